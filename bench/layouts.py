"""Parallel layouts of one train step, compared by the compile-only profiler: per-device
memory and the collective bytes each device sends per step.

For each layout (mesh axis sizes, and any other override it names), ``python -m
jaxpar.commands.train CONFIG dry_run=true mesh.K=V ... --simulate-devices N`` compiles the train
step on abstract inputs and prints its profile (``jaxpar.profiler.profile``; README,
"Compile-only profiler"). Nothing runs: the figures are the compiled program's own,
exact, and the same on any machine with the same JAX, XLA flags and config. Always
compiled for XLA:CPU (``JAX_PLATFORMS=cpu``, N simulated devices), whatever accelerator
the machine has; temporaries are XLA:CPU's buffer assignment, not a GPU's.

    python bench/layouts.py [--config 1b] [--devices 8] [--layouts "data=8" "fsdp=8" ...]
        [--set KEY=VALUE ...] [--json PATH] [--png PATH]
    python bench/layouts.py --smoke [--json PATH] [--png PATH]   # tiny, 2 layers, 3 layouts

A layout is one argument of space-separated ``key=value``s; a key without a dot is a
mesh axis (``fsdp=4`` is ``mesh.fsdp=4``; ``tensor=[2,2]`` is Optimus 2D), a dotted key
any ``jaxpar-train`` override (``execution.sequence_parallel=true``). ``data`` left out
takes the devices the other axes leave. ``--set`` overrides apply to every layout.

Printed: a markdown table per layout of ``argument_bytes`` (parameters, optimizer state
and the batch), ``temp_bytes``, ``peak_bytes`` and ``collective_bytes`` with its split
by kind (all per device, per step). The picture: per layout, memory (arguments +
temporaries) beside collective bytes by kind, GiB per device.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

LAYOUTS = ("data=8", "fsdp=8", "data=2 fsdp=4", "tensor=8", "fsdp=2 tensor=4", "data=2 tensor=[2,2]",
           "seq=2 fsdp=4", "pipe=2 fsdp=4")
SMOKE = {"config": "tiny", "layouts": ("data=8", "fsdp=8", "data=2 tensor=4"), "set": ("model.layers=2",)}
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB = 2 ** 30


def overrides(layout: str) -> list[str]:
    """``jaxpar-train`` overrides of a layout: ``"data=2 tensor=[2,2]"`` ->
    ``["mesh.data=2", "mesh.tensor=[2,2]"]``."""
    out = []
    for item in layout.split():
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise SystemExit(f"layout {layout!r}: {item!r} is not key=value")
        out.append(item if "." in key else f"mesh.{key}={value}")
    return out


def describe(layout: str, profile: dict | None = None) -> str:
    """What a layout's axes are, in words (the picture's second tick line); a pipeline's
    schedule and microbatches from its ``profile``."""
    profile = profile or {}
    words = []
    for item in layout.split():
        key, _, value = item.partition("=")
        if key == "data":
            words.append("data parallel")
        elif key == "fsdp":
            words.append("FSDP")
        elif key == "tensor":
            words.append("tensor 2D (SUMMA)" if value.startswith("[") else "tensor 1D (Megatron)")
        elif key == "seq":
            words.append("sequence (ring)")
        elif key == "pipe":
            schedule = {"1f1b": "1F1B", "gpipe": "GPipe"}.get(profile.get("pipeline_schedule"),
                                                             profile.get("pipeline_schedule"))
            words.append(f"pipeline ({schedule}, {profile['pipeline_microbatches']} microbatches)"
                         if schedule else "pipeline")
        elif key == "execution.sequence_parallel" and value == "true":
            words.append("+ Megatron SP")
    return " + ".join(words).replace("+ +", "+")


def profile(config: str, layout: str, devices: int, extra: list[str]) -> dict:
    """The dry run's profile of ``config`` under ``layout`` (one subprocess)."""
    command = [sys.executable, "-m", "jaxpar.commands.train", config, "dry_run=true", *overrides(layout), *extra,
               "--simulate-devices", str(devices)]
    began = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    seconds = time.perf_counter() - began
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines or not lines[-1].startswith("{"):
        tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"layout {layout!r}: the dry run failed (exit {out.returncode}):\n{tail}")
    return {"layout": layout, "overrides": overrides(layout), "seconds": round(seconds, 1),
            "profile": json.loads(lines[-1])}


def kinds_present(rows: list[dict]) -> list[str]:
    return [k for k in KINDS if any(r["profile"]["collectives"].get(k, 0) for r in rows)]


def table(rows: list[dict]) -> list[str]:
    """The markdown table, exact bytes."""
    kinds = kinds_present(rows)
    lines = ["| layout | argument bytes | temp bytes | peak bytes | collective bytes sent | "
             + " | ".join(kinds) + " |" if kinds else "| layout | argument bytes | temp bytes | peak bytes | "
             "collective bytes sent |"]
    lines.append("|---" * (5 + len(kinds)) + "|")
    for row in rows:
        p = row["profile"]
        cells = [row["layout"], *(f"{p[k]:,}" for k in ("argument_bytes", "temp_bytes", "peak_bytes",
                                                          "collective_bytes")),
                 *(f"{p['collectives'].get(k, 0):,}" for k in kinds)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def draw(rows: list[dict], png: pathlib.Path, title: str) -> None:
    """Per layout (a row, the first on top): memory per device (arguments, temporaries)
    and, beside it, collective bytes sent per device per step by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, comm) = plt.subplots(1, 2, figsize=(13, 1.6 + 0.62 * len(rows)), sharey=True)
    ys = list(range(len(rows)))[::-1]
    labels = [f"{r['layout']}\n{describe(r['layout'], r['profile'])}" for r in rows]
    parts = (("argument_bytes", "arguments: parameters, optimizer state, batch", "#1f77b4"),
             ("temp_bytes", "temporaries (activations, gradients, workspace)", "#9ecae1"))
    colours = dict(zip(KINDS, ("#2ca02c", "#d62728", "#9467bd", "#8c564b", "#ff7f0e")))
    biggest = max(max(r["profile"]["argument_bytes"] + r["profile"]["temp_bytes"], r["profile"]["collective_bytes"])
                  for r in rows)
    unit, scale = ("GiB", GIB) if biggest >= GIB else ("MiB", 2 ** 20)
    memory = [[(r["profile"][key] / scale) for r in rows] for key, _, _ in parts]
    kinds = kinds_present(rows)
    traffic = [[r["profile"]["collectives"].get(kind, 0) / scale for r in rows] for kind in kinds]
    for ax, segments, key_total in ((mem, [(values, label, c) for values, (_, label, c) in zip(memory, parts)], None),
                                    (comm, [(values, kind, colours[kind]) for values, kind in zip(traffic, kinds)],
                                     "collective_bytes")):
        left = [0.0] * len(rows)
        for values, label, colour in segments:
            ax.barh(ys, values, left=left, height=0.62, color=colour, label=label, edgecolor="white", linewidth=0.5)
            left = [a + b for a, b in zip(left, values)]
        totals = []
        for y, r in zip(ys, rows):
            p = r["profile"]
            total = (p["argument_bytes"] + p["temp_bytes"] if key_total is None else p[key_total]) / scale
            note = f"  (arguments {p['argument_bytes'] / scale:,.1f})" if key_total is None else ""
            ax.text(total, y, f" {total:,.1f}{note}", va="center", fontsize=8)
            totals.append(total)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        ax.set_xlim(0, max(totals) * (1.45 if key_total is None else 1.1))
    mem.set_yticks(ys, labels, fontsize=8)
    mem.set_xlabel(f"{unit} per device (lower is better)")
    mem.set_title("memory per device (arguments + temporaries)", fontsize=10)
    comm.set_xlabel(f"{unit} sent per device per step (lower is better)")
    comm.set_title("collective traffic per device per step, by kind", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight(), 1, 1))  # half an inch below for the legends
    for ax, ncol in ((mem, 1), (comm, 3)):
        box = ax.get_position()
        fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=ncol, frameon=False,
                   bbox_to_anchor=(box.x0 + box.width / 2, 0.0))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="1b", help="a shipped config or a YAML file (default 1b)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (8)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), help="each: space-separated key=value")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every layout")
    parser.add_argument("--smoke", action="store_true", help="tiny, 2 layers, 3 layouts: seconds, for the tests")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--png", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.layouts, args.set = SMOKE["config"], list(SMOKE["layouts"]), list(SMOKE["set"])

    from jaxpar.train.config import load_config

    cfg = load_config(args.config, args.set)
    rows = []
    for layout in args.layouts:
        rows.append(profile(args.config, layout, args.devices, args.set))
        print(f"{layout}: compiled in {rows[-1]['seconds']} s", file=sys.stderr, flush=True)
    for line in table(rows):
        print(line)
    meta = {"command": " ".join(["python", *sys.argv]) if argv is None else "main(...)",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "jax": importlib.metadata.version("jax"), "config": args.config, "set": args.set,
            "devices": f"{args.devices} simulated CPU devices", "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "layouts": rows}, indent=1) + "\n")
    if args.png:
        name = pathlib.Path(args.config).stem
        extra = f", {' '.join(args.set)}" if args.set else ""
        draw(rows, args.png, f"{name}{extra} train step (AdamW, batch {cfg.batch_size} x {cfg.seq_len} tokens) on "
                             f"{args.devices} simulated CPU devices\ncompiled, not run: exact per-device figures "
                             f"of the program XLA built (XLA:CPU, JAX {meta['jax']}, {meta['date'][:10]})")
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
