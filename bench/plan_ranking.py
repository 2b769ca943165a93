"""The layout planner's step-time ranking (``jaxpar-plan``, ``jaxpar.planning``) against
step times measured by training each layout on this machine.

    python bench/plan_ranking.py [--config tiny] [--set seq_len=512 ...] [--devices 8]
        [--hardware cpu] [--top 5] [--sample 15] [--seed 0] [--steps 6] [--repeat 1] [--timeout 900]
        [--json bench/results/plan_ranking.json] [--png bench/figures/plan_ranking.png]
    python bench/plan_ranking.py --smoke [--json PATH] [--png PATH]
        # tiny, model.layers=2 seq_len=64 batch_size=8: the top 2 + 1 sampled, 3 steps each

1. ``jaxpar-plan CONFIG devices=8 hardware=cpu SET... --json`` (one subprocess) ranks
   every candidate layout, best first, with its predicted ``step_time_s``
   (``jaxpar.planning.cost.step_time``; ``hardware=cpu`` is this machine's calibrated
   profile, ``CACHE_DIR/hardware/cpu.yaml``, written by ``jaxpar-plan --calibrate
   devices=8``; ``--hardware FILE`` names another).
2. The measured set: of the candidates that fit and keep their state on the device, the
   planner's best ``--top``, plus ``--sample`` others drawn at random (``--seed``) one
   from each of ``--sample`` equal slices of the rest of the ranking, so the sample
   spans it from second best to worst. Offload variants (``offload.params`` /
   ``offload.optimizer`` = ``host``) are left out: XLA:CPU does not tell host memory
   from device memory, so on a CPU they run the very program of their on-device layout
   and measure nothing the planner's offload term predicts.
3. Each layout's train step runs for real, in a subprocess of its own with 8 simulated
   devices (``JAX_PLATFORMS=cpu``): ``jaxpar.train.plan.measured_steps`` builds the
   very step ``jaxpar-train`` runs, takes one step to compile, then times ``S`` more on
   one batch of random tokens; measured = their median. The step alone, as the planner
   predicts it: a first version timed ``jaxpar-train``'s own ``step_time_s`` and, with
   its loader and per-step bookkeeping on this shared 2-core machine, two runs of the
   same 20 layouts agreed with each other at a rank correlation of 0.54. A layout that
   fails is recorded with its error line and skipped. ``--repeat R`` measures the whole
   set ``R`` times, pass after pass (each layout in a fresh process each time), takes
   the median of a layout's passes as its measured time, and prints the rank
   correlation of each later pass with the first: how well the measurement agrees with
   itself, the ceiling for any prediction's Spearman on this machine.

The batch is the config's (tiny: 16 rows, whatever ``seq_len``; ``--set batch_size=N``
changes it for the plan and the runs alike). Wall-clock times on a shared machine are
noisy: run it on an idle one (the meta block records the load average at the start).

The full run (20 layouts, 6 steps each) takes roughly 10 to 15 minutes on 2 idle cores:
one plan (under a minute once its compiled figures are cached) and 20 to 60 s a layout
(start, compile, steps); ``--smoke`` about a minute.

Printed: a markdown table in the planner's order (its rank among all candidates,
layout, predicted and measured ms, measured / predicted), then Spearman's rank
correlation of predicted against measured step time (average ranks for ties: layouts
that differ only in what the model does not price, e.g. ``remat=none`` and ``dots``,
predict the same time), the measured time of the planner's top choice (the best of the
measured set) over the fastest measured, and the mean absolute relative error of the
predictions. The planner ranks compiled candidates before estimated ones, so its order
need not follow the predicted time: Spearman of its rank against the measured time is
printed beside. The picture: measured against predicted step time, log-log, with the
y = x diagonal and the planner's top choice marked.
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
import tempfile
import time

import numpy as np

DEFAULT = {"config": "tiny", "set": ("seq_len=512",), "top": 5, "sample": 15, "steps": 6}
# The smoke scale checks the script's workings, not the planner's figures: a quarter of
# tiny's tokens a step (64 x 8 rather than 128 x 16), so its timed steps cost about a
# quarter as much.
SMOKE = {"config": "tiny", "set": ("model.layers=2", "seq_len=64", "batch_size=8", "plan.compile_top=1"), "top": 2,
         "sample": 1, "steps": 3}
ROOT = pathlib.Path(__file__).resolve().parents[1]
PLAN = "import sys; from jaxpar.commands.plan import main; sys.exit(main(sys.argv[1:]))"  # jaxpar-plan


def _env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _tail(out: subprocess.CompletedProcess, lines: int = 1) -> str:
    text = (out.stderr or "").strip() or (out.stdout or "").strip()
    return "\n".join(text.splitlines()[-lines:]) or f"exit {out.returncode}, no output"


def plan(config: str, devices: int, hardware: str, sets: list[str]) -> dict:
    """``jaxpar-plan``'s JSON: ``candidates`` ranked best first (one subprocess)."""
    command = [sys.executable, "-c", PLAN, config, f"devices={devices}", f"hardware={hardware}", *sets, "--json"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=_env())
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines or not lines[-1].startswith("{"):
        raise SystemExit(f"jaxpar-plan {config} failed (exit {out.returncode}):\n{_tail(out, 5)}")
    return json.loads(lines[-1])


def on_device(candidate: dict) -> bool:
    o = candidate["overrides"]
    return o.get("offload.params", "device") == "device" and o.get("offload.optimizer", "device") == "device"


def choose(candidates: list[dict], top: int, sample: int, seed: int = 0) -> list[dict]:
    """The measured set, in the planner's order: the best ``top`` of the candidates that
    fit and stay on the device, and one drawn (``seed``) from each of ``sample`` equal
    slices of the rest. Each is the candidate with ``rank`` (1-based, among all
    candidates) and ``pick`` (``top`` or ``sample``)."""
    pool = [{**c, "rank": i} for i, c in enumerate(candidates, 1) if c["fits"] and on_device(c)]
    chosen = [{**c, "pick": "top"} for c in pool[:top]]
    rest = pool[top:]
    rng = np.random.default_rng(seed)
    for part in np.array_split(np.arange(len(rest)), min(sample, len(rest))) if sample and rest else []:
        chosen.append({**rest[int(rng.choice(part))], "pick": "sample"})
    return chosen


def setting(key: str, value) -> str:
    """One ``jaxpar-train`` argument: lists as ``[2,2]``, booleans as ``true``/``false``."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (list, tuple)):
        text = "[" + ",".join(str(v) for v in value) + "]"
    else:
        text = str(value)
    return f"{key}={text}"


MEASURE = """
import json, sys
from jaxpar.planning.layout import from_overrides
from jaxpar.train.config import load_config
from jaxpar.train.plan import measured_steps
config, sets, overrides, steps = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
print(json.dumps(measured_steps(load_config(config, sets), from_overrides(overrides), steps=steps)))
"""


def measure(config: str, sets: list[str], overrides: dict, steps: int, devices: int,
            timeout: float | None = None) -> dict:
    """Times ``steps`` train steps of ``config`` under ``overrides`` after one that
    compiles (``jaxpar.train.plan.measured_steps``: the step alone, on one batch of
    random tokens, in a subprocess of its own with ``devices`` simulated devices):
    ``measured_s`` (their median), every step's time, the wall seconds, and ``error``
    (the failure's last line, else None)."""
    env = {**_env(), "JAX_NUM_CPU_DEVICES": str(devices), "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [sys.executable, "-c", MEASURE, config, json.dumps(sets), json.dumps(overrides), str(steps)]
    began = time.perf_counter()
    try:
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"measured_s": None, "step_times_s": [], "seconds": round(time.perf_counter() - began, 1),
                "error": f"timed out after {timeout:g} s"}
    seconds = round(time.perf_counter() - began, 1)
    if out.returncode != 0 or not out.stdout.strip():
        return {"measured_s": None, "step_times_s": [], "seconds": seconds,
                "error": f"exit {out.returncode}: {_tail(out)}"}
    times = json.loads(out.stdout.strip().splitlines()[-1])
    return {"measured_s": float(np.median(times)), "step_times_s": times, "seconds": seconds, "error": None}


def combined(runs: list[dict]) -> dict:
    """One layout's passes as one row: the median of their measured times (None if any
    failed, with the first failure's line), every pass's (``passes_s``), their steps
    and wall seconds."""
    failed = next((r for r in runs if r["error"] is not None), None)
    passes = [r["measured_s"] for r in runs]
    return {"measured_s": None if failed else float(np.median(passes)), "passes_s": passes,
            "step_times_s": [t for r in runs for t in r["step_times_s"]],
            "seconds": round(sum(r["seconds"] for r in runs), 1), "error": failed["error"] if failed else None}


def ranks(values) -> np.ndarray:
    """1-based ranks, ties sharing their average rank."""
    x = np.asarray(values, dtype=float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    _, group = np.unique(x, return_inverse=True)
    return (np.bincount(group, weights=r) / np.bincount(group))[group]


def spearman(a, b) -> float | None:
    """Spearman's rank correlation (Pearson's of the average ranks); None for fewer
    than 3 pairs or when either side is all one value."""
    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    norm = np.sqrt((ra ** 2).sum() * (rb ** 2).sum())
    return float((ra * rb).sum() / norm) if norm > 0 else None


def repeatability(rows: list[dict]) -> list[float | None]:
    """Spearman of each later pass's measured times against the first pass's, over
    the rows every pass measured (``--repeat``)."""
    done = [r for r in rows if r.get("passes_s") and None not in r["passes_s"]]
    passes = len(done[0]["passes_s"]) if done else 0
    return [spearman([r["passes_s"][0] for r in done], [r["passes_s"][k] for r in done]) for k in range(1, passes)]


def summarize(rows: list[dict]) -> dict:
    """Spearman, the top choice's measured time over the fastest's, and the mean
    absolute relative error, over the rows that trained."""
    done = [r for r in rows if r["measured_s"] is not None]
    predicted = np.array([r["predicted_s"] for r in done])
    measured = np.array([r["measured_s"] for r in done])
    top = rows[0] if rows else None  # rows are in the planner's order
    fastest = min(done, key=lambda r: r["measured_s"]) if done else None
    trained = top is not None and top["measured_s"] is not None
    return {
        "measured": len(done), "failed": len(rows) - len(done),
        "spearman": spearman(predicted, measured),
        # The planner ranks compiled candidates before estimated ones, so its order need
        # not follow the predicted time: this is its order against the measured one.
        "spearman_planner_rank": spearman([r["rank"] for r in done], measured),
        "top_choice": top["layout"] if top else None,
        "top_choice_measured_s": top["measured_s"] if top else None,
        "fastest_measured": fastest["layout"] if fastest else None,
        "fastest_measured_s": fastest["measured_s"] if fastest else None,
        "top_choice_ratio": top["measured_s"] / fastest["measured_s"] if trained else None,
        "top_choice_measured_rank": int(ranks(measured)[done.index(top)]) if trained else None,
        "mean_abs_rel_error": float(np.mean(np.abs(predicted - measured) / measured)) if done else None,
        "median_measured_over_predicted": float(np.median(measured / predicted)) if done else None,
        "spearman_pass_vs_first": repeatability(rows),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def table(rows: list[dict]) -> list[str]:
    lines = ["| rank | pick | layout | predicted (source) | predicted ms | measured ms | measured / predicted |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = _ms(r["measured_s"]) if r["error"] is None else f"failed: {r['error']}"
        ratio = "-" if r["measured_s"] is None else f"{r['measured_s'] / r['predicted_s']:.2f}"
        lines.append(f"| {r['rank']} | {r['pick']} | {r['layout']} | {r['memory_source']} | "
                     f"{_ms(r['predicted_s'])} | {measured} | {ratio} |")
    return lines


def summary_lines(s: dict, considered: int, kept: int, eligible: int) -> list[str]:
    rho = "n/a (fewer than 3 trained)" if s["spearman"] is None else f"{s['spearman']:.3f}"
    lines = [f"Measured {s['measured']} of {kept:,} ranked candidates ({considered:,} considered; {eligible:,} fit "
             f"and stay on the device), {s['failed']} failed.",
             f"Spearman rank correlation, predicted vs measured step time: {rho}"
             + ("." if s["spearman_planner_rank"] is None
                else f" (the planner's rank vs measured: {s['spearman_planner_rank']:.3f}).")]
    if s["top_choice_ratio"] is not None:
        lines.append(f"Planner's top choice, {s['top_choice']}: {_ms(s['top_choice_measured_s'])} ms measured, "
                     f"{s['top_choice_ratio']:.2f}x the fastest measured ({s['fastest_measured']}, "
                     f"{_ms(s['fastest_measured_s'])} ms); rank {s['top_choice_measured_rank']} of {s['measured']} "
                     "by measured time.")
    elif s["top_choice"] is not None:
        lines.append(f"Planner's top choice, {s['top_choice']}, did not train.")
    if s["mean_abs_rel_error"] is not None:
        lines.append(f"Mean absolute relative error of the predicted step time: {s['mean_abs_rel_error']:.1%}; "
                     f"median measured / predicted: {s['median_measured_over_predicted']:.2f}.")
    if s["spearman_pass_vs_first"]:
        agree = ", ".join("n/a" if v is None else f"{v:.3f}" for v in s["spearman_pass_vs_first"])
        lines.append(f"The measurement against itself (each later pass vs the first, Spearman): {agree}.")
    return lines


def draw(rows: list[dict], summary: dict, png: pathlib.Path, title: str) -> None:
    """Measured against predicted step time (ms, log-log, equal scales), y = x dashed
    (and the median measured / predicted dotted); each sampled point numbered by its
    planner rank; the top choice a star, labelled with its layout in the emptiest
    corner; the legend below the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    done = [r for r in rows if r["measured_s"] is not None]
    fig, ax = plt.subplots(figsize=(7.5, 8))
    if done:
        x = np.array([r["predicted_s"] for r in done]) * 1e3
        y = np.array([r["measured_s"] for r in done]) * 1e3
        lo, hi = min(x.min(), y.min()) / 1.25, max(x.max(), y.max()) * 1.25
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_aspect("equal")
        ax.plot([lo, hi], [lo, hi], "--", color="grey", lw=1, label="y = x (measured = predicted)")
        scale = summary["median_measured_over_predicted"]
        if scale and abs(np.log(scale)) > 0.05:
            ax.plot([lo, hi], [lo * scale, hi * scale], ":", color="grey", lw=1,
                    label=f"y = {scale:.2f} x (the median measured / predicted)")
        for pick, colour, label in (("top", "#1f77b4", "the planner's best (its top, on the device)"),
                                    ("sample", "#ff7f0e", "sampled over the rest of its ranking (#: rank)")):
            keep = [i for i, r in enumerate(done) if r["pick"] == pick]
            if keep:
                ax.scatter(x[keep], y[keep], s=36, color=colour, label=label, zorder=3,
                           edgecolor="white", linewidth=0.5)
        for xi, yi, r in zip(x, y, done):
            if r["pick"] == "sample":
                ax.annotate(f"#{r['rank']}", (xi, yi), xytext=(4, -9), textcoords="offset points", fontsize=7,
                            color="#444444")
        top = rows[0]
        if top["measured_s"] is not None:
            tx, ty = top["predicted_s"] * 1e3, top["measured_s"] * 1e3
            ax.scatter([tx], [ty], marker="*", s=260, color="#d62728", edgecolor="black", linewidth=0.6, zorder=4,
                       label="the planner's top choice")
            # The label's box (about 0.4 x 0.06 of the axes) clear of the points (axes
            # fractions, log scales), the nearest such spot to the star.
            at = np.column_stack([np.log(x / lo), np.log(y / lo)]) / np.log(hi / lo)
            star = np.log(np.array([tx, ty]) / lo) / np.log(hi / lo)
            spots = [(sx, sy) for sy in np.arange(0.05, 0.96, 0.06) for sx in (0.03, 0.2, 0.4, 0.57)]

            def clearance(spot):  # from the box's points nearest to each point
                dx = np.clip(at[:, 0], spot[0], spot[0] + 0.4) - at[:, 0]
                dy = np.clip(at[:, 1], spot[1] - 0.03, spot[1] + 0.03) - at[:, 1]
                return np.min(np.hypot(dx, dy))

            clear = [sp for sp in spots if clearance(sp) > 0.06] or [max(spots, key=clearance)]
            spot = min(clear, key=lambda sp: np.hypot(sp[0] + 0.2 - star[0], sp[1] - star[1]))
            ax.annotate(f"top choice: {top['layout']}\n{ty:,.0f} ms measured, {tx:,.0f} ms predicted",
                        (tx, ty), xytext=spot, textcoords="axes fraction", fontsize=8, va="center",
                        arrowprops={"arrowstyle": "-", "color": "#d62728", "lw": 0.8},
                        bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "#d62728", "lw": 0.6})
        ticks = [m * 10.0 ** k for k in range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
                 for m in (1, 2, 5) if lo <= m * 10.0 ** k <= hi]
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(FixedLocator(ticks))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2, frameon=False)
    ax.grid(True, which="both", alpha=0.25)
    ax.set_axisbelow(True)
    ax.set_xlabel("predicted step time (ms, jaxpar-plan)")
    ax.set_ylabel("measured step time (ms, median of the timed steps)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _hardware_profile(hardware: str, cache_dir) -> dict | None:
    """The profile's figures (what the predictions rest on), where it can be read."""
    import yaml

    from jaxpar.planning import hardware as hardware_lib
    from jaxpar.train.data import cache_dir_of

    path = (hardware_lib.calibrated_path(cache_dir_of(cache_dir)) if hardware == "cpu"
            else hardware_lib.PROFILE_DIR / f"{hardware}.yaml" if hardware in hardware_lib.SHIPPED
            else pathlib.Path(hardware).expanduser())
    try:
        return {"path": str(path), **yaml.safe_load(path.read_text())}
    except (OSError, yaml.YAMLError, TypeError):
        return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT["config"], help="a shipped config or a YAML file (tiny)")
    parser.add_argument("--set", nargs="+", default=list(DEFAULT["set"]), metavar="KEY=VALUE",
                        help="overrides for the plan and every run (default seq_len=512; --set replaces it)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (8)")
    parser.add_argument("--hardware", default="cpu", help="the planner's hardware profile (cpu: the calibrated one)")
    parser.add_argument("--top", type=int, default=DEFAULT["top"], help="the planner's best K, measured (5)")
    parser.add_argument("--sample", type=int, default=DEFAULT["sample"], help="others sampled over the ranking (15)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (0)")
    parser.add_argument("--steps", type=int, default=DEFAULT["steps"], help="timed steps per layout, after one that compiles (6)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure the whole set this many times, pass after pass (1); measured = the median")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take (900)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny, model.layers=2 seq_len=64 batch_size=8, top 2 + 1 sampled, 3 steps: for the tests")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--png", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.set, args.top, args.sample, args.steps = (
            SMOKE["config"], list(SMOKE["set"]), SMOKE["top"], SMOKE["sample"], SMOKE["steps"])
    if args.steps < 1:
        parser.error("--steps must be 1 or more")
    if args.repeat < 1:
        parser.error(f"--repeat must be 1 or more, not {args.repeat}")

    from jaxpar.train.config import load_config

    cfg = load_config(args.config, args.set)
    load = os.getloadavg()
    began = time.perf_counter()
    result = plan(args.config, args.devices, args.hardware, args.set)
    eligible = sum(c["fits"] and on_device(c) for c in result["candidates"])
    chosen = choose(result["candidates"], args.top, args.sample, args.seed)
    print(f"jaxpar-plan: {result['kept']:,} candidates ranked in {result['seconds']:.1f} s; measuring {len(chosen)}",
          file=sys.stderr, flush=True)
    runs: list[list[dict]] = [[] for _ in chosen]
    for k in range(args.repeat):
        for i, c in enumerate(chosen):
            run = measure(args.config, args.set, c["overrides"], args.steps, args.devices, args.timeout)
            runs[i].append(run)
            said = f"{_ms(run['measured_s'])} ms" if run["error"] is None else f"failed: {run['error']}"
            print(f"[pass {k + 1}, {i + 1}/{len(chosen)}] #{c['rank']} {c['layout']}: predicted "
                  f"{_ms(c['step_time_s'])} ms, measured {said} ({run['seconds']} s)", file=sys.stderr, flush=True)
    rows = [{"rank": c["rank"], "pick": c["pick"], "layout": c["layout"], "overrides": c["overrides"],
             "memory_bytes": c["memory_bytes"], "memory_source": c["memory_source"],
             "predicted_s": c["step_time_s"], "split": c["split"], **combined(r)} for c, r in zip(chosen, runs)]
    summary = summarize(rows)
    for line in table(rows):
        print(line)
    print()
    for line in summary_lines(summary, result["considered"], result["kept"], eligible):
        print(line)
    meta = {"command": " ".join(["python", *sys.argv]) if argv is None else "main(...)",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load_average_at_start": [round(v, 2) for v in load],
            "jax": importlib.metadata.version("jax"), "config": args.config, "set": args.set,
            "devices": f"{args.devices} simulated CPU devices", "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
            "steps": args.steps, "repeat": args.repeat, "timed_steps": f"{args.steps} after the compiling one (median)", "top": args.top, "sample": args.sample,
            "seed": args.seed, "hardware": args.hardware,
            "hardware_profile": _hardware_profile(args.hardware, cfg.cache_dir),
            "plan": {k: result.get(k) for k in ("considered", "pruned", "kept", "compiled", "from_cache", "seconds")},
            "eligible": eligible, "plan_best": result["candidates"][0]["layout"],
            "left_out": "offload variants (offload.params/optimizer=host): XLA:CPU does not model offload",
            "seconds": round(time.perf_counter() - began, 1), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    out = {"meta": meta, "summary": summary, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.png:
        name = pathlib.Path(args.config).stem
        rho = "n/a" if summary["spearman"] is None else f"{summary['spearman']:.2f}"
        ratio = "n/a" if summary["top_choice_ratio"] is None else f"{summary['top_choice_ratio']:.2f}x"
        draw(rows, summary, args.png,
             f"{name} {' '.join(args.set)} (batch {cfg.batch_size} x {cfg.seq_len} tokens): jaxpar-plan's predicted "
             f"vs measured train step,\n{len(rows)} layouts on {args.devices} simulated CPU devices "
             f"(XLA:CPU, JAX {meta['jax']}, {meta['date'][:10]})\n"
             f"Spearman \u03c1 = {rho}; the top choice takes {ratio} the fastest measured")
        print(f"wrote {args.png}")
    return out


if __name__ == "__main__":
    main()
