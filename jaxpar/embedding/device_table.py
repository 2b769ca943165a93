"""The whole table on the device(s), behind the cache's interface.

``DeviceTable`` is what ``embedding.cache_ratio=null`` trains with: no host copy, no
eviction; a row's slot is its id. The table is one array on ``device`` (replicated over
a mesh when ``device`` is a replicated sharding), or, with a ``ShardingPlan``, split
row-wise or table-wise over a mesh axis (``jaxpar.embedding.sharded``: lookups and
updates by all-to-all). It answers the calls a trainer makes of an ``EmbeddingCache``
(``prepare``, ``arrays``, ``lookup``, ``update``, ``rows_of``, ``table``,
``optimizer_state``, ``load``, ``last_step``, ``close``), so one train step and one loop
serve all of them, and the cache can be checked against it (the same rows, the same
sparse update: ``jaxpar.embedding.update``). Over several processes a split table's
reads (``rows_of``, ``table``) gather the whole table from every process: it fits on
the devices, so it fits on a host.
"""

from __future__ import annotations

import functools

import numpy as np

from jaxpar.embedding.sharded import ShardingPlan, shard_arrays, sharded_lookup, sharded_update, unshard_arrays
from jaxpar.embedding.stats import CacheStats
from jaxpar.embedding.transfer import host_value, place
from jaxpar.embedding.update import CacheArrays, SparseOptimizer, lookup, sparse_update


class DeviceTable:
    """``table [num_rows, dim]`` (and its optimizer state) on ``device`` (a Device or a
    Sharding; None: the default device), or split by ``plan`` over ``mesh``'s ``axis``."""

    def __init__(self, table: np.ndarray, *, optimizer: SparseOptimizer = SparseOptimizer(),
                 state: np.ndarray | None = None, device=None, plan: ShardingPlan | None = None, mesh=None,
                 axis: str = "data"):
        table = np.asarray(table, np.float32)
        self.num_rows, self.dim = table.shape
        self.optimizer, self._device = optimizer, device
        self.plan, self._mesh, self._axis = plan, mesh, axis
        if plan is None:
            self.lookup = lookup
            self.update = functools.partial(sparse_update, optimizer=optimizer)
        else:
            where = dict(plan=plan, mesh=mesh, axis=axis)
            self.lookup = functools.partial(sharded_lookup, **where)
            self.update = functools.partial(sharded_update, optimizer=optimizer, **where)
        if optimizer.has_state and state is None:
            state = np.full(self.num_rows, optimizer.initial_accumulator, np.float32)
        self.arrays = self._placed(table, state)
        self.last_step = CacheStats()

    def prepare(self, ids, upcoming=()) -> np.ndarray:
        """Every id is resident: its slot is itself (int32, shaped like ``ids``)."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            bad = ids[(ids < 0) | (ids >= self.num_rows)].flat[0]
            raise ValueError(f"ids: row id {bad} outside [0, num_rows={self.num_rows})")
        hits = len(np.unique(ids))
        self.last_step = CacheStats(hits=hits)
        return ids.astype(np.int32)

    def check_fits(self, ids) -> None:
        """Every row is on the devices: any batch fits."""

    def rows_of(self, ids):
        """The current rows of ``ids`` (any shape) ``[..., dim]``."""
        if self.plan is None:
            return self.arrays.rows[np.asarray(ids)]
        return host_value(self.arrays.rows)[self.plan.positions(np.asarray(ids))]

    def table(self) -> np.ndarray:
        return self._unplaced()[0]

    def optimizer_state(self) -> np.ndarray | None:
        return self._unplaced()[1]

    def _unplaced(self):
        if self.plan is not None:
            return unshard_arrays(self.arrays, plan=self.plan)
        return np.asarray(self.arrays.rows), None if self.arrays.state is None else np.asarray(self.arrays.state)

    def load(self, table: np.ndarray, state: np.ndarray | None = None) -> None:
        table = np.asarray(table, np.float32)
        if table.shape != (self.num_rows, self.dim):
            raise ValueError(f"load: table shape {table.shape}, expected {(self.num_rows, self.dim)}")
        if self.optimizer.has_state and state is None:
            raise ValueError(f"load: optimizer {self.optimizer.kind!r} needs its state, got None")
        self.arrays = self._placed(table, state if self.optimizer.has_state else None)

    def close(self) -> None:
        pass

    def _placed(self, table, state) -> CacheArrays:
        if self.plan is not None:
            return shard_arrays(table, state, plan=self.plan, mesh=self._mesh, axis=self._axis)
        return CacheArrays(place(table, self._device),
                           None if state is None else place(np.asarray(state, np.float32), self._device))
