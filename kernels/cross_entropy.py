"""Fused linear + softmax cross-entropy that walks the vocabulary in chunks, forward and
backward, as Pallas kernels: the ``[tokens, vocab]`` logits never exist in memory.

``linear_cross_entropy(x, w, targets)`` with ``x [N, D]`` (the final hidden states),
``w [D, V]`` (the vocabulary projection) and ``targets [N]`` int returns the per-token
losses ``logsumexp(x w) - (x w)[target]`` ``[N]`` in float32 (the caller masks and
averages). It is made of two statistics, ``log_sum_exp_and_target_logit`` (the
differentiable primitive the kernels implement), which is also what a vocabulary split
across devices combines (``jaxpar.ops.kernel_ops.token_losses``). Products accumulate in float32
whatever the input dtype.

* Forward: one program per token block, walking the vocabulary chunks in a loop with
  an online log-sum-exp (running max, sum of exponentials and target logit in
  registers); it writes the log-sum-exp, which the backward reuses. (A program per
  (token block, chunk) accumulating into its output would race: Triton runs a grid's
  programs concurrently, in no order.)
* Backward, two kernels, each recomputing its ``[tokens, chunk]`` logits from ``x`` and
  ``w`` and the saved log-sum-exp, with ``d = softmax * g_lse + onehot * g_picked`` (the
  two statistics' cotangents; ``g, -g`` for the loss): ``dx = sum over chunks of d
  w_c^T``, one program per token block looping over the chunks, and ``dw_c = sum over
  token blocks of x^T d``, one program per chunk looping over the token blocks.

Memory beyond the inputs and gradients: one ``[block_tokens, chunk]`` tile per program
and two floats per token. Shapes: any ``N``, ``D``, ``V``. Tiles are ``[block_tokens,
pow2(D)]`` and ``[pow2(D), chunk]`` (``D`` 576 or 768 computes on 1024): loads read zeros
past ``D`` and past the last token and vocabulary entry, stores are masked there, so no
padding reaches a sum and ``x``, ``w`` are never copied.

Backend: ``pl.pallas_call`` with block specs, Triton on GPU (selected explicitly:
``jaxpar.kernels.dispatch.triton``): portable, and the same kernel body runs in interpret
mode on CPU. On Hopper a Mosaic GPU version with wgmma
would feed the tensor cores better; not yet measured either way.

Dispatch (``interpret``) as in ``jaxpar.kernels``: ``None`` is the compiled kernel on GPU
and ``linear_cross_entropy_reference`` elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpar.kernels.dispatch import triton, use_pallas
from jaxpar.kernels.tiles import is_pow2, load, pow2, store, tile_index


def linear_cross_entropy_reference(x, w, targets):
    """Plain ``jnp`` (materialises the float32 logits): ``[N]`` losses."""
    lse, picked = log_sum_exp_and_target_logit_reference(x, w, targets)
    return lse - picked


def log_sum_exp_and_target_logit_reference(x, w, targets):
    """Plain ``jnp``: ``(logsumexp(x w), (x w)[target])``, each ``[N]`` float32; a
    target outside ``[0, V)`` picks 0."""
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    picked = jnp.where(vocab == targets[:, None], logits, 0.0).sum(-1)
    return jax.nn.logsumexp(logits, axis=-1), picked


def linear_cross_entropy(x, w, targets, *, block_tokens: int = 16, chunk: int = 128,
                         interpret: bool | None = None):
    """Per-token cross-entropy of ``softmax(x w)`` against ``targets`` (module docstring)."""
    lse, picked = log_sum_exp_and_target_logit(x, w, targets, block_tokens=block_tokens,
                                               chunk=chunk, interpret=interpret)
    return lse - picked


def log_sum_exp_and_target_logit(x, w, targets, *, block_tokens: int = 16, chunk: int = 128,
                                 interpret: bool | None = None):
    """The two statistics the loss is made of, ``(lse [N], picked [N])`` float32:
    ``logsumexp(x w)`` and the target's logit (0 for a target outside ``[0, V)``), by the
    same kernels, differentiable in ``x`` and ``w``. With ``w`` one device's slice of a
    vocabulary split across devices (and targets shifted by the slice's offset), these
    combine into the full loss with a log-sum-exp and a sum across the devices
    (``jaxpar.ops.kernel_ops.token_losses``)."""
    _check(x, w, targets, block_tokens, chunk)
    if not use_pallas(interpret):
        return log_sum_exp_and_target_logit_reference(x, w, targets)
    return _fused(x, w, targets.astype(jnp.int32), block_tokens, chunk, bool(interpret))


def _check(x, w, targets, block_tokens, chunk):
    """Shapes the kernels take: ``x [N, D]``, ``w [D, V]``, ``targets [N]`` with any
    ``N, D, V >= 1`` (tiles are ``[block_tokens, pow2(D)]`` and ``[pow2(D), chunk]``, rows
    and columns past the arrays masked); ``block_tokens`` and ``chunk`` powers of two >= 16
    (Triton's dot tiles)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or targets.shape != x.shape[:1] \
            or 0 in x.shape or 0 in w.shape:
        raise ValueError(f"linear_cross_entropy wants x [N, D], w [D, V], targets [N]; got "
                         f"{x.shape}, {w.shape}, {targets.shape}")
    for name, size in (("block_tokens", block_tokens), ("chunk", chunk)):
        if size < 16 or not is_pow2(size):
            raise ValueError(f"linear_cross_entropy {name}={size} must be a power of two >= 16 "
                             "(Triton's dot tiles)")


def _x_tile(x_ref, i, bt, width):
    """Token block ``i`` of ``x`` (the whole ``[N, D]`` ref): ``[bt, width]``, zeros past N
    and D; and its rows' validity ``[bt, 1]``."""
    r, c = tile_index(i * bt, bt, width)
    return load(x_ref, r, c, x_ref.shape), r < x_ref.shape[0]


def _w_tile(w_ref, j, bv, width):
    """Vocabulary chunk ``j`` of ``w`` (the whole ``[D, V]`` ref): ``[width, bv]``, zeros
    past D and V; and its columns (vocabulary ids) ``[1, bv]``."""
    d, c = tile_index(0, width, bv)
    col = j * bv + c
    return load(w_ref, d, col, w_ref.shape), col


def _forward_kernel(x_ref, w_ref, t_ref, lse_ref, picked_ref, *, bv, width):
    """One token block: ``x_ref [N, D]``, ``w_ref [D, V]`` whole; ``t_ref``, ``lse_ref``,
    ``picked_ref [bt, 1]``. Walks the vocabulary chunks with an online log-sum-exp."""
    bt, V = t_ref.shape[0], w_ref.shape[1]
    x, _ = _x_tile(x_ref, pl.program_id(0), bt, width)
    t = t_ref[...]

    def body(j, carry):
        m, total, picked = carry
        w, col = _w_tile(w_ref, j, bv, width)
        logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
        picked = picked + jnp.where(col == t, logits, 0.0).sum(-1, keepdims=True)  # 0 past V
        logits = jnp.where(col < V, logits, -jnp.inf)
        new_m = jnp.maximum(m, logits.max(-1, keepdims=True))  # finite: every chunk has a column
        total = total * jnp.exp(m - new_m) + jnp.exp(logits - new_m).sum(-1, keepdims=True)
        return new_m, total, picked

    f32 = jnp.float32
    init = (jnp.full((bt, 1), -jnp.inf, f32), jnp.zeros((bt, 1), f32), jnp.zeros((bt, 1), f32))
    m, total, picked = jax.lax.fori_loop(0, pl.cdiv(V, bv), body, init)
    lse_ref[...], picked_ref[...] = m + jnp.log(total), picked


def _dlogits(x, w, col, rows_valid, t, lse, g_lse, g_picked, V):
    """``softmax * g_lse + onehot * g_picked`` of one ``[bt, bv]`` tile (the cotangents of
    the two statistics), zero past N and V."""
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    d = jnp.exp(logits - lse) * g_lse + jnp.where(col == t, g_picked, 0.0)
    return jnp.where(rows_valid & (col < V), d, 0.0)


def _dx_kernel(x_ref, w_ref, t_ref, lse_ref, g_lse_ref, g_picked_ref, dx_ref, *, bv, width):
    """One token block: ``dx [bt, D]`` (of ``[N, D]``) = sum over chunks of ``d w_c^T``."""
    i, bt, V = pl.program_id(0), t_ref.shape[0], w_ref.shape[1]
    x, rows_valid = _x_tile(x_ref, i, bt, width)
    stats = (t_ref[...], lse_ref[...], g_lse_ref[...], g_picked_ref[...])

    def body(j, dx):
        w, col = _w_tile(w_ref, j, bv, width)
        d = _dlogits(x, w, col, rows_valid, *stats, V)
        return dx + jax.lax.dot_general(d.astype(w.dtype), w, (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)

    dx = jax.lax.fori_loop(0, pl.cdiv(V, bv), body, jnp.zeros((bt, width), jnp.float32))
    r, c = tile_index(0, bt, width)
    store(dx_ref, r, c, (x_ref.shape[0] - i * bt, x_ref.shape[1]), dx)


def _dw_kernel(x_ref, w_ref, t_ref, lse_ref, g_lse_ref, g_picked_ref, dw_ref, *, bt, width):
    """One vocabulary chunk: ``dw [D, bv]`` (of ``[D, V]``) = sum over token blocks of
    ``x^T d``; the per-token statistics are whole ``[N_pad, 1]`` refs."""
    j, bv, N = pl.program_id(0), dw_ref.shape[1], x_ref.shape[0]
    w, col = _w_tile(w_ref, j, bv, width)

    def body(i, dw):
        x, rows_valid = _x_tile(x_ref, i, bt, width)
        rows = pl.ds(i * bt, bt)
        d = _dlogits(x, w, col, rows_valid, t_ref[rows, :], lse_ref[rows, :], g_lse_ref[rows, :],
                     g_picked_ref[rows, :], w_ref.shape[1])
        return dw + jax.lax.dot_general(x, d.astype(x.dtype), (((0,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)

    dw = jax.lax.fori_loop(0, pl.cdiv(N, bt), body, jnp.zeros((width, bv), jnp.float32))
    d, c = tile_index(0, width, bv)
    store(dw_ref, d, c, (w_ref.shape[0], w_ref.shape[1] - j * bv), dw)


def _whole(x):
    return pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)


def _per_token(x, bt: int):
    """``x [N]`` as ``[N_pad, 1]`` (zeros past N): whole token blocks, no masks needed."""
    return jnp.pad(x, (0, -x.shape[0] % bt))[:, None]


def _forward(x, w, targets, bt, bv, interpret):
    N, D = x.shape
    t = _per_token(targets, bt)
    column = pl.BlockSpec((bt, 1), lambda i: (i, 0))
    f32 = jax.ShapeDtypeStruct(t.shape, jnp.float32)
    lse, picked = pl.pallas_call(
        functools.partial(_forward_kernel, bv=bv, width=pow2(D)),
        grid=(t.shape[0] // bt,), in_specs=[_whole(x), _whole(w), column],
        out_specs=[column, column], out_shape=[f32, f32],
        interpret=interpret, compiler_params=triton(), name="cross_entropy_forward",
    )(x, w, t)
    return lse[:N, 0], picked[:N, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(x, w, targets, bt, bv, interpret):
    return _forward(x, w, targets, bt, bv, interpret)


def _fused_fwd(x, w, targets, bt, bv, interpret):
    lse, picked = _forward(x, w, targets, bt, bv, interpret)
    return (lse, picked), (x, w, targets, lse)


def _fused_bwd(bt, bv, interpret, residuals, cotangents):
    x, w, targets, lse = residuals
    (N, D), V = x.shape, w.shape[1]
    g_lse, g_picked = cotangents
    stats = [_per_token(a, bt) for a in (targets, lse, g_lse.astype(jnp.float32),
                                         g_picked.astype(jnp.float32))]
    column = pl.BlockSpec((bt, 1), lambda i: (i, 0))
    dx = pl.pallas_call(
        functools.partial(_dx_kernel, bv=bv, width=pow2(D)),
        grid=(stats[0].shape[0] // bt,), in_specs=[_whole(x), _whole(w), *[column] * 4],
        out_specs=pl.BlockSpec((bt, D), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((N, D), jnp.float32),
        interpret=interpret, compiler_params=triton(), name="cross_entropy_dx",
    )(x, w, *stats)
    dw = pl.pallas_call(
        functools.partial(_dw_kernel, bt=bt, width=pow2(D)),
        grid=(pl.cdiv(V, bv),), in_specs=[_whole(x), _whole(w), *map(_whole, stats)],
        out_specs=pl.BlockSpec((D, bv), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((D, V), jnp.float32),
        interpret=interpret, compiler_params=triton(), name="cross_entropy_dw",
    )(x, w, *stats)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)
