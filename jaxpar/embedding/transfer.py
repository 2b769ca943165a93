"""Moving rows between the host and the device cache: a gather out, a donated scatter in.

Each ``prepare`` that misses runs two programs: one batched gather that reads out the
rows being evicted, then one batched scatter that writes the missing ones in (not one
copy per row, as Colossal-AI's cache batches its transfers). The scatter's cache arrays
are donated, so it updates them in place; in one program, the gather's reads of the
old rows made XLA copy the whole ``[C, D]`` cache first (the compile-only ``memory``
benchmark measured the copy: 900 MB for a 90 GB table's 1% cache). Index arrays
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
    n = len(victims)
    old_rows = old_state = None
    if n:  # read out first, in a program of its own: one that also wrote would copy the cache
        old_rows, old_state = _read(arrays, _padded(victims, P, C))
        old_rows = np.asarray(old_rows)[:n]
        old_state = np.asarray(old_state)[:n] if old_state is not None else None
    if len(fill):
        arrays = _write(arrays, _padded(fill, P, C), fill_rows, fill_state)
    return arrays, old_rows, old_state


@jax.jit
def _read(arrays: CacheArrays, victim_slots):
    rows, state = arrays
    old_state = None if state is None else state.at[victim_slots].get(mode="fill", fill_value=0)
    return rows.at[victim_slots].get(mode="fill", fill_value=0), old_state


@functools.partial(jax.jit, donate_argnums=0)
def _write(arrays: CacheArrays, fill_slots, fill_rows, fill_state):
    """The rows written in place (donated): the cache is never copied."""
    rows, state = arrays
    rows = rows.at[fill_slots].set(fill_rows, mode="drop")
    if state is not None:
        state = state.at[fill_slots].set(fill_state, mode="drop")
    return CacheArrays(rows, state)


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
