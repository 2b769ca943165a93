"""Prompt lookup (Saxena, 2023): draft tokens copied from the sequence itself, the tokens
that followed the latest earlier occurrence of what ends it. A one-layer draft cannot
copy what its context already holds; text (a small model's greedy continuations most of
all) repeats it often. ``jaxpar.inference.speculative`` verifies such a chain beside the
draft's (``token_tree.two_chains_mask``: a two-branch tree) or instead of it (``Method.lookup``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chain(history: jax.Array, n: jax.Array, gamma: int, ngram: int = 1) -> tuple[jax.Array, jax.Array]:
    """The ``gamma`` tokens after the latest earlier occurrence of the
    sequence's last ``ngram`` tokens (those ending at ``last``), ``(tokens [B, gamma],
    valid [B, gamma])``; ``valid`` is False where they have not occurred before. An
    occurrence ``p`` tokens back is followed by ``p`` known tokens; past them the chain
    repeats those (the text's period: ``a b a b`` continues ``a b``, ``x x`` with ``x``).

    Args:
      history: int32 ``[B, S]``, each sequence by position, ``last`` at ``n``.
      n: int32 ``[B]``, the position of ``last``.
    """
    S = history.shape[1]
    index = jnp.arange(S, dtype=jnp.int32)[None, :]
    match = index < n[:, None]
    for back in range(ngram):  # history[j - back] == history[n - back]
        here = jnp.take_along_axis(history, jnp.maximum(n - back, 0)[:, None], axis=1)
        match = match & (index >= back) & (jnp.roll(history, back, axis=1) == here)
    seen = jnp.max(jnp.where(match, index, -1), axis=1)  # [B], < n
    period = jnp.maximum(n - seen, 1)[:, None]
    at = seen[:, None] + 1 + jnp.arange(gamma, dtype=jnp.int32)[None, :] % period  # <= n
    valid = jnp.broadcast_to(seen[:, None] >= 0, at.shape)
    return jnp.take_along_axis(history, jnp.clip(at, 0, S - 1), axis=1), valid
