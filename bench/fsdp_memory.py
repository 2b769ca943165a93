"""Per-device parameter + optimizer-state bytes under fsdp=8 vs fsdp=1 (ZeRO-3).

Compile-only: the model is abstract (``nnx.eval_shape``) and the AdamW train step is
lowered and compiled for 8 simulated CPU devices; the figures are the compiled
program's own ``memory_analysis()``, exact and machine-independent. fsdp=1 is plain
data parallelism (``data=8``: every device holds everything).

    python bench/fsdp_memory.py [--models tiny 1b] [--batch 8] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.models import PRESETS, Transformer  # noqa: E402
from jaxpar.train.step import BATCH_KEYS, make_train_step  # noqa: E402


def measure(name: str, fsdp: int, batch: int, seq_len: int) -> dict:
    cfg = PRESETS[name]  # no remat (Transformer's default), as BENCHMARKS.md measured it
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    mesh = jaxpar.make_mesh(data=8 // fsdp, fsdp=fsdp)
    step = make_train_step(model, optax.adamw(1e-3), mesh)
    memory = step.compile(model, batch, seq_len).memory_analysis()
    batch_bytes = len(BATCH_KEYS) * (batch // 8) * seq_len * 4  # int32 [B/8, T] arrays
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    return {
        "model": name,
        "params": params,
        "fsdp": fsdp,
        "state_bytes_per_device": memory.argument_size_in_bytes - batch_bytes,
        "temp_bytes_per_device": memory.temp_size_in_bytes,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["tiny", "1b"], choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    print("| model | params | fsdp | param + Adam bytes / device | ratio to fsdp=1 | temp bytes / device |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        rows = [measure(name, fsdp, args.batch, args.seq_len) for fsdp in (1, 8)]
        for row in rows:
            ratio = row["state_bytes_per_device"] / rows[0]["state_bytes_per_device"]
            print(f"| {name} | {row['params'] / 1e6:.1f}M | {row['fsdp']} | "
                  f"{row['state_bytes_per_device']:,} | {ratio:.4f} | {row['temp_bytes_per_device']:,} |")
        print(json.dumps(rows), file=__import__("sys").stderr)


if __name__ == "__main__":
    main()
