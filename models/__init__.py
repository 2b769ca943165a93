"""jaxpar's models: one decoder-only transformer for the Llama family and GPT-2 style."""

from jaxpar.models.config import PRESETS, ModelConfig, RopeScaling
from jaxpar.models.hf import from_hf, to_hf
from jaxpar.models.transformer import Transformer

__all__ = ["PRESETS", "ModelConfig", "RopeScaling", "Transformer", "from_hf", "to_hf"]
