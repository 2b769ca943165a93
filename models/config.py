"""Model configuration: one frozen dataclass covers the Llama family and GPT-2 style models."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Literal

import jax.numpy as jnp

NORMS = ("rms", "layer")
MLPS = ("swiglu", "gelu")
POSITIONS = ("rope", "learned")
DTYPES = ("float32", "bfloat16", "float16")
# The ``checkpoint_name``s the transformer's layers tag (models/transformer.py): what
# ``model.remat_names`` may save and ``offload.activations`` may send to the host.
# layer_input [B, T, D] (the residual stream entering a stacked layer: the scan's carry),
# query/key/value [B, T, N or K, H] after RoPE, attention [B, T, N, H] (before the output
# projection), mlp_hidden [B, T, F] (before the down projection).
CHECKPOINT_NAMES = ("layer_input", "query", "key", "value", "attention", "mlp_hidden")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (HF ``rope_type: llama3``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


# Tags on ModelConfig's fields, so each list of "the settings X depends on" is derived
# from the field declarations rather than kept by hand beside them.
WEIGHTS = "weights"  # the parameters' shapes and dtypes: a checkpoint fits only its own
TARGET = "target"  # what a GliDe draft reads of its target: cached K/V layout, RoPE, head


def _field(default, *tags: str):
    return dataclasses.field(default=default, metadata={tag: True for tag in tags})


ROUTERS = ("softmax", "sigmoid_bias")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (``jaxpar.models.moe``) in place of the dense one.

    Each token's router scores (float32) pick ``experts_per_token`` (k) of ``experts``
    (E) experts, each a SwiGLU (or GELU, as ``model.mlp``) MLP of width
    ``expert_width``; their outputs are summed weighted by the router's gates, plus
    ``shared_experts`` experts every token passes through (DeepSeek; one MLP of width
    ``shared_experts * expert_width``).

    ``every``: layer ``l`` (from 0) is a MoE layer where ``(l + 1) % every == 0``, the
    others dense (``every=2``: layers 1, 3, ...); ``model.layers`` must be a multiple.
    ``router``: ``softmax`` (the top-k of softmax scores, divided by their sum when
    ``normalize``: Mixtral, Qwen3-MoE) or ``sigmoid_bias`` (DeepSeek-V3: sigmoid scores,
    the top-k chosen by score + a per-expert bias that is no gradient parameter and moves
    by ``bias_rate * sign(mean load - load)`` after each step; the gates are the unbiased
    scores, normalised when ``normalize``).
    ``balance_loss``: the coefficient of Switch's load-balancing loss ``E * sum_e f_e
    P_e`` (``f_e`` the fraction of the k-per-token assignments expert ``e`` gets,
    ``P_e`` its mean router probability), added per MoE layer to the training loss.
    ``capacity_factor``: None is dropless; a number ``C`` keeps, per sequence and expert,
    the first ``ceil(C * T * k / E)`` assignments in token order and drops the rest
    (a dropped assignment contributes zero; the residual carries the token).
    """

    experts: int = 8  # E
    experts_per_token: int = 2  # k
    expert_width: int = 256  # F of one expert
    shared_experts: int = 0
    every: int = 1
    router: Literal[ROUTERS] = "softmax"
    normalize: bool = True
    bias_rate: float = 0.001  # sigmoid_bias's update speed (DeepSeek-V3's gamma)
    balance_loss: float = 0.01
    capacity_factor: float | None = None

    def __post_init__(self):
        for name in ("experts", "experts_per_token", "expert_width", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.moe.{name}={value!r} must be a positive int")
        if isinstance(self.shared_experts, bool) or not isinstance(self.shared_experts, int) \
                or self.shared_experts < 0:
            raise ValueError(f"model.moe.shared_experts={self.shared_experts!r} must be an int >= 0")
        if self.experts_per_token > self.experts:
            raise ValueError(f"model.moe.experts_per_token={self.experts_per_token} is more than "
                             f"model.moe.experts={self.experts}")
        if self.router not in ROUTERS:
            raise ValueError(f"model.moe.router={self.router!r} must be one of {ROUTERS}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"model.moe.capacity_factor={self.capacity_factor!r} must be positive (or null: "
                             "dropless)")
        if not self.balance_loss >= 0:
            raise ValueError(f"model.moe.balance_loss={self.balance_loss!r} must not be negative")
        if not self.bias_rate >= 0:
            raise ValueError(f"model.moe.bias_rate={self.bias_rate!r} must not be negative")


def check_expert_ways(moe: MoEConfig | None, ways: int, missing: str = "give model.moe (e.g. model=moe_tiny)") -> None:
    """``mesh.expert=ways`` splits a MoE model's whole experts: ``ValueError`` naming the
    key where the model has no ``model.moe`` (``missing``: what the line says to do, a
    config's or a loaded model's) or ``ways`` does not divide its experts."""
    if moe is None:
        raise ValueError(f"mesh.expert={ways} splits a MoE model's experts: {missing}")
    if moe.experts % ways:
        raise ValueError(f"mesh.expert={ways} must divide model.moe.experts={moe.experts}")


@functools.cache
def literal_choices(cls) -> dict[str, tuple]:
    """The allowed values of each ``Literal`` field of the dataclass ``cls``, from its
    annotations, read once per class (``typing.get_type_hints`` evaluates every string
    annotation again on each call: 16 ms a ``ModelConfig``, made thousands of times)."""
    hints = typing.get_type_hints(cls)
    return {name: typing.get_args(hint) for name, hint in hints.items() if typing.get_origin(hint) is Literal}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer.

    Llama style is ``norm="rms", mlp="swiglu", position="rope"``; GPT-2 style is
    ``norm="layer", mlp="gelu", position="learned"`` with biases and tied embeddings.
    """

    vocab_size: int = _field(4096, WEIGHTS, TARGET)
    dim: int = _field(128, WEIGHTS, TARGET)  # D, the model width
    layers: int = _field(4, WEIGHTS, TARGET)  # L
    heads: int = _field(4, WEIGHTS, TARGET)  # N, query heads
    kv_heads: int = _field(2, WEIGHTS, TARGET)  # K, key/value heads (grouped-query attention when K < N)
    head_dim: int = _field(32, WEIGHTS, TARGET)  # H
    mlp_dim: int = _field(384, WEIGHTS)  # F
    norm: Literal[NORMS] = _field("rms", WEIGHTS)
    norm_eps: float = 1e-5
    mlp: Literal[MLPS] = _field("swiglu", WEIGHTS)
    position: Literal[POSITIONS] = _field("rope", WEIGHTS, TARGET)
    rope_theta: float = _field(10000.0, TARGET)
    rope_scaling: RopeScaling | None = _field(None, TARGET)
    max_position: int = _field(2048, WEIGHTS)  # rows of the learned position table (position="learned")
    tie_embeddings: bool = _field(False, WEIGHTS)
    attention_bias: bool = _field(False, WEIGHTS)  # biases on the q/k/v/out projections
    mlp_bias: bool = _field(False, WEIGHTS)
    # Qwen3's per-head RMSNorm of the queries and keys over the head dimension, before
    # RoPE (scales layers.attn.q_norm, k_norm [L, H]; eps norm_eps), whatever ``norm``.
    qk_norm: bool = _field(False, WEIGHTS, TARGET)
    dtype: Literal[DTYPES] = "float32"  # compute dtype
    param_dtype: Literal[DTYPES] = _field("float32", WEIGHTS)
    init_std: float = 0.02
    # A mixture-of-experts MLP in (every `moe.every`-th of) the layers; None: dense.
    moe: MoEConfig | None = _field(None, WEIGHTS)

    def __post_init__(self):
        for name in ("vocab_size", "dim", "layers", "heads", "kv_heads", "head_dim", "mlp_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name}={value!r} must be a positive int")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model.heads={self.heads} must be a multiple of model.kv_heads={self.kv_heads}"
            )
        for name, allowed in literal_choices(ModelConfig).items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")
        if self.moe is not None:
            if self.layers % self.moe.every:
                raise ValueError(f"model.layers={self.layers} must be a multiple of model.moe.every="
                                 f"{self.moe.every}")
            if self.mlp_bias:
                raise ValueError("model.mlp_bias with model.moe is not supported yet: experts have no biases")

    @property
    def stacked_layers(self) -> int:
        """The length of the stacked ``layers`` axis: ``layers``, or with ``moe.every =
        n > 1`` the ``layers / n`` groups of ``n`` layers (``jaxpar.models.moe``)."""
        return self.layers if self.moe is None else self.layers // self.moe.every

    @classmethod
    def fields_tagged(cls, tag: str) -> tuple[str, ...]:
        """The names of the fields tagged ``tag`` (``WEIGHTS`` or ``TARGET``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(tag))

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)


# The one definition of each named model: jaxpar-train's configs name these
# (``model: small``, train/configs/*.yaml) and the benchmarks use them.
PRESETS: dict[str, ModelConfig] = {
    # Trains on CPU in minutes; float32 so parallel runs match single-device runs.
    "tiny": ModelConfig(),
    # About 350M parameters, Llama style, bfloat16 compute: a one-GPU run (small.yaml
    # trains it with model.remat=dots_no_batch: remat is the run's layout, jaxpar.layout).
    "small": ModelConfig(
        vocab_size=32768, dim=1024, layers=24, heads=16, kv_heads=8, head_dim=64, mlp_dim=2816,
        dtype="bfloat16",
    ),
    # The shape of Llama 3.2 1B (its 128,256-token vocabulary: train it with Llama 3's
    # tokenizer.json, or set vocab_size to the tokenizer you have, as 1b.yaml does).
    "1b": ModelConfig(
        vocab_size=128256, dim=2048, layers=16, heads=32, kv_heads=8, head_dim=64,
        mlp_dim=8192, rope_theta=500000.0, rope_scaling=RopeScaling(factor=32.0),
        tie_embeddings=True, dtype="bfloat16",
    ),
    # GPT-2 (124M).
    "gpt2": ModelConfig(
        vocab_size=50257, dim=768, layers=12, heads=12, kv_heads=12, head_dim=64,
        mlp_dim=3072, norm="layer", mlp="gelu", position="learned", max_position=1024,
        tie_embeddings=True, attention_bias=True, mlp_bias=True,
    ),
    # tiny with 8 experts, 2 per token, each half tiny's MLP: tiny's active MLP width,
    # 4x its MLP parameters. Trains on CPU in CI.
    "moe_tiny": ModelConfig(moe=MoEConfig(experts=8, experts_per_token=2, expert_width=192)),
    # Shapes for compile-only work (bfloat16 compute). Mixtral 8x7B: 46.7B parameters,
    # 12.9B active.
    "mixtral_8x7b": ModelConfig(
        vocab_size=32000, dim=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp_dim=14336,
        rope_theta=1e6, max_position=32768, dtype="bfloat16", param_dtype="bfloat16",
        moe=MoEConfig(experts=8, experts_per_token=2, expert_width=14336),
    ),
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active.
    "qwen3_30b_a3b": ModelConfig(
        vocab_size=151936, dim=2048, layers=48, heads=32, kv_heads=4, head_dim=128, mlp_dim=6144,
        norm_eps=1e-6, qk_norm=True, rope_theta=1e6, max_position=40960, dtype="bfloat16", param_dtype="bfloat16",
        moe=MoEConfig(experts=128, experts_per_token=8, expert_width=768),
    ),
    # DeepSeek-V3-like: its MoE (256 routed experts of width 2048, 8 per token, 1 shared,
    # sigmoid router with the balancing bias) in all 61 layers, with grouped-query
    # attention (128 heads, 8 kv heads) in place of MLA and no group-limited routing, no
    # dense first layers, no multi-token prediction: 708B parameters, 41B active (DeepSeek-V3:
    # 671B, 37B).
    "deepseek_v3_like": ModelConfig(
        vocab_size=129280, dim=7168, layers=61, heads=128, kv_heads=8, head_dim=128, mlp_dim=18432,
        norm_eps=1e-6, dtype="bfloat16", param_dtype="bfloat16",
        moe=MoEConfig(experts=256, experts_per_token=8, expert_width=2048, shared_experts=1,
                      router="sigmoid_bias", balance_loss=0.0001),
    ),
}
