"""The driver: the probe, then each part in a bounded process of its own; the outputs.

Off a GPU (the probe's answer, unless ``--smoke``): one line, nothing written, exit 0.
Otherwise each chosen part runs (``part.run_part``) until its deadline, the sum of its
own bound and those before it from the start, scaled by ``--time-limit-s`` / 560; a
part with under 10 s left is ``skipped``. After every part ``DIR/results.json`` and
``DIR/summary.txt`` are rewritten; ``DIR/gpu_check.log`` has every part's output. The
exit status is 1 if any part failed, else 0. Only the standard library: this process
never starts JAX.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import processes
from part import run_part, short, write_json

# (name, bound in seconds). The bounds add up to the default --time-limit-s.
PARTS = (("probe", 40), ("correctness", 100), ("model", 45), ("kernels", 100), ("train", 130),
         ("offload", 80), ("serve", 65))
TIME_LIMIT_S = sum(bound for _, bound in PARTS)  # 560
DESCRIPTION = "A GPU user's first check, in one command (issue 35, item 9): ``bash bench/gpu_check.sh``."


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bash bench/gpu_check.sh", description=DESCRIPTION)
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="where results.json, summary.txt and gpu_check.log go ($OUT, else runs/gpu_check)")
    p.add_argument("--parts", nargs="+", choices=[name for name, _ in PARTS if name != "probe"],
                   default=[name for name, _ in PARTS if name != "probe"], help="which parts (all)")
    p.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S,
                   help="the whole run's bound; the parts' bounds are scaled to it (%(default)s)")
    p.add_argument("--smoke", action="store_true",
                   help="every part tiny, on any backend (Pallas interpret mode off a GPU): checks this script")
    p.add_argument("--keep-work", action="store_true", help="keep the scratch directory (run dirs, caches)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else processes.ROOT / "runs" / "gpu_check"
    return args


def main(argv) -> int:
    args = parse_args(argv)
    processes.exit_on_sigterm()
    work = pathlib.Path(tempfile.mkdtemp(prefix="jaxpar-gpu-check-"))
    try:
        return orchestrate(args, work)
    finally:
        if args.keep_work:
            print(f"scratch kept: {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def orchestrate(args, work: pathlib.Path) -> int:
    began = time.time()
    scale = args.time_limit_s / TIME_LIMIT_S
    shim = processes.make_shim(processes.shim_dir(work))
    processes.use_shim(work)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

    # The probe first: without a GPU, one line and nothing written.
    probe_bound = PARTS[0][1] * scale
    code, text, probe, took = run_part("probe", work, began + probe_bound, args.smoke, env=env)
    backend = probe.get("backend")
    if not args.smoke and backend != "gpu":
        if code is None:
            why = f"jax did not answer in {probe_bound:.0f} s"
        elif probe.get("error") or not backend:
            why = probe.get("error") or f"the probe failed: {short(text) or f'exit {code}'}"
        else:
            why = f"jax backend: {backend}"
        print(f"gpu_check: no GPU here ({why}); nothing to check", flush=True)
        return 0

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "gpu_check": 1, "smoke": args.smoke,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["bash bench/gpu_check.sh", *sys.argv[1:]]),
        "git": git_state(), "nvidia_smi": nvidia_smi(), "time_limit_s": args.time_limit_s,
        "machine": {k: v for k, v in probe.items() if k not in ("status", "summary")},
        "parts": {"probe": finish("probe", code, text, probe, took, probe_bound)},
    }
    print(headline(results), flush=True)
    print(line("probe", results["parts"]["probe"]), flush=True)
    write_all(out, results, began)
    with (out / "gpu_check.log").open("w") as log:
        log.write(f"== probe ({took:.0f} s)\n{text}\n")
        deadline = began + probe_bound
        for name, bound in PARTS[1:]:
            deadline += bound * scale
            if name not in args.parts:
                continue
            if deadline - time.time() < 10:
                results["parts"][name] = {"status": "skipped", "reason": "time limit: no time left",
                                          "duration_s": 0.0, "bound_s": round(bound * scale)}
            else:
                print(f"{name} ... (until +{deadline - began:.0f} s)", flush=True)
                log.write(f"\n== {name} (from +{time.time() - began:.0f} s, until +{deadline - began:.0f} s)\n")
                log.flush()
                code, text, record, took = run_part(name, work, deadline, args.smoke, env=env, log=log)
                results["parts"][name] = finish(name, code, text, record, took, deadline - began)
            print(line(name, results["parts"][name]), flush=True)
            write_all(out, results, began)
    summary = write_all(out, results, began)
    print("\n" + summary, flush=True)
    print(f"wrote {out / 'results.json'}, {out / 'summary.txt'} and {out / 'gpu_check.log'}", flush=True)
    return 1 if any(p["status"] == "failed" for p in results["parts"].values()) else 0


def git_state() -> dict:
    def git(*a):
        try:
            proc = subprocess.run(["git", "-C", str(processes.ROOT), *a], capture_output=True, text=True, timeout=10)
            return proc.stdout.strip() if proc.returncode == 0 else None
        except Exception:  # noqa: BLE001 - no git, or no repository (a copied tree)
            return None

    commit = git("rev-parse", "--short", "HEAD")
    changed = git("status", "--porcelain")
    return {"commit": commit, "changed_files": None if changed is None else len(changed.splitlines())}


def nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        return proc.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def finish(name: str, code: int | None, text: str, record: dict, took: float, until: float) -> dict:
    """The part's entry in results.json, from its exit and its record."""
    part = dict(record)
    status = part.get("status")
    if code is None:
        part["status"] = "failed"
        part["reason"] = f"killed at its bound (+{until:.0f} s from the start) after {took:.0f} s" + (
            f"; it had: {part['summary']}" if part.get("summary") else "")
    elif status not in ("ok", "failed", "skipped"):
        part["status"] = "failed"
        part.setdefault("reason", f"exit {code} without a result: {short(text)}")
    elif code != 0 and status == "ok":
        part["status"] = "failed"
        part["reason"] = f"exit {code}: {short(text)}"
    part["duration_s"] = round(took, 1)
    if part["status"] == "failed":
        part["tail"] = text[-4000:]
    return part


def headline(results: dict) -> str:
    m = results["machine"]
    device = m.get("device_kind", "?")
    cap = f" (compute capability {m['capability']})" if m.get("capability") else ""
    git = results["git"]
    if git.get("commit"):
        changed = git.get("changed_files")
        rev = f"jaxpar {git['commit']}" + (f" with {changed} files changed" if changed else "")
    else:
        rev = "jaxpar (no git)"
    smoke = " SMOKE (tiny shapes, not a measurement)" if results["smoke"] else ""
    return (f"gpu_check{smoke}: {m.get('device_count', '?')} x {device}{cap}, {m.get('backend')} backend, "
            f"JAX {m.get('jax', '?')}, Python {m.get('python', '?')}, {m.get('cpus', '?')} CPUs; "
            f"{results['date']}; {rev}")


def line(name: str, part: dict) -> str:
    what = part.get("summary") or ""
    if part["status"] != "ok" and part.get("reason"):
        what = part["reason"] + (f" | {what}" if what and what not in part["reason"] else "")
    return f"{name:<12} {part['status']:<8} {part.get('duration_s', 0):>5.0f} s  {what}"


def write_all(out: pathlib.Path, results: dict, began: float) -> str:
    """results.json and summary.txt, rewritten; the summary's text."""
    results["elapsed_s"] = round(time.time() - began, 1)
    write_json(out / "results.json", results)
    lines = [headline(results),
             f"{results['elapsed_s']:.0f} s in all, bound {results['time_limit_s']:.0f} s; every figure in "
             "results.json beside this file", "",
             f"{'part':<12} {'status':<8} {'time':>7}  what it gave"]
    lines += [line(name, part) for name, part in results["parts"].items()]
    for name, part in results["parts"].items():
        if part.get("details"):
            lines += ["", f"{name}:", *part["details"]]
    summary = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(summary)
    return summary
