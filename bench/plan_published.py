"""The planner's step-time model against published large-model training runs
(``bench/plan_published.yaml``: Megatron-LM 2021, Llama 3 405B, NeMo AutoModel Llama 3
70B), and where the planner ranks each published layout among its own candidates.

    python bench/plan_published.py [--runs NAME ...] [--no-rank] [--json PATH]

The run kept in the repository (4 minutes on 2 cores, analytic: nothing compiles):

    python bench/plan_published.py --json bench/results/plan_published.json

For each usable row of the YAML (``--runs`` picks some by name; rows without a layout
and FP8 rows are listed as skipped, with why): the model as a ``ModelConfig`` (GPT-3
style rows: ``mlp=gelu, norm=layer, position=learned, max_position=seq_len``, tied
embeddings as the row says; Llama rows: ``swiglu, rms, rope``; all ``dtype=bfloat16,
param_dtype=float32``), a ``Workload(model, global_batch, seq_len)`` and the published
layout as a jaxpar ``Layout``:

* the data-parallel degree goes to ``fsdp`` where the run sharded its optimizer state
  over it (FSDP, ZeRO, Megatron's distributed optimizer: the YAML's
  ``distributed_optimizer: true``), to ``data`` otherwise;
* ``tensor``, ``pipe``, ``seq`` (context parallelism, the ring) as published;
* microbatches per data-parallel replica: the pipeline's ``microbatches`` when
  ``pipe > 1``, else gradient accumulation (``grad_accum``); schedule ``interleaved``
  with ``virtual_stages > 1``, else ``1f1b``;
* remat ``full`` for full recompute, ``dots_no_batch`` for selective, else ``none``;
  Megatron sequence parallelism as published.

What a row does not publish is assumed, and every assumption is listed in the JSON
(``assumptions``): Llama 3 405B's microbatch size (1, so M = sequences per DP group),
virtual stages (4; the bubble for 1, 2, 4, 8 is in ``alternatives``) and sequence
parallelism (on); its pipeline is modelled with 128 layers (the paper's 16 ranks x 8
slots, 126 layers + the embedding and the head in two slots; jaxpar shards layers evenly
over ``pipe``), its FLOPs (MFU) with the real 126.

Reported step time: from the source's throughput and the source's own FLOP count:
Megatron's Eq. 3 (``F = 96 B s l h^2 (1 + s/6h + V/16lh)``, recompute included;
step = F / (GPUs x TFLOP/s per GPU)); Llama 3's PaLM MFU (``6 x matmul parameters +
12 l s h`` per token, dense attention, as Chowdhery et al. count it; the causal count is
kept beside it); tokens/s per GPU where the source gives it (step = batch x seq /
(tokens/s/GPU x GPUs)). MFU under jaxpar's convention
(``Workload.model_flops() / (step x GPUs x peak bf16)``) for both the reported and the
predicted step, so like is compared with like; the source's own MFU figure beside it.

Predicted: ``jaxpar.planning.cost.step_time(work, layout, hw, devices_per_node=8,
own_pipeline=False)`` (these runs' pipelines branch, each device running its own
operation, and recompute no stage forward but by their remat policy; jaxpar's runs in
lockstep with ring attention inside its stages, and its stage backward recomputes the
stage's forward) on
the shipped ``a100`` / ``h100`` profiles, as they are (not tuned to these runs), and,
for a row whose software was not today's (the YAML's ``stack``), on that stack's
profile as well (``STACKS``): the shipped profile with the overlap the stack had and one
compute rate, fitted on one of its runs (its ``fit_run``) and checked on the others.
The shipped profiles' efficiencies are today's kernels (cuBLAS at 85% of peak,
FlashAttention-2 at 55%); Megatron-LM 2021 ran neither FlashAttention nor today's
fused kernels, and all-reduced its gradients after the pipeline's flush, under no
compute (its ``train_step``: ``forward_backward_func``, then, with its local DDP,
``allreduce_gradients()`` under the ``backward-params-all-reduce`` timer). The fit run
is the stack's smallest (1.7B on 32 GPUs, data parallelism alone): the step with the
least besides its kernels. So the stack's rows check the model's layout terms
(bubble, schedule, tensor and pipeline traffic) with the rate of the kernels taken from
one run, and the shipped profile's error beside them is the kernels' difference.

Rank (``--no-rank`` skips it): ``jaxpar.planning.search.search`` over the run's devices,
analytic (``compile=None``), ``device_memory=80GiB``, ``Space(offload=False,
tensor_2d=False)`` and ``backend="gpu"`` (the memory model's GPU figures: nothing is
compiled for XLA:CPU here). The published layout is then found among the candidates
(same mesh, schedule, microbatches, virtual stages, remat, sequence parallelism and
gradient accumulation) or, where the enumeration's bounds leave it out (microbatches
beyond ``8 x pipe``, say), inserted with its own estimate: its rank is where the
planner's ordering (fitting first, then fastest) puts it. Beside it, the planner's top
choice, its predicted time and its split against the published layout's.

Printed: the prediction table, the ranking table, and the alternatives (Llama 3
405B's virtual stages; FSDP rows with the data-parallel degree as plain ``data``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import sys
import tempfile
import time

from plan_memory import git_head, sources_hash  # noqa: E402 - bench/ is this script's folder

ROOT = pathlib.Path(__file__).resolve().parents[1]
YAML = ROOT / "bench" / "plan_published.yaml"
GIB = 2 ** 30
PLANNER_FILES = ("jaxpar/planning/layout.py", "jaxpar/planning/workload.py", "jaxpar/planning/memory.py",
                 "jaxpar/planning/cost.py", "jaxpar/planning/search.py", "jaxpar/planning/hardware/a100.yaml",
                 "jaxpar/planning/hardware/h100.yaml")
SPLIT = ("compute", "communication", "bubble", "offload")
LLAMA_VIRTUAL = 4  # assumed: not published
# The software a run's kernels came from, where it was not today's (module docstring):
# the overlap it had (``comm_overlap``, the profile's field) and the run its one compute
# rate is fitted on.
STACKS = {
    "megatron-lm-2021": {
        "comm_overlap": 0.0,
        "fit_run": "megatron-gpt-1.7b-table1-32gpu",
        "why": "Megatron-LM 2021: no FlashAttention nor today's fused kernels (one compute rate, fitted on its "
               "1.7B run); its local DDP all-reduced the gradients after the pipeline's flush (comm_overlap 0: "
               "these layouts have no other overlapped traffic)",
    },
}
LLAMA_PIPE_LAYERS = 128  # 16 ranks x 8 slots (126 layers + embedding + head)


# ----------------------------------------------------------------------------- rows


def skip_reason(row: dict) -> str | None:
    lay = row["layout"]
    if any(lay.get(k) is None for k in ("data", "tensor", "pipe")):
        return "no published layout (a training-time estimate): nothing to predict"
    if row.get("precision") == "fp8":
        return ("FP8: the hardware profiles give no fp8 peak, and FP8 matmul throughput cannot be "
                "modelled honestly with the bf16 efficiency; excluded")
    return None


def model_config(row: dict, layers: int | None = None):
    from jaxpar.models.config import ModelConfig

    m = row["model"]
    gpt = m["mlp"] == "gelu"
    return ModelConfig(
        vocab_size=m["vocab_size"], dim=m["dim"], layers=layers or m["layers"], heads=m["heads"],
        kv_heads=m["kv_heads"], head_dim=m["head_dim"], mlp_dim=m["mlp_dim"], mlp=m["mlp"],
        norm="layer" if gpt else "rms", position="learned" if gpt else "rope",
        max_position=row["seq_len"] if gpt else 2048, tie_embeddings=bool(m["tie_embeddings"]),
        dtype="bfloat16", param_dtype="float32")


def is_llama3_405b(row: dict) -> bool:
    return row["name"].startswith("llama3-405b")


def published_layout(row: dict, virtual_override: int | None = None, dp_as: str | None = None):
    """``(Layout, assumptions)`` of a row's published layout."""
    from jaxpar.planning.layout import Layout

    lay = row["layout"]
    notes = []
    sharded = bool(lay.get("distributed_optimizer")) or (lay.get("fsdp") or 1) > 1
    where = dp_as or ("fsdp" if sharded else "data")
    dp = lay["data"]
    pipe, tensor, seq = lay["pipe"], lay["tensor"], lay.get("seq") or 1
    micro = lay.get("microbatches")
    if micro is None:
        micro = row["global_batch"] // dp
        notes.append(f"microbatch size not published: 1 assumed, so {micro} microbatches per DP replica "
                     f"(global batch {row['global_batch']} / DP {dp})")
    virtual = lay.get("virtual_stages")
    if virtual is None:
        if lay.get("schedule") == "interleaved":
            virtual = LLAMA_VIRTUAL
            notes.append(f"virtual stages not published: {virtual} assumed (see alternatives for 1, 2, 4, 8)")
        else:
            virtual = 1
            notes.append("schedule / virtual stages not published: non-interleaved 1F1B assumed")
    if virtual_override is not None:
        virtual = virtual_override
    remat = {"full": "full", "selective": "dots_no_batch"}.get(lay.get("remat") or "none", "none")
    if lay.get("remat") is None:
        notes.append("remat not stated: none assumed (as the 8K stage; CP=16 keeps 8K tokens per rank)")
    sp = lay.get("sequence_parallel")
    if sp is None:
        sp = tensor > 1
        notes.append(f"sequence parallelism not stated: {'on' if sp else 'off'} assumed")
    kwargs = dict(data=dp if where == "data" else 1, fsdp=dp if where == "fsdp" else 1, tensor=tensor, pipe=pipe,
                  seq=seq, sequence_parallel=bool(sp and tensor > 1), remat=remat, seq_impl="ring")
    if pipe > 1:
        kwargs |= dict(schedule="interleaved" if virtual > 1 else "1f1b", microbatches=micro, virtual_stages=virtual)
    else:
        kwargs |= dict(grad_accum=micro)
    if seq > 1:
        notes.append("context parallelism as jaxpar's ring attention (seq_impl=ring)")
    if where == "fsdp":
        notes.append(f"DP={dp} shards the optimizer state (distributed optimizer / FSDP): mapped to jaxpar fsdp={dp} "
                     "(ZeRO-3: parameters gathered per layer and microbatch)")
    return Layout(**kwargs), notes


def megatron_eq3(row: dict) -> float:
    """Megatron-LM 2021 Eq. 3: FLOPs per iteration, recompute included."""
    m = row["model"]
    b, s, l, h, v = row["global_batch"], row["seq_len"], m["layers"], m["dim"], m["vocab_size"]
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def palm_flops(row: dict, causal: bool = False) -> float:
    """PaLM's (Chowdhery et al.) training FLOPs per step: 6 x (non-embedding + head
    matmul parameters) + 12 l s h per token (6 l s h with a causal discount)."""
    m = row["model"]
    d, n, k, hd, f = m["dim"], m["heads"], m["kv_heads"], m["head_dim"], m["mlp_dim"]
    per_layer = d * (n + 2 * k) * hd + n * hd * d + d * f * (3 if m["mlp"] == "swiglu" else 2)
    params = m["layers"] * per_layer + m["vocab_size"] * d
    attention = (6 if causal else 12) * m["layers"] * n * hd * row["seq_len"]
    return row["global_batch"] * row["seq_len"] * (6 * params + attention)


def reported(row: dict) -> dict:
    """The reported step time (seconds) from the source's throughput and FLOP count, and
    the source's own MFU figure."""
    rep, der = row.get("reported", {}), row.get("derived", {})
    n = row["devices"]
    out: dict = {}
    if "tokens_per_s_per_gpu" in rep:
        out["step_s"] = row["global_batch"] * row["seq_len"] / (rep["tokens_per_s_per_gpu"] * n)
        out["formula"] = "global_batch x seq_len / (tokens/s per GPU x GPUs)"
    elif row["name"].startswith("megatron"):
        out["step_s"] = megatron_eq3(row) / (n * rep["tflops_per_gpu"] * 1e12)
        out["formula"] = "Megatron Eq. 3 F / (GPUs x TFLOP/s per GPU) (F counts the recompute forward)"
    else:  # Llama 3: PaLM's MFU convention
        out["step_s"] = palm_flops(row) / (n * rep["tflops_per_gpu"] * 1e12)
        out["step_s_causal"] = palm_flops(row, causal=True) / (n * rep["tflops_per_gpu"] * 1e12)
        out["formula"] = ("PaLM FLOPs (6 x matmul params + 12 l s h per token, dense attention) / (GPUs x TFLOP/s "
                          "per GPU); step_s_causal: with 6 l s h")
    yaml_step = der.get("step_time_s", rep.get("step_time_s", der.get("step_time_s_dense_attn")))
    if yaml_step is not None:
        out["yaml_step_s"] = yaml_step  # the YAML's own arithmetic, a cross-check
    if "mfu" in rep:
        out["source_mfu"], out["source_mfu_kind"] = rep["mfu"], "published"
    else:
        key = next((k for k in der if k.startswith("mfu_vs")), None)
        if key:
            out["source_mfu"], out["source_mfu_kind"] = der[key], f"derived here ({key}: TFLOP/s / peak)"
    out["tflops_per_gpu"] = rep.get("tflops_per_gpu")
    return out


# ----------------------------------------------------------------------------- prediction


def split_seconds(st) -> dict:
    return {k: float(v) for k, v in st.split().items()}


def predict(work, layout, hw, flops_work) -> dict:
    from jaxpar.planning import cost, memory

    st = cost.step_time(work, layout, hw, devices_per_node=8, own_pipeline=False)  # as Megatron's pipelines run
    mem = memory.estimate(work, layout, backend="gpu")
    return {"step_s": st.total, "split_s": split_seconds(st),
            "mfu": flops_work.model_flops() / (st.total * layout.devices * hw.peak("bfloat16")),
            "memory_gib": mem["device"] / GIB, "memory_parts_gib": {k: mem[k] / GIB for k in mem},
            "fits_80gib": mem["device"] <= 80 * GIB}


def with_rate(hw, rate: float, comm_overlap: float):
    """``hw`` with its matmul and attention efficiencies times ``rate`` and
    ``comm_overlap`` replaced."""
    return dataclasses.replace(hw, name=f"{hw.name} x{rate:.3f}", comm_overlap=comm_overlap,
                               efficiency={k: v * rate for k, v in hw.efficiency.items()})


def stack_profile(stack: str, rows: list[dict], cache: str):
    """``(Hardware, rate)``: the shipped profile of ``stack``'s fit run with the stack's
    overlap and the one compute rate under which the fit run's predicted step equals its
    reported one (bisection: the step falls as the rate grows)."""
    from jaxpar.planning import cost, hardware
    from jaxpar.planning.workload import Workload

    spec = STACKS[stack]
    row = next(r for r in rows if r["name"] == spec["fit_run"])
    base = hardware.load(row["hardware"], cache)
    work = Workload(model_config(row), row["global_batch"], row["seq_len"])
    layout, _ = published_layout(row)
    target = reported(row)["step_s"]
    lo, hi = 0.05, 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        step = cost.step_time(work, layout, with_rate(base, mid, spec["comm_overlap"]), devices_per_node=8,
                              own_pipeline=False).total
        lo, hi = (lo, mid) if step < target else (mid, hi)
    rate = (lo + hi) / 2
    return with_rate(base, rate, spec["comm_overlap"]), rate


def rank(work, layout, hw, devices: int, flops_work) -> dict:
    """The planner's ranking (analytic) and where ``layout`` sits in it."""
    from jaxpar.planning import cost, memory, search
    from jaxpar.planning.layout import Space

    space = Space(offload=False, tensor_2d=False)
    began = time.perf_counter()
    plan = search.search(work, devices, hw, device_memory=80 * GIB, devices_per_node=8, space=space, backend="gpu")
    seconds = time.perf_counter() - began
    cands = plan.candidates
    exact = next((i for i, c in enumerate(cands) if c.layout == layout), None)
    out = {"space": "Space(offload=False, tensor_2d=False), backend=gpu, device_memory=80GiB, devices_per_node=8",
           "seconds": round(seconds, 1), "considered": plan.considered, "kept": len(cands),
           "fitting": sum(c.fits for c in cands), "pruned": dict(plan.pruned)}
    if exact is not None:
        out["published"] = {"rank": exact + 1, "match": "exact (in the enumeration)"}
    else:  # not enumerated: inserted with its own estimate, ranked by the planner's key
        mem = memory.estimate(work, layout, backend="gpu")
        mine = search.Candidate(layout, mem, cost.step_time(work, layout, hw, devices_per_node=8, own_pipeline=False))
        mine.fits = mem["device"] <= 80 * GIB
        key = search._rank_key(mine)
        position = sum(search._rank_key(c) < key for c in cands)
        why = []
        same_mesh = [c for c in cands if c.layout.mesh_sizes == layout.mesh_sizes]
        if not same_mesh:
            why.append("its mesh is not enumerated")
        elif layout.pipe > 1 and layout.microbatches > 8 * layout.pipe:
            why.append(f"microbatches {layout.microbatches} > 8 x pipe (a bound)")
        elif layout.pipe > 1 and layout.microbatches & (layout.microbatches - 1):
            why.append(f"microbatches {layout.microbatches} not a power of two (a bound)")
        elif layout.grad_accum > 1 and layout.grad_accum & (layout.grad_accum - 1):
            why.append(f"grad_accum {layout.grad_accum} not a power of two (a bound)")
        elif layout.pipe > 1 and layout.virtual_stages not in (1, 2, 4):
            why.append(f"virtual_stages {layout.virtual_stages} not in (2, 4) (a bound)")
        else:
            why.append("not among the kept candidates")
        closest = None
        if same_mesh:
            def distance(c):
                lo = c.layout
                return ((lo.remat != layout.remat) * 4 + (lo.sequence_parallel != layout.sequence_parallel) * 4
                        + (lo.schedule != layout.schedule) * 2 + (lo.virtual_stages != layout.virtual_stages)
                        + abs(math.log2(lo.microbatches / layout.microbatches))
                        + abs(math.log2(lo.grad_accum / layout.grad_accum)))
            best = min(same_mesh, key=distance)
            closest = {"rank": cands.index(best) + 1, "describe": best.layout.describe(),
                       "step_s": best.time.total}
        out["published"] = {"rank": position + 1, "match": "inserted (not enumerated: " + "; ".join(why) + ")",
                            "fits": mine.fits, "closest_enumerated": closest}
    meshes = list(dict.fromkeys(tuple(c.layout.mesh_sizes.items()) for c in cands))
    mine_mesh = tuple(layout.mesh_sizes.items())
    out["meshes"] = len(meshes)
    if mine_mesh in meshes:
        best = next(c for c in cands if tuple(c.layout.mesh_sizes.items()) == mine_mesh)
        out["published_mesh"] = {"rank": meshes.index(mine_mesh) + 1, "best": best.layout.describe(),
                                 "best_rank": cands.index(best) + 1, "best_step_s": best.time.total,
                                 "best_fits": best.fits}
    top = cands[0]
    out["top"] = {"describe": top.layout.describe(), "overrides": top.layout.overrides(), "step_s": top.time.total,
                  "split_s": split_seconds(top.time), "fits": top.fits, "memory_gib": top.memory["device"] / GIB,
                  "mfu": flops_work.model_flops() / (top.time.total * devices * hw.peak("bfloat16"))}
    return out


def why_faster(pub: dict, top: dict, pub_layout_describe: str) -> str:
    """The top choice's split against the published layout's, largest gains first."""
    diffs = sorted(((top["split_s"][k] - pub["split_s"][k], k) for k in SPLIT), key=lambda x: x[0])
    words = [f"{k} {d:+.1f} s" for d, k in diffs if abs(d) >= 0.05]
    return ", ".join(words) or "same split"


# ----------------------------------------------------------------------------- output


def fmt_split(split: dict, total: float) -> str:
    return " / ".join(f"{split[k]:.1f}" for k in ("compute", "communication", "bubble")) + \
        (f" / off {split['offload']:.1f}" if split["offload"] > 0.05 else "")


def shipped_error(r: dict) -> str:
    """`` (fitted; shipped: +33.3%)`` for a stack's row, else nothing."""
    if "stack" not in r:
        return ""
    fitted = "fitted; " if r["name"] == r["stack"]["fit_run"] else ""
    return f" ({fitted}shipped: {r['mfu_relative_error_shipped']:+.1%})"


def tables(results: list[dict], skipped: list[dict]) -> list[str]:
    lines = ["| run | GPUs | layout (jaxpar) | reported step | reported MFU (jaxpar conv.) | source's MFU | "
             "predicted step | predicted MFU | MFU error (shipped profile's) | predicted compute / comm / bubble, s | fits 80 GiB (est.) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rep, pred = r["reported"], r["predicted"]
        source = (f"{rep['source_mfu']:.1%}" + (" (derived)" if rep.get("source_mfu_kind", "").startswith("derived")
                                                 else "")) if "source_mfu" in rep else "-"
        extra = f" ({rep['step_s_causal']:.2f} causal)" if "step_s_causal" in rep else ""
        lines.append(
            f"| {r['name']} | {r['devices']:,} | `{r['layout']['describe']}` | {rep['step_s']:.2f} s{extra} | "
            f"{rep['mfu_jaxpar']:.1%} | {source} | {pred['step_s']:.2f} s | {pred['mfu']:.1%} | "
            f"{r['mfu_relative_error']:+.1%}{shipped_error(r)} | {fmt_split(pred['split_s'], pred['step_s'])} | "
            f"{'yes' if pred['fits_80gib'] else 'no'} ({pred['memory_gib']:.0f} GiB) |")
    stacks = {r["stack"]["name"]: r for r in results if "stack" in r}
    for name, r in stacks.items():
        st = r["stack"]
        lines += ["", f"Stack {name}: the shipped {r['hardware'].split()[0]} profile with its matmul and attention "
                      f"efficiencies x{st['rate']:.3f} (fitted on {st['fit_run']}) and comm_overlap "
                      f"{st['comm_overlap']:g}. {st['why']}."]
    ranked = [r for r in results if "rank" in r]
    if ranked:
        lines += ["", "| run | candidates (fit) | published layout's rank (its mesh's rank) | planner's top choice | top: step, MFU "
                  "(predicted) | published: compute / comm / bubble, s | top: compute / comm / bubble, s | "
                  "where the top choice gains | search |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in ranked:
            k, pub, top = r["rank"], r["predicted"], r["rank"]["top"]
            p = k["published"]
            rank_text = f"{p['rank']:,} ({p['match']})"
            if k.get("published_mesh"):
                m = k["published_mesh"]
                rank_text += (f"; its mesh: #{m['rank']} of {k['meshes']:,} meshes, best there `{m['best']}` "
                              f"({m['best_step_s']:.2f} s)")
            if p.get("closest_enumerated"):
                c = p["closest_enumerated"]
                rank_text += f"; closest enumerated `{c['describe']}` #{c['rank']:,} ({c['step_s']:.2f} s)"
            lines.append(
                f"| {r['name']} | {k['kept']:,} ({k['fitting']:,}) | {rank_text} | `{top['describe']}` "
                f"({top['memory_gib']:.0f} GiB) | {top['step_s']:.2f} s, {top['mfu']:.1%} | "
                f"{fmt_split(pub['split_s'], pub['step_s'])} | {fmt_split(top['split_s'], top['step_s'])} | "
                f"{r['why_top_faster']} | {k['seconds']:.0f} s |")
    alts = [(r, a) for r in results for a in r.get("alternatives", [])]
    if alts:
        lines += ["", "| run | alternative | layout | predicted step | predicted MFU | compute / comm / bubble, s |",
                  "|---|---|---|---|---|---|"]
        for r, a in alts:
            lines.append(f"| {r['name']} | {a['what']} | `{a['describe']}` | {a['step_s']:.2f} s | {a['mfu']:.1%} | "
                         f"{fmt_split(a['split_s'], a['step_s'])} |")
    if skipped:
        lines += [""] + [f"skipped {s['name']}: {s['reason']}" for s in skipped]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--yaml", type=pathlib.Path, default=YAML, help="the published runs (bench/plan_published.yaml)")
    parser.add_argument("--runs", nargs="+", metavar="NAME", help="only these rows (default: all usable)")
    parser.add_argument("--no-rank", action="store_true", help="skip the planner's search (seconds instead of minutes)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)

    import yaml

    from jaxpar.planning import hardware
    from jaxpar.planning.workload import Workload

    rows = yaml.safe_load(args.yaml.read_text())
    if args.runs:
        unknown = set(args.runs) - {r["name"] for r in rows}
        if unknown:
            raise SystemExit(f"unknown run(s) {', '.join(sorted(unknown))}; the YAML has {', '.join(r['name'] for r in rows)}")
        rows = [r for r in rows if r["name"] in args.runs]
    began = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="plan_published_")
    results, skipped = [], []
    every = yaml.safe_load(args.yaml.read_text())
    stacks = {name: stack_profile(name, every, cache) for name in {r["stack"] for r in rows if r.get("stack")}}
    for row in rows:
        reason = skip_reason(row)
        if reason:
            skipped.append({"name": row["name"], "reason": reason})
            continue
        t0 = time.perf_counter()
        shipped = hardware.load(row["hardware"], cache)
        hw = stacks[row["stack"]][0] if row.get("stack") else shipped
        flops_work = Workload(model_config(row), row["global_batch"], row["seq_len"])
        assumptions = []
        pipe_layers = None
        if is_llama3_405b(row):
            pipe_layers = LLAMA_PIPE_LAYERS
            assumptions.append(f"pipeline modelled with {pipe_layers} layers (16 ranks x 8 slots: 126 layers + the "
                               "embedding and the head); MFU counts the 126")
        work = Workload(model_config(row, pipe_layers), row["global_batch"], row["seq_len"]) if pipe_layers else flops_work
        layout, notes = published_layout(row)
        assumptions += notes
        rep = reported(row)
        peak = shipped.peak("bfloat16")
        rep["mfu_jaxpar"] = flops_work.model_flops() / (rep["step_s"] * row["devices"] * peak)
        if layout.devices != row["devices"]:
            raise SystemExit(f"{row['name']}: the layout has {layout.devices} devices, the run {row['devices']}")
        pred = predict(work, layout, hw, flops_work)
        result = {"name": row["name"], "source": row["source"].split(",")[0], "devices": row["devices"],
                  "hardware": hw.name, "peak_bf16": peak, "global_batch": row["global_batch"],
                  "seq_len": row["seq_len"], "model_flops": flops_work.model_flops(),
                  "layout": {"describe": layout.describe(), "overrides": layout.overrides(),
                             "published": row["layout"]},
                  "assumptions": assumptions, "reported": rep, "predicted": pred,
                  "mfu_relative_error": pred["mfu"] / rep["mfu_jaxpar"] - 1,
                  "step_relative_error": pred["step_s"] / rep["step_s"] - 1}
        if row.get("stack"):
            on_shipped = predict(work, layout, shipped, flops_work)
            result["stack"] = {"name": row["stack"], "rate": stacks[row["stack"]][1],
                               "fit_run": STACKS[row["stack"]]["fit_run"], "why": STACKS[row["stack"]]["why"],
                               "comm_overlap": STACKS[row["stack"]]["comm_overlap"]}
            result["predicted_shipped"] = on_shipped
            result["mfu_relative_error_shipped"] = on_shipped["mfu"] / rep["mfu_jaxpar"] - 1
        alternatives = []
        if is_llama3_405b(row):
            for v in (1, 2, 4, 8):
                alt, _ = published_layout(row, virtual_override=v)
                a = predict(work, alt, hw, flops_work)
                alternatives.append({"what": f"virtual stages {v}", "describe": alt.describe(), **a})
        if layout.fsdp > 1:
            alt, _ = published_layout(row, dp_as="data")
            if is_llama3_405b(row):
                alt = dataclasses.replace(alt, virtual_stages=layout.virtual_stages)
            a = predict(work, alt, hw, flops_work)
            alternatives.append({"what": "DP as plain data (replicated state, one gradient all-reduce)",
                                 "describe": alt.describe(), **a})
        if alternatives:
            result["alternatives"] = alternatives
        if not args.no_rank:
            print(f"{row['name']}: searching {row['devices']:,} devices ...", file=sys.stderr, flush=True)
            result["rank"] = rank(work, layout, hw, row["devices"], flops_work)
            result["why_top_faster"] = why_faster(pred, result["rank"]["top"], layout.describe())
        result["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(result)
        print(f"{row['name']}: reported {rep['step_s']:.2f} s, predicted {pred['step_s']:.2f} s "
              f"({result['seconds']} s)", file=sys.stderr, flush=True)
    for line in tables(results, skipped):
        print(line)
    meta = {"command": " ".join(["python", *sys.argv]) if argv is None else "main(...)",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "jax": importlib.metadata.version("jax"), "yaml": str(args.yaml.relative_to(ROOT)
                                                                  if args.yaml.is_relative_to(ROOT) else args.yaml),
            "git": git_head(), "planner_sources_sha256": sources_hash(PLANNER_FILES), "rank": not args.no_rank,
            "seconds": round(time.perf_counter() - began, 1),
            "mfu_convention": "Workload.model_flops() / (step x GPUs x peak bf16): 6 x matmul parameters (head "
                              "included, lookup not) + 12 l s h per token, no recompute",
            "mfu_relative_error": "predicted MFU / reported MFU - 1 (= reported step / predicted step - 1)",
            "stacks": {name: {**STACKS[name], "rate": rate} for name, (_, rate) in stacks.items()}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "runs": results, "skipped": skipped}, indent=1) + "\n")
    print(f"done in {meta['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
