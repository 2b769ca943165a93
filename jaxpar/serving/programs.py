"""The engine's compiled programs, one call each per engine step part.

``step`` runs the model once over the step's flat token batch (``Batch``: decode tokens
and prompt chunks of any sequences, each token with its sequence and position, the page
tables as metadata: ``jaxpar.serving.pages.RaggedCache``) and samples a token for each
of its sampling rows: every decoding sequence and every prompt whose last chunk ran.
With a draft the same program runs the draft over the batch too (its pages follow the
model's; a prompt's tokens are never sampled from the draft), and ``round_step`` runs
one speculative round (``speculative``, ``glide`` or ``cape``:
``jaxpar.inference.speculative.speculate``, the dense decoder's own round, over the
pages: ``PagedCache``) for ``B`` decoding sequences.

Shapes: ``step``'s depend on the batch's token count alone (its bucket) and
``round_step``'s on its rows alone, whatever the sequences' lengths: attention reads
each sequence's own pages up to its length (``jaxpar.serving.pages.attention``). The
vocabulary projection and sampling run over the step's sampling rows only: a
``lax.switch`` over a few row counts (``sample_rows``) picks the least that holds them,
so a prefill step of 256 tokens and one sampling row projects one row's logits, not
256, and a loop samples ``SAMPLE_CHUNK`` rows at a time up to the rows there are.

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
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.inference.drafting import as_draft
from jaxpar.inference.sampling import Rows
from jaxpar.inference.speculative import Method, speculate
from jaxpar.placement.execution import use_execution
from jaxpar.serving.pages import KVPages, PagedCache, RaggedCache


TOP_LOGPROBS = 20  # OpenAI's most top_logprobs
SAMPLE_CHUNK = 8  # rows a step's sampling loop takes at a time


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's flat token batch (``jaxpar.serving.pages.RaggedCache``'s fields):
    ``tokens``, ``positions``, ``seq`` int32 ``[T]`` (each token's sequence, a row of
    ``tables``; ``-1``: padding), ``tables`` int32 ``[S, W]`` (the step's sequences' page
    tables, the context's whole width); ``sample_at`` int32 ``[R]``: the token whose
    logits each sampling row reads (its sequence's last in the batch), ``samples``
    int32 ``[]``: how many of the ``R`` rows are real."""

    tokens: jax.Array
    positions: jax.Array
    seq: jax.Array
    tables: jax.Array
    sample_at: jax.Array
    samples: jax.Array


def sample_rows(rows: int) -> tuple[int, ...]:
    """The row counts ``step``'s sampling switch compiles for ``rows`` sampling rows:
    powers of four from 4, and ``rows``."""
    return tuple(sorted({4 ** n for n in range(1, 8) if 4 ** n < rows} | {rows}))


def _sample(model, normed, sampling: Sampling, count) -> Sampled:
    """A token for each of the first ``count`` rows of ``normed [R, D]`` (final-normed
    hidden states: ``Decoded.features``), the rest zeros. The logits are projected for
    the least of ``sample_rows(R)`` rows that holds ``count`` (one branch of a
    ``lax.switch`` runs: one pass over the head's weights), and sampled
    ``SAMPLE_CHUNK`` rows at a time up to ``count`` (a loop: the sampling code, with its
    sorts of the vocabulary, compiled once and run for the rows there are)."""
    R = normed.shape[0]
    sizes = sample_rows(R)

    def project(n):
        return lambda normed: jnp.pad(model.project(normed[None, :n])[0], ((0, R - n), (0, 0)))

    branch = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), count)
    logits = jax.lax.switch(branch, [project(n) for n in sizes], normed)
    C = math.gcd(R, SAMPLE_CHUNK)

    def chunk(i, out: Sampled) -> Sampled:
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, i * C, C)  # noqa: E731
        got = _choose(rows(logits), jax.tree.map(rows, sampling))
        return jax.tree.map(lambda o, g: jax.lax.dynamic_update_slice_in_dim(o, g, i * C, 0), out, got)

    empty = Sampled(jnp.zeros(R, jnp.int32), jnp.zeros(R, jnp.float32), jnp.zeros((R, TOP_LOGPROBS), jnp.int32),
                    jnp.zeros((R, TOP_LOGPROBS), jnp.float32))
    return jax.lax.fori_loop(0, (count + C - 1) // C, chunk, empty)


def _forward(model, pages: KVPages, batch: Batch):
    """``model`` once over ``batch`` (``Transformer.decode`` over a ``RaggedCache``):
    ``(final-normed hidden states at the sampling rows [R, D], pages)``. Its logits are
    not computed (the caller projects the rows it samples)."""
    cache = RaggedCache(pages, batch.seq, batch.positions, batch.tables)
    _, cache, normed = model.decode(batch.tokens[None], cache, positions=batch.positions[None],
                                    logits_at=batch.sample_at[None])
    return normed[0], cache.pages


def _draft_prefill(draft, target, draft_pages: KVPages, target_pages: KVPages, batch: Batch):
    """The batch through the draft (``Draft.forward`` over a ``RaggedCache``): its pages
    (its tokens are never sampled: the model's are). A GliDe draft's token at position
    ``p`` cross-attends to the model's keys of its own sequence up to ``p`` (the first,
    causal block of its training mask), so ``target_pages`` must already hold the
    batch."""
    cache = lambda pages: RaggedCache(pages, batch.seq, batch.positions, batch.tables)  # noqa: E731
    return as_draft(draft).forward(target, batch.tokens[None], cache(draft_pages), cache(target_pages),
                                   positions=batch.positions[None])[1].pages


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(5, 6))
def step(graphdef, draft_graph, execution, params, draft_params, pages: KVPages, draft_pages: KVPages | None,
         batch: Batch, sampling: Sampling):
    """One engine step over ``batch``: the model (and a draft's, where ``draft_graph``
    is not None, over its own pages), a token sampled for each sampling row
    (``sampling``'s ``R`` rows; ``batch.samples`` of them real). Returns ``(Sampled
    [R], pages, draft pages)``."""
    with use_execution(execution):
        model = nnx.merge(graphdef, params)
        normed, pages = _forward(model, pages, batch)
        sampled = _sample(model, normed, sampling, batch.samples)
        if draft_graph is not None:
            draft_pages = _draft_prefill(nnx.merge(draft_graph, draft_params), model, draft_pages, pages, batch)
        return sampled, pages, draft_pages


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


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(6, 7))
def round_step(target_graph, draft_graph, execution, method: Method, target_params, draft_params,
               target_pages: KVPages, draft_pages: KVPages, window, tables, lengths, sampling: Sampling):
    """One speculative round (``_round``) for ``B`` decoding sequences: ``window [B, W]``
    their last tokens, ``tables [B, max_pages]``, ``lengths [B]`` the tokens cached
    before each one's last (a row of no sequence: the null page's table, length 0).
    Returns ``(Sampled [B, gamma + 1], accepted [B], target pages, draft pages)``."""
    with use_execution(execution):
        target, draft = nnx.merge(target_graph, target_params), nnx.merge(draft_graph, draft_params)
        return _round(target, draft, method, target_pages, draft_pages, window, tables, lengths, sampling)
