"""The training loop behind ``jaxpar-train``: data, sharded state, steps, evals,
checkpoints, metrics.

Outputs in ``RUN_DIR``: ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one
JSON object per step: ``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``,
``step_time_s``, ``device_live_bytes`` (bytes of live arrays in device memory on the
most loaded device after the step), and ``val_loss`` at eval steps), the same scalars as TensorBoard
events in ``tensorboard/`` (a resumed run first drops the steps after its
checkpoint from both, so each step is logged once), ``tokenizer.json`` and
``checkpoints/`` (orbax; unreadable ones moved to ``checkpoints/corrupt/<step>``). The
run dir is made only once the run can start. The tokenizer/packed-data cache is
``cache_dir``, by default the per-user ``jaxpar.train.data.default_cache_dir()`` that
every run dir shares. The steps themselves (metrics, checkpoints, stop signals, a
non-finite loss) run in ``jaxpar.train.stepping``, which every task shares.

With ``task: glide`` the trained model is a GliDe draft for the frozen target in
``target_run_dir`` (``jaxpar.train.glide``); the loop is the same, its batches carrying
the target's keys/values (live, or from ``glide.teacher_cache``), and ``RUN_DIR`` also
holds ``draft_vocab.npy`` with ``glide.draft_vocab``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import pathlib
import time

import jax
import numpy as np
import optax
import yaml
from flax import nnx

import jaxpar
from jaxpar.models import GlideDraft, Transformer
from jaxpar.models.config import WEIGHTS, ModelConfig
from jaxpar.parallel import pipeline_schedule as pipeline_schedules
from jaxpar.models.transformer import sharding_rules
from jaxpar.parallel.pipeline_schedule import Schedule
from jaxpar.parallel.zigzag import to_zigzag
from jaxpar.planning import hardware as hardware_lib
from jaxpar.train import data as data_lib
from jaxpar.train import glide, self_distill
from jaxpar.train import offload as offload_lib
from jaxpar.train.checkpoints import CheckpointError, Checkpoints
from jaxpar.train.command import file_in_the_way
from jaxpar.train.config import Config, ConfigError, MeshConfig, OptimizerConfig, to_dict
from jaxpar.train.step import make_train_step
from jaxpar.train.stepping import Recorder, TrainingError, run_steps

log = logging.getLogger(__name__)


def build_mesh(mesh_cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """The mesh for ``mesh_cfg``; ``data`` None takes the devices the other axes leave."""
    devices = jax.devices() if devices is None else devices
    tensor = mesh_cfg.tensor if isinstance(mesh_cfg.tensor, tuple) else (mesh_cfg.tensor,)
    others = mesh_cfg.fsdp * mesh_cfg.pipe * mesh_cfg.seq * math.prod(tensor)
    data = mesh_cfg.data
    if data is None:
        if others < 1 or len(devices) % others:
            raise TrainingError(
                f"mesh fsdp={mesh_cfg.fsdp} pipe={mesh_cfg.pipe} seq={mesh_cfg.seq} "
                f"tensor={mesh_cfg.tensor} ({others} devices) does not divide {len(devices)} devices"
            )
        data = len(devices) // others
    try:
        return jaxpar.make_mesh(data=data, fsdp=mesh_cfg.fsdp, pipe=mesh_cfg.pipe,
                                seq=mesh_cfg.seq, tensor=mesh_cfg.tensor, devices=devices,
                                axis_types=mesh_cfg.axis_types)
    except ValueError as e:
        raise TrainingError(str(e)) from None


def describe_mesh(mesh) -> str:
    """``mesh data=2 fsdp=4 (8 cpu devices)``: the axes over one device, and the devices."""
    axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items() if size > 1) or "of one device"
    n = mesh.devices.size
    return f"mesh {axes} ({n} {mesh.devices.flat[0].platform} device{'s' if n > 1 else ''})"


def make_optimizer(opt: OptimizerConfig, steps: int):
    """``(tx, schedule)``: clipped AdamW with warmup and cosine decay."""
    warmup = min(opt.warmup_steps, steps)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, opt.lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
        end_value=opt.lr * opt.min_lr_ratio,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(opt.clip_norm),
        optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay),
    )
    return tx, schedule


def flops_per_token(cfg) -> float:
    """Training FLOPs per token: 6 per matmul parameter (the output projection, not the
    input embedding's lookup) plus attention's score and value products (PaLM's count)."""
    m = cfg.model
    params = m.vocab_size * m.dim + m.layers * (
        m.dim * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.dim
        + m.dim * m.mlp_dim * (3 if m.mlp == "swiglu" else 2)
    )
    return 6 * params + 12 * m.layers * m.heads * m.head_dim * cfg.seq_len


def _data_parallel(mesh, rules) -> tuple[tuple[str, ...], int]:
    """The mesh axes the rules split the batch over, and how many ways in all."""
    axes = jaxpar.rules.as_tuple(jaxpar.rules.logical_to_spec(("batch",), rules)[0])
    return axes, math.prod(mesh.shape[a] for a in axes)


def pipeline_schedule(cfg: Config, mesh, rules) -> Schedule | None:
    """The schedule ``cfg.pipeline`` asks for on ``mesh`` (None without ``pipe`` > 1),
    its sizes checked against the model and the batch."""
    P = mesh.shape["pipe"]
    if P == 1:
        return None
    pipe = cfg.pipeline
    M = pipe.microbatches or 2 * P
    V = pipe.virtual_stages if pipe.schedule == "interleaved" else 1
    if cfg.model.layers % (P * V):
        raise TrainingError(f"model.layers={cfg.model.layers} is not divisible by mesh.pipe x "
                            f"pipeline.virtual_stages = {P} x {V} = {P * V}")
    if cfg.optimizer.grad_accum != 1:
        raise TrainingError(f"optimizer.grad_accum={cfg.optimizer.grad_accum} with mesh.pipe={P}: "
                            "the pipeline's microbatches accumulate already (pipeline.microbatches)")
    axes, ways = _data_parallel(mesh, rules)
    if cfg.batch_size % (M * ways):
        raise TrainingError(f"batch_size={cfg.batch_size} is not divisible by pipeline.microbatches "
                            f"x the data-parallel degree = {M} x {ways} = {M * ways}")
    try:
        return pipeline_schedules.build(pipe.schedule, P, M, V)
    except ValueError as e:
        raise TrainingError(str(e)) from None


def _check_batch(cfg: Config, mesh, rules) -> None:
    axes, ways = _data_parallel(mesh, rules)
    micro = cfg.batch_size // cfg.optimizer.grad_accum
    if cfg.batch_size % cfg.optimizer.grad_accum or micro % ways:
        raise TrainingError(
            f"batch_size={cfg.batch_size} / optimizer.grad_accum={cfg.optimizer.grad_accum} "
            f"must be a multiple of the data-parallel degree {'*'.join(axes)}={ways}"
        )


# The model settings a checkpoint's arrays depend on.
SHAPE_KEYS = ModelConfig.fields_tagged(WEIGHTS)


def _check_same_model(checkpoints: Checkpoints, cfg: Config) -> None:
    """Refuses a run dir whose newest readable checkpoint holds another model shape
    (rather than letting the restore fail on it and start afresh over it)."""
    for step in reversed(checkpoints.steps()):
        try:
            saved_cfg = checkpoints.read_meta(step).get("config", {})
            break
        except Exception:  # noqa: BLE001 - unreadable; restore_latest warns about it
            continue
    else:
        return
    saved = saved_cfg.get("model", {})
    current = json.loads(json.dumps(dataclasses.asdict(cfg.model)))
    diffs = [f"model.{k}: {saved.get(k)!r} there, {v!r} here" for k, v in current.items()
             if k in SHAPE_KEYS and saved.get(k) != v]
    if saved_cfg.get("task", "lm") != cfg.task:
        diffs.append(f"task: {saved_cfg.get('task', 'lm')!r} there, {cfg.task!r} here")
    elif cfg.task == "glide":
        for key in ("layers", "draft_vocab"):  # the draft's shape, which its arrays alone do not show
            if saved_cfg.get("glide", {}).get(key) != getattr(cfg.glide, key):
                diffs.append(f"glide.{key}: {saved_cfg.get('glide', {}).get(key)!r} there, "
                             f"{getattr(cfg.glide, key)!r} here")
    if diffs:
        raise TrainingError(
            f"{checkpoints.directory} holds a checkpoint of a different model ({'; '.join(diffs)}); "
            "use another run_dir"
        )


def _global_batch(local: dict, step_fn) -> dict:
    """This process's rows as global arrays; with a zigzag sequence layout, every row's
    tokens (inputs, targets, positions, segment ids, mask alike) reordered to it."""
    seq = step_fn.mesh.shape.get("seq", 1)
    if seq > 1 and step_fn.sequence.layout == "zigzag":
        local = {k: to_zigzag(v, seq) for k, v in local.items()}
    return {k: jax.make_array_from_process_local_data(step_fn.batch_sharding, v) for k, v in local.items()}


def dry_run_profile(cfg: Config, step_fn, abstract_model, mesh, rules, schedule: Schedule | None) -> dict:
    """The compile-only profile of ``step_fn`` (``jaxpar.profiler.profile``), with the
    pipeline's bubble and per-stage memory when it runs ``schedule``."""
    from jaxpar.profiler import profile

    result = profile(step_fn.compile(abstract_model, cfg.batch_size, cfg.seq_len))
    if schedule is not None:
        from jaxpar.train.pipelined import profile_fields

        result.update(profile_fields(schedule, step_fn.abstract_state(abstract_model), cfg.model,
                                     mesh, rules, cfg.batch_size, cfg.seq_len))
    return result


def peak_flops() -> float | None:
    """This device's dense bf16 peak FLOP/s, for the MFU estimate: its shipped hardware
    profile's (``jaxpar.planning.hardware``); None for a device without one."""
    name = hardware_lib.shipped_for(jax.devices()[0].device_kind)
    return None if name is None else hardware_lib.load(name).peak("bfloat16")


def build_model(cfg: Config, vocab=None) -> nnx.Module:
    """The model a run trains: the ``Transformer``, or with ``task: glide`` the GliDe
    draft for the target's model config (``cfg.model``) over ``vocab`` (a
    ``jaxpar.models.glide.DraftVocab``, or None: the whole vocabulary)."""
    if cfg.task == "glide":
        return GlideDraft(cfg.model, cfg.glide.layers, vocab=vocab, features=cfg.glide.features,
                          rngs=nnx.Rngs(cfg.seed))
    return Transformer(cfg.model, rngs=nnx.Rngs(cfg.seed))


def load_data(cfg: Config, target: Transformer | None = None, *, progress: bool = False) -> tuple:
    """``(tokenizer, train rows, validation rows)`` of the run, from ``cache_dir`` when
    an earlier run made them. With ``glide.self_distill``, the rows are ``target``'s
    own continuations of the splits' prompts (``jaxpar.train.self_distill``)."""
    cache_dir = data_lib.cache_dir_of(cfg.cache_dir)
    tokenizer = data_lib.load_tokenizer(cfg.data, cfg.model.vocab_size, cache_dir)
    data_lib.check_vocab(tokenizer, cfg.model.vocab_size)
    if cfg.task == "glide" and cfg.glide.self_distill:
        if target is None:
            raise ValueError("glide.self_distill rows are the target's continuations: load_data needs the target")
        return tokenizer, *self_distill.load_rows(cfg, target, tokenizer, cache_dir, progress=progress)
    train_rows = data_lib.packed_rows(cfg.data, tokenizer, cfg.seq_len, "train", cache_dir)
    val_rows = data_lib.packed_rows(cfg.data, tokenizer, cfg.seq_len, "validation", cache_dir)
    return tokenizer, train_rows, val_rows


def check_output_dirs(cfg: Config) -> None:
    """``ConfigError`` (exit 2) where a directory the run would write to is a file, or
    lies under one: ``run_dir`` (and its ``checkpoints``), ``cache_dir``,
    ``glide.teacher_cache``. Checked before anything is read or written."""
    cache_dir = data_lib.cache_dir_of(cfg.cache_dir)
    run_dir = pathlib.Path(cfg.run_dir).expanduser()
    for key, value, path in [("run_dir", cfg.run_dir, run_dir / "checkpoints"),
                             ("cache_dir", cfg.cache_dir or str(cache_dir), cache_dir),
                             ("glide.teacher_cache", cfg.glide.teacher_cache, cfg.glide.teacher_cache)]:
        file = path is not None and file_in_the_way(pathlib.Path(path))
        if file:
            raise ConfigError(f"{key}={value!r}: {file} is a file, not a directory")


def train(cfg: Config, *, progress: bool = True) -> list[dict]:
    """Runs (or resumes) the training ``cfg`` describes; returns the per-step metrics
    (none, with one log line, when the run dir's checkpoint is at ``cfg.steps`` already).

    In the main thread, SIGINT or SIGTERM stops the run at the next step boundary with
    that step saved and raises ``jaxpar.train.stopping.Stopped`` (a second signal acts
    at once); several processes stop at the same step (``stopping``)."""
    check_output_dirs(cfg)
    if cfg.task == "dlrm":  # a recommendation model (jaxpar.train.recsys)
        from jaxpar.train import recsys

        return recsys.train(cfg, progress=progress)
    if cfg.auto_mesh:  # the planner's best layout for the devices present (jaxpar.train.plan)
        from jaxpar.train.plan import auto

        cfg = auto(cfg)
    target = vocab = data = None
    run_dir = pathlib.Path(cfg.run_dir)
    if cfg.task == "glide":
        cfg, target = glide.prepare(cfg)  # model.* and data.tokenizer become the target's
        data = load_data(cfg, target, progress=progress)  # the draft's vocabulary is counted on its training split
        vocab = glide.draft_vocabulary(cfg, data[1], run_dir)
    mesh = build_mesh(cfg.mesh)
    model_cfg = cfg.model
    rules = sharding_rules(model_cfg, mesh, sequence_parallel=cfg.execution.sequence_parallel)
    _check_batch(cfg, mesh, rules)
    abstract_model = nnx.eval_shape(lambda: build_model(cfg, vocab))
    tx, schedule = make_optimizer(cfg.optimizer, cfg.steps)
    stages = pipeline_schedule(cfg, mesh, rules)
    frozen, glide_step = (), {}
    if target is not None:  # the frozen target: an argument of every step, never trained
        frozen = (nnx.state(jaxpar.shard_model(target, mesh, rules)),)
        glide_step = {"loss": glide.make_loss(cfg, target), "frozen": frozen[0]}

    def build_step(**offload):
        return make_train_step(abstract_model, tx, mesh, rules, grad_accum=cfg.optimizer.grad_accum,
                               sequence=cfg.execution.sequence, kernels=cfg.execution.kernels,
                               pipeline=stages, **glide_step, **offload)

    step_fn = build_step()
    profile = offload_plan = None
    if cfg.offload.requested:  # planned on the all-on-device step's compile-only profile
        profile = dry_run_profile(cfg, step_fn, abstract_model, mesh, rules, stages)
        offload_plan = offload_lib.resolve(cfg, profile, step_fn.abstract_state(abstract_model),
                                           mesh, rules, peak_flops())
        if offload_plan.options.any:
            profile = None  # the step that runs is another program
            step_fn = build_step(offload=offload_plan.options)
    if cfg.dry_run:
        profile = profile or dry_run_profile(cfg, step_fn, abstract_model, mesh, rules, stages)
        if offload_plan is not None:
            profile.update(offload_lib.dry_run_fields(offload_plan))
        print(json.dumps(profile, separators=(",", ":")))
        return []

    host_state = offload_plan is not None and offload_plan.options.state_on_host
    with Checkpoints(run_dir, keep=cfg.checkpoint.keep,  # closed on every way out
                     replica_parallel=not host_state) as checkpoints:
        _check_same_model(checkpoints, cfg)
        restored = checkpoints.restore_latest(step_fn.abstract_state(abstract_model))
        start = 0 if restored is None else restored[0]
        if start >= cfg.steps:
            log.warning("%s is already at step %d (steps=%d): nothing to do; raise steps= to continue "
                        "or choose another run_dir", cfg.run_dir, start, cfg.steps)
            return []
        tokenizer, train_rows, val_rows = data if data is not None else load_data(cfg)
        val_rows_of = data_lib.eval_rows(len(val_rows), cfg.batch_size, cfg.eval.batches) if cfg.eval.every else []
        val_batches = [(rows, data_lib.batch_of_rows(val_rows, rows)) for rows in val_rows_of]
        to_global = functools.partial(_global_batch, step_fn=step_fn)
        if target is None:
            def batch_of(split, rows, local):
                return to_global(local)
        else:  # with the target's keys/values, computed outside the step (or cached)
            train_rows = glide.training_rows(cfg, train_rows)
            val_count = cfg.eval.batches * cfg.batch_size if cfg.eval.every else 0
            val_used = data_lib.PackedRows(*(a[:val_count] for a in dataclasses.astuple(val_rows)))
            batch_of = glide.make_teacher(cfg, target, frozen[0], {"train": train_rows, "validation": val_used},
                                          tokenizer.to_str(), to_global, step_fn.batch_sharding)
        loader = data_lib.Loader(train_rows, cfg.batch_size, seed=cfg.seed)

        # The run can start: only now is the run dir made (a run refused above leaves none).
        lead = jax.process_index() == 0  # writes the run dir's files; every process checkpoints
        if lead:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            tokenizer.save(str(run_dir / "tokenizer.json"))  # jaxpar-generate needs only the run dir
            glide.save_vocabulary(vocab, run_dir)
        if restored is None:
            log.info("starting at step 0 on %s", describe_mesh(mesh))

            @nnx.jit
            def create(frozen):  # the target's state an argument, not constants of the program
                model = build_model(cfg, vocab)
                if target is not None and cfg.glide.init == "target":
                    model.start_from_target(nnx.merge(nnx.graphdef(target), *frozen))
                return jaxpar.shard_model(model, mesh, rules)

            with jax.set_mesh(mesh):  # where JAX traces Explicit axes' shardings (axis_types)
                params, opt_state = step_fn.init(create(frozen))
        else:
            log.info("resuming from step %d (checkpoint %s) on %s", start, checkpoints.directory / str(start),
                     describe_mesh(mesh))
            _, state, meta = restored  # saved in model order (step_fn.in_model_order)
            state = step_fn.in_storage_order(state)
            params, opt_state = state["params"], state["opt_state"]
            loader.restore(meta["loader"])
        eval_fn = jax.jit(lambda params, batch, *frozen: step_fn.loss(step_fn.model(params), batch, *frozen))
        tokens_per_step = cfg.batch_size * cfg.seq_len
        peak = peak_flops()
        if target is not None:
            peak = None  # flops_per_token counts a Transformer's step, not the draft's and teacher's

        def one_step(step):
            nonlocal params, opt_state
            rows = loader.local_rows(loader.step)
            batch = batch_of("train", rows, next(loader))
            began = time.perf_counter()
            params, opt_state, out = step_fn(params, opt_state, batch, *frozen)
            loss = float(out["loss"])
            elapsed = time.perf_counter() - began
            record = {"step": step, "loss": loss, "lr": float(schedule(step - 1)),
                      "grad_norm": float(out["grad_norm"]), "tokens_per_s": tokens_per_step / elapsed,
                      "step_time_s": elapsed, "device_live_bytes": offload_lib.device_live_bytes()}
            if val_batches and (step % cfg.eval.every == 0 or step == cfg.steps) and math.isfinite(loss):
                losses = [eval_fn(params, batch_of("validation", rows, b), *frozen) for rows, b in val_batches]
                record["val_loss"] = float(np.mean([float(l) for l in losses]))
            postfix = {"loss": f"{loss:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}", "step": f"{elapsed * 1e3:.0f}ms"}
            if peak:
                postfix["MFU"] = f"{flops_per_token(cfg) * record['tokens_per_s'] / (peak * mesh.devices.size):.1%}"
            if "val_loss" in record:
                postfix["val"] = f"{record['val_loss']:.3f}"
            return record, postfix

        def save(step):
            try:
                checkpoints.save(step, step_fn.in_model_order({"params": params, "opt_state": opt_state}),
                                 {"step": step, "loader": loader.state(), "config": to_dict(cfg)})
            except CheckpointError as e:
                raise TrainingError(str(e)) from None

        recorder = Recorder(run_dir, start, cfg.steps, lead=lead, progress=progress)
        log.info("compiling the train step (the first step waits for it)")
        with step_fn.context():
            history = run_steps(start, cfg.steps, cfg.checkpoint.every, one_step=one_step, save=save,
                                recorder=recorder, where=str(checkpoints.directory))
        return history  # leaving the block waits for the last save
