"""Model-parallel embedding tables: rows split over one mesh axis, lookups by all-to-all.

The DLRM paper (Naumov et al. 2019, section 4, "Parallelism") trains the MLPs data
parallel and the embedding tables model parallel over the same devices, with a
"butterfly shuffle" (an all-to-all) between them; TorchRec shards tables the same way
and names the layouts this module builds:

- **row-wise** (TorchRec's ``ShardingType.ROW_WISE``): the concatenated table ``[R, D]``
  (``jaxpar.models.DLRM``'s one table, feature f at rows ``offsets[f]..``) is cut into
  ``n`` equal blocks of ``S = ceil(R / n)`` rows; device k holds rows ``[k*S, (k+1)*S)``.
  R is padded up to ``n * S`` with zero rows that no id reaches.
- **table-wise** (``ShardingType.TABLE_WISE``): each feature's whole table lives on one
  device, tables placed greedily, largest first, on the device with the fewest rows so
  far (Graham's LPT rule; TorchRec's planner balances a cost model's estimate the same
  greedy way, here the cost is rows). It reuses the row-wise machinery: the rows are
  permuted so that each device's tables are contiguous in its block (``S`` = the most
  rows any device holds, the others padded), after which a lookup is the same routing.

``ShardingPlan`` is the static (numpy, hashable) half: global row -> (device, local row),
and ``to_shards``/``from_shards`` between the ``[R, ...]`` table and the ``[n*S, ...]``
sharded layout. ``shard_arrays`` places that layout as ``CacheArrays`` split
``P(axis)`` on dim 0. Inside a jitted step (ids ``[B, F]`` and the loss data parallel,
batch-split over the same axis)::

    emb = sharded_lookup(arrays, ids, plan=plan, mesh=mesh, axis="data")      # [B, F, D]
    loss, g_emb = jax.value_and_grad(loss_fn)(emb, ...)
    arrays = sharded_update(arrays, ids, g_emb, lr, plan=plan, optimizer=opt, mesh=mesh, axis="data")

The exchange (per device, under ``jax.shard_map``): its ``N = B/n * F`` ids are bucketed
by owner into a fixed ``[n, N]`` buffer (static shapes: a bucket must hold every local
id in the worst case, so the capacity per (sender, owner) pair is N; unused slots hold
the out-of-range local row S, which gathers read as zeros and scatters drop); one
``all_to_all`` sends each bucket to its owner, the owner gathers ``[n, N, D]`` rows, a
second ``all_to_all`` sends them back, and each device un-buckets them into ``[B/n, F,
D]``. The update routes ``g_emb`` the same way and each owner calls ``sparse_update`` on
its shard with everything it received. The price of the static capacity: every
all-to-all moves n times the useful bytes (a capacity factor with overflow handling, as
MoE layers use, would cut that at the cost of exactness); the update repeats the ids'
exchange (ints, 1/D of the rows' bytes) rather than carrying routing state between calls.

Exactness: an owner receives its buckets in sender order, and a sender's batch is the
global batch's slice ``[k*B/n, (k+1)*B/n)`` kept in its flattened order (a stable sort),
so the gradients of each row arrive in the global batch's order, and ``sparse_update``
sums duplicates (within and across devices) in that order before the (nonlinear, for
Adagrad) row update: the same sums, in the same order, as one device running
``sparse_update`` over the whole batch. Lookups are gathers (exact). (The replicated,
data-parallel update under Auto axes is not bit-identical to one device: the SPMD
partitioner splits its segment sum by device and adds the partial sums.)

Out-of-range ids raise ``ValueError`` when the ids are concrete; inside ``jit`` they
cannot, and read zero rows and update nothing (``jnp``'s fill/drop semantics).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.embedding.transfer import host_value, place
from jaxpar.embedding.update import CacheArrays, SparseOptimizer, sparse_update

KINDS = ("row", "table")


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where each row of the concatenated table ``[R, D]`` lives on ``num_shards``
    devices; hashable (its fields), so a jitted step can take it as a static argument.
    The derived maps are numpy, computed once per plan."""

    table_rows: tuple[int, ...]  # rows of each feature's table, in the table's order (R = sum)
    num_shards: int  # n, the devices of the mesh axis the rows are split over
    kind: Literal["row", "table"] = "row"

    def __post_init__(self):
        object.__setattr__(self, "table_rows", tuple(self.table_rows))
        rows = self.table_rows
        if not rows or any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1 for r in rows):
            raise ValueError(f"table_rows={rows!r}: expected a non-empty tuple of positive ints")
        if isinstance(self.num_shards, bool) or not isinstance(self.num_shards, (int, np.integer)) \
                or self.num_shards < 1:
            raise ValueError(f"num_shards={self.num_shards!r}: expected a positive int")
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: expected one of {KINDS}")
        if self.num_shards * self.shard_rows >= 2**31:
            raise ValueError(f"table_rows sum to {self.num_rows}: {self.num_shards} shards of {self.shard_rows} "
                             "rows are more than int32 row ids hold")

    @property
    def num_rows(self) -> int:
        """R, the rows of the unsharded table."""
        return sum(self.table_rows)

    @property
    def padded_rows(self) -> int:
        """``n * S``, the rows of the sharded layout (padding included)."""
        return self.num_shards * self.shard_rows

    @functools.cached_property
    def table_device(self) -> tuple[int, ...] | None:
        """Feature -> device, table-wise (LPT: largest table first, to the device with
        the fewest rows, the lowest index on ties); None row-wise."""
        if self.kind == "row":
            return None
        load, device = [0] * self.num_shards, [0] * len(self.table_rows)
        for f in sorted(range(len(self.table_rows)), key=lambda f: (-self.table_rows[f], f)):
            device[f] = min(range(self.num_shards), key=lambda k: (load[k], k))
            load[device[f]] += self.table_rows[f]
        return tuple(device)

    @functools.cached_property
    def shard_rows(self) -> int:
        """S, the rows each device holds (padding included)."""
        if self.kind == "row":
            return -(-self.num_rows // self.num_shards)
        return max(self.device_rows)

    @property
    def device_rows(self) -> tuple[int, ...]:
        """The table's rows each device holds, padding not counted."""
        if self.kind == "row":
            S, R = -(-self.num_rows // self.num_shards), self.num_rows
            return tuple(max(0, min(S, R - k * S)) for k in range(self.num_shards))
        load = [0] * self.num_shards
        for f, k in enumerate(self.table_device):
            load[k] += self.table_rows[f]
        return tuple(load)

    @functools.cached_property
    def _segments(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts [F], shifts [F])``: a global row g of feature f (``starts[f] <= g``)
        sits at ``g + shifts[f]`` of the sharded layout. Row-wise every shift is 0;
        table-wise each device's tables follow one another, in feature order."""
        starts = np.concatenate([[0], np.cumsum(self.table_rows[:-1])]).astype(np.int64)
        if self.kind == "row":
            return starts, np.zeros_like(starts)
        used, new = [0] * self.num_shards, np.zeros_like(starts)
        for f, k in enumerate(self.table_device):
            new[f] = k * self.shard_rows + used[k]
            used[k] += self.table_rows[f]
        return starts, new - starts

    def positions(self, ids):
        """The sharded layout's row of each global row id (numpy in, numpy out; a jax
        array in, a jax array out); ids must lie in ``[0, R)``."""
        if self.kind == "row":
            return ids
        starts, shifts = self._segments
        xp = np if isinstance(ids, np.ndarray) else jnp
        segment = xp.searchsorted(starts, ids, side="right") - 1
        return ids + xp.asarray(shifts, ids.dtype)[segment]

    def placement(self) -> tuple[np.ndarray, np.ndarray]:
        """``(device [R], local [R])`` int32: the device holding each global row and its
        row in that device's shard."""
        pos = self.positions(np.arange(self.num_rows, dtype=np.int64))
        return (pos // self.shard_rows).astype(np.int32), (pos % self.shard_rows).astype(np.int32)

    def to_shards(self, x: np.ndarray) -> np.ndarray:
        """``x [R, ...]`` (a table, or its optimizer state) in the sharded layout
        ``[n*S, ...]``, padding rows zero."""
        x = np.asarray(x)
        if x.shape[:1] != (self.num_rows,):
            raise ValueError(f"x.shape={x.shape}: expected {self.num_rows} rows (sum of table_rows)")
        out = np.zeros((self.padded_rows, *x.shape[1:]), x.dtype)
        out[self.positions(np.arange(self.num_rows, dtype=np.int64))] = x
        return out

    def from_shards(self, x) -> np.ndarray:
        """The inverse of ``to_shards``: ``[n*S, ...]`` -> ``[R, ...]`` (numpy)."""
        x = np.asarray(x)
        if x.shape[:1] != (self.padded_rows,):
            raise ValueError(f"x.shape={x.shape}: expected {self.padded_rows} rows (the plan's sharded layout)")
        return x[self.positions(np.arange(self.num_rows, dtype=np.int64))]

    def rows_from_shards(self, shards, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo..hi`` of ``from_shards`` of the shards laid end to end, ``shards[k]``
        device k's ``[S, ...]``, without joining them: a copy of those rows alone, copied
        run by run (a checkpoint reads a split host table a block at a time). A shard
        may be None (another process holds it) when none of the rows is in it."""
        held = [s for s in shards if s is not None]
        if len(shards) != self.num_shards or not held or any(s.shape[:1] != (self.shard_rows,) for s in held):
            raise ValueError(f"shards of shapes {[None if s is None else s.shape for s in shards]}: expected "
                             f"{self.num_shards} of {self.shard_rows} rows")
        if not 0 <= lo <= hi <= self.num_rows:
            raise ValueError(f"rows {lo}..{hi}: expected 0 <= lo <= hi <= {self.num_rows}")
        starts, shifts = self._segments
        out = np.empty((hi - lo, *held[0].shape[1:]), held[0].dtype)
        row = lo
        while row < hi:  # runs of rows contiguous in one shard: within a feature and a shard
            f = int(np.searchsorted(starts, row, side="right")) - 1
            k, local = divmod(row + int(shifts[f]), self.shard_rows)
            if shards[k] is None:
                raise ValueError(f"row {row} is in shard {k}, which is not here")
            end = min(hi, starts[f + 1] if f + 1 < len(starts) else hi, row + self.shard_rows - local)
            out[row - lo:end - lo] = shards[k][local:local + end - row]
            row = end
        return out

    def shard_ranges(self, k: int) -> tuple[tuple[int, int], ...]:
        """The rows of the unsharded table ``[R, ...]`` that shard k holds, as ranges
        ``(lo, hi)`` in order (row-wise one range; table-wise one a table; none for a
        shard of padding alone): what the process holding shard k writes of a
        checkpoint's table."""
        if self.kind == "row":
            S = self.shard_rows
            lo, hi = k * S, min((k + 1) * S, self.num_rows)
            return ((lo, hi),) if lo < hi else ()
        starts = np.concatenate([[0], np.cumsum(self.table_rows)]).tolist()
        return tuple((starts[f], starts[f + 1]) for f, d in enumerate(self.table_device) if d == k)

    def check_ids(self, ids) -> None:
        """ValueError naming the first id outside ``[0, R)`` (concrete ids only)."""
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ids dtype {ids.dtype}: expected integer row ids")
        bad = (ids < 0) | (ids >= self.num_rows)
        if bad.any():
            raise ValueError(f"ids: row id {ids[bad].flat[0]} outside [0, num_rows={self.num_rows})")


def shard_arrays(table, state=None, *, plan: ShardingPlan, mesh, axis: str = "data") -> CacheArrays:
    """``table [R, D]`` (and its optimizer state ``[R]``, or None for SGD) in the plan's
    layout, split ``P(axis)`` on dim 0: device k holds its shard ``[S, D]``."""
    _check_axis(plan, mesh, axis)
    split = NamedSharding(mesh, P(axis))
    put = lambda x: place(plan.to_shards(np.asarray(x, np.float32)), split)  # noqa: E731: each process its shards
    return CacheArrays(put(table), None if state is None else put(state))


def unshard_arrays(arrays: CacheArrays, *, plan: ShardingPlan) -> tuple[np.ndarray, np.ndarray | None]:
    """``(table [R, D], state [R] | None)`` in numpy, the padding dropped (a checkpoint's layout);
    over several processes gathered from every process (a collective)."""
    state = None if arrays.state is None else plan.from_shards(host_value(arrays.state))
    return plan.from_shards(host_value(arrays.rows)), state


def sharded_lookup(arrays: CacheArrays, ids, *, plan: ShardingPlan, mesh, axis: str = "data") -> jax.Array:
    """The rows of global ids ``ids [B, ...]`` (batch-split over ``axis``) from the
    sharded ``arrays``: ``[B, ..., D]``, batch-split like ``ids``; equal to
    ``table[ids]`` of the unsharded table."""
    n = _check(plan, arrays, ids, mesh, axis)
    S, D = plan.shard_rows, arrays.rows.shape[1]

    def local(rows, ids):  # rows [S, D], ids [B/n, ...]
        owner, within, slot = _route(plan, ids.reshape(-1), n)
        wanted = _all_to_all(_bucket(slot, owner, within, n, fill=S), axis)  # [n, N]: rows asked of me
        answers = _all_to_all(rows.at[wanted].get(mode="fill", fill_value=0), axis)  # [n, N, D], by owner
        return answers[owner, within].reshape(*ids.shape, D)

    with jax.named_scope("sharded_lookup"):
        return jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P(axis)), out_specs=P(axis))(arrays.rows, ids)


def sharded_update(arrays: CacheArrays, ids, grads, lr, *, plan: ShardingPlan, optimizer: SparseOptimizer,
                   mesh, axis: str = "data") -> CacheArrays:
    """``arrays`` with the rows of ``ids`` updated by ``grads [B, ..., D]`` (the gradient
    with respect to ``sharded_lookup(arrays, ids, ...)``): every owner sums its rows'
    gradients from the whole batch and applies ``sparse_update``; other rows unchanged."""
    n = _check(plan, arrays, ids, mesh, axis)
    S, D = plan.shard_rows, arrays.rows.shape[1]
    if grads.shape != (*ids.shape, D):
        raise ValueError(f"grads.shape={grads.shape}: expected ids.shape + (D,) = {(*ids.shape, D)}")
    if optimizer.has_state != (arrays.state is not None):
        raise ValueError(f"optimizer {optimizer.kind!r} with state={'None' if arrays.state is None else 'an array'}")

    def local(arrays, ids, grads, lr):  # shards [S, D] / [S]; ids [B/n, ...], grads [B/n, ..., D]
        owner, within, slot = _route(plan, ids.reshape(-1), n)
        slots = _all_to_all(_bucket(slot, owner, within, n, fill=S), axis)  # [n, N], sender-major
        g = _all_to_all(_bucket(grads.reshape(-1, D), owner, within, n, fill=0), axis)  # [n, N, D]
        # Slot S (empty bucket places) is out of range: sparse_update reads it as zeros and drops it.
        return sparse_update(arrays, slots, g, lr, optimizer=optimizer)

    with jax.named_scope("sharded_update"):
        return jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P(axis), P(axis), P()),
                             out_specs=P(axis))(arrays, ids, grads, jnp.asarray(lr, jnp.float32))


def _route(plan: ShardingPlan, ids, n: int):
    """Each local id's ``(owner, place in the owner's bucket, local row on the owner)``,
    ``[N]`` each. The buckets keep the ids' order (a stable sort), which is what makes the
    owner's sums follow the global batch's order. Invalid ids go to owner 0 at row S
    (read as zeros, dropped by the update)."""
    S, N = plan.shard_rows, ids.shape[0]
    valid = (ids >= 0) & (ids < plan.num_rows)
    pos = plan.positions(jnp.where(valid, ids, 0).astype(jnp.int32))
    owner = jnp.where(valid, pos // S, 0)
    slot = jnp.where(valid, pos % S, S)
    order = jnp.argsort(owner, stable=True)
    rank = jnp.zeros(N, jnp.int32).at[order].set(jnp.arange(N, dtype=jnp.int32))  # place in owner order
    counts = jnp.zeros(n, jnp.int32).at[owner].add(1)
    within = rank - (jnp.cumsum(counts) - counts)[owner]
    return owner, within, slot


def _bucket(x, owner, within, n: int, *, fill):
    """``x [N, ...]`` into ``[n, N, ...]`` buckets by owner; unused places hold ``fill``."""
    out = jnp.full((n, *x.shape), fill, x.dtype)
    return out.at[owner, within].set(x, mode="drop")


def _all_to_all(x, axis):
    """Bucket k of ``x [n, ...]`` to device k; row j of the result came from device j."""
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def _check_axis(plan: ShardingPlan, mesh, axis) -> int:
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh (its axes: {tuple(mesh.axis_names)})")
    n = mesh.shape[axis]
    if n != plan.num_shards:
        raise ValueError(f"mesh axis {axis!r} has {n} devices but the plan has num_shards={plan.num_shards}")
    return n


def _check(plan: ShardingPlan, arrays: CacheArrays, ids, mesh, axis) -> int:
    n = _check_axis(plan, mesh, axis)
    if arrays.rows.ndim != 2 or arrays.rows.shape[0] != plan.padded_rows:
        raise ValueError(f"arrays.rows.shape={arrays.rows.shape}: expected ({plan.padded_rows}, D), the plan's "
                         "sharded layout (shard_arrays)")
    if ids.ndim < 1 or ids.shape[0] % n:
        raise ValueError(f"ids.shape={ids.shape}: the batch (dim 0) must split evenly over {axis!r} ({n} devices)")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids dtype {ids.dtype}: expected integer row ids")
    if not isinstance(ids, jax.core.Tracer):
        plan.check_ids(ids)
    return n
