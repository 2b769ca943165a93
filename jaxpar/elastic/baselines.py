"""The baseline schedulers (FIFO, SRTF, Tiresias) and ``by_name``, the registry of all.

The baselines never resize: a job runs on exactly the devices it asked for, at its base
batch, or waits. They differ in the order they admit jobs in:

* ``Fifo``: arrival order, no preemption; a running job keeps its devices, and the first
  waiting job that does not fit blocks every job behind it (head-of-line blocking, as
  Philly's scheduler did; Jeon et al., ATC'19).
* ``Srtf``: shortest remaining time first (remaining samples over the goodput on the
  requested devices), with preemption; a job that does not fit is skipped, so smaller
  jobs behind it may run (no reservation).
* ``Tiresias``: two-dimensional least attained service (Gu et al., NSDI'19): a job's
  attained service is devices times time (device-seconds), discretised into priority
  queues; jobs run by queue, then arrival (FIFO within a queue), with preemption and
  skipping as SRTF. One threshold, 18,000 device-seconds (two queues: five GPU-hours),
  as the Helios simulator (Hu et al., SC'21) sets it after Tiresias' own code; Tiresias'
  optional starvation promotion is left out.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence

from jaxpar.elastic.scheduler import Allocation, JobView, Scheduler


def _requested(job: JobView) -> Allocation:
    return Allocation(job.requested_devices, job.model.base_batch)


def _greedy(order: Sequence[JobView], devices: int, *, blocking: bool) -> dict[str, Allocation]:
    """Each job in ``order`` its requested devices while they fit (``blocking``: stop at the
    first that does not, else skip it)."""
    free, decision = devices, {}
    for job in order:
        if job.requested_devices <= free:
            decision[job.id] = _requested(job)
            free -= job.requested_devices
        elif blocking:
            break
    return decision


@dataclasses.dataclass
class Fifo:
    name: str = "fifo"

    def decide(self, now_s: float, jobs: Sequence[JobView], devices: int) -> Mapping[str, Allocation]:
        running = [j for j in jobs if j.devices]
        decision = {j.id: Allocation(j.devices, j.batch or j.model.base_batch) for j in running}
        waiting = sorted((j for j in jobs if not j.devices), key=lambda j: (j.arrival_s, j.id))
        decision.update(_greedy(waiting, devices - sum(j.devices for j in running), blocking=True))
        return decision


@dataclasses.dataclass
class Srtf:
    name: str = "srtf"

    def decide(self, now_s: float, jobs: Sequence[JobView], devices: int) -> Mapping[str, Allocation]:
        def remaining_s(j: JobView) -> float:
            return j.remaining / j.model.goodput(j.requested_devices, j.model.base_batch)

        return _greedy(sorted(jobs, key=lambda j: (remaining_s(j), j.arrival_s, j.id)), devices, blocking=False)


@dataclasses.dataclass
class Tiresias:
    thresholds_s: tuple[float, ...] = (18_000.0,)  # device-seconds between the queues
    name: str = "tiresias"

    def queue(self, job: JobView) -> int:
        return sum(job.attained_service_s >= t for t in self.thresholds_s)

    def decide(self, now_s: float, jobs: Sequence[JobView], devices: int) -> Mapping[str, Allocation]:
        order = sorted(jobs, key=lambda j: (self.queue(j), j.arrival_s, j.id))
        return _greedy(order, devices, blocking=False)


def _lazy(module: str, cls: str) -> Callable[[int], Scheduler]:
    def make(seed: int) -> Scheduler:
        try:
            found = getattr(importlib.import_module(f"jaxpar.elastic.{module}"), cls)
        except (ImportError, AttributeError):
            raise ValueError(f"scheduler {module!r} is not available: "
                             f"jaxpar.elastic.{module}.{cls} is missing") from None
        return found(seed=seed) if "seed" in inspect.signature(found).parameters else found()
    return make


SCHEDULERS: dict[str, Callable[[int], Scheduler]] = {
    "fifo": lambda seed: Fifo(),
    "srtf": lambda seed: Srtf(),
    "tiresias": lambda seed: Tiresias(),
    "pollux": _lazy("pollux", "Pollux"),
    "ones": _lazy("ones", "Ones"),
}


def by_name(name: str, seed: int = 0) -> Scheduler:
    """A new scheduler by name (``seed`` for those that draw random numbers)."""
    if name not in SCHEDULERS:
        raise ValueError(f"no scheduler {name!r}; choose from {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name](seed)
