"""The one attention entry point every model layer calls.

Decoding caches, ring attention over the ``seq`` axis and the fused kernels (Pallas
flash and decode attention, cuDNN) plug in behind this signature without touching the
model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar import fused
from jaxpar import rules as rules_lib
from jaxpar.sequence_parallel import current_options, ring_attention
from jaxpar.sharding import context_rules

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
      q_start: position of the first query among the keys (a scalar, possibly traced).
        Default ``S - T``: the queries are the last ``T`` keys. A preallocated KV cache
        passes its fill level, so slots not yet written are never seen.

    Returns:
      ``[B, T, N, H]`` in ``q``'s dtype.

    Sequence parallelism: when the mesh in context (``jax.set_mesh``) splits
    ``activation_length`` over an axis of size > 1 under the rules in force and the
    queries are the keys (no cache), this is ``jaxpar.ring_attention`` over that axis,
    with the impl and token layout set by ``jaxpar.sequence_parallel.sequence_options``
    (default: the blockwise ring, natural order).

    Kernels: ``jaxpar.kernels.KernelOptions.attention`` (``attention.impl``) picks who
    computes it: this function's XLA code, the Pallas flash attention kernel (and the
    Pallas decode kernel over a cache), or cuDNN (``jaxpar.fused``).
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    options = current_options()
    axis = _length_axis(options.always) if q_start is None and T == S else None
    if axis is not None:
        return ring_attention(q, k, v, mesh=jax.sharding.get_abstract_mesh(), causal=causal,
                              segment_ids=segment_ids, axis=axis, impl=options.impl,
                              layout=options.layout)
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of key/value heads K={K}")
    if q_start is None and T == S:
        out = fused.attention(q, k, v, causal=causal, segment_ids=segment_ids)
    elif causal and segment_ids is None:
        start = S - T if q_start is None else q_start
        lengths = jnp.full((B,), start + T, jnp.int32)
        out = fused.decode_attention(q, k, v, lengths)
    else:
        out = None
    if out is not None:
        return out
    q = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
    scores = scores * (H ** -0.5)
    mask = jnp.ones((T, S), dtype=bool)
    if causal:
        start = S - T if q_start is None else q_start
        mask = jnp.arange(T)[:, None] + start >= jnp.arange(S)[None, :]
    mask = mask[None, None, None]  # [1, 1, 1, T, S]
    if segment_ids is not None:
        if T != S:
            raise ValueError(f"segment_ids need equal query and key lengths, got T={T}, S={S}")
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, S]
        mask = mask & same[:, None, None]
    scores = jnp.where(mask, scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, H).astype(q.dtype)


def _length_axis(always: bool) -> str | None:
    """The mesh axis the rules split the attention length over, if it has size > 1
    (or any size, with ``always``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    axes = rules_lib.as_tuple(dict(context_rules(mesh)).get("activation_length"))
    axes = tuple(a for a in axes if mesh.shape[a] > 1 or always)
    if len(axes) > 1:
        raise ValueError(f"attention: the rules split activation_length over {axes}; sequence "
                         "parallelism rings over one mesh axis")
    return axes[0] if axes else None
