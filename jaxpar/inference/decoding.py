"""Decoding: autoregressive generation with a preallocated KV cache (``generate``, one
jitted step per token, streamed), and speculative decoding that reuses the target's
cache (``speculative_generate``, the whole loop in one jitted ``while_loop``, and
``speculative_stream``, one jitted round at a time) with an independent draft model,
a GliDe draft (``jaxpar.models.GlideDraft``) or GliDe with CaPE's token trees. The
rounds themselves are ``jaxpar.inference.speculative``'s; ``generate`` runs its ``ar``
rounds, so plain and speculative decoding share one autoregressive step.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.inference import speculative
from jaxpar.models.transformer import Transformer
from jaxpar.inference.sampling import probabilities, sample
from jaxpar.inference.speculative import METHODS, Method
from jaxpar.inference.token_tree import DEFAULT_BINS

__all__ = ["DEFAULT_BINS", "METHODS", "Generation", "generate", "probabilities", "sample",
           "speculative_generate", "speculative_stream"]


def generate(
    model: Transformer,
    prompt: np.ndarray,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_ids: Sequence[int] = (),
) -> Iterator[np.ndarray]:
    """Yields the next token of every sequence, ``[B]`` int32, up to ``max_new_tokens``:
    the ``ar`` method's rounds of ``speculative_stream`` (one jitted target step each),
    one yield per round.

    Args:
      prompt: int ``[B, T]`` prompt tokens (all sequences the same length).
      eos_ids: end-of-sequence tokens: stop once every sequence has produced one of
        them; a sequence that has repeats its end token while the others go on.
    """
    method, tokens, lengths, graph, params = _setup(model, prompt, None, "ar", 1, DEFAULT_BINS,
                                                    temperature, top_p, max_new_tokens)
    programs = speculative.compiled(method, max_new_tokens, _eos(eos_ids))
    state = programs.prefill(graph, params, tokens, lengths, jax.random.key(seed))
    while True:
        yield np.asarray(state.last)
        if bool(np.asarray(state.done).all()):
            return
        state = programs.round(graph, params, state)


@dataclasses.dataclass(frozen=True)
class Generation:
    """What ``speculative_generate`` returns.

    tokens: per sequence, int32 ``[<= max_new_tokens]``, cut after its first end token
      (any of ``eos_ids``).
    accepted_per_step: mean tokens a round gave a sequence, the target's own (correction
      or bonus) token included, as Spec-Bench counts it (1.0 for ``ar``).
    rounds: int ``[B]``, the rounds (target forward passes) each sequence took.
    emitted: int ``[B]``, the tokens those rounds gave each sequence (past
      ``max_new_tokens`` too: ``emitted / rounds`` is its accepted tokens per round).
    """

    tokens: list[np.ndarray]
    accepted_per_step: float
    rounds: np.ndarray
    emitted: np.ndarray


# Prompt widths are rounded up to a multiple of this many tokens, so prompts of nearby
# lengths share one compiled program (the prefill buckets of vLLM's and MaxText's
# engines): without it every new prompt length compiles every method afresh, seconds
# each on a GPU. The padding is masked like any shorter row's and costs at most
# PROMPT_BUCKET - 1 positions of prefill and of cache.
PROMPT_BUCKET = 32


def _prompts(prompt) -> tuple[jax.Array, jax.Array]:
    """``(tokens [B, P], lengths [B])`` from an int ``[B, T]`` array or a list of 1-D
    prompts of any lengths, right-padded to ``P``, the longest rounded up to a multiple
    of ``PROMPT_BUCKET``."""
    rows = [np.asarray(p, np.int32).reshape(-1) for p in prompt]
    if not rows or min(len(r) for r in rows) == 0:
        raise ValueError("every prompt needs at least one token")
    P = -(-max(len(r) for r in rows) // PROMPT_BUCKET) * PROMPT_BUCKET
    tokens = np.zeros((len(rows), P), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    return jnp.asarray(tokens), jnp.asarray([len(r) for r in rows], jnp.int32)


# The heads the rounds multiply (``speculative.loop_heads``: a tied target's [D, V]
# copy, a GliDe draft's restricted head) depend on the weights alone, so they are made
# once per model and kept while its weights live, as an engine prepares its weights at
# load: keyed by the weight arrays' identities, an entry dropped when any of them is
# freed (new weights, as after a training step, are new arrays: a new entry). It holds
# one more copy of a tied head per model (113 MB for SmolLM2) while the model lives.
_HEADS: dict[tuple, tuple] = {}


def _heads(programs: speculative.Programs, method: Method, graph, params) -> tuple:
    """``programs.heads(graph, params)``, made once for these weights (``_HEADS``)."""
    if method.name == "ar":
        return None, None
    leaves = jax.tree.leaves(params)
    key = (graph, tuple(id(x) for x in leaves))
    if key not in _HEADS:
        heads = programs.heads(graph, params)
        try:
            for leaf in leaves:
                weakref.finalize(leaf, _HEADS.pop, key, None)
        except TypeError:  # a leaf that cannot be referenced weakly: not kept
            return heads
        _HEADS[key] = heads
    return _HEADS[key]


def _eos(eos_ids: Sequence[int]) -> tuple[int, ...]:
    """``eos_ids`` as a sorted tuple of distinct ints (hashable: a static argument)."""
    if isinstance(eos_ids, (int, np.integer)) or not all(
            isinstance(i, (int, np.integer)) for i in eos_ids):
        raise ValueError(f"eos_ids={eos_ids!r} must be a sequence of token ids")
    return tuple(sorted({int(i) for i in eos_ids}))


def _setup(target, prompt, draft, method, gamma, bins, temperature, top_p, max_new_tokens, lookup="",
           lookup_tokens=0, runner_up=False):
    method = Method(method, gamma, tuple(bins), float(temperature), float(top_p), lookup or "", int(lookup_tokens),
                    bool(runner_up))
    speculative.check(method, target, draft)
    if method.name == "ar":  # its rounds read no draft setting: one program whatever gamma, lookup, runner-up say
        method = Method("ar", 1, temperature=method.temperature, top_p=method.top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    tokens, lengths = _prompts(prompt)
    graph, params = nnx.split((target, draft if method.name != "ar" else None))
    return method, tokens, lengths, graph, params


def _tokens(state, eos_ids: tuple[int, ...], max_new_tokens) -> list[np.ndarray]:
    """Each sequence's tokens so far, cut after its first end token; ``state`` on the
    device or (its ``out`` and ``count``) fetched."""
    out, count = np.asarray(state.out), np.asarray(state.count)
    rows = []
    for b in range(out.shape[0]):
        row = out[b, : min(int(count[b]), max_new_tokens)]
        ends = np.isin(row, eos_ids)
        if ends.any():
            row = row[: int(np.argmax(ends)) + 1]
        rows.append(row)
    return rows


def speculative_generate(
    target: Transformer,
    prompt,
    *,
    draft=None,
    method: str = "speculative",
    gamma: int = 4,
    bins: Sequence[int] = DEFAULT_BINS,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_ids: Sequence[int] = (),
    lookup: str = "",
    lookup_tokens: int = 0,
    runner_up: bool = False,
) -> Generation:
    """Generates with ``method`` (``jaxpar.inference.decoding.METHODS``), all rounds in one jitted
    loop, every sequence of the batch accepting its own number of tokens per round. The
    verification's heads (a tied target's ``[D, V]`` copy, a GliDe draft's head) are made
    by a model's first generation and kept while its weights live (``_HEADS``).

    Args:
      target: the model whose output this is (greedy: exactly its greedy decoding;
        sampling: exactly its distribution ``probabilities(logits, temperature, top_p)``).
      prompt: int ``[B, P]``, or a list of 1-D prompts of different lengths.
      draft: a ``Transformer`` sharing the target's tokenizer (``speculative``, ``cape``)
        or a ``GlideDraft`` trained against this target (``glide``, ``cape``); None for
        ``ar``.
      method: ``ar`` (the baseline), ``speculative``, ``glide`` or ``cape``.
      gamma: draft tokens per round (the tree's depth for ``cape``).
      bins: CaPE's widths by draft confidence decile (11 ints).
      temperature, top_p: 0 is greedy; ``cape`` is greedy only.
      eos_ids: end-of-sequence tokens; a sequence stops after producing any of them.
      lookup: with ``speculative`` or ``glide``, greedy: a chain copied from the sequence
        itself (prompt lookup), ``"tree"`` verified beside the draft's in the same pass,
        ``"select"`` instead of it where the last two tokens occurred before
        (``jaxpar.inference.speculative``); ``""``: none.
      lookup_tokens: with ``lookup="select"``, the copied chain's length (0: ``gamma``);
        a round where every sequence has a copy verifies all of it.
      runner_up: with a greedy ``speculative`` or ``glide`` chain (``lookup`` ``select``
        or none): the same pass also verifies another first token, the draft's best where
        the chain starts otherwise (a copy), else its second best, kept where the chain's
        first token is wrong and it is right: a pass over one more token.

    Raises:
      ValueError: a method, draft or setting that does not fit (one line).
    """
    method, tokens, lengths, graph, params = _setup(target, prompt, draft, method, gamma, bins,
                                                    temperature, top_p, max_new_tokens, lookup, lookup_tokens,
                                                    runner_up)
    eos_ids = _eos(eos_ids)
    programs = speculative.compiled(method, max_new_tokens, eos_ids)
    state = programs.loop(graph, params, tokens, lengths, jax.random.key(seed), _heads(programs, method, graph, params))
    rounds, emitted = np.asarray(state.rounds), np.asarray(state.emitted)
    accepted = float(emitted.sum() / max(rounds.sum(), 1)) if method.name != "ar" else 1.0
    return Generation(_tokens(state, eos_ids, max_new_tokens), accepted, rounds, emitted)


def speculative_stream(target: Transformer, prompt, *, draft=None, method: str = "speculative",
                       gamma: int = 4, bins: Sequence[int] = DEFAULT_BINS, max_new_tokens: int,
                       temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                       eos_ids: Sequence[int] = (), lookup: str = "", lookup_tokens: int = 0,
                       runner_up: bool = False) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
    """``speculative_generate`` one jitted round at a time, for streaming: yields
    ``(new_tokens, accepted)`` after the prefill and after every round, ``new_tokens`` a
    list (per sequence) of the int32 tokens it just produced (empty once done), and
    ``accepted [B]`` the tokens per round so far (mean, bonus token included). The
    round is compiled (and run once, discarded) before the first yield, so time taken
    between yields is decoding alone: one round's program and one transfer of what the
    host reads (the tokens, counts and flags, fetched together), as the one-jit loop of
    ``speculative_generate`` runs the same program without the transfers."""
    method, tokens, lengths, graph, params = _setup(target, prompt, draft, method, gamma, bins,
                                                    temperature, top_p, max_new_tokens, lookup, lookup_tokens,
                                                    runner_up)
    eos_ids = _eos(eos_ids)
    programs = speculative.compiled(method, max_new_tokens, eos_ids)
    state = programs.prefill(graph, params, tokens, lengths, jax.random.key(seed))
    heads = _heads(programs, method, graph, params)  # the loop's
    round_ = lambda state: programs.round(graph, params, state, heads)  # noqa: E731
    jax.block_until_ready(round_(state))  # compile before the first yield
    shown = np.zeros(tokens.shape[0], int)
    while True:
        host = jax.device_get(dataclasses.replace(state, target_cache=None, draft_cache=None, key=None,
                                                  features=None, history=None))
        rows = _tokens(host, eos_ids, max_new_tokens)
        new = [row[s:] for row, s in zip(rows, shown)]
        shown = np.asarray([len(r) for r in rows])
        rounds = np.maximum(host.rounds, 1)
        yield new, host.emitted / rounds if method.name != "ar" else np.ones(len(rows))
        if bool(host.done.all()):
            return
        state = round_(state)
