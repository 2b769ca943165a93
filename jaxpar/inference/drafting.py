"""The one draft interface: ``as_draft(model)`` turns a draft model into a ``Draft``,
whatever its kind, and the speculative round (``jaxpar.inference.speculative``), the
dense decoder and the serving engine use only that.

* ``Independent``: a ``Transformer`` of its own (a smaller model over the target's
  tokenizer): its forward continues its own cache.
* ``Glide``: a ``jaxpar.models.glide.GlideDraft``, whose layers also cross-attend to the
  target's cached keys/values of the layers it was trained against
  (``check_glide_target``) and, with ``features``, read the target's features; its
  logits over a restricted vocabulary are put back over the whole one (-inf elsewhere).

Both read the target's cache through its ``Cache`` interface (``cross``), so one draft
runs over a contiguous cache and over the engine's pages alike.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.models.config import TARGET, ModelConfig
from jaxpar.models.glide import GlideDraft
from jaxpar.models.cache import Cache, init_cache
from jaxpar.models.transformer import Transformer


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


def features_at(features: jax.Array, index: jax.Array) -> jax.Array:
    """``features [B, T, D]`` at ``index [B, k]`` -> ``[B, k, D]``, zeros where ``index < 0``."""
    picked = jnp.take_along_axis(features, jnp.maximum(index, 0)[..., None], axis=1)
    return jnp.where((index >= 0)[..., None], picked, 0).astype(features.dtype)


def _positions(tokens: jax.Array, cache: Cache, positions: jax.Array | None) -> jax.Array:
    """``positions``, or each row's next ones after its cached tokens."""
    if positions is not None:
        return positions
    return cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class Independent:
    """An independent draft model (a ``Transformer``)."""

    model: Transformer
    method = "speculative"  # the decoding method it runs by default
    reads_features = False

    def cache_config(self) -> ModelConfig:
        """The layout of its own cache (``init_cache``'s, or pages')."""
        return self.model.cfg

    def head(self, target: Transformer) -> None:
        return None

    def forward(self, target: Transformer, tokens: jax.Array, cache: Cache, target_cache: Cache, head=None,
                features=None, positions: jax.Array | None = None) -> tuple[jax.Array, Cache]:
        """The draft over ``tokens [B, T]`` continuing its ``cache``: ``(logits [B, T,
        V], cache)``; ``positions [B, T]`` default ``cache.lengths[b] + 0..T-1``."""
        logits, cache, _ = self.model.decode(tokens, cache, positions=_positions(tokens, cache, positions))
        return logits, cache


@dataclasses.dataclass(frozen=True)
class Glide:
    """A GliDe draft (``GlideDraft``)."""

    model: GlideDraft
    method = "glide"

    @property
    def reads_features(self) -> bool:
        return self.model.features

    def cache_config(self) -> ModelConfig:
        return self.model.cache_config()

    def head(self, target: Transformer) -> jax.Array:
        """Its LM head (``GlideDraft.head``), made once for a round's steps."""
        return self.model.head(target)

    def forward(self, target: Transformer, tokens: jax.Array, cache: Cache, target_cache: Cache, head=None,
                features=None, positions: jax.Array | None = None) -> tuple[jax.Array, Cache]:
        """As ``Independent.forward``; a query at position ``p`` also reads the target's
        keys up to ``p`` of those ``target_cache`` holds (``Cache.cross``: over a prompt
        the first, causal block of its training mask; in a round every verified key);
        ``head``: its ``head(target)`` made once for many steps, or None; ``features [B,
        T, D]``: the target's feature each token reads (a draft that reads them, and only
        there).

        Over a restricted vocabulary (``GlideDraft.vocab``) the logits are -inf outside
        it: it proposes only its tokens (as full-vocabulary ids), and its sampling
        distribution ``q`` is zero elsewhere, which the speculative-sampling rule takes
        as it is (``q(d) > 0`` for every proposal ``d``, and the residual ``max(0, p -
        q)`` is ``p`` outside), so decoding stays lossless."""
        positions = _positions(tokens, cache, positions)
        cross = target_cache.cross(self.model.target_layers(), positions)
        logits, cache, _ = self.model.decode(tokens, target, cross, cache, positions=positions, head=head,
                                             features=features)
        return (logits if self.model.vocab is None else self.model.vocab.full_logits(logits)), cache


Draft = Independent | Glide


def as_draft(model) -> Draft:
    """The ``Draft`` of a draft model: ``Glide`` for a ``GlideDraft``, else ``Independent``."""
    return Glide(model) if isinstance(model, GlideDraft) else Independent(model)


def draft_cache(draft: Draft, batch: int, max_length: int):
    """An empty contiguous cache for ``draft``."""
    return init_cache(draft.cache_config(), batch, max_length)
