"""A job's model: how fast it trains on ``devices`` devices at global batch ``batch``.

Two parts, as Pollux (Qiao et al., OSDI'21) splits them:

* ``throughput(devices, batch)``: samples per second. ``SpeedModel`` is Pollux's shape
  of it: a step takes the compute of ``batch / devices`` samples per device plus a
  synchronisation that grows with the device count,
  ``t(d, b) = alpha + beta * b / d + gamma * (d - 1) / d * [d > 1]``, and
  ``throughput = b / t``. Its three numbers come from the planner's cost model for a
  config (``jaxpar.cluster.jobs.job_speed``, JOBS.yaml's ``speed: plan``) or a
  least-squares fit to measured points (``SpeedModel.fit``); ``jaxpar-cluster run``
  refits each job's model to its measured step times as it runs (``SpeedModel.refit``).
* ``efficiency(batch)``: samples at batch ``batch`` are worth
  ``(noise + base) / (noise + batch)`` samples at the job's ``base`` batch (McCandlish
  et al.'s gradient noise scale ``noise``, as Pollux's statistical efficiency): a batch
  well below the noise scale loses nothing, one far above it wastes most samples.

``goodput = throughput * efficiency``: base-batch-equivalent samples per second, the
rate at which a job's progress (and its target, in samples at its base batch)
advances. A job whose noise scale is unknown (``noise=None``) has efficiency 1 at its
base batch and may not change it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SpeedModel:
    """Seconds per step ``alpha + beta * batch / devices + gamma * (devices - 1) / devices``."""

    alpha: float  # fixed cost per step (s)
    beta: float  # compute per sample on one device (s)
    gamma: float  # the synchronisation's cost at many devices (s); 0 on one device

    def step_time(self, devices: int, batch: int) -> float:
        sync = self.gamma * (devices - 1) / devices if devices > 1 else 0.0
        return self.alpha + self.beta * batch / devices + sync

    def throughput(self, devices: int, batch: int) -> float:
        """Samples per second."""
        return batch / self.step_time(devices, batch)

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, float]]) -> SpeedModel:
        """Least squares (non-negative) over ``(devices, batch, step seconds)`` points."""
        from scipy.optimize import nnls

        a = np.array([[1.0, b / d, (d - 1) / d if d > 1 else 0.0] for d, b, _ in points])
        t = np.array([s for _, _, s in points])
        (alpha, beta, gamma), _ = nnls(a, t)
        return cls(float(alpha), float(beta), float(gamma))

    def refit(self, measured: Sequence[tuple[int, int, float]]) -> SpeedModel:
        """This model (a prior: the planner's or a guess) corrected by ``measured``
        ``(devices, batch, step seconds)`` points, as Pollux refits a job's model while it
        runs: the least-squares fit once they hold three distinct ``(devices, batch)``
        pairs over at least two device counts (what the three numbers need), before that
        this model scaled by the measured-over-predicted ratio (their geometric mean),
        which then predicts a single point exactly."""
        if not measured:
            return self
        pairs = {(d, b) for d, b, _ in measured}
        if len(pairs) >= 3 and len({d for d, _ in pairs}) >= 2:
            return SpeedModel.fit(measured)
        ratio = float(np.exp(np.mean([np.log(s / self.step_time(d, b)) for d, b, s in measured])))
        return SpeedModel(self.alpha * ratio, self.beta * ratio, self.gamma * ratio)


@dataclasses.dataclass(frozen=True)
class JobModel:
    """A job's speed, its base batch, the batch range it may run, and its noise scale."""

    speed: SpeedModel
    base_batch: int
    min_batch: int | None = None  # None: the base batch
    max_batch: int | None = None  # None: the base batch
    noise: float | None = None  # the gradient noise scale B_simple, in samples

    def __post_init__(self):
        lo, hi = self.batch_range
        if not 0 < lo <= self.base_batch <= hi:
            raise ValueError(f"batch range [{lo}, {hi}] must hold the base batch {self.base_batch}")

    @property
    def batch_range(self) -> tuple[int, int]:
        return (self.min_batch or self.base_batch, self.max_batch or self.base_batch)

    def efficiency(self, batch: int) -> float:
        if self.noise is None:
            return 1.0 if batch == self.base_batch else 0.0
        return (self.noise + self.base_batch) / (self.noise + batch)

    def throughput(self, devices: int, batch: int) -> float:
        return self.speed.throughput(devices, batch)

    def goodput(self, devices: int, batch: int) -> float:
        """Base-batch-equivalent samples per second (0 without devices)."""
        return 0.0 if devices < 1 else self.throughput(devices, batch) * self.efficiency(batch)

    def best_batch(self, devices: int) -> int:
        """The batch in range (a multiple of ``devices`` where one is) with the most goodput."""
        lo, hi = self.batch_range
        candidates = {b for b in range(max(lo, devices), hi + 1, max(devices, 1))} | {lo, hi, self.base_batch}
        candidates = [b for b in candidates if lo <= b <= hi]
        return max(sorted(candidates), key=lambda b: self.goodput(devices, b))
