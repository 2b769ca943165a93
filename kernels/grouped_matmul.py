"""Grouped matmul (megablox's ``gmm``), as Pallas kernels: each row of ``lhs`` times its
group's matrix, the mixture-of-experts layer's expert MLP (``jaxpar.models.moe``).

``grouped_matmul(lhs, rhs, group_sizes)`` with ``lhs [M, K]`` rows sorted by group,
``rhs [G, K, N]`` and ``group_sizes [G]`` int returns ``[M, N]``: rows ``offsets[g] ..
offsets[g + 1] - 1`` (``offsets`` the running sum of ``group_sizes``) times ``rhs[g]``,
zeros for the rows past ``sum(group_sizes)``: ``jax.lax.ragged_dot(lhs, rhs,
group_sizes)``. A group may be empty; group sizes are clipped to ``>= 0`` and their
running sum to ``M``. Products accumulate in float32; the output has ``lhs`` and
``rhs``'s promoted dtype, as ``ragged_dot``'s.

Why our own kernel. On CUDA, ``jax.lax.ragged_dot``'s default lowering in jaxlib 0.10
rewrites the ragged dot into a dense batched dot over zero-padded operands (``G`` times
the FLOPs; openxla/xla#40189 adds a cuDNN fusion behind a flag for the forward and the
input gradient only, the weight gradient still dense; marin-community/marin#7012 measured
the dense path at 23 TFLOP/s on a B200 and the flagged cuDNN path crashing). tokamax
ships grouped-matmul kernels but is not a dependency, and a GPU machine without registry
access cannot install it; megablox is TPU (Mosaic) only. So: a Triton-lowered Pallas
kernel of the megablox scheme, portable, with the same body running in interpret mode
on CPU (the tests).

Kernel (forward, and the input gradient). Rows are cut into tiles of ``block_m``; a
*work item* is one (group, row tile) pair the group overlaps, so a tile that straddles
two groups is two items, each storing only its own group's rows (masked stores: the
items write disjoint rows, so they never race). The rows past ``sum(group_sizes)`` are
one more group, ``G``, whose items store zeros without a matmul. Items are found in XLA
from the group offsets (``_schedule``: ``O(G + M / block_m)`` ints); there are at most
``ceil(M / block_m) + G`` of them (each group boundary adds at most one), a bound of the
shapes alone, so the grid ``(items, ceil(N / block_n))`` is static and its idle items do
nothing. Each program loops over ``K`` in ``block_k`` slices: ``[block_m, block_k] x
[block_k, block_n]`` with ``rhs[g]`` read as rows ``g * K + k`` of ``rhs`` seen as ``[G *
K, N]`` (a reshape: no copy). ``transpose_rhs`` reads ``rhs [G, N, K]`` as ``[block_n,
block_k]`` tiles and contracts their second axis, so the input gradient ``d_lhs = d_out
rhs[g]^T`` is this kernel without a transposed copy of the weights.

Weight gradient (``d_rhs[g] = lhs[rows g]^T d_out[rows g]``, megablox's ``tgmm``): a
second kernel, one program per (group, ``block_k`` slice of K, ``block_n`` slice of N),
looping over its group's row tiles (a trip count read from the offsets) with rows outside
the group masked to zeros; an empty group's programs write zeros. A kernel rather than
``ragged_dot``'s transpose because that transpose is exactly the dense rewrite above.

Triton wants power-of-two tiles: ``block_m``, ``block_k``, ``block_n`` powers of two >= 16
(each cut to ``pow2`` of its dimension when that is smaller); loads read zeros past the
arrays' extents and stores are masked, so any ``M``, ``K``, ``N`` and ``G`` run, nothing
padded or copied. Row numbers are int32: ``G * K``, ``G * N`` or ``M`` at ``2**31`` or
more run the reference instead (``dispatch.fall_back``, logged once).

Not measured: this task had no GPU. The kernels have run only in Pallas interpret mode on
CPU (tests/test_kernels_grouped_matmul.py) and been lowered for CUDA without one
(tests/test_kernels_lower_for_gpu.py); compiled correctness and the speed against
``ragged_dot`` wait for bench/gpu_check.sh (its ``correctness`` part, and
``bench/kernels.py --parts gmm`` in its ``kernels`` part). The default tiles (64 x 64 x
64) are a guess, not tuned.

``grouped_matmul_reference`` is ``jax.lax.ragged_dot`` (float32 accumulation). Dispatch
(``interpret``) as in ``jaxpar.kernels``: ``None`` is the compiled kernel on a GPU that
runs it and the reference elsewhere; ``True`` the kernel in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.kernels.dispatch import fall_back, triton, use_pallas
from jaxpar.kernels.tiles import is_pow2, load, pow2, store

# Rows the kernels address (int32 row numbers).
_MAX_ROWS = 2**31 - 1


def grouped_matmul(lhs, rhs, group_sizes, *, block_m: int = 64, block_k: int = 64, block_n: int = 64,
                   interpret: bool | None = None):
    """``lhs [M, K]`` rows sorted by group, ``rhs [G, K, N]``, ``group_sizes [G]`` int ->
    ``[M, N]``, ``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` (module docstring);
    differentiable in ``lhs`` and ``rhs``. ``block_m``, ``block_k``, ``block_n``: the
    tiles, powers of two >= 16."""
    _check(lhs, rhs, group_sizes, block_m, block_k, block_n)
    (M, K), (G, _, N) = lhs.shape, rhs.shape
    if not use_pallas(interpret):
        return grouped_matmul_reference(lhs, rhs, group_sizes)
    if max(M, G * K, G * N) > _MAX_ROWS:
        fall_back(f"grouped_matmul addresses rows in int32, so the kernel takes M, G * K and G * N < 2**31, "
                  f"got {M}, {G * K} and {G * N}")
        return grouped_matmul_reference(lhs, rhs, group_sizes)
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    if M == 0 or N == 0:
        return jnp.zeros((M, N), out_dtype)
    tiles = (min(block_m, pow2(M)), min(block_k, pow2(K)), min(block_n, pow2(N)))
    return _gmm(lhs, rhs, group_sizes.astype(jnp.int32), tiles, bool(interpret))


def _check(lhs, rhs, group_sizes, block_m, block_k, block_n):
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != rhs.shape[:1] \
            or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul wants lhs [M, K], rhs [G, K, N], group_sizes [G] int; got lhs "
                         f"{lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape} {group_sizes.dtype}")
    for name, size in (("block_m", block_m), ("block_k", block_k), ("block_n", block_n)):
        if size < 16 or not is_pow2(size):
            raise ValueError(f"grouped_matmul {name}={size} must be a power of two >= 16 (Triton's dot tiles)")


def _offsets(group_sizes, M):
    """``(starts, ends)`` int32 ``[G]``: each group's rows, sizes clipped to >= 0 and
    their running sum to ``M``."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), M).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]]), ends


def _schedule(group_sizes, M: int, bm: int):
    """The forward kernel's work items, ``(group, tile, lo, hi)`` int32 each ``[ceil(M /
    bm) + G]``: item ``w`` computes group ``group[w]``'s rows ``lo[w] .. hi[w] - 1`` of
    row tile ``tile[w]``; group ``G`` is the rows past the groups' total (zeros), and the
    items past the last real one have ``lo == hi`` (nothing stored)."""
    G = group_sizes.shape[0]
    starts, ends = _offsets(group_sizes, M)
    starts = jnp.concatenate([starts, ends[-1:]])  # group G: the rows past the total
    ends = jnp.concatenate([ends, jnp.full(1, M, jnp.int32)])
    first = starts // bm
    tiles = jnp.where(ends > starts, (ends - 1) // bm - first + 1, 0)  # [G + 1]
    item_end = jnp.cumsum(tiles)
    w = jnp.arange(pl.cdiv(M, bm) + G, dtype=jnp.int32)
    group = jnp.searchsorted(item_end, w, side="right").astype(jnp.int32)  # G + 1: idle
    live = group <= G
    g = jnp.minimum(group, G)
    tile = first[g] + w - (item_end - tiles)[g]
    lo = jnp.where(live, jnp.maximum(starts[g], tile * bm), 0)
    hi = jnp.where(live, jnp.minimum(ends[g], tile * bm + bm), 0)
    return g, jnp.where(live, tile, 0), lo, hi


def _gmm_kernel(group_ref, tile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref, *, bm, bk, bn, groups,
                transpose):
    """One work item's row tile x ``block_n`` columns: ``lhs_ref [M, K]``, ``rhs_ref [G *
    K, N]`` (``[G * N, K]`` with ``transpose``) and ``out_ref [M, N]`` whole; stores rows
    ``lo .. hi - 1`` only."""
    g, t, lo, hi = group_ref[()], tile_ref[()], lo_ref[()], hi_ref[()]
    M, K = lhs_ref.shape
    N = out_ref.shape[1]
    gc = jnp.minimum(g, groups - 1)  # group G (the rows past the total) reads nothing
    r, n = _iota(t * bm, bm, 0), _iota(pl.program_id(1) * bn, bn, 0)  # [bm, 1], [bn, 1]
    cols = _iota(pl.program_id(1) * bn, bn, 1)

    def body(i, acc):
        kr, kc = _iota(i * bk, bk, 0), _iota(i * bk, bk, 1)
        a = load(lhs_ref, r, kc, (hi, K))  # [bm, bk]
        if transpose:  # rhs[g] is [N, K]: a [bn, bk] tile, contracted on its second axis
            b = load(rhs_ref, n, kc, (N, K), rows=gc * N + n)
            return acc + jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        b = load(rhs_ref, kr, cols, (K, N), rows=gc * K + kr)  # [bk, bn]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    steps = jnp.where(g < groups, pl.cdiv(K, bk), 0)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(out_ref.at[r, cols], acc.astype(out_ref.dtype), mask=(r >= lo) & (r < hi) & (cols < N))


def _tgmm_kernel(start_ref, end_ref, lhs_ref, dout_ref, out_ref, *, bm, bk, bn):
    """One (group ``g``, K slice, N slice): ``out_ref [G * K, N]`` rows ``g * K + k`` =
    ``lhs[rows of g]^T dout[rows of g]``, ``lhs_ref [M, K]``, ``dout_ref [M, N]`` whole."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = start_ref[()], end_ref[()]
    (M, K), N = lhs_ref.shape, dout_ref.shape[1]
    kc, nc = _iota(i * bk, bk, 1), _iota(j * bn, bn, 1)

    def body(s, acc):
        r = _iota((lo // bm + s) * bm, bm, 0)
        mine = (r >= lo) & (r < hi)
        x = plgpu.load(lhs_ref.at[r, kc], mask=mine & (kc < K), other=0)  # [bm, bk]
        dy = plgpu.load(dout_ref.at[r, nc], mask=mine & (nc < N), other=0)  # [bm, bn]
        return acc + jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    steps = jnp.where(hi > lo, pl.cdiv(hi, bm) - lo // bm, 0)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bk, bn), jnp.float32))
    store(out_ref, g * K + _iota(i * bk, bk, 0), nc, ((g + 1) * K, N), acc)


def _iota(start, n: int, axis: int):
    """int32 ``start .. start + n - 1`` as a column ``[n, 1]`` (``axis`` 0) or a row ``[1, n]``."""
    shape = (n, 1) if axis == 0 else (1, n)
    return start + jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _scalar(axes: int):
    """Each program's own entry of a ``[W]`` array (the grid's first axis)."""
    return pl.BlockSpec((None,), (lambda w, j: (w,)) if axes == 2 else (lambda g, i, j: (g,)))


def _whole(x, axes: int):
    return pl.BlockSpec(x.shape, (lambda a, b: (0,) * x.ndim) if axes == 2 else (lambda a, b, c: (0,) * x.ndim))


def _forward(lhs, rhs, group_sizes, tiles, interpret, *, transpose=False, out_dtype=None):
    """``lhs [M, K]`` by ``rhs [G, K, N]`` (``[G, N, K]`` with ``transpose``) per group."""
    bm, bk, bn = tiles
    M, G = lhs.shape[0], rhs.shape[0]
    N = rhs.shape[1] if transpose else rhs.shape[2]
    bk, bn = min(bk, pow2(lhs.shape[1])), min(bn, pow2(N))
    items = _schedule(group_sizes, M, bm)
    rhs2d = rhs.reshape(G * rhs.shape[1], rhs.shape[2])  # a bitcast: no copy
    return pl.pallas_call(
        functools.partial(_gmm_kernel, bm=bm, bk=bk, bn=bn, groups=G, transpose=transpose),
        grid=(items[0].shape[0], pl.cdiv(N, bn)),
        in_specs=[_scalar(2)] * 4 + [_whole(lhs, 2), _whole(rhs2d, 2)],
        out_specs=pl.BlockSpec((M, N), lambda w, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype or jnp.float32),
        interpret=interpret, compiler_params=triton(), name="grouped_matmul",
    )(*items, lhs, rhs2d)


def _weight_grad(lhs, dout, group_sizes, G, tiles, interpret):
    """``[G, K, N]``: per group ``lhs[rows]^T dout[rows]`` (zeros for an empty group)."""
    bm, bk, bn = tiles
    (M, K), N = lhs.shape, dout.shape[1]
    bk, bn = min(bk, pow2(K)), min(bn, pow2(N))
    starts, ends = _offsets(group_sizes, M)
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, bm=bm, bk=bk, bn=bn),
        grid=(G, pl.cdiv(K, bk), pl.cdiv(N, bn)),
        in_specs=[_scalar(3)] * 2 + [_whole(lhs, 3), _whole(dout, 3)],
        out_specs=pl.BlockSpec((G * K, N), lambda g, i, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((G * K, N), jnp.float32),
        interpret=interpret, compiler_params=triton(), name="grouped_matmul_weight_grad",
    )(starts, ends, lhs, dout)
    return out.reshape(G, K, N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(lhs, rhs, group_sizes, tiles, interpret):
    return _forward(lhs, rhs, group_sizes, tiles, interpret, out_dtype=jnp.result_type(lhs.dtype, rhs.dtype))


def _gmm_fwd(lhs, rhs, group_sizes, tiles, interpret):
    out = _forward(lhs, rhs, group_sizes, tiles, interpret, out_dtype=jnp.result_type(lhs.dtype, rhs.dtype))
    return out, (lhs, rhs, group_sizes)


def _gmm_bwd(tiles, interpret, residuals, dout):
    lhs, rhs, group_sizes = residuals
    dout = dout.astype(jnp.result_type(lhs.dtype, rhs.dtype))
    d_lhs = _forward(dout, rhs, group_sizes, tiles, interpret, transpose=True, out_dtype=lhs.dtype)
    d_rhs = _weight_grad(lhs, dout, group_sizes, rhs.shape[0], tiles, interpret)
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul_reference(lhs, rhs, group_sizes):
    """``jax.lax.ragged_dot`` accumulating in float32, in ``lhs`` and ``rhs``'s promoted dtype."""
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(jnp.result_type(lhs.dtype, rhs.dtype))
