"""Pollux and ONES (jaxpar.elastic.{pollux,ones}) against searches written here: Pollux's
exact search against an exhaustive one, ONES' evolutionary search against the best of
1,000 random allocations, both inside the cluster and each job's bounds, both giving the
devices to the job that scales."""

import itertools
import math

import numpy as np
import pytest

from jaxpar.elastic.jobs import JobModel, SpeedModel
from jaxpar.elastic.ones import Ones, score
from jaxpar.elastic.pollux import Pollux
from jaxpar.elastic.scheduler import Allocation, JobView, check


def job(i, gamma=0.02, noise=512.0, remaining=1e6, devices=0, batch=None, min_devices=1, **kw):
    model = JobModel(SpeedModel(0.01, 0.002, gamma), base_batch=32, min_batch=16, max_batch=512, noise=noise)
    return JobView(f"j{i}", arrival_s=10.0 * i, model=model, target=remaining + 1000.0, progress=1000.0,
                   requested_devices=2, min_devices=min_devices, devices=devices, batch=batch,
                   attained_service_s=100.0 * i, **kw)


def small_case():
    """4 jobs on 8 devices: two running (one of them at its minimum 2), varied scaling."""
    return [
        job(0, gamma=0.001, remaining=2e5, devices=4, batch=64),
        job(1, gamma=0.05, noise=64.0, remaining=5e5, devices=2, batch=32, min_devices=2),
        job(2, gamma=0.01, noise=2048.0, remaining=1e5),
        job(3, gamma=0.2, noise=None, remaining=3e5, min_devices=2),
    ]


def random_case(rng, n_jobs, running_devices=8):
    jobs = []
    for i in range(n_jobs):
        d = int(rng.integers(0, 3)) if sum(j.devices for j in jobs) + 2 <= running_devices else 0
        jobs.append(job(i, gamma=float(rng.choice([0.001, 0.02, 0.3])), noise=float(rng.choice([64.0, 1024.0])),
                        remaining=float(rng.uniform(1e4, 1e6)), devices=d, batch=32 if d else None,
                        min_devices=int(rng.integers(1, 3))))
    return jobs


def batch_choices(model, d):
    """The batches ``JobModel.best_batch`` chooses among: multiples of ``d`` in range, its ends and base."""
    lo, hi = model.batch_range
    return sorted({b for b in range(max(lo, d), hi + 1, d)} | {lo, hi, model.base_batch})


def random_allocation(rng, jobs, devices):
    """A valid allocation: jobs in random order take 0 or an allowed count of what is left."""
    decision, free = {}, devices
    for i in rng.permutation(len(jobs)):
        j = jobs[i]
        top = min(j.max_devices or devices, free)
        if top < j.min_devices or rng.random() < 0.25:
            continue
        d = int(rng.integers(j.min_devices, top + 1))
        decision[j.id] = Allocation(d, int(rng.choice(batch_choices(j.model, d))))
        free -= d
    return decision


def test_ones_is_deterministic_for_a_seed():
    jobs = small_case()
    a, b = Ones(seed=7), Ones(seed=7)
    for now in (100.0, 160.0):  # the second round starts from the first's population
        assert a.decide(now, jobs, 8) == b.decide(now, jobs, 8)
        assert len(a.previous) == a.population and set(a.previous[0]) == {j.id for j in jobs}
    later = jobs[1:] + [job(9, remaining=5e4)]  # one job finished, one arrived
    assert a.decide(220.0, later, 8) == b.decide(220.0, later, 8)
    assert set(a.previous[0]) == {j.id for j in later}


def test_ones_beats_1000_random_allocations():
    jobs = small_case()
    decision = Ones(seed=0).decide(100.0, jobs, 8)
    check(decision, jobs, 8)
    rng = np.random.default_rng(0)
    best_random = max(score(jobs, random_allocation(rng, jobs, 8), 8) for _ in range(1000))
    assert score(jobs, decision, 8) >= best_random - 1e-12


def pollux_fitness(now, jobs, devices, counts, restarts=0, p=-1.0):
    """Pollux's power mean of speedups, written from the paper's formula."""
    terms = []
    for j, d in zip(jobs, counts):
        fair = max(min(math.ceil(devices / len(jobs)), devices), j.min_devices)
        base = j.model.goodput(fair, j.model.best_batch(fair))
        s = j.model.goodput(d, j.model.best_batch(d)) / base if d else 0.0
        if j.devices:
            kept = j.model.goodput(d, j.batch) / base if d == j.devices else 0.0
            age = now - j.arrival_s
            s = max(s * max(age - restarts * j.restart_s, 0.0) / (age + j.restart_s), kept)
        terms.append((s + 1e-3) ** p)
    return (sum(terms) / len(terms)) ** (1 / p)


def test_pollux_equals_exhaustive_search():
    jobs, devices, now = small_case(), 8, 100.0
    decision = Pollux().decide(now, jobs, devices)
    check(decision, jobs, devices)
    ours = pollux_fitness(now, jobs, devices, [decision[j.id].devices if j.id in decision else 0 for j in jobs])
    best = max(
        pollux_fitness(now, jobs, devices, counts)
        for counts in itertools.product(range(devices + 1), repeat=len(jobs))
        if sum(counts) <= devices and all(c == 0 or c >= j.min_devices for c, j in zip(counts, jobs))
    )
    assert ours == pytest.approx(best, rel=1e-9)
    for j in jobs:  # each job runs its goodput-best batch, or keeps its own without resizing
        if j.id in decision:
            a = decision[j.id]
            assert a.batch in (j.model.best_batch(a.devices), j.batch if a.devices == j.devices else None)


@pytest.mark.parametrize("make", [Pollux, lambda: Ones(seed=1, generations=10)], ids=["pollux", "ones"])
@pytest.mark.parametrize("n_jobs", [3, 6, 14])
def test_allocations_stay_within_cluster_and_minimums(make, n_jobs):
    rng = np.random.default_rng(n_jobs)
    scheduler = make()
    for now in (60.0, 120.0, 180.0):
        jobs = random_case(rng, n_jobs)
        decision = scheduler.decide(now, jobs, 8)
        check(decision, jobs, 8)
        assert sum(a.devices for a in decision.values()) <= 8
        by_id = {j.id: j for j in jobs}
        for job_id, a in decision.items():
            assert by_id[job_id].min_devices <= a.devices <= 8
            lo, hi = by_id[job_id].model.batch_range
            assert lo <= a.batch <= hi


@pytest.mark.parametrize("make", [Pollux, lambda: Ones(seed=1, generations=10)], ids=["pollux", "ones"])
def test_a_job_whose_minimum_exceeds_the_cluster_waits(make):
    jobs = [job(0, min_devices=16), job(1, min_devices=3)]
    decision = make().decide(0.0, jobs, 8)
    check(decision, jobs, 8)
    assert "j0" not in decision and decision["j1"].devices >= 3


@pytest.mark.parametrize("make", [Pollux, lambda: Ones(seed=2)], ids=["pollux", "ones"])
def test_the_job_that_scales_gets_more_devices(make):
    """Same work left, same noise scale; one job's synchronisation costs 100 times more."""
    scales, stalls = job(0, gamma=0.001, remaining=4e5), job(1, gamma=0.1, remaining=4e5)
    decision = make().decide(0.0, [scales, stalls], 8)
    assert decision["j0"].devices > decision.get("j1", Allocation(0, 0)).devices


def test_ones_vectorised_fitness_matches_the_job_model():
    from jaxpar.elastic.ones import Problem

    jobs = small_case()
    problem = Problem.build(jobs, 8)
    decision = Ones(seed=3).decide(100.0, jobs, 8)
    d = np.array([decision[j.id].devices if j.id in decision else 0 for j in jobs])
    k = np.array([
        int(np.searchsorted(problem.batches[i, : problem.count[i]], decision[j.id].batch)) if j.id in decision else 0
        for i, j in enumerate(jobs)
    ])
    assert float(problem.fitness(d, k)) == pytest.approx(score(jobs, decision, 8), rel=1e-12)
