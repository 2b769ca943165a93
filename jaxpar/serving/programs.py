"""The engine's two compiled programs: a decode step over every batch slot and a packed
prefill, each a model forward over the paged KV cache, with sampling.

Shapes are fixed per engine (batch slots ``B``, pages per sequence ``max_pages``, the
page pool) and the prefill row is bucketed (``C`` in ``prefill_buckets``), so a run
compiles one decode program and one prefill program per bucket, whatever its requests.

``execution`` (static) is the ``jaxpar.Execution`` the model traces under: with a mesh,
the rules its activations follow (tensor-parallel serving splits the weights and the
pages' kv heads as training splits them); the engine calls them under ``jax.set_mesh``.

Sampling is per sequence: ``temperature``, ``top_p`` and a key folded from the request's
own seed and the count of tokens it has generated, so a request's tokens depend on its
seed alone, not on what else is in the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.inference.sampling import sample
from jaxpar.placement.execution import use_execution
from jaxpar.serving.pages import DecodeView, KVPages, PrefillView


def _features(model, tokens, positions, view_of):
    """The residual stream after the last layer and the updated pages: ``model``'s
    embedding and stacked layers over ``tokens [R, T]`` at ``positions [R, T]``, each
    layer's attention reading and writing its pages through ``view_of(k, v)``."""
    x = model.embed_tokens(tokens, positions)
    graphdef, layer_state = nnx.split(model.layers)

    def layer(x, xs):
        state, k, v = xs
        return nnx.merge(graphdef, state)(x, positions, None, view_of(k, v))

    return jax.lax.scan(layer, x, (layer_state, *view_of.pages))


class _Pages:
    """``view_of``: a view class bound to its arguments, over one layer's pages."""

    def __init__(self, pages: KVPages, view, **fields):
        self.pages, self._view, self._fields = (pages.k, pages.v), view, fields

    def __call__(self, k, v):
        return self._view(k, v, **self._fields)


def _sample(logits, seeds, counts, temperature, top_p):
    """One token per row of ``logits [R, V]``, row ``r`` with its own key
    ``fold_in(key(seeds[r]), counts[r])``, temperature and top_p."""
    def one(logits, seed, count, temperature, top_p):
        key = jax.random.fold_in(jax.random.key(seed), count)
        return sample(logits[None], key, temperature, top_p)[0]

    return jax.vmap(one)(logits, seeds, counts, temperature, top_p)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def decode(graphdef, execution, params, pages: KVPages, tokens, tables, lengths, sampling):
    """One token for every batch slot.

    ``tokens``, ``lengths`` int32 ``[B]``: each slot's last token and the tokens its
    sequence has cached (the new token goes to position ``lengths[b]``); ``tables``
    int32 ``[B, max_pages]``; ``sampling``: ``(seeds, counts, temperature, top_p)``,
    each ``[B]``. Returns ``(next tokens [B], pages)``."""
    with use_execution(execution):
        model = nnx.merge(graphdef, params)
        view_of = _Pages(pages, DecodeView, tables=tables, lengths=lengths)
        x, (k, v) = _features(model, tokens[:, None], lengths[:, None], view_of)
        logits = model.logits(x)[:, 0]
        return _sample(logits, *sampling), KVPages(k, v)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def prefill(graphdef, execution, params, pages: KVPages, tokens, positions, index, tables, last, sampling):
    """A packed row of prompt tokens from up to ``G`` sequences, written to their pages,
    and a token sampled after each sequence's last token in the row.

    ``tokens``, ``positions``, ``index`` int32 ``[C]``: the row (``index``: the token's
    sequence in ``tables [G, max_pages]``, -1 past the row's tokens); ``last`` int32
    ``[G]``: where in the row each sequence's last token is; ``sampling`` ``[G]`` each.
    Returns ``(tokens [G], pages)``; a sequence whose prompt goes on in a later chunk
    ignores its token."""
    with use_execution(execution):
        model = nnx.merge(graphdef, params)
        view_of = _Pages(pages, PrefillView, tables=tables, index=index, positions=positions)
        x, (k, v) = _features(model, tokens[None], positions[None], view_of)
        logits = model.logits(x[0, last][None])[0]
        return _sample(logits, *sampling), KVPages(k, v)
