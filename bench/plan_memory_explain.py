"""Why the planner's memory estimate misses a layout: the estimate's parts beside the
compiled program's peak, and the values XLA keeps live at that peak, by the operation
that made them (XLA's own "stack trace breakdown for peak usage" from its live-range
dump), so each miss in BENCHMARKS.md is named by the buffers that explain it.

    python bench/plan_memory_explain.py CONFIG DEVICES LAYOUT [LAYOUT ...] [--set KEY=VALUE ...]
        [--top 12] [--json PATH]

LAYOUT is a planner description as ``jaxpar-plan`` prints it, quoted, e.g.
``"seq=2 tensor=4 rsa remat=full"`` or ``"tensor=4x4 remat=dots"``. Each is compiled as
``jaxpar.train.plan.compiled_figures`` compiles it (XLA:CPU, the planner's compile
options, state on the device) with XLA's dumps written to a temporary directory, on
``DEVICES`` simulated CPU devices; nothing runs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import tempfile

GIB = 2 ** 30
MIB = 2 ** 20
PARTS = ("params", "optimizer", "batch", "gradients", "activations", "workspace")


def parse_layout(text: str):
    """A ``Layout`` from ``Layout.describe``'s words (``key=value`` mesh sizes, ``AxB`` a 2D
    grid, a sequence implementation, ``sp``, ``remat=``, ``ga=``, a pipeline's
    ``schedule/mM[/vV]``)."""
    from jaxpar.layout import Layout

    fields: dict = {}
    for word in text.split():
        key, _, value = word.partition("=")
        if word in ("ring", "rsa", "ulysses"):
            fields["seq_impl"] = word
        elif word == "sp":
            fields["sequence_parallel"] = True
        elif "/" in word:  # gpipe/m4, interleaved/m16/v4
            schedule, *rest = word.split("/")
            fields["schedule"] = schedule
            for part in rest:
                fields["microbatches" if part[0] == "m" else "virtual_stages"] = int(part[1:])
        elif key == "tensor" and "x" in value:
            fields["tensor"] = tuple(int(n) for n in value.split("x"))
        elif key == "remat":
            fields["remat"] = value
        elif key == "ga":
            fields["grad_accum"] = int(value)
        else:
            fields[key] = int(value)
    return Layout(**fields)


def peak_breakdown(dump: pathlib.Path, top: int) -> list[tuple[str, int]]:
    """The train step's live values at its peak, summed by the operation that made them
    (the op name without the layer scan's and the transposes' prefixes), largest first."""
    text = next(dump.glob("*jit_step*live-range.txt")).read_text()
    section = text.split("Stack trace breakdown for peak usage", 1)[1]
    sums: dict[str, int] = {}
    for line in section.splitlines()[2:]:
        m = re.search(r"[├└]── (.*) \([\d.]+%, total: ([\d ]+) bytes, current: ([\d ]+) bytes", line)
        if not m:
            continue
        name, current = m.group(1), int(m.group(3).replace(" ", ""))
        if current:
            short = re.sub(r"^jit\(step\)/", "", name)
            short = re.sub(r"/while/body/closed_call", "", short)
            sums[short] = sums.get(short, 0) + current
    return sorted(sums.items(), key=lambda kv: -kv[1])[:top]


def explain(cfg, text: str, top: int) -> dict:
    from jaxpar.planning import memory
    from jaxpar.train.plan import FIGURE_OPTIONS, _built_step, workload
    from jaxpar.profiler import profile

    layout = parse_layout(text)
    run, mesh, _, step, abstract, _ = _built_step(cfg, layout, None)
    with tempfile.TemporaryDirectory(prefix="plan_memory_explain_") as tmp:
        compiled = step.compile(abstract, run.batch_size, run.seq_len, {**FIGURE_OPTIONS, "xla_dump_to": tmp})
        figures = profile(compiled, mesh=mesh)
        peak = peak_breakdown(pathlib.Path(tmp), top)
    estimate = memory.estimate(workload(run), layout, backend="cpu")
    total = figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"] + figures["temp_bytes"]
    return {"layout": layout.describe(), "compiled_bytes": total, "argument_bytes": figures["argument_bytes"],
            "temp_bytes": figures["temp_bytes"], "estimated_bytes": estimate["device"],
            "error": estimate["device"] / total - 1, "estimate_parts": {k: estimate[k] for k in PARTS},
            "peak_by_operation": peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("devices", type=int)
    parser.add_argument("layouts", nargs="+")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from jaxpar.train.config import load_config

    cfg = load_config(args.config, args.set)
    rows = []
    for text in args.layouts:
        row = explain(cfg, text, args.top)
        rows.append(row)
        print(f"{args.config} on {args.devices}: {row['layout']}: estimated {row['estimated_bytes'] / GIB:.2f} GiB, "
              f"compiled {row['compiled_bytes'] / GIB:.2f} GiB ({row['error']:+.0%}); arguments "
              f"{row['argument_bytes'] / GIB:.2f}, temporaries {row['temp_bytes'] / GIB:.2f}")
        print("  estimate (MiB): " + ", ".join(f"{k} {v / MIB:.0f}" for k, v in row["estimate_parts"].items()))
        for name, nbytes in row["peak_by_operation"]:
            print(f"  {nbytes / MIB:9.1f} MiB  {name}")
    if args.json:
        args.json.write_text(json.dumps({"config": args.config, "devices": args.devices, "set": args.set,
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
