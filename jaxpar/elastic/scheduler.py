"""The one interface every scheduler implements (FIFO, SRTF, Tiresias, Pollux, ONES).

At each scheduling round the simulator (or the Ray runner) hands the scheduler the time,
the cluster's device count and a ``JobView`` of every job that has arrived and not
finished; the scheduler returns, for every job, an ``Allocation``: its devices (0:
waiting) and global batch size. The caller enforces the rules every scheduler must keep
(tested for all): the devices given never exceed the cluster's, and a job runs on at
least its ``min_devices`` or not at all. A job whose allocation changes devices or batch
pays its ``restart_s`` (stop at a checkpoint, start on the new mesh) before it
progresses again; schedulers that resize weigh that cost themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from jaxpar.elastic.jobs import JobModel


@dataclasses.dataclass(frozen=True)
class JobView:
    """What a scheduler sees of one job at one round."""

    id: str
    arrival_s: float
    model: JobModel
    target: float  # samples at the job's base batch to finish
    progress: float  # of them done
    requested_devices: int  # what the job asked for (FIFO's and SRTF's allocation)
    min_devices: int = 1
    max_devices: int | None = None  # None: the cluster
    devices: int = 0  # now (0: waiting)
    batch: int | None = None  # now (None: never ran; the base batch)
    attained_service_s: float = 0.0  # device-seconds run so far (Tiresias)
    restart_s: float = 30.0  # what one resize costs it

    @property
    def remaining(self) -> float:
        return max(self.target - self.progress, 0.0)


@dataclasses.dataclass(frozen=True)
class Allocation:
    devices: int
    batch: int


class Scheduler(Protocol):
    name: str

    def decide(self, now_s: float, jobs: Sequence[JobView], devices: int) -> Mapping[str, Allocation]:
        """Every job's devices and batch from now on (a job left out waits)."""
        ...


def check(decision: Mapping[str, Allocation], jobs: Sequence[JobView], devices: int) -> None:
    """Raises ``ValueError`` where ``decision`` breaks the rules every scheduler keeps."""
    by_id = {j.id: j for j in jobs}
    unknown = set(decision) - set(by_id)
    if unknown:
        raise ValueError(f"allocations for jobs that are not running or waiting: {sorted(unknown)}")
    used = sum(a.devices for a in decision.values())
    if used > devices:
        raise ValueError(f"allocations use {used} devices of {devices}")
    for job_id, a in decision.items():
        job = by_id[job_id]
        if a.devices and a.devices < job.min_devices:
            raise ValueError(f"job {job_id} given {a.devices} devices, below its minimum {job.min_devices}")
        if a.devices and a.batch < 1:
            raise ValueError(f"job {job_id} given batch {a.batch}")
