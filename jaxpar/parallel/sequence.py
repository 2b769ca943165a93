"""Sequence parallelism: attention over a length split across one mesh axis (``seq``).

Three algorithms, one entry point (``ring_attention``):

* ``impl="ring"`` (default): blockwise ring attention (Liu et al., "Ring Attention with
  Blockwise Transformers", 2023). Each of the ``n`` devices keeps its queries; key/value
  blocks travel ``n - 1`` hops round the ring (``jax.lax.ppermute``), and each block is
  folded into a running output and log-sum-exp (the online softmax of flash attention),
  walking the block's keys ``KV_BLOCK`` at a time, so no device holds more than a
  ``[T/n, KV_BLOCK]`` score block. The transfer of the next block is issued before the
  current block is computed, so XLA overlaps them. A custom VJP rings again in the
  backward pass: keys and values travel on, their float32 gradients travel with them
  and arrive home after one last hop. Memory per device is O(T/n), never O(T²/n);
  traffic per device per layer is ``2 (n-1)`` k/v blocks forward, ``2 (n-1)`` k/v
  blocks and ``2 n`` float32 gradient blocks backward (a block: ``B T/n K H``
  elements, kv heads only). ``block_update`` / ``block_grads`` are the per-block
  computation: XLA here, and the seam where a fused GPU kernel goes.
* ``impl="rsa"``: Ring Self-Attention as in the Sequence Parallelism paper (Li et al.,
  2021, Sec. 3.2), kept as the baseline: a ring pass of keys builds each device's full
  ``[T/n, T]`` score rows, a softmax, then a ring pass of values. Differentiated by JAX,
  so the backward pass keeps the ``[T/n, T]`` probabilities.
* ``impl="ulysses"``: DeepSpeed-Ulysses (Jacobs et al., 2023): an all-to-all turns the
  length split into a head split, every device attends over the whole length for
  ``heads / n`` heads, and a second all-to-all turns it back. Needs the heads (per
  device, after tensor parallelism) divisible by ``n``. Two all-to-alls of q/k/v/out
  per layer whatever ``n`` is, against the ring's ``n - 1`` hops of k/v: better for
  short sequences with many heads; the ring wins when ``T`` is long, heads are few
  (grouped-query attention rotates only the kv heads), or ``n`` exceeds the heads.

Causal load balance. Under a causal mask the device holding the first ``T/n`` tokens
sees far fewer keys than the one holding the last. The ``"zigzag"`` layout cuts the
length into ``2n`` chunks and gives device ``i`` chunks ``i`` and ``2n - 1 - i``; then
at every ring step after the first each device computes exactly two of its four
(query chunk, key chunk) pairs, so all devices do the same work. ``layout="zigzag"``
takes and returns tokens already in that order (``to_zigzag``), as jaxpar's training
loop keeps them end to end (the loader permutes tokens, targets, positions, segment ids
and mask alike; the loss is a sum over tokens, so nothing needs undoing).
``layout="natural"`` takes and returns tokens in their natural order; under a causal
mask the ring reorders q, k, v to zigzag and the output back (when ``T`` divides by
``2n``; otherwise it runs on contiguous shards, exact but unbalanced).

Other mesh axes: the batch dimension is split as the rules split
``activation_batch``, query heads as ``activation_heads`` and kv heads as
``activation_kv_heads`` (``jaxpar.placement.execution.rules_for``), each only where the size
divides; where the query heads are split but the kv heads are not (Megatron's
replicated kv heads), each device picks the kv heads its query heads read.

Dimension letters: B batch, T length, N query heads, K kv heads, G = N / K, H head dim;
inside ``shard_map`` ``L = T / n`` local tokens in ``P`` pieces of ``C = L / P``
(``P = 2`` for zigzag).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.kernels.dispatch import pallas_interpret
from jaxpar.placement.axes import axes_size, kv_heads_for, local_axes
from jaxpar.placement.execution import SEQUENCE_IMPLS as IMPLS
from jaxpar.placement.execution import SEQUENCE_LAYOUTS as LAYOUTS
from jaxpar.placement import rules as rules_lib
from jaxpar.placement.execution import current, implementation
from jaxpar.parallel.zigzag import natural_to_zigzag, zigzag_to_natural
from jaxpar.kernels.flash_attention import block_grads as kernel_block_grads
from jaxpar.kernels.flash_attention import block_grads_reference, block_update_reference
from jaxpar.kernels.flash_attention import block_update as kernel_block_update
from jaxpar.kernels.masks import visible

# ----------------------------------------------------------------------- block math
#
# The ring's layout: q, o [B, Tq, K, G, H], lse [B, K, G, Tq] (o the float32 output
# normalised over the keys seen so far, lse their log-sum-exp, -inf before any); scores
# [B, K, G, Tq, Tk] in float32. Which keys a query sees follows from token positions (in
# natural order) and segment ids given per block (jaxpar.kernels.masks.visible), so no
# [Tq, Tk] mask is ever stored. The per-block step is jaxpar.kernels.flash_attention's:
# the Pallas kernel's, or its XLA reference.

# Keys per inner XLA step: scores live as [B, N, Tq, KV_BLOCK] at most, so memory stays
# linear in the local length.
KV_BLOCK = 512


def _scores(q, k):
    scale = q.shape[-1] ** -0.5
    return jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32) * scale


def _key_blocks(*xs):
    """Cuts arrays along their key axis (axis 0 for positions ``[Tk]``, 1 otherwise) into
    a leading axis of blocks of at most ``KV_BLOCK``; None stays None. A length with no
    divisor between ``KV_BLOCK / 8`` and ``KV_BLOCK`` (a prime, say) stays one block:
    exact, with ``[Tq, Tk]`` scores."""
    Tk = xs[0].shape[1]
    size = max(d for d in range(1, min(Tk, KV_BLOCK) + 1) if Tk % d == 0)
    if size < KV_BLOCK // 8:
        size = Tk

    def cut(x):
        if x is None:
            return None
        if x.ndim == 1:
            return x.reshape(Tk // size, size)
        return jnp.moveaxis(x.reshape(x.shape[0], Tk // size, size, *x.shape[2:]), 1, 0)

    return Tk // size, tuple(cut(x) for x in xs)


def _unblock(x):
    """[nb, B, size, ...] -> [B, nb * size, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _flat(x):
    """The ring's ``[B, T, K, G, H]`` / ``[B, K, G, T]`` as the kernels' ``[B, T, N, H]`` /
    ``[B, N, T]`` (free reshapes: query head ``n = k * G + g``)."""
    if x.ndim == 5:
        return x.reshape(*x.shape[:2], -1, x.shape[-1])
    return x.reshape(x.shape[0], -1, x.shape[-1])


def block_update(q, k, v, o, lse, q_pos, k_pos, q_seg=None, k_seg=None, *, causal: bool):
    """Folds the keys/values ``k, v`` into the running ``(o, lse)`` of queries ``q``.

    Args:
      q ``[B, Tq, K, G, H]``; k, v ``[B, Tk, K, H]``; o ``[B, Tq, K, G, H]`` float32;
      lse ``[B, K, G, Tq]`` float32; q_pos ``[Tq]``, k_pos ``[Tk]`` int positions in
      natural order (used when ``causal``); q_seg ``[B, Tq]``, k_seg ``[B, Tk]`` segment
      ids or None.
    Returns:
      the updated ``(o, lse)``; rows that see no key here are unchanged. With
      ``execution.attention`` "pallas" (the GPU default, ``jaxpar.kernels.KernelOptions``) by
      the flash attention kernel's step; otherwise by its XLA reference
      (``block_update_reference``), walking the keys in blocks of at most ``KV_BLOCK``.
    """
    B, Tq, K, G, _ = q.shape
    state = (_flat(o), _flat(lse))
    if implementation("attention") == "pallas":
        o, lse = kernel_block_update(_flat(q), k, v, *state, q_pos, k_pos, q_seg, k_seg,
                                     causal=causal, interpret=pallas_interpret())
    else:
        def fold(state, block):
            k, v, k_pos, k_seg = block
            return block_update_reference(_flat(q), k, v, *state, q_pos, k_pos, q_seg, k_seg,
                                          causal=causal), None

        count, blocks = _key_blocks(k, v, k_pos, k_seg)
        if count == 1:
            o, lse = fold(state, (k, v, k_pos, k_seg))[0]
        else:
            o, lse = jax.lax.scan(fold, state, blocks)[0]
    return o.reshape(q.shape), lse.reshape(B, K, G, Tq)


def block_grads(q, k, v, do, lse, delta, q_pos, k_pos, q_seg=None, k_seg=None, *, causal: bool):
    """Gradient contributions of the keys/values ``k, v`` (flash attention's backward).

    Args:
      q, do ``[B, Tq, K, G, H]``; k, v ``[B, Tk, K, H]``; lse, delta ``[B, K, G, Tq]``
      float32 (the final log-sum-exp, and ``sum(do * out, H)``); positions and segment
      ids as in ``block_update``.
    Returns:
      ``(dq [B, Tq, K, G, H], dk [B, Tk, K, H], dv [B, Tk, K, H])``, float32; by the
      flash attention kernel's backward under ``execution.attention`` "pallas", otherwise by
      ``block_grads_reference`` per block of at most ``KV_BLOCK`` keys.
    """
    rows = (_flat(do), _flat(lse), _flat(delta))
    if implementation("attention") == "pallas":
        dq, dk, dv = kernel_block_grads(_flat(q), k, v, *rows, q_pos, k_pos, q_seg, k_seg,
                                        causal=causal, interpret=pallas_interpret())
        return dq.reshape(q.shape), dk, dv

    def grads(dq, block):
        k, v, k_pos, k_seg = block
        g_q, g_k, g_v = block_grads_reference(_flat(q), k, v, *rows, q_pos, k_pos, q_seg, k_seg,
                                              causal=causal)
        return dq + g_q, (g_k, g_v)

    dq = jnp.zeros(_flat(q).shape, jnp.float32)
    count, blocks = _key_blocks(k, v, k_pos, k_seg)
    if count == 1:
        dq, (dk, dv) = grads(dq, (k, v, k_pos, k_seg))
    else:
        dq, (dk, dv) = jax.lax.scan(grads, dq, blocks)
        dk, dv = _unblock(dk), _unblock(dv)
    return dq.reshape(q.shape), dk, dv


def _empty_state(q):
    o = jnp.zeros(q.shape, jnp.float32)
    return o, jnp.full((q.shape[0], *q.shape[2:4], q.shape[1]), -jnp.inf, jnp.float32)


def _delta(do, out):
    return jnp.einsum("BTKGH,BTKGH->BKGT", do.astype(jnp.float32), out.astype(jnp.float32))


def _no_grad(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash_attention(causal: bool, q, k, v, positions, segment_ids):
    """Memory-efficient self-attention on one device: ``q [B, T, K, G, H]``, ``k, v [B, T,
    K, H]``, ``positions [T]`` (natural order), ``segment_ids [B, T]`` or None; keys are
    walked in ``KV_BLOCK``s forward and backward (custom VJP), so memory is O(T)."""
    return _flash_fwd(causal, q, k, v, positions, segment_ids)[0]


def _flash_fwd(causal, q, k, v, positions, segment_ids):
    o, lse = block_update(q, k, v, *_empty_state(q), positions, positions, segment_ids,
                          segment_ids, causal=causal)
    out = o.astype(q.dtype)
    return out, (q, k, v, positions, segment_ids, out, lse)


def _flash_bwd(causal, residuals, do):
    q, k, v, positions, segment_ids, out, lse = residuals
    dq, dk, dv = block_grads(q, k, v, do, lse, _delta(do, out), positions, positions,
                             segment_ids, segment_ids, causal=causal)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), _no_grad(positions),
            _no_grad(segment_ids))


flash_attention.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------- the local ring


@dataclasses.dataclass(frozen=True)
class _Ring:
    """What every device knows statically: the ring axis and size, the layout (``pieces``
    1 for contiguous shards, 2 for zigzag), the mask kind."""

    axis: str
    n: int
    pieces: int
    causal: bool

    def chunk(self, device, piece):
        """Global chunk index (in units of one piece) of ``piece`` on ``device``."""
        if self.pieces == 1:
            return device
        return device if piece == 0 else 2 * self.n - 1 - device

    def positions(self, device, size, piece=None):
        """Natural positions of ``device``'s tokens (``[L]``, or one piece's ``[size]``)."""
        if piece is not None:
            return self.chunk(device, piece) * size + jnp.arange(size)
        return jnp.concatenate([self.positions(device, size, p) for p in range(self.pieces)])

    @property
    def shift(self):
        """Each hop sends a block from device d to d + 1."""
        return [(d, (d + 1) % self.n) for d in range(self.n)]


def _tied(x, data):
    """``x`` made to depend on ``data`` (plus a zero derived from it).

    In the model the ring runs inside the differentiated scan over layers. There JAX
    evaluates apart the parts of the computation that depend on no differentiated input
    and keeps their values for every iteration: masks derived from a bare
    ``axis_index``, or from the segment ids (the same in every layer), were kept for
    every ring step and key block, ``[n - 1, L/2, L/2]`` or ``[T/512, B, T, 512]`` per
    layer, the O(T²) this module exists to avoid (measured: 1.9 GB instead of 0.3 GB
    for two layers at T = 16k, n = 8). Tied to the data, they stay where they are used.
    """
    first = data.reshape(-1)[0]
    return x + (first == first).astype(x.dtype) * 0


def _device_index(axis: str, data):
    """``axis_index(axis)``, tied to ``data`` (``_tied``)."""
    return _tied(jax.lax.axis_index(axis), data)


def _split(x, pieces, axis=1):
    """Cuts the length (``axis``) into a list of ``pieces`` arrays (None stays None)."""
    if x is None:
        return [None] * pieces
    return list(jnp.split(x, pieces, axis=axis)) if pieces > 1 else [x]


def _join(xs, axis=1):
    return jnp.concatenate(xs, axis=axis) if len(xs) > 1 else xs[0]


def _pairs(ring: _Ring, me, source, body, carry):
    """Runs ``body(carry, qp, kp)`` for every (query piece, key piece) pair of this device
    and the block from ``source`` that has a visible key; a pair the causal mask hides
    entirely is skipped (``lax.cond``: zigzag's load balance is in these skips)."""
    for qp in range(ring.pieces):
        for kp in range(ring.pieces):
            update = functools.partial(body, qp=qp, kp=kp)
            if ring.causal:
                visible = ring.chunk(me, qp) >= ring.chunk(source, kp)
                carry = jax.lax.cond(visible, update, lambda c: c, carry)
            else:
                carry = update(carry)
    return carry


def _ring_forward(ring: _Ring, q, k, v, seg):
    """Local shards: q ``[B, L, K, G, H]``, k/v ``[B, L, K, H]``, seg ``[B, L]`` or None.
    Returns ``(out [B, L, K, G, H] float32, lse [B, K, G, L])``."""
    P, size = ring.pieces, q.shape[1] // ring.pieces
    me = _device_index(ring.axis, q)
    qs, q_segs = _split(q, P), _split(seg, P)

    def attend(state, block, step):
        source = (me - step) % ring.n
        ks, vs, k_segs = (_split(x, P) for x in block)

        def body(state, *, qp, kp):
            o, lse = list(state[0]), list(state[1])
            o[qp], lse[qp] = block_update(
                qs[qp], ks[kp], vs[kp], o[qp], lse[qp], ring.positions(me, size, qp),
                ring.positions(source, size, kp), q_segs[qp], k_segs[kp], causal=ring.causal)
            return o, lse

        return _pairs(ring, me, source, body, state)

    def hop(carry, step):
        block, state = carry
        with jax.named_scope("ring_send_kv"):
            incoming = jax.lax.ppermute(block, ring.axis, ring.shift)  # issued first
        with jax.named_scope("ring_block"):
            state = attend(state, block, step)
        return (incoming, state), None

    empty = [_empty_state(x) for x in qs]
    state = ([o for o, _ in empty], [lse for _, lse in empty])
    (block, state), _ = jax.lax.scan(hop, ((k, v, seg), state), jnp.arange(ring.n - 1))
    o, lse = attend(state, block, ring.n - 1)
    return _join(o), _join(lse, axis=3)


def _ring_backward(ring: _Ring, q, k, v, seg, out, lse, do):
    """Gradients of the local shards; k/v and their float32 gradients travel together
    and the gradients take one last hop home."""
    P, size = ring.pieces, q.shape[1] // ring.pieces
    me = _device_index(ring.axis, q)
    qs, dos, q_segs = _split(q, P), _split(do, P), _split(seg, P)
    lses, deltas = _split(lse, P, axis=3), _split(_delta(do, out), P, axis=3)

    def accumulate(dq, block, grads, step):
        source = (me - step) % ring.n
        ks, vs, k_segs = (_split(x, P) for x in block)

        def body(state, *, qp, kp):
            dq, dks, dvs = (list(x) for x in state)
            g_q, g_k, g_v = block_grads(
                qs[qp], ks[kp], vs[kp], dos[qp], lses[qp], deltas[qp], ring.positions(me, size, qp),
                ring.positions(source, size, kp), q_segs[qp], k_segs[kp], causal=ring.causal)
            dq[qp], dks[kp], dvs[kp] = dq[qp] + g_q, dks[kp] + g_k, dvs[kp] + g_v
            return dq, dks, dvs

        dq, dks, dvs = _pairs(ring, me, source, body, (dq, _split(grads[0], P), _split(grads[1], P)))
        return dq, (_join(dks), _join(dvs))

    def hop(carry, step):
        block, grads, dq = carry
        with jax.named_scope("ring_send_kv"):
            incoming = jax.lax.ppermute(block, ring.axis, ring.shift)
        with jax.named_scope("ring_block_grads"):
            dq, grads = accumulate(dq, block, grads, step)
        with jax.named_scope("ring_send_dkv"):
            grads = jax.lax.ppermute(grads, ring.axis, ring.shift)
        return (incoming, grads, dq), None

    dq = [jnp.zeros(x.shape, jnp.float32) for x in qs]
    grads = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (block, grads, dq), _ = jax.lax.scan(hop, ((k, v, seg), grads, dq), jnp.arange(ring.n - 1))
    dq, grads = accumulate(dq, block, grads, ring.n - 1)
    dk, dv = jax.lax.ppermute(grads, ring.axis, ring.shift)  # home: block i is back on i
    return _join(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, seg):
    return _ring_forward(ring, q, k, v, seg)[0].astype(q.dtype)


def _ring_fwd(ring, q, k, v, seg):
    out, lse = _ring_forward(ring, q, k, v, seg)
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(ring, residuals, do):
    q, k, v, seg, out, lse = residuals
    return (*_ring_backward(ring, q, k, v, seg, out, lse, do), _no_grad(seg))


_ring.defvjp(_ring_fwd, _ring_bwd)


# --------------------------------------------------------------- rsa and ulysses


def _rsa(ring: _Ring, q, k, v, seg):
    """The Sequence Parallelism paper's Ring Self-Attention on local shards: full
    ``[L, T]`` score rows from a ring pass of keys, a softmax, then a ring pass of values;
    differentiated by JAX, so the backward pass keeps those rows."""
    me = _device_index(ring.axis, q)
    size = q.shape[1] // ring.pieces
    q_pos = ring.positions(me, size)

    def block_scores(block, step):
        k_blk, seg_blk = block
        k_pos = ring.positions((me - step) % ring.n, size)
        mask = visible(q_pos, k_pos, seg, seg_blk, causal=ring.causal)
        s = _scores(q, k_blk)
        return s if mask is None else jnp.where(mask[..., None, None, :, :], s, -jnp.inf)

    def score_hop(block, step):
        return jax.lax.ppermute(block, ring.axis, ring.shift), block_scores(block, step)

    block, scores = jax.lax.scan(score_hop, (k, seg), jnp.arange(ring.n - 1))
    scores = jnp.concatenate([scores, block_scores(block, ring.n - 1)[None]])  # [n, B, K, G, L, L]
    probs = jax.nn.softmax(scores, axis=(0, -1)).astype(v.dtype)  # over every key block

    def product(out, v_blk, p):
        return out + jnp.einsum("BKGTS,BSKH->BTKGH", p, v_blk, preferred_element_type=jnp.float32)

    def value_hop(carry, p):
        v_blk, out = carry
        return (jax.lax.ppermute(v_blk, ring.axis, ring.shift), product(out, v_blk, p)), None

    out = jnp.zeros(q.shape, jnp.float32)
    (v_blk, out), _ = jax.lax.scan(value_hop, (v, out), probs[:-1])
    return product(out, v_blk, probs[-1]).astype(q.dtype)


def _ulysses(ring: _Ring, q, k, v, seg):
    """All-to-all sequence parallelism on local shards: heads split ``n`` more ways, the
    whole length attended with ``flash_attention``."""
    n, axis = ring.n, ring.axis
    B, L, K, G, H = q.shape
    if K % n:  # too few kv heads to split: give each query head its own copy
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
        q = q.reshape(B, L, K * G, 1, H)
    to_heads = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=2, concat_axis=1, tiled=True)
    q_all, k_all, v_all = to_heads(q), to_heads(k), to_heads(v)  # [B, T, heads / n, ...]
    positions = jnp.concatenate([ring.positions(d, L // ring.pieces) for d in range(n)])
    positions = _tied(positions, q)
    seg_all = None if seg is None else jax.lax.all_gather(seg, axis, axis=1, tiled=True)
    out = flash_attention(ring.causal, q_all, k_all, v_all, positions, seg_all)
    out = jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)
    return out.reshape(B, L, K, G, H)


# ------------------------------------------------------------------ entry point


def ring_attention(q, k, v, *, mesh, causal: bool = True, segment_ids=None, axis: str = "seq",
                   impl: str = "ring", layout: str = "natural", rules=None):
    """Attention over a length split across mesh axis ``axis``; equals
    ``jaxpar.dot_product_attention`` on the same global arrays (in the same layout).

    Args:
      q: ``[B, T, N, H]`` queries; k, v: ``[B, T, K, H]`` (``N`` a multiple of ``K``),
        global arrays whose length is (or will be) split over ``axis``.
      mesh: the ``jax.sharding.Mesh`` (or abstract mesh) that has ``axis``.
      causal: token ``t`` sees tokens at or before it (in natural order).
      segment_ids: ``[B, T]`` int document ids of packed sequences, or None.
      axis: the mesh axis the length is split over.
      impl: ``"ring"`` (blockwise, custom VJP), ``"rsa"`` (the paper's baseline) or
        ``"ulysses"`` (all-to-all); see the module docstring.
      layout: ``"natural"``, or ``"zigzag"`` when the tokens are in ``to_zigzag`` order.
      rules: how batch and heads split over the other mesh axes around the ring
        (``activation_batch``, ``activation_heads``, ``activation_kv_heads``): the rules
        in force (``jaxpar.use_mesh``), else ``jaxpar.rules.DEFAULT_RULES``. The mesh is
        an argument here, so the rules only choose each device's share of the work.

    Returns:
      ``[B, T, N, H]`` in ``q``'s dtype and ``layout``, sharded like ``q``.
    """
    _check_ring_arguments(q, k, v, segment_ids, mesh, axis, impl, layout)
    B, T, N, H = q.shape
    K = k.shape[2]
    n = mesh.shape[axis]
    # Under a causal mask the ring balances its work by reordering natural shards to
    # zigzag on the way in and back on the way out (two ppermutes of half a shard each).
    reorder = impl == "ring" and layout == "natural" and causal and n > 1 and T % (2 * n) == 0
    ring = _Ring(axis, n, 2 if (layout == "zigzag" or reorder) and n > 1 else 1, causal)

    if rules is None:
        rules = current().rules or rules_lib.DEFAULT_RULES
    batch_axes = local_axes(mesh, "activation_batch", B, exclude=axis, rules=rules)
    head_axes = local_axes(mesh, "activation_heads", N, exclude=axis, rules=rules)
    kv_axes = local_axes(mesh, "activation_kv_heads", K, exclude=axis, rules=rules)
    if kv_axes != head_axes:
        kv_axes = ()  # each device selects its query heads' kv heads below
    n_local = N // axes_size(mesh, head_axes)
    if impl == "ulysses" and n_local % n:
        raise ValueError(f"ring_attention: ulysses splits the heads over {axis}={n}, but there "
                         f"are {n_local} query heads per device (N={N} over {head_axes or 'no axes'})")
    G = N // K

    def local(q, k, v, seg):
        seg = None if seg is None else _tied(seg, q)
        if kv_axes != head_axes:
            k, v = kv_heads_for(q.shape[2], G, head_axes, mesh, k, v)
        b, t, heads, _ = q.shape
        kv = k.shape[2]
        q = q.reshape(b, t, kv, heads // kv, H)
        fn = {"ring": _ring, "rsa": _rsa, "ulysses": _ulysses}[impl]
        if reorder:
            q, k, v, seg = (None if x is None else natural_to_zigzag(x, axis, n) for x in (q, k, v, seg))
        out = fn(ring, q, k, v, seg)
        if reorder:
            out = zigzag_to_natural(out, axis, n)
        return out.reshape(b, t, heads, H)

    q_spec = PartitionSpec(batch_axes or None, axis, head_axes or None, None)
    kv_spec = PartitionSpec(batch_axes or None, axis, kv_axes or None, None)
    seg_spec = None if segment_ids is None else PartitionSpec(batch_axes or None, axis)
    with jax.named_scope(f"sequence_parallel_{impl}"):
        out = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                            out_specs=q_spec, check_vma=False)(q, k, v, segment_ids)
    return out


def _check_ring_arguments(q, k, v, segment_ids, mesh, axis, impl, layout) -> None:
    """``ring_attention``'s argument checks: one ValueError naming the offending value."""
    if impl not in IMPLS:
        raise ValueError(f"ring_attention: impl={impl!r} is not one of {IMPLS}")
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention: layout={layout!r} is not one of {LAYOUTS}")
    if axis not in mesh.axis_names:
        raise ValueError(f"ring_attention: the mesh has no axis {axis!r}; its axes are "
                         f"{tuple(mesh.axis_names)} (make one with jaxpar.make_mesh(seq=N))")
    B, T, N, H = q.shape
    K = k.shape[2]
    if k.shape != (B, T, K, H) or v.shape != k.shape:
        raise ValueError(f"ring_attention: k and v must be [B, T, K, H] = [{B}, {T}, K, {H}] "
                         f"like q {q.shape}, got k {k.shape}, v {v.shape}")
    if N % K:
        raise ValueError(f"ring_attention: query heads N={N} must be a multiple of kv heads K={K}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"ring_attention: segment_ids must be [B, T] = [{B}, {T}], got {segment_ids.shape}")
    n = mesh.shape[axis]
    if T % n:
        raise ValueError(f"ring_attention: length T={T} is not divisible by {axis}={n}")
    if layout == "zigzag" and T % (2 * n):
        raise ValueError(f"ring_attention: the zigzag layout needs the length divisible by "
                         f"2 x {axis} = {2 * n}, got T={T}")
