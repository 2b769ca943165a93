"""``jaxpar-plan CONFIG devices=N [--out PLAN.yaml] [--json]``: the parallel layouts of
a config on N devices, ranked by the planner (``jaxpar.planning``) and printed as a
table; ``--out`` writes the best as a config overlay (``jaxpar-train CONFIG
PLAN.yaml``); ``--calibrate`` measures this machine's ``cpu`` hardware profile (which
``hardware=cpu`` also measures on first use, saying so on stderr and as ``calibrated``
in ``--json``), ``--profile-devices`` the devices' pipeline profile. Every bad input is
refused in one line (exit 2) before anything is compiled or written.

The table (``jaxpar.planning.search.table``): first, when the question is wrong (the
best candidate far below what its compute alone reaches), one line saying so and what
would help (``jaxpar.planning.advice``); then the ranked rows; then the search's counts,
one line saying how many candidates were compiled and why (the bound: every candidate
that could still rank first), and the bounds. ``--json``: the same as one object
(``advice``, ``compile_bound``, ``margins``, ``unverified``, ``candidates``, ...).

The command line alone: what a run also uses (the candidates compiled, the plan, the
hardware profile, the uneven pipeline split) is ``jaxpar.train.plan``'s, where
``mesh=auto`` runs it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

import jax
import yaml

from jaxpar.commands.common import CommandParser
from jaxpar.inputs import InputError
from jaxpar.placement.runtime import simulate_cpu_devices
from jaxpar.planning import devices as devices_lib
from jaxpar.planning import search
from jaxpar.planning.calibrate import calibrate_and_save
from jaxpar.planning.hardware import calibrated_path
from jaxpar.layout import PLANNED, Layout
from jaxpar.planning.search import Plan
from jaxpar.train.config import Config, load_config
from jaxpar.train.data import cache_dir_of, file_in_the_way
from jaxpar.train.plan import calibrate_step, describe_stages, hardware_for, run_plan, stage_comparison

ALIASES = ("devices", "device_memory", "hardware", "devices_per_node")


def overlay(layout: Layout) -> dict:
    """``layout``'s settings as nested config sections (what ``--out`` writes): every one
    the planner chooses, so that the config it overlays reloads with exactly ``layout``."""
    out: dict = {}
    for dotted, value in layout.settings(PLANNED).items():
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
    # hardware=cpu without a calibrated profile calibrates on first use (cached)
    calibrating = args.calibrate or (hardware == "cpu" and args.config is not None
                                     and not calibrated_path(cache_dir).is_file())
    hw = None
    if args.config is not None:
        try:  # every bad input is refused before anything is compiled or written
            hw = hardware_for("h100" if hardware == "cpu" and calibrating else hardware, cache_dir)
            if cfg.pipeline.stage_layers == "auto":
                stage_comparison(cfg, devices, hw, per_node)  # (checked here; recomputed on the cpu profile)
        except InputError as e:
            parser.error(str(e))
    # compiled for XLA:CPU on simulated devices, whatever the machine has: at most
    # plan.compile_devices of them (a candidate compiles with data cut, on fewer devices;
    # one that needs more than there are stays estimated, and the plan says so)
    compiles = args.calibrate or cfg.plan.compile_top > 0
    if compiles or calibrating:
        jax.config.update("jax_platforms", "cpu")
        simulate_cpu_devices(min(devices, cfg.plan.compile_devices) if compiles else min(devices, 8))
    calibrated = None
    if calibrating:
        calibrated = _calibrate(cache_dir, say)
        if args.config is None:
            return 0
        hw = hardware_for(hardware, cache_dir)
    try:
        stage_split = stage_comparison(cfg, devices, hw, per_node) if cfg.pipeline.stage_layers == "auto" else None
        plan = run_plan(cfg, devices, hw=hw, device_memory=cfg.plan.memory or hw.memory, devices_per_node=per_node,
                        compile_on=jax.devices() if compiles else None, backend="cpu",
                        progress=None if args.json else say)
    except InputError as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps(plan.to_json() | ({"pipeline_stages": stage_split} if stage_split else {})
                         | ({"calibrated": str(calibrated)} if calibrated else {})))
    else:
        print(search.table(plan, args.top, every=args.all))
        if stage_split:
            print(describe_stages(stage_split))
    if args.out is not None:
        write_overlay(args.out, plan, args.config)
        say(f"wrote {args.out}: jaxpar-train {args.config} {args.out}")
    return 0


def _calibrate(cache_dir: pathlib.Path, say) -> pathlib.Path:
    """Measures this machine's ``cpu`` profile on the simulated devices present into
    ``cache_dir`` (``--calibrate``, or ``hardware=cpu``'s first use), said in one line;
    returns where it wrote it."""
    devices = len(jax.devices())
    say(f"calibrating the cpu hardware profile on {devices} simulated devices (once: cached in {cache_dir})")
    hw, path = calibrate_and_save(cache_dir)
    hw = calibrate_step(hw, cache_dir, devices)
    say(f"wrote {path}: {hw.peak_flops['float32'] / 1e9:.1f} GFLOP/s float32 per device "
        f"(a train step's matmuls reach {hw.efficiency['matmul']:.0%} of it), "
        f"{hw.hbm_bandwidth / 1e9:.1f} GB/s memory, {hw.intra_node_bandwidth / 1e9:.2f} GB/s between "
        f"devices, {hw.collective_latency * 1e6:.0f} us a collective, on {devices} simulated devices")
    return path


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
    except InputError as e:
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
