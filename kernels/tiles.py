"""What the Triton lowering asks of a tile, and the helpers that meet it for any shape.

Pallas' Triton lowering needs every loaded or computed array to have a power-of-two
number of elements (and a matmul operand at least 16 on a side), and it does not mask
a block that runs past an array's end: a plain ``ref[...]`` of a partial block reads and
writes whatever lies beyond. The kernels therefore compute on tiles of ``pow2`` sizes and
move data with ``load`` / ``store``, which mask the rows and columns past the array's
true extent (loads read zeros there); where a shape cannot be served, the entry point
runs its plain-XLA reference instead and says why once (``dispatch.fall_back``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def pow2(n: int, least: int = 16) -> int:
    """The smallest power of two ``>= n``, at least ``least`` (16: Triton's smallest dot tile)."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def tile_index(start, rows: int, cols: int):
    """``(r [rows, 1], c [1, cols])`` int32 indices of a ``[rows, cols]`` tile whose first
    row is ``start`` (traced or static) and first column 0."""
    r = start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    return r, jax.lax.broadcasted_iota(jnp.int32, (1, cols), 1)


def load(ref, r, c, extent, rows=None):
    """The tile ``ref[r, c]`` (``r [R, 1]``, ``c [1, C]`` indices into the 2D ``ref``), zeros
    where ``r >= extent[0]`` or ``c >= extent[1]`` (past the array: never read).
    ``rows [R, 1]``: read ``ref[rows, c]`` instead, still masked by ``r`` (where a page
    table maps a sequence's slots ``r`` into a pool of pages)."""
    return plgpu.load(ref.at[r if rows is None else rows, c], mask=(r < extent[0]) & (c < extent[1]),
                      other=0)


def store(ref, r, c, extent, value):
    """Writes ``value [R, C]`` to ``ref[r, c]`` where ``r < extent[0]`` and ``c < extent[1]``."""
    plgpu.store(ref.at[r, c], value.astype(ref.dtype), mask=(r < extent[0]) & (c < extent[1]))


def online_softmax(acc, m, total, s, v):
    """One block of an online softmax (flash attention's update): ``s [R, block]`` the
    block's scaled scores (``-inf`` where masked), ``v [block, H]`` its values; ``acc [R,
    H]``, ``m``, ``total [R, 1]`` the running output, max and sum (float32). Returns them
    updated; a row with nothing seen yet stays at ``(0, -inf, 0)``."""
    m_new = jnp.maximum(m, s.max(-1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no NaN from -inf - -inf
    p = jnp.exp(s - m_safe)
    correction = jnp.exp(m - m_safe)
    total = total * correction + p.sum(-1, keepdims=True)
    acc = acc * correction + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc, m_new, total
