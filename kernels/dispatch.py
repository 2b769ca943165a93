"""Which implementation runs: the rule every ``jaxpar.kernels`` entry point follows, and
the model's choice per operation (``KernelOptions``, a field of
``jaxpar.placement.execution.Execution``).

Both follow ``choose(op, choice, backend, capability)``, a pure function of the user's
choice, JAX's backend and the GPU's compute capability, so the decision is tested
without a GPU. Pallas' Triton lowering needs compute capability 8.0 (Ampere) or newer
(jax-ml/jax#26799), and so does cuDNN's fused attention: on an older GPU, such as
Colab's free T4 (7.5), ``auto`` runs XLA and says why once (``fall_back``, the
``jaxpar.kernels`` logger), and an explicit ``pallas`` or ``cudnn`` is a one-line
``ValueError`` when the options are made, before anything is traced.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

_log = logging.getLogger("jaxpar.kernels")
_REPORTED: set[str] = set()

# The oldest GPU the compiled kernels and cuDNN's fused attention run on: Ampere.
MIN_CAPABILITY = (8, 0)


def fall_back(reason: str) -> None:
    """Logs (once per distinct ``reason``) that a kernel runs its XLA reference instead."""
    if reason not in _REPORTED:
        _REPORTED.add(reason)
        _log.warning("jaxpar.kernels: %s; running the XLA reference instead", reason)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def device() -> tuple[str, tuple[int, int] | None]:
    """``(backend, capability)``: JAX's default backend and the CUDA compute capability
    ``(major, minor)`` of its first device (``compute_capability``, a string such as
    ``"7.5"``), None off CUDA: CPU, TPU, and ROCm, whose devices name an architecture
    (``"gfx90a"``) instead. What ``choose`` decides from."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend, None
    try:
        major, minor = str(jax.devices()[0].compute_capability).split(".")
        return backend, (int(major), int(minor))
    except (AttributeError, ValueError):
        return backend, None


def _version(capability: tuple[int, int]) -> str:
    return ".".join(map(str, capability))


def choose(op: str, choice: str, backend: str, capability: tuple[int, int] | None) -> tuple[str, str | None]:
    """``(implementation, reason)``: what runs ``op`` (``"attention"``, ``"norm"``,
    ``"loss"``, ``"moe"``; ``"kernels"`` for a ``jaxpar.kernels`` entry point's
    ``interpret=None``) when the user chose ``choice`` (one of ``IMPLS[op]``), JAX's backend is ``backend``
    (``"cpu"``, ``"gpu"``, ``"tpu"``) and the GPU's compute capability ``capability``
    (``(major, minor)``, None off CUDA). ``reason`` says why ``"auto"`` did not get the
    Pallas kernels on a GPU, else None. Raises ``ValueError`` (one line) for an explicit
    choice this device cannot run."""
    if op == "moe_exchange":  # a collective, not a kernel: the GPU's and TPU's XLA have the ragged one
        if choice == "ragged" and backend == "cpu":
            raise ValueError("execution.moe_exchange='ragged' needs a GPU or TPU: XLA:CPU has no "
                             "jax.lax.ragged_all_to_all; use execution.moe_exchange=auto or padded")
        return (choice if choice != "auto" else "padded" if backend == "cpu" else "ragged"), None
    if choice == "cudnn" and backend != "gpu":
        raise ValueError(f"execution.{op}='cudnn' needs a GPU; JAX's backend here is {backend!r}")
    too_old = backend == "gpu" and capability is not None and tuple(capability) < MIN_CAPABILITY
    need, have = _version(MIN_CAPABILITY), too_old and _version(capability)
    if too_old and choice in ("pallas", "cudnn"):
        what = "Pallas' Triton lowering, jax-ml/jax#26799" if choice == "pallas" else "cuDNN's fused attention"
        raise ValueError(f"execution.{op}={choice!r} needs a GPU of compute capability {need} or newer "
                         f"({what}); this one has {have}: use execution.{op}=auto or xla")
    if choice != "auto":
        return choice, None
    if backend != "gpu":
        return "xla", None
    if too_old:
        return "xla", (f"this GPU has compute capability {have} and Pallas' Triton kernels need "
                       f"{need} or newer (jax-ml/jax#26799)")
    return "pallas", None


def use_pallas(interpret: bool | None) -> bool:
    """Whether to run the Pallas kernel: ``interpret=None`` runs it (compiled) on a GPU
    that can (``choose``; an older one logs why once) and the plain-XLA reference
    elsewhere; ``True`` runs it in interpret mode on any backend (the CPU tests);
    ``False`` forces the compiled kernel."""
    if interpret is not None:
        return True
    impl, reason = choose("kernels", "auto", *device())
    if reason:
        fall_back(reason)
    return impl == "pallas"


# The choices per operation. "auto": the Pallas kernel on a GPU that runs it, XLA elsewhere.
IMPLS = {
    "attention": ("auto", "xla", "cudnn", "pallas"),
    "norm": ("auto", "xla", "pallas"),
    "loss": ("auto", "xla", "pallas"),
    "moe": ("auto", "xla", "pallas"),
    "moe_exchange": ("auto", "padded", "ragged"),
}


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the model's attention, norms, loss and mixture-of-experts grouped matmuls run
    (``jaxpar-train``'s ``execution.attention``, ``execution.norm``, ``execution.loss``,
    ``execution.moe``): ``"xla"`` the plain-``jnp`` computation (for ``moe``,
    ``jax.lax.ragged_dot``); ``"pallas"`` the ``jaxpar.kernels`` kernel (compiled on GPU,
    interpret mode elsewhere: slow, for tests); ``"cudnn"`` (attention only, GPU only) cuDNN's
    fused attention through ``jax.nn.dot_product_attention``; ``"auto"`` Pallas on a GPU
    of compute capability 8.0 or newer and XLA elsewhere (``choose``). What is computed
    is the same whichever runs. ``"pallas"`` and ``"cudnn"`` on a GPU older than 8.0, and
    ``"cudnn"`` without a GPU, raise ``ValueError`` here. ``moe_exchange`` (``execution.moe_exchange``)
    is how expert parallelism moves tokens (``jaxpar.models.moe.exchange``): ``"padded"``
    all-to-alls of fixed per-destination buffers (any backend), ``"ragged"``
    ``jax.lax.ragged_all_to_all`` of the real rows only (GPU and TPU; ``ValueError`` on a
    CPU), ``"auto"`` ragged where the backend has it."""

    attention: str = "auto"
    norm: str = "auto"
    loss: str = "auto"
    moe: str = "auto"
    moe_exchange: str = "auto"

    def __post_init__(self):
        for op, allowed in IMPLS.items():
            if getattr(self, op) not in allowed:
                raise ValueError(f"execution.{op}={getattr(self, op)!r} must be one of {list(allowed)}")
        for op in IMPLS:  # only explicit choices look at the device: "auto" starts no backend
            if getattr(self, op) in ("pallas", "cudnn", "ragged"):
                choose(op, getattr(self, op), *device())

    def resolve(self, op: str) -> str:
        """The implementation that runs ``op`` on this device ("auto" resolved; when it
        cannot get the kernels on a GPU, why is logged once)."""
        choice = getattr(self, op)
        if choice != "auto":
            return choice
        impl, reason = choose(op, choice, *device())
        if reason:
            fall_back(reason)
        return impl


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
