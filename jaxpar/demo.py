"""The main job until training lands: ``python -m jaxpar.demo``.

Builds an ``fsdp=8`` mesh over 8 simulated CPU devices, creates the ``tiny`` model
already sharded by the rules (ZeRO-3: parameters, gradients and Adam state split
8 ways), checks a forward pass against one device, and takes a few AdamW steps on
byte tokens of the Python standard library's source.
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.models import PRESETS, Transformer
from jaxpar.runtime import simulate_cpu_devices
from jaxpar.train.step import make_train_step


def stdlib_bytes(limit: int) -> np.ndarray:
    """The first ``limit`` bytes of the interpreter's standard library source."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(np.frombuffer(data, np.uint8))
        total += len(data)
        if total >= limit:
            break
    return np.concatenate(chunks)[:limit].astype(np.int32)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch % 8 or args.seq_len < 2:
        parser.error(f"need --steps >= 1, --batch a multiple of 8, --seq-len >= 2; got {vars(args)}")

    simulate_cpu_devices(8)
    mesh = jaxpar.make_mesh(fsdp=8, devices=jax.devices()[:8])
    cfg = PRESETS["tiny"]
    print(f"mesh {dict(mesh.shape)} on {mesh.devices.size} {jax.devices()[0].platform} devices")

    @nnx.jit
    def create():
        return jaxpar.shard_model(Transformer(cfg, rngs=nnx.Rngs(0)), mesh)

    model = create()
    for path, var in nnx.to_flat_state(nnx.state(model))[:4]:
        x = var.get_value()
        print(f"  {'.'.join(map(str, path)):22s} {str(x.shape):18s} spec {x.sharding.spec}  "
              f"per device {x.sharding.shard_shape(x.shape)}")

    tokens = stdlib_bytes(args.batch * (args.seq_len + 1) * (args.steps + 1))
    windows = tokens[: len(tokens) // (args.seq_len + 1) * (args.seq_len + 1)].reshape(-1, args.seq_len + 1)

    def batch(i):
        rows = windows[i * args.batch : (i + 1) * args.batch]
        return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}

    single = nnx.jit(lambda m, t: m(t))(Transformer(cfg, rngs=nnx.Rngs(0)), batch(0)["inputs"])
    with jaxpar.use_mesh(mesh):
        sharded = nnx.jit(lambda m, t: m(t))(model, batch(0)["inputs"])
    diff = float(np.max(np.abs(sharded - single)) / np.max(np.abs(single)))
    print(f"forward on the mesh vs one device: max relative difference {diff:.1e}")

    step = make_train_step(model, optax.adamw(3e-3), mesh)
    params, opt_state = step.init(model)
    for i in range(args.steps):
        params, opt_state, metrics = step(params, opt_state, batch(i))
        if i == 0 or (i + 1) % 5 == 0 or i + 1 == args.steps:
            print(f"step {i + 1:3d}  loss {float(metrics['loss']):.3f}")


if __name__ == "__main__":
    main()
