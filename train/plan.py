"""The planner in training: a config's candidate layouts compiled (``compiled_figures``,
``measured_steps``), ranked (``run_plan``) and applied (``Config.layout`` is the
planner's own ``jaxpar.layout.Layout``: ``dataclasses.replace(cfg, layout=...)``), which
``mesh=auto`` runs for the devices present (``auto``), and
``pipeline.stage_layers=auto``'s split (``auto_stage_layers``).

The planner itself (``jaxpar.planning``) sees model shapes, layouts and figures; what
it needs compiled comes from ``compiled_figures`` here, which builds the very train
step ``jaxpar-train`` would run for a layout and reads the compile-only profiler.
``jaxpar-plan``'s command line (its arguments, table and ``--out`` overlay) is
``jaxpar.commands.plan``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib

import jax
import numpy as np
from flax import nnx

from jaxpar.models.transformer import sharding_rules
from jaxpar.placement.sharding import shard_model as jaxpar_shard
from jaxpar.offload import budget as budget_lib
from jaxpar.planning import cost
from jaxpar.planning import devices as devices_lib
from jaxpar.planning import hardware as hardware_lib
from jaxpar.planning import search, stages
from jaxpar.planning.cache import FigureCache
from jaxpar.planning.hardware import Hardware
from jaxpar.layout import Layout
from jaxpar.planning.layout import Space
from jaxpar.planning.search import Plan
from jaxpar.planning.workload import Workload
from jaxpar.train import loop
from jaxpar.train.config import Config, ConfigError, MeshConfig, load_config
from jaxpar.train.data import cache_dir_of

log = logging.getLogger(__name__)

# calibrate_step's reference: a config and its overrides, run under data=N, and the
# steps timed (tests take a smaller one: a rougher, faster profile).
CALIBRATION_REFERENCE = ("tiny", ())
CALIBRATION_STEPS = 5

# The planner reads its compiled programs, never runs them: on a CPU (where it compiles its
# simulated devices) XLA's LLVM optimisation is off and its older elemental emitters
# replace the MLIR fusion ones. Measured on 1b (2 layers, 64 devices, 2026-11-30): a
# pipe=2 x seq=4 x tensor=8 candidate compiled in 7.2 s instead of 13.3 and fsdp=8 x
# tensor=8 in 2.5 instead of 6.7, their argument, output and collective bytes the same
# and their temporary bytes and FLOPs within 0.05% (LLVM's level alone: the same figures,
# 9.8 and 5.0 s).
# The scheduler is XLA:CPU's default, named: a train step that asks for the memory-optimized
# one at run time (``train.step.SIMULATED_DEVICES``: pipelines on simulated devices) is
# still profiled under the schedule the memory model is measured against.
FIGURE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False,
                  "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"}


def _built_step(cfg: Config, layout: Layout, devices):
    """``(run config, mesh, rules, train step, abstract model, pipeline schedule)`` of ``cfg``
    under ``layout`` (state on the device) on the first ``layout.devices`` devices."""
    devices = list(jax.devices() if devices is None else devices)[:layout.devices]
    on_device = dataclasses.replace(layout, offload_params="device", offload_optimizer="device")
    run = dataclasses.replace(cfg, mesh=MeshConfig() if cfg.auto_mesh else cfg.mesh, layout=on_device)
    mesh = loop.build_mesh(run, devices)
    rules = sharding_rules(run.model, mesh, sequence_parallel=run.layout.sequence_parallel)
    loop._check_batch(run, mesh, rules)
    stages = loop.pipeline_schedule(run, mesh, rules)
    abstract = nnx.eval_shape(lambda: loop.build_model(run))
    tx, _ = loop.make_optimizer(run.optimizer, run.steps)
    step = loop.make_train_step(abstract, tx, mesh, rules, grad_accum=run.layout.grad_accum,
                                sequence=run.layout.sequence(run.execution.seq_layout), kernels=run.execution.kernels,
                                pipeline=stages)
    return run, mesh, rules, step, abstract, stages


def compiled_figures(cfg: Config, layout: Layout, batch_size: int | None = None, *, devices=None) -> dict:
    """The compile-only profile of ``cfg``'s train step under ``layout`` (state on the
    device: XLA:CPU does not tell host from device memory, ``jaxpar.profiler``), on the
    first ``layout.devices`` of ``devices`` (default ``jax.devices()``), with
    ``collectives_by_axes``; ``batch_size``: in place of ``cfg``'s (the planner's
    ``compiled_shape``). Everything that changes the program is an argument of
    ``make_train_step`` (its ``Execution`` bound when built), so candidates compiled one
    after another in one process do not see each other's settings."""
    from jaxpar.profiler import profile

    if batch_size is not None:
        cfg = dataclasses.replace(cfg, batch_size=batch_size)
    run, mesh, _, step, abstract, stages = _built_step(cfg, layout, devices)
    options = FIGURE_OPTIONS if mesh.devices.flat[0].platform == "cpu" else None
    figures = profile(step.compile(abstract, run.batch_size, run.seq_len, options), mesh=mesh)
    if stages is not None:
        figures["pipeline_bubble"] = stages.bubble()
    return figures


def measured_steps(cfg: Config, layout: Layout, devices=None, *, steps: int = 5) -> list[float]:
    """The seconds of each of ``steps`` train steps of ``cfg`` under ``layout`` (after
    one that compiles, not counted), on one batch of random tokens: the step alone, as
    the planner predicts it (no data loading, no metrics)."""
    import time

    run, mesh, rules, step, abstract, _ = _built_step(cfg, layout, devices)
    with jax.set_mesh(mesh):
        params, opt_state = step.init(jax.jit(lambda: jaxpar_shard(loop.build_model(run), mesh, rules))())
    tokens = np.random.default_rng(0).integers(0, run.model.vocab_size, (run.batch_size, run.seq_len + 1))
    rows = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "positions": np.broadcast_to(np.arange(run.seq_len), (run.batch_size, run.seq_len)),
            "segment_ids": np.ones((run.batch_size, run.seq_len)), "mask": np.ones((run.batch_size, run.seq_len))}
    batch = {k: jax.device_put(np.asarray(v, np.int32), step.batch_sharding) for k, v in rows.items()}
    times = []
    for _ in range(steps + 1):
        began = time.perf_counter()
        params, opt_state, out = step(params, opt_state, batch)
        float(out["loss"])
        times.append(time.perf_counter() - began)
    return times[1:]


def calibrate_step(hw: Hardware, cache_dir: pathlib.Path, devices: int) -> Hardware:
    """``hw`` (the measured ``cpu`` profile) with its matmul and attention efficiencies
    scaled so that the model predicts a measured reference step: ``tiny`` under
    ``data=N`` on the ``N`` devices present (``CALIBRATION_REFERENCE``). The kernels'
    peak rates come from large matmuls; a training step's small ones, the softmax and the dispatch between
    operations run slower, and this one factor carries that into every prediction."""
    reference = load_config(CALIBRATION_REFERENCE[0], list(CALIBRATION_REFERENCE[1]))
    layout = Layout(data=devices)
    measured = float(np.median(measured_steps(reference, layout, steps=CALIBRATION_STEPS)))
    predicted = cost.step_time(workload(reference), layout, hw, devices_per_node=devices,
                               compiled=compiled_figures(reference, layout))
    kernels = predicted.compute - cost.elementwise_bytes(workload(reference), layout) / hw.hbm_bandwidth
    rest = predicted.total - kernels
    scale = max(measured - rest, 0.1 * kernels) / kernels
    hw = dataclasses.replace(hw, efficiency={k: v / scale for k, v in hw.efficiency.items()})
    name = " ".join((CALIBRATION_REFERENCE[0], *CALIBRATION_REFERENCE[1]))
    hardware_lib.save(hw, hardware_lib.calibrated_path(cache_dir),
                      notes=f"peak rates measured by jaxpar.planning.calibrate on {devices} simulated devices; "
                            f"efficiencies fit to a measured {name} data={devices} step ({measured * 1e3:.1f} ms, "
                            f"predicted {predicted.total * 1e3:.1f} ms at efficiency 1)")
    return hw


# ----------------------------------------------------------------------------- the plan


def workload(cfg: Config) -> Workload:
    return Workload(cfg.model, cfg.batch_size, cfg.seq_len)


def hardware_for(name: str | None, cache_dir: pathlib.Path, devices=None) -> Hardware:
    """The profile ``name`` names; None: the present device's kind. ``cpu`` (named or
    present) is measured now and saved if ``cache_dir`` has no calibrated profile yet
    (``jaxpar-plan`` calibrates itself first, after refusing bad input)."""
    if name is None:
        device = (devices or jax.devices())[0]
        name = hardware_lib.shipped_for(device.device_kind) or ("cpu" if device.platform == "cpu" else None)
        if name is None:
            raise ConfigError(f"no hardware profile for {device.device_kind!r}: give plan.hardware=FILE")
    if name == "cpu" and not hardware_lib.calibrated_path(cache_dir).is_file():
        from jaxpar.planning.calibrate import calibrate_and_save

        log.info("calibrating the cpu hardware profile (once per machine)")
        measured, _ = calibrate_and_save(cache_dir)
        calibrate_step(measured, cache_dir, len(devices or jax.devices()))
    try:
        return hardware_lib.load(name, cache_dir)
    except hardware_lib.HardwareError as e:
        raise ConfigError(str(e)) from None


def run_plan(cfg: Config, devices: int, *, hw: Hardware, device_memory: int, devices_per_node: int,
             compile_on=None, backend: str = "cpu", progress=None) -> Plan:
    """The ranked plan; ``compile_on``: the devices to compile candidates on (None:
    analytic only; a candidate needing more of them than there are is left estimated)."""
    if devices_per_node > devices:
        devices_per_node = devices
    compile = None
    if compile_on is not None and cfg.plan.compile_top > 0:
        compile = functools.partial(compiled_figures, cfg, devices=compile_on)
    cache = FigureCache(cache_dir_of(cfg.cache_dir))
    try:
        return search.search(workload(cfg), devices, hw, device_memory=device_memory,
                             devices_per_node=devices_per_node, space=Space(base=cfg.layout),
                             compile=compile, compile_top=cfg.plan.compile_top,
                             cache=cache, backend=backend, progress=progress,
                             compile_devices=None if compile_on is None else len(compile_on))
    except search.PlanError as e:
        raise ConfigError(str(e)) from None


def auto(cfg: Config) -> Config:
    """``mesh=auto``: ``cfg`` with the plan's best layout for the devices present, said in
    one line (``ConfigError`` when nothing fits)."""
    devices = jax.devices()
    cache_dir = cache_dir_of(cfg.cache_dir)
    hw = hardware_for(cfg.plan.hardware, cache_dir, devices)
    memory = cfg.plan.memory or budget_lib.device_memory(devices[0]) or hw.memory
    per_node = cfg.plan.devices_per_node or jax.local_device_count()
    plan = run_plan(cfg, len(devices), hw=hw, device_memory=memory, devices_per_node=per_node,
                    compile_on=devices, backend=jax.default_backend())
    best = plan.best.summary(plan.work, hw)
    log.info("mesh=auto: %s; predicted %s per device of %s (%s), %.1f ms a step, %s tokens/s, MFU %.1f%% on %s; "
             "%d candidates, %d compiled, %d from the cache, %.1f s", best["layout"],
             budget_lib.format_bytes(best["memory_bytes"]), budget_lib.format_bytes(memory), best["memory_source"],
             best["step_time_s"] * 1e3, f"{best['tokens_per_s']:,.0f}", best["mfu"] * 100, hw.name,
             plan.considered, plan.compiled, plan.cached, plan.seconds)
    return dataclasses.replace(cfg, mesh=MeshConfig(), layout=plan.best.layout)


# ----------------------------------------------------------------------------- uneven stages


def stage_comparison(cfg: Config, devices: int, hw: Hardware, devices_per_node: int) -> dict:
    """``pipeline.stage_layers=auto`` against the even split on ``cfg``'s layout and
    ``pipeline.device_profile`` (``jaxpar.planning.stages.compare``); ``ConfigError``
    (one line) where the profile or the layout cannot give one."""
    try:
        profile = devices_lib.load(cfg.pipeline.device_profile, cfg.layout.pipe)
        model = stages.stage_model(workload(cfg), cfg.layout.resolved(devices), hw, devices_per_node=devices_per_node,
                                   backend="cpu" if hw.name == "cpu" else "gpu")
        return {"device_profile": profile.source, **stages.compare(profile, model)}
    except ValueError as e:
        raise ConfigError(str(e)) from None


def auto_stage_layers(cfg: Config) -> tuple[int, ...]:
    """``pipeline.stage_layers=auto`` in a run: the layers per pipeline rank for
    ``pipeline.device_profile`` on ``cfg``'s layout over the devices present
    (``jaxpar.planning.stages``), logged with the predicted step against the even
    split's. Speed 1 is ``plan.hardware``'s device (unset: the present device's shipped
    profile, else ``h100``'s figures: only the head's time against a layer's and the
    sends depend on it). ``ConfigError`` (one line): the profile is missing, bad or
    lists another number of ranks than ``mesh.pipe``, interleaved stages, or no split
    fits the ranks' memory."""
    devices = jax.devices()
    name = cfg.plan.hardware or hardware_lib.shipped_for(devices[0].device_kind) or "h100"
    try:
        hw = hardware_lib.load(name, cache_dir_of(cfg.cache_dir))
    except hardware_lib.HardwareError as e:
        raise ConfigError(str(e)) from None
    result = stage_comparison(cfg, len(devices), hw, cfg.plan.devices_per_node or jax.local_device_count())
    log.info("%s", describe_stages(result))
    return tuple(result["stage_layers"])


def describe_stages(result: dict) -> str:
    """One line: ``stage_comparison``'s split and predicted steps."""
    even = ("does not fit" if result["even_step_s"] is None
            else f"{result['even_step_s'] * 1e3:.3g} ms, auto {result['speedup']:.2f}x faster")
    return (f"pipeline.stage_layers=auto from {result['device_profile']}: {result['stage_layers']}, "
            f"{result['auto_step_s'] * 1e3:.3g} ms a step predicted; even {result['even_stage_layers']}: {even}")
