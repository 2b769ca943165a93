"""Tokens/s of jaxpar's train step vs a plain Flax NNX + optax step, one CPU device.

Both train the same ``tiny`` model with the same AdamW on the same batches; jaxpar's
step runs on a 1-device mesh (rules, constraints and all), the plain one is the
idiomatic ``nnx.Optimizer`` + ``nnx.jit`` loop. The two alternate in rounds so machine
noise hits both alike; the figure is the median over rounds.

    python bench/step_overhead.py [--rounds 5] [--steps 10] [--batch 16] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.models import PRESETS, Transformer
from jaxpar.train.step import loss_fn, make_train_step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    cfg = PRESETS["tiny"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (args.steps, args.batch, args.seq_len + 1)).astype(np.int32)
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
    tx = optax.adamw(1e-3)

    mesh = jaxpar.make_mesh(devices=jax.devices()[:1])  # the device the plain step runs on
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    ours = make_train_step(model, tx, mesh)
    params, opt_state = ours.init(model)

    plain_model = Transformer(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(plain_model, tx, wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))
    def plain_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    def run_ours():
        nonlocal params, opt_state
        for batch in batches:
            params, opt_state, out = ours(params, opt_state, batch)
        return float(out["loss"])

    def run_plain():
        for batch in batches:
            loss = plain_step(plain_model, optimizer, batch)
        return float(loss)

    run_ours(), run_plain()  # compile
    rates = {"jaxpar": [], "plain": []}
    for _ in range(args.rounds):
        for name, run in (("jaxpar", run_ours), ("plain", run_plain)):
            began = time.perf_counter()
            run()
            rates[name].append(args.steps * args.batch * args.seq_len / (time.perf_counter() - began))
    ours_rate, plain_rate = statistics.median(rates["jaxpar"]), statistics.median(rates["plain"])
    print("| step | tokens/s (median of rounds) |")
    print("|---|---|")
    print(f"| jaxpar (1-device mesh) | {ours_rate:,.0f} |")
    print(f"| plain nnx.Optimizer + nnx.jit | {plain_rate:,.0f} |")
    print(f"jaxpar / plain = {ours_rate / plain_rate:.3f}")


if __name__ == "__main__":
    # Run as a script, one CPU device (not JAX_NUM_CPU_DEVICES simulated ones sharing the
    # cores); it must be set before JAX starts its backends. Imported, main() takes the
    # first of the process's devices.
    jax.config.update("jax_num_cpu_devices", 1)
    main()
