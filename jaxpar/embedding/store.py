"""The full embedding table and its optimizer state, in host memory.

One concatenated table for every feature (``num_rows`` is the sum of all tables' rows;
callers add each feature's row offset to its ids), as Colossal-AI's
``CachedEmbeddingBag`` and FBGEMM's table-batched embeddings keep it: one id space means
one cache, one map and one eviction order shared by all features, so hot rows of any
table compete for the same device memory. Plain numpy arrays: the device cache reads
rows from here by id (``gather``) and writes evicted rows back (``write``). Rows of ids
that are resident in the device cache are stale here until they are written back
(``EmbeddingCache.flush``).
"""

from __future__ import annotations

import numpy as np

from jaxpar.embedding.update import SparseOptimizer


class HostStore:
    """``table [R, D]`` float32 and, for row-wise Adagrad, ``state [R]`` float32."""

    def __init__(self, table: np.ndarray, optimizer: SparseOptimizer, state: np.ndarray | None = None):
        table = np.asarray(table)
        if table.ndim != 2 or table.dtype != np.float32:
            raise ValueError(f"table: expected a [num_rows, dim] float32 array, got {table.dtype}{list(table.shape)}")
        self.table = np.array(table, copy=True)
        self.optimizer = optimizer
        if not optimizer.has_state:
            self.state = None
        elif state is None:
            self.state = np.full(table.shape[0], optimizer.initial_accumulator, np.float32)
        else:
            self.state = np.array(self._checked_state(state), copy=True)

    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    @property
    def dim(self) -> int:
        return self.table.shape[1]

    @property
    def row_bytes(self) -> int:
        """Bytes one row moves between host and device: its values and its state."""
        return 4 * (self.dim + (1 if self.state is not None else 0))

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Copies of the rows (and state) of ``ids``. Safe from the prefetch thread while
        the main thread writes other rows: numpy's fancy indexing touches only these."""
        rows = self.table[ids]
        return rows, (self.state[ids] if self.state is not None else None)

    def write(self, ids: np.ndarray, rows: np.ndarray, state: np.ndarray | None) -> None:
        self.table[ids] = rows
        if self.state is not None:
            self.state[ids] = state

    def load(self, table: np.ndarray, state: np.ndarray | None) -> None:
        """Replace the contents in place (shapes must match; the cache keeps its maps)."""
        table = np.asarray(table)
        if table.shape != self.table.shape:
            raise ValueError(f"load: table shape {table.shape}, expected {self.table.shape}")
        self.table[...] = table
        if self.state is not None:
            if state is None:
                raise ValueError(f"load: optimizer {self.optimizer.kind!r} needs its state, got None")
            self.state[...] = self._checked_state(state)

    def _checked_state(self, state) -> np.ndarray:
        state = np.asarray(state, np.float32)
        if state.shape != (self.num_rows,):
            raise ValueError(f"optimizer state shape {state.shape}, expected ({self.num_rows},)")
        return state


class RemoteStore:
    """A shard's host table that another process holds (a ``ShardedCache`` over several
    processes): this process keeps the shard's cache maps, which every process computes
    alike, but none of its rows. ``gather`` gives zero rows of the right shape (never
    sent anywhere: the swap program takes each device's rows from its own process),
    ``write`` and ``load`` do nothing."""

    table = state = None

    def __init__(self, num_rows: int, dim: int, optimizer: SparseOptimizer):
        self.num_rows, self.dim, self.optimizer = num_rows, dim, optimizer

    @property
    def row_bytes(self) -> int:
        return 4 * (self.dim + (1 if self.optimizer.has_state else 0))

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        rows = np.zeros((len(ids), self.dim), np.float32)
        return rows, (np.zeros(len(ids), np.float32) if self.optimizer.has_state else None)

    def write(self, ids: np.ndarray, rows, state) -> None:
        pass

    def load(self, table, state) -> None:
        pass
