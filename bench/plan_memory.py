"""The planner's analytic memory model against compiled programs: for a deterministic,
stratified sample of the candidate layouts of each config and device count,
``jaxpar.planning.memory.estimate`` beside XLA's own buffer assignment of the very
train step ``jaxpar-train`` would run for that layout.

    python bench/plan_memory.py [--configs tiny small 1b] [--devices 8 16] [--sample 24]
        [--seed 0] [--set KEY=VALUE ...] [--json PATH] [--png PATH]
    python bench/plan_memory.py --smoke [--json PATH] [--png PATH]   # tiny, 2 layers, 8 devices, 3 candidates
    python bench/plan_memory.py --from bench/results/plan_memory.json [--json PATH] [--png PATH]
        # seconds: the compiled figures of an earlier run, re-estimated by today's memory model

The run kept in the repository (19 minutes on 2 shared cores, compile only: 144 programs):

    nice -n 10 python bench/plan_memory.py --json bench/results/plan_memory.json \\
        --png bench/figures/plan_memory.png

For each (config, devices): the candidates ``jaxpar.planning.layout.enumerate_layouts``
keeps, reduced to distinct on-device programs (offload variants compile to the same
program on XLA:CPU, so only ``offload.params = offload.optimizer = device`` is kept),
less those whose parameter shapes do not divide over the mesh (``workload.shards``
raises ``LayoutError``; the planner prunes them as rule ``shape``). ``--sample K`` of
them are drawn with ``random.Random(seed)``, stratified by (mesh kind, remat policy) and
visited so that the first strata drawn cover every mesh kind (pure data/FSDP, tensor 1D,
tensor 2D, sequence, pipeline; a layout with several is classed by the first of pipe,
seq, 2D, 1D) and every remat policy. Each is compiled with ``jaxpar.train.plan.
compiled_figures`` on simulated CPU devices (one subprocess per (config, devices): the
simulated device count is fixed when JAX starts), and compared:

* total: ``estimate(work, layout, backend="cpu")["device"]`` against the compiled peak
  ``argument_bytes + output_bytes - alias_bytes + temp_bytes``;
* the exact part: ``params + optimizer + batch`` against ``argument_bytes``.

Relative error is ``(estimated - compiled) / compiled`` (positive: the model
over-estimates). The worst case of each (config, devices) is split into arguments and
temporaries (compiled: ``argument_bytes`` vs the rest of the peak; estimated:
``params + optimizer + batch`` vs ``gradients + activations + workspace``), which says
which side of the model is off; a compiled program does not split its temporaries any
further, so the largest estimated temporary part is named as the likely culprit.

``--from`` re-reads an earlier JSON and recomputes only the estimates (the compiled
figures do not depend on the memory model; they do on the train step, JAX and XLA, so
recompile when those change).

Printed: a markdown table per (config, devices) and one of the signed median error by
mesh kind and remat policy over every row. The picture: estimated against compiled
bytes (log-log, the diagonal and a +-5% band; colour: config, marker: device count),
and the signed error of every row by mesh kind (colour: remat policy). Always compiled
for XLA:CPU: temporaries are XLA:CPU's buffer assignment, not a GPU's (the model's
``backend="cpu"`` counts what XLA:CPU does differently: float32 matmul results).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("data/fsdp", "tensor 1D", "tensor 2D", "seq", "pipe")
SMOKE = {"configs": ["tiny"], "devices": [8], "sample": 3, "set": ["model.layers=2"]}
ARGS_PARTS = ("params", "optimizer", "batch")
TEMP_PARTS = ("gradients", "activations", "workspace")
PLANNER_FILES = ("jaxpar/planning/layout.py", "jaxpar/planning/workload.py", "jaxpar/planning/memory.py",
                 "train/plan.py")
MiB = 2 ** 20


def mesh_kind(layout) -> str:
    """The stratum a layout's mesh falls in (the first of pipe, seq, 2D, 1D tensor)."""
    if layout.pipe > 1:
        return "pipe"
    if layout.seq > 1:
        return "seq"
    if isinstance(layout.tensor, tuple):
        return "tensor 2D"
    if layout.tensor > 1:
        return "tensor 1D"
    return "data/fsdp"


def stratified_sample(layouts: list, k: int, seed: int, remats: tuple[str, ...]) -> list:
    """``k`` of ``layouts``, deterministic for ``seed``: each (mesh kind, remat) stratum
    shuffled, then one drawn from each in turn. The strata are visited in the order
    ``(KINDS[i % 5], remats[i % 4])``, i = 0..19 (5 and 4 coprime: all 20 pairs, every
    kind within the first five draws, every remat within the first four), skipping
    empty ones, and round again until ``k`` are drawn or none are left."""
    rng = random.Random(seed)
    strata: dict[tuple[str, str], list] = {}
    for layout in layouts:
        strata.setdefault((mesh_kind(layout), layout.remat), []).append(layout)
    for members in strata.values():
        rng.shuffle(members)
    order = [(KINDS[i % len(KINDS)], remats[i % len(remats)]) for i in range(len(KINDS) * len(remats))]
    order += sorted(set(strata) - set(order))  # (an unknown remat policy: last)
    picked: list = []
    while len(picked) < k and any(strata.values()):
        for key in order:
            if strata.get(key) and len(picked) < k:
                picked.append(strata[key].pop())
    return picked


# ------------------------------------------------------------------ one (config, devices)


def worker(config: str, devices: int, sample: int, seed: int, extra: list[str]) -> None:
    """Runs in a subprocess started with ``JAX_NUM_CPU_DEVICES=devices``: prints one
    ``HEAD {json}`` line, then ``ROW {json}`` per sampled candidate as it compiles."""
    import jax

    from jaxpar.planning import memory
    from jaxpar.planning.layout import REMATS, enumerate_layouts
    from jaxpar.planning.workload import LayoutError, shards
    from jaxpar.train.config import load_config
    from jaxpar.train.plan import compiled_figures, workload

    if jax.device_count() != devices:
        raise SystemExit(f"expected {devices} simulated devices, JAX has {jax.device_count()} "
                         "(set JAX_NUM_CPU_DEVICES before JAX starts)")
    cfg = load_config(config, extra)
    work = workload(cfg)
    kept, pruned = enumerate_layouts(devices, cfg.model, cfg.batch_size, cfg.seq_len)
    on_device = [layout for layout in kept if layout.offload_params == layout.offload_optimizer == "device"]
    distinct = list(dict.fromkeys(on_device))
    usable, shape = [], 0
    for layout in distinct:
        try:
            shards(work, layout.mesh_sizes, layout.sequence_parallel)
        except LayoutError:
            shape += 1
            continue
        usable.append(layout)
    picked = stratified_sample(usable, sample, seed, REMATS)
    head = {"config": config, "set": extra, "devices": devices, "batch_size": cfg.batch_size,
            "seq_len": cfg.seq_len, "model": {k: getattr(cfg.model, k) for k in
                                              ("layers", "dim", "heads", "kv_heads", "head_dim", "mlp_dim",
                                               "vocab_size", "dtype", "param_dtype")},
            "enumerated": len(kept), "pruned_by_rule": dict(pruned), "on_device": len(distinct),
            "shape_pruned": shape, "candidates": len(usable), "sampled": len(picked)}
    print("HEAD " + json.dumps(head), flush=True)
    for i, layout in enumerate(picked, 1):
        row = {"config": config, "devices": devices, "overrides": layout.overrides(), "describe": layout.describe(),
               "mesh_kind": mesh_kind(layout), "remat": layout.remat}
        estimated = memory.estimate(work, layout, backend="cpu")
        row["estimated"] = {k: float(v) for k, v in estimated.items()}
        began = time.perf_counter()
        try:
            figures = compiled_figures(cfg, layout)
        except (Exception, SystemExit) as e:  # a candidate the planner keeps but the trainer refuses
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
        else:
            row["compiled"] = {k: int(figures[k]) for k in ("argument_bytes", "output_bytes", "alias_bytes",
                                                            "temp_bytes", "peak_bytes")}
        row["seconds"] = round(time.perf_counter() - began, 2)
        print("ROW " + json.dumps(row), flush=True)
        print(f"PROGRESS {config} {devices} [{i}/{len(picked)}] {layout.describe()}: "
              f"{'FAILED ' + row['error'][:120] if 'error' in row else 'compiled'} in {row['seconds']} s", flush=True)


# ------------------------------------------------------------------ the driver


def run_worker(config: str, devices: int, args) -> tuple[dict, list[dict]]:
    """One subprocess of this script (``--worker``) with ``devices`` simulated devices."""
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", "--configs", config,
               "--devices", str(devices), "--sample", str(args.sample), "--seed", str(args.seed)]
    if args.set:
        command += ["--set", *args.set]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices),
           "TF_CPP_MIN_LOG_LEVEL": "2"}  # XLA's spmd_partitioner warnings: noise here
    head, rows = None, []
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        for line in proc.stdout:
            tag, _, body = line.rstrip("\n").partition(" ")
            if tag == "HEAD":
                head = json.loads(body)
                print(f"{config} on {devices} devices: {head['candidates']} distinct on-device candidates, "
                      f"compiling {head['sampled']}", file=sys.stderr, flush=True)
            elif tag == "ROW":
                rows.append(json.loads(body))
            elif tag == "PROGRESS":
                print(body, file=sys.stderr, flush=True)
        proc.wait()
        if proc.returncode != 0 or head is None:
            err.seek(0)
            lines = [ln for ln in err.read().splitlines() if "spmd_partitioner" not in ln and not ln.startswith("W")]
            raise SystemExit(f"{config} on {devices} devices: the worker failed (exit {proc.returncode}):\n"
                             + "\n".join(lines[-8:]))
    return head, rows


def complete(row: dict) -> dict:
    """``row`` with its compiled peak, estimated bytes and relative errors."""
    if "compiled" not in row:
        return row
    c, e = row["compiled"], row["estimated"]
    peak = c["argument_bytes"] + c["output_bytes"] - c["alias_bytes"] + c["temp_bytes"]
    est_args = sum(e[p] for p in ARGS_PARTS)
    est_temps = sum(e[p] for p in TEMP_PARTS)
    row.update({
        "compiled_peak": peak, "estimated_device": e["device"],
        "relative_error": (e["device"] - peak) / peak,
        "estimated_arguments": est_args, "argument_error": (est_args - c["argument_bytes"]) / c["argument_bytes"],
        "compiled_temporaries": peak - c["argument_bytes"], "estimated_temporaries": est_temps,
        "temporaries_error": (est_temps - (peak - c["argument_bytes"])) / max(peak - c["argument_bytes"], 1),
    })
    return row


def reestimate(previous: dict) -> tuple[list[dict], list[dict]]:
    """``(heads, rows)`` of an earlier run's JSON, every estimate recomputed by the
    memory model as it is now (nothing compiled)."""
    from jaxpar.planning import memory
    from jaxpar.planning.layout import from_overrides
    from jaxpar.train.config import load_config
    from jaxpar.train.plan import workload

    heads, rows = [], []
    for summary in previous["summary"]:
        head = summary["head"]
        work = workload(load_config(head["config"], head["set"]))
        heads.append(head)
        for row in previous["rows"]:
            if row["config"] == head["config"] and row["devices"] == head["devices"]:
                layout = from_overrides(row["overrides"])
                kept = {k: row[k] for k in ("config", "devices", "overrides", "describe", "mesh_kind", "remat",
                                            "compiled", "error", "seconds") if k in row}
                kept["estimated"] = {k: float(v) for k, v in memory.estimate(work, layout, backend="cpu").items()}
                rows.append(kept)
    return heads, rows


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile, linear between order statistics."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def summarize(head: dict, rows: list[dict]) -> dict:
    done = [r for r in rows if "relative_error" in r]
    out = {"config": head["config"], "devices": head["devices"], "candidates": head["candidates"],
           "enumerated": head["enumerated"], "on_device": head["on_device"], "shape_pruned": head["shape_pruned"],
           "sampled": len(rows), "compiled": len(done), "failed": [{"describe": r["describe"], "error": r["error"]}
                                                                  for r in rows if "error" in r],
           "mesh_kinds": sorted({r["mesh_kind"] for r in rows}, key=KINDS.index),
           "remats": sorted({r["remat"] for r in rows})}
    if not done:
        return out
    errors = [abs(r["relative_error"]) for r in done]
    worst = max(done, key=lambda r: abs(r["relative_error"]))
    temps = {p: worst["estimated"][p] for p in TEMP_PARTS}
    side = ("temporaries" if abs(worst["estimated_temporaries"] - worst["compiled_temporaries"])
            >= abs(worst["estimated_arguments"] - worst["compiled"]["argument_bytes"]) else "arguments")
    out.update({
        "median_abs_error": statistics.median(errors), "p90_abs_error": percentile(errors, 0.9),
        "within_5pct": sum(e <= 0.05 for e in errors) / len(errors),
        "median_error": statistics.median(r["relative_error"] for r in done),
        "max_abs_argument_error": max(abs(r["argument_error"]) for r in done),
        "worst": {"describe": worst["describe"], "overrides": worst["overrides"],
                  "relative_error": worst["relative_error"], "compiled_peak": worst["compiled_peak"],
                  "estimated_device": worst["estimated_device"], "off_side": side,
                  "argument_error": worst["argument_error"], "temporaries_error": worst["temporaries_error"],
                  "compiled_temporaries": worst["compiled_temporaries"],
                  "estimated_temporaries": worst["estimated_temporaries"],
                  "estimated_temporary_parts": temps, "largest_temporary_part": max(temps, key=temps.get)},
    })
    return out


def pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def table(summaries: list[dict]) -> list[str]:
    lines = ["| config | devices | candidates | sampled (compiled) | median abs err | p90 abs err | within 5% | "
             "median err | worst case | worst: arguments / temporaries err (est. temporaries: grads, acts, workspace) "
             "| max abs argument err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        if "worst" not in s:
            lines.append(f"| {s['config']} | {s['devices']} | {s['candidates']:,} | {s['sampled']} ({s['compiled']}) "
                         "| - | - | - | - | - | - | - |")
            continue
        w = s["worst"]
        parts = ", ".join(f"{w['estimated_temporary_parts'][p] / MiB:,.1f}" for p in TEMP_PARTS)
        lines.append(
            f"| {s['config']} | {s['devices']} | {s['candidates']:,} | {s['sampled']} ({s['compiled']}) | "
            f"{s['median_abs_error'] * 100:.1f}% | {s['p90_abs_error'] * 100:.1f}% | {s['within_5pct']:.0%} | "
            f"{pct(s['median_error'])} | `{w['describe']}`: {pct(w['relative_error'])} "
            f"({w['estimated_device'] / MiB:,.1f} vs {w['compiled_peak'] / MiB:,.1f} MiB) | "
            f"{pct(w['argument_error'])} / {pct(w['temporaries_error'])} ({w['off_side']} off; est. "
            f"{w['estimated_temporaries'] / MiB:,.1f} vs {w['compiled_temporaries'] / MiB:,.1f} MiB: {parts} MiB, "
            f"largest {w['largest_temporary_part']}) | {s['max_abs_argument_error'] * 100:.4f}% |")
    return lines


def breakdown(rows: list[dict]) -> list[str]:
    """Median signed error (and count) by mesh kind x remat, over every compiled row."""
    done = [r for r in rows if "relative_error" in r]
    remats = sorted({r["remat"] for r in done}, key=lambda x: ("none", "dots_no_batch", "dots", "full").index(x)
                    if x in ("none", "dots_no_batch", "dots", "full") else 9)
    lines = ["| mesh kind | " + " | ".join(remats) + " | all |", "|---" * (len(remats) + 2) + "|"]
    for kind in KINDS + ("all",):
        cells = []
        for remat in remats + ["all"]:
            errs = [r["relative_error"] for r in done if kind in ("all", r["mesh_kind"]) and remat in ("all", r["remat"])]
            cells.append(f"{pct(statistics.median(errs))} (n={len(errs)})" if errs else "-")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return lines


def draw(rows: list[dict], png: pathlib.Path, title: str) -> None:
    """Left: estimated against compiled bytes (log-log), the diagonal and a +-5% band;
    right: each row's signed error by mesh kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "relative_error" in r]
    configs = list(dict.fromkeys(r["config"] for r in done))
    devices = sorted({r["devices"] for r in done})
    colours = dict(zip(configs, ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")))
    markers = dict(zip(devices, ("o", "^", "s", "D")))
    fig, (ax, err) = plt.subplots(1, 2, figsize=(13.5, 6.2), gridspec_kw={"width_ratios": [1.15, 1]})
    lo = min(min(r["compiled_peak"], r["estimated_device"]) for r in done) / MiB / 1.5
    hi = max(max(r["compiled_peak"], r["estimated_device"]) for r in done) / MiB * 1.5
    line = [lo, hi]
    ax.fill_between(line, [v * 0.95 for v in line], [v * 1.05 for v in line], color="#bbbbbb", alpha=0.5,
                    label="within 5%", linewidth=0)
    ax.plot(line, line, color="black", linewidth=0.8, label="estimated = compiled")
    for config in configs:
        for d in devices:
            mine = [r for r in done if r["config"] == config and r["devices"] == d]
            if mine:
                ax.scatter([r["compiled_peak"] / MiB for r in mine], [r["estimated_device"] / MiB for r in mine],
                           c=colours[config], marker=markers[d], s=30, alpha=0.8, edgecolors="white", linewidths=0.4,
                           label=f"{config}, {d} devices")
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}")
    subs = (1.0,) if math.log10(hi / lo) > 3 else (1.0, 2.0, 5.0)  # labels that do not collide
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=subs))
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel("compiled peak, MiB per device (arguments + outputs - aliased + temporaries)")
    ax.set_ylabel("estimated, MiB per device (memory.estimate, backend=cpu)")
    ax.grid(alpha=0.3, which="major")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("analytic estimate vs XLA:CPU buffer assignment", fontsize=10)

    remat_colours = {"none": "#d62728", "dots": "#ff7f0e", "dots_no_batch": "#2ca02c", "full": "#1f77b4"}
    rng = random.Random(0)
    for r in done:
        x = KINDS.index(r["mesh_kind"]) + rng.uniform(-0.28, 0.28)
        err.scatter(x, r["relative_error"] * 100, c=remat_colours.get(r["remat"], "grey"),
                    marker=markers[r["devices"]], s=26, alpha=0.8, edgecolors="white", linewidths=0.4)
    for remat, colour in remat_colours.items():
        err.scatter([], [], c=colour, marker="o", s=26, label=f"remat={remat}")
    err.axhspan(-5, 5, color="#bbbbbb", alpha=0.5, linewidth=0)
    err.axhline(0, color="black", linewidth=0.8)
    err.set_xticks(range(len(KINDS)), KINDS, fontsize=9)
    err.set_ylabel("relative error of the estimate, % ((estimated - compiled) / compiled)")
    err.set_xlabel("mesh kind (marker: device count, as left)")
    err.grid(axis="y", alpha=0.3)
    err.legend(fontsize=8, loc="best")
    err.set_title("signed error by mesh kind and remat policy", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def sources_hash(files=PLANNER_FILES) -> dict:
    """A short hash of each planner source the figures depend on (it changes while the
    planner is worked on; this says which version produced a result)."""
    return {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest()[:12] for f in files if (ROOT / f).exists()}


def git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        return head.strip() + (" (uncommitted changes)" if dirty.strip() else "")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "small", "1b"], help="shipped configs or YAML files")
    parser.add_argument("--devices", nargs="+", type=int, default=[8, 16], help="simulated CPU device counts (8 16)")
    parser.add_argument("--sample", type=int, default=24, metavar="K", help="candidates per (config, devices) (24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides for every config")
    parser.add_argument("--smoke", action="store_true", help="tiny, 2 layers, 8 devices, 3 candidates: for the tests")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--png", type=pathlib.Path)
    parser.add_argument("--from", dest="previous", type=pathlib.Path, metavar="JSON",
                        help="re-estimate an earlier run's compiled figures (nothing compiled)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.configs, args.devices, args.sample, args.set = (list(SMOKE["configs"]), list(SMOKE["devices"]),
                                                             SMOKE["sample"], list(SMOKE["set"]))
    if args.worker:
        worker(args.configs[0], args.devices[0], args.sample, args.seed, args.set)
        return

    began = time.perf_counter()
    summaries, rows = [], []
    if args.previous:
        previous = json.loads(args.previous.read_text())
        args.configs = list(dict.fromkeys(s["config"] for s in previous["summary"]))
        args.devices = sorted({s["devices"] for s in previous["summary"]})
        args.sample, args.seed, args.set = (previous["meta"]["sample"], previous["meta"]["seed"],
                                            previous["meta"]["set"])
        heads, all_rows = reestimate(previous)
        for head, old in zip(heads, previous["summary"]):
            mine = [complete(r) for r in all_rows if r["config"] == head["config"] and r["devices"] == head["devices"]]
            rows += mine
            summaries.append(summarize(head, mine) | {"head": head, "seconds": old.get("seconds")})
    for config in [] if args.previous else args.configs:
        for devices in args.devices:
            t0 = time.perf_counter()
            head, mine = run_worker(config, devices, args)
            mine = [complete(r) for r in mine]
            rows += mine
            summaries.append(summarize(head, mine) | {"head": head, "seconds": round(time.perf_counter() - t0, 1)})
    for line in table(summaries):
        print(line)
    print()
    print("Signed median error of the estimate by mesh kind and remat policy (all configs and device counts):")
    print()
    for line in breakdown(rows):
        print(line)
    failed = [(s["config"], s["devices"], f) for s in summaries for f in s["failed"]]
    for config, devices, f in failed:
        print(f"\nnot compiled: {config} on {devices} devices, {f['describe']}: {f['error']}")
    meta = {"command": " ".join(["python", *sys.argv]) if argv is None else "main(...)",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "jax": importlib.metadata.version("jax"), "jaxlib": importlib.metadata.version("jaxlib"),
            "configs": args.configs, "devices": [f"{d} simulated CPU devices" for d in args.devices],
            "sample": args.sample, "seed": args.seed, "set": args.set, "backend": "XLA:CPU",
            "compiled_in": "this run" if not args.previous else (
                previous["meta"]["compiled_in"] if previous["meta"].get("compiled_in", "this run") != "this run"
                else f"{previous['meta']['command']}, {previous['meta']['date']}"),
            "git": git_head(), "planner_sources_sha256": sources_hash(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "seconds": round(time.perf_counter() - began, 1),
            "error": "(estimated - compiled) / compiled; compiled = argument + output - alias + temp bytes"}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "summary": summaries, "rows": rows}, indent=1) + "\n")
    if args.png and any("relative_error" in r for r in rows):
        extra = f", {' '.join(args.set)}" if args.set else ""
        draw(rows, args.png, f"planner memory model vs compiled train steps: {' '.join(args.configs)}{extra} on "
                             f"{'/'.join(map(str, args.devices))} simulated CPU devices, {args.sample} sampled "
                             f"candidates each\ncompiled, not run (XLA:CPU, JAX {meta['jax']}, {meta['date'][:10]})")
        print(f"wrote {args.png}", file=sys.stderr)
    print(f"done in {meta['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
