"""Pipeline schedules compared by the compile-only profiler, and their step time predicted.

Part 1, measured (compile-only, exact for the program XLA builds). For ``pipe=P`` on
``P`` simulated devices the training config's train step (AdamW) is compiled on
abstract inputs with each schedule (``jaxpar.parallel.pipeline_schedule``) and ``M``
microbatches of the config's global batch; per schedule and ``M`` the table gives the
bubble counted from the schedule actually built beside ``(P-1)/(VM+P-1)``, the compiled
program's per-device ``temp_bytes``, what stage 0 (the busiest) keeps at once (stage
inputs of the microbatches in flight, from ``jaxpar.train.pipelined.profile_fields``),
and the per-device ``collective_bytes`` (all kinds, and the ``collective-permute``s
that move activations between stages).

Part 2, predicted (on paper; nothing here is a measured wall time). jaxpar's pipeline
is one SPMD program whose ticks are synchronous (every tick ends with the stage-to-stage
``ppermute``s), so a step lasts the sum over ticks of the slowest device's work plus
that tick's transfer. Per microbatch and stage, the forward takes ``t_f`` and the
backward ``t_b = 3 t_f`` (the stage's forward is recomputed from the stashed input,
then the backward's two matmuls per forward matmul); the last stage adds the head
(vocabulary projection and loss, FLOPs ``2 V D`` per token forward, three times that
backward). A transfer of a ``[B/M, T, D]`` bf16 activation takes ``latency + bytes /
bandwidth``. ``t_f`` comes from the FLOPs (``6 N`` per token for training, PaLM's
count, one third of it forward) at ``--peak-tflops x --efficiency``, or from a measured
per-stage forward time (``--stage-ms``) when one is known. ``--lockstep`` ticks cost a
forward plus a backward wherever the devices' operations differ (ring attention or
SUMMA inside the stages), and every stage computes the head.

    python bench/pipeline.py [--config small] [--pipe 4] [--microbatches 8 16]
        [--schedules gpipe 1f1b interleaved] [--virtual 2] [--peak-tflops 989]
        [--efficiency 0.4] [--bandwidth-gbs 450 50] [--latency-us 10] [--stage-ms MS]
        [--skip-compile]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax


def _pipe_arg() -> int:
    """``--pipe`` before jax is imported: the simulated CPU device count is fixed then."""
    return int(sys.argv[sys.argv.index("--pipe") + 1]) if "--pipe" in sys.argv else 4


try:
    jax.config.update("jax_num_cpu_devices", _pipe_arg())
except RuntimeError:  # run inside a process whose JAX has started (a test's): its first --pipe devices
    pass

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models.transformer import sharding_rules  # noqa: E402
from jaxpar.parallel.pipeline_schedule import BACKWARD, FORWARD, IDLE, build  # noqa: E402
from jaxpar.train.config import load_config  # noqa: E402
from jaxpar.train.loop import build_model, dry_run_profile, flops_per_token  # noqa: E402
from jaxpar.train.step import make_train_step  # noqa: E402


def measure(cfg, kind: str, P: int, M: int, V: int) -> dict:
    """The compile-only profile of the pipelined step, with the pipeline's fields (what
    ``jaxpar-train ... dry_run=true`` prints)."""
    model = nnx.eval_shape(lambda: build_model(cfg))
    mesh = jaxpar.make_mesh(pipe=P, devices=jax.devices()[:P])
    rules = sharding_rules(cfg.model, mesh)
    schedule = build(kind, P, M, V)
    step = make_train_step(model, optax.adamw(1e-4), mesh, rules, pipeline=schedule)
    return dry_run_profile(cfg, step, model, mesh, rules, schedule)


def predict(schedule, t_f: float, t_head: float, transfer: float, lockstep: bool = False) -> float:
    """Seconds per step of ``schedule`` under the tick model of the module docstring:
    ``t_f`` one stage's forward of one microbatch, ``t_head`` the head's forward on the
    last stage, ``transfer`` one activation's stage-to-stage transfer."""
    S = schedule.devices * schedule.virtual
    total = 0.0
    for t in range(schedule.ticks):
        ops, stages = schedule.op[t], schedule.stage[t]
        head = np.where(stages == S - 1, t_head, 0.0) if not lockstep else t_head
        cost_f = np.where(ops == FORWARD, t_f + head, 0.0)
        cost_b = np.where(ops == BACKWARD, 3 * (t_f + head), 0.0)
        if lockstep:
            work = cost_f.max() + cost_b.max()
        else:
            work = (cost_f + cost_b).max()
        sends = (ops != IDLE).any()
        total += work + (transfer if sends else 0.0)
    return total


def gb(x) -> str:
    return f"{x / 1e9:,.3f}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="small", help="the shipped training config whose model runs")
    parser.add_argument("--pipe", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--virtual", type=int, default=2, help="virtual stages per device, interleaved")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100 SXM: 989)")
    parser.add_argument("--efficiency", type=float, default=0.4, help="fraction of peak a stage reaches")
    parser.add_argument("--bandwidth-gbs", type=float, nargs="+", default=[450.0, 50.0],
                        help="stage-to-stage GB/s, one prediction each (NVLink 4: 450; 400 Gb/s IB: 50)")
    parser.add_argument("--latency-us", type=float, default=10.0)
    parser.add_argument("--stage-ms", type=float, default=None,
                        help="a measured forward time of one stage on one microbatch, instead of FLOPs")
    parser.add_argument("--skip-compile", action="store_true", help="the prediction only")
    args = parser.parse_args()
    cfg = load_config(args.config, [])
    m, P, B, T = cfg.model, args.pipe, cfg.batch_size, cfg.seq_len
    start = time.time()
    print(f"`{args.config}` ({m.layers} layers, D={m.dim}, vocabulary {m.vocab_size}, {m.dtype} compute, "
          f"remat {cfg.layout.remat}), global batch {B} x {T} tokens, pipe={P}.\n")

    runs = [(kind, M, args.virtual if kind == "interleaved" else 1)
            for M in args.microbatches for kind in args.schedules]
    if not args.skip_compile:
        print("| schedule | M | V | ticks | bubble (schedule) | bubble (theory) | temp GB | "
              "stage 0 in flight | stage 0 stage inputs GB | collective GB | of which permute GB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        for kind, M, V in runs:
            p = measure(cfg, kind, P, M, V)
            stage0 = p["pipeline_stages"][0]
            print(f"| {kind} | {M} | {V} | {build(kind, P, M, V).ticks} | {p['pipeline_bubble']:.4f} | "
                  f"{p['pipeline_bubble_theory']:.4f} | {gb(p['temp_bytes'])} | {stage0['in_flight']} | "
                  f"{gb(stage0['stage_input_bytes'])} | {gb(p['collective_bytes'])} | "
                  f"{gb(p['collectives']['collective-permute'])} |", flush=True)
        print()

    tokens = B * T
    head_flops = 2 * m.vocab_size * m.dim  # forward, per token
    layer_flops = flops_per_token(cfg) / 3 - head_flops  # forward, per token, all layers
    for M in args.microbatches:
        mb_tokens = tokens / M
        if args.stage_ms is not None:
            t_f = args.stage_ms / 1e3
        else:
            t_f = layer_flops / P * mb_tokens / (args.peak_tflops * 1e12 * args.efficiency)
        t_head = head_flops * mb_tokens / (args.peak_tflops * 1e12 * args.efficiency)
        ideal = 4 * M * (t_f + t_head)  # the last device's work alone: no bubble, no transfers
        activation = mb_tokens * m.dim * 2  # bf16
        print(f"M={M}: t_f = {t_f * 1e3:.2f} ms per stage and microbatch, head {t_head * 1e3:.2f} ms, "
              f"activation {activation / 1e6:.1f} MB; no-bubble step {ideal * 1e3:.0f} ms\n")
        print("| schedule | V | " + " | ".join(f"step ms @ {bw:g} GB/s" for bw in args.bandwidth_gbs)
              + " | lockstep step ms @ " + f"{args.bandwidth_gbs[0]:g} GB/s |")
        print("|---|---|" + "---|" * (len(args.bandwidth_gbs) + 1))
        for kind in args.schedules:
            V = args.virtual if kind == "interleaved" else 1
            schedule = build(kind, P, M, V)
            t_stage = t_f / V
            cells = []
            for bw in args.bandwidth_gbs:
                transfer = args.latency_us * 1e-6 + activation / (bw * 1e9)
                cells.append(f"{predict(schedule, t_stage, t_head, transfer) * 1e3:.0f}")
            transfer = args.latency_us * 1e-6 + activation / (args.bandwidth_gbs[0] * 1e9)
            lockstep = predict(schedule, t_stage, t_head, transfer, lockstep=True)
            print(f"| {kind} | {V} | " + " | ".join(cells) + f" | {lockstep * 1e3:.0f} |")
        print()
    print(f"\n{time.time() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
