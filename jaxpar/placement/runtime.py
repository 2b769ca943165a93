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


def initialize_distributed(environ=None) -> bool:
    """Starts JAX's distributed runtime when this process is one of several.

    Triggers, in order:

    * ``JAXPAR_COORDINATOR`` (``host:port``), ``JAXPAR_NUM_PROCESSES`` and
      ``JAXPAR_PROCESS_ID`` set: those are used;
    * under SLURM (``SLURM_NTASKS`` > 1) or Open MPI (``OMPI_COMM_WORLD_SIZE`` > 1):
      ``jax.distributed.initialize()`` reads the cluster from the environment.

    On CPU, collectives between processes go over gloo. Must run before anything asks
    JAX for its devices. Returns whether the runtime was started.
    """
    import os

    env = os.environ if environ is None else environ
    explicit = [env.get(k) for k in ("JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID")]
    cluster = int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    if not any(explicit) and not cluster:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if any(explicit):
        if not all(explicit):
            raise ValueError(
                "set all of JAXPAR_COORDINATOR, JAXPAR_NUM_PROCESSES and JAXPAR_PROCESS_ID, "
                f"got {dict(zip(('coordinator', 'num_processes', 'process_id'), explicit))}"
            )
        coordinator, count, index = explicit
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=int(count), process_id=int(index))
    else:
        jax.distributed.initialize()
    return True
