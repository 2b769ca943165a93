"""Thresholded gradient sparsification with error feedback (the DCT reading of issue 39):
each replica sends only its gradient's largest-magnitude entries and carries the rest
into its next step, so nothing is lost, only delayed.

``select`` is the rule of what one replica sends: of the entries (gradient plus
carried residual) whose magnitude reaches the leaf's threshold, at most the
``k = ceil(ratio * size)`` largest (a static size, so the exchange has one shape); the
rest is carried. The threshold is hard (the paper's), re-estimated every
``threshold_every`` steps as the magnitude of the k-th largest entry; between those
steps fewer than k may pass. ``ratio`` 1 keeps everything: the plain gradient.
``jaxpar.hetero.reduction`` exchanges what ``select`` keeps over a mesh's data axis;
``sparsify(ratio, threshold_every)`` is the same rule as an optax transformation of
one replica's gradients (what a replica would apply alone).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class SparsifyState(NamedTuple):
    residual: optax.Updates  # what earlier steps did not send, per leaf
    threshold: optax.Updates  # each leaf's current threshold, float32 scalars
    count: jax.Array  # steps taken


def threshold_of(x: jax.Array, ratio: float) -> jax.Array:
    """The magnitude of ``x``'s ``ceil(ratio * size)``-th largest entry (float32); 0 when
    that is every entry (``ratio`` 1): the ``k`` slots hold them all, so every entry is
    sent at every step, not only those above the smallest magnitude of the last
    re-estimation."""
    k = max(1, math.ceil(ratio * x.size))
    if k >= x.size:
        return jnp.zeros((), jnp.float32)
    return jax.lax.top_k(jnp.abs(x.astype(jnp.float32)).ravel(), k)[0][-1]


def select(total: jax.Array, threshold: jax.Array, ratio: float):
    """``(values [k], indices [k] int32, residual)``: of ``total``'s entries whose
    magnitude reaches ``threshold``, the ``k = ceil(ratio * size)`` largest (zero values
    where fewer pass: a static size to exchange), and ``total`` less what is sent. The
    one rule of what a replica sends, whether it then exchanges it
    (``jaxpar.hetero.reduction``) or keeps it (``sparsify``)."""
    k = max(1, math.ceil(ratio * total.size))
    flat = total.ravel()
    magnitude = jnp.abs(flat.astype(jnp.float32))
    top, indices = jax.lax.top_k(jnp.where(magnitude >= threshold, magnitude, -1.0), k)
    values = jnp.where(top >= 0, flat[indices], 0).astype(flat.dtype)
    return values, indices.astype(jnp.int32), flat.at[indices].add(-values).reshape(total.shape)


def sparsify(ratio: float, threshold_every: int = 1) -> optax.GradientTransformation:
    """Keep each leaf's entries at or above its threshold (re-estimated every
    ``threshold_every`` steps for ``ratio`` of its entries), carrying the rest."""
    if not 0 < ratio <= 1:
        raise ValueError(f"optimizer.compression_ratio={ratio!r} must be in (0, 1]")
    if threshold_every < 1:
        raise ValueError(f"optimizer.threshold_every={threshold_every!r} must be at least 1")

    def init(params):
        return SparsifyState(jax.tree.map(jnp.zeros_like, params),
                             jax.tree.map(lambda p: jnp.zeros((), jnp.float32), params), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        del params
        total = jax.tree.map(lambda g, r: g + r.astype(g.dtype), updates, state.residual)
        fresh = state.count % threshold_every == 0
        threshold = jax.tree.map(lambda t, x: jnp.where(fresh, threshold_of(x, ratio), t), state.threshold, total)
        residual = jax.tree.map(lambda x, t: select(x, t, ratio)[2], total, threshold)
        kept = jax.tree.map(lambda x, r: x - r, total, residual)
        return kept, SparsifyState(residual, threshold, state.count + 1)

    return optax.GradientTransformation(init, update)
