"""Speculative decoding rounds over preallocated KV caches: the draft proposes, the target
verifies in one forward pass, and only the accepted tokens' cache entries stay.

One round, for every sequence of the batch at once (each with its own cache length):

* ``ar``: one target step (the baseline, run by the same loop; ``decoding.generate``
  streams these rounds).
* ``speculative`` / ``glide``: the draft (an independent small model, or the GliDe draft
  that cross-attends to the target's cache) proposes ``gamma`` tokens; the target runs
  once over ``[last, d_1..d_gamma]``; greedy decoding accepts the longest prefix equal
  to the target's own argmax, sampling accepts ``d_i`` with probability
  ``min(1, p_target(d_i) / p_draft(d_i))`` and at the first rejection draws from
  ``norm(max(0, p_target - p_draft))`` (Leviathan et al., 2023; Chen et al., 2023), so
  the output follows the target's distribution exactly. The target's token after the
  accepted prefix (the correction, or the bonus token) always comes too: a round emits
  ``accepted + 1`` tokens.
* ``cape``: the draft's greedy chain widened into a token tree by its confidence
  (``jaxpar.inference.token_tree``), verified in one target pass with a tree mask; the longest
  path the target agrees with is accepted and its cache entries compacted into place.
* ``lookup`` (with ``speculative`` or ``glide``, greedy): a chain copied from the sequence
  itself (``jaxpar.inference.prompt_lookup``, Saxena 2023: the ``gamma`` tokens that
  followed the latest earlier occurrence of what ends it), which catches what a one-layer
  draft cannot: text that repeats what the context already holds. ``"tree"``: the chain after ``last``'s
  latest occurrence and the draft's, verified in one target pass as a two-branch tree,
  the longer accepted one kept (the draft's on a tie): never fewer tokens than the
  draft alone, for a pass over ``1 + 2 gamma`` tokens. ``"select"``: the chain after
  the latest occurrence of the last two tokens *instead of* the draft's where there is
  one (a pass over ``gamma + 1``, as without): on SmolLM2 a two-token match is right
  more often than the draft. A round where every sequence takes the copy skips the
  draft's steps after its first (``lax.cond``), and verifies all of a copy longer than
  ``gamma`` (``Method.lookup_tokens``).
* ``runner_up`` (with a greedy ``speculative`` or ``glide`` chain, ``select``'s
  included): the same pass also verifies one more candidate for the chain's first token,
  the draft's best where the chain starts otherwise (a copy), else its second best
  (``verification.verify_with_runner_up``: two chains, the second of one token). Where the
  chain's first token is wrong and that one is right, the round keeps it and the
  target's token after it: two tokens where the chain gives one. On SmolLM2 with
  ``select`` at gamma 3 that is 2.18 -> 2.35 tokens a round.

Cache bookkeeping, with ``n`` a sequence's target cache length: the target cache holds
the ``n`` tokens before ``last``; a round writes ``[last, ...]`` at slots ``n..`` and the
new length is ``n + accepted + 1``, so rollback is the length alone and the accepted
prefix is never recomputed. The draft's first step of a round is over a window of the
sequence's last tokens (ending at ``last``; ``draft_window``, ``state_window``): for a
chain of the draft's own ``[n - 1, n]``, whose earlier accepted tokens its cache holds
already; where a round can keep tokens the draft did not propose (CaPE's siblings, a
copied chain, the runner-up, a round whose draft steps were skipped) the last
``tokens_per_round``: a round advances ``n`` by at most that, so every slot before
``last`` is rewritten from the verified token there.

A GliDe draft with ``features`` (EAGLE's input) also reads the target's features: the
state carries those at positions ``n - 2`` and ``n - 1`` (what the target's last pass
computed there), and its window is the last two tokens: ``n - 1`` reads the first,
``last`` and the round's proposals the second (the last position the target has
verified), as ``jaxpar.models.glide.feature_sources`` trains it. That window leaves the
draft's own entries at earlier slots where a round kept tokens it did not propose (a
draft's approximation; the tokens stay exact).

One round, two callers: ``speculate`` is the round's work (propose, verify, accept) over
any ``Cache`` (``jaxpar.models.transformer``) and any draft (``jaxpar.inference.drafting
.Draft``), with each row's sampling (``jaxpar.inference.sampling.Rows``). The dense loop
(``make_round``, over ``KVCache``) and the serving engine's step
(``jaxpar.serving.programs``, over pages, each row with its own seed and temperature)
both run it, so they give the same tokens and accepted counts for the same draft.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.inference import prompt_lookup, token_tree
from jaxpar.inference.drafting import Draft, Glide, as_draft, check_glide_target, draft_cache, features_at
from jaxpar.inference.sampling import Rows
from jaxpar.inference.verification import (Verified, verify_chain, verify_select, verify_tree, verify_two_chains,
                                           verify_with_runner_up)
from jaxpar.models.cache import Cache, KVCache, init_cache, write_cache
from jaxpar.models.transformer import Transformer
from jaxpar.placement.execution import jit

METHODS = ("ar", "speculative", "glide", "cape")
LOOKUPS = ("tree", "select")  # prompt lookup beside the draft (Method.lookup)


@dataclasses.dataclass(frozen=True)
class Method:
    """A decoding method's static settings (what a compiled round depends on)."""

    name: str = "speculative"
    gamma: int = 4
    bins: tuple[int, ...] = token_tree.DEFAULT_BINS
    temperature: float = 0.0
    top_p: float = 1.0
    lookup: str = ""  # "", or one of LOOKUPS
    lookup_tokens: int = 0  # a copied chain's length with lookup "select"; 0: gamma
    runner_up: bool = False  # also verify another first token beside a greedy chain (verify_with_runner_up)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def tree(self) -> token_tree.TreeLayout:
        return token_tree.TreeLayout(self.gamma, max(self.bins))

    @property
    def copied(self) -> int:
        """The length of a copied chain: ``gamma`` beside the draft's (``tree``);
        ``lookup_tokens`` (default ``gamma``) instead of it (``select``), where a round
        in which every sequence takes the copy verifies all of it. A copy that holds
        often holds for long (on SmolLM2's greedy continuations, where a two-token match
        occurred before, its next 3 tokens are right 44% of the time, its next 7 25%),
        which pays where a longer pass costs little more (a GPU's); on a CPU a pass over 8
        tokens costs 1.5 to 2 ``ar`` steps against 1.2 to 1.4 for 4
        (``bench/round_cost.py``), and ``lookup_tokens=7`` at gamma 3 lost there."""
        return self.lookup_tokens or self.gamma

    @property
    def tokens_per_round(self) -> int:
        """The most tokens a round emits (accepted drafts plus the target's own)."""
        return 1 if self.name == "ar" else max(self.gamma, self.copied) + 1

    @property
    def tokens_verified(self) -> int:
        """The tokens a round's target pass writes into the cache."""
        if self.lookup == "tree":
            return 1 + 2 * self.gamma
        return self.tree.size if self.name == "cape" else self.tokens_per_round + int(self.runner_up)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
    """The decoding loop's carry. ``B`` sequences, ``C`` output slots.

    target_cache: the target's cache; lengths ``n [B]`` (every token before ``last``).
    draft_cache: the draft's cache (None for ``ar``).
    last: int32 ``[B]``, the token at position ``n``.
    out: int32 ``[B, C]`` generated tokens; ``count [B]`` of them are filled.
    done: bool ``[B]``; a done sequence's lengths and counts no longer move.
    rounds, emitted: int32 ``[B]``, rounds run and tokens emitted while not done.
    key: the PRNG key of sampling.
    features: ``[B, 2, D]`` the target's features at positions ``n - 2`` and ``n - 1``
      (zeros before the first token), for a draft that reads them; else None.
    history: int32 ``[B, S]`` each sequence so far by position (``history[b, n] =
      last``; later slots are stale): the draft's window and the lookup's source; None
      for ``ar``.
    """

    target_cache: KVCache
    draft_cache: KVCache | None
    last: jax.Array
    out: jax.Array
    count: jax.Array
    done: jax.Array
    rounds: jax.Array
    emitted: jax.Array
    key: jax.Array
    features: jax.Array | None = None
    history: jax.Array | None = None


def check(method: Method, target: Transformer, draft) -> None:
    """Raises ValueError (one line) for a method, draft and settings that do not fit."""
    if method.name not in METHODS:
        raise ValueError(f"method={method.name!r} must be one of {', '.join(METHODS)}")
    if method.gamma < 1:
        raise ValueError(f"gamma={method.gamma} must be at least 1")
    token_tree.check_bins(method.bins)
    if method.temperature < 0 or not 0 < method.top_p <= 1:
        raise ValueError(f"need temperature >= 0 (got {method.temperature}) and 0 < top_p <= 1 "
                         f"(got {method.top_p})")
    if method.name == "ar":
        return
    if draft is None:
        raise ValueError(f"method {method.name!r} needs a draft model")
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.cfg.vocab_size} tokens) differs from the "
                         f"target's ({target.cfg.vocab_size}); a draft must share the target's tokenizer")
    kind = as_draft(draft)
    if method.name == "glide" and not isinstance(kind, Glide):
        raise ValueError("method 'glide' needs a GliDe draft (jaxpar-train glide); this draft is an "
                         "independent model: use method 'speculative'")
    if method.name == "speculative" and isinstance(kind, Glide):
        raise ValueError("method 'speculative' takes an independent draft model; a GliDe draft "
                         "runs with method 'glide' or 'cape'")
    if isinstance(kind, Glide):
        check_glide_target(draft, target)
    if method.lookup not in ("", *LOOKUPS):
        raise ValueError(f"lookup={method.lookup!r} must be one of {', '.join(LOOKUPS)} (or none)")
    if method.lookup_tokens < 0 or (method.lookup_tokens and method.lookup != "select"):
        raise ValueError(f"lookup_tokens={method.lookup_tokens} must be a positive length of the copied chain, "
                         f"with lookup 'select' (got lookup={method.lookup!r})")
    if method.lookup and (method.name not in ("speculative", "glide") or not method.greedy):
        raise ValueError(f"lookup goes with a greedy 'speculative' or 'glide' round, not method "
                         f"{method.name!r} at temperature {method.temperature}")
    if method.runner_up and (method.name not in ("speculative", "glide") or not method.greedy
                             or method.lookup == "tree" or method.copied != method.gamma):
        raise ValueError(f"runner_up goes with a greedy 'speculative' or 'glide' chain (lookup 'select' or none, "
                         f"lookup_tokens 0), not method {method.name!r} at temperature {method.temperature} "
                         f"with lookup={method.lookup!r}, lookup_tokens={method.lookup_tokens}")
    if method.name == "cape" and not method.greedy:
        raise ValueError(f"method 'cape' is greedy (temperature 0), got temperature={method.temperature}; "
                         "for sampling use 'glide' or 'speculative', which are lossless")


def draft_window(method: Method, with_features: bool = False) -> int:
    """How many of a sequence's last tokens (ending at ``last``) a round's first draft
    step feeds: a round's largest advance (``tokens_per_round``) where a round can keep
    tokens the draft did not propose (CaPE's siblings, a copied chain, the runner-up);
    2 for a chain of the draft's own, whose accepted proposals its cache already holds,
    and for a draft that reads features (``with_features``: the state carries two)."""
    if with_features or (method.name != "cape" and not method.lookup and not method.runner_up):
        return 2
    return method.tokens_per_round


def window_start(lengths: jax.Array, width: int) -> jax.Array:
    """Where a window of ``width`` tokens ending at position ``lengths [B]`` starts (from
    slot 0 while a sequence is shorter: its tail past ``last`` is then padding, written
    to the draft's cache where the proposals overwrite it)."""
    return jnp.maximum(lengths - (width - 1), 0)


def state_window(method: Method, state: State) -> jax.Array:
    """The dense decoder's draft window: the last ``draft_window`` tokens of each
    sequence in ``state.history`` (from ``window_start``), ``[B, W]``."""
    n, W = state.target_cache.lengths, draft_window(method, state.features is not None)
    return jnp.take_along_axis(state.history, window_start(n, W)[:, None] + jnp.arange(W, dtype=jnp.int32), axis=1)


def propose(method: Method, step: Callable, n: jax.Array, window: jax.Array, cache: Cache, rows: Rows,
            features: jax.Array | None = None, skip: jax.Array | None = None):
    """The draft's chain of ``gamma`` tokens: ``(tokens [B, gamma], logits [B, gamma, V],
    cache)``, token ``i`` drawn from ``logits[:, i]`` (``rows.choose(..., i)``).
    ``step(tokens, cache, features)``: the draft's forward, first over ``window [B, W]``
    (the sequence's tokens from ``window_start(n, W)``, ``last`` at ``n``) given
    ``features`` (the target's at ``n - 2``, ``n - 1``, or None), then over each proposal
    with the last of them. ``skip``: a bool scalar; where True only the window runs (it
    updates the cache; the tokens and logits after the first are zeros)."""
    start = window_start(n, window.shape[1])
    latest = None if features is None else features[:, 1:]  # the last verified position's
    logits, cache = step(window, cache.with_lengths(start), features)
    cache = cache.with_lengths(n + 1)  # slots past last: the proposals' to write
    first = jnp.take_along_axis(logits, (n - start)[:, None, None], axis=1)[:, 0]
    token = rows.choose(first, 0)

    def body(carry, i):
        cache, token = carry
        logits, cache = step(token[:, None], cache, latest)
        nxt = rows.choose(logits[:, 0], i)
        return (cache, nxt), (logits[:, 0], nxt)

    def steps(cache):
        (cache, _), (rest_logits, rest) = jax.lax.scan(body, (cache, token), jnp.arange(1, method.gamma))
        return cache, rest_logits, rest

    def none(cache):
        B, V = first.shape
        return (cache, jnp.zeros((method.gamma - 1, B, V), first.dtype),
                jnp.zeros((method.gamma - 1, B), jnp.int32))

    cache, rest_logits, rest = steps(cache) if skip is None else jax.lax.cond(skip, none, steps, cache)
    tokens = jnp.concatenate([token[:, None], rest.T], axis=1)
    logits = jnp.concatenate([first[:, None], jnp.swapaxes(rest_logits, 0, 1)], axis=1)
    return tokens, logits, cache


def speculate(method: Method, target: Transformer, draft: Draft, rows: Rows, target_cache: Cache,
              draft_cache: Cache, window: jax.Array, *, history: jax.Array | None = None,
              features: jax.Array | None = None, draft_head: jax.Array | None = None,
              target_head: jax.Array | None = None) -> tuple[Verified, Cache]:
    """One speculative round for ``B`` rows, whatever runs it (the dense decoder's
    ``make_round``, the serving engine's step) and whatever caches (any ``Cache``): the
    draft proposes (``propose`` over ``window``, the last ``draft_window`` tokens), the
    target verifies in one pass, each row accepts its own prefix.

    ``target_cache``'s lengths ``n [B]``: the tokens before ``last`` (``window``'s token
    at ``n``); ``rows``: each row's sampling; ``history [B, S]``: each sequence by
    position (the ``lookup`` methods' source; None without); ``features``: ``[B, 2, D]``
    for a draft that reads them, else None; ``draft_head``, ``target_head``: the heads
    made once for many rounds (``loop_heads``; None: made here). Returns ``(Verified,
    draft cache)``; the target cache's lengths are the caller's to move (``n + accepted
    + 1``)."""
    verifier = target if target_head is None else _with_head(target, target_head)
    with_features = features is not None
    n = target_cache.lengths
    last = jnp.take_along_axis(window, (n - window_start(n, window.shape[1]))[:, None], axis=1)[:, 0]
    with jax.named_scope("draft"):  # the named scopes label a round's parts in profiles
        head = draft.head(target) if draft_head is None else draft_head  # once a round, not once a step

        def step(tokens, cache, features):
            return draft.forward(target, tokens, cache, target_cache, head, features)

        skip = None
        if method.lookup == "select":  # the copied chain where the last two tokens occurred before
            copied, copied_valid = prompt_lookup.chain(history, n, method.copied, 2)
            use_copy = copied_valid[:, 0]
            skip = use_copy.all()  # every sequence takes the copy: the draft's first step only
        drafts, draft_logits, draft_cache = propose(method, step, n, window, draft_cache, rows, features, skip)
    with jax.named_scope("verify"):
        if method.name == "cape":
            verified = verify_tree(method, verifier, target_cache, last, drafts, draft_logits, rows, with_features)
        elif method.lookup == "tree":
            copied, copied_valid = prompt_lookup.chain(history, n, method.gamma)
            verified = verify_two_chains(verifier, target_cache, last, drafts, copied, copied_valid, with_features)
        elif method.runner_up:  # the chain (or the copy where taken) and one more first token
            chain = drafts if method.lookup != "select" else jnp.where(use_copy[:, None],
                                                                       copied[:, :method.gamma], drafts)
            verified = verify_with_runner_up(verifier, target_cache, last, chain, draft_logits[:, 0], with_features)
        elif method.lookup == "select":
            chain = jnp.where(use_copy[:, None], copied[:, :method.gamma], drafts)
            verified = verify_select(method, verifier, target_cache, last, chain, copied, use_copy, rows,
                                     with_features)
        else:
            verified = verify_chain(verifier, target_cache, last, drafts, draft_logits, rows, with_features)
    return verified, draft_cache


class _with_head:
    """``target`` whose passes take ``head`` (``Transformer.decode``'s), made once."""

    def __init__(self, target: Transformer, head: jax.Array):
        self.target, self.head = target, head

    def decode(self, *args, **kwargs):
        return self.target.decode(*args, head=self.head, **kwargs)


# -------------------------------------------------------------------------- rounds


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """Whether each of ``tokens`` (int, any shape) is one of ``eos_ids``; bool, same shape."""
    hit = jnp.zeros(tokens.shape, bool)
    for eos in eos_ids:
        hit = hit | (tokens == eos)
    return hit


def _finish(method: Method, state: State, target_cache: KVCache, path_tokens, accepted, nxt,
            draft_cache, key, eos_ids: tuple[int, ...], features: jax.Array | None = None) -> State:
    """Emits ``path_tokens[:, :accepted]`` and ``nxt`` for the sequences not done, sets
    the caches' lengths to keep exactly the accepted tokens, updates the counters;
    ``features``: the target's ``[B, T, D]`` over the round's accepted path (its root
    ``last`` first), for a draft that reads them."""
    B, R = path_tokens.shape[0], method.tokens_per_round
    n = state.target_cache.lengths
    live = ~state.done
    slot = jnp.arange(R)[None, :]
    padded = jnp.concatenate([path_tokens, jnp.zeros((B, R - path_tokens.shape[1]), jnp.int32)], axis=1)
    emitted = jnp.where(slot < accepted[:, None], padded, nxt[:, None])
    out = jnp.where(live[:, None], write_cache(state.out, emitted, state.count), state.out)
    count = state.count + jnp.where(live, accepted + 1, 0)
    target_cache = dataclasses.replace(target_cache, lengths=jnp.where(live, n + accepted + 1, n))
    hit_eos = (is_eos(emitted, eos_ids) & (slot <= accepted[:, None])).any(1)
    max_new = state.out.shape[1] - R
    return State(
        target_cache=target_cache,
        draft_cache=draft_cache,
        last=jnp.where(live, nxt, state.last),
        out=out,
        count=count,
        done=state.done | (live & (hit_eos | (count >= max_new))),
        rounds=state.rounds + live,
        emitted=state.emitted + jnp.where(live, accepted + 1, 0),
        key=key,
        features=None if features is None else jnp.where(live[:, None, None], _next_features(state, features, accepted),
                                                         state.features),
        history=None if state.history is None else jnp.where(live[:, None], write_cache(state.history, emitted, n + 1),
                                                             state.history),
    )


def _next_features(state: State, path_features: jax.Array, accepted: jax.Array) -> jax.Array:
    """The target's features at the new ``n - 2`` and ``n - 1`` (``[B, 2, D]``): the
    path's at ``accepted - 1`` and ``accepted``, the first the old ``n - 1``'s when
    nothing was accepted (``path_features [B, T, D]``: the path's, root first)."""
    at = features_at(path_features, jnp.stack([accepted - 1, accepted], axis=1))
    before = jnp.where((accepted > 0)[:, None], at[:, 0], state.features[:, 1])
    return jnp.stack([before, at[:, 1]], axis=1)


def make_round(method: Method, target: Transformer, draft, eos_ids: tuple[int, ...],
               draft_head: jax.Array | None = None, target_head: jax.Array | None = None
               ) -> Callable[[State], State]:
    """One decoding round ``State -> State`` for ``method`` (traced inside ``jit``): ``ar``'s
    one target step, or ``speculate``'s round; a sequence is done after emitting any of
    ``eos_ids``. ``draft_head``: the draft's ``head(target)``, and ``target_head`` the
    target's ``head_weight()`` for its verification passes, made once by the caller for
    every round (None: in each)."""
    def round_(state: State) -> State:
        key, round_key = jax.random.split(state.key)
        rows = Rows.uniform(state.last.shape[0], method.temperature, method.top_p, round_key)
        if method.name == "ar":
            with jax.named_scope("verify"):
                logits, cache, _ = target.decode(state.last[:, None], state.target_cache)
                token = rows.choose(logits[:, 0], 0)
            no_drafts = jnp.zeros((token.shape[0], 0), jnp.int32)
            with jax.named_scope("finish"):
                return _finish(method, state, cache, no_drafts, jnp.zeros_like(token), token, None, key, eos_ids)
        verified, dcache = speculate(method, target, as_draft(draft), rows, state.target_cache, state.draft_cache,
                                     state_window(method, state), history=state.history, features=state.features,
                                     draft_head=draft_head, target_head=target_head)
        with jax.named_scope("finish"):
            return _finish(method, state, verified.cache, verified.path_tokens, verified.accepted, verified.next,
                           dcache, key, eos_ids, verified.features)

    return round_


def prefill(method: Method, target: Transformer, draft, prompt: jax.Array, lengths: jax.Array,
            max_new_tokens: int, key: jax.Array, eos_ids: tuple[int, ...]) -> State:
    """The target (and draft) over the prompts ``[B, P]`` (sequence ``b``'s first
    ``lengths[b]`` tokens; the rest is padding), and the target's first token."""
    B, P = prompt.shape
    max_length = P + max_new_tokens + method.tokens_verified
    logits, cache, features = target.decode(prompt, init_cache(target.cfg, B, max_length))
    cache = cache.with_lengths(lengths)
    key, sub = jax.random.split(key)
    last_logits = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    first = Rows.uniform(B, method.temperature, method.top_p, sub).choose(last_logits, 0)
    dcache = None
    kind = None if method.name == "ar" else as_draft(draft)
    with_features = kind is not None and kind.reads_features
    if kind is not None:  # the draft over the prompt: a query at t reads the target's keys <= t
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        fed = features_at(features, positions - 1) if with_features else None  # the target's at t - 1
        dcache = kind.forward(target, prompt, draft_cache(kind, B, max_length), cache, None, fed, positions)[1]
    out = jnp.zeros((B, max_new_tokens + method.tokens_per_round), jnp.int32).at[:, 0].set(first)
    count = jnp.ones((B,), jnp.int32)
    done = (count >= max_new_tokens) | is_eos(first, eos_ids)
    zeros = jnp.zeros((B,), jnp.int32)
    # the target's features at n - 2 and n - 1, for a draft that reads them
    features = features_at(features, lengths[:, None] + jnp.arange(-2, 0, dtype=jnp.int32)) if with_features else None
    history = None
    if method.name != "ar":  # room for every round's writes past the last position kept
        history = jnp.zeros((B, P + max_new_tokens + 2 * method.tokens_per_round), jnp.int32)
        history = write_cache(history.at[:, :P].set(prompt.astype(jnp.int32)), first[:, None], lengths)
    return State(cache, dcache, first, out, count, done, zeros, zeros, key, features, history)


def loop_heads(method: Method, target: Transformer, draft) -> tuple[jax.Array | None, jax.Array | None]:
    """``(draft_head, target_head)`` for ``make_round``, made once for many rounds: the
    draft's ``head(target)`` (a GliDe draft's; None for an independent one), and a tied
    target's ``head_weight()`` as a ``[D, V]`` copy, which its passes over several tokens
    multiply faster (``Transformer.__call__``; ``ar``'s one row is not faster: None
    there). They depend on the weights alone, so ``jaxpar.inference.decoding`` keeps
    them with the model across generations: made in each, SmolLM2's 113 MB copy took 70
    to 77 ms, about 5% of a 64-token generation on a 2-core CPU."""
    if method.name == "ar":
        return None, None
    return as_draft(draft).head(target), (target.head_weight() if target.cfg.tie_embeddings else None)


class Programs(NamedTuple):
    """``compiled``'s jitted programs; each takes the graph and the state of the pair
    ``(target, draft)`` (``nnx.split``; the graph static) first."""

    prefill: Callable  # (graph, params, prompt, lengths, key) -> State
    round: Callable  # (graph, params, state[, heads]) -> State; heads: from `heads` (default: made in the round)
    loop: Callable  # (graph, params, prompt, lengths, key, heads) -> State: prefill, then rounds until done
    heads: Callable  # (graph, params) -> loop_heads(...)


@functools.lru_cache(maxsize=64)  # a benchmark's table: methods x gammas x lookups
def compiled(method: Method, max_new_tokens: int, eos_ids: tuple[int, ...]) -> Programs:
    """``Programs`` jitted for ``method``: ``loop`` runs the rounds in a ``while_loop``
    until every sequence is done; it and a stream's ``round`` take the heads ``heads``
    made (``loop_heads``, once per model), so a streamed round costs the loop's.
    Temperature and top-p are part of ``method``, and the end-of-sequence ids
    ``eos_ids`` (any of them ends a sequence; none, ``()``) static too, so each setting
    compiles once. The same settings return the same ``Programs`` (cached), so every
    caller (``jaxpar.inference.decoding``, a benchmark lowering the loop to read its
    program) shares their traces and compiled programs rather than tracing anew."""

    def do_prefill(graph, params, prompt, lengths, key):
        target, draft = nnx.merge(graph, params)
        return prefill(method, target, draft, prompt, lengths, max_new_tokens, key, eos_ids)

    def do_heads(graph, params):
        return loop_heads(method, *nnx.merge(graph, params))

    def do_round(graph, params, state, heads=(None, None)):
        target, draft = nnx.merge(graph, params)
        return make_round(method, target, draft, eos_ids, *heads)(state)

    def do_loop(graph, params, prompt, lengths, key, heads):
        target, draft = nnx.merge(graph, params)
        state = prefill(method, target, draft, prompt, lengths, max_new_tokens, key, eos_ids)
        body = make_round(method, target, draft, eos_ids, *heads)
        return jax.lax.while_loop(lambda s: ~s.done.all(), body, state)

    keyed = lambda f: jit(f, static_argnums=0)  # noqa: E731 (the Execution is in the key too)
    return Programs(keyed(do_prefill), keyed(do_round), keyed(do_loop), keyed(do_heads))
