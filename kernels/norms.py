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

Shapes: any ``D`` and any row count. Triton wants power-of-two tiles, so a program's tile
is ``[block_rows, pow2(D)]`` (``D`` 576 or 768 computes on 1024 columns): the loads read
zeros past ``D`` and past the last row, the stores are masked there, and the statistics
divide by the true ``D``, so the padding never reaches a result. ``x`` is never copied.

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
from jaxpar.kernels.tiles import is_pow2, load, pow2, store, tile_index

KINDS = ("rms", "layer")
# Elements per tile at most: wide rows get fewer rows per program (registers).
_MAX_TILE = 1 << 16


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
    _check(x, scale, bias, block_rows)
    if not use_pallas(interpret):
        return norm_reference(x, scale, bias, kind=kind, eps=eps)
    if bias is None:
        bias = jnp.zeros_like(scale)
    D = x.shape[-1]
    block_rows = min(block_rows, max(1, _MAX_TILE // pow2(D)))
    y = _norm(x.reshape(-1, D), scale, bias, kind, eps, block_rows, bool(interpret))
    return y.reshape(x.shape)


def _check(x, scale, bias, block_rows):
    """Shapes the kernels take: ``x [..., D]`` with any ``D >= 1`` and any row count (tiles
    are ``[block_rows, pow2(D)]``, the columns past D and rows past the end masked);
    ``scale`` (and ``bias``) ``[D]``; ``block_rows`` a power of two (Triton tiles)."""
    D = x.shape[-1] if x.ndim else 0
    if x.ndim < 1 or D < 1 or scale.shape != (D,) or (bias is not None and bias.shape != (D,)):
        raise ValueError(f"norm wants x [..., D], scale and bias [D]; got x {x.shape}, scale "
                         f"{scale.shape}, bias {None if bias is None else bias.shape}")
    if not is_pow2(block_rows):
        raise ValueError(f"norm block_rows={block_rows} must be a power of two (Triton tiles)")


def rms_norm(x, scale, *, eps: float = 1e-6, interpret: bool | None = None):
    return norm(x, scale, kind="rms", eps=eps, interpret=interpret)


def layer_norm(x, scale, bias, *, eps: float = 1e-6, interpret: bool | None = None):
    return norm(x, scale, bias, kind="layer", eps=eps, interpret=interpret)


def _rows(block_rows: int, D: int):
    return pl.BlockSpec((block_rows, D), lambda i: (i, 0))


def _column(block_rows: int):
    return pl.BlockSpec((block_rows, 1), lambda i: (i, 0))


def _whole(width: int):
    return pl.BlockSpec((1, width), lambda i: (0, 0))


def _tile(x_ref, width: int, rows: int, D: int):
    """This program's ``(r, c, extent)`` for a ``[block_rows, width]`` tile of its block of
    the ``[rows, D]`` array: ``extent`` the block's true rows and columns."""
    block = x_ref.shape[0]
    r, c = tile_index(0, block, width)
    return r, c, (rows - pl.program_id(0) * block, D)


def _forward_kernel(x_ref, scale_ref, bias_ref, y_ref, mean_ref, rstd_ref, *, kind, eps, rows, D):
    r, c, extent = _tile(x_ref, scale_ref.shape[1], rows, D)
    x = load(x_ref, r, c, extent).astype(jnp.float32)  # zeros past the row and D
    # Statistics over the true D: the padded columns add zeros to the sums.
    mean = x.sum(-1, keepdims=True) / D if kind == "layer" else jnp.zeros_like(x[:, :1])
    h = jnp.where(c < D, x - mean, 0.0)
    rstd = jax.lax.rsqrt(jnp.square(h).sum(-1, keepdims=True) / D + eps)
    store(y_ref, r, c, extent, h * rstd * scale_ref[...] + bias_ref[...])
    mean_ref[...], rstd_ref[...] = mean, rstd


def _backward_kernel(x_ref, g_ref, scale_ref, mean_ref, rstd_ref, dx_ref, dscale_ref, dbias_ref,
                     *, kind, rows, D):
    r, c, extent = _tile(x_ref, scale_ref.shape[1], rows, D)
    valid = (r < extent[0]) & (c < D)
    g = load(g_ref, r, c, extent).astype(jnp.float32)
    x = load(x_ref, r, c, extent).astype(jnp.float32)
    xhat = jnp.where(valid, (x - mean_ref[...]) * rstd_ref[...], 0.0)
    gs = g * scale_ref[...]
    # y = xhat * scale + bias, xhat = (x - mean) * rstd:
    # dx = rstd * (gs - mean(gs) - xhat * mean(gs * xhat)), the mean(gs) term for LayerNorm only.
    dx = gs - xhat * (gs * xhat).sum(-1, keepdims=True) / D
    if kind == "layer":
        dx = dx - gs.sum(-1, keepdims=True) / D
    store(dx_ref, r, c, extent, dx * rstd_ref[...])
    dscale_ref[...] = (g * xhat).sum(0, keepdims=True)
    dbias_ref[...] = g.sum(0, keepdims=True)


def _forward(x, scale, bias, kind, eps, block_rows, interpret):
    """``(y [rows, D], mean, rstd [blocks * block_rows, 1] f32)``; ``scale`` and ``bias``
    ``[1, D_pad]`` float32, zero past D."""
    rows, D = x.shape
    blocks, width = pl.cdiv(rows, block_rows), scale.shape[1]
    f32 = jax.ShapeDtypeStruct((blocks * block_rows, 1), jnp.float32)
    return pl.pallas_call(
        functools.partial(_forward_kernel, kind=kind, eps=eps, rows=rows, D=D),
        grid=(blocks,),
        in_specs=[_rows(block_rows, D), _whole(width), _whole(width)],
        out_specs=[_rows(block_rows, D), _column(block_rows), _column(block_rows)],
        out_shape=[jax.ShapeDtypeStruct((rows, D), x.dtype), f32, f32],
        interpret=interpret, compiler_params=triton(),
    )(x, scale, bias)


def _backward(x, g, scale, mean, rstd, kind, block_rows, interpret):
    rows, D = x.shape
    blocks, width = pl.cdiv(rows, block_rows), scale.shape[1]
    partial = pl.BlockSpec((1, width), lambda i: (i, 0))
    dx, dscale, dbias = pl.pallas_call(
        functools.partial(_backward_kernel, kind=kind, rows=rows, D=D),
        grid=(blocks,),
        in_specs=[_rows(block_rows, D), _rows(block_rows, D), _whole(width), _column(block_rows),
                  _column(block_rows)],
        out_specs=[_rows(block_rows, D), partial, partial],
        out_shape=[jax.ShapeDtypeStruct((rows, D), x.dtype),
                   jax.ShapeDtypeStruct((blocks, width), jnp.float32),
                   jax.ShapeDtypeStruct((blocks, width), jnp.float32)],
        interpret=interpret, compiler_params=triton(),
    )(x, g, scale, mean, rstd)
    return dx, dscale.sum(0)[:D], dbias.sum(0)[:D]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _norm(x, scale, bias, kind, eps, block_rows, interpret):
    return _norm_fwd(x, scale, bias, kind, eps, block_rows, interpret)[0]


def _norm_fwd(x, scale, bias, kind, eps, block_rows, interpret):
    y, mean, rstd = _forward(x, _padded(scale), _padded(bias), kind, eps, block_rows, interpret)
    return y, (x, scale, bias, mean, rstd)


def _norm_bwd(kind, eps, block_rows, interpret, residuals, g):
    x, scale, bias, mean, rstd = residuals
    dx, dscale, dbias = _backward(x, g, _padded(scale), mean, rstd, kind, block_rows, interpret)
    return dx, dscale.astype(scale.dtype), dbias.astype(bias.dtype)


def _padded(v):
    """``v [D]`` as float32 ``[1, pow2(D)]``, zeros past D (tiny: the rows are never padded)."""
    return jnp.pad(v.astype(jnp.float32), (0, pow2(v.shape[0]) - v.shape[0]))[None]


_norm.defvjp(_norm_fwd, _norm_bwd)
