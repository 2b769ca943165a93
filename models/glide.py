"""The GliDe draft model ("GliDe with a CaPE", Du et al., ICML 2024): a small decoder
that cross-attends to the *target* model's own KV cache.

Each draft layer is ``x += self_attn(norm(x))`` over the draft's own cache, then
``x += cross_attn(norm(x))`` into the cached keys/values of one of the target's last
layers (draft layer ``i`` of ``L_d`` reads target layer ``L - L_d + i``), then
``x += mlp(norm(x))``. The token embedding and the LM head are the target's, shared and
frozen; the draft owns its layers and its final norm. The layers have the target's
widths, so the draft is built from the target's ``ModelConfig``.

Parameter layout (stacked layers lead with L_d):
  layers.attn.q, k, v, o       as the Transformer's self-attention
  layers.cross.q               [L_d, D, N, H]  (layers, embed, heads, kv)
  layers.cross.o               [L_d, N, H, D]  (layers, heads, kv, embed)
  layers.cross.q_bias, o_bias  [L_d, N, H] / [L_d, D]    with attention_bias
  layers.mlp.*                 as the Transformer's MLP
  layers.*_norm, final_norm    [L_d, D] / [D]

With ``features`` (EAGLE's input, Li et al., 2024) the draft's input at position ``t`` is
not the token embedding alone but ``e_t @ fuse[0] + feature_norm(f) @ fuse[1]``, with
``f`` the target's *feature* (its final-normed last hidden state, what its LM head
multiplies) at the last position the target has verified before ``t``'s round: ``t - 1``
when the target has run there, else the round's last verified position
(``feature_sources``). The parameters it adds:
  fuse                         [2, D, D]  (embedding / feature, embed, embed)
  feature_norm                 [D]        a norm of the draft's own
``start_from_target`` sets the fuse to ``[I, 0]`` (the draft begins as the one without)
and the norm's scale to the root mean square of the target's embedding table: SmolLM2's
features are 15 times its embeddings' size, and fed as they are they swamp the
embedding within the first steps (the held-out loss 0.4 higher at step 250 and 500).

A draft may predict over a restricted vocabulary (``DraftVocab``: the ``N`` most frequent
tokens of its training corpus, as FR-Spec and EAGLE-3 do): its head is then those ``N``
columns of the target's, its logits ``[..., N]``, and ``DraftVocab.full_logits`` puts
them back over the whole vocabulary (-inf elsewhere) for decoding, whose verification
stays over every token.

Training (``jaxpar-train glide``) feeds the target's teacher-forced keys/values of a
whole row with ``cross_block_mask``: a draft query sees the target's keys of the blocks
before its own, as at inference the target has verified the tokens before the ``gamma``
the draft proposes. Inference reads the target's cache through its ``Cache.cross``
(``jaxpar.models.cache``), whose mask ``inference_cross_mask`` is for a whole cache.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.offload import fetch
from jaxpar.ops.linear import dense
from jaxpar.models.cache import DenseCross, DenseCrossLayer, KVCache, init_cache
from jaxpar.models.config import ModelConfig
from jaxpar.models.transformer import (
    ACT_BTD,
    ACT_BTNH,
    ACT_BTV,
    MLP,
    Attention,
    Decoded,
    Norm,
    Remat,
    _param,
    _remat,
    _zeros,
    apply_rope,
    rope_frequencies,
)
from jaxpar.placement.sharding import constrain

# Masks -------------------------------------------------------------------------------


def cross_block_mask(positions: jax.Array, segment_ids: jax.Array | None, block_size: int) -> jax.Array:
    """The training cross mask, bool ``[B, T, T]``: query ``t`` sees target key ``s`` iff
    both are in one segment and ``block(s) < block(t)``, or ``block(t) == 0`` and
    ``s <= t``, where ``block(i) = positions[b, i] // block_size``.

    Positions restart at every packed document, so every document's first block is
    causal (it has no earlier context to read) and every query sees at least itself.
    Order within a document is compared by position, which there orders as the index
    does, so a row permuted along its length gets the same mask, permuted.

    Args:
      positions: int ``[B, T]`` position of each token in its document.
      segment_ids: int ``[B, T]`` document ids of packed rows, or None (one document).
      block_size: tokens per block, ``gamma + 1``.
    """
    query, key = positions[:, :, None], positions[:, None, :]
    q_block, k_block = query // block_size, key // block_size
    visible = (k_block < q_block) | ((q_block == 0) & (key <= query))
    if segment_ids is not None:
        visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return visible


def feature_sources(positions: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Where each training position's target feature comes from, as the training cross
    mask has it: ``(source [B, T] int32 row index, has [B, T] bool)``.

    A query in a document's first block reads the feature at ``t - 1`` (the target has
    run over the whole prompt); one in a later block, starting at position ``s``, the
    feature at ``s - 1``, the last position whose keys it sees (at inference, the last
    token the target verified before the round). ``has`` is False at a document's
    first token, which has no feature before it (zeros).

    Args:
      positions: int ``[B, T]`` position of each token in its document (packed rows
        restart it at each document; a document's tokens are consecutive in the row).
      block_size: tokens per block, ``gamma + 1``.
    """
    positions = jnp.asarray(positions, jnp.int32)
    first_block = positions < block_size
    source_position = jnp.where(first_block, positions - 1, positions - positions % block_size - 1)
    index = jnp.arange(positions.shape[1], dtype=jnp.int32)[None, :]
    has = source_position >= 0
    return jnp.where(has, index - (positions - source_position), 0), has


def inference_cross_mask(target_lengths: jax.Array, T: int, S: int) -> jax.Array:
    """bool ``[B, T, S]``: every draft query sees the target's first ``target_lengths[b]``
    cache slots (the tokens it has verified), int ``[B]``."""
    lengths = jnp.asarray(target_lengths, jnp.int32)
    visible = jnp.arange(S, dtype=jnp.int32)[None, None, :] < lengths[:, None, None]
    return jnp.broadcast_to(visible, (lengths.shape[0], T, S))


# The restricted vocabulary -------------------------------------------------------------


class DraftVocab:
    """The full-vocabulary ids ``[N]`` (int32, sorted, distinct) a draft predicts over.

    A static attribute of the draft (part of its graph, not of its state: it is neither
    trained nor checkpointed; the draft run keeps it in ``draft_vocab.npy``), so programs
    hold the ids as a constant and the optimizer never sees an integer leaf. Hashed once,
    by content, so jit's cache lookups stay cheap.
    """

    def __init__(self, ids, vocab_size: int):
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"a draft vocabulary must be a non-empty list of token ids, got shape {ids.shape}")
        ids = ids.astype(np.int32)
        if (np.diff(ids) <= 0).any() or ids[0] < 0 or ids[-1] >= vocab_size:
            raise ValueError(f"a draft vocabulary's ids must be sorted, distinct and below the target's "
                             f"vocabulary of {vocab_size} tokens")
        ids.flags.writeable = False
        self.ids, self.vocab_size = ids, vocab_size
        self._hash = hash((vocab_size, hashlib.sha256(ids.tobytes()).hexdigest()))

    def __len__(self) -> int:
        return len(self.ids)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return (isinstance(other, DraftVocab) and self.vocab_size == other.vocab_size
                and np.array_equal(self.ids, other.ids))

    def __repr__(self) -> str:
        return f"DraftVocab({len(self)} of {self.vocab_size} tokens)"

    def index(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Full-vocabulary ``tokens`` (int, any shape) -> ``(index, inside)``: each
        token's position among ``ids`` (0 where it is not one) and whether it is."""
        ids = jnp.asarray(self.ids)
        at = jnp.clip(jnp.searchsorted(ids, tokens), 0, len(self) - 1).astype(jnp.int32)
        inside = ids[at] == tokens
        return jnp.where(inside, at, 0), inside

    def full_logits(self, logits: jax.Array) -> jax.Array:
        """``[..., N]`` -> ``[..., V]``: the draft's logits over the whole vocabulary,
        -inf outside its ``N`` tokens (so its distribution is zero there)."""
        full = jnp.full((*logits.shape[:-1], self.vocab_size), -jnp.inf, logits.dtype)
        return full.at[..., jnp.asarray(self.ids)].set(logits)


# Modules -----------------------------------------------------------------------------


class CrossAttention(nnx.Module):
    """Attention of the draft's queries over the target's cached keys/values: only the
    query and output projections are the draft's; the keys (already rotated at their
    positions) and values are the target's, used as they are."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, N, H = cfg.dim, cfg.heads, cfg.head_dim
        self.cfg = cfg
        self.q = _param(rngs, cfg, (D, N, H), ("embed", "heads", "kv"))
        self.o = _param(rngs, cfg, (N, H, D), ("heads", "kv", "embed"))
        if cfg.attention_bias:
            self.q_bias = _zeros(rngs, cfg, (N, H), ("heads", "kv"))
            self.o_bias = _zeros(rngs, cfg, (D,), ("embed",))

    def __call__(self, x, positions, k, v, mask):
        """x ``[B, T, D]``, positions int ``[B, T]``, k/v ``[B, S, K, H]``, mask bool
        ``[B, T, S]`` -> ``[B, T, D]``."""
        return self.read(x, positions, DenseCrossLayer(k, v, mask))

    def read(self, x, positions, source):
        """x ``[B, T, D]`` over ``source`` (a ``CrossSource``'s layer: ``attend(q [B, T,
        N, H]) -> [B, T, N, H]``, the target's keys/values as it holds them) -> ``[B, T,
        D]``."""
        cfg, dtype = self.cfg, self.cfg.compute_dtype
        D, N, H = self.q.shape
        q = dense(x, self.q[...].astype(dtype).reshape(D, N * H), ("embed", "heads"))
        q = q.reshape(*x.shape[:-1], N, H)
        if cfg.attention_bias:
            q = q + self.q_bias[...].astype(dtype)
        q = constrain(q, ACT_BTNH)
        if cfg.position == "rope":
            q = apply_rope(q, positions, rope_frequencies(cfg))
        out = constrain(source.attend(q), ACT_BTNH)
        y = dense(out.reshape(*out.shape[:-2], N * H), self.o[...].astype(dtype).reshape(N * H, D),
                  ("heads", "embed"))
        if cfg.attention_bias:
            y = y + self.o_bias[...].astype(dtype)
        return constrain(y, ACT_BTD)


def _embedding_only(key, shape, dtype):
    """The fuse ``[I, 0]`` (an initializer, ``shape`` ``[2, D, D]``): the input is the
    token's embedding alone, the draft without features."""
    D = shape[-1]
    return jnp.stack([jnp.eye(D, dtype=dtype), jnp.zeros((D, D), dtype)])


class GlideLayer(nnx.Module):
    """Pre-norm block: self-attention, cross-attention into the target, MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = Norm(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.cross_norm = Norm(cfg, rngs=rngs)
        self.cross = CrossAttention(cfg, rngs=rngs)
        self.mlp_norm = Norm(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, segment_ids, cross, cache=None):
        """``cross``: this layer's ``CrossSource`` layer (the target's keys it reads)."""
        with jax.named_scope("attention"):
            attn = self.attn(self.attn_norm(x), positions, segment_ids, cache)
            attn, new_cache = attn if cache is not None else (attn, None)
            x = x + attn
        with jax.named_scope("cross_attention"):
            x = x + self.cross.read(self.cross_norm(x), positions, cross)
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.mlp_norm(x))
        x = constrain(x, ACT_BTD)
        return x if cache is None else (x, new_cache)


class GlideDraft(nnx.Module):
    """GliDe draft: L_draft decoder layers (default 1), each
    x += self_attn(norm(x)) over the draft's own cache;
    x += cross_attn(norm(x)) into the target's cached K/V of target layer L_target - L_draft + i;
    x += mlp(norm(x)); then its own final norm and the TARGET's LM head (target.head_weight()),
    or with ``vocab`` (a ``DraftVocab``) only its columns of those tokens.
    Token embedding is the target's (target.embed_tokens(tokens, positions)). Both shared
    and frozen: the draft holds no reference to the target, which each call passes.
    """

    def __init__(self, cfg: ModelConfig, layers: int = 1, *, vocab: DraftVocab | None = None,
                 features: bool = False, rngs: nnx.Rngs, remat: Remat = Remat()):
        """``cfg``: the TARGET's ``ModelConfig`` (the draft layers take its widths, norm,
        MLP, position and bias settings); ``layers``: ``L_d``, at most ``cfg.layers``;
        ``vocab``: the tokens it predicts over (None: all ``cfg.vocab_size``);
        ``features``: whether it reads the target's features (EAGLE's input); ``remat``:
        what its layers keep for the backward pass (``jaxpar.models.transformer.Remat``)."""
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= cfg.layers:
            raise ValueError(f"GliDe draft layers={layers!r} must be between 1 and the target's "
                             f"model.layers={cfg.layers}")
        if vocab is not None and vocab.vocab_size != cfg.vocab_size:
            raise ValueError(f"{vocab!r} is not over the target's vocabulary of {cfg.vocab_size} tokens")
        self.cfg, self.remat = cfg, remat
        self.num_layers = layers
        self.vocab = vocab
        self.features = features
        if features:
            self.fuse = _param(rngs, cfg, (2, cfg.dim, cfg.dim), (None, "embed", None), _embedding_only)
            self.feature_norm = Norm(cfg, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked(rngs):
            return GlideLayer(cfg, rngs=rngs)

        self.layers = stacked(rngs)
        self.final_norm = Norm(cfg, rngs=rngs)

    def start_from_target(self, target) -> None:
        """Sets the draft's layers, in place, to the target layers they read (draft layer
        ``i`` to target layer ``target_layers()[i]``): its self-attention, MLP and their
        norms as that layer's, its cross-attention's query and output projections (and
        norm) as that layer's attention's, whose keys/values it reads, and its final norm
        as the target's. ``jaxpar-train glide`` starts here (``glide.init: target``):
        the cross-attention then begins as the query of the very layer whose keys it
        reads, and on SmolLM2 the validation loss after 200 steps is 0.7 lower than from
        a random start (BENCHMARKS.md).

        ``target``: the ``Transformer`` of this draft's ``cfg`` (anything with its
        ``layers`` and ``final_norm``)."""
        if target.cfg.layers != self.cfg.layers or target.cfg.dim != self.cfg.dim:
            raise ValueError(f"the draft is for a target of {self.cfg.layers} x {self.cfg.dim}, "
                             f"not {target.cfg.layers} x {target.cfg.dim}")
        read = jnp.asarray(list(self.target_layers()))
        mine, theirs = self.layers, target.layers
        pairs = [(mine.attn_norm, theirs.attn_norm), (mine.mlp_norm, theirs.mlp_norm),
                 (mine.cross_norm, theirs.attn_norm), (mine.attn, theirs.attn),
                 (mine.mlp, theirs.mlp), (mine.cross, theirs.attn)]
        for dst, src in pairs:  # the cross-attention takes the attention's q, o (and biases)
            for name, var in vars(dst).items():
                if isinstance(var, nnx.Param):
                    var[...] = getattr(src, name)[...][read].astype(var.dtype)
        for name, var in vars(self.final_norm).items():
            if isinstance(var, nnx.Param):
                var[...] = getattr(target.final_norm, name)[...]
        if self.features:
            self.fuse[...] = _embedding_only(None, self.fuse.shape, self.fuse.dtype)
            table = target.embed[...].astype(jnp.float32)
            scale = self.feature_norm.scale
            scale[...] = jnp.full(scale.shape, jnp.sqrt(jnp.mean(table * table)), scale.dtype)

    def target_layers(self) -> range:
        """The target layers whose keys/values the draft layers read, in order."""
        return range(self.cfg.layers - self.num_layers, self.cfg.layers)

    def cache_config(self) -> ModelConfig:
        """The ``ModelConfig`` of the draft's own cache: the target's with ``L_d`` layers."""
        return dataclasses.replace(self.cfg, layers=self.num_layers)

    def init_cache(self, batch: int, max_length: int) -> KVCache:
        """An empty draft cache (``init_cache(self.cache_config(), ...)``)."""
        return init_cache(self.cache_config(), batch, max_length)

    def __call__(self, tokens: jax.Array, target, target_k: jax.Array, target_v: jax.Array,
                 cross_mask: jax.Array, *, positions: jax.Array, segment_ids: jax.Array | None = None,
                 head: jax.Array | None = None, features: jax.Array | None = None) -> jax.Array:
        """The draft over whole rows (training): logits ``[B, T, V]`` in the compute dtype
        (``[B, T, N]`` over a ``vocab`` of ``N`` tokens). ``decode`` continues a cache.

        Args:
          tokens: int ``[B, T]``.
          target: the target ``Transformer`` (or anything with its ``embed_tokens(tokens,
            positions)`` and ``head_weight()``): only its embedding and LM head are used.
          target_k, target_v: ``[L_d, B, S, K, H]``, the target's keys/values of layers
            ``target_layers()`` (keys rotated at their positions: what ``KVCache.k``
            holds), used as they are.
          cross_mask: bool ``[B, T, S]``, which target keys each draft query sees
            (``cross_block_mask`` in training; a ``Cache``'s ``cross`` at inference).
          positions: int ``[B, T]`` absolute positions.
          segment_ids: int ``[B, T]`` document ids of packed training rows (the
            self-attention's), or None.
          head: ``self.head(target)``, when the caller computed it once for many calls
            (a decoding loop's draft steps); None: computed here.
          features: ``[B, T, D]`` the target's feature each token reads (a draft with
            ``features``, and only there): zeros where there is none.
        """
        cross = DenseCross(target_k, target_v, cross_mask)
        x = self._inputs(tokens, positions, target, cross, features)
        graphdef, layer_state = nnx.split(self.layers)

        def layer(x, xs):
            state, i = xs
            state = jax.tree.map(fetch.to_device, state)  # a host-resident layer (jaxpar.offload), fetched
            return nnx.merge(graphdef, state)(x, positions, segment_ids, cross.layer(i)), None

        x = jax.lax.scan(_remat(layer, self.remat), x, (layer_state, jnp.arange(self.num_layers)))[0]
        return self.logits(x, target, head)

    def decode(self, tokens: jax.Array, target, cross, cache, *, positions: jax.Array,
               head: jax.Array | None = None, features: jax.Array | None = None) -> Decoded:
        """The draft over ``tokens [B, T]`` continuing its own ``cache`` (any ``Cache`` of
        ``cache_config()``'s layout: ``init_cache`` or pages), reading the target's keys
        through ``cross`` (a ``CrossSource``: the target cache's ``cross(target_layers(),
        positions)``, or ``DenseCross(target_k, target_v, cross_mask)``); the other
        arguments as ``__call__``'s. ``Decoded``."""
        x = self._inputs(tokens, positions, target, cross, features)
        x, cache = cache.run(self.layers, x,
                             lambda layer, x, view, i: layer(x, positions, None, cross.layer(i), view),
                             xs=jnp.arange(self.num_layers))
        return Decoded(self.logits(x, target, head), cache, self.final_norm(x))

    def _inputs(self, tokens, positions, target, cross, features) -> jax.Array:
        """The checked arguments' residual stream ``[B, T, D]``: the target's embedding,
        fused with the target's ``features`` for a draft that reads them."""
        B, T = tokens.shape
        if isinstance(cross, DenseCross):
            L_d, S = self.num_layers, cross.k.shape[2]
            for name, kv in (("target_k", cross.k), ("target_v", cross.v)):
                if kv.ndim != 5 or kv.shape[:2] != (L_d, B):
                    raise ValueError(f"{name} {kv.shape} must be [L_d={L_d}, B={B}, S, K, H]")
            if cross.mask.shape != (B, T, S):
                raise ValueError(f"cross_mask {cross.mask.shape} must be [B, T, S] = {(B, T, S)}")
        if (features is not None) != self.features:
            raise ValueError("this GliDe draft reads the target's features: pass features [B, T, D]"
                             if self.features else "this GliDe draft reads no target features")
        x = target.embed_tokens(tokens, positions)
        if self.features:
            if features.shape != x.shape:
                raise ValueError(f"features {features.shape} must be [B, T, D] = {x.shape}")
            both = jnp.concatenate([x, self.feature_norm(features.astype(x.dtype))], axis=-1)  # [B, T, 2D]
            x = constrain(both @ self.fuse[...].astype(x.dtype).reshape(2 * x.shape[-1], -1), ACT_BTD)
        return x

    def head(self, target) -> jax.Array:
        """The draft's LM head, ``[D, V]`` (``[D, N]`` over a ``vocab`` of ``N`` tokens):
        the target's, or its columns of ``vocab`` (gathered: a decoding loop computes it
        once, not at every draft step, where the gather of a tied embedding's 8,192 rows
        would cost as much again as the product)."""
        return target.head_weight(None if self.vocab is None else jnp.asarray(self.vocab.ids))

    def logits(self, x: jax.Array, target, head: jax.Array | None = None) -> jax.Array:
        """The draft's final norm and the target's LM head (``head``, else
        ``self.head(target)``): ``[B, T, D]`` -> ``[B, T, V]`` (``[B, T, N]``: its
        columns of ``vocab``)."""
        head = self.head(target) if head is None else head
        logits = dense(self.final_norm(x), head, ("embed", "vocab"))
        return constrain(logits, ACT_BTV)
