"""Gathering the coming batches' missing rows on a host thread.

While the device runs step ``t``, one worker thread copies the host rows (and optimizer
state) of the ids that batches ``t+1 .. t+k`` need and the cache does not hold into a
staging buffer; ``prepare`` for step ``t+1`` then takes its misses from there and only
scatters them. Colossal-AI's cache and TorchRec's ``prefetch_pipeline`` do the same
job; TorchRec's leaks memory each step (FBGEMM#6120), so this one is bounded by
construction: at most one job in flight, and one staging buffer that each job replaces,
holding at most the union of the upcoming batches' ids.

Correctness does not depend on timing: a staged row is only ever used for an id that
was not resident from the moment it was staged until it is used, and the host copy of
such a row cannot change in between (the cache writes back only rows it holds, and
``load``/``warmup`` drop the staging first), so a staged row is bit-identical to what a
synchronous gather would read. ``take`` waits for the job to finish.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from jaxpar.embedding.store import HostStore


def lookup(sorted_ids: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(found, pos)``: which of ``ids`` are in ``sorted_ids``, and where."""
    pos = np.searchsorted(sorted_ids, ids)
    pos = np.minimum(pos, max(len(sorted_ids) - 1, 0))
    found = (sorted_ids[pos] == ids) if len(sorted_ids) else np.zeros(len(ids), bool)
    return found, pos


class Prefetcher:
    """One worker thread and one staging buffer ``(ids, rows, state)``, ids sorted."""

    def __init__(self, store: HostStore):
        self._store = store
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxpar-embedding-prefetch")
        self._job: Future | None = None
        self._staged = self._empty()

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet taken: 0 or 1."""
        return int(self._job is not None)

    @property
    def staged_rows(self) -> int:
        """Rows in the staging buffer (after the job in flight, if any, finishes)."""
        return len(self._wait()[0])

    def submit(self, ids: np.ndarray) -> None:
        """Stage the rows of ``ids`` (sorted, unique, none of them resident in the cache),
        keeping the rows already staged for them."""
        old = self._wait()
        self._job = self._executor.submit(self._stage, ids, old) if len(ids) else None
        if self._job is None:
            self._staged = self._empty()

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(found, rows, state)``: which of ``ids`` are staged, and their rows."""
        staged_ids, rows, state = self._wait()
        found, pos = lookup(staged_ids, ids)
        pos = pos[found]
        return found, rows[pos], (state[pos] if state is not None else None)

    def drop(self) -> None:
        """Forget the staging (after the host table changed other than by write-back)."""
        self._wait()
        self._staged = self._empty()

    def close(self) -> None:
        self.drop()
        self._executor.shutdown(wait=True)

    def _wait(self):
        if self._job is not None:
            job, self._job = self._job, None
            self._staged = job.result()
        return self._staged

    def _stage(self, ids: np.ndarray, old):
        old_ids, old_rows, old_state = old
        found, pos = lookup(old_ids, ids)
        rows = np.empty((len(ids), self._store.dim), np.float32)
        rows[found] = old_rows[pos[found]]
        fresh_rows, fresh_state = self._store.gather(ids[~found])
        rows[~found] = fresh_rows
        state = None
        if fresh_state is not None:
            state = np.empty(len(ids), np.float32)
            state[found] = old_state[pos[found]]
            state[~found] = fresh_state
        return ids, rows, state

    def _empty(self):
        has_state = self._store.state is not None
        return (np.zeros(0, np.int64), np.zeros((0, self._store.dim), np.float32),
                np.zeros(0, np.float32) if has_state else None)
