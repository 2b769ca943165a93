"""The gradient noise scale of a run (``eval.noise_scale``): McCandlish et al. (2018,
"An Empirical Model of Large-Batch Training", appendix A.1) estimated from two batch
sizes within each step, what Pollux's and ONES' statistical-efficiency models read.

The step (``make_train_step(..., noise_scale=True)``) returns ``grad_sq_small``, the
mean over the ``n`` data replicas of each one's gradient's squared norm (batch
``b_small = B / n``), and ``grad_sq_big``, the whole batch's (``b_big = B``). Since
``E|G_b|^2 = |G|^2 + tr(Sigma) / b``, the two give unbiased estimates

    |G|^2 ~ (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)
    S     ~ (|G_small|^2 - |G_big|^2) / (1 / b_small - 1 / b_big)

and ``B_simple = S / |G|^2``, in sequences (the batch's unit). One step's ratio is
noisy (``|G|^2`` may come out negative), so, as the paper advises, each of ``|G|^2``
and ``S`` is smoothed apart, by an exponential moving average with decay ``DECAY``
(the same zero start in both, so Adam's bias correction cancels in the ratio), and the
logged ``noise_scale`` is their ratio. The averages are not checkpointed: a resumed run
starts them again (``optimizer.batch_scaling=adascale`` keeps its own in the optimizer's
state, ``jaxpar.elastic.adascale``, which also logs ``adascale_gain``). With one data
replica there is one batch size, and no estimate.
"""

from __future__ import annotations

import dataclasses
import logging

from jaxpar.elastic.adascale import simple_estimates
from jaxpar.train.config import Config
from jaxpar.train.trainer import Hook, StepInfo

log = logging.getLogger(__name__)

DECAY = 0.9  # about ten steps' memory


@dataclasses.dataclass
class Smoothed:
    """Exponential moving averages of ``|G|^2`` and ``S`` from zero; ``update`` gives their ratio."""

    decay: float = DECAY
    g2: float = 0.0
    trace: float = 0.0
    count: int = 0

    def update(self, g2: float, trace: float) -> float:
        """Adds one step's estimates; returns the smoothed ``B_simple = S / |G|^2``."""
        self.count += 1
        self.g2 = self.decay * self.g2 + (1 - self.decay) * g2
        self.trace = self.decay * self.trace + (1 - self.decay) * trace
        return self.trace / self.g2 if self.g2 else float("nan")  # the bias corrections cancel


def replicas_of(mesh) -> int:
    return mesh.shape.get("data", 1)


def enabled(cfg: Config, mesh) -> bool:
    """Whether the step should return the norms: ``eval.noise_scale``, and more than one
    data replica (else one log line says why not). What it does not compose with is
    refused when the config is read (``jaxpar.train.combinations``)."""
    if not cfg.eval.noise_scale:
        return False
    if replicas_of(mesh) < 2:
        log.warning("eval.noise_scale: one data replica (mesh.data=1) gives one batch size per step; the "
                    "noise scale needs two, so it is not estimated")
        return False
    return True


def hook(batch_size: int) -> Hook:
    """A ``Trainer`` hook adding ``noise_scale`` (smoothed ``B_simple``, in sequences) to
    each step's record, from the step's ``grad_sq_small``, ``grad_sq_big`` and the
    small batch ``batch_small`` it measured them at."""
    smoothed = Smoothed()

    def add(info: StepInfo) -> None:
        record = info.record
        g2, trace = simple_estimates(record["grad_sq_small"], record["grad_sq_big"], record["batch_small"],
                                     batch_size)
        record["noise_scale"] = smoothed.update(g2, trace)

    return add
