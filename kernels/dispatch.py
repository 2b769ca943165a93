"""Which implementation runs: the rule every ``jaxpar.kernels`` entry point follows, and
the model's choice per operation (``KernelOptions``, a field of
``jaxpar.placement.execution.Execution``)."""

from __future__ import annotations

import dataclasses

import jax


def use_pallas(interpret: bool | None) -> bool:
    """Whether to run the Pallas kernel: ``interpret=None`` runs it (compiled) on GPU and
    the plain-XLA reference elsewhere; ``True`` runs it in interpret mode on any backend
    (the CPU tests); ``False`` forces the compiled kernel."""
    return interpret is not None or jax.default_backend() == "gpu"


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


# The choices per operation. "auto": the Pallas kernel on GPU, XLA elsewhere.
IMPLS = {
    "attention": ("auto", "xla", "cudnn", "pallas"),
    "norm": ("auto", "xla", "pallas"),
    "loss": ("auto", "xla", "pallas"),
}


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the model's attention, norms and loss run (``jaxpar-train``'s
    ``execution.attention``, ``execution.norm``, ``execution.loss``): ``"xla"`` the plain-``jnp``
    computation; ``"pallas"`` the ``jaxpar.kernels`` kernel (compiled on GPU, interpret
    mode elsewhere: slow, for tests); ``"cudnn"`` (attention only, GPU only) cuDNN's
    fused attention through ``jax.nn.dot_product_attention``; ``"auto"`` Pallas on GPU
    and XLA elsewhere. What is computed is the same whichever runs."""

    attention: str = "auto"
    norm: str = "auto"
    loss: str = "auto"

    def __post_init__(self):
        for op, allowed in IMPLS.items():
            if getattr(self, op) not in allowed:
                raise ValueError(f"{op}.impl={getattr(self, op)!r} must be one of {list(allowed)}")
        if self.attention == "cudnn" and not on_gpu():
            raise ValueError(f"execution.attention='cudnn' needs a GPU; JAX's backend here is "
                             f"{jax.default_backend()!r}")

    def resolve(self, op: str) -> str:
        """The implementation that runs ``op`` on this backend ("auto" resolved)."""
        choice = getattr(self, op)
        if choice == "auto":
            return "pallas" if on_gpu() else "xla"
        return choice


def pallas_interpret() -> bool:
    """The ``interpret`` flag a chosen ``"pallas"`` implementation runs with: compiled on
    GPU, interpret mode elsewhere."""
    return not on_gpu()


def triton(num_warps: int = 4, num_stages: int = 2):
    """``compiler_params`` that select the Triton lowering for a ``pl.pallas_call``: without
    them JAX lowers ``pallas_call`` on CUDA through Mosaic GPU (``jax_pallas_use_mosaic_gpu``
    defaults on), which our kernels are not written for. Ignored in interpret mode."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
