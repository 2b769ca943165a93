"""Model-parallel tables with a cache on every device: each device caches its own shard.

A ``ShardingPlan`` splits the table over a mesh axis (``jaxpar.embedding.sharded``);
``ShardedCache`` keeps one ``EmbeddingCache`` per device over that device's shard (its
rows and their optimizer state in host memory, ``cache_rows`` of them on the device).
Before a step the host sends each of the batch's ids to its owner's cache, which makes
the row resident and answers with a slot; the id becomes ``owner * cache_rows + slot``,
a row of the caches laid end to end, ``[n * cache_rows, D]`` split over the axis. The
step then looks rows up and updates them with the same all-to-all routing as an
uncached split table (``sharded_lookup`` / ``sharded_update`` under the plan
``ShardingPlan((n * cache_rows,), n, "row")``), so owners still sum each row's gradients
in the global batch's order: a cached split table trains the uncached one bit for bit.

Eviction, write-back, warm-up and prefetch stay per device, as in ``EmbeddingCache``,
but a step's swaps of rows in and out of the caches are one program over the axis
(``transfer.swap_sharded``), not one for each device;
a batch must fit each owner's cache (a hot table under table-wise sharding sizes its
device's cache). Checkpoints flush every cache and read the exact table from the shards
(``shard_views``), a block of rows at a time.

Over several processes (JAX's multi-controller runtime) each process holds the host
rows, cache and prefetch thread of its own devices' shards alone (``local``); the
caches of other processes' shards are kept as maps alone (``EmbeddingCache(...,
remote=True)``). The maps are deterministic functions of the ids (every process is
given the global batch's ids), so every process computes every id's slot, as the
step's ``[B, F]`` slots need, and the swap programs run on every process with each
device's rows put by its own process. ``rows_of`` (evaluation) gathers the owners' rows across
processes; a checkpoint's table is written by each process for its shards' rows
(``owned_ranges``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.embedding.cache import EmbeddingCache
from jaxpar.embedding.sharded import ShardingPlan, sharded_lookup, sharded_update
from jaxpar.embedding.stats import CacheStats
from jaxpar.embedding.transfer import swap_sharded
from jaxpar.embedding.update import CacheArrays, SparseOptimizer


class ShardedCache:
    """``plan.num_shards`` caches of ``cache_rows`` rows each over ``table``'s shards, on
    the devices of ``mesh``'s ``axis``; the ``EmbeddingCache`` interface a trainer uses."""

    def __init__(self, table: np.ndarray, cache_rows: int, *, plan: ShardingPlan, mesh, axis: str = "data",
                 optimizer: SparseOptimizer = SparseOptimizer(), state: np.ndarray | None = None,
                 eviction: str = "lfu", prefetch: int = 0):
        table = np.asarray(table, np.float32)
        n, S = plan.num_shards, plan.shard_rows
        if mesh.shape.get(axis) != n:
            raise ValueError(f"mesh axis {axis!r} has {mesh.shape.get(axis)} devices, the plan {n} shards")
        self.plan, self.cache_rows, self.optimizer = plan, cache_rows, optimizer
        self.num_rows, self.dim = table.shape
        self.sharding = NamedSharding(mesh, P(axis))
        self._mesh, self._axis = mesh, axis
        owners = self._devices(mesh, axis)
        # the process holding each shard; this process's shards: its host rows and caches
        self._process = np.array([d.process_index for d in owners])
        self.local = [k for k in range(n) if self._process[k] == jax.process_index()]
        rows = plan.to_shards(table)
        states = plan.to_shards(np.asarray(state, np.float32)) if state is not None else None
        self.caches = [EmbeddingCache(S, self.dim, cache_rows, optimizer=optimizer, eviction=eviction,
                                      prefetch=prefetch, table=rows[k * S:(k + 1) * S],
                                      state=None if states is None else states[k * S:(k + 1) * S], device=owners[k],
                                      remote=k not in self.local)
                       for k in range(n)]
        joined = dict(plan=ShardingPlan((n * cache_rows,), n, "row"), mesh=mesh, axis=axis)
        self.lookup = functools.partial(sharded_lookup, **joined)
        self.update = functools.partial(sharded_update, optimizer=optimizer, **joined)
        self.last_step = CacheStats()

    def _devices(self, mesh, axis) -> list:
        """The device holding each shard k (its block of ``[n * cache_rows, D]``)."""
        n = self.plan.num_shards
        index = self.sharding.devices_indices_map((n * self.cache_rows, self.dim))
        by_start = {slices[0].start or 0: device for device, slices in index.items()}
        return [by_start[k * self.cache_rows] for k in range(n)]

    @property
    def cache_ratio(self) -> float:
        return self.cache_rows / self.plan.shard_rows

    @property
    def arrays(self) -> CacheArrays:
        """The caches laid end to end, ``[n * cache_rows, D]`` split over the axis."""
        n = self.plan.num_shards
        join = lambda parts, shape: jax.make_array_from_single_device_arrays(  # noqa: E731
            shape, self.sharding, parts)
        mine = [self.caches[k] for k in self.local]
        rows = join([c.arrays.rows for c in mine], (n * self.cache_rows, self.dim))
        state = None
        if self.optimizer.has_state:
            state = join([c.arrays.state for c in mine], (n * self.cache_rows,))
        return CacheArrays(rows, state)

    @arrays.setter
    def arrays(self, arrays: CacheArrays) -> None:
        """Hands each cache its block of a step's result."""
        def parts(a):
            return {shard.index[0].start or 0: shard.data for shard in a.addressable_shards}

        rows = parts(arrays.rows)
        state = parts(arrays.state) if arrays.state is not None else None
        for k in self.local:
            start = k * self.cache_rows
            self.caches[k].arrays = CacheArrays(rows[start], None if state is None else state[start])

    def _split(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """``(owner, local row)`` of global row ids (any shape)."""
        self.plan.check_ids(ids)
        position = self.plan.positions(np.asarray(ids))
        return position // self.plan.shard_rows, position % self.plan.shard_rows

    def check_fits(self, ids) -> None:
        """One line when a batch's ids do not fit their owners' caches."""
        owner, local = self._split(ids)
        need = max(len(np.unique(local[owner == k])) for k in range(self.plan.num_shards))
        if need > self.cache_rows:
            raise ValueError(f"embedding.cache_ratio={self.cache_ratio:.6g} caches {self.cache_rows} rows a device "
                             f"but a device owns {need} distinct ids of the first batch: the smallest cache_ratio "
                             f"that holds it is {need / self.plan.shard_rows:.6g}")

    def prepare(self, ids, upcoming: Sequence = ()) -> np.ndarray:
        """Every id of ``ids`` resident in its owner's cache; returns its row of the
        joined caches, ``owner * cache_rows + slot`` (int32, shaped like ``ids``)."""
        owner, local = self._split(ids)
        soon = [self._split(u) for u in upcoming]
        out = np.empty(owner.shape, np.int64)
        stats = CacheStats()
        moves = []
        for k, cache in enumerate(self.caches):
            mine = owner == k
            ahead = [loc[own == k] for own, loc in soon]
            slots, move = cache._plan(local[mine], ahead)
            out[mine] = k * self.cache_rows + slots
            moves.append(move)
            stats += cache.last_step
        old_rows, old_state = self._swap(moves)
        for cache, move, rows, state in zip(self.caches, moves, old_rows, old_state, strict=True):
            cache._moved(move, rows, state)
        self.last_step = stats
        return out.astype(np.int32)

    def warmup(self, sample_ids, *, ratio: float = 1.0) -> int:
        """Each cache's ``EmbeddingCache.warmup`` from the ids of ``sample_ids`` it owns,
        the rows loaded by one program over the axis; returns the rows loaded."""
        owner, local = self._split(np.asarray(sample_ids).reshape(-1))
        moves = [cache._warmup_plan(local[owner == k], None, ratio) for k, cache in enumerate(self.caches)]
        self._swap(moves)
        return sum(len(m.fill) for m in moves)

    def _swap(self, moves) -> tuple[list, list]:
        """Every cache's swap (``moves``, cache k's k-th) in one read and one write program
        over the axis, not a program per device; the evicted rows and state, per cache."""
        self.arrays, old_rows, old_state = swap_sharded(
            self.arrays, [m.victims for m in moves], [m.fill for m in moves], [m.rows for m in moves],
            [m.state for m in moves], mesh=self._mesh, axis=self._axis)
        return old_rows, old_state

    def rows_of(self, ids) -> np.ndarray:
        """The exact rows of ``ids`` (any shape) ``[..., D]``, read from the host shards;
        over several processes each reads its own shards' and they are gathered (every
        process calls this with the same ids: a collective)."""
        owner, local = self._split(ids)
        out = np.zeros((*owner.shape, self.dim), np.float32)
        for k in self.local:
            mine = owner == k
            out[mine] = self.caches[k].rows_of(local[mine])
        if len(self.local) == self.plan.num_shards:
            return out
        every = multihost_utils.process_allgather(out)  # [processes, ..., D]
        return np.take_along_axis(every, self._process[owner][None, ..., None], axis=0)[0]

    def table(self) -> np.ndarray:
        self._whole("table")
        return self.plan.from_shards(np.concatenate([c.table() for c in self.caches]))

    def optimizer_state(self) -> np.ndarray | None:
        if not self.optimizer.has_state:
            return None
        self._whole("optimizer_state")
        return self.plan.from_shards(np.concatenate([c.optimizer_state() for c in self.caches]))

    def _whole(self, what: str) -> None:
        if len(self.local) != self.plan.num_shards:
            raise ValueError(f"{what}: shards {sorted(set(range(self.plan.num_shards)) - set(self.local))} are held "
                             "by other processes (shard_views and owned_ranges give this process's)")

    def shard_views(self) -> tuple[list[np.ndarray | None], list[np.ndarray | None] | None]:
        """Each device's shard of the table ``[S, D]`` and of its optimizer state
        (None for SGD): read-only views of the host shards, flushed first, which later
        steps change (``plan.rows_from_shards`` reads the table's rows from them without
        joining them, as ``table()`` does); None for a shard another process holds."""
        rows = [c.table() if k in self.local else None for k, c in enumerate(self.caches)]
        if not self.optimizer.has_state:
            return rows, None
        return rows, [c.optimizer_state() if k in self.local else None for k, c in enumerate(self.caches)]

    def owned_ranges(self) -> tuple[tuple[tuple[int, int], ...], int] | None:
        """``(ranges, align)`` over several processes: the rows ``(lo, hi)`` of the
        unsharded table this process's shards hold (what it writes of a checkpoint),
        and the gcd of the rows where the holding process changes (a checkpoint's
        blocks must not straddle two processes' rows); None in one process."""
        if len(self.local) == self.plan.num_shards:
            return None
        holder = {}
        for k in range(self.plan.num_shards):
            for lo, hi in self.plan.shard_ranges(k):
                holder[lo] = (hi, int(self._process[k]))
        starts = sorted(holder)
        changes = [lo for prev, lo in zip(starts, starts[1:]) if holder[prev][1] != holder[lo][1]]
        ranges = []
        for lo in starts:
            hi, process = holder[lo]
            if process != jax.process_index():
                continue
            if ranges and ranges[-1][1] == lo:  # one range across this process's adjacent shards
                lo = ranges.pop()[0]
            ranges.append((lo, hi))
        return tuple(ranges), math.gcd(*changes)

    def load(self, table: np.ndarray, state: np.ndarray | None = None) -> None:
        S = self.plan.shard_rows
        rows = self.plan.to_shards(np.asarray(table, np.float32))
        states = None if state is None else self.plan.to_shards(np.asarray(state, np.float32))
        for k, cache in enumerate(self.caches):
            cache.load(rows[k * S:(k + 1) * S], None if states is None else states[k * S:(k + 1) * S])

    def close(self) -> None:
        for cache in self.caches:
            cache.close()
