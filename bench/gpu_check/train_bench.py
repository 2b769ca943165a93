"""The ``train`` (130 s) and ``offload`` (80 s) parts: ``jaxpar-train``'s throughput.

``train``: ``jaxpar-train small`` (its config's batch, 32 x 1024) for 12 steps, then
``1b`` at batch 8 x 2048 for 8 (``train_runs``; Python's stdlib as data,
``data.max_files=200``, no evals, no checkpoint; ``small`` gets at most 40% of the time
left, ``1b`` the rest): median step time after 2 warm-up steps, tokens/s, MFU
(``flops_per_token`` over the device's bf16 peak, ``jaxpar.train.loop.PEAK_FLOPS``, and
over the matmul peak the kernels part measured), compile + first step, live device
bytes. ``small`` keeps its checkpoint where fastapi, uvicorn and httpx import: the serve
part's ``jaxpar-serve`` over HTTP reads it.

``offload``: the same ``small`` run with ``offload.params=host``, then also
``offload.optimizer=host`` (``OFFLOAD_MODES``): tokens/s and live device bytes against
``train``'s all-on-device run (measured here first if ``train`` has none).

Each run is a ``jaxpar-train`` process (``python bench/gpu_check --train-child``,
``train_child``) killed at its share of the part's time; its figures come from the
``metrics.jsonl`` it wrote, those of the steps it logged when killed.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import time

import part
from kernel_bench import measured_peak
from part import Record, Skip, md_table, missing, read_result, short, time_left
from probe import HTTP_DEPS, TRAIN_DEPS, machine, need_gpu
from processes import run_bounded, self_command

OFFLOAD_MODES = (("params=host", ["offload.params=host"]),
                 ("params=host optimizer=host", ["offload.params=host", "offload.optimizer=host"]))


def train_child(argv) -> int:
    """``jaxpar-train`` as the train and offload parts run it: without a checkpoint
    (``Checkpoints.save`` patched out: the 1b state is 15 GB) unless ``--keep-checkpoint``."""
    keep = "--keep-checkpoint" in argv
    argv = [a for a in argv if a != "--keep-checkpoint"]
    from jaxpar.train import loop

    if not keep:
        class NoSave(loop.Checkpoints):
            def save(self, *args, **kwargs):
                return None

        loop.Checkpoints = NoSave
    from jaxpar.commands.train import main as cli_main

    return cli_main(argv)


@dataclasses.dataclass
class TrainRun:
    label: str
    config: str
    overrides: list[str]
    steps: int
    warmup: int


def train_runs(ns) -> list[TrainRun]:
    cache = ns.work / "cache"
    if ns.smoke:
        common = [f"cache_dir={cache}", "eval.every=0", "checkpoint.every=0", "data.max_files=30",
                  "batch_size=2", "seq_len=64", "model.layers=1"]
        return [TrainRun("small", "tiny", common, 3, 1)]
    common = [f"cache_dir={cache}", "eval.every=0", "checkpoint.every=0", "data.max_files=200"]
    return [TrainRun("small", "small", common, 12, 2),
            TrainRun("1b", "1b", [*common, "batch_size=8"], 8, 2)]


def run_dir(work: pathlib.Path, label: str) -> pathlib.Path:
    """The train part's run ``label`` (the serve part serves ``small``'s)."""
    return work / f"run-{label}"


def need_training(ns) -> dict:
    """The probe's record; Skip off a GPU (unless ``--smoke``) or without jaxpar-train's packages."""
    probe = need_gpu(ns)
    gone = missing(TRAIN_DEPS)
    if gone:
        raise Skip(f"{', '.join(gone)} not installed (jaxpar-train needs them)")
    return probe


def train_once(ns, run: TrainRun, extra: list[str], directory: pathlib.Path, until: float, *,
               keep_checkpoint: bool = False) -> dict:
    """One ``jaxpar-train`` child, killed at ``until``: its figures from metrics.jsonl
    (those of the steps it logged, when killed)."""
    from jaxpar.train.config import load_config
    from jaxpar.train.loop import PEAK_FLOPS, flops_per_token

    overrides = [*run.overrides, *extra, f"steps={run.steps}", f"run_dir={directory}"]
    row = {"label": run.label, "config": run.config, "overrides": overrides, "steps": run.steps,
           "warmup_steps": run.warmup}
    timeout = min(until, part.DEADLINE) - time.time()
    if timeout < 15:
        row["status"] = "skipped: time limit"
        return row
    cmd = self_command("--train-child", *(["--keep-checkpoint"] if keep_checkpoint else []), run.config,
                       *overrides, "--no-progress", "--simulate-devices", "1")
    began = time.perf_counter()
    code, text = run_bounded(cmd, timeout)
    print(text[-6000:], flush=True)
    row["wall_s"] = round(time.perf_counter() - began, 1)
    metrics = directory / "metrics.jsonl"
    steps = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()] if metrics.exists() else []
    row["step_times_s"] = [round(m["step_time_s"], 4) for m in steps]
    timed = [m["step_time_s"] for m in steps[run.warmup:]]
    cfg = load_config(run.config, overrides)
    row["batch_size"], row["seq_len"] = cfg.batch_size, cfg.seq_len
    row["tokens_per_step"] = cfg.batch_size * cfg.seq_len
    row["flops_per_token"] = flops_per_token(cfg)
    if steps:
        row["first_step_s"] = round(steps[0]["step_time_s"], 2)  # compile + one step
        row["losses"] = [round(m["loss"], 4) for m in steps]
        row["device_live_bytes"] = max(m.get("device_live_bytes") or 0 for m in steps)
    if timed:
        row["step_s"] = statistics.median(timed)
        row["tokens_per_s"] = row["tokens_per_step"] / row["step_s"]
        kind = machine(ns).get("device_kind")
        peak = next((f for name, f in PEAK_FLOPS.items() if kind and name in kind), None)
        achieved = row["flops_per_token"] * row["tokens_per_s"]
        row["model_tflops_per_s"] = achieved / 1e12
        if peak:
            row["mfu"] = achieved / peak
            row["peak_flops"] = peak
        measured = measured_peak(ns.work)
        if measured:
            row["mfu_measured_peak"] = achieved / measured
    if code is None:
        row["status"] = f"failed: killed after {timeout:.0f} s, {len(steps)} of {run.steps} steps logged"
    elif code != 0:
        row["status"] = f"failed: exit {code}: {short(text)}"
    elif not timed:
        row["status"] = f"failed: {len(steps)} steps logged, none after the {run.warmup} warm-up ones"
    else:
        row["status"] = "ok"
    if row["status"] != "ok":
        row["tail"] = text[-3000:]
    return row


def describe_run(r: dict) -> str:
    label = r["label"] if r["label"].startswith(r["config"]) else f"{r['label']} ({r['config']} config)"
    if "step_s" not in r:
        return f"{label}: {r['status']}"
    mfu = f", MFU {r['mfu'] * 100:.1f}%" if "mfu" in r else ""
    if "mfu_measured_peak" in r:
        mfu += f" ({r['mfu_measured_peak'] * 100:.1f}% of the measured matmul peak)"
    mem = f", {r['device_live_bytes'] / 2**30:.1f} GiB live" if r.get("device_live_bytes") else ""
    bad = "" if r["status"] == "ok" else f" [{r['status']}]"
    return (f"{label}: {r['tokens_per_s']:,.0f} tokens/s, step {r['step_s'] * 1e3:,.0f} ms{mfu}, "
            f"compile + first step {r['first_step_s']:.0f} s{mem}{bad}")


def train_table(rows: list[dict], first: str = "model") -> list[str]:
    """The runs as BENCHMARKS.md's tables: batch, median step, tokens/s, MFU over the
    nominal and the measured peak, compile + first step, live device bytes."""
    out = []
    for r in rows:
        name, batch = r.get("mode", r["label"]), f"{r.get('batch_size')} x {r.get('seq_len')}"
        if "step_s" not in r:
            out.append([name, batch, r["status"], "-", "-", "-", "-", "-"])
            continue
        out.append([name, batch, f"{r['step_s'] * 1e3:,.0f}", f"{r['tokens_per_s']:,.0f}",
                    f"{r['mfu'] * 100:.1f}%" if "mfu" in r else "-",
                    f"{r['mfu_measured_peak'] * 100:.1f}%" if "mfu_measured_peak" in r else "-",
                    f"{r['first_step_s']:.0f} s",
                    f"{r['device_live_bytes'] / 2**30:.1f}" if r.get("device_live_bytes") else "-"])
    return md_table([first, "batch", "step ms (median)", "tokens/s", "MFU (bf16 peak)", "MFU (measured matmul peak)",
                     "compile + first step", "live GiB"], out)


def part_train(ns, rec: Record) -> None:
    need_training(ns)
    keep = not missing(HTTP_DEPS)  # the serve part's jaxpar-serve reads the small run
    rec["rows"] = []
    runs = train_runs(ns)
    start = time.time()
    for i, run in enumerate(runs):
        share = 1.0 if i == len(runs) - 1 else 0.4  # small gets at most 40% of what is left; the last run the rest
        row = train_once(ns, run, [], run_dir(ns.work, run.label), time.time() + share * time_left(),
                         keep_checkpoint=keep and run.label == "small")
        rec["rows"].append(row)
        rec.save()
        print(f"  {describe_run(row)}", flush=True)
    rows = rec["rows"]
    rec["status"] = "ok" if all(r["status"] == "ok" for r in rows) else "failed"
    rec["summary"] = "; ".join(describe_run(r) for r in rows)

    def settings(r):
        return " ".join(o for o in r["overrides"] if not o.startswith(("cache_dir", "run_dir")))

    rec["details"] = train_table(rows) + [
        f"  {r['label']} ({r['config']} {settings(r)}): step times {r.get('step_times_s')}, losses {r.get('losses')}"
        for r in rows]
    rec["seconds"] = round(time.time() - start, 1)


def part_offload(ns, rec: Record) -> None:
    need_training(ns)
    run = train_runs(ns)[0]
    base = next((r for r in read_result(ns.work, "train").get("rows") or []
                 if r["label"] == run.label and r["status"] == "ok"), None)
    rows = []
    if base is None:  # the train part did not give one: measure it here
        base = train_once(ns, run, [], ns.work / "offload-none", time.time() + 0.4 * time_left())
        base["label"] = f"{run.label}, all on device"
        rows.append(base)
    else:
        base = dict(base, label=f"{run.label}, all on device (the train part's run)")
    rec["baseline"] = base
    rec["rows"] = rows
    for i, (mode, extra) in enumerate(OFFLOAD_MODES):
        share = 1.0 if i == len(OFFLOAD_MODES) - 1 else 0.55
        row = train_once(ns, run, extra, ns.work / f"offload-{i}", time.time() + share * time_left())
        row["label"] = f"{run.label}, {mode}"
        row["mode"] = mode
        if "tokens_per_s" in row and "tokens_per_s" in base:
            row["vs_all_on_device"] = row["tokens_per_s"] / base["tokens_per_s"]
            if base.get("device_live_bytes") and row.get("device_live_bytes"):
                row["device_bytes_vs_all_on_device"] = row["device_live_bytes"] / base["device_live_bytes"]
        rows.append(row)
        rec.save()
        print(f"  {describe_run(row)}", flush=True)
    offloaded = [r for r in rows if "mode" in r]
    rec["status"] = "ok" if all(r["status"] == "ok" for r in rows) and "tokens_per_s" in base else "failed"
    said = []
    for r in offloaded:
        if "vs_all_on_device" in r:
            mem = (f", device bytes {r['device_bytes_vs_all_on_device']:.2f}x"
                   if "device_bytes_vs_all_on_device" in r else "")
            said.append(f"{r['mode']}: {r['tokens_per_s']:,.0f} tokens/s = {r['vs_all_on_device']:.2f}x "
                        f"all-on-device{mem}")
        else:
            said.append(f"{r['mode']}: {r['status']}")
    rec["summary"] = f"{run.label} ({base.get('tokens_per_s', 0):,.0f} tokens/s all on device): " + "; ".join(said)
    table = train_table([dict(base, mode="none (all on device)"), *offloaded], first=f"{run.label}: offload")
    rec["details"] = table + [f"  {r['mode']}: {r['vs_all_on_device']:.2f}x the all-on-device tokens/s"
                              for r in offloaded if "vs_all_on_device" in r]
