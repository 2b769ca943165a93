"""Tensor parallelism compared by the compile-only profiler: per-device memory and bytes.

For p devices as Megatron 1D (``tensor=p``) with and without sequence parallelism,
and as Optimus 2D (``tensor=(q, q)``, q^2 = p, projections by SUMMA), compiles the ``small`` train step (bf16 compute, no remat, AdamW) on
abstract inputs and reads the compiled program: ``argument_bytes``, ``temp_bytes``,
``collective_bytes`` per device per step. The largest global batch under a per-device
budget comes from two compilations (temp bytes are affine in the batch: exact for
these programs, whose buffers all scale with the batch or not at all).

Theory, 2 bytes per bf16 element (4 per reduced float32 partial sum of SUMMA). 1D, per layer: forward and backward each all-reduce
the attention and MLP outputs, 4 all-reduces of B T D elements moving ``2 (p-1)/p`` of
them per device. 2D, per layer: each of the layer's SUMMA products (QKV, out, gate, up,
down, and the vocabulary projection once) moves ``(q-1)/q^2`` of its moving operands
per device (``summa_theory``); XLA merges identical broadcasts (q, k and v read the
same activation), so the measured figure can be lower.

    python bench/tensor_parallel.py [--devices 4 16] [--seq-len 2048] [--batch 16]
"""

from __future__ import annotations

import argparse
import sys

import jax

DEVICES = int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 16
try:
    jax.config.update("jax_num_cpu_devices", max(16, DEVICES))
except RuntimeError:  # run inside a process whose JAX has started (a test's): its devices, as many as it has
    pass


import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models import Transformer  # noqa: E402
from jaxpar.models.transformer import sharding_rules  # noqa: E402
from jaxpar.train.config import load_config  # noqa: E402
from jaxpar.train.step import make_train_step  # noqa: E402

BUDGET = 16 * 2**30


MODES = ("1D", "1D + SP", "2D SUMMA")


def measure(cfg, p: int, mode: str, batch: int, seq_len: int) -> dict:
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    q = int(round(p ** 0.5))
    tensor = (q, q) if mode == "2D SUMMA" else p
    mesh = jaxpar.make_mesh(tensor=tensor, devices=jax.devices()[:p])
    rules = sharding_rules(cfg, mesh, sequence_parallel=mode == "1D + SP")
    step = make_train_step(model, optax.adamw(1e-4), mesh, rules)
    return jaxpar.profiler.profile(step.compile(model, batch, seq_len))


def summa_theory(cfg, p: int, tokens: int) -> float:
    """Bytes per device per step of the SUMMA products with no broadcast shared: an
    ``a @ b`` product moves (q-1)/q^2 (A + B) forward and twice that backward; an
    ``a @ bᵀ`` one (output and down projections) moves B + C forward, C + 2 B backward.
    Operands move as bf16 (2 bytes), reduced partial sums as f32 (4 bytes): an ``a @ b``
    reduces dA and dB backward, an ``a @ bᵀ`` C forward and dB backward."""
    q = int(round(p ** 0.5))
    D, F, V = cfg.dim, cfg.mlp_dim, cfg.vocab_size
    NH, KH = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def nn(k, n):  # activation [tokens, k] @ weight [k, n]
        return 2 * 2 * (tokens * k + k * n) + 4 * (tokens * k + k * n)

    def nt(k, n):  # activation [tokens, k] @ weight [k, n] stored transposed
        return 2 * (2 * k * n + tokens * n) + 4 * (tokens * n + k * n)

    per_layer = nn(D, NH) + 2 * nn(D, KH) + nt(NH, D) + 2 * nn(D, F) + nt(F, D)
    return (cfg.layers * per_layer + nn(D, V)) * (q - 1) / q**2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--config", default="small", help="the shipped training config whose model runs")
    args = parser.parse_args()
    cfg = load_config(args.config).model  # no remat: the model's default (not the config's layout)
    T, D = args.seq_len, cfg.dim
    print(f"`{args.config}` ({cfg.layers} layers, D={D}), global batch {args.batch} x {T} tokens, "
          f"budget {BUDGET / 2**30:.0f} GiB per device\n")
    print("| p | mode | argument bytes | temp bytes | collective bytes | all-reduce / all-gather / "
          "reduce-scatter / all-to-all | theory (layers) | largest batch in budget |")
    print("|---|---|---|---|---|---|---|---|")
    for p in args.devices:
        for mode in MODES:
            small = measure(cfg, p, mode, args.batch, T)
            large = measure(cfg, p, mode, 2 * args.batch, T)
            per_sequence = (large["temp_bytes"] - small["temp_bytes"]) / args.batch
            fixed = small["temp_bytes"] - per_sequence * args.batch + small["argument_bytes"]
            fits = int((BUDGET - fixed) // per_sequence) if per_sequence > 0 else 0
            if mode == "2D SUMMA":
                theory = summa_theory(cfg, p, args.batch * T)
            else:
                theory = cfg.layers * 4 * 2 * (p - 1) / p * args.batch * T * D * 2
            kinds = " / ".join(f"{small['collectives'][k]:,.0f}" for k in
                               ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"))
            print(f"| {p} | {mode} | {small['argument_bytes']:,} | "
                  f"{small['temp_bytes']:,} | {small['collective_bytes']:,.0f} | {kinds} | "
                  f"{theory:,.0f} | {fits} |", flush=True)


if __name__ == "__main__":
    main()
