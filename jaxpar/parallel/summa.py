"""SUMMA matrix products on a q x q device grid: the 2D tensor parallelism of Optimus.

SUMMA (van de Geijn & Watts, "SUMMA: Scalable Universal Matrix Multiplication
Algorithm", 1997), in the three forms Optimus (Xu et al., "An Efficient 2D Method for
Training Super-Large Deep Learning Models", 2021, Sec. 3) builds a transformer from:

* ``C = A B``   (``nn``): A ``[M, K]``, B ``[K, N]``. Step k: grid column k broadcasts
  its A blocks along the grid rows, grid row k its B blocks along the grid columns, and
  every device adds ``A[i, k] B[k, j]`` to its C block. C stays put.
* ``C = A Bᵀ``  (``nt``): A ``[M, K]``, B ``[N, K]``. Step k: grid row k broadcasts its
  B blocks along the columns, device ``(i, l)`` forms ``A[i, l] B[k, l]ᵀ``, and these
  partial products are summed along grid row i into device ``(i, k)``. A stays put.
* ``C = Aᵀ B``  (``tn``): A ``[K, M]``, B ``[K, N]``. Step k: grid column k broadcasts
  its A blocks along the rows, device ``(l, j)`` forms ``A[l, k]ᵀ B[l, j]``, and these
  are summed along grid column j into device ``(k, j)``. B stays put.

Every matrix, operands and result alike, is blocked ``PartitionSpec(row_axis,
col_axis)``: device ``(i, j)`` of the grid holds block ``(i, j)``. Each form's gradient
is the other two forms (``nn``: dA = dC Bᵀ is ``nt``, dB = Aᵀ dC is ``tn``; ``nt``: dA =
dC B is ``nn``, dB = dCᵀ A is ``tn``; ``tn``: dA = B dCᵀ is ``nt``, dB = A dC is
``nn``), so the backward pass is SUMMA as well, with no gathered matrix anywhere.
Leading batch dimensions of ``a`` (``[..., M, K]``, ``nn`` and ``nt`` only) are folded
into M on each device; ``Aᵀ Bᵀ`` is not offered.

Communication. Broadcasts and reductions are binomial trees of ``jax.lax.ppermute``
(XLA ``collective-permute``) over the grid axis, rooted at the step's owner:
``R = ceil(log2 q)`` rounds; in round r each device fewer than ``2^r`` hops past the
root sends to the device ``2^r`` further on (a reduction runs the same tree backwards,
adding). Every non-root device receives the panel exactly once (reduction: sends its
partial sum exactly once), which is the least any broadcast can move: ``(q - 1)`` block
transfers per grid line per step. The alternatives cost more. A masked ``psum`` is an
all-reduce, ``2 (q - 1) / q`` blocks per device per step under the ring algorithm,
twice the tree's total and mostly zeros; an ``all_gather`` of the row moves the same
bytes as the tree but all at step 0, holding ``q`` panels at once, which is not SUMMA.

Over the q steps the root walks once round the grid line, so every device takes every
position in the tree once and sends exactly as much as it receives. Per device per call,
in elements, with ``X, Y`` the two moving matrices' element counts (``beta`` = product
of ``a``'s leading batch dims, 1 for plain matrices):

====  ==============  ===================================================
form  moves           elements each device sends (= receives) per call
====  ==============  ===================================================
nn    A, B            ``(q - 1) / q^2 * (beta M K + K N)``
nt    B, C            ``(q - 1) / q^2 * (N K + beta M N)``
tn    A, C            ``(q - 1) / q^2 * (K M + M N)``
====  ==============  ===================================================

(i.e. ``(q - 1)`` blocks of each moving matrix), times the bytes of the operands' dtype,
or of float32 for the reduced C of ``nt`` and ``tn`` (see Precision). A backward
pass runs the other two forms; for ``nn`` they move ``2 (A + B)``, twice the forward.
For ``nt`` and ``tn`` both gradient products broadcast the cotangent dC along the same
grid axis from the same roots, and XLA's CSE keeps one copy (checked on XLA:CPU), so
they move ``dC + 2 B`` (``nt``) and ``dC + 2 A`` (``tn``), with every matrix counted as
in the table. ``communication`` computes all of these.

SUMMA's trees are partial permutations (in round r only ``min(2^r, q - 2^r)`` devices
of each grid line send); ``jaxpar.profiler`` averages a ``collective-permute`` over the
devices, so its per-device figure equals ``communication``'s exactly. The compiled
program holds ``q R`` collective-permutes per moving matrix and no other collective.

Overlap. The q steps are unrolled (q is static, and the tree's ``source_target_pairs``
depend on the step's root). Step k+1's broadcasts are issued before step k's block
product; nothing but the final accumulation depends on a reduction, so step k's
reduction overlaps step k+1's product. On GPU/TPU XLA turns each ``collective-permute``
into an async start/done pair that its latency-hiding scheduler places around the dot;
XLA:CPU's collectives are synchronous, so tests check the issue order in the lowered
program.

Precision: block products, the partial sums ``nt`` and ``tn`` reduce over the grid, and
their sum over ``batch_axes`` (a weight gradient's over data-parallel replicas) are all
float32 (at least), rounded to the result dtype once at the end, as the rest of the
library accumulates. The moving operands travel in their own dtype, the reduced
partial sums in float32 (``communication`` counts them apart).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

Form = Literal["nn", "nt", "tn"]


def summa_matmul(
    a: jax.Array,
    b: jax.Array,
    *,
    mesh: Mesh,
    transpose_a: bool = False,
    transpose_b: bool = False,
    row_axis: str = "tensor_row",
    col_axis: str = "tensor_col",
    batch_axes: tuple[str, ...] = (),
) -> jax.Array:
    """The product of two matrices 2D-blocked over the ``row_axis x col_axis`` grid.

    Every array is sharded ``PartitionSpec(row_axis, col_axis)`` on its last two
    dimensions (``a``'s leading batch dimensions, if any, are replicated); inputs
    sharded otherwise are resharded by ``shard_map`` first. Other mesh axes replicate.

    Args:
      a: ``[..., M, K]``; with ``transpose_a``, ``[K, M]`` (no batch dimensions).
        Leading batch dimensions are folded into M on each device, so they are
        allowed only where they stay on the output (``a @ b`` and ``a @ b.T``).
      b: ``[K, N]``; with ``transpose_b``, ``[N, K]``.
      mesh: a mesh with both grid axes, of equal size q (``jaxpar.make_mesh(tensor=(q,
        q))``).
      transpose_a: compute ``aᵀ b`` (SUMMA's ``tn`` form).
      transpose_b: compute ``a bᵀ`` (SUMMA's ``nt`` form).
      row_axis, col_axis: the grid's mesh axes.
      batch_axes: mesh axes (data parallelism) that split the rows of ``a`` and of the
        result together with ``row_axis``: ``a`` is ``PartitionSpec((*batch_axes,
        row_axis), col_axis)``, and each data-parallel replica runs its own SUMMA; in
        the backward pass ``b``'s gradient is summed over them. Not with
        ``transpose_a``, nor with batch dimensions on ``a``.

    Returns:
      ``[..., M, N]`` in the promoted dtype of ``a`` and ``b``, sharded
      ``PartitionSpec(..., row_axis, col_axis)``. Differentiable (reverse mode): the
      gradients are SUMMA products too.

    Raises:
      ValueError: both transposes, a missing or repeated grid axis, a non-square grid,
        bad ranks, mismatched contraction dimensions, or M, K, N not divisible by q.
    """
    form: Form = "tn" if transpose_a else "nt" if transpose_b else "nn"
    if transpose_a and transpose_b:
        raise ValueError(
            "transpose_a and transpose_b together are not supported: aᵀbᵀ = (b a)ᵀ, and "
            "transposing a 2D-blocked matrix moves every block across the grid"
        )
    batch_axes = tuple(batch_axes)
    if batch_axes and (transpose_a or a.ndim != 2):
        raise ValueError(
            f"summa_matmul: batch_axes={batch_axes} need a 2D a (got {tuple(a.shape)}) and "
            "no transpose_a"
        )
    grid = _Grid(mesh, row_axis, col_axis, batch_axes)
    _check(form, grid, a.shape, b.shape)
    dtype = jnp.result_type(a, b)
    return _matmul(form, grid, jnp.asarray(a, dtype), jnp.asarray(b, dtype))


def communication(
    a_shape: tuple[int, ...],
    b_shape: tuple[int, ...],
    q: int,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
    backward: bool = False,
) -> dict[str, int]:
    """Elements one device moves in one ``summa_matmul`` (see the module doc).

    Args:
      a_shape, b_shape, transpose_a, transpose_b: as given to ``summa_matmul``.
      q: the grid size.
      backward: the figures for the gradients of both operands instead of the product.

    Returns:
      ``{"sent": n, "partial_sums": p}``: elements each device sends, equal to what it
      receives and to ``jaxpar.profiler``'s per-device figure; ``p`` of them are the
      float32 partial sums of reduced products, the rest operands in their own dtype.
      Bytes: ``(n - p) * itemsize + 4 * p``.
    """
    *batch, rows, cols = a_shape
    beta = math.prod(batch)
    if transpose_a:  # A [K, M] and C [M, N] move; backward, dA [K, M] is reduced
        fwd, c = rows * cols, cols * b_shape[1]
        moving, reduced = (2 * fwd + c, fwd) if backward else (fwd + c, c)
    elif transpose_b:  # B [N, K] and C [beta M, N] move; backward, dB [N, K] is reduced
        fwd, c = math.prod(b_shape), beta * rows * b_shape[0]
        moving, reduced = (2 * fwd + c, fwd) if backward else (fwd + c, c)
    else:  # A [beta M, K] and B [K, N] move; backward, dA and dB are reduced
        operands = beta * rows * cols + math.prod(b_shape)
        moving, reduced = (2 * operands, operands) if backward else (operands, 0)
    return {"sent": (q - 1) * moving // q**2, "partial_sums": (q - 1) * reduced // q**2}


# --------------------------------------------------------------------------- validation


@dataclasses.dataclass(frozen=True)
class _Grid:
    """The q x q device grid: hashable, so it can be a static argument of custom_vjp."""

    mesh: Mesh
    row: str
    col: str
    batch: tuple[str, ...] = ()  # axes that split activation rows beside `row`

    @property
    def q(self) -> int:
        return self.mesh.shape[self.row]

    @property
    def rows(self) -> int:
        """How many ways an activation's rows are split."""
        return self.q * math.prod(self.mesh.shape[a] for a in self.batch)


def _check(form: Form, grid: _Grid, a_shape, b_shape) -> None:
    names = tuple(grid.mesh.axis_names)
    for which, axis in (("row_axis", grid.row), ("col_axis", grid.col)):
        if axis not in names:
            raise ValueError(
                f"summa_matmul: {which}={axis!r} is not an axis of the mesh, whose axes are "
                f"{names}; make one with jaxpar.make_mesh(tensor=(q, q))"
            )
    if grid.row == grid.col:
        raise ValueError(f"summa_matmul: row_axis and col_axis are both {grid.row!r}")
    q_row, q_col = grid.mesh.shape[grid.row], grid.mesh.shape[grid.col]
    if q_row != q_col:
        raise ValueError(
            f"summa_matmul: the grid {grid.row}={q_row} x {grid.col}={q_col} is not "
            "square; SUMMA needs a q x q grid"
        )
    q = q_row
    if len(a_shape) < 2 or (form == "tn" and len(a_shape) != 2):
        expected = "[K, M] (transpose_a takes no batch dimensions)" if form == "tn" else "[..., M, K]"
        raise ValueError(f"summa_matmul: a must be {expected}, got shape {tuple(a_shape)}")
    if len(b_shape) != 2:
        expected = "[N, K]" if form == "nt" else "[K, N]"
        raise ValueError(f"summa_matmul: b must be {expected}, got shape {tuple(b_shape)}")
    # (name, size, where it is) for each of M, K (as a and b see it), N.
    if form == "nn":
        dims = [("M", a_shape[-2], "a.shape[-2]"), ("K", a_shape[-1], "a.shape[-1]"),
                ("K", b_shape[0], "b.shape[0]"), ("N", b_shape[1], "b.shape[1]")]
    elif form == "nt":
        dims = [("M", a_shape[-2], "a.shape[-2]"), ("K", a_shape[-1], "a.shape[-1]"),
                ("K", b_shape[1], "b.shape[1]"), ("N", b_shape[0], "b.shape[0]")]
    else:
        dims = [("M", a_shape[1], "a.shape[1]"), ("K", a_shape[0], "a.shape[0]"),
                ("K", b_shape[0], "b.shape[0]"), ("N", b_shape[1], "b.shape[1]")]
    (_, ka, where_a), (_, kb, where_b) = dims[1], dims[2]
    if ka != kb:
        raise ValueError(
            f"summa_matmul: contraction dimension K differs: {where_a}={ka} but "
            f"{where_b}={kb} (a {tuple(a_shape)}, b {tuple(b_shape)}, form {form})"
        )
    if grid.batch and a_shape[-2] % grid.rows:
        raise ValueError(
            f"summa_matmul: M={a_shape[-2]} (a.shape[-2]) is not divisible by the "
            f"{grid.rows} ways {(*grid.batch, grid.row)} split it"
        )
    for name, size, where in dims:
        if size % q:
            raise ValueError(
                f"summa_matmul: {name}={size} ({where}) is not divisible by the grid size "
                f"q={q} ({grid.row} x {grid.col})"
            )


# ------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(form: Form, grid: _Grid, x: jax.Array, y: jax.Array) -> jax.Array:
    return _summa(form, grid, x, y)


def _matmul_fwd(form, grid, x, y):
    return _summa(form, grid, x, y), (x, y)


def _matmul_bwd(form, grid, residuals, g):
    x, y = residuals
    if form == "nn":  # C = X Y: dX = G Yᵀ, dY = Xᵀ G
        return _matmul("nt", grid, g, y), _matmul("tn", grid, x, g)
    if form == "nt":  # C = X Yᵀ: dX = G Y, dY = Gᵀ X
        return _matmul("nn", grid, g, y), _matmul("tn", grid, g, x)
    # C = Xᵀ Y: dX = Y Gᵀ, dY = X G
    return _matmul("nt", grid, y, g), _matmul("nn", grid, x, g)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


# ---------------------------------------------------------------------------- kernels


def _summa(form: Form, grid: _Grid, x: jax.Array, y: jax.Array) -> jax.Array:
    """One SUMMA product under ``shard_map``. ``x`` may have leading dims (``tn``: ``x``
    and ``y`` the same ones, which it contracts, as in a gradient Xᵀ G)."""

    def spec(ndim: int) -> PartitionSpec:
        return PartitionSpec(*(None,) * (ndim - 2), grid.row, grid.col)

    # With batch axes, activations (a, the result, and both operands of `tn`, which in
    # a backward pass contracts activations) also split their rows over them.
    activation = PartitionSpec((*grid.batch, grid.row), grid.col) if grid.batch else None
    out_ndim = 2 if form == "tn" else x.ndim
    product = functools.partial({"nn": _summa_nn, "nt": _summa_nt, "tn": _summa_tn}[form], grid=grid)
    in_specs, out_spec = (spec(x.ndim), spec(y.ndim)), spec(out_ndim)
    # `tn` contracts the rows the batch axes split, so its replicas' sums are added up.
    summed = grid.batch if activation is not None and form == "tn" else ()
    if activation is not None:
        in_specs = (activation, activation) if form == "tn" else (activation, spec(2))
        out_spec = out_spec if form == "tn" else activation

    def kernel(x, y):
        acc = product(x, y)  # float32 (at least), summed over the grid
        if summed:
            acc = jax.lax.psum(acc, summed)
        return acc.astype(x.dtype)  # the one rounding to the result dtype

    with jax.named_scope(f"summa_{form}"):
        return jax.shard_map(kernel, mesh=grid.mesh, in_specs=in_specs, out_specs=out_spec)(x, y)


def _acc_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _summa_nn(x, y, *, grid: _Grid):
    """Device (i, j): x = A[i, j] ``[..., M/q, K/q]``, y = B[i, j] ``[K/q, N/q]``;
    returns C[i, j] = sum_k A[i, k] B[k, j] ``[..., M/q, N/q]`` in the accumulation dtype."""
    q = grid.q
    a = x.reshape(-1, x.shape[-1])  # [beta M/q, K/q]

    def panels(k):
        with jax.named_scope(f"panels_{k}"):
            return _broadcast(a, k, grid.col, q), _broadcast(y, k, grid.row, q)

    acc = None
    nxt = panels(0)
    for k in range(q):
        a_k, b_k = nxt  # A[i, k], B[k, j]
        if k + 1 < q:
            nxt = panels(k + 1)  # issued before this step's product, to overlap it
        with jax.named_scope(f"product_{k}"):
            prod = jnp.einsum("MK,KN->MN", a_k, b_k, preferred_element_type=_acc_dtype(x.dtype))
        acc = prod if acc is None else acc + prod
    return acc.reshape(*x.shape[:-1], y.shape[-1])


def _summa_nt(x, y, *, grid: _Grid):
    """Device (i, l): x = A[i, l] ``[..., M/q, K/q]``, y = B[i, l] ``[N/q, K/q]``;
    returns C[i, l] = sum_j A[i, j] B[l, j]ᵀ ``[..., M/q, N/q]`` in the accumulation dtype."""
    a = x.reshape(-1, x.shape[-1])  # [beta M/q, K/q]
    out = _broadcast_multiply_reduce(
        y, lambda b_k: jnp.einsum("MK,NK->MN", a, b_k, preferred_element_type=_acc_dtype(x.dtype)),
        broadcast_axis=grid.row, reduce_axis=grid.col, q=grid.q,
        shape=(a.shape[0], y.shape[0]), dtype=_acc_dtype(x.dtype),
    )  # B[k, l] broadcast down the columns; C[i, k] reduced onto column k
    return out.reshape(*x.shape[:-1], y.shape[0])


def _summa_tn(x, y, *, grid: _Grid):
    """Device (l, j): x = A[l, j] ``[..., K/q, M/q]``, y = B[l, j] ``[..., K/q, N/q]``
    (same leading dims, contracted with K); returns C[l, j] = sum_i A[i, l]ᵀ B[i, j]
    ``[M/q, N/q]`` in the accumulation dtype."""
    a = x.reshape(-1, x.shape[-1])  # [beta K/q, M/q]
    b = y.reshape(-1, y.shape[-1])  # [beta K/q, N/q]
    return _broadcast_multiply_reduce(
        a, lambda a_k: jnp.einsum("KM,KN->MN", a_k, b, preferred_element_type=_acc_dtype(x.dtype)),
        broadcast_axis=grid.col, reduce_axis=grid.row, q=grid.q,
        shape=(a.shape[1], b.shape[1]), dtype=_acc_dtype(x.dtype),
    )  # A[l, k] broadcast along the rows; C[k, j] reduced onto row k


def _broadcast_multiply_reduce(moving, product, *, broadcast_axis, reduce_axis, q, shape, dtype):
    """The loop of the ``nt`` and ``tn`` forms: at step k, grid line k broadcasts its
    panel of ``moving`` along ``broadcast_axis``, every device multiplies it with its own
    stationary block (``product``), and the partial products are reduced along
    ``reduce_axis`` onto grid line k, which keeps the sum (``shape``, in ``dtype``, the
    accumulation dtype: partial sums travel and are added unrounded). Step k+1's
    broadcast is issued before step k's product."""
    mine = jax.lax.axis_index(reduce_axis)
    out = jnp.zeros(shape, dtype)
    nxt = _broadcast(moving, 0, broadcast_axis, q)
    for k in range(q):
        panel = nxt
        if k + 1 < q:
            with jax.named_scope(f"panels_{k + 1}"):
                nxt = _broadcast(moving, k + 1, broadcast_axis, q)
        with jax.named_scope(f"product_{k}"):
            part = product(panel)
        with jax.named_scope(f"reduce_{k}"):
            c_k = _reduce(part, k, reduce_axis, q)
        out = jnp.where(mine == k, c_k, out)
    return out


# ------------------------------------------------------------------------ collectives


def _tree_rounds(q: int) -> list[int]:
    """Hop distances of a binomial tree over q devices: 1, 2, 4, ... < q."""
    return [1 << r for r in range(math.ceil(math.log2(q)))] if q > 1 else []


def _broadcast(x: jax.Array, root: int, axis: str, q: int) -> jax.Array:
    """``x`` of the device at position ``root`` of ``axis``, on every device of it."""
    rel = (jax.lax.axis_index(axis) - root) % q  # hops past the root
    for step in _tree_rounds(q):
        # Devices [0, step) past the root hold the panel; each sends it `step` further.
        pairs = [((root + s) % q, (root + s + step) % q) for s in range(min(step, q - step))]
        arrived = jax.lax.ppermute(x, axis, pairs)
        x = jnp.where((rel >= step) & (rel < 2 * step), arrived, x)
    return x


def _reduce(x: jax.Array, root: int, axis: str, q: int) -> jax.Array:
    """The sum of ``x`` over ``axis``, correct on the device at position ``root``."""
    for step in reversed(_tree_rounds(q)):
        # Devices [step, 2 step) past the root send their partial sums `step` back;
        # devices nothing arrives at add ppermute's zeros.
        pairs = [((root + s + step) % q, (root + s) % q) for s in range(min(step, q - step))]
        x = x + jax.lax.ppermute(x, axis, pairs)
    return x


# -------------------------------------------------------------------------- reference


def reference_matmul(a, b, *, transpose_a: bool = False, transpose_b: bool = False):
    """What ``summa_matmul`` computes, as one ``jnp`` product."""
    a = jnp.swapaxes(a, -1, -2) if transpose_a else a
    b = b.T if transpose_b else b
    return jnp.matmul(a, b, preferred_element_type=_acc_dtype(jnp.result_type(a, b))).astype(
        jnp.result_type(a, b))
