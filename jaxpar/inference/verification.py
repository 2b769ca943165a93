"""The target's side of a speculative round: its pass over what the draft proposed (a
chain, two chains from ``last``, CaPE's tree), the acceptance rules, and keeping the
accepted path's cache entries. ``jaxpar.inference.speculative`` runs the rounds (its
``Method`` and ``State``); ``jaxpar.inference.drafting`` is the draft's side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.inference import token_tree
from jaxpar.inference.sampling import draw, probabilities
from jaxpar.models.transformer import KVCache, Transformer

if TYPE_CHECKING:
    from jaxpar.inference.speculative import Method, State


def accept_greedy(drafts: jax.Array, target_logits: jax.Array):
    """Exact match: ``(accepted [B], next [B])`` for drafts ``[B, gamma]`` and the
    target's logits ``[B, gamma + 1, V]`` after ``[last, d_1..d_gamma]``."""
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    match = drafts == choice[:, :-1]
    accepted = jnp.cumprod(match, axis=1).sum(axis=1).astype(jnp.int32)
    return accepted, jnp.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]


def accept_sampled(drafts: jax.Array, draft_probs: jax.Array, target_probs: jax.Array, key):
    """The speculative-sampling rule: ``(accepted [B], next [B])``.

    drafts ``[B, gamma]`` drawn from ``draft_probs [B, gamma, V]``; ``target_probs
    [B, gamma + 1, V]`` after ``[last, d_1..d_gamma]``. ``d_i`` is kept with probability
    ``min(1, p(d_i) / q(d_i))``; the first rejection draws from ``norm(max(0, p - q))``
    at that depth, and when all are kept the bonus token is drawn from ``p`` after
    ``d_gamma``.
    """
    B, gamma = drafts.shape
    key_accept, key_next = jax.random.split(key)
    p = jnp.take_along_axis(target_probs[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    keep = jax.random.uniform(key_accept, (B, gamma)) * q < p
    accepted = jnp.cumprod(keep, axis=1).sum(axis=1).astype(jnp.int32)
    q_padded = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    at = accepted[:, None, None]
    p_at = jnp.take_along_axis(target_probs, at, axis=1)[:, 0]
    residual = jnp.maximum(p_at - jnp.take_along_axis(q_padded, at, axis=1)[:, 0], 0.0)
    # p == q leaves no residual mass, but then a rejection has probability 0 too.
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_at)
    return accepted, draw(key_next, residual)


# ------------------------------------------------------------------- target passes


def target_pass(target: Transformer, tokens: jax.Array, cache: KVCache, with_features: bool, **kwargs):
    """The target over ``tokens [B, T]`` continuing ``cache``: ``(logits, cache,
    features)``, ``features [B, T, D]`` when ``with_features`` (for a draft that reads
    them), else None."""
    out = target(tokens, cache=cache, with_features=with_features, **kwargs)
    return out if with_features else (*out, None)


def _tree_pass(target: Transformer, state: State, tokens: jax.Array, depths: np.ndarray, mask: np.ndarray):
    """The target over a token tree ``tokens [B, N]`` (root ``last``; node depths ``[N]``,
    its mask ``[N, N]``) in one pass: ``(target_next [B, N], cache, features)``, the
    target's greedy token after each node, and its features when the state carries them."""
    B, N = tokens.shape
    positions = state.target_cache.lengths[:, None] + jnp.asarray(depths)[None, :]
    logits, cache, features = target_pass(target, tokens, state.target_cache, state.features is not None,
                                           positions=positions,
                                           tree_mask=jnp.broadcast_to(jnp.asarray(mask), (B, N, N)))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache, features


def _keep_path(state: State, cache: KVCache, path: jax.Array, features: jax.Array | None):
    """A tree pass's ``cache`` with the accepted ``path [B, gamma + 1]``'s entries moved
    into place, and the tree's ``features`` along it (None stays None)."""
    kept = None if features is None else jnp.take_along_axis(features, path[..., None], axis=1)
    return token_tree.compact(cache, state.target_cache.lengths, path), kept


def _pad(x: jax.Array, length: int) -> jax.Array:
    """``x [B, T, ...]`` with zeros after it along axis 1, to ``[B, length, ...]``."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def verify_chain(method: Method, target: Transformer, state: State, drafts, draft_logits, key):
    """The target over ``[last, d_1..d_gamma]`` in one pass; ``(cache, accepted, next,
    features)`` by exact match (greedy) or the speculative-sampling rule, ``features``
    the target's over the chain ``[B, gamma + 1, D]`` when the state carries them (else
    None)."""
    chain = jnp.concatenate([state.last[:, None], drafts], axis=1)
    logits, cache, features = target_pass(target, chain, state.target_cache, state.features is not None)
    if method.greedy:
        return (cache, *accept_greedy(drafts, logits), features)
    probs = lambda l: probabilities(l, method.temperature, method.top_p)
    return (cache, *accept_sampled(drafts, probs(draft_logits), probs(logits), key), features)


def verify_two_chains(target: Transformer, state: State, first, second, second_valid):
    """Two chains from ``last`` in one target pass over ``[last, first, second]``
    (``token_tree.two_chains_mask``): ``first [B, gamma]`` (the draft's) and ``second [B,
    k]``, ``k <= gamma`` (a copied chain, the runner-up; its ``second_valid``). Keeps the
    chain with more accepted tokens (the first on a tie) and compacts its cache entries:
    ``(cache, path_tokens [B, gamma], accepted, next, features)``, a kept second chain's
    path tokens followed by the first's past ``k`` (never emitted: it accepted at most
    ``k``), ``features`` the target's along the kept path when the state carries them
    (else None)."""
    B, gamma = first.shape
    k = second.shape[1]
    tokens = jnp.concatenate([state.last[:, None], first, second], axis=1)
    depths = np.concatenate([[0], np.arange(1, gamma + 1), np.arange(1, k + 1)]).astype(np.int32)
    target_next, cache, features = _tree_pass(target, state, tokens, depths, token_tree.two_chains_mask(gamma, k))

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
    cache, features = _keep_path(state, cache, path, features)
    second_tokens = jnp.concatenate([second, first[:, k:]], axis=1)
    return cache, jnp.where(use_second[:, None], second_tokens, first), accepted, nxt, features


def verify_select(method: Method, target: Transformer, state: State, chain, copied, use_copy):
    """``select``: ``chain [B, gamma]`` (the first ``gamma`` tokens of ``copied [B,
    method.copied]`` where ``use_copy [B]``, else the draft's) verified as a chain; where
    every sequence takes the copy and it is longer (``lookup_tokens``), all of it, a
    longer pass (``lax.cond``). ``(cache, path_tokens, accepted, next, features)``, the
    path and the features (None without) padded to the copy's length."""
    def verified(tokens):
        cache, accepted, nxt, features = verify_chain(method, target, state, tokens, None, None)
        features = None if features is None else _pad(features, method.copied + 1)
        return cache, _pad(tokens, method.copied), accepted, nxt, features

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


def verify_with_runner_up(target: Transformer, state: State, chain, first_logits):
    """A chain ``[B, gamma]`` and one more candidate for its first token (``runner_up``
    of the draft's ``first_logits [B, V]``), verified as two chains, the second of one
    token (``verify_two_chains``): the chain's accepted prefix, or, where the chain's
    first token is wrong and the other is right, that token and the target's after it
    (two tokens where the chain alone gives one). ``(cache, path_tokens [B, gamma],
    accepted, next, features)``."""
    other = runner_up(first_logits, chain[:, 0])[:, None]
    return verify_two_chains(target, state, chain, other, jnp.ones(other.shape, bool))


def verify_tree(method: Method, target: Transformer, state: State, drafts, draft_logits):
    """CaPE: the draft's chain widened by its confidence into ``method.tree``, verified
    in one target pass with the tree mask, the accepted path's cache entries compacted;
    ``(cache, path_tokens [B, gamma], accepted, next, features)``, ``features`` the
    target's along the path ``[B, gamma + 1, D]`` when the state carries them."""
    layout = method.tree
    confidence = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1).max(-1)  # [B, gamma]
    top = jax.lax.top_k(draft_logits, layout.width)[1].at[:, :, 0].set(drafts)
    tokens = layout.tokens(state.last, top)
    valid = layout.valid(token_tree.widths(confidence, method.bins))
    target_next, cache, features = _tree_pass(target, state, tokens, layout.depths, layout.mask)
    path, accepted, nxt = token_tree.verify_greedy(layout, tokens, valid, target_next)
    cache, features = _keep_path(state, cache, path, features)
    return cache, jnp.take_along_axis(tokens, path[:, 1:], axis=1), accepted, nxt, features
