"""jaxpar's models: one decoder-only transformer for the Llama family and GPT-2 style,
the GliDe draft model that reads its KV cache, and the DLRM recommendation model."""

from jaxpar.models.config import PRESETS, ModelConfig, MoEConfig, RopeScaling
from jaxpar.models.dlrm import DLRM, DLRM_PRESETS, DLRMConfig
from jaxpar.models.gguf import from_gguf
from jaxpar.models.glide import GlideDraft
from jaxpar.models.hf import from_hf, to_hf
from jaxpar.models.transformer import Remat, Transformer

__all__ = ["DLRM", "DLRM_PRESETS", "DLRMConfig", "PRESETS", "GlideDraft", "ModelConfig", "MoEConfig", "RopeScaling",
           "Remat", "Transformer", "from_gguf", "from_hf", "to_hf"]
