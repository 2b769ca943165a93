"""Model configuration: one frozen dataclass covers the Llama family and GPT-2 style models."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import jax.numpy as jnp

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "names")
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
    dtype: Literal[DTYPES] = "float32"  # compute dtype
    param_dtype: Literal[DTYPES] = _field("float32", WEIGHTS)
    remat: Literal[REMAT_POLICIES] = "none"
    remat_names: tuple[str, ...] = ()  # with remat="names": checkpoint_name tags to save
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "dim", "layers", "heads", "kv_heads", "head_dim", "mlp_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name}={value!r} must be a positive int")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model.heads={self.heads} must be a multiple of model.kv_heads={self.kv_heads}"
            )
        for field in dataclasses.fields(self):  # every Literal field, from its annotation
            allowed = typing.get_args(typing.get_type_hints(ModelConfig)[field.name])
            if typing.get_origin(typing.get_type_hints(ModelConfig)[field.name]) is Literal:
                if getattr(self, field.name) not in allowed:
                    raise ValueError(f"model.{field.name}={getattr(self, field.name)!r} must be one of {allowed}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")

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
    # About 350M parameters, Llama style, bfloat16 compute: a one-GPU run.
    "small": ModelConfig(
        vocab_size=32768, dim=1024, layers=24, heads=16, kv_heads=8, head_dim=64, mlp_dim=2816,
        dtype="bfloat16", remat="dots_no_batch",
    ),
    # The shape of Llama 3.2 1B (its 128,256-token vocabulary: train it with Llama 3's
    # tokenizer.json, or set vocab_size to the tokenizer you have, as 1b.yaml does).
    "1b": ModelConfig(
        vocab_size=128256, dim=2048, layers=16, heads=32, kv_heads=8, head_dim=64,
        mlp_dim=8192, rope_theta=500000.0, rope_scaling=RopeScaling(factor=32.0),
        tie_embeddings=True, dtype="bfloat16", remat="dots_no_batch",
    ),
    # GPT-2 (124M).
    "gpt2": ModelConfig(
        vocab_size=50257, dim=768, layers=12, heads=12, kv_heads=12, head_dim=64,
        mlp_dim=3072, norm="layer", mlp="gelu", position="learned", max_position=1024,
        tie_embeddings=True, attention_bias=True, mlp_bias=True,
    ),
}
