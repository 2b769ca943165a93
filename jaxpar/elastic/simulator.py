"""A discrete-event simulation of a cluster running a job trace under a scheduler.

SimPy (a well-kept discrete-event library) keeps the clock and the event queue; three
kinds of process drive it: the trace's arrivals, a ticker every ``round_s``, and one
completion timer per running job's current allocation. A scheduling round runs at every
arrival, every completion and every tick: it hands the scheduler a ``JobView`` of every
arrived, unfinished job, checks the decision (``scheduler.check``: never more devices
than the cluster, never fewer than a job's minimum) and applies it.

Rules, as the scheduler interface states them: a job whose devices or batch change,
starting from waiting included, holds its new devices for ``restart_s`` without
progressing (stop at a checkpoint, start on the new mesh); being preempted costs nothing
then (the save is in the next start's cost). A running job progresses at
``model.goodput(devices, batch)`` base-batch samples per second and finishes when its
progress reaches its target. Attained service (Tiresias') counts device-seconds held,
restarts included.

``round_s`` defaults to 60 s, as Pollux's simulator re-optimises each minute: often
enough that a job's growing attained service and age move the schedulers that read
them, far apart compared with the 30 s restart that resizing costs. Nothing here is
random: a run is deterministic for a trace and a scheduler (whose own seed decides
its choices).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np
import simpy

from jaxpar.elastic.scheduler import Allocation, JobView, Scheduler, check
from jaxpar.elastic.traces import Job, check_fits

STALL_ROUNDS = 1000  # rounds in a row with work waiting and nothing progressing: an error


class SimulationError(RuntimeError):
    """A scheduler that breaks the rules, or leaves the cluster stalled."""


@dataclasses.dataclass(frozen=True)
class Round:
    """One scheduling round: its time and every job's allocation (waiting jobs left out)."""

    time_s: float
    allocations: dict[str, Allocation]


@dataclasses.dataclass(frozen=True)
class Result:
    jct_s: dict[str, float]  # completion - arrival, by job id, in trace order
    makespan_s: float  # the last completion - the first arrival
    rounds: list[Round]

    @property
    def avg_jct_s(self) -> float:
        return float(np.mean(list(self.jct_s.values()))) if self.jct_s else 0.0

    @property
    def p99_jct_s(self) -> float:
        return float(np.percentile(list(self.jct_s.values()), 99)) if self.jct_s else 0.0

    def summary(self) -> dict:
        """What ``jaxpar-cluster simulate --json`` prints."""
        return {"avg_jct_s": self.avg_jct_s, "p99_jct_s": self.p99_jct_s, "makespan_s": self.makespan_s,
                "jobs": [{"id": job_id, "jct_s": jct} for job_id, jct in self.jct_s.items()]}


@dataclasses.dataclass
class _State:
    """A job's mutable state in the simulation."""

    job: Job
    progress: float = 0.0
    devices: int = 0
    batch: int | None = None
    attained_s: float = 0.0
    since: float = 0.0  # progress and service are counted up to here
    ready_at: float = 0.0  # the current restart ends
    epoch: int = 0  # bumped at every allocation change: older completion timers are stale

    def account(self, now: float) -> None:
        if self.devices:
            self.attained_s += self.devices * (now - self.since)
            running = max(now - max(self.since, self.ready_at), 0.0)
            self.progress = min(self.progress + self.rate * running, self.job.target)
        self.since = now

    @property
    def rate(self) -> float:
        return self.job.model.goodput(self.devices, self.batch) if self.devices else 0.0

    def view(self) -> JobView:
        j = self.job
        return JobView(j.id, j.arrival_s, j.model, j.target, self.progress, j.requested_devices,
                       min_devices=j.min_devices, max_devices=j.max_devices, devices=self.devices,
                       batch=self.batch, attained_service_s=self.attained_s, restart_s=j.restart_s)


class _Simulation:
    def __init__(self, jobs: Sequence[Job], scheduler: Scheduler, devices: int, round_s: float):
        self.env = simpy.Environment()
        self.jobs, self.scheduler, self.devices, self.round_s = list(jobs), scheduler, devices, round_s
        self.active: list[_State] = []
        self.done: dict[str, float] = {}
        self.rounds: list[Round] = []
        self.pending = len(self.jobs)  # not yet arrived
        self.stalled = 0

    def run(self) -> Result:
        self.env.process(self.arrivals())
        self.env.process(self.ticker())
        self.env.run()
        first = min((j.arrival_s for j in self.jobs), default=0.0)
        jct = {j.id: self.done[j.id] - j.arrival_s for j in self.jobs}
        return Result(jct, max(self.done.values(), default=first) - first, self.rounds)

    def arrivals(self):
        for job in sorted(self.jobs, key=lambda j: j.arrival_s):
            yield self.env.timeout(max(job.arrival_s - self.env.now, 0.0))
            self.pending -= 1
            self.active.append(_State(job, since=self.env.now))
            self.round()

    def ticker(self):
        while self.pending or self.active:
            yield self.env.timeout(self.round_s)
            if self.active:
                self.round()

    def finish(self, state: _State, epoch: int, after: float):
        yield self.env.timeout(after)
        if state.epoch != epoch or state not in self.active:
            return  # its allocation changed since
        state.account(self.env.now)
        state.progress = state.job.target
        self.done[state.job.id] = self.env.now
        self.active.remove(state)
        if self.active:
            self.round()

    def round(self) -> None:
        now = self.env.now
        for state in self.active:
            state.account(now)
        views = [s.view() for s in self.active]
        decision = dict(self.scheduler.decide(now, views, self.devices))
        try:
            check(decision, views, self.devices)
        except ValueError as e:
            raise SimulationError(f"{getattr(self.scheduler, 'name', self.scheduler)} at {now:.0f} s: {e}") from None
        decision = {k: a for k, a in decision.items() if a.devices > 0}
        self.rounds.append(Round(now, decision))
        for state in self.active:
            new = decision.get(state.job.id)
            if new is None:
                if state.devices:
                    state.devices, state.epoch = 0, state.epoch + 1
                continue
            if (new.devices, new.batch) == (state.devices, state.batch):
                continue
            state.devices, state.batch, state.epoch = new.devices, new.batch, state.epoch + 1
            state.ready_at = now + state.job.restart_s
            if state.rate > 0:
                after = state.job.restart_s + (state.job.target - state.progress) / state.rate
                self.env.process(self.finish(state, state.epoch, after))
        progressing = any(s.rate > 0 for s in self.active)
        self.stalled = 0 if progressing or self.pending else self.stalled + 1
        if self.stalled >= STALL_ROUNDS:
            raise SimulationError(f"{getattr(self.scheduler, 'name', self.scheduler)} left every job without "
                                  f"progress for {STALL_ROUNDS} rounds (at {now:.0f} s)")


def simulate(jobs: Sequence[Job], scheduler: Scheduler, devices: int, *, round_s: float = 60.0) -> Result:
    """Runs ``jobs`` on a cluster of ``devices`` devices under ``scheduler``.

    Raises ``TraceError`` for a job bigger than the cluster, ``SimulationError`` where the
    scheduler breaks the rules or stalls the cluster.
    """
    if devices < 1:
        raise ValueError(f"a cluster needs at least one device, not {devices}")
    if round_s <= 0:
        raise ValueError(f"round_s must be positive, not {round_s}")
    repeated = sorted(i for i, n in collections.Counter(j.id for j in jobs).items() if n > 1)
    if repeated:
        raise ValueError(f"job ids repeat: {repeated[:5]}")
    check_fits(jobs, devices)
    return _Simulation(jobs, scheduler, devices, round_s).run()
