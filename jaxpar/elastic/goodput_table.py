"""A job's goodput at every device count and candidate batch, as one array (for searches).

Pollux and ONES score thousands of candidate allocations per round; calling
``JobModel.goodput`` for each would dominate a simulation. ``goodput_table`` evaluates it
once per ``(model, cluster size, current batch)`` through ``JobModel`` itself (the one
definition of goodput) and caches the result: models are frozen, so a job's table is
built once per simulation unless its batch changes to a value outside its candidates.

Candidate batches, per job: the ends of its range, its base batch, its current batch,
and ``JobModel.best_batch(d)`` for every device count ``d`` (Pollux's choice). A search
then picks an index into ``batches`` instead of a free integer. ``fair_devices`` is the
fair share both schedulers measure speedups against.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jaxpar.elastic.jobs import JobModel


@dataclasses.dataclass(frozen=True)
class GoodputTable:
    batches: np.ndarray  # [K] candidate global batches, ascending
    goodput: np.ndarray  # [D + 1, K] base-batch samples per second; row 0 is zeros
    best: np.ndarray  # [D + 1] index into ``batches`` of ``best_batch(d)`` (row 0: the base batch)

    def index(self, batch: int) -> int:
        return int(np.searchsorted(self.batches, batch))


@functools.lru_cache(maxsize=8192)
def goodput_table(model: JobModel, devices: int, current_batch: int | None = None) -> GoodputTable:
    """The table for a cluster of ``devices``; ``current_batch`` joins the candidates."""
    best = [model.base_batch] + [model.best_batch(d) for d in range(1, devices + 1)]
    lo, hi = model.batch_range
    extra = {current_batch} if current_batch is not None else set()
    batches = np.array(sorted(set(best) | {lo, hi, model.base_batch} | extra), dtype=np.int64)
    goodput = np.zeros((devices + 1, len(batches)))
    for d in range(1, devices + 1):
        goodput[d] = [model.goodput(d, int(b)) for b in batches]
    best_index = np.searchsorted(batches, np.array(best))
    return GoodputTable(batches, goodput, best_index)


def fair_devices(devices: int, jobs: int, low: int, high: int) -> int:
    """A job's fair share of ``devices`` among ``jobs`` (Pollux's ``ceil(D / J)``), within its
    bounds ``[low, high]`` (``high`` where ``low`` exceeds it: the share only normalises)."""
    return max(min(math.ceil(devices / max(jobs, 1)), high), min(low, high), 1)
