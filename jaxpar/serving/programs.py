"""The engine's compiled programs: one per engine step. ``step`` runs the model once over
the step's row (``B`` decode rows of one token each, then a packed row of prompt chunks:
``jaxpar.serving.pages.StepView``) and samples a token for every decode row and every
prompt whose last chunk ran. With a draft, ``speculative_step`` runs one speculative
round (``speculative``, ``glide`` or ``cape``) for the decode rows and the packed
prompt chunks through the model and the draft, in the same program.

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

from jaxpar.inference.sampling import probabilities, sample
from jaxpar.inference import token_tree
from jaxpar.inference.speculative import Method
from jaxpar.inference.verification import accept_greedy, accept_sampled
from jaxpar.placement.execution import use_execution
from jaxpar.models.glide import GlideDraft
from jaxpar.serving.pages import DecodeView, KVPages, PrefillView, StepView, gather, move, packed_mask, side_by_side


def _layers(layers, x, positions, pages: KVPages, view, cross=None):
    """``(x, pages)``: ``layers`` (stacked, scanned) over the residual stream ``x [R, T,
    D]`` at ``positions [R, T]``, layer ``i``'s attention reading and writing the pages
    through ``view(k, v, i)`` (a ``DecodeView`` or ``PrefillView`` with its other fields
    bound) and, for a GliDe draft's layers, cross-attending to ``cross(i)``: ``(keys,
    values, mask)``. The pages ride in the scan's carry, whole, so each layer's writes
    land in place."""
    graphdef, layer_state = nnx.split(layers)

    def layer(carry, xs):
        x, k, v = carry
        state, i = xs
        extra = () if cross is None else cross(i)
        x, (k, v) = nnx.merge(graphdef, state)(x, positions, None, *extra, view(k, v, i))
        return (x, k, v), None

    count = jax.tree.leaves(layer_state)[0].shape[0]
    (x, k, v), _ = jax.lax.scan(layer, (x, pages.k, pages.v), (layer_state, jnp.arange(count)))
    return x, KVPages(k, v)


def _features(model, tokens, positions, pages: KVPages, view):
    """``model``'s embedding and layers over ``tokens [R, T]``: ``(x, pages)``, ``x`` the
    residual stream after the last layer (``_layers``)."""
    return _layers(model.layers, model.embed_tokens(tokens, positions), positions, pages, view)


TOP_LOGPROBS = 20  # OpenAI's most top_logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each of ``R`` rows samples: ``seeds`` uint32, ``counts`` int32 (tokens the
    request has generated), ``temperature``, ``top_p`` float32 ``[R]``; ``bias`` float32
    ``[R, V]`` added to the logits before sampling; ``logprobs`` bool ``[R]``: the row
    wants its logprobs."""

    seeds: jax.Array
    counts: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    bias: jax.Array
    logprobs: jax.Array

    def rows(self, start: int, stop: int) -> "Sampling":
        return jax.tree.map(lambda x: x[start:stop], self)


class Sampled(NamedTuple):
    """Per row: the sampled ``tokens [R]``, its ``logprob [R]`` and the ``TOP_LOGPROBS``
    most likely tokens, ``top_ids``, ``top_logprobs [R, TOP_LOGPROBS]`` (zeros unless a
    row of the step asked)."""

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _choose(logits, sampling: Sampling) -> Sampled:
    """A token per row of ``logits [R, V]`` (``sampling``'s rows), with its logprobs."""
    tokens = _sample(logits + sampling.bias, _keys(sampling.seeds, sampling.counts), sampling.temperature,
                     sampling.top_p)
    R = logits.shape[0]

    def logprobs():
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        top, ids = jax.lax.top_k(lp, TOP_LOGPROBS)
        return jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0], ids.astype(jnp.int32), top

    none = lambda: (jnp.zeros(R, jnp.float32), jnp.zeros((R, TOP_LOGPROBS), jnp.int32),  # noqa: E731
                    jnp.zeros((R, TOP_LOGPROBS), jnp.float32))
    return Sampled(tokens, *jax.lax.cond(jnp.any(sampling.logprobs), logprobs, none))


def _keys(seeds, counts):
    """Each row's key for this step: ``fold_in(key(seeds[r]), counts[r])``, the request's
    seed and the tokens it has generated."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counts)


def _sample(logits, keys, temperature, top_p):
    """One token per row of ``logits [R, V]``, row ``r`` with its own key, temperature and
    top_p. When no row samples the nucleus (two sorts of the vocabulary per row) is not
    computed: greedy rows take the argmax either way."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = lambda: jax.vmap(lambda l, k, t, p: sample(l[None], k, t, p)[0])(  # noqa: E731
        logits, keys, temperature, top_p)
    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)


def _extend(model, pages: KVPages, tokens, tables, lengths, depths=None, tree_mask=None):
    """``model`` over ``tokens [B, T]`` continuing each slot's cached ``lengths [B]``
    tokens (``tables [B, max_pages]``): ``(logits [B, T, V], pages)``. The new tokens
    are written at positions ``lengths + 0..T-1``; a token tree's (``tree_mask [B, T,
    T]``) sit at ``lengths + depths [T]`` for their rotary positions."""
    offsets = jnp.arange(tokens.shape[1], dtype=jnp.int32) if depths is None else jnp.asarray(depths)
    view = functools.partial(DecodeView, tables=tables, lengths=lengths, tree_mask=tree_mask)
    x, pages = _features(model, tokens, lengths[:, None] + offsets, pages, view)
    return model.logits(x), pages


def _cross(draft: GlideDraft, target_pages: KVPages, tables, mask, flat: bool):
    """A GliDe draft's cross-attention inputs, ``i -> (keys, values, mask)``: its layer
    ``i`` reads target layer ``draft.target_layers()[i]``'s pages through ``tables [R,
    max_pages]`` (``[R, S, K, H]``; ``flat``: the rows side by side, ``[1, R * S, K,
    H]``, for a packed row), where ``mask`` lets it."""
    first = draft.target_layers().start

    def read(pages, i):
        rows = gather(pages, first + i, tables)
        return side_by_side(rows) if flat else rows

    return lambda i: (read(target_pages.k, i), read(target_pages.v, i), mask)


def _draft_extend(draft, target, draft_pages: KVPages, target_pages: KVPages, tokens, tables, lengths, verified,
                  head=None):
    """The draft over ``tokens [B, T]`` continuing its cached ``lengths [B]``: ``(logits
    [B, T, V], draft pages)``. A GliDe draft's queries see the target's first
    ``verified [B]`` positions, the tokens it has verified (as
    ``jaxpar.inference.drafting.draft_forward`` gives them the target cache's
    lengths); over a restricted vocabulary its logits are -inf outside it, as there.
    ``head``: a GliDe draft's ``head(target)``, computed once for a round's steps."""
    if not isinstance(draft, GlideDraft):
        return _extend(draft, draft_pages, tokens, tables, lengths)
    B, T = tokens.shape
    positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)
    S = tables.shape[1] * target_pages.k.shape[2]
    mask = jnp.broadcast_to(jnp.arange(S)[None, None, :] < verified[:, None, None], (B, T, S))
    view = functools.partial(DecodeView, tables=tables, lengths=lengths)
    x, draft_pages = _layers(draft.layers, target.embed_tokens(tokens, positions), positions, draft_pages, view,
                             _cross(draft, target_pages, tables, mask, flat=False))
    logits = draft.logits(x, target, head)
    # a restricted vocabulary's proposals as full-vocabulary ids, q zero outside it
    return (logits if draft.vocab is None else draft.vocab.full_logits(logits)), draft_pages


def _verify_chain(target, target_pages, last, drafts, draft_logits, tables, lengths, temperature, top_p, key):
    """The model over ``[last, d_1..d_gamma]``, each row accepting its prefix: ``(accepted
    [B], next [B], target pages)``."""
    target_logits, target_pages = _extend(target, target_pages, jnp.concatenate([last[:, None], drafts], 1),
                                          tables, lengths)
    accepted, nxt = _accept(drafts, draft_logits, target_logits, temperature, top_p, key,
                            accept_greedy(drafts, target_logits))
    return accepted, nxt, target_pages


def _accept(drafts, draft_logits, target_logits, temperature, top_p, key, greedy):
    """``greedy`` (``(accepted, next)`` ``[B]`` each) where a row is greedy, the
    speculative-sampling rule over the chain's logits (``target_logits [B, gamma + 1,
    V]``) where it samples."""
    def sampled():
        t, p = temperature[:, None, None], top_p[:, None, None]  # per row, over [B, depth, V]
        draft_probs, target_probs = probabilities(draft_logits, t, p), probabilities(target_logits, t, p)
        one = lambda d, q, p, k: jax.tree.map(lambda x: x[0], accept_sampled(d[None], q[None], p[None], k))  # noqa: E731
        drawn = jax.vmap(one)(drafts, draft_probs, target_probs, key)
        return tuple(jnp.where(temperature > 0, s, g) for s, g in zip(drawn, greedy))

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)


def _verify_tree(method: Method, target, target_pages, last, drafts, draft_logits, tables, lengths, temperature,
                 top_p, key):
    """CaPE (``jaxpar.inference.verification.verify_tree``, over pages): the draft's chain
    widened by its confidence into ``method.tree``, verified in one pass of the model
    with the tree's mask, its nodes written at positions ``lengths + node``; greedy rows
    walk the tree, sampling rows take the chain (its nodes see what the chain alone
    would) by the speculative-sampling rule; the accepted path's entries are then moved
    to ``lengths + depth``. ``(path tokens [B, gamma], accepted [B], next [B], target
    pages)``."""
    layout = method.tree
    B = drafts.shape[0]
    confidence = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1).max(-1)  # [B, gamma]
    top = jax.lax.top_k(draft_logits, layout.width)[1].at[:, :, 0].set(drafts)
    tokens = layout.tokens(last, top)
    tree_mask = jnp.broadcast_to(jnp.asarray(layout.mask), (B, layout.size, layout.size))
    logits, target_pages = _extend(target, target_pages, tokens, tables, lengths, layout.depths, tree_mask)
    valid = layout.valid(token_tree.widths(confidence, method.bins))
    path, accepted, nxt = token_tree.verify_greedy(layout, tokens, valid, jnp.argmax(logits, -1).astype(jnp.int32))
    chain = jnp.asarray([0] + [layout.node(i, 0) for i in range(1, method.gamma + 1)], jnp.int32)
    accepted, nxt = _accept(drafts, draft_logits, logits[:, chain], temperature, top_p, key, (accepted, nxt))
    path = jnp.where((temperature > 0)[:, None], chain[None, :], path)
    sources, targets = lengths[:, None] + path[:, 1:], lengths[:, None] + jnp.arange(1, method.gamma + 1)
    target_pages = KVPages(*(move(pages, tables, sources, targets) for pages in (target_pages.k, target_pages.v)))
    return jnp.take_along_axis(tokens, path[:, 1:], axis=1), accepted, nxt, target_pages




def _packed_view(packed):
    """``StepView``'s packed fields from ``packed``: ``(tokens, positions, index, tables,
    last)`` or None."""
    if packed is None:
        return dict(tables=None, index=None, positions=None)
    _, positions, index, tables, _ = packed
    return dict(tables=tables, index=index, positions=positions)


def _forward(model, pages: KVPages, decode, packed):
    """``model`` once over the step's row: ``decode = (tokens, tables, lengths)`` (``[B]``,
    ``[B, max_pages]``, ``[B]``: each row's token, written at position ``lengths[b]``)
    and ``packed = (tokens, positions, index, tables, last)`` (``PrefillView``'s row of
    ``C`` tokens over ``G`` sequences, ``last [G]`` where each sequence's last token
    is), either None. ``(logits [B + G, V], pages)``: each decode row's, then each
    packed sequence's at its last token."""
    tokens, positions, rows, B = [], [], [], 0
    view = dict(decode_tables=None, decode_lengths=None) | _packed_view(packed)
    if decode is not None:
        d_tokens, d_tables, d_lengths = decode
        B = d_tokens.shape[0]
        tokens, positions, rows = [d_tokens], [d_lengths], [jnp.arange(B)]
        view |= dict(decode_tables=d_tables, decode_lengths=d_lengths)
    if packed is not None:
        p_tokens, p_positions, _, _, last = packed
        tokens, positions, rows = tokens + [p_tokens], positions + [p_positions], rows + [B + last]
    tokens, positions = jnp.concatenate(tokens)[None], jnp.concatenate(positions)[None]
    x, pages = _features(model, tokens, positions, pages, functools.partial(StepView, **view))
    return model.logits(x[0, jnp.concatenate(rows)][None])[0], pages


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def step(graphdef, execution, params, pages: KVPages, decode, packed, sampling: Sampling):
    """One engine step: the model over ``decode`` and ``packed`` (``_forward``), a token
    sampled for each of their ``B + G`` rows (``sampling``'s). Returns ``(Sampled,
    pages)``; a packed sequence whose tokens go on in a later step ignores its row."""
    with use_execution(execution):
        logits, pages = _forward(nnx.merge(graphdef, params), pages, decode, packed)
        return _choose(logits, sampling), pages


def _round(target, draft, method: Method, target_pages: KVPages, draft_pages: KVPages, prev, last, tables,
           lengths, sampling: Sampling):
    """One round of speculative decoding for every row (``method``: its name and
    ``gamma``; ``bins`` for ``cape``; the temperature and top_p are the rows'): the
    draft proposes ``gamma`` tokens, the model verifies them in one pass, each row
    accepts its own prefix (``jaxpar.inference.speculative``'s rules: exact match when
    greedy, the speculative-sampling rule otherwise, so the output follows the model's
    distribution; ``cape``: a token tree where the draft is unsure, for its greedy
    rows).

    ``last``, ``lengths`` ``[B]``: each row's last token and its position (the tokens
    cached before it); ``prev`` ``[B]``: the token before ``last``, fed again with it
    to the draft, whose cache runs one token behind (a fully accepted round, or a tree's
    accepted sibling, leaves its last token unwritten there). Both models' pages share
    the page tables. Keys: the row's ``fold_in(key(seed), count)``, folded again with
    the draft step (0 .. gamma - 1) and with ``gamma`` for the acceptance.

    Returns ``(emitted [B, gamma + 1], accepted [B], target pages, draft pages)``: a
    row emits ``emitted[b, :accepted[b] + 1]``.
    """
    gamma = method.gamma
    keys = _keys(sampling.seeds, sampling.counts)
    temperature, top_p = sampling.temperature, sampling.top_p
    key_at = lambda i: jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)  # noqa: E731
    choose = lambda logits, i: _sample(logits, key_at(i), temperature, top_p)  # noqa: E731
    head = draft.head(target) if isinstance(draft, GlideDraft) else None  # once a round

    def draft_step(tokens, pages, at):
        return _draft_extend(draft, target, pages, target_pages, tokens, tables, at, lengths, head)

    logits, draft_pages = draft_step(jnp.stack([prev, last], 1), draft_pages, lengths - 1)
    proposals, proposal_logits = [choose(logits[:, -1], 0)], [logits[:, -1]]
    for i in range(1, gamma):
        logits, draft_pages = draft_step(proposals[-1][:, None], draft_pages, lengths + i)
        proposals.append(choose(logits[:, 0], i))
        proposal_logits.append(logits[:, 0])
    drafts, draft_logits = jnp.stack(proposals, 1), jnp.stack(proposal_logits, 1)
    args = (target, target_pages, last, drafts, draft_logits, tables, lengths, temperature, top_p, key_at(gamma))
    if method.name == "cape":
        drafts, accepted, nxt, target_pages = _verify_tree(method, *args)
    else:
        accepted, nxt, target_pages = _verify_chain(*args)
    slot = jnp.arange(gamma + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], 1)
    emitted = jnp.where(slot < accepted[:, None], padded, nxt[:, None])
    return emitted, accepted, target_pages, draft_pages


def _draft_prefill(draft, target, draft_pages: KVPages, target_pages: KVPages, packed):
    """The packed row through the draft: its pages (its tokens are never sampled: the
    model's are). A GliDe draft's token at position ``p`` cross-attends to the model's
    keys of its own sequence up to ``p`` (the first, causal block of its training mask),
    so ``target_pages`` must already hold the row."""
    tokens, positions, index, tables, _ = packed
    view = functools.partial(PrefillView, tables=tables, index=index, positions=positions)
    if not isinstance(draft, GlideDraft):
        return _features(draft, tokens[None], positions[None], draft_pages, view)[1]
    G, S = tables.shape[0], tables.shape[1] * target_pages.k.shape[2]
    mask = packed_mask(index, positions, G, S)[None]
    x = target.embed_tokens(tokens[None], positions[None])
    return _layers(draft.layers, x, positions[None], draft_pages, view,
                   _cross(draft, target_pages, tables, mask, flat=True))[1]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(6, 7))
def speculative_step(target_graph, draft_graph, execution, method: Method, target_params, draft_params,
                     target_pages: KVPages, draft_pages: KVPages, rounds, packed, sampling: Sampling):
    """One engine step with a draft: a speculative round (``_round``) for the rows of
    ``rounds = (prev, last, tables, lengths)`` (``[B]`` each but the tables; None when
    none), and the ``packed`` prompt chunks (``_forward``'s, or None) through the model
    (a token sampled for each of their ``G`` sequences) and then the draft. ``sampling``
    has the ``B`` rounds' rows, then the ``G`` packed ones.

    Returns ``(emitted [B, gamma + 1], accepted [B], Sampled [G], target pages, draft
    pages)`` (``emitted``, ``accepted`` None without rounds, ``Sampled`` None without
    a packed row)."""
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
