"""Which cached rows to evict: LFU or LRU, with protected rows, deterministically.

- ``lfu`` (the default; Colossal-AI's freq-aware cache and FBGEMM's LFU cache): the row
  with the lowest access count goes first. Counts are kept per id over the whole table,
  as FBGEMM's ``lfu_state`` is, not per slot: a row that is evicted and comes back keeps
  its history, and the warm-up's counts seed them (Colossal-AI's dataset strategy).
  Ties go to the least recently used, then to the lowest id.
- ``lru`` (FBGEMM's LRU cache): the row whose last access is oldest goes first; ties
  (rows of the same step) go to the lowest id.

The order is total, so a replay of the same batches evicts the same rows whatever the
timing of the prefetch thread. Selection is O(C): a partition on the first key, and a
sort only of the rows tied with the last one chosen.
"""

from __future__ import annotations

import numpy as np

POLICIES = ("lfu", "lru")


def eviction_keys(policy: str, count: np.ndarray, last_used: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, ...]:
    """The sort keys of candidate rows, most significant first (lower goes first)."""
    if policy == "lfu":
        return count, last_used, ids
    if policy == "lru":
        return last_used, ids
    raise ValueError(f"eviction={policy!r}: expected one of {POLICIES}")


def smallest(keys: tuple[np.ndarray, ...], k: int) -> np.ndarray:
    """Indices of the ``k`` smallest entries by ``keys`` (lexicographic), unordered."""
    n = len(keys[0])
    if k <= 0:
        return np.zeros(0, np.int64)
    if k >= n:
        return np.arange(n)
    first = keys[0]
    kth = np.partition(first, k - 1)[k - 1]
    sure = np.flatnonzero(first < kth)
    tied = np.flatnonzero(first == kth)
    order = np.lexsort(tuple(key[tied] for key in keys[::-1]))
    return np.concatenate([sure, tied[order[: k - len(sure)]]])


def choose_victims(keys: tuple[np.ndarray, ...], k: int, protected: np.ndarray, soft: np.ndarray) -> np.ndarray:
    """Indices of ``k`` candidates to evict: never a ``protected`` one (the current
    batch's ids); ``soft`` ones (the upcoming batches' ids) only when the others do not
    free enough room, and then by the same order."""
    free = np.flatnonzero(~protected & ~soft)
    chosen = free[smallest(tuple(key[free] for key in keys), k)]
    if len(chosen) < k:
        spare = np.flatnonzero(~protected & soft)
        chosen = np.concatenate([chosen, spare[smallest(tuple(key[spare] for key in keys), k - len(chosen))]])
    if len(chosen) < k:
        raise AssertionError(f"{k} rows to evict but only {len(chosen)} unprotected")  # the caller sized k
    return chosen
