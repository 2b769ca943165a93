"""The model's fused operations: attention, norm and loss, each run by the implementation
the ``Execution``'s ``KernelOptions`` choose (XLA, cuDNN or the Pallas kernels).

A Pallas kernel is one device's program: XLA cannot partition it. So with a mesh in
context each kernel runs under ``jax.shard_map`` on its device's slice (batch rows and
heads split as the rules split the activations, everything a row needs whole). Where
the rules split what the kernel must see whole (the model width of a norm's rows on the
2D tensor grid) ``norm`` returns None and the caller runs the XLA computation, which
GSPMD partitions. The loss handles a split vocabulary itself (``token_losses``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar import kernels
from jaxpar.kernels.dispatch import pallas_interpret
from jaxpar.placement.execution import implementation
from jaxpar.placement.axes import kv_heads_for, local_axes, shard_index


def _mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def _per_device(fn, mesh, in_specs, out_specs, *args):
    if mesh is None:
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)


# ------------------------------------------------------------------------ attention


def _head_layout(mesh, B, N, K):
    """How per-device attention splits ``q [B, T, N, H]`` and ``k, v [B, S, K, H]``:
    ``(q_spec, kv_spec, local_kv)``, batch and heads as the rules split them; when the kv
    heads cannot follow the query heads (fewer kv heads than head shards), k/v stay whole
    and ``local_kv(q, k, v)`` takes each device's query heads' kv heads."""
    batch_axes = head_axes = kv_axes = ()
    if mesh is not None:
        batch_axes = local_axes(mesh, "activation_batch", B)
        head_axes = local_axes(mesh, "activation_heads", N)
        kv_axes = local_axes(mesh, "activation_kv_heads", K)
        if kv_axes != head_axes:
            kv_axes = ()

    def local_kv(q, k, v):
        if kv_axes == head_axes:
            return k, v
        return kv_heads_for(q.shape[2], N // K, head_axes, mesh, k, v)

    return (PartitionSpec(batch_axes or None, None, head_axes or None, None),
            PartitionSpec(batch_axes or None, None, kv_axes or None, None), local_kv)


def attention(q, k, v, *, causal: bool, segment_ids=None):
    """Self-attention ``q [B, T, N, H]``, ``k, v [B, T, K, H]`` -> ``[B, T, N, H]`` by
    the chosen fused implementation, or None when that is ``"xla"`` (the caller's)."""
    impl = implementation("attention")
    if impl == "xla":
        return None
    mesh = _mesh()
    q_spec, kv_spec, local_kv = _head_layout(mesh, q.shape[0], q.shape[2], k.shape[2])

    def local(q, k, v, seg):
        k, v = local_kv(q, k, v)
        if impl == "cudnn":
            mask = None if seg is None else (seg[:, :, None] == seg[:, None, :])[:, None]
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                                implementation="cudnn")
        return kernels.flash_attention(q, k, v, causal=causal, segment_ids=seg,
                                       interpret=pallas_interpret())

    seg_spec = None if segment_ids is None else PartitionSpec(q_spec[0], None)
    with jax.named_scope(f"attention_{impl}"):
        return _per_device(local, mesh, (q_spec, kv_spec, kv_spec, seg_spec), q_spec,
                           q, k, v, segment_ids)


# Query tokens per sequence up to which the decode kernel runs (a token tree being
# verified); a longer prefill over a cache is XLA's.
DECODE_MAX_QUERIES = 16


def decode_attention(q, k_cache, v_cache, lengths, tree_mask=None):
    """``q [B, T, N, H]`` over a cache ``[B, S, K, H]`` whose first ``lengths [B]`` slots
    are filled (the T new tokens last, seen causally or by ``tree_mask [B, T, T]``) by
    the Pallas decode kernel, or None when the chosen attention is not ``"pallas"`` or
    ``T > DECODE_MAX_QUERIES``."""
    if implementation("attention") != "pallas" or q.shape[1] > DECODE_MAX_QUERIES:
        return None
    mesh = _mesh()
    q_spec, kv_spec, local_kv = _head_layout(mesh, q.shape[0], q.shape[2], k_cache.shape[2])
    batch_spec = PartitionSpec(q_spec[0])

    def local(q, k, v, lengths, *tree):
        k, v = local_kv(q, k, v)
        return kernels.decode_attention(q, k, v, lengths, tree_mask=tree[0] if tree else None,
                                        interpret=pallas_interpret())

    if tree_mask is None:
        return _per_device(local, mesh, (q_spec, kv_spec, kv_spec, batch_spec), q_spec,
                           q, k_cache, v_cache, lengths)
    return _per_device(local, mesh, (q_spec, kv_spec, kv_spec, batch_spec, batch_spec), q_spec,
                       q, k_cache, v_cache, lengths, tree_mask)


def paged_decode_attention(q, k_pages, v_pages, layer, tables, lengths):
    """``q [B, T, N, H]`` over layer ``layer`` of every layer's pages ``[L, P, S_p, K,
    H]``, sequence ``b``'s slots read through ``tables [B, max_pages]`` up to ``lengths
    [b]`` (the T new tokens last, already written, seen causally), by the Pallas paged
    decode kernel; or None when the chosen attention is not ``"pallas"``, ``T >
    DECODE_MAX_QUERIES``, or the kv heads stay whole while the query heads are split
    (more head shards than kv heads): the caller then gathers the pages, since slicing
    each device's kv heads out of the pages would copy every layer's. With a mesh, each
    device runs the kernel on its batch rows and kv heads, over all the pages."""
    if implementation("attention") != "pallas" or q.shape[1] > DECODE_MAX_QUERIES:
        return None
    mesh = _mesh()
    q_spec, kv_spec, _ = _head_layout(mesh, q.shape[0], q.shape[2], k_pages.shape[3])
    if kv_spec[2] != q_spec[2]:
        return None
    pages_spec = PartitionSpec(None, None, None, kv_spec[2], None)

    def local(q, k, v, layer, tables, lengths):
        return kernels.paged_decode_attention(q, k, v, layer, tables, lengths, interpret=pallas_interpret())

    return _per_device(local, mesh, (q_spec, pages_spec, pages_spec, PartitionSpec(),
                                     PartitionSpec(q_spec[0], None), PartitionSpec(q_spec[0])),
                       q_spec, q, k_pages, v_pages, layer, tables, lengths)


def ragged_paged_attention(q, k_pages, v_pages, layer, seq, positions, tables):
    """A flat batch of tokens ``q [T, N, H]`` (decode tokens and prompt chunks mixed),
    token ``t`` of sequence ``seq[t]`` (a row of ``tables [S, W]``; ``-1``: padding, zeros
    out) at slot ``positions[t]``, its key and value already written, attending to its
    sequence's slots ``0 .. positions[t]`` of layer ``layer`` of every layer's pages
    ``[L, P, S_p, K, H]``, by the Pallas ragged paged attention kernel
    (``jaxpar.kernels.ragged_paged_attention``); or None when the chosen attention is not
    ``"pallas"``, or the kv heads stay whole while the query heads are split (more head
    shards than kv heads): the caller then runs its XLA attention, since slicing each
    device's kv heads out of the pages would copy every layer's. With a mesh, each device
    runs the kernel on its query heads and their kv heads, over all the pages and every
    token (the tokens are not split: a token may read any sequence's pages)."""
    if implementation("attention") != "pallas":
        return None
    mesh = _mesh()
    q_spec, kv_spec, _ = _head_layout(mesh, 1, q.shape[1], k_pages.shape[3])
    if kv_spec[2] != q_spec[2]:
        return None
    tokens_spec = PartitionSpec(None, q_spec[2], None)
    pages_spec = PartitionSpec(None, None, None, kv_spec[2], None)

    def local(q, k, v, layer, seq, positions, tables):
        return kernels.ragged_paged_attention(q, k, v, layer, seq, positions, tables,
                                              interpret=pallas_interpret())

    return _per_device(local, mesh, (tokens_spec, pages_spec, pages_spec, PartitionSpec(), PartitionSpec(None),
                                     PartitionSpec(None), PartitionSpec(None, None)),
                       tokens_spec, q, k_pages, v_pages, layer, seq, positions, tables)


# ----------------------------------------------------------------------------- norm


def norm(x, scale, bias, *, kind: str, eps: float):
    """The fused norm of ``x [B, T, D]`` (float32 statistics, ``x``'s dtype out), or None
    when the chosen norm is ``"xla"`` or the rules split the model width."""
    if implementation("norm") != "pallas":
        return None
    mesh = _mesh()
    spec = PartitionSpec()
    if mesh is not None:
        if local_axes(mesh, "activation_embed", x.shape[-1]):
            return None
        rows = (local_axes(mesh, "activation_batch", x.shape[0]),
                local_axes(mesh, "activation_norm_length", x.shape[1]))
        spec = PartitionSpec(*(axes or None for axes in rows), None)
    fn = functools.partial(kernels.norm, kind=kind, eps=eps, interpret=pallas_interpret())
    if bias is None:
        return _per_device(lambda x, s: fn(x, s), mesh, (spec, PartitionSpec()), spec, x, scale)
    return _per_device(fn, mesh, (spec, PartitionSpec(), PartitionSpec()), spec, x, scale, bias)


# ----------------------------------------------------------------------------- loss


def token_losses(x, w, targets):
    """Per-token cross-entropy ``[B, T]`` float32 of ``softmax(x w)``: ``x [B, T, D]``
    final hidden states, ``w [D, V]`` the vocabulary projection, ``targets [B, T]``; by the
    fused kernel (the ``[B, T, V]`` logits never exist), or None when the chosen loss is
    ``"xla"``.

    When the rules split the vocabulary (tensor parallelism), each device runs the kernel
    on its slice of ``w`` and the per-slice log-sum-exps and target logits combine across
    the slices (Megatron's vocab-parallel cross-entropy, without its logits)."""
    if implementation("loss") != "pallas":
        return None
    mesh = _mesh()
    rows, vocab_axes = PartitionSpec(), ()
    if mesh is not None:
        vocab_axes = local_axes(mesh, "activation_vocab", w.shape[1])
        rows = PartitionSpec(local_axes(mesh, "activation_batch", x.shape[0]) or None,
                             local_axes(mesh, "activation_length", x.shape[1]) or None)

    def local(x, w, targets):
        B, T, D = x.shape
        targets = targets.reshape(B * T)
        if vocab_axes:  # this device's slice of the vocabulary starts at shard * V_local
            # (targets outside [0, V_local) pick nothing here)
            targets = targets - shard_index(mesh, vocab_axes) * w.shape[1]
        lse, picked = kernels.log_sum_exp_and_target_logit(
            x.reshape(B * T, D), w, targets, interpret=pallas_interpret())
        if vocab_axes:
            top = jax.lax.pmax(jax.lax.stop_gradient(lse), vocab_axes)
            lse = top + jnp.log(jax.lax.psum(jnp.exp(lse - top), vocab_axes))
            picked = jax.lax.psum(picked, vocab_axes)
        return (lse - picked).reshape(B, T)

    x_spec = PartitionSpec(*rows, None)
    w_spec = PartitionSpec(None, vocab_axes or None)
    return _per_device(local, mesh, (x_spec, w_spec, rows), rows, x, w, targets.astype(jnp.int32))
