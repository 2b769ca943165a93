"""``jaxpar-train CONFIG [key=value ...]`` (also ``python -m jaxpar.commands.train``).

CONFIG is a shipped config (``tiny``, ``small``, ``1b``; ``glide`` trains a GliDe draft
for ``target_run_dir=DIR``) or a YAML path; overrides are dotted keys (``mesh.fsdp=4
model.layers=2 steps=30 run_dir=runs/x``). Exit codes: 0
done, 2 bad config or arguments (nothing written), 1 a run that could not start or go on,
130 / 143 stopped by SIGINT / SIGTERM at a step boundary, that step saved (a second
signal exits at once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

import jax

from jaxpar.commands.common import CommandParser, add_compile_cache_flags, use_compile_cache
from jaxpar.inputs import InputError
from jaxpar.placement.runtime import initialize_distributed, simulate_cpu_devices


def _parser() -> CommandParser:
    """Flags may come anywhere: ``jaxpar-train tiny --no-progress steps=3``."""
    parser = CommandParser(
        prog="jaxpar-train", description="Train a jaxpar model.",
        epilog="Keys: run_dir steps seed batch_size seq_len dry_run mesh.* model.* data.* "
               "optimizer.* checkpoint.every checkpoint.keep eval.every ...",
    )
    parser.add_argument("config", help="shipped config name (tiny, small, 1b, glide) or a YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument(
        "--simulate-devices", type=int, default=None, metavar="N",
        help="CPU devices to simulate (default: $JAX_NUM_CPU_DEVICES, else 8); ignored on GPUs",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_compile_cache_flags(parser, cache_dir=False)  # cache_dir= is a config key
    return parser


@contextlib.contextmanager
def _log_lines():
    """jaxpar's log lines as the command's own, one line each (orbax's import gives the
    root logger a handler that would prefix them with their level and logger): from
    the lead process, what the run is doing (the data built, resumed or started, the
    step compiling: ``logging.INFO``); from every process, what went wrong (a checkpoint
    skipped, nothing to do). As before on leaving (``main`` also runs in-process)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("jaxpar-train: %(message)s"))
    log = logging.getLogger("jaxpar")
    propagate, level = log.propagate, log.level
    log.propagate = False
    log.setLevel(logging.INFO if jax.process_index() == 0 else logging.WARNING)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate
        log.setLevel(level)


@contextlib.contextmanager
def _ctrl_c_exits_at_once():
    """Ctrl-C exits at once, with one line and status 130. The training loop takes the
    first Ctrl-C itself (to stop at a step boundary, ``jaxpar.train.stopping``) and
    passes the next here. (A ``KeyboardInterrupt`` would print orbax's traceback of the
    save it broke, and the interpreter's exit would wait for orbax's threads.)"""
    def handler(signum, frame):
        sys.stdout.flush()
        print("jaxpar-train: interrupted", file=sys.stderr, flush=True)
        os._exit(130)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    devices = args.simulate_devices or int(os.environ.get("JAX_NUM_CPU_DEVICES", "8"))
    try:
        simulate_cpu_devices(devices)
        initialize_distributed()
    except ValueError as e:
        print(f"jaxpar-train: error: {e}", file=sys.stderr)
        return 2

    # Here, once the arguments are read: the trainer loads flax, optax and orbax (0.7 s),
    # which --help and a bad flag answer without.
    from jaxpar.train.config import load_config
    from jaxpar.train.loop import TrainingError, check_output_dirs, train
    from jaxpar.train.stopping import Stopped

    try:
        cfg = load_config(args.config, args.overrides)
        check_output_dirs(cfg)  # before the compilation cache goes into cache_dir
    except InputError as e:
        print(f"jaxpar-train: error: {e}", file=sys.stderr)
        return 2
    use_compile_cache(cfg.cache_dir, not args.no_compile_cache)
    try:
        with _log_lines(), _ctrl_c_exits_at_once():
            history = train(cfg, progress=not args.no_progress)
    except InputError as e:  # found once the mesh is built or the step compiled (an offload budget no plan fits)
        print(f"jaxpar-train: error: {e}", file=sys.stderr)
        return 2
    except (TrainingError, ValueError, FileNotFoundError) as e:
        print(f"jaxpar-train: error: {e}", file=sys.stderr)
        return 1
    except Stopped as e:
        print(f"jaxpar-train: {e}", file=sys.stderr)
        return 128 + e.signum
    if history:
        last = history[-1]
        val = next((h["val_loss"] for h in reversed(history) if "val_loss" in h), None)
        print(f"step {last['step']}: loss {last['loss']:.3f}"
              + (f", validation loss {val:.3f}" if val is not None else "")
              + f"; run in {cfg.run_dir}")
    return 0


def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":  # python -m jaxpar.commands.train
    main_entry()
