"""Moving rows between the host and the device cache: one jitted, donated swap.

Each ``prepare`` that misses runs one program that reads out the rows being evicted and
writes the missing ones in (one batched gather and one batched scatter, not one copy per
row, as Colossal-AI's cache batches its transfers). The cache arrays are donated, so the
scatter updates them in place rather than copying ``[C, D]`` each step. Index arrays
are padded to a size bucket with out-of-bounds slots (the gathers fill them, the
scatters drop them), so a few programs serve every step instead of one per miss count.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxpar.embedding.update import CacheArrays


def swap(arrays: CacheArrays, victims: np.ndarray, fill: np.ndarray, rows: np.ndarray, state: np.ndarray | None):
    """``(arrays, old_rows, old_state)``: ``arrays`` with ``rows`` (and ``state``) written at
    slots ``fill``, and the host copies of the rows (and state) that were at ``victims``
    before. ``arrays`` is donated: use the returned one."""
    if len(fill) == 0 and len(victims) == 0:
        return arrays, None, None
    C, D = arrays.rows.shape
    P = bucket(max(len(fill), len(victims)))
    fill_rows = np.zeros((P, D), np.float32)
    fill_rows[: len(fill)] = rows
    fill_state = None
    if state is not None:
        fill_state = np.zeros(P, np.float32)
        fill_state[: len(fill)] = state
    arrays, old_rows, old_state = _swap(arrays, _padded(victims, P, C), _padded(fill, P, C), fill_rows, fill_state)
    n = len(victims)
    if n == 0:
        return arrays, None, None
    return arrays, np.asarray(old_rows)[:n], (np.asarray(old_state)[:n] if old_state is not None else None)


@functools.partial(jax.jit, donate_argnums=0)
def _swap(arrays: CacheArrays, victim_slots, fill_slots, fill_rows, fill_state):
    rows, state = arrays
    old_rows = rows.at[victim_slots].get(mode="fill", fill_value=0)
    rows = rows.at[fill_slots].set(fill_rows, mode="drop")
    old_state = None
    if state is not None:
        old_state = state.at[victim_slots].get(mode="fill", fill_value=0)
        state = state.at[fill_slots].set(fill_state, mode="drop")
    return CacheArrays(rows, state), old_rows, old_state


def bucket(n: int) -> int:
    """``n`` rounded up to 8 or to ``m * 2^e`` with ``m`` in 4..7: at most a quarter of
    padding, four programs per doubling of the size."""
    if n <= 8:
        return 8
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def _padded(slots: np.ndarray, size: int, fill: int) -> np.ndarray:
    out = np.full(size, fill, np.int32)
    out[: len(slots)] = slots
    return out
