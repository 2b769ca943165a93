"""Which key a query sees: the one rule every attention in jaxpar applies (the XLA
attention in ``jaxpar.ops.attention``, the ring in ``jaxpar.parallel.sequence``, the Pallas
kernels and their references), written once.

A token has a position (its place in the natural order of the sequence) and, in packed
sequences, a segment id (its document). Query at ``q_pos`` sees key at ``k_pos`` when

* ``causal``: ``k_pos <= q_pos``;
* ``window`` w: ``q_pos - k_pos < w`` (and ``k_pos - q_pos < w`` when not causal);
* segment ids given: the two ids are equal.

Queries over a cache being filled (a block of new tokens at the end, possibly a token
tree) follow from the same positions: ``tree_visible``. The references' softmax over
what a query sees (a row that sees nothing all zeros, not NaN): ``masked_softmax``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible(q_pos, k_pos, q_seg=None, k_seg=None, *, causal: bool, window: int | None = None):
    """``[..., T, S]`` bool, or None when nothing is masked (every key seen).

    ``q_pos [..., T]``, ``k_pos [..., S]`` int positions; ``q_seg [..., T]``, ``k_seg
    [..., S]`` segment ids or None. Leading dimensions broadcast (positions ``[T]`` with
    segment ids ``[B, T]`` give ``[B, T, S]``)."""
    mask = None
    if causal or window is not None:
        distance = q_pos[..., :, None] - k_pos[..., None, :]
        if causal:
            mask = distance >= 0
        if window is not None:
            near = distance < window
            if not causal:
                near &= -distance < window
            mask = near if mask is None else mask & near
    if q_seg is not None:
        same = q_seg[..., :, None] == k_seg[..., None, :]
        mask = same if mask is None else mask & same
    return mask


def tree_visible(start, T: int, S: int, tree_mask):
    """``[B, T, S]`` bool: ``T`` new tokens at slots ``start[b] .. start[b] + T - 1`` of
    ``S`` (``start [B]`` int); query ``t`` sees every slot before ``start[b]`` and new token
    ``j`` where ``tree_mask[b, t, j]`` (``[B, T, T]`` bool, a token tree's
    ancestors-or-self; the lower triangle is causal); never a slot after the new tokens."""
    B = start.shape[0]
    new = jnp.arange(S)[None, None, :] - start[:, None, None]  # a slot's index among the new
    in_tree = jnp.take_along_axis(jnp.broadcast_to(tree_mask, (B, T, T)),
                                  jnp.broadcast_to(jnp.clip(new, 0, T - 1), (B, T, S)), axis=2)
    return (new < 0) | ((new < T) & in_tree)


def masked_softmax(scores: jax.Array, visible: jax.Array) -> jax.Array:
    """Softmax over the last axis of ``scores`` (float32) among the ``visible`` entries
    (bool, broadcast against it): the references' rule, a row with nothing visible is
    all zeros rather than NaN."""
    scores = jnp.where(visible, scores, -jnp.inf)
    top = scores.max(-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(top == -jnp.inf, 0.0, top))  # all zeros if nothing visible
    total = p.sum(-1, keepdims=True)
    return p / jnp.where(total == 0, 1.0, total)
