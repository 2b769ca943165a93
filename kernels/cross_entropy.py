"""Fused linear + softmax cross-entropy that walks the vocabulary in chunks, forward and
backward, as Pallas kernels: the ``[tokens, vocab]`` logits never exist in memory.

``linear_cross_entropy(x, w, targets)`` with ``x [N, D]`` (the final hidden states),
``w [D, V]`` (the vocabulary projection) and ``targets [N]`` int returns the per-token
losses ``logsumexp(x w) - (x w)[target]`` ``[N]`` in float32 (the caller masks and
averages). It is made of two statistics, ``log_sum_exp_and_target_logit`` (the
differentiable primitive the kernels implement), which is also what a vocabulary split
across devices combines (``jaxpar.ops.kernel_ops.token_losses``). Products accumulate in float32
whatever the input dtype.

* Forward: one program per (token block, vocabulary chunk), the chunk axis innermost.
  A token block's running max, running sum of exponentials and target logit stay in
  its output blocks while the chunks stream past (online logsumexp); the last chunk
  writes the log-sum-exp, which the backward reuses.
* Backward, two kernels over the same tiles, each recomputing its ``[tokens, chunk]``
  logits from ``x`` and ``w`` and the saved log-sum-exp, with ``d = softmax * g_lse +
  onehot * g_picked`` (the two statistics' cotangents; ``g, -g`` for the loss):
  ``dx = sum over chunks of d w_c^T`` (token blocks outer), and
  ``dw_c = sum over token blocks of x^T d`` (chunks outer).

Memory beyond the inputs and gradients: one ``[block_tokens, chunk]`` tile per program
and two floats per token. Rows and columns past the arrays' ends (partial blocks) are
zeroed before use, so whatever the padding holds cannot leak into a sum.

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
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or targets.shape != x.shape[:1]:
        raise ValueError(f"linear_cross_entropy wants x [N, D], w [D, V], targets [N]; got "
                         f"{x.shape}, {w.shape}, {targets.shape}")
    if not use_pallas(interpret):
        return log_sum_exp_and_target_logit_reference(x, w, targets)
    return _fused(x, w, targets.astype(jnp.int32), block_tokens, chunk, bool(interpret))


def _tile(x_ref, w_ref, i, j, rows, vocab):
    """The ``[block_tokens, chunk]`` float32 logits of tile (i, j), with the column ids
    and validity masks; rows/columns past the ends read as zeros."""
    bt, bv = x_ref.shape[0], w_ref.shape[1]
    row = i * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    col = j * bv + jax.lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    x = jnp.where(row < rows, x_ref[...], 0)
    w = jnp.where(col < vocab, w_ref[...], 0)
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return x, w, logits, col, row < rows, col < vocab


def _forward_kernel(x_ref, w_ref, t_ref, picked_ref, lse_ref, max_ref, sum_ref, *, rows, vocab):
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _():
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        picked_ref[...] = jnp.zeros(picked_ref.shape, jnp.float32)

    _, _, logits, col, _, in_vocab = _tile(x_ref, w_ref, i, j, rows, vocab)
    logits = jnp.where(in_vocab, logits, -jnp.inf)
    new_max = jnp.maximum(max_ref[...], logits.max(-1, keepdims=True))
    sum_ref[...] = sum_ref[...] * jnp.exp(max_ref[...] - new_max) + jnp.exp(logits - new_max).sum(-1, keepdims=True)
    max_ref[...] = new_max
    picked_ref[...] += jnp.where(in_vocab & (col == t_ref[...]), logits, 0.0).sum(-1, keepdims=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        lse_ref[...] = max_ref[...] + jnp.log(sum_ref[...])


def _dlogits(x_ref, w_ref, t_ref, lse_ref, g_lse_ref, g_picked_ref, i, j, rows, vocab):
    """``softmax * g_lse + onehot * g_picked`` of tile (i, j) (the cotangents of the two
    statistics), zero outside the arrays."""
    x, w, logits, col, in_rows, in_vocab = _tile(x_ref, w_ref, i, j, rows, vocab)
    d = jnp.exp(logits - lse_ref[...]) * g_lse_ref[...] + jnp.where(col == t_ref[...], g_picked_ref[...], 0.0)
    return x, w, jnp.where(in_rows & in_vocab, d, 0.0)


def _dx_kernel(x_ref, w_ref, t_ref, lse_ref, g_lse_ref, g_picked_ref, dx_ref, *, rows, vocab):
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _():
        dx_ref[...] = jnp.zeros(dx_ref.shape, jnp.float32)

    _, w, d = _dlogits(x_ref, w_ref, t_ref, lse_ref, g_lse_ref, g_picked_ref, i, j, rows, vocab)
    dx_ref[...] += jax.lax.dot_general(d.astype(w.dtype), w, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)


def _dw_kernel(x_ref, w_ref, t_ref, lse_ref, g_lse_ref, g_picked_ref, dw_ref, *, rows, vocab):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _():
        dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)

    x, _, d = _dlogits(x_ref, w_ref, t_ref, lse_ref, g_lse_ref, g_picked_ref, i, j, rows, vocab)
    dw_ref[...] += jax.lax.dot_general(x, d.astype(x.dtype), (((0,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)


def _specs(D, bt, bv, vocab_outer: bool):
    """Block specs of x, w, targets, lse, g_lse, g_picked for the grid (i, j), or (j, i)
    if ``vocab_outer``."""
    order = (lambda f: (lambda j, i: f(i, j))) if vocab_outer else (lambda f: f)
    tokens = lambda width: pl.BlockSpec((bt, width), order(lambda i, j: (i, 0)))  # noqa: E731
    return [tokens(D), pl.BlockSpec((D, bv), order(lambda i, j: (0, j))), tokens(1), tokens(1), tokens(1), tokens(1)]


def _forward(x, w, targets, bt, bv, interpret):
    (N, D), V = x.shape, w.shape[1]
    column = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
    f32 = jax.ShapeDtypeStruct((N, 1), jnp.float32)
    picked, lse, _, _ = pl.pallas_call(
        functools.partial(_forward_kernel, rows=N, vocab=V),
        grid=(pl.cdiv(N, bt), pl.cdiv(V, bv)),
        in_specs=_specs(D, bt, bv, False)[:3],
        out_specs=[column] * 4, out_shape=[f32] * 4,  # picked, lse, running max, running sum
        interpret=interpret, compiler_params=triton(),
    )(x, w, targets[:, None])
    return lse[:, 0], picked[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(x, w, targets, bt, bv, interpret):
    return _forward(x, w, targets, bt, bv, interpret)


def _fused_fwd(x, w, targets, bt, bv, interpret):
    lse, picked = _forward(x, w, targets, bt, bv, interpret)
    return (lse, picked), (x, w, targets, lse)


def _fused_bwd(bt, bv, interpret, residuals, cotangents):
    x, w, targets, lse = residuals
    (N, D), V = x.shape, w.shape[1]
    g_lse, g_picked = (c.astype(jnp.float32)[:, None] for c in cotangents)
    args = (x, w, targets[:, None], lse[:, None], g_lse, g_picked)
    dx = pl.pallas_call(
        functools.partial(_dx_kernel, rows=N, vocab=V),
        grid=(pl.cdiv(N, bt), pl.cdiv(V, bv)),
        in_specs=_specs(D, bt, bv, False),
        out_specs=pl.BlockSpec((bt, D), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((N, D), jnp.float32),
        interpret=interpret, compiler_params=triton(),
    )(*args)
    dw = pl.pallas_call(
        functools.partial(_dw_kernel, rows=N, vocab=V),
        grid=(pl.cdiv(V, bv), pl.cdiv(N, bt)),
        in_specs=_specs(D, bt, bv, True),
        out_specs=pl.BlockSpec((D, bv), lambda j, i: (0, j)),
        out_shape=jax.ShapeDtypeStruct((D, V), jnp.float32),
        interpret=interpret, compiler_params=triton(),
    )(*args)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)
