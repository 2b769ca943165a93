"""The one rule every ``jaxpar.kernels`` entry point follows to pick its implementation."""

import jax


def use_pallas(interpret: bool | None) -> bool:
    """Whether to run the Pallas kernel: ``interpret=None`` runs it (compiled) on GPU and
    the plain-XLA reference elsewhere; ``True`` runs it in interpret mode on any backend
    (the CPU tests); ``False`` forces the compiled kernel."""
    return interpret is not None or jax.default_backend() == "gpu"
