"""Model configuration: one frozen dataclass covers the Llama family and GPT-2 style models."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "names")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (HF ``rope_type: llama3``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer.

    Llama style is ``norm="rms", mlp="swiglu", position="rope"``; GPT-2 style is
    ``norm="layer", mlp="gelu", position="learned"`` with biases and tied embeddings.
    """

    vocab_size: int = 4096
    dim: int = 128  # D, the model width
    layers: int = 4  # L
    heads: int = 4  # N, query heads
    kv_heads: int = 2  # K, key/value heads (grouped-query attention when K < N)
    head_dim: int = 32  # H
    mlp_dim: int = 384  # F
    norm: Literal["rms", "layer"] = "rms"
    norm_eps: float = 1e-5
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    position: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position: int = 2048  # rows of the learned position table (position="learned")
    tie_embeddings: bool = False
    attention_bias: bool = False  # biases on the q/k/v/out projections
    mlp_bias: bool = False
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    remat: str = "none"  # one of REMAT_POLICIES
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
        choices = {
            "norm": ("rms", "layer"),
            "mlp": ("swiglu", "gelu"),
            "position": ("rope", "learned"),
            "remat": REMAT_POLICIES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be one of {allowed}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(
                    f"model.{name}={getattr(self, name)!r} must be float32, bfloat16 or float16"
                )
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)


PRESETS: dict[str, ModelConfig] = {
    # Trains on CPU in minutes; float32 so parallel runs match single-device runs.
    "tiny": ModelConfig(),
    # About 110M parameters with a 32k vocabulary.
    "small": ModelConfig(
        vocab_size=32768, dim=768, layers=12, heads=12, kv_heads=4, head_dim=64, mlp_dim=2048
    ),
    # The shape of Llama 3.2 1B.
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
}
