"""The one attention entry point every model layer calls.

Decoding caches, ring attention over the ``seq`` axis and the fused kernels (Pallas
flash and decode attention, cuDNN) plug in behind this signature without touching the
model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.kernels import masks
from jaxpar.ops import kernel_ops
from jaxpar.placement import rules as rules_lib
from jaxpar.parallel.sequence import ring_attention
from jaxpar.placement.execution import current, rules_for

# Large but finite, so a fully masked row gives a uniform softmax rather than NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    q_start: jax.Array | int | None = None,
    tree_mask: jax.Array | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention with grouped-query heads, computed in float32.

    Args:
      q: queries ``[B, T, N, H]``.
      k: keys ``[B, S, K, H]``; ``N`` must be a multiple of ``K`` (query head ``n``
        reads key/value head ``n // (N // K)``, as Hugging Face's ``repeat_kv``).
      v: values ``[B, S, K, H]``.
      causal: query ``t`` sees keys ``s <= q_start + t``.
      segment_ids: ``[B, T]`` int document ids for packed sequences (needs ``T == S``);
        a query sees only keys of its own segment.
      q_start: slot of the first query among the keys: a scalar (possibly traced) or
        one per sequence, int ``[B]``. Default ``S - T``: the queries are the last ``T``
        keys. A preallocated KV cache passes its lengths before the new tokens, so
        slots not yet written (or rolled back) are never seen.
      tree_mask: bool ``[B, T, T]``, with ``q_start``: among the ``T`` new keys, query
        ``t`` sees key ``j`` where ``tree_mask[b, t, j]`` (a token tree; ``causal``
        then governs nothing more); every query sees all keys before ``q_start``.
      mask: bool ``[B, T, S]``, an explicit mask (query ``t`` sees key ``s`` where
        True) combined with the others: cross-attention into another model's cache.
        Computed by this function's XLA code whatever the kernel options; a query it
        leaves no key gets zeros.

    Returns:
      ``[B, T, N, H]`` in ``q``'s dtype.

    Sequence parallelism: when the mesh in context (``jax.set_mesh``) splits
    ``activation_length`` over an axis of size > 1 under the rules in force and the
    queries are the keys (no cache), this is ``jaxpar.ring_attention`` over that axis,
    with the impl and token layout of the ``Execution`` in force (``jaxpar.use_execution``)
    (default: the blockwise ring, natural order).

    Kernels: ``jaxpar.kernels.KernelOptions.attention`` (``execution.attention``) picks who
    computes it: this function's XLA code, the Pallas flash attention kernel (and the
    Pallas decode kernel over a cache), or cuDNN (``jaxpar.ops.kernel_ops``).
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    options = current().sequence
    # The ring knows causal and segment masks only: an explicit mask stays on this path.
    axis = _length_axis(options.always) if q_start is None and T == S and mask is None else None
    if axis is not None:
        return ring_attention(q, k, v, mesh=jax.sharding.get_abstract_mesh(), causal=causal,
                              segment_ids=segment_ids, axis=axis, impl=options.impl,
                              layout=options.layout)
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of key/value heads K={K}")
    start = jnp.broadcast_to(jnp.asarray(S - T if q_start is None else q_start, jnp.int32), (B,))
    out = None
    if mask is None and q_start is None and T == S and tree_mask is None:
        out = kernel_ops.attention(q, k, v, causal=causal, segment_ids=segment_ids)
    elif mask is None and (causal or tree_mask is not None) and segment_ids is None:
        out = kernel_ops.decode_attention(q, k, v, start + T, tree_mask)
    if out is not None:
        return out
    if segment_ids is not None and T != S:
        raise ValueError(f"segment_ids need equal query and key lengths, got T={T}, S={S}")
    return _xla_attention(q, k, v, start, causal=causal, segment_ids=segment_ids, tree_mask=tree_mask,
                          mask=mask)


def _xla_attention(q, k, v, start, *, causal, segment_ids, tree_mask, mask):
    """This module's XLA attention: ``dot_product_attention``'s masks over float32 scores,
    the queries at slots ``start [B] + t`` among the keys."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    q = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
    scores = scores * (H ** -0.5)
    q_pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]: the queries' slots among the keys
    visible = masks.visible(q_pos, jnp.arange(S), segment_ids, segment_ids,
                            causal=causal and tree_mask is None)
    for extra in (None if tree_mask is None else masks.tree_visible(start, T, S, tree_mask), mask):
        if extra is not None:
            visible = extra if visible is None else visible & extra
    if visible is not None:
        scores = jnp.where(visible[:, None, None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    if mask is not None:  # a query that sees no key reads nothing (as the Pallas kernels do)
        out = jnp.where(visible.any(-1)[:, :, None, None, None], out, 0.0)
    return out.reshape(B, T, N, H).astype(q.dtype)


def _length_axis(always: bool) -> str | None:
    """The mesh axis the rules split the attention length over, if it has size > 1
    (or any size, with ``always``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    axes = rules_lib.as_tuple(dict(rules_for(mesh, "jaxpar.dot_product_attention")).get("activation_length"))
    axes = tuple(a for a in axes if mesh.shape[a] > 1 or always)
    if len(axes) > 1:
        raise ValueError(f"attention: the rules split activation_length over {axes}; sequence "
                         "parallelism rings over one mesh axis")
    return axes[0] if axes else None
