"""One GliDe draft training step from the teacher cache against one with the live target.

    python bench/glide_step.py --target PATH --cache DIR [--steps 5] [key=value ...]

``--target``: the target (a jaxpar run, a Hugging Face directory or a ``.gguf`` file);
``--cache``: the teacher cache directory (``glide.teacher_cache``), built first when it
is not there (its build time is reported apart); the ``key=value`` overrides are
``jaxpar-train glide``'s (``batch_size=8 seq_len=128 glide.train_rows=64
glide.draft_vocab=8192 data.path=...``). On a CPU-only machine JAX sees one device here
unless ``JAX_NUM_CPU_DEVICES`` says otherwise (the trainer's default is 8 simulated).

A step, as the trainer runs it: this step's rows from the loader, the target's keys,
values and top-k for them (``live``: the target's teacher-forced forward pass;
``cache``: read from the cache's memory-mapped shards), then the draft's jitted
optimizer step, waited for. Both compile first; then ``--steps`` steps each, the
median printed, with the speedup of the cached step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
from flax import nnx

import jaxpar
from jaxpar.models.transformer import sharding_rules
from jaxpar.train import glide, loop
from jaxpar.train.config import load_config
from jaxpar.train.loader import Loader
from jaxpar.train.step import make_train_step


def time_steps(teacher, step_fn, params, opt_state, frozen, loader, steps: int) -> list[float]:
    """Seconds of each of ``steps`` draft steps (batch, teacher, step, waited for),
    after one untimed step that compiles."""
    times = []
    for s in range(steps + 1):
        began = time.perf_counter()
        batch = teacher("train", loader.local_rows(s), loader.batch(s))
        params, opt_state, out = step_fn(params, opt_state, batch, frozen)
        float(out["loss"])
        times.append(time.perf_counter() - began)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=pathlib.Path, required=True)
    parser.add_argument("--cache", type=pathlib.Path, required=True, help="teacher cache directory")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("overrides", nargs="*", help="jaxpar-train glide key=value overrides")
    args = parser.parse_args()

    cfg = load_config("glide", [f"target_run_dir={args.target}", f"glide.teacher_cache={args.cache}",
                                "eval.every=0", *args.overrides])
    cfg, target = glide.prepare(cfg)
    mesh = loop.build_mesh(cfg)
    rules = sharding_rules(cfg.model, mesh)
    tokenizer, train_rows, _ = loop.load_data(cfg)
    vocab = glide.draft_vocabulary(cfg, train_rows, args.cache / "no-run-dir")
    train_rows = glide.training_rows(cfg, train_rows)
    loader = Loader(train_rows, cfg.batch_size, seed=cfg.seed)
    abstract = nnx.eval_shape(lambda: loop.build_model(cfg, vocab))
    tx, _ = loop.make_optimizer(cfg.optimizer, cfg.steps)
    frozen = nnx.state(jaxpar.shard_model(target, mesh, rules))
    step_fn = make_train_step(abstract, tx, mesh, rules, loss=glide.make_loss(cfg, target), frozen=frozen)
    with jax.set_mesh(mesh):
        params, opt_state = step_fn.init(nnx.jit(lambda: jaxpar.shard_model(loop.build_model(cfg, vocab),
                                                                             mesh, rules))())
    to_global = functools.partial(loop._global_batch, step_fn=step_fn)
    rows = {"train": train_rows}

    built = time.perf_counter()
    cached = glide.make_teacher(cfg, target, frozen, rows, tokenizer.to_str(), to_global, step_fn.batch_sharding)
    build_s = time.perf_counter() - built
    live_cfg = dataclasses.replace(cfg, glide=dataclasses.replace(cfg.glide, teacher_cache=None))
    live = glide.make_teacher(live_cfg, target, frozen, rows, tokenizer.to_str(), to_global, step_fn.batch_sharding)

    results = {}
    with step_fn.context():
        for name, teacher in (("live", live), ("cache", cached)):
            fresh = jax.tree.map(lambda x: x.copy(), (params, opt_state))  # the step donates its state
            times = time_steps(teacher, step_fn, *fresh, frozen, loader, args.steps)
            results[name] = statistics.median(times)
            print(json.dumps({"mode": name, "step_s": times}), file=sys.stderr)
    manifest = cached.cache.manifest
    disk = sum(f.stat().st_size for f in args.cache.iterdir())
    device = jax.devices()[0].device_kind
    meta = {"target": str(args.target), "device": device, "devices": jax.device_count(),
            "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "rows": len(train_rows),
            "draft_vocab": cfg.glide.draft_vocab, "kl_weight": cfg.glide.kl_weight, "distill": cfg.glide.distill,
            "teacher_topk": manifest["identity"]["topk"], "bytes_per_token": manifest["bytes_per_token"],
            "cache_bytes": disk, "cache_open_s": build_s, "topk_mass": manifest.get("topk_mass")}
    print(f"target {args.target} on {jax.device_count()} x {device}: batch {cfg.batch_size} x {cfg.seq_len}, "
          f"{len(train_rows)} cached rows, {manifest['bytes_per_token']} B/token ({disk / 2**20:.1f} MiB), "
          f"cache opened (built if new) in {build_s:.1f} s", file=sys.stderr)
    print(f"\n| draft step ({device}) | median s | speedup |")
    print("|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds:.3f} | {results['live'] / seconds:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "median_step_s": results}, indent=1))


if __name__ == "__main__":
    main()
