"""``jaxpar-plan``'s side in the trainer: a config's candidates compiled, and the
plan applied to a config (``mesh=auto``, ``--out plan.yaml``).

The planner itself (``jaxpar.planning``) sees model shapes, layouts and figures; what
it needs compiled comes from ``compiled_figures`` here, which builds the very train
step ``jaxpar-train`` would run for a layout and reads the compile-only profiler.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import sys

import jax
import numpy as np
import yaml
from flax import nnx

from jaxpar.models.transformer import sharding_rules
from jaxpar.placement.sharding import shard_model as jaxpar_shard
from jaxpar.elastic.jobs import SpeedModel
from jaxpar.offload import budget as budget_lib
from jaxpar.placement.runtime import simulate_cpu_devices
from jaxpar.planning import cost
from jaxpar.planning import devices as devices_lib
from jaxpar.planning import hardware as hardware_lib
from jaxpar.planning import search, stages
from jaxpar.planning.cache import FigureCache
from jaxpar.planning.hardware import Hardware
from jaxpar.planning.layout import Layout
from jaxpar.planning.search import Plan
from jaxpar.planning.workload import Workload
from jaxpar.train import loop
from jaxpar.train.command import CommandParser, file_in_the_way
from jaxpar.train.config import Config, ConfigError, MeshConfig, load_config
from jaxpar.train.data import cache_dir_of

log = logging.getLogger(__name__)


def with_layout(cfg: Config, layout: Layout, *, offload: bool = True) -> Config:
    """``cfg`` with ``layout``'s settings (``offload=False``: state left on the device)."""
    pipeline = dataclasses.replace(cfg.pipeline, schedule=layout.schedule,
                                   microbatches=layout.microbatches if layout.pipe > 1 else None,
                                   virtual_stages=layout.virtual_stages)
    execution = dataclasses.replace(cfg.execution, seq_impl=layout.seq_impl,
                                    sequence_parallel=layout.sequence_parallel)
    tensor = tuple(layout.tensor) if isinstance(layout.tensor, tuple) else layout.tensor
    mesh = dataclasses.replace(MeshConfig() if cfg.auto_mesh else cfg.mesh, data=layout.data, fsdp=layout.fsdp, pipe=layout.pipe, seq=layout.seq, tensor=tensor)
    offload_cfg = cfg.offload
    if offload:
        offload_cfg = dataclasses.replace(cfg.offload, params=layout.offload_params,
                                          optimizer=layout.offload_optimizer)
    return dataclasses.replace(
        cfg, mesh=mesh, pipeline=pipeline, execution=execution, offload=offload_cfg,
        model=dataclasses.replace(cfg.model, remat=layout.remat),
        optimizer=dataclasses.replace(cfg.optimizer, grad_accum=layout.grad_accum))


def _built_step(cfg: Config, layout: Layout, devices):
    """``(run config, mesh, rules, train step, abstract model, pipeline schedule)`` of ``cfg``
    under ``layout`` (state on the device) on the first ``layout.devices`` devices."""
    devices = list(jax.devices() if devices is None else devices)[:layout.devices]
    run = with_layout(cfg, layout, offload=False)
    mesh = loop.build_mesh(run.mesh, devices)
    rules = sharding_rules(run.model, mesh, sequence_parallel=run.execution.sequence_parallel)
    loop._check_batch(run, mesh, rules)
    stages = loop.pipeline_schedule(run, mesh, rules)
    abstract = nnx.eval_shape(lambda: loop.build_model(run))
    tx, _ = loop.make_optimizer(run.optimizer, run.steps)
    step = loop.make_train_step(abstract, tx, mesh, rules, grad_accum=run.optimizer.grad_accum,
                                sequence=run.execution.sequence, kernels=run.execution.kernels, pipeline=stages)
    return run, mesh, rules, step, abstract, stages


def compiled_figures(cfg: Config, layout: Layout, devices=None) -> dict:
    """The compile-only profile of ``cfg``'s train step under ``layout`` (state on the
    device: XLA:CPU does not tell host from device memory, ``jaxpar.profiler``), on the
    first ``layout.devices`` of ``devices`` (default ``jax.devices()``), with
    ``collectives_by_axes``. Everything that changes the program is an argument of
    ``make_train_step`` (its ``Execution`` bound when built), so candidates compiled one
    after another in one process do not see each other's settings."""
    from jaxpar.profiler import profile

    run, mesh, _, step, abstract, stages = _built_step(cfg, layout, devices)
    figures = profile(step.compile(abstract, run.batch_size, run.seq_len), mesh=mesh)
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
    ``data=N`` on the ``N`` devices present. The kernels' peak rates come from large
    matmuls; a training step's small ones, the softmax and the dispatch between
    operations run slower, and this one factor carries that into every prediction."""
    reference = load_config("tiny", [])
    layout = Layout(data=devices)
    measured = float(np.median(measured_steps(reference, layout)))
    predicted = cost.step_time(workload(reference), layout, hw, devices_per_node=devices,
                               compiled=compiled_figures(reference, layout))
    kernels = predicted.compute - cost.elementwise_bytes(workload(reference), layout) / hw.hbm_bandwidth
    rest = predicted.total - kernels
    scale = max(measured - rest, 0.1 * kernels) / kernels
    hw = dataclasses.replace(hw, efficiency={k: v / scale for k, v in hw.efficiency.items()})
    hardware_lib.save(hw, hardware_lib.calibrated_path(cache_dir),
                      notes=f"peak rates measured by jaxpar.planning.calibrate on {devices} simulated devices; "
                            f"efficiencies fit to a measured tiny data={devices} step ({measured * 1e3:.1f} ms, "
                            f"predicted {predicted.total * 1e3:.1f} ms at efficiency 1)")
    return hw


# ----------------------------------------------------------------------------- the plan


ALIASES = ("devices", "device_memory", "hardware", "devices_per_node")


def workload(cfg: Config) -> Workload:
    return Workload(cfg.model, cfg.batch_size, cfg.seq_len)


def overlay(layout: Layout) -> dict:
    """``layout``'s settings as nested config sections (what ``--out`` writes)."""
    out: dict = {}
    for dotted, value in layout.overrides().items():
        section, key = dotted.split(".")
        out.setdefault(section, {})[key] = value
    return out


def write_overlay(path: pathlib.Path, plan: Plan, cfg_name: str) -> None:
    best = plan.best.summary(plan.work, plan.hardware)
    header = (f"# jaxpar-plan {cfg_name}: {best['layout']} on {plan.devices} {plan.hardware.name} devices\n"
              f"# predicted: {best['memory_bytes'] / 2**30:.2f} GiB per device ({best['memory_source']}), "
              f"{best['step_time_s'] * 1e3:.1f} ms a step, {best['tokens_per_s']:,.0f} tokens/s, "
              f"MFU {best['mfu']:.1%}\n# apply: jaxpar-train {cfg_name} {path.name}\n")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(header + yaml.safe_dump(overlay(plan.best.layout), sort_keys=False))
    tmp.replace(path)


def hardware_for(name: str | None, cache_dir: pathlib.Path, devices=None) -> Hardware:
    """The profile ``name`` names; None: the present device's kind (``cpu`` on CPUs,
    measured now and saved if this machine has no calibrated profile yet)."""
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
    analytic only)."""
    if devices_per_node > devices:
        devices_per_node = devices
    compile = None
    if compile_on is not None and cfg.plan.compile_top > 0:
        compile = functools.partial(compiled_figures, cfg, devices=compile_on)
    cache = FigureCache(cache_dir_of(cfg.cache_dir))
    try:
        return search.search(workload(cfg), devices, hw, device_memory=device_memory,
                             devices_per_node=devices_per_node, compile=compile, compile_top=cfg.plan.compile_top,
                             cache=cache, backend=backend, progress=progress)
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
    return with_layout(dataclasses.replace(cfg, mesh=MeshConfig()), plan.best.layout)


def job_speed(cfg: Config, hw: Hardware, devices: int, batches) -> SpeedModel:
    """A job's ``jaxpar.elastic.SpeedModel`` from the cost model: the predicted step time
    of ``cfg``'s model, data-parallel on 1, 2, 4, ... up to ``devices`` devices (one node
    each), at each of ``batches`` that the device count divides, fitted by least
    squares (what JOBS.yaml's ``speed: plan`` gives ``jaxpar-cluster``); ``ConfigError``
    where no point can be predicted."""
    points, d = [], 1
    while d <= devices:
        for batch in sorted(set(batches)):
            if batch % d:
                continue
            layout = dataclasses.replace(Layout(data=d), remat=cfg.model.remat)
            try:
                t = cost.step_time(Workload(cfg.model, batch, cfg.seq_len), layout, hw, devices_per_node=d).total
            except ValueError:  # a layout the shapes cannot take
                continue
            points.append((d, batch, t))
        d *= 2
    if not points:
        raise ConfigError(f"no data-parallel layout of batches {sorted(set(batches))} on up to {devices} devices "
                          "for the cost model to predict")
    return SpeedModel.fit(points)


# ----------------------------------------------------------------------------- uneven stages


def layout_of(cfg: Config, devices: int) -> Layout:
    """``cfg``'s own mesh, pipeline and placement as a ``Layout`` (``with_layout``'s
    inverse; ``mesh.data`` unset: what ``devices`` leave; ``offload`` ``auto``: device)."""
    m, p = cfg.mesh, cfg.pipeline
    tensor = tuple(m.tensor) if isinstance(m.tensor, (list, tuple)) else m.tensor
    layout = Layout(fsdp=m.fsdp, pipe=m.pipe, seq=m.seq, tensor=tensor, schedule=p.schedule,
                    microbatches=(p.microbatches or 2 * m.pipe) if m.pipe > 1 else 1, virtual_stages=p.virtual_stages,
                    seq_impl=cfg.execution.seq_impl, sequence_parallel=cfg.execution.sequence_parallel,
                    remat=cfg.model.remat, grad_accum=cfg.optimizer.grad_accum,
                    offload_params="host" if cfg.offload.params == "host" else "device",
                    offload_optimizer="host" if cfg.offload.optimizer == "host" else "device")
    return dataclasses.replace(layout, data=m.data or max(1, devices // layout.devices))


def stage_comparison(cfg: Config, devices: int, hw: Hardware, devices_per_node: int) -> dict:
    """``pipeline.stage_layers=auto`` against the even split on ``cfg``'s layout and
    ``pipeline.device_profile`` (``jaxpar.planning.stages.compare``); ``ConfigError``
    (one line) where the profile or the layout cannot give one."""
    try:
        profile = devices_lib.load(cfg.pipeline.device_profile, cfg.mesh.pipe)
        model = stages.stage_model(workload(cfg), layout_of(cfg, devices), hw, devices_per_node=devices_per_node,
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


def profile_devices(cfg: Config, out: pathlib.Path) -> str:
    """``--profile-devices``: times one layer of ``cfg.model`` forward and backward over
    ``[batch_size, seq_len, D]`` on each device present and writes their profile to
    ``out``, one pipeline rank per device in ``jax.devices()`` order; returns its text."""
    found = jax.devices()
    profile, seconds = devices_lib.measure(cfg.model, cfg.batch_size, cfg.seq_len, found)
    header = (f"jaxpar-plan --profile-devices: one layer of model dim={cfg.model.dim} forward and backward over "
              f"[{cfg.batch_size}, {cfg.seq_len}, {cfg.model.dim}], median of 7, on {len(found)} devices\n"
              f"seconds: {', '.join(f'{s * 1e3:.2f} ms' for s in seconds)}\n"
              "speed: the fastest device's time over each one's; memory: the backend's bytes_limit "
              "(null: it does not say, unbounded)\n"
              "a pipeline's ranks in order: keep the entries of the devices of mesh.pipe, one per rank")
    return devices_lib.save(profile, out, header)


def _parser() -> CommandParser:
    parser = CommandParser(
        prog="jaxpar-plan", description="Rank the parallel layouts of a jaxpar config on N devices.",
        epilog="Plan keys: devices=N device_memory=80GiB hardware=h100|h200|a100|cpu|FILE devices_per_node=8 "
               "(also as plan.*); any jaxpar-train key=value (batch_size=, seq_len=, model.*).")
    parser.add_argument("config", nargs="?", help="shipped config name (tiny, small, 1b) or a YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--out", type=pathlib.Path, metavar="PLAN.yaml",
                        help="write the best layout as a config overlay: jaxpar-train CONFIG PLAN.yaml")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--top", type=int, default=12, metavar="K", help="rows of the table (12)")
    parser.add_argument("--all", action="store_true",
                        help="list every candidate (default: the best of each mesh)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine's cpu hardware profile (on devices=N simulated devices, "
                             "default 8) into CACHE_DIR/hardware/cpu.yaml, then plan if a CONFIG is given")
    parser.add_argument("--profile-devices", action="store_true",
                        help="time one layer of CONFIG's model (default tiny) forward and backward on each device "
                             "present (devices=N: N simulated CPU devices) and write their pipeline device profile, "
                             "for pipeline.device_profile, to --out (default devices.yaml)")
    parser.add_argument("--cache-dir", type=pathlib.Path, metavar="DIR",
                        help="where compiled figures and the cpu profile are kept (default: jaxpar-train's cache_dir)")
    return parser


def _split_aliases(overrides: list[str]) -> list[str]:
    """``devices=8`` -> ``plan.devices=8``, the other overrides as they are."""
    return [f"plan.{item}" if item.partition("=")[0] in ALIASES else item for item in overrides]


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    say = lambda message: print(f"jaxpar-plan: {message}", file=sys.stderr, flush=True)  # noqa: E731
    alone = args.calibrate or args.profile_devices  # what runs without a CONFIG
    if args.config is None and not alone:
        parser.error("give a CONFIG to plan (or --calibrate, --profile-devices)")
    if args.config is not None and "=" in args.config:
        args.overrides, args.config = [args.config, *args.overrides], None
        if not alone:
            parser.error("give a CONFIG to plan before its key=value settings")
    cfg, cache_dir = _config(parser, args)
    if args.profile_devices:
        if cfg.plan.devices:
            simulate_cpu_devices(cfg.plan.devices)
        out = args.out or pathlib.Path("devices.yaml")
        print(profile_devices(cfg, out), end="")
        say(f"wrote {out}: pipeline.device_profile={out}")
        return 0
    devices = cfg.plan.devices or (8 if args.calibrate else None)
    if devices is None:
        parser.error("give devices=N (how many devices to plan for)")
    per_node = cfg.plan.devices_per_node or (8 if devices % 8 == 0 else devices)
    hardware = cfg.plan.hardware or "h100"
    if not args.calibrate or args.config is not None:
        try:  # every bad input is refused before anything is compiled or written
            hw = hardware_for(hardware, cache_dir) if not (args.calibrate and hardware == "cpu") else None
        except ConfigError as e:
            parser.error(str(e))
    stage_split = None
    if cfg.pipeline.stage_layers == "auto" and not args.calibrate:
        try:
            stage_split = stage_comparison(cfg, devices, hw, per_node)
        except ConfigError as e:
            parser.error(str(e))
    compiles = args.calibrate or (cfg.plan.compile_top > 0 and devices <= cfg.plan.compile_devices)
    if compiles:  # compiled for XLA:CPU on simulated devices, whatever the machine has
        jax.config.update("jax_platforms", "cpu")
        simulate_cpu_devices(devices)
    if args.calibrate:
        from jaxpar.planning.calibrate import calibrate_and_save

        hw, path = calibrate_and_save(cache_dir)
        hw = calibrate_step(hw, cache_dir, devices)
        say(f"wrote {path}: {hw.peak_flops['float32'] / 1e9:.1f} GFLOP/s float32 per device "
            f"(a train step's matmuls reach {hw.efficiency['matmul']:.0%} of it), "
            f"{hw.hbm_bandwidth / 1e9:.1f} GB/s memory, {hw.intra_node_bandwidth / 1e9:.2f} GB/s between "
            f"devices, {hw.collective_latency * 1e6:.0f} us a collective, on {devices} simulated devices")
        if args.config is None:
            return 0
        hw = hardware_for(hardware, cache_dir)
    try:
        plan = run_plan(cfg, devices, hw=hw, device_memory=cfg.plan.memory or hw.memory, devices_per_node=per_node,
                        compile_on=jax.devices() if compiles else None, backend="cpu",
                        progress=None if args.json else say)
    except ConfigError as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps(plan.to_json() | ({"pipeline_stages": stage_split} if stage_split else {})))
    else:
        print(search.table(plan, args.top, every=args.all))
        if stage_split:
            print(describe_stages(stage_split))
    if args.out is not None:
        write_overlay(args.out, plan, args.config)
        say(f"wrote {args.out}: jaxpar-train {args.config} {args.out}")
    return 0


def _config(parser, args) -> tuple:
    """The command's config and cache directory, every bad setting refused (exit 2)
    before anything is compiled or written."""
    overrides = _split_aliases(args.overrides)
    for item in overrides:
        key, _, value = item.partition("=")
        if key in ("plan.devices", "plan.devices_per_node"):
            try:
                number = yaml.safe_load(value)
            except yaml.YAMLError:
                number = value
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                parser.error(f"{key.removeprefix('plan.')}={value!r} must be a positive integer")
    try:
        cfg = load_config(args.config or "tiny", overrides)
    except ConfigError as e:
        parser.error(str(e))
    if args.cache_dir is not None:
        cfg = dataclasses.replace(cfg, cache_dir=str(args.cache_dir))
    cache_dir = cache_dir_of(cfg.cache_dir)
    if file := file_in_the_way(cache_dir):
        parser.error(f"cache_dir {cache_dir}: {file} is a file, not a directory")
    if args.out is not None and (args.out.is_dir() or file_in_the_way(args.out.parent)):
        parser.error(f"--out {args.out}: not a file path (a directory is in the way)")
    return cfg, cache_dir

def main_entry() -> None:
    # jaxpar-plan compiles dozens of candidates, and XLA's partitioner warns about each
    # one it compiles inefficiently ("Involuntary full rematerialization"): pages of text
    # for a table that ranks them anyway. XLA reads TF_CPP_MIN_LOG_LEVEL once, when JAX
    # loads it (importing jaxpar did), so the command starts again with it set;
    # TF_CPP_MIN_LOG_LEVEL=0 in the environment shows them.
    if "TF_CPP_MIN_LOG_LEVEL" not in os.environ and os.path.isfile(sys.argv[0]):  # the installed script
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sys.exit(main())
