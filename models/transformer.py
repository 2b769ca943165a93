"""A decoder-only transformer in Flax NNX: the one model every parallel mode runs.

Parallelism never enters here as code: every parameter carries logical axis names
(``jaxpar.rules``), every activation that a parallel axis touches is constrained by its
logical names (``jaxpar.constrain``, a no-op without a mesh), and attention goes through
``jaxpar.dot_product_attention``. Layers are stacked on a leading ``layers`` axis and run
with ``jax.lax.scan``, so pipeline stages and remat policies apply per layer.

Parameter layout (stacked layers lead with L):
  embed                 [V, D]        (vocab, embed)
  positions             [P, D]        (positions, embed)           position="learned"
  layers.attn.q         [L, D, N, H]  (layers, embed, heads, kv)
  layers.attn.k, v      [L, D, K, H]  (layers, embed, kv_heads, kv)
  layers.attn.o         [L, N, H, D]  (layers, heads, kv, embed)
  layers.attn.q_norm, k_norm [L, H]   (layers, kv)                 qk_norm only (Qwen3)
  layers.mlp.gate, up   [L, D, F]     (layers, embed, mlp)         gate for swiglu only
  layers.mlp.down       [L, F, D]     (layers, mlp, embed)
  *_norm.scale, bias    [L, D] / [D]  (layers, norm) / (norm,)     bias for LayerNorm only
  lm_head               [D, V]        (embed, vocab)               untied embeddings only
  layers.*_bias         biases of the projections, with attention_bias / mlp_bias
  layers.moe.*          the routed experts of MoE layers (jaxpar.models.moe); layers.mlp
                        is then their shared experts (absent without any)

With ``model.moe.every = n > 1`` the stacked unit is a ``LayerGroup`` of ``n`` layers
(``n - 1`` dense, then one MoE), stacked ``L / n`` times: ``layers.dense[i].*`` and
``layers.sparse.*`` lead with ``L / n``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.offload import activations, fetch
from jaxpar.ops import kernel_ops
from jaxpar.placement import rules as rules_lib
from jaxpar.ops.attention import dot_product_attention
from jaxpar.ops.linear import dense
from jaxpar.layout import REMAT_POLICIES
from jaxpar.models.cache import Cache, CacheView
from jaxpar.models.config import CHECKPOINT_NAMES, ModelConfig, RopeScaling
from jaxpar.models.moe import Aux, MoE
from jaxpar.models.params import param as _param, zeros as _zeros, ones as _ones
from jaxpar.placement import execution as execution_lib
from jaxpar.placement.sharding import constrain

# The residual stream (norms, residual adds): its length may be split over `tensor`
# too (Megatron sequence parallelism, jaxpar.rules.SEQUENCE_PARALLEL).
ACT_BTD = ("activation_batch", "activation_norm_length", "activation_embed")
# The residual stream with its length split as attention's (over seq, not tensor): under
# Megatron sequence parallelism (activation_norm_length over seq x tensor) the inputs of
# the projections are gathered to it and their outputs go through it before the
# reduce-scatter, the same rules as without SP elsewhere. Without these, with seq > 1 XLA's
# SPMD partitioner met each weight gradient (the embed dimension over fsdp x seq) by
# replicating the [B, T, D] activation ("Involuntary full rematerialization"): `1b`,
# 2 layers, fsdp=4 seq=2 tensor=2 ring sp on 16 CPU devices moved 34.8 GB a step in
# collectives with 22.8 GB of temporaries; now 5.2 GB and 8.7 GB (2026-11-30).
ACT_BTD_WHOLE = ("activation_batch", "activation_length", "activation_embed")
ACT_BTF = ("activation_batch", "activation_length", "activation_mlp")
ACT_BTV = ("activation_batch", "activation_length", "activation_vocab")
ACT_BTNH = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
ACT_BTKH = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")


# Helpers ------------------------------------------------------------------------------


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies ``[H/2]`` of rotary embeddings, Llama-3 scaled if configured."""
    H = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    scaling: RopeScaling | None = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1 (HF `_compute_llama3_parameters`): long wavelengths are divided by
    # `factor`, short ones kept, and the band between is interpolated smoothly.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates ``x`` ``[B, T, heads, H]`` by ``positions`` ``[B, T]`` (HF's rotate-half layout)."""
    angles = positions[:, :, None, None].astype(jnp.float32) * inv_freq  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def head_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Qwen3's RMSNorm of each head of ``x [B, T, heads, H]`` over ``H`` (``model.qk_norm``):
    float32 statistics, then, as Hugging Face's ``Qwen3RMSNorm``, the normalised value cast
    back to ``x``'s dtype and multiplied by ``scale [H]`` in it."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


# Modules -----------------------------------------------------------------------------


class Norm(nnx.Module):
    """RMSNorm (Llama) or LayerNorm (GPT-2) over the last axis, computed in float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.kind, self.eps, self.dtype = cfg.norm, cfg.norm_eps, cfg.compute_dtype
        self.scale = _ones(rngs, cfg, (cfg.dim,), ("norm",))
        self.bias = _zeros(rngs, cfg, (cfg.dim,), ("norm",)) if cfg.norm == "layer" else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[B, T, D]`` -> ``[B, T, D]``; by the fused kernel under ``execution.norm`` "pallas"."""
        scale = fetch.to_device(self.scale[...])  # the final norm's may live on the host
        bias = None if self.bias is None else fetch.to_device(self.bias[...])
        fused_out = kernel_ops.norm(x, scale, bias, kind=self.kind, eps=self.eps)
        if fused_out is not None:
            return fused_out.astype(self.dtype)
        x = x.astype(jnp.float32)
        if self.kind == "layer":
            x = x - x.mean(-1, keepdims=True)
        x = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + self.eps)
        x = x * scale.astype(jnp.float32)
        if bias is not None:
            x = x + bias.astype(jnp.float32)
        return x.astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, N, K, H = cfg.dim, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q = _param(rngs, cfg, (D, N, H), ("embed", "heads", "kv"))
        self.k = _param(rngs, cfg, (D, K, H), ("embed", "kv_heads", "kv"))
        self.v = _param(rngs, cfg, (D, K, H), ("embed", "kv_heads", "kv"))
        self.o = _param(rngs, cfg, (N, H, D), ("heads", "kv", "embed"))
        if cfg.attention_bias:
            self.q_bias = _zeros(rngs, cfg, (N, H), ("heads", "kv"))
            self.k_bias = _zeros(rngs, cfg, (K, H), ("kv_heads", "kv"))
            self.v_bias = _zeros(rngs, cfg, (K, H), ("kv_heads", "kv"))
            self.o_bias = _zeros(rngs, cfg, (D,), ("embed",))
        if cfg.qk_norm:
            self.q_norm = _ones(rngs, cfg, (H,), ("kv",))
            self.k_norm = _ones(rngs, cfg, (H,), ("kv",))

    def __call__(self, x, positions, segment_ids, cache=None):
        """x ``[B, T, D]`` -> ``[B, T, D]``.

        With a ``cache`` (one layer's view of a KV cache: ``attend(q, k, v) -> (out,
        new_cache)`` stores the new keys/values and attends over what it holds; the
        contiguous ``jaxpar.models.cache.CacheView`` and ``jaxpar.serving.pages``' paged views), returns
        ``(y, new_cache)``.
        """
        cfg, dtype = self.cfg, self.cfg.compute_dtype
        x = constrain(x, ACT_BTD_WHOLE)

        def project(w, bias_name, head_axis, names):
            D, heads, H = w.shape
            kernel = w[...].astype(dtype).reshape(D, heads * H)
            y = dense(x, kernel, ("embed", head_axis)).reshape(*x.shape[:-1], heads, H)
            if cfg.attention_bias:
                y = y + getattr(self, bias_name)[...].astype(dtype)
            return constrain(y, names)

        q = project(self.q, "q_bias", "heads", ACT_BTNH)
        k = project(self.k, "k_bias", "kv_heads", ACT_BTKH)
        v = project(self.v, "v_bias", "kv_heads", ACT_BTKH)
        if cfg.qk_norm:  # every path (training, prefill, decode, paged, speculative) passes here
            q, k = head_norm(q, self.q_norm[...], cfg.norm_eps), head_norm(k, self.k_norm[...], cfg.norm_eps)
        if cfg.position == "rope":
            inv_freq = rope_frequencies(cfg)
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        q, k, v = checkpoint_name(q, "query"), checkpoint_name(k, "key"), checkpoint_name(v, "value")
        if cache is not None:
            out, cache = cache.attend(q, k, v)
        else:
            out = dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids)
        out = checkpoint_name(constrain(out, ACT_BTNH), "attention")
        N, H, D = self.o.shape
        y = dense(out.reshape(*out.shape[:-2], N * H), self.o[...].astype(dtype).reshape(N * H, D),
                  ("heads", "embed"))
        if cfg.attention_bias:
            y = y + self.o_bias[...].astype(dtype)
        y = constrain(constrain(y, ACT_BTD_WHOLE), ACT_BTD)
        return y if cache is None else (y, cache)


class MLP(nnx.Module):
    """SwiGLU (``down(silu(gate x) * up x)``) or GELU (``down(gelu(up x))``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, F = cfg.dim, cfg.mlp_dim
        self.cfg = cfg
        self.gate = _param(rngs, cfg, (D, F), ("embed", "mlp")) if cfg.mlp == "swiglu" else None
        self.up = _param(rngs, cfg, (D, F), ("embed", "mlp"))
        self.down = _param(rngs, cfg, (F, D), ("mlp", "embed"))
        if cfg.mlp_bias:
            self.gate_bias = _zeros(rngs, cfg, (F,), ("mlp",)) if cfg.mlp == "swiglu" else None
            self.up_bias = _zeros(rngs, cfg, (F,), ("mlp",))
            self.down_bias = _zeros(rngs, cfg, (D,), ("embed",))

    def __call__(self, x):
        """x ``[B, T, D]`` -> ``[B, T, D]``."""
        cfg, dtype = self.cfg, self.cfg.compute_dtype
        x = constrain(x, ACT_BTD_WHOLE)

        def project(w, bias):
            y = dense(x, w[...].astype(dtype), ("embed", "mlp"))
            if bias is not None:
                y = y + bias[...].astype(dtype)
            return constrain(y, ACT_BTF)

        up = project(self.up, self.up_bias if cfg.mlp_bias else None)
        if cfg.mlp == "swiglu":
            gate = project(self.gate, self.gate_bias if cfg.mlp_bias else None)
            hidden = jax.nn.silu(gate) * up
        else:
            hidden = jax.nn.gelu(up, approximate=True)  # GPT-2's "gelu_new"
        hidden = checkpoint_name(hidden, "mlp_hidden")
        y = dense(hidden, self.down[...].astype(dtype), ("mlp", "embed"))
        if cfg.mlp_bias:
            y = y + self.down_bias[...].astype(dtype)
        return constrain(constrain(y, ACT_BTD_WHOLE), ACT_BTD)


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; with ``moe``, the
    MLP is the routed experts plus the shared ones (``jaxpar.models.moe``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm = Norm(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = Norm(cfg, rngs=rngs)
        if moe:
            self.moe = MoE(cfg, rngs=rngs)
            shared = cfg.moe.shared_experts * cfg.moe.expert_width
            self.mlp = MLP(dataclasses.replace(cfg, mlp_dim=shared), rngs=rngs) if shared else None
        else:
            self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, segment_ids, cache=None):
        x, new_cache, _ = self.forward(x, positions, segment_ids, cache)
        return x if cache is None else (x, new_cache)

    def forward(self, x, positions, segment_ids, cache=None):
        """``(x, new_cache, aux)``: ``aux`` the MoE layer's ``jaxpar.models.moe.Aux`` (None when dense)."""
        with jax.named_scope("attention"):
            attn = self.attn(self.attn_norm(x), positions, segment_ids, cache)
            attn, new_cache = attn if cache is not None else (attn, None)
            x = x + attn
        aux = None
        with jax.named_scope("mlp"):
            h = self.mlp_norm(x)
            moe = getattr(self, "moe", None)
            if moe is None:
                x = x + self.mlp(h)
            else:
                with jax.named_scope("moe"):
                    y, aux = moe(h)
                x = x + (y if self.mlp is None else y + self.mlp(h))
        x = constrain(x, ACT_BTD)
        return x, new_cache, aux


class LayerGroup(nnx.Module):
    """``model.moe.every = n`` layers as one stacked unit: ``n - 1`` dense layers
    (``dense``), then a MoE one (``sparse``), so MoE layers are those ``l`` with ``(l +
    1) % n == 0`` and the stack is still one scan (over ``L / n`` groups)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.dense = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.moe.every - 1)])
        self.sparse = DecoderLayer(cfg, rngs=rngs, moe=True)

    def __call__(self, x, positions, segment_ids, cache=None):
        x, new_cache, _ = self.forward(x, positions, segment_ids, cache)
        return x if cache is None else (x, new_cache)

    def forward(self, x, positions, segment_ids, cache=None):
        """``DecoderLayer.forward`` over the group's layers. A ``cache`` is a view of the
        group's ``n`` layers (``Cache.run``'s), which gives layer ``j``'s own view from
        what the layers before it returned (``member(j, state)``) and the group's new
        cache from what each returned (``joined``): the contiguous cache's view holds the
        ``n`` layers' keys and values and stacks theirs (``CacheView``), a paged one
        (``jaxpar.serving.pages.PagesView``) reads and writes the pages at the group's
        first layer plus ``j``, each layer writing into the pages the one before wrote."""
        if cache is None:
            for layer in self.dense:
                x = layer(x, positions, segment_ids)
            return self.sparse.forward(x, positions, segment_ids)
        state, outputs = (cache.k, cache.v), []
        for j, layer in enumerate([*self.dense, self.sparse]):
            x, state, aux = layer.forward(x, positions, segment_ids, cache.member(j, state))
            outputs.append(state)
        return x, cache.joined(outputs), aux


@dataclasses.dataclass(frozen=True)
class Remat:
    """What a stacked layer keeps for its backward pass: ``policy`` in
    ``jaxpar.layout.REMAT_POLICIES`` (``none``: everything), ``names`` the
    ``checkpoint_name``s (``CHECKPOINT_NAMES``) ``policy="names"`` keeps. An argument of
    the model (``Transformer(cfg, remat=...)``), not part of its config: it changes the
    program, not the weights; a training run takes it from its layout (``model.remat``,
    ``model.remat_names``)."""

    policy: str = "none"
    names: tuple[str, ...] = ()

    def __post_init__(self):
        if self.policy not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.policy!r} must be one of {REMAT_POLICIES}")
        object.__setattr__(self, "names", tuple(self.names))


def _remat(fn, remat: Remat):
    """``fn(x, xs)``, one stacked layer over the residual stream ``x [B, T, D]``, under
    ``jax.checkpoint`` with the policy ``remat.policy`` names composed with the
    ``offload.activations`` of the ``Execution`` in force (``jaxpar.offload``).

    What a layer keeps for its backward pass, value by value:

    * named in ``offload.activations``: in host memory, whatever ``remat`` says (also
      when ``remat_names`` lists it);
    * otherwise as ``remat`` says: ``names`` keeps ``remat_names`` on the device,
      ``dots`` / ``dots_no_batch`` keep matmul outputs there, ``full`` nothing; the rest
      is recomputed in the backward pass;
    * ``remat="none"`` with names offloaded: the matmul outputs stay on the device (as
      under ``dots``) and the elementwise work between them is recomputed. With every
      value saved, the backward pass would read a device copy of an offloaded value (its
      reshape or cast, saved too) rather than the host one, and the offload would free
      nothing.

    ``x`` is named ``layer_input`` inside the checkpoint: offloading it leaves no
    ``[L, B, T, D]`` stack of layer inputs on the device (jax#23869: a name on the
    layer's output does not, the scan saves its carry itself).
    """
    policies = jax.checkpoint_policies
    offloaded = execution_lib.current().offload.activations
    if remat.policy == "none" and not offloaded:
        return fn
    activations.check_names(offloaded, CHECKPOINT_NAMES)
    otherwise = {
        "none": policies.checkpoint_dots,
        "full": None,
        "dots": policies.checkpoint_dots,
        "dots_no_batch": policies.dots_with_no_batch_dims_saveable,
        "names": None,
    }[remat.policy]
    saved = remat.names if remat.policy == "names" else ()
    if offloaded:
        policy = activations.policy(offloaded, saved=saved, otherwise=otherwise)
    else:  # as before offload existed: None is jax.checkpoint's own "save nothing"
        policy = policies.save_only_these_names(*saved) if remat.policy == "names" else otherwise

    def named(x, *xs):
        if isinstance(x, tuple):  # (x, aux) of a MoE model: the residual stream is named
            return fn((checkpoint_name(x[0], "layer_input"), *x[1:]), *xs)
        return fn(checkpoint_name(x, "layer_input"), *xs)

    return jax.checkpoint(named, policy=policy, prevent_cse=False)


class Decoded(NamedTuple):
    """What a forward over a cache returns (``Transformer.decode``,
    ``GlideDraft.decode``): ``logits [B, R, V]`` (``R``: every token's, or the
    ``logits_at`` chosen), the cache with the new tokens in (every length advanced by
    ``T``), and ``features [B, R, D]``, the final-normed last hidden state the logits
    were projected from (a GliDe draft's ``features`` input; unused, XLA drops it)."""

    logits: jax.Array
    cache: Cache
    features: jax.Array


def sharding_rules(cfg: ModelConfig, mesh, rules=None, *, sequence_parallel: bool = False):
    """The rules this model runs with on ``mesh``: ``rules`` (default ``DEFAULT_RULES``)
    restricted to the mesh, plus Megatron's two model-dependent choices.

    * When the key/value heads do not divide over their mesh axes (``tensor=4`` with 2
      kv heads), the k/v projections and activations are replicated across them, as
      Megatron replicates kv heads when the tensor group outnumbers them; each device
      then computes the kv heads its query heads read.
    * ``sequence_parallel``: ``jaxpar.rules.SEQUENCE_PARALLEL``.
    * With a ``seq`` axis of size > 1 the weights' model dimension (``embed``) is split
      over ``seq`` too, where it divides: the sequence-parallel group holds one copy
      of the parameters and optimizer state between them (ZeRO-3 across it, as
      MaxText's context parallelism and DeepSpeed-Ulysses do) rather than one each,
      which at long context is what leaves room for activations.

    On a 2D tensor grid (``tensor_row``/``tensor_col``) the default rules take
    ``jaxpar.rules.TENSOR_2D``, and the projections run as SUMMA (``jaxpar.ops.linear``).
    """
    if rules is None:
        rules = rules_lib.DEFAULT_RULES
        if "tensor_row" in mesh.axis_names:
            rules = rules_lib.override(rules, rules_lib.TENSOR_2D)
    resolved = rules_lib.for_mesh(mesh, rules)
    changes = dict(rules_lib.SEQUENCE_PARALLEL) if sequence_parallel else {}
    embed = rules_lib.as_tuple(dict(resolved).get("embed"))
    if mesh.shape.get("seq", 1) > 1 and "seq" not in embed:
        with_seq = (*embed, "seq")
        if cfg.dim % math.prod(mesh.shape[a] for a in with_seq) == 0:
            changes["embed"] = with_seq
    for name in ("kv_heads", "activation_kv_heads"):
        axes = dict(resolved).get(name)
        ways = math.prod(mesh.shape[a] for a in rules_lib.as_tuple(axes))
        if cfg.kv_heads % ways:
            changes[name] = None
    return rules_lib.for_mesh(mesh, rules_lib.override(resolved, changes))


class Transformer(nnx.Module):
    """Decoder-only language model: int32 tokens ``[B, T]`` -> logits ``[B, T, V]``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat: Remat = Remat()):
        self.cfg, self.remat = cfg, remat
        self.embed = _param(rngs, cfg, (cfg.vocab_size, cfg.dim), ("vocab", "embed"))
        if cfg.position == "learned":
            self.positions = _param(rngs, cfg, (cfg.max_position, cfg.dim), ("positions", "embed"))

        if cfg.moe is None:
            unit = DecoderLayer
        else:
            unit = functools.partial(DecoderLayer, moe=True) if cfg.moe.every == 1 else LayerGroup

        @nnx.split_rngs(splits=cfg.stacked_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked(rngs):
            return unit(cfg, rngs=rngs)

        self.layers = stacked(rngs)
        self.final_norm = Norm(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, cfg, (cfg.dim, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, head: jax.Array | None = None) -> jax.Array:
        """int ``[B, T]`` tokens -> logits ``[B, T, V]`` in the compute dtype (no cache:
        training, scoring; ``decode`` continues a cache).

        Args:
          positions: int ``[B, T]`` position of each token in its document (default
            ``0..T-1``); packed sequences restart it at each document.
          segment_ids: int ``[B, T]`` document ids of packed sequences, or None.
          head: ``head_weight()`` computed once by the caller for many calls, or None
            (computed here). A decoding loop's verification passes a tied embedding's
            transpose made once before the loop: XLA:CPU multiplies 4 rows by a
            ``[D, V]`` copy in 5.6 ms, by the ``[V, D]`` table's transpose in 7.5 ms
            (SmolLM2's 49,152 x 576; one row is no faster).
        """
        return self.logits(self.features(tokens, positions=positions, segment_ids=segment_ids), head)

    def decode(self, tokens: jax.Array, cache: Cache, *, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, tree_mask: jax.Array | None = None,
               head: jax.Array | None = None, logits_at: jax.Array | None = None) -> Decoded:
        """``tokens [B, T]`` continuing ``cache`` (any ``Cache``: each row's tokens follow
        its cached prefix; their keys/values are written at its next slots). ``Decoded``.

        Args:
          positions: int ``[B, T]`` (default ``cache.lengths[b] + 0..T-1``).
          segment_ids: as ``__call__``'s (a teacher's packed rows over a fresh cache).
          tree_mask: bool ``[B, T, T]``: ``tree_mask[b, t, j]`` lets new token ``t`` see
            new token ``j`` (a token tree verified in one pass; give each token its depth
            through ``positions``). Default causal.
          head: as ``__call__``'s.
          logits_at: int ``[B, R]``: the logits (and features) only at these of the ``T``
            tokens (a packed row's last token per sequence: the vocabulary projection of
            the others is not computed). Default every token.
        """
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(cache.lengths, (B,))[:, None] + jnp.arange(T, dtype=jnp.int32)
        x = self.embed_tokens(tokens, positions)
        x, cache = cache.run(self.layers, x, lambda layer, x, view, _: layer(x, positions, segment_ids, view),
                             tree_mask)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
        return Decoded(self.logits(x, head), cache, self.final_norm(x))

    def features(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """The residual stream after the last layer (before the final norm), ``[B, T, D]``:
        what ``logits`` (or a fused loss, ``jaxpar.ops.kernel_ops.token_losses``) takes."""
        return self.features_and_aux(tokens, positions=positions, segment_ids=segment_ids)[0]

    def features_and_aux(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                         segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """``(features(...), aux)``: ``aux`` the MoE layers' ``jaxpar.models.moe.Aux``, their
        loss terms summed (the balance loss, which the training loss adds) and their
        statistics stacked ``[L, 3, E]``; None for a dense model."""
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x = self.embed_tokens(tokens, positions)
        graphdef, layer_state = nnx.split(self.layers)
        if self.cfg.moe is None:
            return run_layers(self.cfg, graphdef, layer_state, x, positions, segment_ids, remat=self.remat), None
        return run_layers_and_aux(self.cfg, graphdef, layer_state, x, positions, segment_ids, remat=self.remat)

    def embed_tokens(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """int ``[B, T]`` tokens (and positions) -> the residual stream ``[B, T, D]``.

        The tables are looked up with ``embed`` whole (gathered over FSDP, as every
        weight is for its use; ``vocab`` stays split): the lookup's gradient, a
        scatter-add of the batch-split ``[B, T, D]`` gradient, then runs locally and is
        reduce-scattered onto the table's shards. Looked up in place, ``D`` split over
        ``fsdp`` while the rows are split over the batch axes, XLA can only replicate the
        whole ``[B, T, D]`` gradient ("Involuntary full rematerialization").
        """
        x = jnp.take(constrain(fetch.to_device(self.embed[...]), ("vocab", None)), tokens, axis=0)
        x = x.astype(self.cfg.compute_dtype)
        if self.cfg.position == "learned":
            table = constrain(fetch.to_device(self.positions[...]), ("positions", None))
            x = x + jnp.take(table, positions, axis=0).astype(self.cfg.compute_dtype)
        return constrain(x, ACT_BTD)

    def logits(self, x: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """The final norm and vocabulary projection (``head``, else ``head_weight()``):
        ``[B, T, D]`` -> ``[B, T, V]``."""
        with jax.named_scope("lm_head"):
            return self.project(self.final_norm(x), head)

    def project(self, normed: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """The vocabulary projection of final-normed ``[B, T, D]`` (``Decoded.features``)
        -> ``[B, T, V]``."""
        with jax.named_scope("lm_head"):
            head = self.head_weight() if head is None else head
            return constrain(dense(constrain(normed, ACT_BTD_WHOLE), head, ("embed", "vocab")), ACT_BTV)

    def head_weight(self, ids: jax.Array | None = None) -> jax.Array:
        """The vocabulary projection ``[D, V]`` in the compute dtype (the embedding's
        transpose when tied); with ``ids`` (int ``[N]``), only those tokens' columns,
        ``[D, N]`` (a GliDe draft's restricted vocabulary)."""
        dtype = self.cfg.compute_dtype
        if self.cfg.tie_embeddings:
            table = fetch.to_device(self.embed[...])
            return (table if ids is None else jnp.take(table, ids, axis=0)).astype(dtype).T
        head = fetch.to_device(self.lm_head[...])
        return (head if ids is None else jnp.take(head, ids, axis=1)).astype(dtype)


def run_layers(cfg: ModelConfig, graphdef, layer_state, x, positions, segment_ids, *, remat: Remat = Remat()):
    """Runs stacked decoder layers (``layer_state`` leaves ``[L', ...]``, any ``L'``, as a
    pipeline stage holds) over ``x [B, T, D]`` with ``jax.lax.scan``, ``remat`` per layer.
    Layers kept in host memory are fetched to the device a few layers ahead of their use
    (``jaxpar.offload.fetch.scan_layers``)."""
    def layer(x, state, positions, segment_ids):
        return nnx.merge(graphdef, state)(x, positions, segment_ids)

    if cfg.moe is not None:
        return run_layers_and_aux(cfg, graphdef, layer_state, x, positions, segment_ids, remat=remat)[0]
    return fetch.scan_layers(_remat(layer, remat), x, layer_state, positions, segment_ids)


def run_layers_and_aux(cfg: ModelConfig, graphdef, layer_state, x, positions, segment_ids, *,
                       remat: Remat = Remat()):
    """``run_layers`` of a MoE model: ``(x, Aux)``, the residual stream and the MoE layers'
    ``jaxpar.models.moe.Aux`` (loss terms summed, statistics stacked ``[L', 3, E]``,
    carried through the scan with the index of the layer to write)."""
    def layer(carry, state, positions, segment_ids):
        x, loss, stats, i = carry
        x, _, aux = nnx.merge(graphdef, state).forward(x, positions, segment_ids)
        return x, loss + aux.loss, jax.lax.dynamic_update_index_in_dim(stats, aux.stats, i, 0), i + 1

    first = jax.tree.leaves(layer_state, is_leaf=fetch.is_split)[0]
    units = first.resident.shape[0] + first.offloaded.shape[0] if fetch.is_split(first) else first.shape[0]
    stats = jnp.zeros((units, 3, cfg.moe.experts), jnp.float32)
    carry = (x, jnp.zeros((), jnp.float32), stats, jnp.zeros((), jnp.int32))
    x, loss, stats, _ = fetch.scan_layers(_remat(layer, remat), carry, layer_state, positions, segment_ids)
    return x, Aux(loss, stats)
