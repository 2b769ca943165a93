"""Fused RMSNorm and LayerNorm over the last axis, forward and backward, as Pallas kernels.

``norm(x, scale, bias=None, *, kind, eps)`` with ``x [..., D]``, ``scale [D]``,
``bias [D]`` (LayerNorm only) returns ``[..., D]`` in ``x``'s dtype, computed in float32:

* ``rms``:   ``y = x * rsqrt(mean(x^2) + eps) * scale``
* ``layer``: ``y = (x - mean(x)) * rsqrt(var(x) + eps) * scale + bias``

The rows (every leading index) are cut into blocks of ``block_rows``; one program reads a
block once, keeps it in registers/SRAM, and writes the normalised block plus one float32
``rstd`` per row (and ``mean`` for LayerNorm), which the backward reuses instead of
recomputing the statistics. The backward program reads ``x``, ``g`` and the saved
statistics of its block once and writes ``dx`` and its block's partial ``dscale`` /
``dbias`` (rows beyond the array's end masked out); the partials are summed in XLA.
Each pass moves the minimum: read ``x`` (and ``g``), write ``y`` (``dx``).

Backend: ``pl.pallas_call`` with block specs, which lowers through Triton on GPU. A norm
is a bandwidth-bound row reduction with no matmul, so Hopper's wgmma and TMA (Mosaic GPU's
reasons to exist) buy nothing here; the portable lowering keeps one kernel body for the
GPU and for interpret mode on CPU. Not yet measured on a GPU.

Dispatch (``interpret``): ``None`` runs the compiled kernel on GPU and the XLA reference
(``norm_reference``) elsewhere; ``True`` runs the Pallas kernel in interpret mode on any
backend (what the CPU tests do); ``False`` forces the compiled kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpar.kernels.dispatch import triton, use_pallas

KINDS = ("rms", "layer")


def norm_reference(x, scale, bias=None, *, kind: str = "rms", eps: float = 1e-6):
    """Plain ``jnp``: what the kernels compute (and the model's ``Norm``)."""
    h = x.astype(jnp.float32)
    if kind == "layer":
        h = h - h.mean(-1, keepdims=True)
    h = h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + eps) * scale.astype(jnp.float32)
    if bias is not None:
        h = h + bias.astype(jnp.float32)
    return h.astype(x.dtype)


def norm(x, scale, bias=None, *, kind: str = "rms", eps: float = 1e-6, block_rows: int = 8,
         interpret: bool | None = None):
    """The fused norm of ``x [..., D]`` (module docstring); differentiable in ``x``,
    ``scale`` and ``bias``."""
    if kind not in KINDS:
        raise ValueError(f"norm kind must be one of {KINDS}, not {kind!r}")
    if (bias is not None) != (kind == "layer"):
        raise ValueError(f"kind={kind!r} takes {'a' if kind == 'layer' else 'no'} bias")
    if not use_pallas(interpret):
        return norm_reference(x, scale, bias, kind=kind, eps=eps)
    if bias is None:
        bias = jnp.zeros_like(scale)
    D = x.shape[-1]
    y = _norm(x.reshape(-1, D), scale, bias, kind, eps, block_rows, bool(interpret))
    return y.reshape(x.shape)


def rms_norm(x, scale, *, eps: float = 1e-6, interpret: bool | None = None):
    return norm(x, scale, kind="rms", eps=eps, interpret=interpret)


def layer_norm(x, scale, bias, *, eps: float = 1e-6, interpret: bool | None = None):
    return norm(x, scale, bias, kind="layer", eps=eps, interpret=interpret)


def _rows(block_rows: int, D: int):
    return pl.BlockSpec((block_rows, D), lambda i: (i, 0))


def _column(block_rows: int):
    return pl.BlockSpec((block_rows, 1), lambda i: (i, 0))


def _whole(D: int):
    return pl.BlockSpec((1, D), lambda i: (0, 0))


def _forward_kernel(x_ref, scale_ref, bias_ref, y_ref, mean_ref, rstd_ref, *, kind, eps):
    x = x_ref[...].astype(jnp.float32)
    mean = x.mean(-1, keepdims=True) if kind == "layer" else jnp.zeros_like(x[:, :1])
    h = x - mean
    rstd = jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + eps)
    y_ref[...] = (h * rstd * scale_ref[...] + bias_ref[...]).astype(y_ref.dtype)
    mean_ref[...], rstd_ref[...] = mean, rstd


def _backward_kernel(x_ref, g_ref, scale_ref, mean_ref, rstd_ref, dx_ref, dscale_ref, dbias_ref,
                     *, kind, rows):
    block = x_ref.shape[0]
    valid = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0) < rows
    g = jnp.where(valid, g_ref[...].astype(jnp.float32), 0.0)
    xhat = jnp.where(valid, (x_ref[...].astype(jnp.float32) - mean_ref[...]) * rstd_ref[...], 0.0)
    gs = g * scale_ref[...]
    # y = xhat * scale + bias, xhat = (x - mean) * rstd:
    # dx = rstd * (gs - mean(gs) - xhat * mean(gs * xhat)), the mean(gs) term for LayerNorm only.
    dx = gs - xhat * (gs * xhat).mean(-1, keepdims=True)
    if kind == "layer":
        dx = dx - gs.mean(-1, keepdims=True)
    dx_ref[...] = (dx * rstd_ref[...]).astype(dx_ref.dtype)
    dscale_ref[...] = (g * xhat).sum(0, keepdims=True)
    dbias_ref[...] = g.sum(0, keepdims=True)


def _forward(x, scale, bias, kind, eps, block_rows, interpret):
    rows, D = x.shape
    f32 = jnp.float32
    y, mean, rstd = pl.pallas_call(
        functools.partial(_forward_kernel, kind=kind, eps=eps),
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[_rows(block_rows, D), _whole(D), _whole(D)],
        out_specs=[_rows(block_rows, D), _column(block_rows), _column(block_rows)],
        out_shape=[jax.ShapeDtypeStruct((rows, D), x.dtype), jax.ShapeDtypeStruct((rows, 1), f32),
                   jax.ShapeDtypeStruct((rows, 1), f32)],
        interpret=interpret, compiler_params=triton(),
    )(x, scale.astype(f32)[None], bias.astype(f32)[None])
    return y, mean, rstd


def _backward(x, g, scale, mean, rstd, kind, block_rows, interpret):
    rows, D = x.shape
    blocks = pl.cdiv(rows, block_rows)
    partial = pl.BlockSpec((1, D), lambda i: (i, 0))
    dx, dscale, dbias = pl.pallas_call(
        functools.partial(_backward_kernel, kind=kind, rows=rows),
        grid=(blocks,),
        in_specs=[_rows(block_rows, D), _rows(block_rows, D), _whole(D), _column(block_rows),
                  _column(block_rows)],
        out_specs=[_rows(block_rows, D), partial, partial],
        out_shape=[jax.ShapeDtypeStruct((rows, D), x.dtype),
                   jax.ShapeDtypeStruct((blocks, D), jnp.float32),
                   jax.ShapeDtypeStruct((blocks, D), jnp.float32)],
        interpret=interpret, compiler_params=triton(),
    )(x, g, scale.astype(jnp.float32)[None], mean, rstd)
    return dx, dscale.sum(0), dbias.sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _norm(x, scale, bias, kind, eps, block_rows, interpret):
    return _forward(x, scale, bias, kind, eps, block_rows, interpret)[0]


def _norm_fwd(x, scale, bias, kind, eps, block_rows, interpret):
    y, mean, rstd = _forward(x, scale, bias, kind, eps, block_rows, interpret)
    return y, (x, scale, bias, mean, rstd)


def _norm_bwd(kind, eps, block_rows, interpret, residuals, g):
    x, scale, bias, mean, rstd = residuals
    dx, dscale, dbias = _backward(x, g, scale, mean, rstd, kind, block_rows, interpret)
    return dx, dscale.astype(scale.dtype), dbias.astype(bias.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)
