"""Where the memory and the time of the planner's best layouts go: per device, the
memory by part and the predicted step by part, for the best candidate of each of the
best meshes of one ``jaxpar-plan`` run.

    python bench/plan_split.py [--config 1b] [--set devices=8 hardware=h100 ...] [--top 8]
        [--json bench/results/plan_split_1b.json] [--png bench/figures/plan_split_1b.png]
    python bench/plan_split.py --from bench/results/plan_split_1b.json --png ...   # redraw

Runs ``jaxpar-plan CONFIG SET... --json`` once (the compiled figures come from its disk
cache when an earlier plan made them). Memory bars are the analytic model's parts
(parameters, optimizer state, gradients, activations, workspace, batch) with the
compiled program's total marked where the candidate was compiled; time bars are the
step-time model's split (compute, exposed communication, pipeline bubble, offload).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = (("params", "parameters", "#1f77b4"), ("optimizer", "optimizer state", "#6baed6"),
         ("gradients", "gradients", "#2ca02c"), ("activations", "saved activations", "#ff7f0e"),
         ("workspace", "workspace (logits, a layer's working set, gathered weights)", "#fdae6b"),
         ("batch", "batch", "#9467bd"))
SPLIT = (("compute", "compute", "#1f77b4"), ("communication", "exposed communication", "#d62728"),
         ("bubble", "pipeline bubble", "#7f7f7f"), ("offload", "offload transfers", "#9467bd"))
GIB = 2 ** 30


def best_of_each_mesh(candidates: list[dict], top: int) -> list[tuple[int, dict]]:
    out, seen = [], set()
    for rank, c in enumerate(candidates, 1):
        o = c["overrides"]
        mesh = tuple(json.dumps(o[f"mesh.{k}"]) for k in ("data", "fsdp", "pipe", "seq", "tensor"))
        if mesh not in seen:
            seen.add(mesh)
            out.append((rank, c))
        if len(out) == top:
            break
    return out


def draw(result: dict, png: pathlib.Path, top: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = best_of_each_mesh(result["candidates"], top)
    fig, (mem, step) = plt.subplots(1, 2, figsize=(14, 1.9 + 0.55 * len(rows)), sharey=True)
    ys = list(range(len(rows)))[::-1]
    labels = [f"#{rank} {c['layout']}" for rank, c in rows]
    left = [0.0] * len(rows)
    for key, label, colour in PARTS:
        values = [c["memory_parts"][key] / GIB for _, c in rows]
        mem.barh(ys, values, left=left, height=0.6, color=colour, label=label, edgecolor="white", linewidth=0.5)
        left = [a + b for a, b in zip(left, values)]
    for y, (_, c) in zip(ys, rows):
        if c["memory_source"] == "compiled":
            total = c["memory_bytes"] / GIB
            mem.plot([total, total], [y - 0.38, y + 0.38], color="black", linewidth=2)
            mem.text(max(total, left[ys.index(y)]), y, f" compiled {total:,.1f}", va="center", fontsize=7)
        else:
            mem.text(left[ys.index(y)], y, " (estimate only)", va="center", fontsize=7)
    limit = result["device_memory"] / GIB
    mem.axvline(limit, color="black", linestyle=":", linewidth=1)
    mem.text(limit, len(rows) - 0.4, f" device memory {limit:,.0f} GiB", fontsize=7, va="bottom")
    mem.set_yticks(ys, labels, fontsize=8)
    mem.set_xlabel("GiB per device (estimate by part; black tick: the compiled program's total)")
    mem.set_title("memory per device", fontsize=10)
    left = [0.0] * len(rows)
    for key, label, colour in SPLIT:
        values = [c["split"][key] * 1e3 for _, c in rows]
        step.barh(ys, values, left=left, height=0.6, color=colour, label=label, edgecolor="white", linewidth=0.5)
        left = [a + b for a, b in zip(left, values)]
    for y, (_, c), total in zip(ys, rows, left):
        step.text(total, y, f" {total:,.1f} ms, MFU {c['mfu']:.0%}", va="center", fontsize=7)
    step.set_xlim(0, max(left) * 1.3)
    step.set_xlabel(f"predicted ms per step on {result['hardware']} (lower is better)")
    step.set_title("step time by part", fontsize=10)
    for ax in (mem, step):
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.9 / fig.get_figheight(), 1, 1))
    for ax, ncol in ((mem, 2), (step, 2)):
        box = ax.get_position()
        fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="lower center", ncol=ncol, frameon=False,
                   bbox_to_anchor=(box.x0 + box.width / 2, 0.0))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="1b")
    parser.add_argument("--set", nargs="*", default=["devices=8", "hardware=h100"], metavar="KEY=VALUE")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--png", type=pathlib.Path)
    parser.add_argument("--from", dest="source", type=pathlib.Path, help="redraw from a stored --json")
    args = parser.parse_args(argv)
    if args.source:
        stored = json.loads(args.source.read_text())
        result, meta = stored["plan"], stored["meta"]
    else:
        command = [sys.executable, "-c", "import sys; from jaxpar.commands.plan import main; sys.exit(main(sys.argv[1:]))",
                   args.config, *args.set, "--json"]
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")})
        if out.returncode != 0:
            raise SystemExit(f"jaxpar-plan failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}")
        result = json.loads(out.stdout)
        meta = {"command": " ".join(["python", *sys.argv]) if argv is None else "main(...)",
                "plan": f"jaxpar-plan {args.config} {' '.join(args.set)} --json",
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    for rank, c in best_of_each_mesh(result["candidates"], args.top):
        print(f"#{rank:<4} {c['layout']:<46} {c['memory_bytes'] / GIB:7.1f} GiB ({c['memory_source']}) "
              f"{c['step_time_s'] * 1e3:8.1f} ms  MFU {c['mfu']:.1%}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "plan": result}) + "\n")
    if args.png:
        shown = " ".join(w for w in meta["plan"].split() if not w.startswith("cache_dir="))
        draw(result, args.png, args.top,
             f"{shown}: the best layout of each of the {args.top} best meshes, "
             f"{result['devices']} devices ({meta['date'][:10]})")
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
