"""Measures the ``cpu`` hardware profile (``jaxpar.planning.hardware``) on this machine.

The devices are the simulated XLA:CPU devices of this process (``JAX_NUM_CPU_DEVICES`` or
``jaxpar.placement.runtime.simulate_cpu_devices``, set before JAX starts), all sharing the
machine's cores. Every figure is what ONE device achieves while ALL of them run the same
SPMD program at once, as they do in a training step: each program below runs on a 1D mesh
``("x",)`` over the devices, each device working on its own shard, and rates are one
device's work divided by the wall time of the whole program. Each program is jitted, run
twice untimed (compilation, warm-up), then timed several times with ``block_until_ready``;
the median counts. Sizes are picked so a timed run takes about ``TARGET`` seconds and
shrink as the device count grows, so memory stays at a few hundred MB whatever the count.

``peak_flops``
    per dtype (``float32``, ``bfloat16``): a batched ``[b, 512, 512] x [b, 512, 512]``
    matmul per device (``b`` sized to the target time), ``2 * b * 512^3`` FLOPs per device
    over the run's time.
``efficiency``
    ``matmul`` is 1.0 by definition (the measured peak IS what matmuls reach on CPU).
    ``attention`` is the rate of causal attention per device (``einsum`` of Q and K^T,
    causal mask, softmax, ``einsum`` with V; ``[B, T=512, N=4, H=64]``, ``B`` sized to the
    target time), counted as ``4 * B * T^2 * N * H`` FLOPs (the full square, as the
    planner counts it), divided by the float32 peak, clipped to (0, 1].
``hbm_bandwidth``
    ``x * 1.0001 + 1`` in place (donated) on a float32 array of ``clamp(256 MiB / n, 4 MiB,
    64 MiB)`` per device: read plus write bytes per device over the run's time. In place
    so the figure is the steady-state rate, not the page faults of a fresh output buffer.
``collective_latency``
    a ``psum`` of 4 floats per device, 64 of them chained in a ``fori_loop`` inside one
    program: the run's time over 64. Measured in-program rather than as one call because
    a step pays its dispatch once but this for every collective (on 8 devices on 2 cores
    a single-psum call takes about twice as long, half of it dispatch).
``intra_node_bandwidth``, ``inter_node_bandwidth``
    equal (one node): a tiled ``all_gather`` over all devices in ``shard_map``, shards of
    ``clamp(64 MiB / n^2, 64 KiB, 4 MiB)`` (8 devices together gather 64 MiB), chained
    in a ``fori_loop`` whose trip count is sized to the target time; bytes SENT per device
    by the ring model, ``(n - 1) * shard bytes``, over the time of one all-gather less
    ``collective_latency`` (at most half of it is taken off). One device: ``hbm_bandwidth``.
``host_bandwidth``
    device to host: ``jax.device_put`` of a sharded 32 MiB float32 array (``32 MiB / n``
    per device) to its ``pinned_host`` memory kind (XLA:CPU copies into a fresh host
    buffer), per-device bytes over the copy's time; ``np.asarray`` of a fresh array where
    the memory kind is missing. (Offload copies that a jitted step makes between memory
    kinds lower to nothing on XLA:CPU, see ``jaxpar.offload.activations``; this is the
    rate of the copies placement makes between steps.)
``memory``
    the machine's physical memory (``SC_PAGE_SIZE * SC_PHYS_PAGES``) over the device count.
``comm_overlap``
    0.0: XLA:CPU runs collectives synchronously.
"""

from __future__ import annotations

import datetime
import functools
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.planning import hardware

TARGET = 0.02        # seconds one timed run should take
MATMUL = 512         # square matmul side
ATTN = (512, 4, 64)  # attention T, N (heads), H (head dim)
LATENCY_LOOP = 64    # psums chained in the latency program
MIB = 1 << 20
PARTS = 7            # measurements sharing ``seconds``
SECONDS = 3.0        # ``calibrate``'s default ``seconds`` (tests lower it: a faster, rougher profile)


def _mesh(devices: int | None) -> jax.sharding.Mesh:
    present = jax.devices()
    n = len(present) if devices is None else devices
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(present):
        raise ValueError(f"calibrate: devices={devices!r} must be between 1 and the "
                         f"{len(present)} device(s) present")
    return jax.sharding.Mesh(np.array(present[:n]), ("x",),
                             axis_types=(jax.sharding.AxisType.Auto,))


def _median_time(run: Callable[[], object], budget: float, *, min_reps: int = 3,
                 max_reps: int = 30) -> float:
    """Median seconds of ``run()`` (blocked on) after two untimed runs; as many timed runs
    as fit ``budget`` (``min_reps`` to ``max_reps``)."""
    jax.block_until_ready(run())
    jax.block_until_ready(run())
    times = []
    while True:
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
        if len(times) >= max_reps or (len(times) >= min_reps and sum(times) >= budget):
            return statistics.median(times)


def _probe(run: Callable[[], object]) -> float:
    """One untimed (compiling) run, then the time of one more."""
    jax.block_until_ready(run())
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def _scale(probe_seconds: float, limit: int) -> int:
    """How many times the probed work makes a run of about ``TARGET`` seconds."""
    return int(min(limit, max(1, round(TARGET / max(probe_seconds, 1e-9)))))


def _filled(mesh, shape, dtype, value=1.0) -> jax.Array:
    """A ``shape`` array sharded on its first axis, made on the devices."""
    sharding = NamedSharding(mesh, P("x"))
    return jax.jit(lambda: jnp.full(shape, value, dtype), out_shardings=sharding)()


def _matmul_rate(mesh, dtype, budget: float) -> float:
    n, s = mesh.size, MATMUL
    f = jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))

    def runner(batch):
        a = _filled(mesh, (n * batch, s, s), dtype, 0.5)
        return functools.partial(f, a, a)

    batch = _scale(_probe(runner(1)), limit=max(1, 256 // n))
    return 2 * batch * s ** 3 / _median_time(runner(batch), budget)


def _attention(q, k, v):
    T, H = q.shape[1], q.shape[3]
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H).astype(q.dtype)
    causal = jnp.tril(jnp.ones((T, T), bool))
    scores = jnp.where(causal, scores, jnp.finfo(q.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)


def _attention_rate(mesh, budget: float) -> float:
    n, (T, N, H) = mesh.size, ATTN
    f = jax.jit(_attention)

    def runner(batch):
        q = _filled(mesh, (n * batch, T, N, H), jnp.float32, 0.5)
        return functools.partial(f, q, q, q)

    batch = _scale(_probe(runner(1)), limit=max(1, 64 // n))
    return 4 * batch * T * T * N * H / _median_time(runner(batch), budget)


def _hbm_bandwidth(mesh, budget: float) -> float:
    n = mesh.size
    per_device = int(np.clip(256 * MIB // n, 4 * MIB, 64 * MIB)) // 4
    step = jax.jit(lambda x: x * 1.0001 + 1, donate_argnums=0)
    state = [_filled(mesh, (n * per_device,), jnp.float32)]

    def run():
        state[0] = step(state[0])
        return state[0]

    seconds = _median_time(run, budget)
    del state[0]
    return 2 * 4 * per_device / seconds


def _latency(mesh, budget: float) -> float:
    def chain(x):
        return jax.lax.fori_loop(0, LATENCY_LOOP, lambda i, y: jax.lax.psum(y, "x") * 0.5, x)

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))
    x = _filled(mesh, (mesh.size * 4,), jnp.float32)
    return _median_time(lambda: f(x), budget, min_reps=5) / LATENCY_LOOP


def _all_gather_bandwidth(mesh, latency: float, budget: float) -> float:
    n = mesh.size
    shard = int(np.clip(64 * MIB // n ** 2, 64 * 1024, 4 * MIB)) // 4

    def chain(x, trips):
        def gather(i, y):
            whole = jax.lax.all_gather(y, "x", tiled=True)
            return jax.lax.dynamic_slice_in_dim(whole, (i % n) * shard, shard)
        return jax.lax.fori_loop(0, trips[0], gather, x)

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                              check_vma=False))
    x = _filled(mesh, (n * shard,), jnp.float32)
    one = jnp.ones((1,), jnp.int32)
    trips = _scale(_probe(lambda: f(x, one)), limit=256)
    per_gather = _median_time(lambda: f(x, one * trips), budget) / trips
    per_gather = max(per_gather - latency, per_gather / 2)
    return (n - 1) * shard * 4 / per_gather


def _host_bandwidth(mesh, budget: float) -> float:
    n = mesh.size
    per_device = 32 * MIB // n // 4
    x = _filled(mesh, (n * per_device,), jnp.float32)
    try:
        host = NamedSharding(mesh, P("x"), memory_kind="pinned_host")
        jax.block_until_ready(jax.device_put(x, host))
        run = functools.partial(jax.device_put, x, host)
    except (ValueError, RuntimeError, NotImplementedError):  # no pinned_host memory kind
        fresh = jax.jit(lambda y: y + 0)

        def run():  # times the ``+ 0`` too: a lower bound on the rate
            return np.asarray(fresh(x))  # a fresh array each time: arrays cache their host copy
    return per_device * 4 / _median_time(run, budget)


def calibrate(devices: int | None = None, *, seconds: float | None = None) -> hardware.Hardware:
    """The ``cpu`` profile measured on the first ``devices`` of ``jax.devices()`` (all of
    them by default; the caller sets the simulated count before JAX starts). ``seconds``
    is about the time spent in timed runs (compiling and warm-up runs come on top: about
    5 s in all for 8 devices on 2 cores). See the module docstring for what is measured."""
    seconds = SECONDS if seconds is None else seconds
    if not seconds > 0:
        raise ValueError(f"calibrate: seconds={seconds!r} must be positive")
    mesh = _mesh(devices)
    n, budget = mesh.size, seconds / PARTS
    peak = {"float32": _matmul_rate(mesh, jnp.float32, budget),
            "bfloat16": _matmul_rate(mesh, jnp.bfloat16, budget)}
    attention = min(1.0, max(1e-6, _attention_rate(mesh, budget) / peak["float32"]))
    hbm = _hbm_bandwidth(mesh, budget)
    latency = _latency(mesh, budget)
    link = hbm if n == 1 else _all_gather_bandwidth(mesh, latency, budget)
    values = {
        "name": "cpu",
        "peak_flops": peak,
        "efficiency": {"matmul": 1.0, "attention": attention},
        "hbm_bandwidth": hbm,
        "memory": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // n,
        "intra_node_bandwidth": link,
        "inter_node_bandwidth": link,
        "collective_latency": latency,
        "host_bandwidth": _host_bandwidth(mesh, budget),
        "comm_overlap": 0.0,
    }
    return hardware.from_dict(values, "cpu", "calibrate")


def calibrate_and_save(cache_dir: pathlib.Path | str, devices: int | None = None
                       ) -> tuple[hardware.Hardware, pathlib.Path]:
    """``calibrate(devices)`` written to ``hardware.calibrated_path(cache_dir)`` (where
    ``hardware.load("cpu", cache_dir)`` reads it), with notes naming the machine."""
    hw = calibrate(devices)
    n = len(jax.devices()) if devices is None else devices
    notes = (f"measured by jaxpar.planning.calibrate on {platform.machine()} with "
             f"{os.cpu_count()} cores, {n} simulated XLA:CPU devices, jax {jax.__version__}, "
             f"{datetime.date.today().isoformat()}; per-device figures with all devices "
             "running at once")
    path = hardware.calibrated_path(cache_dir)
    hardware.save(hw, path, notes=notes)
    return hw, path
