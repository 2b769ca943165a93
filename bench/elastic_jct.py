"""Average and p99 job completion time (JCT) and makespan of every elastic scheduler on a
Philly-derived synthetic trace, simulated on a 64-GPU cluster at three load levels
(issue 40, Deliver 6). Nothing runs on a GPU: the SimPy simulator
(``jaxpar.elastic.simulator``) plays the trace against each scheduler's decisions.

    python bench/elastic_jct.py [--jobs 400] [--gpus 64] [--seed 0] [--interarrivals 3600 1800 900]
        [--json bench/results/elastic_jct.json] [--png bench/figures/elastic_jct_cdf.png]
        [--notes /tmp/elastic_jct_notes.md]

Trace: ``jaxpar.elastic.traces.synthetic`` (Philly's GPU counts and heavy-tailed
durations as Gavel's Philly-derived generator draws them, Poisson arrivals; Jeon et al.,
ATC'19; Narayanan et al., OSDI'20), requests capped at the cluster. Loads by the mean
gap between arrivals: 3600 s (load ~0.4), 1800 s (the generator's default, ~0.9) and
900 s (~1.7, where a queue builds); the same seed, so the same jobs, sizes and
durations, only the arrival times stretch. Schedulers come from the registry
``jaxpar.elastic.baselines.by_name``: FIFO, SRTF, Tiresias, Pollux
(``jaxpar.elastic.pollux``) and ONES (``jaxpar.elastic.ones``).
Targets (the issue's): ONES below FIFO, SRTF and Tiresias on average JCT, and within
5% of (or below) Pollux.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxpar.elastic import baselines, simulator, traces  # noqa: E402

SCHEDULERS = ("fifo", "srtf", "tiresias", "pollux", "ones")


def make_trace(jobs: int, seed: int, interarrival_s: float, gpus: int):
    return traces.synthetic(jobs, seed, interarrival_s=interarrival_s, max_devices=gpus)


def simulate(trace, name: str, gpus: int, seed: int) -> dict:
    """One run: ``avg_jct_s``, ``p99_jct_s``, ``makespan_s`` and every job's JCT (sorted)."""
    result = simulator.simulate(trace, baselines.by_name(name, seed=seed), gpus)
    return {"avg_jct_s": result.avg_jct_s, "p99_jct_s": result.p99_jct_s, "makespan_s": result.makespan_s,
            "jct_s": sorted(result.jct_s.values())}


def table(results: dict) -> str:
    lines = ["| load | scheduler | avg JCT (h) | p99 JCT (h) | makespan (h) | avg vs ONES |",
             "|---|---|---|---|---|---|"]
    for load, by_name in results.items():
        ones = by_name["ones"]["avg_jct_s"]
        for name, r in by_name.items():
            lines.append(f"| {load} | {name} | {r['avg_jct_s'] / 3600:.2f} | {r['p99_jct_s'] / 3600:.2f} | "
                         f"{r['makespan_s'] / 3600:.1f} | {r['avg_jct_s'] / ones:.2f}x |")
    return "\n".join(lines)


def verdicts(results: dict) -> list[str]:
    """The issue's targets, one line per load: by how much ONES meets or misses each."""
    out = []
    for load, r in results.items():
        ones = r["ones"]["avg_jct_s"]
        parts = [f"{(1 - ones / r[b]['avg_jct_s']) * 100:+.0f}% vs {b}" for b in ("fifo", "srtf", "tiresias")]
        gap = (ones / r["pollux"]["avg_jct_s"] - 1) * 100
        met = all(ones < r[b]["avg_jct_s"] for b in ("fifo", "srtf", "tiresias")) and gap <= 5
        out.append(f"load {load}: ONES average JCT {', '.join(parts)} (positive: ONES shorter); "
                   f"{gap:+.1f}% against Pollux; targets {'met' if met else 'NOT met'}")
    return out


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (load, by_name) in zip(axes[0], results.items()):
        for name, r in by_name.items():
            jct = np.array(r["jct_s"]) / 3600
            ax.step(jct, np.arange(1, len(jct) + 1) / len(jct), where="post", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("JCT (hours, log)")
        ax.set_ylabel("fraction of jobs")
        ax.set_title(f"load {load}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interarrivals", type=float, nargs="+", default=[3600.0, 1800.0, 900.0],
                        help="mean seconds between arrivals, one run per value")
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULERS))
    parser.add_argument("--json", type=pathlib.Path, default=ROOT / "bench/results/elastic_jct.json")
    parser.add_argument("--png", type=pathlib.Path, default=ROOT / "bench/figures/elastic_jct_cdf.png")
    parser.add_argument("--notes", type=pathlib.Path, default=pathlib.Path("/tmp/elastic_jct_notes.md"))
    args = parser.parse_args(argv)

    results, seconds = {}, {}
    for gap in args.interarrivals:
        trace = make_trace(args.jobs, args.seed, gap, args.gpus)
        offered = sum(j.isolated_s * j.requested_devices for j in trace) / (trace[-1].arrival_s * args.gpus)
        load = f"{offered:.2f} ({gap:g} s gap)"
        results[load] = {}
        for name in args.schedulers:
            start = time.perf_counter()
            results[load][name] = simulate(trace, name, args.gpus, args.seed)
            seconds[f"{load}/{name}"] = round(time.perf_counter() - start, 1)
            print(f"load {load} {name}: avg {results[load][name]['avg_jct_s'] / 3600:.2f} h "
                  f"({seconds[f'{load}/{name}']} s)", flush=True)

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), CPU only",
            "command": "python bench/elastic_jct.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "jobs": args.jobs, "gpus": args.gpus, "seed": args.seed, "wall_s": seconds}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, args.png)
    text = "\n".join([
        "## Elastic scheduling: JCT on a Philly-derived trace (issue 40)",
        "",
        f"`{meta['command']}` on {meta['machine']}, {meta['date']}: {args.jobs} synthetic Philly-matched jobs, "
        f"{args.gpus} simulated GPUs, seed {args.seed}, 60 s scheduling rounds and a 30 s restart per resize. "
        "Load: the device-seconds the jobs ask for (alone, on their requested GPUs) over the cluster's "
        "device-seconds until the last arrival.",
        "",
        table(results),
        "",
        *[f"- {line}" for line in verdicts(results)],
        "",
        f"CDF of JCT per scheduler: `{args.png.relative_to(ROOT) if args.png.is_relative_to(ROOT) else args.png}`; "
        f"raw numbers: `{args.json.relative_to(ROOT) if args.json.is_relative_to(ROOT) else args.json}`.",
    ])
    args.notes.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
