"""Run to run: the same ``bench/speculative.py`` rows across several of its runs.

    python bench/speculative_runs.py RUN.json [RUN.json ...] [--labels L ...] [--png P]

On a shared machine one run's speedup is one draw: a 2-core VM's neighbours move a
round's cost in ``ar`` steps by a fifth from one hour to the next (our reading: ``ar``
steps are mostly memory traffic and verification passes more arithmetic, and the
neighbours take from one or the other), so a table taken once can land either side of
a target. This prints, per row (method and gamma, at each batch) of any run, its
speedup in each run that has it and their median, low and high, with ``ar``'s tokens/s
per run (the machine's state), and plots each row's speedup by run with the break-even
line.

Runs are labelled by ``--labels`` (one per file), else by the time the run began
(``meta.began_utc``), else by the file's name. Every run must be of the same target,
prompts and new tokens, and every file a run's JSON (one line otherwise, exit 1): their
rows measure the same work.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys


def load(paths: list[pathlib.Path], labels: list[str] | None) -> list[tuple[str, dict]]:
    """``(label, run)`` per JSON file of ``bench/speculative.py --json``."""
    runs = []
    for i, path in enumerate(paths):
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"{path}: not a bench/speculative.py --json file ({type(e).__name__}: {e})")
        if not isinstance(run, dict) or not {"meta", "results"} <= run.keys():
            sys.exit(f"{path}: not a bench/speculative.py --json file (no meta and results)")
        label = labels[i] if labels else run["meta"].get("began_utc") or path.stem
        runs.append((label, run))
    same = ("target", "prompts", "prompt_tokens", "max_new_tokens", "kinds")
    first = runs[0][1]["meta"]
    for label, run in runs[1:]:
        for key in same:
            if run["meta"].get(key) != first.get(key):
                sys.exit(f"run {label} measured other work: {key} {run['meta'].get(key)!r} against "
                         f"{first.get(key)!r} in {runs[0][0]}")
    return runs


def rows(runs: list[tuple[str, dict]]) -> dict[tuple[str, int | None, int], list[float | None]]:
    """Speedups per ``(method, gamma, batch)`` of any run, in run order (None in the runs
    without that row)."""
    by_run = [{(r["method"], r["gamma"], r["batch"]): r["speedup"] for r in run["results"]} for _, run in runs]
    keys = list(dict.fromkeys(k for b in by_run for k in b))
    return {k: [b.get(k) for b in by_run] for k in keys}


def measured(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def ar_speed(run: dict) -> str:
    return " / ".join(f"{r['tokens_per_s']:.1f}" for r in run["results"] if r["method"] == "ar")


def plot(runs, speedups, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(runs))
    gammas = sorted({gamma for _, gamma, _ in speedups if gamma})
    marker = {gamma: "os^Dv"[i % 5] for i, gamma in enumerate(gammas)}  # a marker per gamma
    for i, ((method, gamma, batch), values) in enumerate(speedups.items()):
        if method == "ar":
            continue
        ax.plot(xs, [float("nan") if v is None else v for v in values], marker=marker[gamma], color=f"C{i % 10}",
                linestyle="-" if batch == 1 else "--",
                label=f"{method}, gamma {gamma}, batch {batch} (median {statistics.median(measured(values)):.2f}x)")
    ax.axhline(1.0, color="gray", linestyle="--", label="break-even (ar)")
    days = {label.split(" ", 1)[0] for label, _ in runs}
    one_day = len(days) == 1 and all(" " in label for label, _ in runs)  # then the ticks give the time alone
    ticks = [label.split(" ", 1)[1].removesuffix(" UTC") if one_day else label for label, _ in runs]
    ax.set_xticks(list(xs), [f"{tick}\n{ar_speed(run)}" for tick, (_, run) in zip(ticks, runs)], fontsize=7)
    ax.set_xlabel(f"run (began {days.pop()}, UTC), and ar's tokens/s in it" if one_day
                  else "run, and ar's tokens/s in it", fontsize=8)
    ax.set_ylabel("wall-time speedup over ar")
    meta = runs[0][1]["meta"]
    fig.suptitle(f"{pathlib.Path(meta['target']).name}: the same rows in {len(runs)} runs, "
                 f"{meta['prompts']} prompts, {meta['max_new_tokens']} new tokens, {meta['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=pathlib.Path, nargs="+", help="bench/speculative.py --json files")
    parser.add_argument("--labels", nargs="+", help="one label per run (default: when it began)")
    parser.add_argument("--png", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"--labels needs one label per run: {len(args.labels)} labels for {len(args.runs)} runs")
    runs = load(args.runs, args.labels)
    speedups = rows(runs)
    print("| method | gamma | batch | " + " | ".join(label for label, _ in runs) + " | median | low-high |")
    print("|---|---|---|" + "---|" * len(runs) + "---|---|")
    print("| ar tokens/s | | | " + " | ".join(ar_speed(run) for _, run in runs) + " | | |")
    for (method, gamma, batch), values in speedups.items():
        if method == "ar":
            continue
        got = measured(values)
        print(f"| {method} | {gamma} | {batch} | " + " | ".join("" if v is None else f"{v:.2f}x" for v in values)
              + f" | {statistics.median(got):.2f}x | {min(got):.2f}-{max(got):.2f}x |")
    if args.png:
        plot(runs, speedups, args.png)


if __name__ == "__main__":
    main()
