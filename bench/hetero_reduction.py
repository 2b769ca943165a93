"""Gradient reduction beyond the mean (issue 39, ``jaxpar.hetero.reduction``): loss curves
and collective bytes per step of the mean, Adasum and DCT's top-k exchange at two ratios.

Each run trains the ``tiny`` preset (4 x 128, 4096-token BPE) from the same
initialisation on the same batches (the standard library's first ``--max-files``
source files, packed into rows of ``--seq-len``) with ``make_train_step`` directly on
``data=8`` simulated CPU devices: clipped AdamW with warmup and cosine decay, as
``jaxpar-train tiny`` builds it. Each step is compiled once (``TrainStep.compile``);
its bytes are the compile-only profiler's ``collective_bytes`` of that program (sent per
device per step, exact for the compiled program), and it is the program that trains.
The final validation loss is over ``--eval-batches`` held-out batches.

    python bench/hetero_reduction.py [--steps 80] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import platform
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar.hetero.reduction import Reduction  # noqa: E402
from jaxpar.models import PRESETS, Transformer  # noqa: E402
from jaxpar.profiler import profile  # noqa: E402
from jaxpar.train import data as data_lib  # noqa: E402
from jaxpar.train.loader import Loader  # noqa: E402
from jaxpar.train.step import loss_fn, make_train_step  # noqa: E402

HERE = pathlib.Path(__file__).parent
RUNS = {
    "mean": None,
    "adasum": Reduction("adasum"),
    "dct_topk 0.1": Reduction("mean", "dct_topk", ratio=0.1, threshold_every=10),
    "dct_topk 0.01": Reduction("mean", "dct_topk", ratio=0.01, threshold_every=10),
}


def optimizer(steps: int, lr: float = 3e-3, warmup: int = 20) -> optax.GradientTransformation:
    """``jaxpar-train``'s: global-norm clipping at 1, AdamW (0.9, 0.95, weight decay 0.1),
    linear warmup then cosine decay to a tenth."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=warmup, decay_steps=steps,
                                                  end_value=lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))


def load(max_files: int, seq_len: int, batch: int, eval_batches: int, vocab: int):
    """``(train Loader, validation batches)`` of the standard library's first files."""
    cfg = data_lib.DataConfig(max_files=max_files)
    cache = data_lib.default_cache_dir()
    tokenizer = data_lib.load_tokenizer(cfg, vocab, cache)
    rows = {split: data_lib.packed_rows(cfg, tokenizer, seq_len, split, cache) for split in ("train", "validation")}
    loader = Loader(rows["train"], batch, seed=0)
    return loader, data_lib.eval_batches(rows["validation"], batch, eval_batches)


def train(name: str, reduction, model_cfg, mesh, loader, val, args) -> dict:
    """One run: its losses, validation loss, collective bytes per step and step time."""
    model = Transformer(model_cfg, rngs=nnx.Rngs(0))
    step = make_train_step(model, optimizer(args.steps), mesh, reduction=reduction)
    compiled = step.compile(model, args.batch, args.seq_len)
    collectives = profile(compiled, mesh)
    params, opt_state = step.init(model)
    losses, start = [], None
    for s in range(args.steps):
        batch = jax.device_put(loader.batch(s), step.batch_sharding)
        params, opt_state, metrics = compiled(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
        start = time.perf_counter() if s == 0 else start
    seconds = (time.perf_counter() - start) / max(args.steps - 1, 1)
    evaluate = jax.jit(lambda p, b: loss_fn(step.model(p), b))
    with step.context():
        val_loss = float(np.mean([evaluate(params, jax.device_put(b, step.batch_sharding)) for b in val]))
    print(f"{name:14s} final loss {np.mean(losses[-10:]):.4f}  val {val_loss:.4f}  "
          f"bytes/step {collectives['collective_bytes']:,}  {seconds * 1e3:.0f} ms/step", flush=True)
    return {"name": name, "reduction": None if reduction is None else dataclasses.asdict(reduction),
            "losses": losses, "final_loss_last10": float(np.mean(losses[-10:])), "val_loss": val_loss,
            "collective_bytes_per_step": collectives["collective_bytes"],
            "collectives": collectives["collectives"], "seconds_per_step": seconds}


def picture(runs: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for run in runs:
        label = f"{run['name']} ({run['collective_bytes_per_step'] / 1e6:.2f} MB/step)"
        ax.plot(np.arange(1, len(run["losses"]) + 1), run["losses"], label=label, lw=1.4)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(title="reduction (collective bytes sent per device)", fontsize=9, title_fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-files", type=int, default=300)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--json", type=pathlib.Path, default=HERE / "results" / "hetero_reduction.json")
    parser.add_argument("--png", type=pathlib.Path, default=HERE / "figures" / "hetero_reduction.png")
    args = parser.parse_args()
    model_cfg = PRESETS["tiny"]
    mesh = jaxpar.make_mesh(data=8)
    loader, val = load(args.max_files, args.seq_len, args.batch, args.eval_batches, model_cfg.vocab_size)
    runs = [train(name, reduction, model_cfg, mesh, loader, val, args) for name, reduction in RUNS.items()]
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} CPU, "
              f"{jax.device_count()} simulated devices", "mesh": "data=8", "model": "tiny",
              "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "max_files": args.max_files,
              "runs": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    picture(runs, args.png, f"tiny, data=8 (simulated CPU devices), batch {args.batch} x {args.seq_len}, "
            f"AdamW 3e-3")
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
