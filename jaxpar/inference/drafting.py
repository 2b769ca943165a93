"""The draft's side of a speculative round, whatever the round: its cache, its pass over
the prompt and its forward continuing its cache. A GliDe draft (``jaxpar.models.glide``)
also reads the target's cached keys/values of the layers it was trained against
(``check_glide_target``) and, with ``features``, the target's features; an independent
draft is a ``Transformer`` of its own. ``jaxpar.inference.speculative`` runs the rounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.models.config import TARGET, ModelConfig
from jaxpar.models.glide import GlideDraft
from jaxpar.models.transformer import KVCache, Transformer, init_cache


# The target settings a GliDe draft's weights depend on: its cross-attention reads the
# target's cached keys/values (heads, head size, RoPE) of fixed layers.
GLIDE_TARGET_KEYS = ModelConfig.fields_tagged(TARGET)


def check_glide_target(draft: GlideDraft, target: Transformer) -> None:
    """A GliDe draft runs only with the target layout it was trained against."""
    diffs = [f"{k} {getattr(draft.cfg, k)!r} vs {getattr(target.cfg, k)!r}"
             for k in GLIDE_TARGET_KEYS if getattr(draft.cfg, k) != getattr(target.cfg, k)]
    if diffs:
        raise ValueError("the GliDe draft was trained for a target with another head layout "
                         f"(draft's target vs this target: {'; '.join(diffs)})")


def _target_layers(draft: GlideDraft, cache: KVCache) -> tuple[jax.Array, jax.Array]:
    layers = draft.target_layers()
    return cache.k[layers.start:layers.stop], cache.v[layers.start:layers.stop]


def reads_features(draft) -> bool:
    """Whether ``draft`` is a GliDe draft that reads the target's features."""
    return isinstance(draft, GlideDraft) and draft.features


def features_at(features: jax.Array, index: jax.Array) -> jax.Array:
    """``features [B, T, D]`` at ``index [B, k]`` -> ``[B, k, D]``, zeros where ``index < 0``."""
    picked = jnp.take_along_axis(features, jnp.maximum(index, 0)[..., None], axis=1)
    return jnp.where((index >= 0)[..., None], picked, 0).astype(features.dtype)


def _cross_mask(positions: jax.Array, target_lengths: jax.Array, S: int) -> jax.Array:
    """bool ``[B, T, S]``: a GliDe query at position ``p`` (``positions [B, T]``) sees the
    target's keys ``<= p`` of the first ``target_lengths [B]`` (those verified): the first,
    causal block of its training mask over a prompt or a window, and every verified key
    for ``last`` and its proposals."""
    keys = jnp.arange(S, dtype=jnp.int32)[None, None, :]
    return (keys <= positions[:, :, None]) & (keys < target_lengths[:, None, None])


def draft_cache(draft, batch: int, max_length: int) -> KVCache:
    if isinstance(draft, GlideDraft):
        return draft.init_cache(batch, max_length)
    return init_cache(draft.cfg, batch, max_length)


def draft_prefill(draft, target: Transformer, prompt: jax.Array, lengths: jax.Array,
                  cache: KVCache, target_cache: KVCache, features: jax.Array | None = None) -> KVCache:
    """Runs the draft over the prompt ``[B, P]`` (the target's cache already holds it; a
    GliDe query at ``t`` sees the target's keys ``<= t``, the first, causal block of its
    training mask, and reads the target's feature at ``t - 1`` of ``features [B, P, D]``,
    which a draft that reads features needs)."""
    if not isinstance(draft, GlideDraft):
        return draft(prompt, cache=cache)[1]
    B, P = prompt.shape
    k, v = _target_layers(draft, target_cache)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    mask = _cross_mask(positions, lengths, k.shape[2])
    if draft.features:
        features = features_at(features, positions - 1)
    return draft(prompt, target, k, v, mask, positions=positions, cache=cache, features=features)[1]


def draft_forward(draft, target: Transformer, tokens: jax.Array, cache: KVCache,
                  target_cache: KVCache, head: jax.Array | None = None,
                  features: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """The draft over ``tokens [B, T]`` continuing its cache: ``(logits [B, T, V], cache)``.
    A GliDe draft's queries see the target's verified tokens (``target_cache.lengths``);
    ``head``: its ``GlideDraft.head(target)`` computed once for many steps, or None;
    ``features``: ``[B, T, D]``, the target's feature each token reads (a GliDe draft
    that reads them, and only there).

    A draft over a restricted vocabulary (``GlideDraft.vocab``) gets -inf logits outside
    it: it proposes only its tokens (as full-vocabulary ids), and its sampling
    distribution ``q`` is zero elsewhere, which the speculative-sampling rule takes as it
    is (``q(d) > 0`` for every proposal ``d``, and the residual ``max(0, p - q)`` is
    ``p`` outside), so decoding stays lossless."""
    if not isinstance(draft, GlideDraft):
        return draft(tokens, cache=cache)
    k, v = _target_layers(draft, target_cache)
    T = tokens.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)
    mask = _cross_mask(positions, target_cache.lengths, k.shape[2])
    logits, cache = draft(tokens, target, k, v, mask, positions=positions, cache=cache, head=head,
                          features=features)
    return (logits if draft.vocab is None else draft.vocab.full_logits(logits)), cache
