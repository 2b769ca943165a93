"""The zigzag token layout of causal sequence parallelism: the length cut into ``2n``
chunks, device ``i`` of ``n`` holding chunks ``i`` and ``2n - 1 - i``, so every device has
the same share of a causal mask's visible blocks. ``to_zigzag`` / ``from_zigzag`` reorder
whole arrays (the data loader does so on the host); ``natural_to_zigzag`` /
``zigzag_to_natural`` move each device's shard inside ``shard_map`` (the ring's way in and
out for natural-order callers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def zigzag_order(length: int, n: int) -> np.ndarray:
    """Natural token indices in zigzag order: ``to_zigzag(x)[t] = x[order[t]]``.

    The length is cut into ``2n`` chunks; device ``i`` of ``n`` holds chunks ``i`` and
    ``2n - 1 - i``, so with the length split evenly over ``n`` devices, position
    ``t`` of device ``i``'s shard is natural token ``order[i * length / n + t]``.
    """
    if length % (2 * n):
        raise ValueError(f"zigzag layout needs the length divisible by 2 x seq = {2 * n}, "
                         f"got length {length} with seq={n}")
    chunks = np.arange(length).reshape(2 * n, length // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def to_zigzag(x, n: int, axis: int = 1):
    """Reorders ``x`` along ``axis`` (the length) into the zigzag layout for ``n`` devices.
    Works on numpy arrays (the data loader, on the host) and jax arrays alike."""
    order = zigzag_order(x.shape[axis], n)
    return x.take(order, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, order, axis=axis)


def from_zigzag(x, n: int, axis: int = 1):
    """Inverse of ``to_zigzag``."""
    inverse = np.argsort(zigzag_order(x.shape[axis], n))
    return x.take(inverse, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, inverse, axis=axis)


def _zigzag_owner(chunk: int, n: int) -> int:
    return chunk if chunk < n else 2 * n - 1 - chunk


def natural_to_zigzag(x, axis: str, n: int):
    """Inside ``shard_map`` over ``axis`` (``n`` devices): device ``d``'s natural shard ``[B, L, ...]`` (chunks 2d, 2d+1 of 2n) -> its zigzag
    shard (chunks d, 2n-1-d). Every device owns one even and one odd zigzag chunk, so
    two permutations, of the even and of the odd halves, do it."""
    even, odd = jnp.split(x, 2, axis=1)
    even = jax.lax.ppermute(even, axis, [(d, _zigzag_owner(2 * d, n)) for d in range(n)])
    odd = jax.lax.ppermute(odd, axis, [(d, _zigzag_owner(2 * d + 1, n)) for d in range(n)])
    even_first = jax.lax.axis_index(axis) % 2 == 0  # chunk d is even
    return jnp.where(even_first, jnp.concatenate([even, odd], 1), jnp.concatenate([odd, even], 1))


def zigzag_to_natural(x, axis: str, n: int):
    """Inverse of ``natural_to_zigzag``."""
    first, second = jnp.split(x, 2, axis=1)
    even_first = jax.lax.axis_index(axis) % 2 == 0
    even, odd = jnp.where(even_first, first, second), jnp.where(even_first, second, first)

    def even_chunk(e):
        return e if e % 2 == 0 else 2 * n - 1 - e

    even = jax.lax.ppermute(even, axis, [(e, even_chunk(e) // 2) for e in range(n)])
    odd = jax.lax.ppermute(odd, axis, [(e, (2 * n - 1 - even_chunk(e)) // 2) for e in range(n)])
    return jnp.concatenate([even, odd], axis=1)
