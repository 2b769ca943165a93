"""Sequence parallelism compared by the compile-only profiler: memory and bytes vs length.

For N devices in a ``seq=N`` mesh, the ``small`` train step (AdamW) is compiled on
abstract inputs for one sequence of T tokens (global batch 1: long-context training)
with each of jaxpar's three sequence-parallel attentions (``jaxpar.parallel.sequence``),
tokens in the zigzag layout, ``always=True`` so that N = 1 runs the same algorithm on
one device:

* ``ring``: blockwise ring attention (custom VJP, one ``[T/2N, 512]`` score block at a time);
* ``rsa``: the Sequence Parallelism paper's Ring Self-Attention (``[T/N, T]`` score rows,
  differentiated by JAX);
* ``ulysses``: DeepSpeed-Ulysses (all-to-all to a head split, whole-length attention);

and, as the baseline, Megatron tensor parallelism (``tensor 1D``: ``tensor=N``, heads,
MLP and vocabulary split, plain XLA attention over the whole length, no Megatron
sequence parallelism). Every mesh takes ``sharding_rules(cfg, mesh)``. The model is the
``small`` training config's, unchanged: 24 layers, D=1024, 16 query heads, 8 kv heads
of 64, MLP 2816, vocabulary 32768, float32 parameters, bfloat16 compute, remat
``dots_no_batch``. Nothing runs; figures are per device per step, read from the compiled
program (``jaxpar.profiler.profile``): ``temp_bytes``, ``collective_bytes`` (by kind)
and the number of collective operations executed per step (a ring hop is one).

Longest sequence under a per-device budget: as in ``bench/tensor_parallel.py``, the
program's ``argument_bytes + temp_bytes`` (parameters, optimizer state, batch and
temporaries; outputs alias the donated arguments) is compared with the budget. Per
(impl, N) that figure is fitted as a quadratic in T through the three ``--lengths``
(exact for these programs, whose buffers are polynomials of degree <= 2 in T, up to
XLA's discrete choices and the key-block size, the largest divisor of the local length
up to 512), solved for the budget, rounded down to a multiple of 512
(which 2N divides), and confirmed by one more compile at that length. If the
confirmation exceeds the budget, a new quadratic through the failed length and the two
measured lengths below it gives a lower length (at least 512 lower), compiled in turn
until one fits; the table marks such steps down.

    python bench/sequence_parallel.py [--impls ring rsa ulysses tensor] [--devices 1 2 4 8]
        [--lengths 8192 16384 32768] [--budget-gib 16] [--config small]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import jax


def _devices_arg() -> list[int]:
    """``--devices`` before jax is imported: the simulated CPU device count is fixed then."""
    if "--devices" not in sys.argv:
        return [1, 2, 4, 8]
    values = []
    for arg in sys.argv[sys.argv.index("--devices") + 1:]:
        if arg.startswith("--"):
            break
        values.append(int(arg))
    return values


jax.config.update("jax_num_cpu_devices", max(8, *_devices_arg()))

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models import Remat, Transformer  # noqa: E402
from jaxpar.models.transformer import sharding_rules  # noqa: E402
from jaxpar import SequenceOptions  # noqa: E402
from jaxpar.train.config import load_config  # noqa: E402
from jaxpar.train.step import make_train_step  # noqa: E402

IMPLS = ("ring", "rsa", "ulysses", "tensor")
LABELS = {"ring": "ring", "rsa": "rsa", "ulysses": "ulysses", "tensor": "tensor 1D"}
ROUND = 512  # the longest length is a multiple of this (and so of 2N, for N <= 256)


class Bench:
    """Compiles and profiles the step for one (impl, N) at any length."""

    def __init__(self, cfg, impl: str, n: int, remat: Remat):
        self.cfg, self.impl, self.n = cfg, impl, n
        self.model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), remat=remat))
        devices = jax.devices()[:n]
        if impl == "tensor":
            mesh, sequence = jaxpar.make_mesh(tensor=n, devices=devices), SequenceOptions()
        else:
            mesh = jaxpar.make_mesh(seq=n, devices=devices)
            sequence = SequenceOptions(impl, "zigzag", always=True)
        self.step = make_train_step(self.model, optax.adamw(1e-4), mesh,
                                    sharding_rules(cfg, mesh), sequence=sequence)
        self.cache: dict[int, dict] = {}

    def __call__(self, seq_len: int) -> dict:
        if seq_len not in self.cache:
            self.cache[seq_len] = jaxpar.profiler.profile(self.step.compile(self.model, 1, seq_len))
        return self.cache[seq_len]

    def total(self, seq_len: int) -> int:
        """The figure compared with the budget."""
        p = self(seq_len)
        return p["argument_bytes"] + p["temp_bytes"]


def quadratic(points: list[tuple[int, int]]) -> tuple[float, float, float]:
    """``(a, b, c)`` of the quadratic ``a T^2 + b T + c`` through three (T, bytes) points."""
    (x0, y0), (x1, y1), (x2, y2) = points
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    a = (d12 - d01) / (x2 - x0)
    b = d01 - a * (x0 + x1)
    return a, b, y0 - a * x0 * x0 - b * x0


def solve(a: float, b: float, c: float, budget: float) -> float:
    """The first T >= 0 where ``a T^2 + b T + c`` reaches ``budget`` (inf if never)."""
    c -= budget
    if c > 0:
        return 0.0
    disc = b * b - 4 * a * c
    if disc < 0:  # a < 0 and the curve turns before reaching the budget
        return math.inf
    root = math.sqrt(disc)
    # the smaller non-negative root, in the form that stays exact as a -> 0
    return -2 * c / (b + root) if b + root > 0 else math.inf


def longest(bench: Bench, lengths: list[int], budget: int) -> dict:
    """The fitted and the confirmed longest sequence under ``budget``."""
    a, b, c = quadratic([(t, bench.total(t)) for t in lengths[:3]])
    fitted = solve(a, b, c, budget)
    cap = 8 * lengths[-1]  # no compiles far beyond the fitted range
    t = int(min(fitted, cap) // ROUND) * ROUND
    steps = 0
    while t > 0 and bench.total(t) > budget:
        # Over budget: refit through the failed length and the two measured below it,
        # and step down to that fit's answer (at least one ROUND).
        steps += 1
        below = sorted(x for x in bench.cache if x < t)[-2:]
        lower = t - ROUND
        if len(below) == 2:
            refit = solve(*quadratic([(x, bench.total(x)) for x in [*below, t]]), budget)
            lower = min(lower, int(refit // ROUND) * ROUND)
        t = lower
    return {"fit": (a, b, c), "fitted": fitted, "confirmed": t, "steps_down": steps,
            "capped": steps == 0 and fitted > cap,
            "confirmed_bytes": bench.total(t) if t > 0 else None}


def gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:,.2f}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--lengths", type=int, nargs=3, default=[8192, 16384, 32768],
                        help="the three lengths the fit goes through; the table reports "
                             "the first and last")
    parser.add_argument("--budget-gib", type=float, default=16)
    parser.add_argument("--config", default="small", help="the shipped training config whose model runs")
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    run = load_config(args.config)
    cfg, remat = run.model, Remat(run.layout.remat, run.layout.remat_names)  # as the run builds its model
    lengths = sorted(args.lengths)
    lo, hi = lengths[0], lengths[-1]
    print(f"`{args.config}` ({cfg.layers} layers, D={cfg.dim}, {cfg.heads} heads, {cfg.kv_heads} kv "
          f"heads, remat {remat.policy}), AdamW, global batch 1 x T tokens, budget "
          f"{args.budget_gib:g} GiB of argument + temp bytes per device; figures in GB "
          f"(10^9 bytes) per device per step\n", flush=True)
    print(f"| impl | N | argument | temp, T={lo} | temp, T={hi} | collective, T={lo} | "
          f"collective, T={hi} | permute / all-to-all / all-reduce / all-gather, T={hi} | "
          f"collective ops | longest T (fit) | longest T (confirmed) | argument + temp there |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    found = {}
    start = time.time()
    for impl in args.impls:
        for n in args.devices:
            bench = Bench(cfg, impl, n, remat)
            small, large = bench(lo), bench(hi)
            best = longest(bench, lengths, budget)
            found[impl, n] = best["confirmed"]
            kinds = " / ".join(gb(large["collectives"][k]) for k in
                               ("collective-permute", "all-to-all", "all-reduce", "all-gather"))
            mark = f" ({best['steps_down']} step{'s' * (best['steps_down'] > 1)} down)" \
                if best["steps_down"] else " (at least: capped)" if best["capped"] else ""
            print(f"| {LABELS[impl]} | {n} | {gb(small['argument_bytes'])} | "
                  f"{gb(small['temp_bytes'])} | {gb(large['temp_bytes'])} | "
                  f"{gb(small['collective_bytes'])} | {gb(large['collective_bytes'])} | {kinds} | "
                  f"{sum(large['collective_counts'].values()):,} | "
                  f"{best['fitted']:,.0f} | {best['confirmed']:,}{mark} | "
                  f"{gb(best['confirmed_bytes'])} |", flush=True)
            a, b, c = best["fit"]
            print(f"<!-- {impl} N={n}: argument + temp = {a:.4g} T^2 + {b:.6g} T + {c:.6g} "
                  f"bytes; {len(bench.cache)} compiles, {time.time() - start:.0f} s so far -->",
                  file=sys.stderr, flush=True)
    print()
    if found.get(("ring", 1)):
        for n in args.devices:
            if n > 1 and ("ring", n) in found:
                print(f"* ring, longest at N={n} / (N x longest at N=1): "
                      f"{found['ring', n] / (n * found['ring', 1]):.2f}")
    if "ring" in args.impls and "tensor" in args.impls:
        for n in args.devices:
            if found.get(("tensor", n)):
                print(f"* longest T, ring / tensor 1D at N={n}: "
                      f"{found['ring', n] / found['tensor', n]:.2f}")
    print(f"\n{time.time() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
