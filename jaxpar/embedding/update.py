"""Sparse optimizer updates of embedding rows, pure and jittable.

``sparse_update`` is what a train step calls inside ``jit``: it takes the rows a batch
read (by slot in the device cache, or by id in a plain table: the function does not
care which) and the gradient with respect to those gathered rows, and changes only the
rows the batch touched. Duplicate slots are summed into one row gradient first (a
segment sum over the batch's unique slots, in the batch's flattened order), so the
result is what a dense table of the same optimizer gives when only touched rows are
updated: the gradient of a gather is the same scatter-add, in the same order.

Optimizers (DLRM trains its tables with row-wise Adagrad; FBGEMM's
``EXACT_ROWWISE_ADAGRAD`` and TorchRec's default are the same rule):

- ``sgd``: ``row -= lr * g``; no state.
- ``adagrad`` (row-wise): one float32 accumulator per row, ``acc += mean_D(g^2)``,
  ``row -= lr * g / (sqrt(acc) + eps)``.

Shapes: ``slots [...]`` int, ``grads [..., D]``, ``rows [C, D]``, ``state [C]``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

KINDS = ("sgd", "adagrad")


@dataclasses.dataclass(frozen=True)
class SparseOptimizer:
    """The row update rule; hashable, so a jitted step can take it as a static argument.
    The learning rate is not here: it is an argument of ``sparse_update`` so a schedule
    does not recompile the step."""

    kind: Literal["sgd", "adagrad"] = "adagrad"
    # FBGEMM's default; guards the first update of a row whose gradient is tiny.
    eps: float = 1e-8
    # Starting accumulator of every row (torch's and FBGEMM's default is 0).
    initial_accumulator: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"optimizer kind={self.kind!r}: expected one of {KINDS}")
        if not self.eps > 0:
            raise ValueError(f"optimizer eps={self.eps}: expected a positive number")

    @property
    def has_state(self) -> bool:
        return self.kind == "adagrad"


class CacheArrays(NamedTuple):
    """The device side of the cache (a pytree, so a jitted step takes and returns it,
    donated): ``rows [C, D]`` float32 and the per-row optimizer state ``state [C]``
    (``None`` for SGD)."""

    rows: jax.Array
    state: jax.Array | None


def lookup(arrays: CacheArrays, slots) -> jax.Array:
    """The rows at ``slots [...]`` of a cache or an unsharded table: ``[..., D]``."""
    return arrays.rows[slots]


def sparse_update(arrays: CacheArrays, slots, grads, lr, *, optimizer: SparseOptimizer) -> CacheArrays:
    """``arrays`` with the rows at ``slots`` updated by ``grads`` (the gradient with
    respect to ``arrays.rows[slots]``); every other row and its state unchanged."""
    rows, state = arrays
    C, D = rows.shape
    if grads.shape != (*slots.shape, D):
        raise ValueError(f"grads.shape={grads.shape}: expected slots.shape + (D,) = {(*slots.shape, D)}")
    if optimizer.has_state != (state is not None):
        raise ValueError(f"optimizer {optimizer.kind!r} with state={'None' if state is None else 'an array'}")
    flat, grads = _whole(slots.reshape(-1)), _whole(grads.reshape(-1, D))
    N = flat.shape[0]
    # Padding entries get slot C, out of bounds: the gathers fill them, the scatters drop them.
    uniq, inverse = jnp.unique(flat, size=N, fill_value=C, return_inverse=True)
    g = jax.ops.segment_sum(grads, inverse.reshape(N), num_segments=N)  # [N, D]
    old = rows.at[uniq].get(mode="fill", fill_value=0)
    if optimizer.kind == "sgd":
        new = old - lr * g
    else:
        acc = state.at[uniq].get(mode="fill", fill_value=0) + jnp.mean(g * g, axis=-1)
        new = old - lr * g / (jnp.sqrt(acc)[:, None] + optimizer.eps)
        state = state.at[uniq].set(acc, mode="drop")
    return CacheArrays(rows.at[uniq].set(new, mode="drop"), state)


def _whole(x):
    """``x`` replicated when its type says it is sharded (a data-parallel batch under a
    mesh of Explicit axes): the unique's sort needs the whole batch, and the rows it
    updates are replicated anyway. Under Auto axes or no mesh, ``x`` itself."""
    sharding = jax.typeof(x).sharding
    if any(axis is not None for axis in sharding.spec):
        return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
    return x
