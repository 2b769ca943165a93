"""Tensor parallelism compared by the compile-only profiler: per-device memory and bytes.

For p devices on the ``tensor`` axis (Megatron 1D) with and without sequence
parallelism, compiles the ``small`` train step (bf16 compute, no remat, AdamW) on
abstract inputs and reads the compiled program: ``argument_bytes``, ``temp_bytes``,
``collective_bytes`` per device per step. The largest global batch under a per-device
budget comes from two compilations (temp bytes are affine in the batch: exact for
these programs, whose buffers all scale with the batch or not at all).

Theory for 1D, per layer and step (ring collectives, 2 bytes per bf16 element, B T D
the global activation): forward and backward each all-reduce the attention and MLP
outputs, 4 all-reduces of B T D elements moving ``2 (p-1)/p`` of them per device.

    python bench/tensor_parallel.py [--devices 4 16] [--seq-len 2048] [--batch 16]
"""

from __future__ import annotations

import argparse
import sys

import jax

DEVICES = int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 16
jax.config.update("jax_num_cpu_devices", max(16, DEVICES))

import dataclasses  # noqa: E402

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models import Transformer  # noqa: E402
from jaxpar.models.transformer import sharding_rules  # noqa: E402
from jaxpar.train.config import load_config  # noqa: E402
from jaxpar.train.step import make_train_step  # noqa: E402

BUDGET = 16 * 2**30


def measure(cfg, p: int, sequence_parallel: bool, batch: int, seq_len: int) -> dict:
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    mesh = jaxpar.make_mesh(tensor=p, devices=jax.devices()[:p])
    rules = sharding_rules(cfg, mesh, sequence_parallel=sequence_parallel)
    step = make_train_step(model, optax.adamw(1e-4), mesh, rules)
    return jaxpar.profiler.profile(step.compile(model, batch, seq_len))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    cfg = dataclasses.replace(load_config("small").model, remat="none")
    T, D = args.seq_len, cfg.dim
    print(f"`small` ({cfg.layers} layers, D={D}), global batch {args.batch} x {T} tokens, "
          f"budget {BUDGET / 2**30:.0f} GiB per device\n")
    print("| p | mode | argument bytes | temp bytes | collective bytes | all-reduce / all-gather / "
          "reduce-scatter / all-to-all | theory (layers) | largest batch in budget |")
    print("|---|---|---|---|---|---|---|---|")
    for p in args.devices:
        for sp in (False, True):
            small = measure(cfg, p, sp, args.batch, T)
            large = measure(cfg, p, sp, 2 * args.batch, T)
            per_sequence = (large["temp_bytes"] - small["temp_bytes"]) / args.batch
            fixed = small["temp_bytes"] - per_sequence * args.batch + small["argument_bytes"]
            fits = int((BUDGET - fixed) // per_sequence) if per_sequence > 0 else 0
            theory = cfg.layers * 4 * 2 * (p - 1) / p * args.batch * T * D * 2
            kinds = " / ".join(f"{small['collectives'][k]:,.0f}" for k in
                               ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"))
            print(f"| {p} | {'1D + SP' if sp else '1D'} | {small['argument_bytes']:,} | "
                  f"{small['temp_bytes']:,} | {small['collective_bytes']:,.0f} | {kinds} | "
                  f"{theory:,.0f} | {fits} |", flush=True)


if __name__ == "__main__":
    main()
