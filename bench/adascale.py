"""AdaScale at larger batches (issue 50 item 5, ``optimizer.batch_scaling=adascale``):
loss against samples of ``tiny`` trained at 1x, 2x and 4x the base batch, each run as
long as AdaScale's progress says (``steps`` base-batch steps: the sum of its gains).

Each run is ``jaxpar-train tiny`` (in this process, ``jaxpar.train.loop.train``) on 8
simulated CPU devices, data parallel, with ``optimizer.batch_scaling=adascale``,
``eval.noise_scale=true`` and ``optimizer.base_batch_size`` the base batch, from the
same seed: at 1x the gain is 1 and the run is the plain schedule; at kx each step is
worth its gain (between 1 and k) in base-batch steps, the schedule read at that
progress and the rate times the gain's square root (AdaptDL's rule for Adam), and the
run ends when the progress reaches ``steps``. AdaScale's claim is that the curves
against progress overlay, so that a kx run needs fewer steps (as few as ``steps / k``
where noise dominates the gradient) for the same loss; against samples, a larger
batch spends more samples for it unless the gain is the whole scale.

    python bench/adascale.py [--steps 120] [--scales 1 2 4] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import tempfile
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

from jaxpar.train.config import load_config  # noqa: E402
from jaxpar.train.loop import train  # noqa: E402

HERE = pathlib.Path(__file__).parent
KEEP = ("step", "loss", "val_loss", "adascale_gain", "adascale_progress", "lr", "step_time_s")


def run(scale: int, args, run_dir: pathlib.Path) -> dict:
    """One ``jaxpar-train tiny`` run at ``scale`` times the base batch: its records."""
    batch = args.base_batch * scale
    cfg = load_config("tiny", [f"steps={args.steps}", f"batch_size={batch}", f"run_dir={run_dir}",
                               "optimizer.batch_scaling=adascale", f"optimizer.base_batch_size={args.base_batch}",
                               "eval.noise_scale=true", f"eval.every={args.eval_every}", "checkpoint.every=0",
                               *args.overrides])
    began = time.perf_counter()
    history = train(cfg, progress=False)
    return {"scale": scale, "batch": batch, "steps_run": len(history), "seconds": time.perf_counter() - began,
            "samples": len(history) * batch, "records": [{k: r[k] for k in KEEP if k in r} for r in history]}


def plot(runs: list[dict], path: pathlib.Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_samples, by_progress, gains) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in runs:
        recs, label = r["records"], f"{r['scale']}x ({r['batch']}; {r['steps_run']} steps)"
        samples = [x["step"] * r["batch"] for x in recs]
        line, = by_samples.plot(samples, [x["loss"] for x in recs], label=label, lw=1.2)
        by_progress.plot([x["adascale_progress"] for x in recs], [x["loss"] for x in recs], label=label, lw=1.2,
                         color=line.get_color())
        val = [(x["step"] * r["batch"], x["val_loss"]) for x in recs if "val_loss" in x]
        if val:
            by_samples.plot(*zip(*val), "o", color=line.get_color(), ms=4)
        gains.plot([x["step"] for x in recs], [x["adascale_gain"] for x in recs], label=label, lw=1.2,
                   color=line.get_color())
    by_samples.set(xlabel="samples trained", ylabel="training loss (dots: validation)",
                   title="loss against samples")
    by_progress.set(xlabel="AdaScale progress (base-batch steps)", ylabel="training loss",
                    title=f"loss against progress (each run ends at {steps})")
    gains.set(xlabel="step", ylabel="gain (base-batch steps per step)", title="AdaScale's gain")
    for ax in (by_samples, by_progress, gains):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("tiny on 8 simulated CPU devices, optimizer.batch_scaling=adascale")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="each run's length in base-batch steps")
    parser.add_argument("--base-batch", type=int, default=16)
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--eval-every", type=int, default=30)
    parser.add_argument("--overrides", nargs="*", default=[], help="more jaxpar-train key=value (a smoke's sizes)")
    parser.add_argument("--json", type=pathlib.Path, default=HERE / "results" / "adascale.json")
    parser.add_argument("--png", type=pathlib.Path, default=HERE / "figures" / "adascale.png")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="adascale_") as tmp:
        runs = [run(k, args, pathlib.Path(tmp) / f"x{k}") for k in args.scales]
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "steps": args.steps, "base_batch": args.base_batch, "overrides": args.overrides, "runs": runs}
    for r in runs:
        last = r["records"][-1]
        print(f"{r['scale']}x batch {r['batch']}: {r['steps_run']} steps, {r['samples']} samples, "
              f"progress {last['adascale_progress']:.1f}, final loss {last['loss']:.3f}"
              + (f", val {last['val_loss']:.3f}" if "val_loss" in last else "") + f", {r['seconds']:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    plot(runs, args.png, args.steps)
    return result


if __name__ == "__main__":
    main()
