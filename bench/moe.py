"""Mixture of experts (issue 51): compile-only memory and traffic at scale, and a CPU side
by side of ``moe_tiny`` against dense models, capacities and routers.

    python bench/moe.py compile [--devices 64 256] [--models mixtral_8x7b deepseek_v3_like]
        [--layers 1 2] [--seq-len 1024] [--json PATH] [--markdown PATH]
    python bench/moe.py cpu [--steps 20] [--batch-size 8] [--json PATH] [--markdown PATH] [--png PATH]
    python bench/moe.py gpu [...]     # the cpu part's runs on one GPU
    python bench/moe.py PART --from-json PATH [--markdown PATH] [--png PATH]   # no run: redraw

``compile``: for each model, device count and expert x fsdp x tensor layout
(``LAYOUTS``), ``bench/layouts.py``'s ``profile`` (``python -m jaxpar.commands.train
tiny model=MODEL model.layers=L dry_run=true mesh.... --simulate-devices N``) compiles
the train step for XLA:CPU on abstract inputs; nothing runs. One sequence of
``--seq-len`` tokens a device (``batch_size`` = devices), ``model.remat=full``. The
models have 61 (DeepSeek-V3-like) and 32 (Mixtral) layers; compiling all of them for 256
simulated devices takes too long here, so each layout is compiled at each of
``--layers`` (1 and 2) and the whole model's argument and collective bytes are
extrapolated linearly: the 1-layer figure plus (layers - 1) times the 2-layer figure's
increment (the per-layer cost; embedding, head and optimizer of the non-layer weights are
in the 1-layer part). Peak memory is the compiled program's only (``whole``).

``cpu``: ``jaxpar-train`` on one CPU device, the same data and tokens for every run
(``RUNS``): ``moe_tiny`` (dropless, Switch balance loss 0.01) against ``tiny`` with the
same total parameters (``model.mlp_dim=1536``: 8 experts of 192) and with the same
active ones (``tiny``: 2 of 192 = 384), ``moe_tiny`` at capacity 1.0 and 1.25, with
the ``sigmoid_bias`` router (no balance loss; ``bias_rate`` 0.01, ten times DeepSeek's,
for so short a run) and with neither. Per run: tokens/s (median of the steps after the
first), the language-model loss after the same tokens (the training loss less its
balance term, mean of the last 5 steps), the dropped fraction and the expert load
(``moe_load_max``: the most-chosen expert over an even share, 1 balanced) from
``metrics.jsonl``. The picture: loss by tokens, tokens/s, and the expert load over
training.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import layouts  # noqa: E402  (bench/layouts.py: one compile-only profile per layout)

ROOT = pathlib.Path(__file__).resolve().parents[1]
GB = 1e9
LAYERS = {"mixtral_8x7b": 32, "deepseek_v3_like": 61}
# model -> devices -> layouts (expert x fsdp x tensor, all devices used); two at 256
# devices, whose compiles take 2-4 minutes each on the shared 2-core machine
LAYOUTS = {
    "mixtral_8x7b": {64: ("fsdp=64", "expert=8 fsdp=8", "expert=8 fsdp=4 tensor=2"),
                     256: ("fsdp=256", "expert=8 fsdp=32")},
    "deepseek_v3_like": {64: ("expert=64", "expert=32 fsdp=2", "expert=16 fsdp=2 tensor=2"),
                         256: ("expert=256", "expert=64 fsdp=4")},
}
RUNS = {  # name -> (config, overrides)
    "moe_tiny": ("moe_tiny", []),
    "dense, same total params": ("tiny", ["model.mlp_dim=1536"]),
    "dense, same active params": ("tiny", []),
    "moe_tiny capacity 1.0": ("moe_tiny", ["model.moe.capacity_factor=1.0"]),
    "moe_tiny capacity 1.25": ("moe_tiny", ["model.moe.capacity_factor=1.25"]),
    "moe_tiny sigmoid_bias": ("moe_tiny", ["model.moe.router=sigmoid_bias", "model.moe.balance_loss=0",
                                           "model.moe.bias_rate=0.01"]),
    "moe_tiny no balancing": ("moe_tiny", ["model.moe.balance_loss=0"]),
}


def meta(argv) -> dict:
    return {"command": " ".join(["python", "bench/moe.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "jax": importlib.metadata.version("jax")}


# ------------------------------------------------------------------ compile-only


def compile_rows(models, devices, layers, seq_len, save=lambda rows: None) -> list[dict]:
    """One row per (model, devices, layout): each ``layers``' profile and the whole model's
    extrapolation (``whole``: peak and collective bytes by kind); ``save(rows)`` after
    each row (the 256-device compiles take minutes each)."""
    rows = []
    for model in models:
        for n in devices:
            for layout in LAYOUTS[model][n]:
                extra = [f"model={model}", f"batch_size={n}", f"seq_len={seq_len}", "model.remat=full"]
                profiles = {}
                for count in layers:
                    got = layouts.profile("tiny", layout, n, [*extra, f"model.layers={count}"])
                    profiles[count] = got["profile"] | {"seconds": got["seconds"]}
                    print(f"{model} {n} {layout} layers={count}: {got['seconds']} s", file=sys.stderr, flush=True)
                rows.append({"model": model, "devices": n, "layout": layout, "profiles": profiles,
                             "whole": whole(profiles, LAYERS[model])})
                save(rows)
    return rows


def whole(profiles: dict, layers: int) -> dict | None:
    """The whole model's argument bytes (parameters, AdamW state, batch) and collective
    bytes by kind, from the 1- and 2-layer profiles (None without both). Peak memory is
    not extrapolated: XLA's temporaries do not grow by layer under ``remat=full`` (some
    layouts' 2-layer temporaries are smaller than their 1-layer ones)."""
    if not {1, 2} <= set(profiles):
        return None
    one, two = profiles[1], profiles[2]

    def line(a, b):
        return a + (layers - 1) * (b - a)

    kinds = set(one["collectives"]) | set(two["collectives"])
    return {"layers": layers, "argument_bytes": line(one["argument_bytes"], two["argument_bytes"]),
            "collective_bytes": line(one["collective_bytes"], two["collective_bytes"]),
            "collectives": {k: line(one["collectives"].get(k, 0), two["collectives"].get(k, 0)) for k in kinds},
            "per_layer_collective_bytes": two["collective_bytes"] - one["collective_bytes"]}


def compile_table(rows) -> list[str]:
    """GB per device per step: the deepest compiled program's figures, and the whole
    model's extrapolated ones."""
    lines = ["| model | devices | layout | compiled: layers | peak | temporaries | collectives | all-to-all | "
             "per layer: collectives | whole model (extrapolated): layers | arguments | collectives | all-to-all |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        depth = max(r["profiles"], key=int)
        p, w = r["profiles"][depth], whole({int(k): v for k, v in r["profiles"].items()}, LAYERS[r["model"]])
        cells = [r["model"], str(r["devices"]), r["layout"], str(depth), f"{p['peak_bytes'] / GB:.1f}",
                 f"{p['temp_bytes'] / GB:.1f}", f"{p['collective_bytes'] / GB:.2f}",
                 f"{p['collectives'].get('all-to-all', 0) / GB:.2f}"]
        cells += ([f"{w['per_layer_collective_bytes'] / GB:.2f}", str(w["layers"]), f"{w['argument_bytes'] / GB:.1f}",
                   f"{w['collective_bytes'] / GB:.1f}", f"{w['collectives'].get('all-to-all', 0) / GB:.1f}"]
                  if w else ["-"] * 5)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------ CPU side by side


def train(name, config, extra, steps, batch_size, root, platform_="cpu") -> dict:
    """One ``jaxpar-train`` run on one device (``platform_``: cpu, or gpu); its metrics
    and summary."""
    run_dir = root / name.replace(" ", "_").replace(",", "")
    command = [sys.executable, "-m", "jaxpar.commands.train", config, f"run_dir={run_dir}", f"steps={steps}",
               f"batch_size={batch_size}", "eval.every=0", "checkpoint.every=0", "optimizer.warmup_steps=5", *extra]
    began = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # gpu: JAX's default backend
    env |= {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"} if platform_ == "cpu" else \
        {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{name}: jaxpar-train failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if '"loss"' in line and '"step"' in line]
    lm = [m["loss"] - m.get("moe_balance_loss", 0.0) for m in metrics]
    summary = {"name": name, "config": config, "overrides": extra, "wall_s": round(time.perf_counter() - began, 1),
               "tokens_per_s": statistics.median(m["tokens_per_s"] for m in metrics[1:]),
               "lm_loss": statistics.mean(lm[-5:]),
               "tokens_per_step": round(metrics[0]["tokens_per_s"] * metrics[0]["step_time_s"])}
    if "moe_load_max" in metrics[0]:
        summary.update(load_max_first=metrics[0]["moe_load_max"], load_max_last=statistics.mean(
            m["moe_load_max"] for m in metrics[-5:]), dropped=statistics.mean(m["moe_dropped"] for m in metrics))
    summary["curve"] = [{"step": m["step"], "lm_loss": x, "load_max": m.get("moe_load_max"),
                         "tokens_per_s": m["tokens_per_s"]} for m, x in zip(metrics, lm)]
    return summary


def cpu_table(runs) -> list[str]:
    lines = ["| run | tokens/s | LM loss (last 5 steps) | dropped | expert load max/mean: first step, last 5 |",
             "|---|---|---|---|---|"]
    for r in runs:
        moe = "load_max_last" in r
        lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['lm_loss']:.3f} | "
                     + (f"{r['dropped']:.3f} | {r['load_max_first']:.2f}, {r['load_max_last']:.2f} |" if moe
                        else "- | - |"))
    return lines


def draw(runs, png: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss, speed, load) = plt.subplots(1, 3, figsize=(16, 4.8))
    tokens_per_step = runs[0]["tokens_per_step"]
    for r in runs[:3]:
        loss.plot([c["step"] * tokens_per_step / 1000 for c in r["curve"]], [c["lm_loss"] for c in r["curve"]],
                  label=r["name"])
    loss.set_xlabel("thousand tokens trained")
    loss.set_ylabel("language-model loss (training, balance term removed)")
    loss.set_title("MoE against dense models", fontsize=10)
    loss.legend(fontsize=8)
    names = [r["name"] for r in runs]
    speed.barh(range(len(runs))[::-1], [r["tokens_per_s"] for r in runs], color="#1f77b4")
    for y, r in zip(range(len(runs))[::-1], runs):
        note = f"  dropped {r['dropped']:.1%}" if r.get("dropped") else ""
        speed.text(r["tokens_per_s"], y, f" {r['tokens_per_s']:,.0f}{note}", va="center", fontsize=8)
    speed.set_yticks(range(len(runs))[::-1], names, fontsize=8)
    speed.set_xlim(0, max(r["tokens_per_s"] for r in runs) * 1.5)
    speed.set_xlabel("tokens/s, one device (higher is better)")
    speed.set_title("throughput (median step)", fontsize=10)
    for r in runs:
        if "load_max_last" in r and "capacity" not in r["name"]:
            load.plot([c["step"] for c in r["curve"]], [c["load_max"] for c in r["curve"]], label=r["name"])
    load.axhline(1, color="grey", lw=0.8, ls=":")
    load.set_xlabel("step")
    load.set_ylabel("expert load: most-chosen expert / even share")
    load.set_title("expert load over training (1 is balanced, E/k=4 the worst)", fontsize=10)
    load.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("compile", "cpu", "gpu"), help="gpu: the cpu part's runs on one GPU")
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 256], choices=(64, 256))
    parser.add_argument("--models", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="depths compiled (1 2)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--markdown", type=pathlib.Path)
    parser.add_argument("--png", type=pathlib.Path)
    parser.add_argument("--from-json", type=pathlib.Path, metavar="PATH",
                        help="no run: the table (and cpu's picture) again from a JSON this script wrote")
    args = parser.parse_args(argv)
    info = meta(argv)
    if args.from_json:
        return redraw(args, json.loads(args.from_json.read_text()))
    if args.part == "compile":
        def save(rows):
            write(args, compile_table(rows), {"meta": info, "rows": rows})

        rows = compile_rows(args.models, args.devices, sorted(args.layers), args.seq_len, save)
        lines, result = compile_table(rows), {"meta": info, "rows": rows}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            rows = [train(name, *RUNS[name], args.steps, args.batch_size, pathlib.Path(tmp), args.part)
                    for name in args.runs]
        lines, result = cpu_table(rows), {"meta": info | {"steps": args.steps, "batch_size": args.batch_size},
                                          "runs": rows}
        if args.png:
            draw(rows, args.png, cpu_title(result["meta"], args.part))
            print(f"wrote {args.png}")
    print("\n".join(lines))
    write(args, lines, result)


def cpu_title(info: dict, part: str) -> str:
    return (f"jaxpar-train, {info['steps']} steps of {info['batch_size']} x 128 tokens each, one {part.upper()} device "
            f"({info['machine']}, JAX {info['jax']}, {info['date']})")


def redraw(args, result: dict) -> None:
    """The table and picture of a saved result (``--from-json``)."""
    if args.part == "compile":
        lines = compile_table(result["rows"])
    else:
        lines = cpu_table(result["runs"])
        if args.png:
            draw(result["runs"], args.png, cpu_title(result["meta"], args.part))
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


def write(args, lines, result) -> None:
    for path, text in ((args.json, json.dumps(result, indent=1) + "\n"), (args.markdown, "\n".join(lines) + "\n")):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


if __name__ == "__main__":
    main()
