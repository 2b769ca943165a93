"""``jaxpar-train CONFIG [key=value ...]`` (also ``python -m jaxpar.train``).

CONFIG is a shipped config (``tiny``, ``small``, ``1b``; ``glide`` trains a GliDe draft
for ``target_run_dir=DIR``) or a YAML path; overrides are dotted keys (``mesh.fsdp=4
model.layers=2 steps=30 run_dir=runs/x``). Exit codes: 0
done, 2 bad config or arguments (nothing written), 1 a run that could not start or go on.
"""

from __future__ import annotations

import os
import sys

from jaxpar.placement.runtime import initialize_distributed, simulate_cpu_devices
from jaxpar.train.command import CommandParser


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
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    devices = args.simulate_devices or int(os.environ.get("JAX_NUM_CPU_DEVICES", "8"))
    try:
        simulate_cpu_devices(devices)
        initialize_distributed()
    except ValueError as e:
        print(f"jaxpar-train: error: {e}", file=sys.stderr)
        return 2

    from jaxpar.train.config import ConfigError, load_config
    from jaxpar.train.loop import TrainingError, train

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"jaxpar-train: error: {e}", file=sys.stderr)
        return 2
    try:
        history = train(cfg, progress=not args.no_progress)
    except (TrainingError, ValueError, FileNotFoundError) as e:
        print(f"jaxpar-train: error: {e}", file=sys.stderr)
        return 1
    if history:
        last = history[-1]
        val = next((h["val_loss"] for h in reversed(history) if "val_loss" in h), None)
        print(f"step {last['step']}: loss {last['loss']:.3f}"
              + (f", validation loss {val:.3f}" if val is not None else "")
              + f"; run in {cfg.run_dir}")
    return 0


def main_entry() -> None:
    sys.exit(main())
