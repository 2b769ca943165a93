"""Moving rows between the host and the device cache: a gather out, a donated scatter in.

Each ``prepare`` that misses runs two programs: one batched gather that reads out the
rows being evicted, then one batched scatter that writes the missing ones in (not one
copy per row, as Colossal-AI's cache batches its transfers). The scatter's cache arrays
are donated, so it updates them in place; in one program, the gather's reads of the
old rows made XLA copy the whole ``[C, D]`` cache first (the compile-only ``memory``
benchmark measured the copy: 900 MB for a 90 GB table's 1% cache). Index arrays
are padded to a size bucket with out-of-bounds slots (the gathers fill them, the
scatters drop them), so a few programs serve every step instead of one per miss count.

``swap_sharded`` does the same for the caches of a split table (``ShardedCache``: one
cache a device, laid end to end in one array split over a mesh axis): each device's
slots are a row of an ``[n, P]`` index array, so one read and one write program serve
every device, where a swap per device's cache compiled each program for each device.
Over several processes each process moves the rows of its own devices' caches alone
(``place`` puts each device's part from its own process; the evicted rows are read
from the addressable shards).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.embedding.update import CacheArrays


def swap(arrays: CacheArrays, victims: np.ndarray, fill: np.ndarray, rows: np.ndarray, state: np.ndarray | None):
    """``(arrays, old_rows, old_state)``: ``arrays`` with ``rows`` (and ``state``) written at
    slots ``fill``, and the host copies of the rows (and state) that were at ``victims``
    before. ``arrays`` is donated: use the returned one."""
    if len(fill) == 0 and len(victims) == 0:
        return arrays, None, None
    C, D = arrays.rows.shape
    P = bucket(max(len(fill), len(victims)))
    fill_rows = np.zeros((P, D), np.float32)
    fill_rows[: len(fill)] = rows
    fill_state = None
    if state is not None:
        fill_state = np.zeros(P, np.float32)
        fill_state[: len(fill)] = state
    n = len(victims)
    old_rows = old_state = None
    if n:  # read out first, in a program of its own: one that also wrote would copy the cache
        old_rows, old_state = _read(arrays, _padded(victims, P, C))
        old_rows = np.asarray(old_rows)[:n]
        old_state = np.asarray(old_state)[:n] if old_state is not None else None
    if len(fill):
        arrays = _write(arrays, _padded(fill, P, C), fill_rows, fill_state)
    return arrays, old_rows, old_state


@jax.jit
def _read(arrays: CacheArrays, victim_slots):
    rows, state = arrays
    old_state = None if state is None else state.at[victim_slots].get(mode="fill", fill_value=0)
    return rows.at[victim_slots].get(mode="fill", fill_value=0), old_state


@functools.partial(jax.jit, donate_argnums=0)
def _write(arrays: CacheArrays, fill_slots, fill_rows, fill_state):
    """The rows written in place (donated): the cache is never copied."""
    rows, state = arrays
    rows = rows.at[fill_slots].set(fill_rows, mode="drop")
    if state is not None:
        state = state.at[fill_slots].set(fill_state, mode="drop")
    return CacheArrays(rows, state)


def swap_sharded(arrays: CacheArrays, victims: list[np.ndarray], fill: list[np.ndarray], rows: list[np.ndarray],
                 state: list[np.ndarray | None], *, mesh, axis: str):
    """``swap`` for ``n`` caches of ``C`` rows laid end to end, ``arrays.rows [n * C, D]``
    split over ``mesh``'s ``axis`` (device k holds cache k): ``victims[k]``, ``fill[k]``,
    ``rows[k]``, ``state[k]`` are cache k's, its slots local (``[0, C)``). Returns
    ``(arrays, old_rows, old_state)``, the last two lists of cache k's evicted rows (and
    state; ``None`` where it evicts nothing). One read program and one donated write
    program for all devices, the index arrays padded to one size bucket."""
    n = len(victims)
    C, D = arrays.rows.shape[0] // n, arrays.rows.shape[1]
    size = max(max(len(f), len(v)) for f, v in zip(fill, victims))
    if size == 0:
        return arrays, [None] * n, [None] * n
    P = bucket(size)
    split = NamedSharding(mesh, PartitionSpec(axis))
    put = lambda x: place(x, split)  # noqa: E731
    old_rows, old_state = [None] * n, [None] * n
    if any(len(v) for v in victims):  # read out first, in a program of its own (see swap)
        got_rows, got_state = _read_split(arrays, put(np.stack([_padded(v, P, C) for v in victims])),
                                          mesh=mesh, axis=axis)
        got_rows = _local_rows(got_rows)  # this process's caches' (all of them in one process)
        got_state = _local_rows(got_state) if got_state is not None else {}
        for k, v in enumerate(victims):
            if len(v) and k in got_rows:
                old_rows[k] = got_rows[k][: len(v)]
                old_state[k] = got_state[k][: len(v)] if k in got_state else None
    if any(len(f) for f in fill):
        fill_rows = np.zeros((n, P, D), np.float32)
        fill_state = None if arrays.state is None else np.zeros((n, P), np.float32)
        for k, f in enumerate(fill):
            if len(f):
                fill_rows[k, : len(f)] = rows[k]
                if fill_state is not None:
                    fill_state[k, : len(f)] = state[k]
        arrays = _write_split(arrays, put(np.stack([_padded(f, P, C) for f in fill])), put(fill_rows),
                              None if fill_state is None else put(fill_state), mesh=mesh, axis=axis)
    return arrays, old_rows, old_state


@functools.partial(jax.jit, static_argnames=("mesh", "axis"))
def _read_split(arrays: CacheArrays, victim_slots, *, mesh, axis):
    """Each device's ``_read`` of its own cache, at its row of ``victim_slots [n, P]``."""
    def local(arrays, slots):
        rows, state = _read(arrays, slots[0])
        return rows[None], None if state is None else state[None]

    spec = PartitionSpec(axis)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec)(arrays, victim_slots)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("mesh", "axis"))
def _write_split(arrays: CacheArrays, fill_slots, fill_rows, fill_state, *, mesh, axis):
    """Each device's ``_write`` into its own cache (donated), from its row of the inputs."""
    def local(arrays, slots, rows, state):
        return _write(arrays, slots[0], rows[0], None if state is None else state[0])

    spec = PartitionSpec(axis)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec)(
        arrays, fill_slots, fill_rows, fill_state)


def place(x: np.ndarray, sharding) -> jax.Array:
    """Host ``x`` on ``sharding`` (a Sharding, a Device or None: ``jax.device_put``'s);
    over several processes each puts its own devices' parts of its own ``x``
    (``jax.make_array_from_callback``): the parts of other processes' devices are never
    read, so they may differ (a process has zeros where another's cache rows are), and
    there is no cross-process check that they agree, which ``jax.device_put`` makes of a
    host value on a global sharding (a collective per call)."""
    if not isinstance(sharding, jax.sharding.Sharding) or sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def host_value(a) -> np.ndarray:
    """The whole of ``a`` in numpy: over several processes, a split array's shards are
    gathered from every process (a collective: every process calls it)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable and not a.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)


def _local_rows(a: jax.Array) -> dict[int, np.ndarray]:
    """``{k: a[k]}`` for the rows k of ``a [n, ...]`` (split over its first axis, a row a
    device) that this process's devices hold."""
    return {shard.index[0].start or 0: np.asarray(shard.data)[0] for shard in a.addressable_shards}


def bucket(n: int) -> int:
    """``n`` rounded up to 8 or to ``m * 2^e`` with ``m`` in 4..7: at most a quarter of
    padding, four programs per doubling of the size."""
    if n <= 8:
        return 8
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def _padded(slots: np.ndarray, size: int, fill: int) -> np.ndarray:
    out = np.full(size, fill, np.int32)
    out[: len(slots)] = slots
    return out
