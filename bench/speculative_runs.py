"""Run to run: the same ``bench/speculative.py`` rows across several of its runs.

    python bench/speculative_runs.py RUN.json [RUN.json ...] [--labels L ...] [--png P] [--target X]

On a shared machine one run's speedup is one draw: a 2-core VM's neighbours move a
round's cost in ``ar`` steps by a fifth from one hour to the next (our reading: ``ar``
steps are mostly memory traffic and verification passes more arithmetic, and the
neighbours take from one or the other), so a table taken once can land either side of
a target. This prints, per row (method and gamma, at each batch) of any run, its
speedup in each run that has it and their median, low and high, with ``ar``'s tokens/s
per run (the machine's state), and plots each row's speedup over ``ar``: one line per
row, sorted by median (best on top), each run a dot, the median marked, the break-even
line at 1.0x and, with ``--target X``, the target's line.

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


def plot(runs, speedups, path: pathlib.Path, target: float | None = None) -> None:
    """Each row's speedup over ``ar`` across runs: a line per row, best median on top,
    a dot per run, the median as a bar, the low-high range as a thin line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    kept = {key: measured(values) for key, values in speedups.items() if key[0] != "ar"}
    order = sorted(kept, key=lambda key: statistics.median(kept[key]))  # bottom to top: best on top
    batches = {batch for _, _, batch in kept}
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.42 * len(order)))
    for y, key in enumerate(order):
        got = kept[key]
        median = statistics.median(got)
        ax.plot([min(got), max(got)], [y, y], color="0.75", linewidth=1.2, zorder=1)
        jitter = [0.0] if len(got) == 1 else [0.22 * (i / (len(got) - 1) - 0.5) for i in range(len(got))]
        ax.scatter(got, [y + j for j in jitter], s=26, color="C0", alpha=0.7, edgecolors="none", zorder=2)
        ax.plot([median], [y], marker="|", markersize=20, markeredgewidth=2.5, color="black", zorder=3)
        runs_note = f", {len(got)} of {len(runs)} runs" if len(got) < len(runs) else ""
        ax.text(1.01, y, f"{median:.2f}x  ({min(got):.2f}-{max(got):.2f}x{runs_note})", va="center",
                fontsize=8, transform=ax.get_yaxis_transform())
    method_labels = [f"{method}, gamma {gamma}" + (f", batch {batch}" if len(batches) > 1 else "")
                     for method, gamma, batch in order]
    ax.set_yticks(range(len(order)), method_labels, fontsize=9)
    ax.set_ylim(-0.7, len(order) - 0.3)
    ax.text(1.01, len(order) - 0.45, "median (lowest-highest)", fontsize=8, fontweight="bold", va="bottom",
            transform=ax.get_yaxis_transform())
    ax.axvline(1.0, color="gray", linestyle="--", linewidth=1, zorder=0)
    handles = [Line2D([], [], color="C0", alpha=0.7, marker="o", linestyle="none", markersize=5, label="one run"),
               Line2D([], [], color="black", marker="|", linestyle="none", markersize=12, markeredgewidth=2.5,
                      label="median of the runs"),
               Line2D([], [], color="0.75", linewidth=1.2, label="lowest to highest"),
               Line2D([], [], color="gray", linestyle="--", linewidth=1, label="1.0x: as fast as ar")]
    if target is not None:
        ax.axvline(target, color="C3", linestyle=":", linewidth=1.5, zorder=0)
        handles.append(Line2D([], [], color="C3", linestyle=":", linewidth=1.5, label=f"target {target:g}x"))
    ax.set_xlabel("wall-time speedup over ar (higher is better \u2192)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.9 / fig.get_figheight()),
              ncol=len(handles), frameon=False)
    meta = runs[0][1]["meta"]
    ar = [r["tokens_per_s"] for _, run in runs for r in run["results"] if r["method"] == "ar"]
    ar_note = f"\nar itself ran at {min(ar):.1f}-{max(ar):.1f} tokens/s across the runs" if ar else ""
    ax.set_title(f"{pathlib.Path(meta['target']).name}: speedup over ar in {len(runs)} runs, "
                 f"{meta['prompts']} prompts, {meta['max_new_tokens']} new tokens, {meta['device']}{ar_note}",
                 fontsize=9, pad=14)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=pathlib.Path, nargs="+", help="bench/speculative.py --json files")
    parser.add_argument("--labels", nargs="+", help="one label per run (default: when it began)")
    parser.add_argument("--png", type=pathlib.Path)
    parser.add_argument("--target", type=float, help="draw the target speedup's line on the picture (1.5, say)")
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
        plot(runs, speedups, args.png, args.target)


if __name__ == "__main__":
    main()
