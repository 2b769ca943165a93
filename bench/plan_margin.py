"""The planner's step-time margin (``jaxpar.planning.search.TIME_MARGIN``): how far the
step time predicted from a candidate's compiled figures (its collectives by axis) can
fall below the analytic estimate. Plans each config on 8 simulated devices with a wide
margin (``--search-margin``, so that more than the planner's own bound compiles) and
reports, over every compiled candidate, compiled / estimated step time.

    nice python bench/plan_margin.py --json bench/results/plan_margin.json

Each run compiles into a fresh cache directory (nothing read from an older cache).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUNS = (("tiny", (), "h100"), ("small", (), "h100"), ("tiny", ("seq_len=512",), "a100"))


def main(argv=None) -> int:
    import jax

    from jaxpar.planning import cost, hardware, search
    from jaxpar.train.config import load_config
    from jaxpar.train.plan import run_plan, workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--search-margin", type=float, default=0.10)
    parser.add_argument("--limit", type=int, default=8, help="plan.compile_top (3x as many compiles at most)")
    args = parser.parse_args(argv)
    search.TIME_MARGIN = args.search_margin
    rows = []
    for name, extra, hw_name in RUNS:
        with tempfile.TemporaryDirectory() as cache:
            cfg = load_config(name, [*extra, f"cache_dir={cache}", f"plan.compile_top={args.limit}"])
            hw = hardware.load(hw_name)
            plan = run_plan(cfg, 8, hw=hw, device_memory=hw.memory, devices_per_node=8, compile_on=jax.devices())
            work = workload(cfg)
            for c in plan.candidates:
                if c.source != "compiled":
                    continue
                est = cost.step_time(work, c.layout, hw, devices_per_node=8).total
                rows.append({"config": " ".join((name, *extra)), "hardware": hw_name, "layout": c.layout.describe(),
                             "estimated_s": est, "compiled_s": c.time.total, "ratio": c.time.total / est})
            print(f"{name} {' '.join(extra)} {hw_name}: {plan.compiled} compiled", file=sys.stderr)
    distinct = {(r["config"], r["hardware"], r["estimated_s"], r["compiled_s"]): r for r in rows}.values()
    ratios = sorted(r["ratio"] for r in distinct)
    print(f"{len(ratios)} distinct compiled candidates: compiled / estimated step from {ratios[0]:.3f} to "
          f"{ratios[-1]:.3f}, median {ratios[len(ratios) // 2]:.3f}; largest drop below the estimate "
          f"{max(0.0, 1 - ratios[0]):.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"search_margin": args.search_margin, "rows": list(distinct)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
