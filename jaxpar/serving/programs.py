"""The engine's compiled programs: one per engine step. ``step`` runs the model once over
the step's row (``B`` decode rows of one token each, then a packed row of prompt chunks:
``jaxpar.serving.pages.StepView``) and samples a token for every decode row and every
prompt whose last chunk ran. With a draft, ``speculative_step`` runs one speculative
round (``speculative``, ``glide`` or ``cape``: ``jaxpar.inference.speculative.speculate``,
the dense decoder's own round, over the pages) for the decode rows and the packed prompt
chunks through the model and the draft, in the same program. The model and the draft
read and write the pages through the ``Cache`` interface (``jaxpar.serving.pages``'
``PagedCache`` and ``StepCache``), as the dense decoder's through ``KVCache``.

Shapes are bucketed by the engine (``jaxpar.serving.engine``): decode rows, packed
tokens and the pages a program reads per sequence (the page tables' width) come in a few
buckets, so a run compiles a few programs, whatever its requests.

``execution`` (static) is the ``jaxpar.Execution`` the model traces under: with a mesh,
the rules its activations follow (tensor-parallel serving splits the weights and the
pages' kv heads as training splits them); the engine calls them under ``jax.set_mesh``.

Sampling is per sequence (``Sampling``): ``temperature``, ``top_p`` and a key folded
from the request's own seed and the count of tokens it has generated, so a request's
tokens depend on its seed alone, not on what else is in the batch; an additive ``bias``
over the vocabulary carries presence/frequency penalties and a structured-output mask
(-inf where the grammar forbids), so neither changes the program. Logprobs are
``log_softmax`` of the model's own logits (before the bias and the temperature: vLLM's
default), the sampled token's and the ``TOP_LOGPROBS`` largest, computed only in steps
where some row asked.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.inference.drafting import as_draft
from jaxpar.inference.sampling import Rows
from jaxpar.inference.speculative import Method, speculate
from jaxpar.placement.execution import use_execution
from jaxpar.serving.pages import KVPages, PagedCache, StepCache


TOP_LOGPROBS = 20  # OpenAI's most top_logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each of ``R`` rows samples: ``seeds`` uint32, ``counts`` int32 (tokens the
    request has generated), ``temperature``, ``top_p`` float32 ``[R]``; ``bias`` float32
    ``[R, V]`` added to the logits before sampling; ``logprobs`` bool ``[R]``: the row
    wants its logprobs; ``biased`` bool ``[R]``: its bias changes with every token it
    takes (penalties, a schema's mask), so a speculative round gives it one token, the
    model's own after ``last`` with the bias, and none of the draft's."""

    seeds: jax.Array
    counts: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    bias: jax.Array
    logprobs: jax.Array
    biased: jax.Array

    def rows(self, start: int, stop: int) -> "Sampling":
        return jax.tree.map(lambda x: x[start:stop], self)

    def as_rows(self) -> Rows:
        """The rows as a speculative round samples them (``Rows``): each its own
        temperature, top_p and key, ``fold_in(key(seed), count)``: the request's seed and
        the tokens it has generated, so its tokens do not depend on its neighbours."""
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(self.seeds, self.counts)
        return Rows(self.temperature, self.top_p, keys)


class Sampled(NamedTuple):
    """Per row: the sampled ``tokens [R]``, its ``logprob [R]`` and the ``TOP_LOGPROBS``
    most likely tokens, ``top_ids``, ``top_logprobs [R, TOP_LOGPROBS]`` (zeros unless a
    row of the step asked); a round's rows ``[R, gamma + 1]`` and ``[R, gamma + 1,
    TOP_LOGPROBS]``, a token each slot."""

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _choose(logits, sampling: Sampling) -> Sampled:
    """A token per row of ``logits [R, V]`` (``sampling``'s rows), with its logprobs."""
    return _with_logprobs(logits, sampling.as_rows().choose(logits + sampling.bias, 0), sampling.logprobs)


def _with_logprobs(logits, tokens, wanted) -> Sampled:
    """``Sampled`` for ``tokens [R, ...]`` drawn from ``logits [R, ..., V]``: their
    logprobs and the top ones (``log_softmax`` of ``logits``), computed only where some
    row of ``wanted`` (bool ``[R]``) asked, else zeros."""
    def logprobs():
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        top, ids = jax.lax.top_k(lp, TOP_LOGPROBS)
        return jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0], ids.astype(jnp.int32), top

    none = lambda: (jnp.zeros(tokens.shape, jnp.float32), jnp.zeros((*tokens.shape, TOP_LOGPROBS), jnp.int32),  # noqa: E731
                    jnp.zeros((*tokens.shape, TOP_LOGPROBS), jnp.float32))
    return Sampled(tokens, *jax.lax.cond(jnp.any(wanted), logprobs, none))


def _forward(model, pages: KVPages, decode, packed):
    """``model`` once over the step's row (``Transformer.decode`` over a ``StepCache``):
    ``decode = (tokens, tables, lengths)`` (``[B]``, ``[B, max_pages]``, ``[B]``: each
    row's token, written at position ``lengths[b]``) and ``packed = (tokens, positions,
    index, tables, last)`` (``PrefillView``'s row of ``C`` tokens over ``G`` sequences,
    ``last [G]`` where each sequence's last token is), either None. ``(logits [B + G,
    V], pages)``: each decode row's, then each packed sequence's at its last token (the
    only ones projected onto the vocabulary)."""
    tokens, positions, rows, B = [], [], [], 0
    fields = dict(decode_tables=None, decode_lengths=None, tables=None, index=None, positions=None)
    if decode is not None:
        d_tokens, d_tables, d_lengths = decode[:3]
        B = d_tokens.shape[0]
        tokens, positions, rows = [d_tokens], [d_lengths], [jnp.arange(B)]
        fields |= dict(decode_tables=d_tables, decode_lengths=d_lengths)
    if packed is not None:
        p_tokens, p_positions, index, tables, last = packed
        tokens, positions, rows = tokens + [p_tokens], positions + [p_positions], rows + [B + last]
        fields |= dict(tables=tables, index=index, positions=p_positions)
    logits, cache, _ = model.decode(jnp.concatenate(tokens)[None], StepCache(pages, **fields),
                                    positions=jnp.concatenate(positions)[None],
                                    logits_at=jnp.concatenate(rows)[None])
    return logits[0], cache.pages


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def step(graphdef, execution, params, pages: KVPages, decode, packed, sampling: Sampling):
    """One engine step: the model over ``decode`` and ``packed`` (``_forward``), a token
    sampled for each of their ``B + G`` rows (``sampling``'s). Returns ``(Sampled,
    pages)``; a packed sequence whose tokens go on in a later step ignores its row."""
    with use_execution(execution):
        logits, pages = _forward(nnx.merge(graphdef, params), pages, decode, packed)
        return _choose(logits, sampling), pages


def _round(target, draft, method: Method, target_pages: KVPages, draft_pages: KVPages, window, tables, lengths,
           sampling: Sampling):
    """One speculative round for every row: ``jaxpar.inference.speculative.speculate``,
    the dense decoder's round, over the pages (``PagedCache``: both models' pages share
    the page tables). ``method``: its name and ``gamma`` (``bins`` for ``cape``); each
    row samples as its own ``sampling`` says (``Rows``: greedy rows by exact match,
    sampling rows by the speculative-sampling rule, so the output follows the model's
    distribution; keys the row's ``fold_in(key(seed), count)``, folded again with the
    draft step and with ``gamma`` for the acceptance).

    ``window [B, W]``: each row's last ``draft_window`` tokens ending at ``last``, from
    ``window_start(lengths, W)``; ``lengths [B]``: the tokens cached before ``last``.
    A ``biased`` row (penalties, a schema) takes no drafts: its one token is the model's
    after ``last`` with its bias (draw ``gamma + 1`` of its key), as without a draft.
    Returns ``(Sampled [B, gamma + 1], accepted [B], target pages, draft pages)``: a row
    emits ``tokens[b, :accepted[b] + 1]``, each with its logprobs (the model's
    ``log_softmax`` at its position in the verification pass, where the row asked).
    """
    rows = sampling.as_rows()
    verified, draft_cache = speculate(method, target, as_draft(draft), rows, PagedCache(target_pages, tables, lengths),
                                      PagedCache(draft_pages, tables, lengths), window)
    # a biased row: no drafts, the model's own token after last (its bias holds for one token)
    own = rows.choose(verified.logits[:, 0] + sampling.bias, method.gamma + 1)
    accepted = jnp.where(sampling.biased, 0, verified.accepted)
    nxt = jnp.where(sampling.biased, own, verified.next)
    path = verified.path_tokens[:, :method.gamma]
    slot = jnp.arange(method.gamma + 1)[None, :]
    padded = jnp.concatenate([path, jnp.zeros_like(path[:, :1])], 1)
    emitted = jnp.where(slot < accepted[:, None], padded, nxt[:, None])
    emitted = _with_logprobs(verified.logits[:, :method.gamma + 1], emitted, sampling.logprobs)
    return emitted, accepted, verified.cache.pages, draft_cache.pages


def _draft_prefill(draft, target, draft_pages: KVPages, target_pages: KVPages, packed):
    """The packed row through the draft (``Draft.forward`` over a ``StepCache``): its
    pages (its tokens are never sampled: the model's are). A GliDe draft's token at
    position ``p`` cross-attends to the model's keys of its own sequence up to ``p`` (the
    first, causal block of its training mask), so ``target_pages`` must already hold the
    row."""
    tokens, positions, index, tables, _ = packed
    row = lambda pages: StepCache(pages, None, None, tables, index, positions)  # noqa: E731
    return as_draft(draft).forward(target, tokens[None], row(draft_pages), row(target_pages),
                                   positions=positions[None])[1].pages


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(6, 7))
def speculative_step(target_graph, draft_graph, execution, method: Method, target_params, draft_params,
                     target_pages: KVPages, draft_pages: KVPages, rounds, packed, sampling: Sampling):
    """One engine step with a draft: a speculative round (``_round``) for the rows of
    ``rounds = (window, tables, lengths)`` (None when none), and the ``packed`` prompt
    chunks (``_forward``'s, or None) through the model (a token sampled for each of their
    ``G`` sequences) and then the draft. ``sampling`` has the ``B`` rounds' rows, then
    the ``G`` packed ones.

    Returns ``(emitted, accepted [B], sampled, target pages, draft pages)``:
    ``emitted`` the rounds' ``Sampled [B, gamma + 1]`` (``_round``), ``sampled`` the
    packed rows' ``Sampled [G]`` (``emitted``, ``accepted`` None without rounds,
    ``sampled`` None without a packed row)."""
    B = 0 if rounds is None else rounds[0].shape[0]
    emitted = accepted = sampled = None
    with use_execution(execution):
        target, draft = nnx.merge(target_graph, target_params), nnx.merge(draft_graph, draft_params)
        if rounds is not None:
            emitted, accepted, target_pages, draft_pages = _round(target, draft, method, target_pages, draft_pages,
                                                                  *rounds, sampling.rows(0, B))
        if packed is not None:
            logits, target_pages = _forward(target, target_pages, None, packed)
            sampled = _choose(logits, sampling.rows(B, B + packed[3].shape[0]))
            draft_pages = _draft_prefill(draft, target, draft_pages, target_pages, packed)
    return emitted, accepted, sampled, target_pages, draft_pages
