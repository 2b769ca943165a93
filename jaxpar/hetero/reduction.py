"""The data-parallel gradient reduction beyond the mean (issue 39): Adasum and DCT's
thresholded top-k exchange with error feedback, as collectives over a mesh's ``data``
axis inside the train step (``jaxpar.train.step.make_train_step(..., reduction=...)``).

The mean needs nothing here: XLA all-reduces the gradients of the whole batch's loss
itself, and ``Reduction()`` (the mean, uncompressed) leaves that program as it is.
Otherwise each data-parallel replica computes its own gradient under ``shard_map``
manual over ``data`` only (the train step's one per-replica part,
``jaxpar.train.gradients.over_replicas``: the other axes stay automatic, so FSDP, tensor
and sequence sharding work inside a replica as they do without it, and FSDP's gradients
are reduced within the replica by XLA as usual), its loss being the token-weighted mean
of its own rows (with gradient accumulation, of all its microbatches: the replicas
accumulate, then reduce once). The replicas' gradients then combine, inside that
``shard_map``, by:

* ``adasum``: Adasum (``jaxpar.hetero.adasum``), leaf by leaf as Horovod does, by
  recursive doubling: at level ``k`` replica ``i`` swaps its partial result with
  replica ``i xor 2^k`` (``ppermute``) and both combine the pair in the same order
  (lower replica first), so every replica ends with the same gradient, equal to
  ``adasum.reduce_stacked`` over the replicas in order. Identical gradients give that
  gradient (the mean); orthogonal ones their sum. The data axis must be a power of two
  (refused otherwise, as Horovod refuses): the pairing of a remainder would make the
  result depend on which replica is left over. Each level sends the whole gradient:
  ``log2(n) S`` bytes per device against the mean's all-reduce ``2 (n - 1) / n S``
  (Horovod's vector-halving variant sends ``2 (n - 1) / n S`` but needs partial dot
  products all-reduced within groups; not done here).
* ``dct_topk`` (compression, with either kind): each replica adds its residual (what
  it has not sent yet) to its gradient, keeps each leaf's entries at or above the
  leaf's hard threshold, re-estimated every ``threshold_every`` steps as the magnitude
  of the ``k = ceil(ratio * size)``-th largest entry (``compression.threshold_of``),
  and sends at most ``k`` of them: the exchange has a static shape, so between
  re-estimations, when more than ``k`` entries pass the threshold, the ``k`` largest
  are sent and the others stay in the residual; when fewer pass, the rest of the ``k``
  slots carry zeros. ``(values, indices)`` are ``all_gather``ed over ``data``
  (``(n - 1) 8 k`` bytes per device per f32 leaf, less than the all-reduce's
  ``2 (n - 1) / n 4 size`` while ``ratio < 1 / n``), and every replica rebuilds the
  same dense result: with ``mean`` the sum of the replicas' sparse gradients over
  ``n``, added one replica after another (each scatter has unique indices, so the
  sum's order is fixed on every backend and the replicas agree bit for bit); with
  ``adasum`` the Adasum of the ``n`` densified sparse gradients, ``[n, size]`` per
  leaf in memory. What a replica did not send stays in its residual: over any number
  of steps, its sent entries plus its residual sum to its raw gradients. Ratio 1
  sends everything (the plain reduction).

The residuals and thresholds are per replica, state sharded over ``data`` (``[n,
...]`` per leaf, ``ResidualState``), and live in the optimizer state: the step's
optimizer is ``optax.chain(carried(n), tx)`` (``with_state``), so checkpoints hold them
and a resume is exact (onto the same ``data`` size). ``carried``'s own update passes
the gradients through; the step replaces its state with the one ``exchange`` returns
before ``tx`` runs.

The replicas' losses are means over their own tokens, so with masks that count
different numbers of tokens per replica the reduced gradient is the mean of the
replicas' means (as in Horovod or PyTorch DDP), not the batch's token-weighted mean the
plain step computes; they agree when every replica counts as many tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.hetero import adasum
from jaxpar.hetero.compression import select, threshold_of
from jaxpar.placement import rules as rules_lib

AXIS = "data"
KINDS = ("mean", "adasum")
COMPRESSIONS = ("none", "dct_topk")


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How the data-parallel replicas' gradients combine (the module docstring).

    kind: ``mean`` or ``adasum``. compression: ``none`` or ``dct_topk``. ratio: with
    ``dct_topk``, the share of each leaf's entries sent per step, in ``(0, 1]``.
    threshold_every: with ``dct_topk``, steps between threshold re-estimations (>= 1).
    """

    kind: str = "mean"
    compression: str = "none"
    ratio: float = 0.01
    threshold_every: int = 10

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"optimizer.reduction={self.kind!r} must be one of {list(KINDS)}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"optimizer.compression={self.compression!r} must be one of {list(COMPRESSIONS)}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"optimizer.compression_ratio={self.ratio!r} must be in (0, 1]")
        if self.threshold_every < 1:
            raise ValueError(f"optimizer.threshold_every={self.threshold_every!r} must be at least 1")

    @property
    def is_mean(self) -> bool:
        """Whether this is the plain mean, which the step leaves to XLA."""
        return self.kind == "mean" and self.compression == "none"

    @property
    def compressed(self) -> bool:
        return self.compression == "dct_topk"


class ResidualState(NamedTuple):
    residual: optax.Updates  # [n, *leaf] per leaf: each replica's unsent gradient
    threshold: optax.Updates  # [n] float32 per leaf: each replica's current threshold
    count: jax.Array  # steps taken


def replicas(mesh) -> int:
    return mesh.shape.get(AXIS, 1)


def check(reduction: Reduction, mesh) -> None:
    """Raises a one-line ``ValueError`` where ``reduction`` cannot run on ``mesh``."""
    if mesh is None:
        raise ValueError(f"optimizer.reduction={reduction.kind} / compression={reduction.compression} "
                         "reduces over a mesh's data axis: give the step a mesh")
    n = replicas(mesh)
    if reduction.kind == "adasum" and n & (n - 1):
        raise ValueError(f"optimizer.reduction=adasum needs a power-of-two mesh.data, not {n} "
                         "(Adasum's pairwise tree, as Horovod's)")


def carried(n: int) -> optax.GradientTransformation:
    """Holds ``n`` replicas' residuals and thresholds in the optimizer state; its update
    passes the gradients and its state through (the step computes the new state)."""
    def init(params):
        return ResidualState(jax.tree.map(lambda p: jnp.zeros((n, *p.shape), p.dtype), params),
                             jax.tree.map(lambda p: jnp.zeros((n,), jnp.float32), params),
                             jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        del params
        return updates, state

    return optax.GradientTransformation(init, update)


def with_state(tx: optax.GradientTransformation, reduction: Reduction, mesh) -> optax.GradientTransformation:
    """The step's optimizer: ``optax.chain(carried(n), tx)`` with compression, else ``tx``."""
    return optax.chain(carried(replicas(mesh)), tx) if reduction.compressed else tx


def state_shardings(reduction: Reduction, opt_sharding, params_sharding, mesh):
    """``opt_sharding`` (``like_params``' shardings of ``with_state``'s state) with the
    carried state split over ``data``: ``P("data", *the leaf's spec)``."""
    if not reduction.compressed:
        return opt_sharding

    def stacked(s):
        if AXIS in jax.tree.leaves(tuple(s.spec)):
            raise ValueError(f"a parameter sharded over {AXIS!r} ({s.spec}) cannot carry per-replica residuals")
        return NamedSharding(mesh, PartitionSpec(AXIS, *s.spec))

    over_data = NamedSharding(mesh, PartitionSpec(AXIS))
    carried_sharding = ResidualState(jax.tree.map(stacked, params_sharding),
                                     jax.tree.map(lambda _: over_data, params_sharding),
                                     NamedSharding(mesh, PartitionSpec()))
    return (carried_sharding, *opt_sharding[1:])


def without_axis(rules, axis: str):
    """``rules`` with ``axis`` removed from every rule (a dimension mapped only to it
    becomes replicated): what activations follow inside a ``shard_map`` manual over it."""
    if rules is None:
        return None

    def drop(mesh_axes):
        kept = tuple(a for a in rules_lib.as_tuple(mesh_axes) if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return tuple((name, drop(mesh_axes)) for name, mesh_axes in rules)


def adasum_over(grads, axis: str, n: int):
    """Adasum of the ``n`` replicas' ``grads`` over ``axis`` (a power of two) by recursive
    doubling; every replica returns the same tree, ``adasum.reduce_stacked``'s."""
    me = jax.lax.axis_index(axis)
    level = 1
    while level < n:
        theirs = jax.lax.ppermute(grads, axis, [(i, i ^ level) for i in range(n)])
        lower = (me & level) == 0  # this replica's block comes first in the pair
        first = jax.tree.map(lambda a, b: jnp.where(lower, a, b), grads, theirs)
        second = jax.tree.map(lambda a, b: jnp.where(lower, b, a), grads, theirs)
        grads = adasum.combine(first, second)
        level *= 2
    return grads


def exchange(grads, state: ResidualState, reduction: Reduction, n: int):
    """One replica's side of ``dct_topk``: ``(reduced grads, new local state)``; the
    local state's leaves are this replica's ``[1, ...]`` blocks."""
    fresh = state.count % reduction.threshold_every == 0

    def leaf(g, residual, threshold):
        # The selection whole within the replica (its top-k reads every entry anyway):
        # XLA's SPMD partitioner aborts on its gather from a leaf split over two auto
        # axes (fsdp x tensor, JAX 0.10).
        total = jax.lax.with_sharding_constraint(g + residual[0].astype(g.dtype), PartitionSpec())
        t = jnp.where(fresh, threshold_of(total, reduction.ratio), threshold[0])
        values, indices, left = jax.lax.with_sharding_constraint(select(total, t, reduction.ratio), PartitionSpec())
        gathered = jax.lax.all_gather(values, AXIS), jax.lax.all_gather(indices, AXIS)  # [n, k] each
        combine = sparse_mean if reduction.kind == "mean" else sparse_adasum
        return combine(*gathered, g.shape).astype(g.dtype), left[None], t[None]

    out = jax.tree.map(leaf, grads, state.residual, state.threshold)
    part = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=lambda o: isinstance(o, tuple))  # noqa: E731
    return part(0), ResidualState(part(1), part(2), state.count + 1)


def sparse_mean(values: jax.Array, indices: jax.Array, shape) -> jax.Array:
    """The mean of ``n`` sparse gradients (``values``, ``indices``: ``[n, k]``) as a dense
    float32 array of ``shape``, added in replica order (the same on every replica)."""
    n = values.shape[0]

    def add(r, total):
        return total.at[indices[r]].add(values[r].astype(jnp.float32), unique_indices=True)

    total = jax.lax.fori_loop(0, n, add, jnp.zeros(math.prod(shape), jnp.float32))
    return (total / n).reshape(shape)


def sparse_adasum(values: jax.Array, indices: jax.Array, shape) -> jax.Array:
    """The Adasum of ``n`` sparse gradients (``[n, k]`` each), densified ``[n, size]``."""
    n = values.shape[0]
    dense = jnp.zeros((n, math.prod(shape)), jnp.float32).at[jnp.arange(n)[:, None], indices].set(
        values.astype(jnp.float32))
    return adasum.reduce_stacked(dense).reshape(shape)
