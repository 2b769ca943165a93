"""Pallas kernels for the GPU hot paths (``jaxpar.kernels``).

Every entry point takes ``interpret: bool | None = None``: ``None`` runs the compiled
Pallas kernel on GPU and the plain-XLA reference beside it elsewhere; ``True`` runs the
Pallas kernel in interpret mode on any backend (the CPU tests); ``False`` forces the
compiled kernel. Each kernel module has its ``*_reference`` in plain ``jnp``.
"""

from jaxpar.kernels.cross_entropy import (linear_cross_entropy, linear_cross_entropy_reference,
                                          log_sum_exp_and_target_logit)
from jaxpar.kernels.decode_attention import (decode_attention, decode_attention_reference,
                                             paged_decode_attention, paged_decode_attention_reference)
from jaxpar.kernels.dispatch import KernelOptions, use_pallas
from jaxpar.kernels.flash_attention import flash_attention, flash_attention_reference
from jaxpar.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from jaxpar.kernels.norms import layer_norm, norm, norm_reference, rms_norm
from jaxpar.kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

__all__ = ["KernelOptions", "decode_attention", "decode_attention_reference", "flash_attention",
           "flash_attention_reference", "grouped_matmul", "grouped_matmul_reference", "layer_norm",
           "linear_cross_entropy",
           "linear_cross_entropy_reference", "log_sum_exp_and_target_logit", "norm",
           "norm_reference", "paged_decode_attention", "paged_decode_attention_reference",
           "ragged_paged_attention", "ragged_paged_attention_reference", "rms_norm", "use_pallas"]
