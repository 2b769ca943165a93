"""The target's side of a speculative round: its pass over what the draft proposed (a
chain, two chains from ``last``, CaPE's tree), the acceptance rules, and keeping the
accepted path's cache entries. Every pass continues the target's cache through its
``Cache`` interface (``Transformer.decode``), contiguous or paged alike.
``jaxpar.inference.speculative`` runs the rounds (``speculate``);
``jaxpar.inference.drafting`` is the draft's side; the sampling rule and the rows'
settings are ``jaxpar.inference.sampling``'s.

Each pass returns ``Verified``; ``with_features``: the target's features along the kept
path (for a draft that reads them), else None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.inference import token_tree
from jaxpar.inference.sampling import Rows
from jaxpar.models.cache import Cache
from jaxpar.models.transformer import Transformer

if TYPE_CHECKING:
    from jaxpar.inference.speculative import Method


def accept_greedy(drafts: jax.Array, target_logits: jax.Array):
    """Exact match: ``(accepted [B], next [B])`` for drafts ``[B, gamma]`` and the
    target's logits ``[B, gamma + 1, V]`` after ``[last, d_1..d_gamma]``."""
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    match = drafts == choice[:, :-1]
    accepted = jnp.cumprod(match, axis=1).sum(axis=1).astype(jnp.int32)
    return accepted, jnp.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]


# ------------------------------------------------------------------- target passes


class Verified(NamedTuple):
    """A round's verification: the target's ``cache`` (the accepted path's entries in
    place, lengths not yet moved), ``path_tokens [B, >= gamma]`` (a row emits its first
    ``accepted [B]`` and then ``next [B]``), ``features`` the target's along the path,
    root first, ``[B, >= gamma + 1, D]`` (None unless asked), and ``logits`` the
    target's along it, ``[B, >= gamma + 1, V]``: emitted token ``i``'s distribution is
    ``logits[:, i]`` (its logprobs)."""

    cache: Cache
    path_tokens: jax.Array
    accepted: jax.Array
    next: jax.Array
    features: jax.Array | None
    logits: jax.Array


def _tree_pass(target: Transformer, cache: Cache, tokens: jax.Array, depths: np.ndarray, mask: np.ndarray):
    """The target over a token tree ``tokens [B, N]`` (root ``last``; node depths ``[N]``,
    its mask ``[N, N]``) in one pass: ``Decoded`` (logits ``[B, N, V]``)."""
    B, N = tokens.shape
    positions = cache.lengths[:, None] + jnp.asarray(depths)[None, :]
    return target.decode(tokens, cache, positions=positions, tree_mask=jnp.broadcast_to(jnp.asarray(mask), (B, N, N)))


def _keep_path(old: Cache, cache: Cache, path: jax.Array, features: jax.Array, with_features: bool):
    """A tree pass's ``cache`` with the accepted ``path [B, P]``'s entries moved into
    place (``token_tree.compact``), and the tree's ``features`` along it (or None)."""
    kept = jnp.take_along_axis(features, path[..., None], axis=1) if with_features else None
    return token_tree.compact(cache, old.lengths, path), kept


def _pad(x: jax.Array, length: int) -> jax.Array:
    """``x [B, T, ...]`` with zeros after it along axis 1, to ``[B, length, ...]``."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def verify_chain(target: Transformer, cache: Cache, last, drafts, draft_logits, rows: Rows,
                 with_features: bool) -> Verified:
    """The target over ``[last, d_1..d_gamma]`` in one pass, each row accepting by exact
    match (greedy) or the speculative-sampling rule (``rows``)."""
    logits, cache, features = target.decode(jnp.concatenate([last[:, None], drafts], axis=1), cache)
    accepted, nxt = rows.accept(drafts, draft_logits, logits, accept_greedy(drafts, logits))
    return Verified(cache, drafts, accepted, nxt, features if with_features else None, logits)


def verify_two_chains(target: Transformer, cache: Cache, last, first, second, second_valid,
                      with_features: bool) -> Verified:
    """Two chains from ``last`` in one target pass over ``[last, first, second]``
    (``token_tree.two_chains_mask``): ``first [B, gamma]`` (the draft's) and ``second [B,
    k]``, ``k <= gamma`` (a copied chain, the runner-up; its ``second_valid``). Keeps the
    chain with more accepted tokens (the first on a tie) and compacts its cache entries;
    the path tokens of a kept second chain are followed by the first's past ``k`` (never
    emitted: it accepted at most ``k``). Greedy."""
    B, gamma = first.shape
    k = second.shape[1]
    tokens = jnp.concatenate([last[:, None], first, second], axis=1)
    depths = np.concatenate([[0], np.arange(1, gamma + 1), np.arange(1, k + 1)]).astype(np.int32)
    logits, new_cache, features = _tree_pass(target, cache, tokens, depths, token_tree.two_chains_mask(gamma, k))
    target_next = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def accepted_along(nodes, valid):  # nodes: a chain's node indices
        parents = np.concatenate([[0], nodes[:-1]])
        agree = valid & (tokens[:, nodes] == target_next[:, parents])
        return jnp.cumprod(agree, axis=1).sum(axis=1).astype(jnp.int32)

    first_nodes, second_nodes = np.arange(1, gamma + 1), np.arange(gamma + 1, gamma + k + 1)
    from_first = accepted_along(first_nodes, jnp.ones((B, gamma), bool))
    from_second = accepted_along(second_nodes, second_valid)
    use_second = from_second > from_first
    accepted = jnp.maximum(from_first, from_second)
    second_path = np.concatenate([second_nodes, first_nodes[k:]])  # node >= depth: compact reads before it writes
    path = jnp.concatenate([jnp.zeros((B, 1), jnp.int32),
                            jnp.where(use_second[:, None], second_path[None, :], first_nodes[None, :])], axis=1)
    nxt = jnp.take_along_axis(target_next, jnp.take_along_axis(path, accepted[:, None], axis=1), axis=1)[:, 0]
    new_cache, features = _keep_path(cache, new_cache, path, features, with_features)
    second_tokens = jnp.concatenate([second, first[:, k:]], axis=1)
    return Verified(new_cache, jnp.where(use_second[:, None], second_tokens, first), accepted, nxt, features,
                    jnp.take_along_axis(logits, path[..., None], axis=1))


def verify_select(method: Method, target: Transformer, cache: Cache, last, chain, copied, use_copy, rows: Rows,
                  with_features: bool) -> Verified:
    """``select``: ``chain [B, gamma]`` (the first ``gamma`` tokens of ``copied [B,
    method.copied]`` where ``use_copy [B]``, else the draft's) verified as a chain; where
    every sequence takes the copy and it is longer (``lookup_tokens``), all of it, a
    longer pass (``lax.cond``). The path and the features padded to the copy's length.
    Greedy."""
    def verified(tokens):
        v = verify_chain(target, cache, last, tokens, None, rows, with_features)
        return v._replace(path_tokens=_pad(tokens, method.copied), logits=_pad(v.logits, method.copied + 1),
                          features=None if v.features is None else _pad(v.features, method.copied + 1))

    if method.copied == method.gamma:
        return verified(chain)
    return jax.lax.cond(use_copy.all(), lambda: verified(copied), lambda: verified(chain))


def runner_up(first_logits: jax.Array, chain_first: jax.Array) -> jax.Array:
    """The first token to verify beside a chain starting with ``chain_first [B]``: the
    draft's most likely (``first_logits [B, V]``) where the chain starts otherwise (a
    copied chain), else its second most likely. Two argmaxes, int32 ``[B]``: XLA:CPU's
    ``top_k`` sorts the whole vocabulary (6 ms a round for SmolLM2's 49,152 tokens)."""
    best = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)
    others = jnp.where(jnp.arange(first_logits.shape[-1])[None, :] == best[:, None], -jnp.inf, first_logits)
    return jnp.where(best != chain_first, best, jnp.argmax(others, axis=-1).astype(jnp.int32))


def verify_with_runner_up(target: Transformer, cache: Cache, last, chain, first_logits,
                          with_features: bool) -> Verified:
    """A chain ``[B, gamma]`` and one more candidate for its first token (``runner_up``
    of the draft's ``first_logits [B, V]``), verified as two chains, the second of one
    token (``verify_two_chains``): the chain's accepted prefix, or, where the chain's
    first token is wrong and the other is right, that token and the target's after it
    (two tokens where the chain alone gives one). Greedy."""
    other = runner_up(first_logits, chain[:, 0])[:, None]
    return verify_two_chains(target, cache, last, chain, other, jnp.ones(other.shape, bool), with_features)


def verify_tree(method: Method, target: Transformer, cache: Cache, last, drafts, draft_logits, rows: Rows,
                with_features: bool) -> Verified:
    """CaPE: the draft's chain widened by its confidence into ``method.tree``, verified
    in one target pass with the tree mask; greedy rows walk the tree, sampling rows take
    the chain (its nodes see what the chain alone would) by the speculative-sampling
    rule; the accepted path's cache entries are compacted into place."""
    layout = method.tree
    confidence = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1).max(-1)  # [B, gamma]
    top = jax.lax.top_k(draft_logits, layout.width)[1].at[:, :, 0].set(drafts)
    tokens = layout.tokens(last, top)
    valid = layout.valid(token_tree.widths(confidence, method.bins))
    logits, new_cache, features = _tree_pass(target, cache, tokens, layout.depths, layout.mask)
    target_next = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    path, accepted, nxt = token_tree.verify_greedy(layout, tokens, valid, target_next)
    chain = jnp.asarray([0] + [layout.node(i, 0) for i in range(1, method.gamma + 1)], jnp.int32)
    accepted, nxt = rows.accept(drafts, draft_logits, logits[:, chain], (accepted, nxt))
    path = jnp.where(rows.sampling()[:, None], chain[None, :], path)
    new_cache, features = _keep_path(cache, new_cache, path, features, with_features)
    return Verified(new_cache, jnp.take_along_axis(tokens, path[:, 1:], axis=1), accepted, nxt, features,
                    jnp.take_along_axis(logits, path[..., None], axis=1))
