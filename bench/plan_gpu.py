"""The planner on a GPU: its prediction for ``small`` and ``1b`` on the GPU present
against XLA:GPU's compiled memory and the measured step time.

    python bench/plan_gpu.py [--configs small 1b] [--hardware h100] [--steps 5] [--json PATH]

For each config, on the devices present: the plan (``jaxpar.train.plan.run_plan``, its
candidates compiled by XLA:GPU on those devices, so every memory figure of a compiled
candidate is the GPU program's own), then the planner's best layout trained for
``--steps`` steps on random tokens (``measured_steps``, the median). Printed: the layout, predicted
and compiled memory per device, predicted and measured step time. Without a GPU: one
line, exit 0. Not yet run: no GPU has been lent since the planner landed
(BENCHMARKS.md, "Planning").
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["small", "1b"])
    parser.add_argument("--hardware", default="h100", help="the profile the prediction uses (h100, h200, a100)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    if jax.default_backend() != "gpu":
        print(f"plan_gpu: no GPU here (jax backend: {jax.default_backend()}); nothing to measure")
        return 0
    from jaxpar.offload.budget import device_memory
    from jaxpar.train import plan as plan_lib
    from jaxpar.train.config import load_config
    from jaxpar.train.data import cache_dir_of

    devices = jax.devices()
    rows = []
    for name in args.configs:
        cfg = load_config(name, [])
        hw = plan_lib.hardware_for(args.hardware, cache_dir_of(cfg.cache_dir))
        memory = device_memory(devices[0]) or hw.memory
        plan = plan_lib.run_plan(cfg, len(devices), hw=hw, device_memory=memory, devices_per_node=len(devices),
                                 compile_on=devices, backend="gpu")
        best = plan.best.summary(plan.work, hw)
        measured = float(np.median(plan_lib.measured_steps(cfg, plan.best.layout, steps=args.steps)))
        rows.append({"config": name, "device": devices[0].device_kind, "devices": len(devices), **best,
                     "measured_step_time_s": measured})
        print(f"{name}: {best['layout']}: memory {best['memory_bytes'] / 2**30:.2f} GiB ({best['memory_source']}, "
              f"XLA:GPU), step predicted {best['step_time_s'] * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms, "
              f"MFU predicted {best['mfu']:.1%}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
