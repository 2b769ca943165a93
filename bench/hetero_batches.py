"""Speed-proportional batches across unequal processes (HetSeq, ``data.batch_weights``):
two ``jaxpar-train`` processes on this machine, one slowed, with equal weights against
``auto`` weights, side by side in one run.

    python bench/hetero_batches.py [--steps 40] [--hogs 2] [--json PATH] [--png PATH]

Each process is pinned to a core of its own (``taskset``) and holds one CPU device of a
``data=2`` mesh (jax.distributed over gloo). Process 1 is slowed by ``--hogs`` busy
loops pinned to its core: with two, it gets about a third of its core. Three runs of
the ``tiny`` config: equal weights on idle cores (what the pair does when neither is
slow), equal weights with process 1 slowed, and ``auto`` weights with process 1
slowed (measured before the first step). The figure is each run's tokens/s per step and
their medians; nothing here is asserted (tests/test_hetero_batches.py checks that the
weighted runs compute the same losses as one process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARGS = ["tiny", "data.max_files=300", "batch_size=32", "eval.every=0", "checkpoint.every=0",
        "optimizer.warmup_steps=5"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(run_dir: pathlib.Path, weights: str, steps: int, hogs: int) -> list[dict]:
    """Two processes of one run, process 1 sharing its core with ``hogs`` busy loops;
    returns the run's metrics."""
    busy = [subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
            for _ in range(hogs)]
    port, shares = _port(), []
    try:
        procs = [subprocess.Popen(
            ["taskset", "-c", str(i), sys.executable, "-m", "jaxpar.commands.train", *ARGS, f"steps={steps}",
             f"run_dir={run_dir}", f"data.batch_weights={weights}", "--no-progress"],
            env=dict(os.environ, JAX_NUM_CPU_DEVICES="1", JAXPAR_COORDINATOR=f"127.0.0.1:{port}",
                     JAXPAR_NUM_PROCESSES="2", JAXPAR_PROCESS_ID=str(i)),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=1800)
            if p.returncode:
                raise SystemExit(f"hetero_batches: a process of {run_dir.name} failed:\n{err[-3000:]}")
            shares += [l.split(": ", 1)[-1] for l in err.splitlines() if "batch shares" in l]
    finally:
        for b in busy:
            b.kill()
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if shares:
        metrics[0]["batch_shares_log"] = shares[-1]
    return metrics


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for name, run in results["runs"].items():
        steps = [r["step"] for r in run["metrics"]][2:]
        left.plot(steps, [r["tokens_per_s"] for r in run["metrics"]][2:], label=name)
    left.set_xlabel("step")
    left.set_ylabel("tokens/s (both processes)")
    left.set_title("tokens/s per step (first two steps compile)")
    left.legend(fontsize=8)
    names = list(results["runs"])
    medians = [results["runs"][n]["median_tokens_per_s"] for n in names]
    bars = right.bar(range(len(names)), medians, color=["tab:blue", "tab:orange", "tab:green"])
    right.bar_label(bars, fmt="%.0f")
    right.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=8)
    right.set_title("median tokens/s")
    fig.suptitle(f"HetSeq batches: process 1 shares its core with {results['hogs']} busy loops "
                 f"({results['date']}, 2-core CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--json", type=pathlib.Path, default=ROOT / "bench/results/hetero_batches.json")
    parser.add_argument("--png", type=pathlib.Path, default=ROOT / "bench/figures/hetero_batches.png")
    args = parser.parse_args(argv)
    plan = [("equal weights, idle cores", "[1,1]", 0), ("equal weights, process 1 slowed", "[1,1]", args.hogs),
            ("auto weights, process 1 slowed", "auto", args.hogs)]
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "machine": f"{os.cpu_count()}-core CPU, {platform.processor() or platform.machine()}",
               "command": "python bench/hetero_batches.py " + " ".join(argv or sys.argv[1:]),
               "steps": args.steps, "hogs": args.hogs, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, weights, hogs in plan:
            metrics = run_pair(pathlib.Path(tmp) / weights.strip("[]").replace(",", "_") / str(hogs), weights,
                               args.steps, hogs)
            median = statistics.median(r["tokens_per_s"] for r in metrics[2:])
            results["runs"][name] = {"weights": weights, "hogs": hogs, "median_tokens_per_s": median,
                                     "shares": metrics[0].get("batch_shares_log"), "metrics": metrics}
            print(f"{name}: median {median:.0f} tokens/s {metrics[0].get('batch_shares_log') or ''}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    plot(results, args.png)
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
