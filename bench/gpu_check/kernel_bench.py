"""The ``kernels`` part (100 s): ``bench/kernels.py``'s figures on a reduced set.

``bench/kernels.py --skip-train`` with ``KERNEL_ARGS``: the ceilings (bf16 matmul peak,
copy bandwidth), norms, cross-entropy, attention 4x32x4096x128 causal and not and
2x32x8192x128 not causal for jaxpar / cuDNN / XLA, decode at S=16384 for batch 1 and 8,
the MoE grouped matmul (Mixtral 8x7B's up projection, 16384 x 4096 x 14336, 8 experts)
against ``jax.lax.ragged_dot`` (``--smoke``: its own smoke of the ceilings, norms and
cross-entropy). It stops starting measurements at its own time limit, 25 s before the part's bound, and is killed 10 s
before it. Its figures go to results.json, its tables (as BENCHMARKS.md's "Kernels"
section prints them) and targets to summary.txt; the train part reads the measured
matmul peak (``measured_peak``).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys

from part import Record, Skip, load_bench, short, time_left
from probe import need_gpu
from processes import ROOT, run_bounded

KERNEL_ARGS = ["--attention-shapes", "4x32x4096x128", "2x32x8192x128:noncausal",
               "--attention-impls", "jaxpar", "cudnn", "xla",
               "--decode-lengths", "16384", "--decode-new-tokens", "1",
               "--repeats", "10", "--budget-s", "0.2"]


def figures_file(work: pathlib.Path) -> pathlib.Path:
    return work / "kernels.json"


def measured_peak(work: pathlib.Path) -> float | None:
    """The bf16 matmul peak the kernels part measured, if it ran."""
    with contextlib.suppress(Exception):
        return (json.loads(figures_file(work).read_text()).get("ceilings") or {}).get("peak_flops")
    return None


def part_kernels(ns, rec: Record) -> None:
    need_gpu(ns)
    out = figures_file(ns.work)
    limit = time_left() - 20  # for its tables and this part's own
    if limit < 20:
        raise Skip("time limit")
    cmd = [sys.executable, str(ROOT / "bench" / "kernels.py"), "--skip-train", "--json", str(out),
           "--time-limit-s", f"{limit:.0f}"]
    cmd += ["--smoke", "--parts", "ceilings", "norms", "ce"] if ns.smoke else KERNEL_ARGS
    rec["command"] = " ".join(["python", *cmd[1:]])
    code, text = run_bounded(cmd, time_left() - 5)
    print(text, flush=True)
    res = json.loads(out.read_text()) if out.exists() else {}
    rec["kernels"] = res
    rec.save()
    if code is None or not res:
        rec["status"] = "failed"
        rec["reason"] = "bench/kernels.py " + ("ran out of time" if code is None else f"ended with {code}") + \
            ("" if res else ", no figures")
    rec["details"] = tables(res, rec)
    errors = [r for key in ("norms", "ce", "attention", "decode", "gmm") for r in res.get(key) or []
              if any(isinstance(v, dict) and "error" in v and not str(v["error"]).startswith(("needs GPU", "skipped"))
                     for v in r.values())]
    c = res.get("ceilings") or {}
    figures = []
    if c.get("peak_flops"):
        figures.append(f"bf16 matmul {c['peak_flops'] / 1e12:.0f} TFLOP/s, copy {c['copy_bw'] / 1e9:,.0f} GB/s")
    for goal, got, verdict in rec.get("targets", []):
        if verdict != "-":
            verdict = verdict if res.get("backend") == "gpu" else "no verdict off GPU"
            figures.append(f"{goal.split(' (')[0]}: {got} ({verdict})")
    rec.setdefault("status", "ok")
    rec["summary"] = "; ".join(figures) or "no figures"
    if errors:
        rec["summary"] += f"; {len(errors)} measurements with errors (see results.json)"


def tables(res: dict, rec: Record) -> list[str]:
    """bench/kernels.py's tables of ``res``, indented for summary.txt; its targets to
    ``rec["targets"]``."""
    details = []
    try:
        kb = load_bench("kernels")
        c = res.get("ceilings") or {}
        peak, copy_bw = c.get("peak_flops"), c.get("copy_bw")
        if c:
            details += ["Ceilings:", kb.ceilings_table(c), ""]
        for key, render, title in (
                ("norms", lambda r: kb.norms_table(r, copy_bw), "Norms"),
                ("ce", lambda r: kb.ce_table(r, peak, copy_bw), "Linear + cross-entropy"),
                ("attention", lambda r: kb.attention_table(r, peak), "Attention"),
                ("decode", lambda r: kb.decode_table(r, copy_bw), "Decode attention"),
                ("gmm", lambda r: kb.gmm_table(r, peak), "Grouped matmul (MoE) against ragged_dot")):
            if res.get(key):
                details += [f"{title}:", render(res[key]), ""]
        rec["targets"] = kb._targets(res)
        details += ["Targets:", kb.targets_table(res)]
    except Exception as e:  # noqa: BLE001 - the figures are in results.json all the same
        details.append(f"(tables not drawn: {short(e)})")
    return ["  " + l for l in "\n".join(details).splitlines()]
