"""The ``probe`` part (40 s), and what the other parts ask of its answer.

The probe imports JAX and records its backend; on a GPU (or in ``--smoke``) also the
device, its compute capability and memory, JAX's version, which optional packages
import, and that jaxpar imports from this checkout (through the shim). Off a GPU the
orchestrator says so in one line and stops. The other parts read the probe's record
(``machine``), never JAX's backend in their own process: the serve part's server needs
the GPU's memory before this process holds any.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import platform
import sys

from part import Record, Skip, missing, read_result, short

OPTIONAL = ("flax", "optax", "orbax.checkpoint", "yaml", "tqdm", "tokenizers", "safetensors",
            "fastapi", "uvicorn", "httpx", "tensorboardX", "matplotlib")
TRAIN_DEPS = ("flax", "optax", "orbax.checkpoint", "yaml", "tqdm", "tokenizers")  # jaxpar-train's
HTTP_DEPS = ("fastapi", "uvicorn", "httpx")  # jaxpar-serve's HTTP stack


def part_probe(ns, rec: Record) -> None:
    rec.update({"python": platform.python_version(), "executable": sys.executable, "cpus": os.cpu_count(),
                "machine": platform.machine()})
    try:
        import jax
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"jax does not import: {short(e, 100)}"
        rec["status"] = "failed"
        return
    rec["jax"] = jax.__version__
    try:
        rec["backend"] = jax.default_backend()
    except Exception as e:  # noqa: BLE001
        rec["backend"], rec["error"] = None, f"no JAX backend: {short(e, 100)}"
        rec["status"] = "failed"
        return
    rec.save()
    if rec["backend"] != "gpu" and not ns.smoke:
        rec["status"] = "ok"
        return  # the orchestrator says so in one line
    import jaxlib

    devices = jax.devices()
    d = devices[0]
    rec.update({"jaxlib": jaxlib.__version__, "device_kind": d.device_kind, "platform": d.platform,
                "device_count": len(devices), "capability": getattr(d, "compute_capability", None)})
    with contextlib.suppress(Exception):
        stats = d.memory_stats() or {}
        rec["memory_bytes"] = stats.get("bytes_limit")
    rec["missing"] = missing(OPTIONAL)
    with contextlib.suppress(Exception):
        import flax

        rec["flax"] = flax.__version__
    try:
        import jaxpar
        import jaxpar.kernels

        rec["jaxpar"] = {"package": str(pathlib.Path(jaxpar.__file__).resolve().parent),
                         "kernels": str(pathlib.Path(jaxpar.kernels.__file__).resolve().parent)}
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        rec["jaxpar_error"] = short(e)
        rec["status"] = "failed"
        rec["reason"] = f"jaxpar does not import from this checkout: {rec['jaxpar_error']}"
    mem = f", {rec['memory_bytes'] / 2**30:.0f} GiB for JAX" if rec.get("memory_bytes") else ""
    rec["summary"] = f"{len(devices)} x {d.device_kind}{mem}; missing: {', '.join(rec['missing']) or 'nothing'}"


def machine(ns) -> dict:
    """The probe's record of this run."""
    return read_result(ns.work, "probe")


def need_gpu(ns) -> dict:
    """The probe's record; Skip off a GPU unless ``--smoke``."""
    probe = machine(ns)
    if probe.get("backend") != "gpu" and not ns.smoke:
        raise Skip("no GPU")
    return probe


def need_pallas_gpu(ns) -> bool:
    """Whether on a GPU (else the kernels run in interpret mode: ``--smoke``); Skip where
    Pallas' kernels cannot run: no GPU, or one older than compute capability 8.0."""
    probe = need_gpu(ns)
    gpu = probe.get("backend") == "gpu"
    if gpu:
        cap = probe.get("capability")
        try:
            old = tuple(int(x) for x in str(cap).split(".")) < (8, 0)
        except ValueError:  # ROCm names an architecture (or none known): the kernels as on any GPU
            old = False
        if old:
            raise Skip(f"compute capability {cap}: Pallas' Triton kernels need 8.0 or newer, XLA runs here")
    return gpu
