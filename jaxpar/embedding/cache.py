"""The device cache of embedding rows: id <-> slot maps, eviction, warm-up, write-back.

Colossal-AI's ``CachedParamMgr`` (the freq-aware embedding of its DLRM work) in JAX:
the table lives on the host (``HostStore``), ``cache_rows`` of its rows live on the
device in ``arrays`` (a ``CacheArrays``: ``rows [C, D]``, ``state [C]``), and before
each step ``prepare(ids)`` makes every id of the batch resident and returns where each
one sits, so the jitted step reads ``arrays.rows[slots]`` and never sees the host. The
bookkeeping is plain numpy on the host: ``slot_to_id [C]`` and ``id_to_slot [R]`` (-1 for
empty / absent), one access count per id (LFU) and one last-use step per slot (LRU).

One ``prepare`` is one device program: the rows to evict are read out and the missing
rows written in by the same jitted swap, donated so the cache is updated in place;
index arrays are padded to a size bucket so a few programs serve every step. Evicted
rows go back to the host with their optimizer state, so a row that returns resumes its
Adagrad accumulator (TorchRec's UVM cache does the same with FBGEMM's
``lxu_cache_flush``).

The device arrays change hands every step: ``prepare`` donates ``arrays`` and sets new
ones, and the train step, which donates them too, must hand its result back
(``cache.arrays = new``). Only rows of a prepared batch may change between two calls.
"""

from __future__ import annotations

import functools
import math
import numbers
import typing
from collections.abc import Sequence

import numpy as np

from jaxpar.embedding.policy import POLICIES, choose_victims, eviction_keys, smallest
from jaxpar.embedding.prefetch import Prefetcher
from jaxpar.embedding.stats import CacheStats
from jaxpar.embedding.store import HostStore, RemoteStore
from jaxpar.embedding.transfer import place, swap
from jaxpar.embedding.update import CacheArrays, SparseOptimizer, lookup, sparse_update


def cache_rows_for(num_rows: int, ratio) -> int:
    """Rows of a cache holding ``ratio`` of ``num_rows`` (rounded up, at least one)."""
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 < ratio <= 1:
        raise ValueError(f"cache_ratio={ratio!r}: expected a number in (0, 1]")
    # round() first: 0.01 * 4000 is 40.00000000000001 in binary, which is 40 rows, not 41.
    return min(num_rows, max(1, math.ceil(round(ratio * num_rows, 6))))


class EmbeddingCache:
    """A device cache of ``cache_rows`` rows of a host table ``[num_rows, dim]``."""

    def __init__(self, num_rows: int, dim: int, cache_rows: int, *, optimizer: SparseOptimizer = SparseOptimizer(),
                 eviction: str = "lfu", prefetch: int = 0, table: np.ndarray | None = None,
                 state: np.ndarray | None = None, seed: int = 0, device=None, remote: bool = False):
        """``remote``: the maps alone, the rows held by another process (a
        ``ShardedCache`` over several processes: every process plans every shard's cache
        alike, so each knows every id's slot, and moves the rows of its own shards
        alone); no host table, no device arrays, no prefetch thread."""
        if eviction not in POLICIES:
            raise ValueError(f"eviction={eviction!r}: expected one of {POLICIES}")
        if not 1 <= cache_rows <= num_rows:
            raise ValueError(f"cache_rows={cache_rows}: expected 1 to num_rows={num_rows}")
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch}: expected a number of batches >= 0")
        if remote:
            table = None
        elif table is None:
            # DLRM's reference init, U(-sqrt(1/n), sqrt(1/n)); a model of several tables
            # passes its own table, initialised table by table.
            bound = math.sqrt(1 / num_rows)
            table = np.random.default_rng(seed).uniform(-bound, bound, (num_rows, dim)).astype(np.float32)
        elif np.shape(table) != (num_rows, dim):
            raise ValueError(f"table shape {np.shape(table)}, expected (num_rows, dim) = {(num_rows, dim)}")
        self.store = RemoteStore(num_rows, dim, optimizer) if remote else HostStore(table, optimizer, state)
        self.remote = remote
        self.optimizer, self.eviction, self.prefetch = optimizer, eviction, prefetch
        self.num_rows, self.dim, self.cache_rows = num_rows, dim, cache_rows
        self._device = device
        self.arrays = None if remote else CacheArrays(
            place(np.zeros((cache_rows, dim), np.float32), device),
            place(np.zeros(cache_rows, np.float32), device) if optimizer.has_state else None)
        self._slot_to_id = np.full(cache_rows, -1, np.int64)
        self._id_to_slot = np.full(num_rows, -1, np.int32 if num_rows < 2**31 else np.int64)
        self._count = np.zeros(num_rows, np.int64)
        self._last_used = np.zeros(cache_rows, np.int64)
        self._step = 0
        self._prefetcher = Prefetcher(self.store) if prefetch and not remote else None
        # What a jitted step calls: the rows at a batch's slots, and their sparse update.
        self.lookup = lookup
        self.update = functools.partial(sparse_update, optimizer=optimizer)
        self.last_step = CacheStats()
        self.total = CacheStats()

    @classmethod
    def from_ratio(cls, num_rows: int, dim: int, ratio: float, **kwargs) -> EmbeddingCache:
        """A cache of ``ratio`` (in (0, 1]) of the table's rows; 1 caches everything."""
        return cls(num_rows, dim, cache_rows_for(num_rows, ratio), **kwargs)

    @property
    def cache_ratio(self) -> float:
        return self.cache_rows / self.num_rows

    @property
    def slot_to_id(self) -> np.ndarray:
        return _readonly(self._slot_to_id)

    @property
    def id_to_slot(self) -> np.ndarray:
        return _readonly(self._id_to_slot)

    @property
    def staged_rows(self) -> int:
        """Rows the prefetch thread holds for coming batches (bounded by their ids)."""
        return self._prefetcher.staged_rows if self._prefetcher else 0

    def check_fits(self, ids) -> None:
        """One line when a batch's distinct ids outnumber the cache's rows (checked before
        a run writes anything; ``prepare`` refuses the same batch)."""
        unique = len(np.unique(self._checked(np.asarray(ids), "ids")))
        if unique > self.cache_rows:
            raise ValueError(f"embedding.cache_ratio={self.cache_ratio:.6g} caches {self.cache_rows} rows but "
                             f"the first batch has {unique} distinct ids: the smallest cache_ratio that holds it "
                             f"is {unique / self.num_rows:.6g}")

    def _plan(self, ids, upcoming: Sequence) -> tuple[np.ndarray, _Move]:
        """The first half of ``prepare``, on the host alone: ``(slots, move)``, the slots
        (final) and the swap that makes them hold their rows, the maps already updated.
        ``ShardedCache`` runs the swaps of all its caches as one program between the halves."""
        ids = np.asarray(ids)
        uniq, inverse, counts = np.unique(self._checked(ids, "ids"), return_inverse=True, return_counts=True)
        if len(uniq) > self.cache_rows:
            R = self.num_rows
            raise ValueError(f"a batch has {len(uniq)} unique ids but the cache holds {self.cache_rows} rows "
                             f"(cache_ratio {self.cache_ratio:.6g} of {R} rows): the smallest cache_ratio "
                             f"that holds this batch is {len(uniq) / R:.6g}")
        if len(upcoming) > self.prefetch:
            raise ValueError(f"{len(upcoming)} upcoming batches given, but prefetch={self.prefetch}")
        soon = np.unique(np.concatenate([np.zeros(0, np.int64)]
                                        + [self._checked(np.asarray(u), "upcoming") for u in upcoming]))
        self._step += 1
        self._count[uniq] += counts
        slots = self._id_to_slot[uniq].astype(np.int64)
        miss = slots < 0
        stats = CacheStats(hits=int((~miss).sum()), misses=int(miss.sum()))
        move = _Move.none(self.dim, soon)
        if stats.misses:
            move = self._admit(uniq[miss], slots[~miss], soon, stats)
            slots[miss] = move.fill
        self._last_used[slots] = self._step
        self.last_step = stats
        self.total += stats
        return slots[inverse.reshape(-1)].reshape(ids.shape).astype(np.int32), move

    def prepare(self, ids, upcoming: Sequence = ()) -> np.ndarray:
        """Make every id of ``ids`` (global row ids, any shape) resident; return their
        slots, int32, shaped like ``ids``. ``upcoming``: the ids of at most ``prefetch``
        next batches, kept from eviction when room allows and staged by the thread."""
        slots, move = self._plan(ids, upcoming)
        self.arrays, old_rows, old_state = swap(self.arrays, move.victims, move.fill, move.rows, move.state)
        self._moved(move, old_rows, old_state)
        return slots

    def _moved(self, move: _Move, old_rows, old_state) -> None:
        """The second half of ``prepare``, once ``move``'s swap has run: the evicted rows
        (``old_rows``, ``old_state``: what was at ``move.victims``) written back to the
        host, then the coming batches' missing rows staged."""
        if len(move.victim_ids):
            self.store.write(move.victim_ids, old_rows, old_state)
        if self._prefetcher is not None:
            self._prefetcher.submit(move.soon[self._id_to_slot[move.soon] < 0])

    def warmup(self, sample_ids=None, *, counts=None, ratio: float = 1.0) -> int:
        """Preload the hottest ``ratio * cache_rows`` ids into free slots, hottest first,
        from ``sample_ids`` (ids of a sample of the training data) or per-id ``counts
        [num_rows]``; the counts also seed LFU's (Colossal-AI's dataset strategy).
        Returns the number of rows loaded."""
        move = self._warmup_plan(sample_ids, counts, ratio)
        self.arrays, _, _ = swap(self.arrays, move.victims, move.fill, move.rows, move.state)
        return len(move.fill)

    def _warmup_plan(self, sample_ids, counts, ratio) -> _Move:
        """``warmup`` on the host alone: the maps, counts and statistics updated; returns
        the swap (nothing evicted) that loads the rows (``ShardedCache`` runs its caches'
        as one program)."""
        if (sample_ids is None) == (counts is None):
            raise ValueError("warmup: give exactly one of sample_ids and counts")
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 <= ratio <= 1:
            raise ValueError(f"warmup_ratio={ratio!r}: expected a number in [0, 1]")
        if counts is None:
            counts = np.bincount(self._checked(np.asarray(sample_ids), "sample_ids"), minlength=self.num_rows)
        counts = np.asarray(counts)
        if counts.shape != (self.num_rows,) or (counts < 0).any():
            raise ValueError(f"warmup counts: expected {self.num_rows} counts >= 0, got shape {counts.shape}")
        if self._prefetcher is not None:
            self._prefetcher.drop()
        self._count += counts.astype(np.int64)
        free = np.flatnonzero(self._slot_to_id < 0)
        n = min(int(ratio * self.cache_rows + 1e-9), len(free))
        candidates = np.flatnonzero((counts > 0) & (self._id_to_slot < 0))
        hot = np.sort(candidates[smallest((-counts[candidates], candidates), n)])
        rows, state = self.store.gather(hot)
        none = np.zeros(0, np.int64)
        self._assign(hot, free[: len(hot)], none)
        self._last_used[free[: len(hot)]] = self._step
        self.total.h2d_bytes += len(hot) * self.store.row_bytes
        return _Move(none, none, free[: len(hot)], rows, state, none)

    def flush(self) -> None:
        """Write every cached row and its state back to the host; the cache stays valid
        (a remote cache's rows are its process's to write)."""
        if self.remote:
            return
        resident = np.flatnonzero(self._slot_to_id >= 0)
        rows = np.asarray(self.arrays.rows)[resident]
        state = np.asarray(self.arrays.state)[resident] if self.arrays.state is not None else None
        self.store.write(self._slot_to_id[resident], rows, state)

    def rows_of(self, ids) -> np.ndarray:
        """The exact current rows of ``ids`` (any shape, resident or not) ``[..., dim]``,
        read from the host table after a flush: an evaluation's lookups neither load rows
        nor count towards eviction."""
        self._local("rows_of")
        self.flush()
        ids = np.asarray(ids)
        return self.store.table[self._checked(ids, "ids")].reshape(*ids.shape, self.dim)

    def table(self) -> np.ndarray:
        """The exact full table ``[num_rows, dim]`` (flushes first); a read-only view of
        the host table, which later steps change: copy it to keep it."""
        self._local("table")
        self.flush()
        return _readonly(self.store.table)

    def optimizer_state(self) -> np.ndarray | None:
        """The exact per-row optimizer state ``[num_rows]`` (``None`` for SGD)."""
        self._local("optimizer_state")
        self.flush()
        return None if self.store.state is None else _readonly(self.store.state)

    def load(self, table: np.ndarray, state: np.ndarray | None = None) -> None:
        """Restore the table (and optimizer state); the resident rows are reloaded (a
        remote cache: nothing to load)."""
        if self.remote:
            return
        if self._prefetcher is not None:
            self._prefetcher.drop()
        self.store.load(table, state)
        resident = np.flatnonzero(self._slot_to_id >= 0)
        rows, state = self.store.gather(self._slot_to_id[resident])
        self._install(self._slot_to_id[resident], resident, np.zeros(0, np.int64), rows, state)

    def close(self) -> None:
        """Stop the prefetch thread (the cache stays usable without prefetch)."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher, self.prefetch = None, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _local(self, what: str) -> None:
        if self.remote:
            raise ValueError(f"{what}: this cache's rows are held by another process")

    def _checked(self, ids: np.ndarray, name: str) -> np.ndarray:
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name}: expected integer row ids, got dtype {ids.dtype}")
        flat = ids.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_rows):
            bad = flat[(flat < 0) | (flat >= self.num_rows)][0]
            raise ValueError(f"{name}: row id {bad} outside [0, num_rows={self.num_rows})")
        return flat

    def _admit(self, missing: np.ndarray, hit_slots: np.ndarray, soon: np.ndarray, stats: CacheStats) -> _Move:
        """Slots for ``missing`` ids (sorted, none resident), evicting first if room is
        short, in the maps; returns the swap that loads them (``fill``: their slots)."""
        rows, state = self._fetch(missing, stats)
        free = np.flatnonzero(self._slot_to_id < 0)
        victims = np.zeros(0, np.int64)
        if len(missing) > len(free):
            resident = np.flatnonzero(self._slot_to_id >= 0)
            resident_ids = self._slot_to_id[resident]
            keys = eviction_keys(self.eviction, self._count[resident_ids], self._last_used[resident], resident_ids)
            protected, soft = np.zeros(self.cache_rows, bool), np.zeros(self.cache_rows, bool)
            protected[hit_slots] = True
            soon_slots = self._id_to_slot[soon]
            soft[soon_slots[soon_slots >= 0]] = True
            chosen = choose_victims(keys, len(missing) - len(free), protected[resident], soft[resident])
            victims = np.sort(resident[chosen])
            free = np.sort(np.concatenate([free, victims]))
        fill = free[: len(missing)]
        victim_ids = self._assign(missing, fill, victims)
        stats.evictions = len(victims)
        stats.h2d_bytes = len(missing) * self.store.row_bytes
        stats.d2h_bytes = len(victims) * self.store.row_bytes
        return _Move(victims, victim_ids, fill, rows, state, soon)

    def _fetch(self, ids: np.ndarray, stats: CacheStats):
        """Host rows of ``ids``: those the prefetch thread staged, the rest gathered now."""
        if self._prefetcher is None:
            return self.store.gather(ids)
        found, staged_rows, staged_state = self._prefetcher.take(ids)
        stats.prefetched = int(found.sum())
        if found.all():
            return staged_rows, staged_state
        rows, state = self.store.gather(ids)  # a copy: the staged ones go in below
        rows[found] = staged_rows
        if state is not None:
            state[found] = staged_state
        return rows, state

    def _install(self, ids, fill, victims, rows, state) -> None:
        """Read out the rows at ``victims`` (written back to the host), then write
        ``rows`` (and ``state``) of ``ids`` at slots ``fill`` (``transfer.swap``)."""
        victim_ids = self._assign(ids, fill, victims)
        self.arrays, old_rows, old_state = swap(self.arrays, victims, fill, rows, state)
        if len(victims):
            self.store.write(victim_ids, old_rows, old_state)

    def _assign(self, ids, fill, victims) -> np.ndarray:
        """The maps: ``ids`` at slots ``fill``, the ids at ``victims`` no longer resident
        (returned: their rows go back to the host once read out)."""
        victim_ids = self._slot_to_id[victims]
        self._id_to_slot[victim_ids] = -1
        self._slot_to_id[victims] = -1
        self._slot_to_id[fill] = ids
        self._id_to_slot[ids] = fill
        return victim_ids


class _Move(typing.NamedTuple):
    """One cache's swap for a batch: read out the slots ``victims`` (the rows of
    ``victim_ids``), then write ``rows`` (``[len(fill), D]``) and ``state`` at ``fill``;
    ``soon``: the upcoming batches' ids, staged once the victims are back on the host."""

    victims: np.ndarray
    victim_ids: np.ndarray
    fill: np.ndarray
    rows: np.ndarray
    state: np.ndarray | None
    soon: np.ndarray

    @classmethod
    def none(cls, dim: int, soon: np.ndarray) -> _Move:
        empty = np.zeros(0, np.int64)
        return cls(empty, empty, empty, np.zeros((0, dim), np.float32), None, soon)


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view
