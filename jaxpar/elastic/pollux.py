"""Pollux's goodput scheduler (Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for
Goodput-Optimized Deep Learning", OSDI'21), on device counts.

Each round every job ``j`` gets ``d_j`` devices (0, or between its minimum and maximum)
and the batch ``JobModel.best_batch(d_j)`` that maximises its goodput there. Pollux's
fitness of an allocation is the generalised (power) mean of the jobs' speedups,

    FITNESS_p = (1/J * sum_j SPEEDUP_j ** p) ** (1/p),   p = -1 by default,

with ``SPEEDUP_j = goodput_j(d_j, best) / goodput_j(fair, best)``, ``fair`` the job's
equal share ``ceil(devices / J)`` (at least its minimum, at most its maximum), as in the
OSDI'21 artifact's simulator. As there, ``1e-3`` is added to every speedup, so with
``p < 0`` a job left waiting costs the fitness much more than a job run slowly: Pollux
runs as many jobs as fit before it widens any.

Restart penalty (the artifact's, paper section 4.2): a running job whose devices or
batch change has its speedup multiplied by ``max(age - restarts * delay, 0) / (age + delay)``,
``age`` the time since it arrived, ``restarts`` how often this scheduler has resized or
preempted it so far and ``delay`` its ``restart_s``. A waiting job pays nothing extra
for starting (any start costs the same restart).

Search: Pollux searches allocations with a genetic algorithm (NSGA-II in the artifact)
because it also places replicas on nodes. Here an allocation is one device count per
job, and the power mean is a monotone function of a sum of per-job terms
(``sum_j u(s_j)`` with ``u(s) = (s + eps) ** p / p``, or ``log`` at ``p = 0``), so the
best allocation is found *exactly* by a knapsack dynamic programme over (job, devices
used): O(J * D^2) per round, deterministic, no seed. Ties (jobs that no device count
separates, as when there are more jobs than devices) go to the job with the least
attained service, then the earliest arrival (the artifact's job order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxpar.elastic.goodput_table import fair_devices, goodput_table
from jaxpar.elastic.scheduler import Allocation, JobView

EPS = 1e-3  # added to every speedup, as the artifact does
TIE = 1e-7  # the tie-break's weight, far below any real difference in utility


def utility(speedup: np.ndarray, p: float) -> np.ndarray:
    """A per-job term whose sum orders allocations as the power mean of speedups does."""
    s = np.asarray(speedup, dtype=float) + EPS
    return np.log(s) if p == 0 else s**p / p


def knapsack(values: np.ndarray) -> list[int]:
    """Device counts maximising ``sum_j values[j, d_j]`` with ``sum_j d_j <= D``.

    ``values`` is ``[J, D + 1]``, ``-inf`` where a count is not allowed (``d = 0`` must be).
    """
    jobs, width = values.shape
    used = np.arange(width)[:, None] - np.arange(width)[None, :]  # [U, d]: devices before job
    valid = used >= 0
    best = np.full(width, -np.inf)
    best[0] = 0.0
    choice = np.zeros((jobs, width), dtype=np.int64)
    for j in range(jobs):
        total = np.where(valid, best[np.clip(used, 0, None)] + values[j][None, :], -np.inf)
        choice[j] = np.argmax(total, axis=1)
        best = total[np.arange(width), choice[j]]
    u = int(np.argmax(best))
    counts = [0] * jobs
    for j in reversed(range(jobs)):
        counts[j] = int(choice[j, u])
        u -= counts[j]
    return counts


@dataclasses.dataclass
class Pollux:
    """The goodput-optimising scheduler; ``p`` is the power mean's exponent (-1: Pollux's)."""

    p: float = -1.0
    name: str = "pollux"
    restarts: dict[str, int] = dataclasses.field(default_factory=dict)

    def penalty(self, now_s: float, job: JobView) -> float:
        """What a resize of running ``job`` multiplies its speedup by (the artifact's rule)."""
        age = max(now_s - job.arrival_s, 0.0)
        delay = job.restart_s
        return max(age - self.restarts.get(job.id, 0) * delay, 0.0) / (age + delay) if age + delay > 0 else 0.0

    def values(self, now_s: float, jobs: Sequence[JobView], devices: int) -> np.ndarray:
        """``[J, D + 1]``: each job's utility at each device count (``-inf``: not allowed)."""
        values = np.full((len(jobs), devices + 1), -np.inf)
        order = sorted(range(len(jobs)), key=lambda i: (jobs[i].attained_service_s, jobs[i].arrival_s, jobs[i].id))
        for rank, i in enumerate(order):
            job = jobs[i]
            table = goodput_table(job.model, devices, job.batch)
            best = table.goodput[np.arange(devices + 1), table.best]  # [D + 1]
            high = min(job.max_devices or devices, devices)
            fair = best[fair_devices(devices, len(jobs), job.min_devices, high)]
            speedup = best / fair if fair > 0 else np.zeros(devices + 1)
            if job.devices:
                kept = np.zeros(devices + 1)
                if job.devices <= devices and fair > 0:
                    kept[job.devices] = table.goodput[job.devices, table.index(current_batch(job))] / fair
                speedup = np.maximum(speedup * self.penalty(now_s, job), kept)
            allowed = np.zeros(devices + 1, dtype=bool)
            allowed[0] = True
            allowed[job.min_devices: min(job.max_devices or devices, devices) + 1] = True
            tie = TIE * (len(jobs) - rank) / len(jobs)
            values[i] = np.where(allowed, utility(speedup, self.p) + tie * (np.arange(devices + 1) > 0), -np.inf)
        return values

    def decide(self, now_s: float, jobs: Sequence[JobView], devices: int) -> Mapping[str, Allocation]:
        if not jobs:
            return {}
        counts = knapsack(self.values(now_s, jobs, devices))
        decision = {}
        for job, d in zip(jobs, counts):
            batch = self.batch(now_s, job, d, devices) if d else 0
            if job.devices and (d, batch) != (job.devices, current_batch(job)):
                self.restarts[job.id] = self.restarts.get(job.id, 0) + 1
            if d:
                decision[job.id] = Allocation(d, batch)
        return decision

    def batch(self, now_s: float, job: JobView, d: int, devices: int) -> int:
        """The best batch at ``d``, or the current one where keeping it (no restart) scored higher."""
        best = job.model.best_batch(d)
        if d != job.devices or current_batch(job) == best:
            return best
        table = goodput_table(job.model, devices, job.batch)
        kept = table.goodput[d, table.index(current_batch(job))]
        return current_batch(job) if kept >= table.goodput[d, table.index(best)] * self.penalty(now_s, job) else best


def current_batch(job: JobView) -> int:
    return job.batch or job.model.base_batch
