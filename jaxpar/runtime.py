"""Process-level set-up that must happen before JAX starts its backends."""

from __future__ import annotations

import jax


def simulate_cpu_devices(n: int) -> None:
    """Makes the CPU backend present ``n`` devices, for meshes on a machine without GPUs.

    Must run before anything asks JAX for its devices; ``JAX_NUM_CPU_DEVICES=n`` in the
    environment does the same.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"simulated device count {n!r} must be a positive int")
    jax.config.update("jax_num_cpu_devices", n)
