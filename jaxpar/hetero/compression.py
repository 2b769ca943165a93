"""Thresholded gradient sparsification with error feedback (the DCT reading of issue 39):
each replica sends only its gradient's largest-magnitude entries and carries the rest
into its next step, so nothing is lost, only delayed.

``sparsify(ratio, threshold_every)`` is an optax transformation of one replica's
gradients: it adds the carried residual, keeps the entries whose magnitude reaches the
leaf's threshold (zeros elsewhere) and carries what it did not keep. The threshold is
hard (the paper's), re-estimated every ``threshold_every`` steps as the magnitude of
the ``ceil(ratio * size)``-th largest entry (a top-k by ratio at those steps; between
them, the share kept drifts with the gradients). ``ratio`` 1 keeps everything: the
plain gradient. The exchange of only the kept entries over the data axes is to come;
this is the replica's side.
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
    """The magnitude of ``x``'s ``ceil(ratio * size)``-th largest entry (float32)."""
    k = max(1, math.ceil(ratio * x.size))
    return jax.lax.top_k(jnp.abs(x.astype(jnp.float32)).ravel(), k)[0][-1]


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
        kept = jax.tree.map(lambda x, t: jnp.where(jnp.abs(x) >= t, x, 0).astype(x.dtype), total, threshold)
        residual = jax.tree.map(lambda x, k: x - k, total, kept)
        return kept, SparsifyState(residual, threshold, state.count + 1)

    return optax.GradientTransformation(init, update)
