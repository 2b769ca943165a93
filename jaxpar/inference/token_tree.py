"""CaPE's token tree: its fixed layout, its attention mask, greedy verification along it,
and compaction of the accepted path's cache entries.

CaPE (Du et al., 2024) widens the draft's greedy chain where the draft is unsure: at
depth ``i`` (1..gamma) the draft's top probability ``c_i`` picks a width
``k_i = bins[floor(10 c_i)]``, and the tree holds the greedy prefix ``g_1..g_gamma`` plus,
at each depth, the draft's top-``k_i`` tokens as siblings of ``g_i`` (children of
``g_{i-1}``). Only the greedy chain has children, so every other candidate is a leaf.

Layout (static, so the verification pass has one shape under ``jit``): node 0 is the
root (the last accepted token); depth ``i`` has ``width`` slots, node
``1 + (i - 1) * width + j`` holding the draft's ``(j + 1)``-th most likely token there
(``j = 0`` the greedy one). A slot ``j >= k_i`` is padding: it is verified with the
others but can never be accepted, and no other node sees it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


# CaPE's default widths by confidence decile: bins[floor(10 c)] for c in [0, 1].
DEFAULT_BINS = (8, 8, 8, 6, 6, 6, 4, 4, 2, 2, 2)


def check_bins(bins) -> tuple[int, ...]:
    """``bins`` as a tuple of 11 positive ints (one per confidence decile, and 1.0)."""
    bins = tuple(bins)
    if len(bins) != 11 or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1
                              for k in bins):
        raise ValueError(f"bins={list(bins)} must be 11 positive integers, one width per "
                         "confidence decile 0.0-0.1, ..., 0.9-1.0 and 1.0")
    return tuple(int(k) for k in bins)


def widths(confidence: jax.Array, bins: tuple[int, ...]) -> jax.Array:
    """CaPE's widths ``bins[floor(10 c)]``, int32 of ``confidence``'s shape."""
    index = jnp.clip(jnp.floor(confidence * 10).astype(jnp.int32), 0, len(bins) - 1)
    return jnp.asarray(bins, jnp.int32)[index]


@dataclasses.dataclass(frozen=True)
class TreeLayout:
    """The static tree of ``gamma`` depths with ``width`` slots each (see the module)."""

    gamma: int
    width: int

    @property
    def size(self) -> int:
        return 1 + self.gamma * self.width

    def node(self, depth: int, slot: int) -> int:
        return 1 + (depth - 1) * self.width + slot

    @property
    def depths(self) -> np.ndarray:
        """int32 ``[size]``: each node's depth (its position after the root's)."""
        return np.concatenate([[0], np.repeat(np.arange(1, self.gamma + 1), self.width)]).astype(np.int32)

    @property
    def mask(self) -> np.ndarray:
        """bool ``[size, size]``: node ``t`` sees node ``j`` iff ``j`` is ``t`` or one of its
        ancestors (the root and the greedy nodes above it)."""
        mask = np.eye(self.size, dtype=bool)
        mask[:, 0] = True
        for depth in range(2, self.gamma + 1):
            for slot in range(self.width):
                for above in range(1, depth):
                    mask[self.node(depth, slot), self.node(above, 0)] = True
        return mask

    def tokens(self, root: jax.Array, top: jax.Array) -> jax.Array:
        """The tree's tokens, int32 ``[B, size]``, from the root ``[B]`` and the draft's
        top tokens ``[B, gamma, width]`` per depth (slot 0 the greedy one)."""
        return jnp.concatenate([root[:, None], top.reshape(top.shape[0], -1)], axis=1).astype(jnp.int32)

    def valid(self, widths: jax.Array) -> jax.Array:
        """bool ``[B, size]``: which nodes are candidates, from widths int ``[B, gamma]``."""
        slots = jnp.arange(self.width)[None, None, :] < widths[:, :, None]
        root = jnp.ones((widths.shape[0], 1), bool)
        return jnp.concatenate([root, slots.reshape(widths.shape[0], -1)], axis=1)


def verify_greedy(layout: TreeLayout, tokens: jax.Array, valid: jax.Array,
                  target_next: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Walks the tree along the target's greedy choices.

    Args:
      tokens: int ``[B, size]`` the tree (``layout.tokens``); valid: bool ``[B, size]``.
      target_next: int ``[B, size]`` the target's greedy next token after each node.

    Returns:
      ``(path, accepted, bonus)``: ``path`` int32 ``[B, gamma + 1]``, the nodes of the
      accepted path by depth (``path[:, 0] = 0``; entries past ``accepted`` repeat the
      last); ``accepted`` int32 ``[B]``, how many draft tokens were accepted; ``bonus``
      ``[B]``, the target's token after the path (the correction, or the bonus token when
      the path reaches the last depth).
    """
    B = tokens.shape[0]
    node = jnp.zeros((B,), jnp.int32)
    accepted = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    path = [node]
    for depth in range(1, layout.gamma + 1):
        want = jnp.take_along_axis(target_next, node[:, None], axis=1)  # [B, 1]
        first = layout.node(depth, 0)
        level = slice(first, first + layout.width)
        match = valid[:, level] & (tokens[:, level] == want)  # at most one: distinct tokens
        slot = jnp.argmax(match, axis=1).astype(jnp.int32)
        hit = alive & match.any(axis=1)
        node = jnp.where(hit, first + slot, node)
        accepted = accepted + hit
        alive = hit & (slot == 0)  # only the greedy node has children
        path.append(node)
    bonus = jnp.take_along_axis(target_next, node[:, None], axis=1)[:, 0]
    return jnp.stack(path, axis=1), accepted, bonus


def two_chains_mask(first: int, second: int) -> np.ndarray:
    """bool ``[1 + first + second]`` squared: the root, then two chains from it of
    ``first`` nodes (``1..first``) and ``second`` nodes (after them); a node sees the
    root, itself and the nodes above it in its own chain. Prompt lookup's two chains
    (the draft's and a copied one), and a chain with the draft's runner-up beside its
    first token (``second`` 1)."""
    size = 1 + first + second
    mask = np.eye(size, dtype=bool)
    mask[:, 0] = True
    for start, length in ((1, first), (1 + first, second)):
        for i in range(length):
            mask[start + i, start: start + i] = True
    return mask


def compact(cache, starts: jax.Array, path: jax.Array):
    """Moves the accepted path's keys/values into place, in any ``Cache``.

    The verification pass wrote node ``j``'s entries at slot ``starts[b] + j``; the
    path's node at depth ``i`` belongs at slot ``starts[b] + i``. Moves ``path [B, P]``'s
    entries (every layer) to ``starts + 0..P-1`` (``Cache.move``: all read before any is
    written); lengths are left to the caller (``starts + accepted + 1``).
    """
    depths = jnp.arange(path.shape[1], dtype=jnp.int32)[None, :]
    return cache.move(starts[:, None] + path, starts[:, None] + depths)
