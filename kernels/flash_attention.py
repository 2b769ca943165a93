"""Flash attention, forward and backward, as Pallas kernels; and the same kernels as one
step of the online softmax, which the ring attention runs its inner blocks on.

``flash_attention(q, k, v, *, causal, segment_ids=None, window=None, scale=None)``:
``q [B, T, N, H]``, ``k, v [B, S, K, H]`` with ``N`` a multiple of ``K`` (grouped-query
attention: query head ``n`` reads key/value head ``n // (N // K)``, as Hugging Face's
``repeat_kv``), returns ``[B, T, N, H]`` in ``q``'s dtype. Scores, softmax statistics and
products accumulate in float32 whatever the input dtype (bf16, fp16, fp32).

Which keys a query sees: key ``s`` sits at position ``s`` and query ``t`` at ``S - T + t``
(the queries are the last ``T`` of the ``S`` tokens: with ``causal`` the mask is aligned
bottom-right, as ``jaxpar.dot_product_attention``'s, so query ``t`` sees keys
``s <= t + S - T``; when ``T > S`` the first ``T - S`` queries see no key and give zeros;
a preallocated KV cache with per-sequence lengths is ``decode_attention``'s job); with
``causal`` keys at positions ``<=`` the query's; with ``window`` w only keys less than w positions
away (a sliding window: ``q_pos - k_pos < w``, and ``k_pos - q_pos < w`` when not
causal); with ``segment_ids [B, T]`` only keys of the same document (packed sequences).

Algorithm (FlashAttention-2, Dao 2023):

* Forward, one program per (batch, query head, block of ``block_q`` queries): walk the
  key/value blocks of ``block_k`` with an online softmax, keeping the running max,
  sum and unnormalised output in registers; write the output and the float32
  log-sum-exp ``lse [B, N, T]``. Causal and windowed programs loop only over the key
  blocks that can be visible (from the block indices), so causal attention does half the
  work; partially visible blocks are masked element by element.
* Backward, recomputing the probabilities from the saved ``lse`` (``p = exp(s - lse)``)
  and ``delta = sum(do * o)`` (computed in XLA, one pass): a dK/dV kernel, one program per
  (batch, key/value head, key block), that loops over the query blocks and over the
  ``G = N / K`` query heads sharing the key/value head, so dK and dV are summed over the
  group inside the kernel; and a dQ kernel, one program per (batch, query head, query
  block), that loops over the key blocks.

Forward and dQ programs are per query head, so under grouped-query attention the ``G``
heads of a group each stream the group's K/V (from L2, mostly); one program per group
(``G * block_q`` rows) is a tuning step to try on the GPU. Block sizes default to 64 x 64
and are not tuned (no GPU yet).

Lengths that are not multiples of the blocks are padded up in the wrapper; padded keys
and padded query rows are masked (and the padding sliced off), so they never reach a sum.
A head dim that is not a power of two (72, 80, 96: Triton's tiles must be) is padded
with zeros to the next one, which changes no ``q.k`` and no output column (the extra
columns are sliced off), as JAX's own Pallas ``mha`` does.
A query row that sees no key at all (possible in a ring block) keeps ``lse = -inf`` and a
zero output instead of NaN.

The ring attention's step (``block_update``) is the same forward kernel started from a
running ``(o, lse)`` instead of an empty one, with explicit ``q_positions`` /
``k_positions`` (the ring's token layout need not be contiguous: zigzag); its backward
step (``block_grads``) is the backward kernels given the final ``lse`` and ``delta``.
With explicit positions the block-skipping bounds are not known, so every key block is
visited (masked where invisible). ``block_update_reference`` / ``block_grads_reference``
are the same step in plain XLA, which the ring runs when attention is not on Pallas.
Which keys a query sees is ``jaxpar.kernels.masks.visible`` everywhere: in the kernels'
tiles, the references, the ring and ``jaxpar.dot_product_attention``.

Backend: ``pl.pallas_call`` with block specs, which lowers through Triton on GPU. The
kernel needs only 2D loads, two matmuls per tile and an online softmax, which Triton
schedules well on Ampere and Hopper (JAX's own Pallas ``mha`` is the same design); the
same kernel body runs in interpret mode on CPU, which is how it is tested. The Hopper
path that beats it (Mosaic GPU: TMA bulk copies, wgmma, warp-specialised pipelining, as
FlashAttention-3 does) is the next step once its speed can be measured on an H200; the
Triton lowering is deprecated from JAX 0.11 but still ships. Not yet measured on a GPU.

Dispatch (``interpret``) as every ``jaxpar.kernels`` entry point: ``None`` runs the
compiled kernel on GPU and ``flash_attention_reference`` elsewhere; ``True`` runs the
Pallas kernel in interpret mode on any backend; ``False`` forces the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxpar.kernels.dispatch import triton, use_pallas
from jaxpar.kernels.masks import visible
from jaxpar.kernels.tiles import is_pow2, pow2


# --------------------------------------------------------------------------- API


def flash_attention(q, k, v, *, causal: bool, segment_ids=None, window: int | None = None,
                    scale: float | None = None, block_q: int = 64, block_k: int = 64,
                    interpret: bool | None = None):
    """Softmax attention of ``q [B, T, N, H]`` over ``k, v [B, S, K, H]`` (module
    docstring); with ``causal`` and ``T != S`` the mask is aligned bottom-right (query
    ``t`` sees keys ``s <= t + S - T``); ``segment_ids [B, T]`` int (needs ``T == S``).
    Differentiable in q, k, v."""
    _check(q, k, v, segment_ids, window, block_q, block_k, interpret)
    T, S, H = q.shape[1], k.shape[1], q.shape[3]
    scale = H ** -0.5 if scale is None else float(scale)
    if not use_pallas(interpret):
        return flash_attention_reference(q, k, v, causal=causal, segment_ids=segment_ids,
                                         window=window, scale=scale)
    config = _Config(causal, window, scale, min(block_q, pow2(T)), min(block_k, pow2(S)),
                     T, S, True, bool(interpret))
    q, k, v = (_pad(x, 3, pow2(H)) for x in (q, k, v))
    return _attention(config, q, k, v, segment_ids)[..., :H]


def block_update(q, k, v, o, lse, q_positions, k_positions, q_segment_ids=None,
                 k_segment_ids=None, *, causal: bool, window: int | None = None,
                 scale: float | None = None, block_q: int = 64, block_k: int = 64,
                 interpret: bool | None = None):
    """One step of the online softmax: folds keys/values ``k, v [B, S, K, H]`` into the
    running output ``o [B, T, N, H]`` (float32, normalised over the keys seen so far) and
    log-sum-exp ``lse [B, N, T]`` (float32, ``-inf`` before any key) of ``q [B, T, N, H]``.

    ``q_positions [T]``, ``k_positions [S]`` int: the tokens' positions (for ``causal``
    and ``window``); segment ids ``[B, T]`` / ``[B, S]`` or None. Returns the updated
    ``(o, lse)``; rows that see no key here are unchanged. Not differentiable: the
    backward of a sequence of steps is ``block_grads`` per step.
    """
    _check(q, k, v, None, window, block_q, block_k, interpret)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not use_pallas(interpret):
        return block_update_reference(q, k, v, o, lse, q_positions, k_positions, q_segment_ids,
                                      k_segment_ids, causal=causal, window=window, scale=scale)
    T, S, H = q.shape[1], k.shape[1], q.shape[3]
    config = _Config(causal, window, scale, min(block_q, pow2(T)), min(block_k, pow2(S)),
                     T, S, False, bool(interpret))
    q, k, v, o = (_pad(x, 3, pow2(H)) for x in (q, k, v, o))
    o, lse = _forward(config, q, k, v, q_segment_ids, k_segment_ids, q_positions, k_positions,
                      o, lse, out_dtype=jnp.float32)
    return o[..., :H], lse


def block_grads(q, k, v, do, lse, delta, q_positions, k_positions, q_segment_ids=None,
                k_segment_ids=None, *, causal: bool, window: int | None = None,
                scale: float | None = None, block_q: int = 64, block_k: int = 64,
                interpret: bool | None = None):
    """The gradient contributions of keys/values ``k, v [B, S, K, H]``: flash attention's
    backward given the final ``lse [B, N, T]`` and ``delta = sum(do * out, H) [B, N, T]``
    (float32) of the whole attention. Returns ``(dq [B, T, N, H], dk, dv [B, S, K, H])``
    in float32."""
    _check(q, k, v, None, window, block_q, block_k, interpret)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not use_pallas(interpret):
        return block_grads_reference(q, k, v, do, lse, delta, q_positions, k_positions,
                                     q_segment_ids, k_segment_ids, causal=causal, window=window,
                                     scale=scale)
    T, S, H = q.shape[1], k.shape[1], q.shape[3]
    config = _Config(causal, window, scale, min(block_q, pow2(T)), min(block_k, pow2(S)),
                     T, S, False, bool(interpret))
    q, k, v, do = (_pad(x, 3, pow2(H)) for x in (q, k, v, do))
    dq, dk, dv = _backward(config, q, k, v, q_segment_ids, k_segment_ids, q_positions, k_positions,
                           do, lse, delta)
    return dq[..., :H], dk[..., :H], dv[..., :H]


def _check(q, k, v, segment_ids, window, block_q, block_k, interpret):
    """Shapes the kernels take: any ``B, T, S, N, K, H`` with ``N % K == 0``. Triton wants
    power-of-two tiles, so the wrappers pad: ``T`` and ``S`` up to whole blocks (padded rows
    and keys masked) and ``H`` with zeros up to ``pow2(H)`` (at least 16: 72, 80 and 96 run
    as 128), which leaves every ``q.k`` and every output column unchanged (the padded
    columns are sliced off). ``block_q``, ``block_k``: powers of two, at least 16 compiled
    (Triton's smallest dot tile)."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] \
            or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention wants q [B, T, N, H], k and v [B, S, K, H]; got q={q.shape}, "
                         f"k={k.shape}, v={v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads N={q.shape[2]} must be a multiple of key/value heads "
                         f"K={k.shape[2]}")
    if segment_ids is not None and (q.shape[1] != k.shape[1] or segment_ids.shape != q.shape[:2]):
        raise ValueError(f"segment_ids={segment_ids.shape} need T == S and shape [B, T] = "
                         f"{q.shape[:2]} (k has S={k.shape[1]})")
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be at least 1")
    least = 1 if interpret else 16
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size < least or not is_pow2(size):
            raise ValueError(f"flash attention {name}={size} must be a power of two >= {least}")


# ------------------------------------------------------------------------- kernels


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call: the mask, the tiles, the true lengths (before
    padding), and whether positions are implicit (then the visible block ranges are known
    and the loops skip the rest): keys at ``0..S-1``, queries at ``S-T..S-1`` (the last
    ``T`` keys' positions: the causal mask aligned bottom-right)."""

    causal: bool
    window: int | None
    scale: float
    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    contiguous: bool
    interpret: bool

    @property
    def q_offset(self) -> int:
        """Position of query 0 when positions are implicit: ``S - T``."""
        return self.kv_len - self.q_len

    def padded(self, length, block):
        return -(-length // block) * block

    def call(self, kernel, grid, in_specs, out_specs, out_shape, name):
        return pl.pallas_call(functools.partial(kernel, config=self), grid=grid,
                              in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                              interpret=self.interpret, name=name, compiler_params=triton())


def _visible(config: _Config, q_idx, k_idx, q_pos, k_pos, q_seg, k_seg):
    """``[bq, bk]`` bool: which (query, key) pairs of a tile attend. ``*_idx`` are the
    rows' indices in the padded arrays (padding is invisible), ``*_pos`` their positions,
    ``*_seg`` their segment ids or None."""
    mask = (q_idx < config.q_len)[:, None] & (k_idx < config.kv_len)[None, :]
    rule = visible(q_pos, k_pos, q_seg, k_seg, causal=config.causal, window=config.window)
    return mask if rule is None else mask & rule


def _div(x, n: int):
    """``x // n`` for a traced ``x >= 0`` (``lax.div``: Triton lowers it, not ``//``)."""
    return jax.lax.div(x, n)


def _cdiv(x, n: int):
    """``ceil(max(x, 0) / n)`` for a traced ``x``."""
    return _div(jnp.maximum(x, 0) + n - 1, n)


def _key_blocks(config: _Config, i, count):
    """The key blocks query block ``i`` can see: ``[lo, hi)`` (all when positions are
    not implicit)."""
    if not config.contiguous:
        return 0, count
    bq, bk, w = config.block_q, config.block_k, config.window
    first = i * bq + config.q_offset  # the block's query positions: first .. last
    last = first + bq - 1
    lo = 0 if w is None else _div(jnp.maximum(first - w + 1, 0), bk)
    if config.causal:  # keys <= last
        hi = jnp.minimum(_cdiv(last + 1, bk), count)
    elif w is not None:  # keys <= last + w - 1
        hi = jnp.minimum(_cdiv(last + w, bk), count)
    else:
        hi = count
    return jnp.minimum(lo, hi), hi


def _query_blocks(config: _Config, j, count):
    """The query blocks that can see key block ``j``: ``[lo, hi)``."""
    if not config.contiguous:
        return 0, count
    bq, bk, w = config.block_q, config.block_k, config.window
    first = j * bk - config.q_offset  # the block's key positions, as query indices
    last = first + bk - 1
    if config.causal:  # queries at or after the first key
        lo = _div(jnp.maximum(first, 0), bq)
    elif w is not None:
        lo = _div(jnp.maximum(first - w + 1, 0), bq)
    else:
        lo = 0
    hi = count if w is None else jnp.minimum(_cdiv(last + w, bq), count)
    return jnp.minimum(lo, hi), hi


def _indices(start, size):
    return start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)


def _scores(config, q, k):
    """``[bq, bk]`` float32 ``q k^T * scale``."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return s * config.scale


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, q_pos_ref, k_pos_ref, o_in_ref,
                    lse_in_ref, o_ref, lse_ref, *, config: _Config):
    """One (batch, head, query block): q ``[bq, H]``, k/v ``[S_pad, H]``; o ``[bq, H]``,
    lse ``[bq]``. Starts from ``(o_in, lse_in)`` when given (the ring's running state)."""
    bq, bk = config.block_q, config.block_k
    i = pl.program_id(2)
    q = q_ref[...]
    q_idx = _indices(i * bq, bq)
    q_pos = q_idx + config.q_offset if q_pos_ref is None else q_pos_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]
    if o_in_ref is None:
        m = jnp.full((bq,), -jnp.inf, jnp.float32)
        total = jnp.zeros((bq,), jnp.float32)
        acc = jnp.zeros(o_ref.shape, jnp.float32)
    else:  # a normalised (o, lse) is the state (acc=o, max=lse, sum=1)
        m = lse_in_ref[...]
        total = jnp.where(jnp.isfinite(m), 1.0, 0.0)
        acc = o_in_ref[...].astype(jnp.float32)

    def body(j, carry):
        acc, m, total = carry
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        k_idx = _indices(j * bk, bk)
        k_pos = k_idx if k_pos_ref is None else k_pos_ref[pl.ds(j * bk, bk)]
        k_seg = None if k_seg_ref is None else k_seg_ref[pl.ds(j * bk, bk)]
        visible = _visible(config, q_idx, k_idx, q_pos, k_pos, q_seg, k_seg)
        s = jnp.where(visible, _scores(config, q, k), -jnp.inf)
        new_m = jnp.maximum(m, s.max(-1))
        safe_m = jnp.where(jnp.isfinite(new_m), new_m, 0.0)  # all -inf so far: no NaN
        p = jnp.exp(s - safe_m[:, None])
        correction = jnp.exp(m - safe_m)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc * correction[:, None] + pv, new_m, total * correction + p.sum(-1)

    lo, hi = _key_blocks(config, i, k_ref.shape[0] // bk)
    acc, m, total = jax.lax.fori_loop(lo, hi, body, (acc, m, total))
    seen = total > 0
    o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, total, 1.0)[:, None],
                           0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


def _probabilities(config, q, k, lse, q_idx, k_idx, q_pos, k_pos, q_seg, k_seg):
    """The tile's softmax ``p = exp(s - lse)`` ``[bq, bk]``, zero where invisible."""
    visible = _visible(config, q_idx, k_idx, q_pos, k_pos, q_seg, k_seg)
    safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.where(visible, jnp.exp(_scores(config, q, k) - safe_lse[:, None]), 0.0)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, k_seg_ref,
                 q_pos_ref, k_pos_ref, dk_ref, dv_ref, *, config: _Config):
    """One (batch, kv head, key block): k/v ``[bk, H]``; q/do ``[T_pad, G, H]``, lse and
    delta ``[G, T_pad]`` of the G query heads reading this kv head; dk/dv ``[bk, H]`` f32."""
    bq, bk = config.block_q, config.block_k
    j = pl.program_id(2)
    G = q_ref.shape[1]
    k, v = k_ref[...], v_ref[...]
    k_idx = _indices(j * bk, bk)
    k_pos = k_idx if k_pos_ref is None else k_pos_ref[...]
    k_seg = None if k_seg_ref is None else k_seg_ref[...]
    lo, hi = _query_blocks(config, j, q_ref.shape[0] // bq)

    def body(step, carry):
        dk, dv = carry
        g, i = jax.lax.rem(step, G), lo + _div(step, G)
        rows = pl.ds(i * bq, bq)
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]
        lse, delta = lse_ref[g, rows], delta_ref[g, rows]
        q_idx = _indices(i * bq, bq)
        q_pos = q_idx + config.q_offset if q_pos_ref is None else q_pos_ref[rows]
        q_seg = None if q_seg_ref is None else q_seg_ref[rows]
        p = _probabilities(config, q, k, lse, q_idx, k_idx, q_pos, k_pos, q_seg, k_seg)
        dv += jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None]) * config.scale
        dk += jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        return dk, dv

    zeros = jnp.zeros(dk_ref.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, (hi - lo) * G, body, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk, dv


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, k_seg_ref,
               q_pos_ref, k_pos_ref, dq_ref, *, config: _Config):
    """One (batch, query head, query block): q/do ``[bq, H]``, lse/delta ``[bq]``,
    k/v ``[S_pad, H]``; dq ``[bq, H]`` float32."""
    bq, bk = config.block_q, config.block_k
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_idx = _indices(i * bq, bq)
    q_pos = q_idx + config.q_offset if q_pos_ref is None else q_pos_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def body(j, dq):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        k_idx = _indices(j * bk, bk)
        k_pos = k_idx if k_pos_ref is None else k_pos_ref[pl.ds(j * bk, bk)]
        k_seg = None if k_seg_ref is None else k_seg_ref[pl.ds(j * bk, bk)]
        p = _probabilities(config, q, k, lse, q_idx, k_idx, q_pos, k_pos, q_seg, k_seg)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None]) * config.scale
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    lo, hi = _key_blocks(config, i, k_ref.shape[0] // bk)
    dq_ref[...] = jax.lax.fori_loop(lo, hi, body, jnp.zeros(dq_ref.shape, jnp.float32))


# ------------------------------------------------------------------------ launches


def _pad(x, axis, length):
    if x is None or x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


def _pad_inputs(config, q, k, v, q_seg, k_seg, q_pos, k_pos):
    T_pad = config.padded(config.q_len, config.block_q)
    S_pad = config.padded(config.kv_len, config.block_k)
    q, q_seg, q_pos = _pad(q, 1, T_pad), _pad(q_seg, 1, T_pad), _pad(q_pos, 0, T_pad)
    k, v, k_seg, k_pos = _pad(k, 1, S_pad), _pad(v, 1, S_pad), _pad(k_seg, 1, S_pad), _pad(k_pos, 0, S_pad)
    return T_pad, S_pad, q, k, v, q_seg, k_seg, q_pos, k_pos


def _query_block_side_specs(S, bq):
    """Block specs of (q_seg, k_seg, q_pos, k_pos) on a grid (b, head, query block): the
    queries' block, every key."""
    return [pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
            pl.BlockSpec((None, S), lambda b, n, i: (b, 0)),
            pl.BlockSpec((bq,), lambda b, n, i: (i,)), pl.BlockSpec((S,), lambda b, n, i: (0,))]


def _maybe(specs, *values):
    return [None if v is None else s for s, v in zip(specs, values, strict=True)]


def _forward(config: _Config, q, k, v, q_seg, k_seg, q_pos, k_pos, o_in=None, lse_in=None, *,
             out_dtype):
    """``(o [B, T, N, H] out_dtype, lse [B, N, T] f32)``, unpadded."""
    B, T, N, H = q.shape
    G, bq = q.shape[2] // k.shape[2], config.block_q
    T_pad, S_pad, q, k, v, q_seg, k_seg, q_pos, k_pos = _pad_inputs(config, q, k, v, q_seg, k_seg,
                                                                   q_pos, k_pos)
    o_in, lse_in = _pad(o_in, 1, T_pad), _pad(lse_in, 2, T_pad)
    query = pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0))
    keys = pl.BlockSpec((None, S_pad, None, H), lambda b, n, i: (b, 0, n // G, 0))
    rows = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    in_specs = [query, keys, keys,
                *_maybe(_query_block_side_specs(S_pad, bq), q_seg, k_seg, q_pos, k_pos),
                *_maybe([query, rows], o_in, lse_in)]
    o, lse = config.call(
        _forward_kernel, (B, N, T_pad // bq), in_specs, [query, rows],
        [jax.ShapeDtypeStruct((B, T_pad, N, H), out_dtype),
         jax.ShapeDtypeStruct((B, N, T_pad), jnp.float32)], "flash_attention_forward",
    )(q, k, v, q_seg, k_seg, q_pos, k_pos, o_in, lse_in)
    return o[:, :T], lse[:, :, :T]


def _backward(config: _Config, q, k, v, q_seg, k_seg, q_pos, k_pos, do, lse, delta):
    """``(dq [B, T, N, H], dk, dv [B, S, K, H])`` float32, unpadded."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    bq, bk = config.block_q, config.block_k
    T_pad, S_pad, q, k, v, q_seg, k_seg, q_pos, k_pos = _pad_inputs(config, q, k, v, q_seg, k_seg,
                                                                   q_pos, k_pos)
    do, lse, delta = _pad(do, 1, T_pad), _pad(lse, 2, T_pad), _pad(delta, 2, T_pad)

    # dK/dV: grid (B, K, key blocks); the G query heads of kv head h as [T_pad, G, H].
    grouped = pl.BlockSpec((None, T_pad, None, G, H), lambda b, h, j: (b, 0, h, 0, 0))
    grouped_rows = pl.BlockSpec((None, None, G, T_pad), lambda b, h, j: (b, h, 0, 0))
    key = pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0))
    side = [pl.BlockSpec((None, T_pad), lambda b, h, j: (b, 0)),
            pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
            pl.BlockSpec((T_pad,), lambda b, h, j: (0,)), pl.BlockSpec((bk,), lambda b, h, j: (j,))]
    as_groups = lambda x: x.reshape(B, T_pad, K, G, H)  # noqa: E731
    as_group_rows = lambda x: x.reshape(B, K, G, T_pad)  # noqa: E731
    dk, dv = config.call(
        _dkdv_kernel, (B, K, S_pad // bk),
        [grouped, key, key, grouped, grouped_rows, grouped_rows,
         *_maybe(side, q_seg, k_seg, q_pos, k_pos)],
        [key, key], [jax.ShapeDtypeStruct((B, S_pad, K, H), jnp.float32)] * 2,
        "flash_attention_dkdv",
    )(as_groups(q), k, v, as_groups(do), as_group_rows(lse), as_group_rows(delta),
      q_seg, k_seg, q_pos, k_pos)

    # dQ: grid (B, N, query blocks).
    query = pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0))
    keys = pl.BlockSpec((None, S_pad, None, H), lambda b, n, i: (b, 0, n // G, 0))
    rows = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
    dq = config.call(
        _dq_kernel, (B, N, T_pad // bq),
        [query, keys, keys, query, rows, rows,
         *_maybe(_query_block_side_specs(S_pad, bq), q_seg, k_seg, q_pos, k_pos)],
        query, jax.ShapeDtypeStruct((B, T_pad, N, H), jnp.float32), "flash_attention_dq",
    )(q, k, v, do, lse, delta, q_seg, k_seg, q_pos, k_pos)
    return dq[:, :T], dk[:, :S], dv[:, :S]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config: _Config, q, k, v, segment_ids):
    return _attention_fwd(config, q, k, v, segment_ids)[0]


def _attention_fwd(config, q, k, v, segment_ids):
    out, lse = _forward(config, q, k, v, segment_ids, segment_ids, None, None, out_dtype=q.dtype)
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(config, residuals, do):
    q, k, v, segment_ids, out, lse = residuals
    delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(jnp.float32), out.astype(jnp.float32))
    dq, dk, dv = _backward(config, q, k, v, segment_ids, segment_ids, None, None, do, lse, delta)
    no_grad = None if segment_ids is None else np.zeros(segment_ids.shape, jax.dtypes.float0)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), no_grad


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------- references


def _reference_mask(T, S, q_positions, k_positions, q_segment_ids, k_segment_ids, causal, window):
    """``[T, S]`` or ``[B, T, S]`` bool, or None (all visible); implicit positions put the
    queries last (bottom-right)."""
    q_pos = jnp.arange(T) + S - T if q_positions is None else q_positions
    k_pos = jnp.arange(S) if k_positions is None else k_positions
    return visible(q_pos, k_pos, q_segment_ids, k_segment_ids, causal=causal, window=window)


def _grouped(x, K):
    """``[B, T, N, H]`` -> ``[B, T, K, G, H]``; ``[B, N, T]`` -> ``[B, K, G, T]``."""
    if x.ndim == 4:
        return x.reshape(*x.shape[:2], K, x.shape[2] // K, x.shape[3])
    return x.reshape(x.shape[0], K, x.shape[1] // K, x.shape[2])


def _reference_scores(q, k, mask, scale):
    """``q [B, T, K, G, H]``, ``k [B, S, K, H]`` -> ``[B, K, G, T, S]`` float32, ``-inf``
    where ``mask [(B,) T, S]`` is False (None: nowhere). Each kv head is read by its G
    query heads in the einsum: k is never repeated."""
    s = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32) * scale
    return s if mask is None else jnp.where(mask[..., None, None, :, :], s, -jnp.inf)


def _rows(x):
    """``[B, K, G, T]`` -> ``[B, T, K, G, 1]``, to scale output rows."""
    return jnp.moveaxis(x, 3, 1)[..., None]


def flash_attention_reference(q, k, v, *, causal: bool, segment_ids=None,
                              window: int | None = None, scale: float | None = None):
    """Plain ``jnp`` (materialises the ``[B, N, T, S]`` scores): what the kernel computes."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    (B, T, N, H), (S, K) = q.shape, k.shape[1:3]
    mask = _reference_mask(T, S, None, None, segment_ids, segment_ids, causal, window)
    p = jax.nn.softmax(_reference_scores(_grouped(q, K), k, mask, scale), axis=-1)
    p = jnp.where(jnp.isnan(p), 0.0, p)  # rows that see nothing
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, H).astype(q.dtype)


def block_update_reference(q, k, v, o, lse, q_positions, k_positions, q_segment_ids=None,
                           k_segment_ids=None, *, causal: bool, window: int | None = None,
                           scale: float | None = None):
    """Plain ``jnp`` ``block_update`` (same arguments and result): the XLA online-softmax
    step, which the ring attention's XLA path runs on each block of keys."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    (B, T, N, H), K = q.shape, k.shape[2]
    mask = _reference_mask(T, k.shape[1], q_positions, k_positions, q_segment_ids, k_segment_ids,
                           causal, window)
    s = _reference_scores(_grouped(q, K), k, mask, scale)
    lse = _grouped(lse, K)
    m = s.max(-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row that sees nothing here: p = 0, no NaN
    p = jnp.exp(s - m[..., None])
    new_lse = jnp.logaddexp(lse, m + jnp.log(p.sum(-1)))  # unchanged where nothing is seen
    safe = jnp.where(jnp.isfinite(new_lse), new_lse, 0.0)
    pv = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = _grouped(o, K) * _rows(jnp.exp(lse - safe)) + pv * _rows(jnp.exp(m - safe))
    return o.reshape(B, T, N, H), new_lse.reshape(B, N, T)


def block_grads_reference(q, k, v, do, lse, delta, q_positions, k_positions, q_segment_ids=None,
                          k_segment_ids=None, *, causal: bool, window: int | None = None,
                          scale: float | None = None):
    """Plain ``jnp`` ``block_grads``: float32 ``(dq [B, T, N, H], dk, dv [B, S, K, H])``;
    the backward step of the ring attention's XLA path."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    (B, T, N, H), K = q.shape, k.shape[2]
    mask = _reference_mask(T, k.shape[1], q_positions, k_positions, q_segment_ids, k_segment_ids,
                           causal, window)
    q32, do32 = (_grouped(x, K).astype(jnp.float32) for x in (q, do))
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    lse, delta = _grouped(lse, K), _grouped(delta, K)
    s = _reference_scores(q32, k32, mask, scale)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])  # 0 where masked
    dv = jnp.einsum("BKGTS,BTKGH->BSKH", p, do32)
    dp = jnp.einsum("BTKGH,BSKH->BKGTS", do32, v32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("BKGTS,BSKH->BTKGH", ds, k32)
    dk = jnp.einsum("BKGTS,BTKGH->BSKH", ds, q32)
    return dq.reshape(B, T, N, H), dk, dv
