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
every run dir shares.

``train`` is one short sequence of named steps for every task (``task_of``: a
``TransformerTask`` over ``jaxpar.train.tasks``' language model or GliDe draft, or a
``jaxpar.train.recsys.DLRMTask``): ``build`` (mesh, optimizer, step; the offload plan,
the embedding tables), the dry run, the model check and the checkpoint to resume, the
task's ``start`` (batches, state, a ``Trainer`` with its hooks: evaluation at
``eval.every``, MFU, the noise scale), ``write_run_dir``, then ``run_steps``
(``jaxpar.train.stepping``: metrics, checkpoints, stop signals, a non-finite loss).
A trainer's ``checkpoint_state`` is what a save holds (a DLRM's flushes its cache).
What changes a transformer's compiled step is an option of ``make_train_step``; what
runs beside it, a hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import optax
import yaml
from flax import nnx

import jaxpar
from jaxpar.elastic import adascale as adascale_lib
from jaxpar.models.config import WEIGHTS, ModelConfig
from jaxpar.parallel import pipeline_schedule as pipeline_schedules
from jaxpar.models.transformer import sharding_rules
from jaxpar.parallel.pipeline_schedule import Schedule
from jaxpar.parallel.zigzag import to_zigzag
from jaxpar.planning import hardware as hardware_lib
from jaxpar.train import data as data_lib
from jaxpar.train import noise_scale as noise_lib
from jaxpar.train import offload as offload_lib
from jaxpar.train import recsys, tasks, weighted
from jaxpar.train.checkpoints import Checkpoints
from jaxpar.train.data import file_in_the_way
from jaxpar.train.config import Config, ConfigError, to_dict
from jaxpar.train.loader import Loader
from jaxpar.train.step import make_train_step
from jaxpar.train.stepping import (Recorder, TrainingError, build_mesh, finished, make_optimizer, run_steps,
                                   save)
from jaxpar.train.trainer import Batches, Trainer, evaluation, utilisation

log = logging.getLogger(__name__)

build_model, load_data = tasks.build_model, tasks.load_data  # the loop's names, as callers know them


def describe_mesh(mesh) -> str:
    """``mesh data=2 fsdp=4 (8 cpu devices)``: the axes over one device, and the devices."""
    axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items() if size > 1) or "of one device"
    n = mesh.devices.size
    return f"mesh {axes} ({n} {mesh.devices.flat[0].platform} device{'s' if n > 1 else ''})"


def batch_scale(rule: str, batch: int, base: int) -> float:
    """The learning rate's fixed factor at global batch ``batch`` for a run whose first
    batch was ``base``, by ``optimizer.batch_scaling`` ``rule``: ``linear`` (``batch /
    base``), ``sqrt`` (its square root), ``none`` or ``adascale`` (1: AdaScale's gain is
    measured in the step, ``make_optimizer``)."""
    ratio = batch / base
    return {"none": 1.0, "adascale": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def flops_per_token(cfg) -> float:
    """Training FLOPs per token: 6 per matmul parameter (the output projection, not the
    input embedding's lookup) plus attention's score and value products (PaLM's count).
    A MoE layer counts the parameters a token passes through: the router, its k routed
    experts and the shared ones."""
    m = cfg.model
    per_width = m.dim * (3 if m.mlp == "swiglu" else 2)  # an MLP's parameters per unit of width
    params = m.vocab_size * m.dim + m.layers * (
        m.dim * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.dim + per_width * m.mlp_dim
    )
    if getattr(m, "moe", None) is not None:
        moe = m.moe
        routed = m.dim * moe.experts + per_width * moe.expert_width * (moe.experts_per_token + moe.shared_experts)
        params += m.layers // moe.every * (routed - per_width * m.mlp_dim)
    return 6 * params + 12 * m.layers * m.heads * m.head_dim * cfg.seq_len


def _data_parallel(mesh, rules) -> tuple[tuple[str, ...], int]:
    """The mesh axes the rules split the batch over, and how many ways in all."""
    axes = jaxpar.rules.as_tuple(jaxpar.rules.logical_to_spec(("batch",), rules)[0])
    return axes, math.prod(mesh.shape[a] for a in axes)


def pipeline_schedule(cfg: Config, mesh, rules) -> Schedule | None:
    """The schedule ``cfg.pipeline`` asks for on ``mesh`` (None without ``pipe`` > 1),
    its sizes checked against the model and the batch."""
    from jaxpar.train.pipelined import check_stage_layers

    P, layout, stage_layers = mesh.shape["pipe"], cfg.layout, cfg.pipeline.stage_layers
    V = layout.virtual_stages if layout.schedule == "interleaved" else 1
    if isinstance(stage_layers, tuple):  # a stage count the mesh can take (config.py: the rest)
        try:
            check_stage_layers(stage_layers, cfg.model.layers, P, V)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if P == 1:
        return None
    M = layout.microbatches or 2 * P
    units = cfg.model.stacked_layers  # a stage holds whole stacked units (MoE groups of model.moe.every)
    if stage_layers is None and units % (P * V):
        groups = "" if units == cfg.model.layers else f" in {units} groups of model.moe.every={cfg.model.moe.every}"
        raise ConfigError(f"model.layers={cfg.model.layers}{groups} is not divisible by mesh.pipe x "
                            f"pipeline.virtual_stages = {P} x {V} = {P * V}")
    if layout.grad_accum != 1:
        raise ConfigError(f"optimizer.grad_accum={layout.grad_accum} with mesh.pipe={P}: "
                            "the pipeline's microbatches accumulate already (pipeline.microbatches)")
    axes, ways = _data_parallel(mesh, rules)
    if cfg.batch_size % (M * ways):
        raise ConfigError(f"batch_size={cfg.batch_size} is not divisible by pipeline.microbatches "
                            f"x the data-parallel degree = {M} x {ways} = {M * ways}")
    try:
        return pipeline_schedules.build(layout.schedule, P, M, V)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_batch(cfg: Config, mesh, rules) -> None:
    axes, ways = _data_parallel(mesh, rules)
    accum = cfg.layout.grad_accum
    micro = cfg.batch_size // accum
    if cfg.batch_size % accum or micro % ways:
        raise ConfigError(
            f"batch_size={cfg.batch_size} / optimizer.grad_accum={accum} "
            f"must be a multiple of the data-parallel degree {'*'.join(axes)}={ways}"
        )


# The model settings a checkpoint's arrays depend on.
SHAPE_KEYS = ModelConfig.fields_tagged(WEIGHTS)


def check_same_model(checkpoints: Checkpoints, cfg: Config, model_keys, other_keys=()) -> None:
    """Refuses a run dir whose newest readable checkpoint holds another task or model
    shape (rather than letting the restore fail on it and start afresh over it):
    ``model_keys``, the ``model.*`` fields the arrays depend on; ``other_keys``,
    ``(section, key)`` pairs of the shape the arrays alone do not show (a GliDe draft's
    layers, a DLRM table's optimizer)."""
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
    if saved_cfg.get("task", "lm") != cfg.task:
        diffs = [f"task: {saved_cfg.get('task', 'lm')!r} there, {cfg.task!r} here"]
    else:
        diffs = [f"model.{k}: {saved.get(k)!r} there, {v!r} here" for k, v in current.items()
                 if k in model_keys and saved.get(k) != v]
        for section, key in other_keys:
            there, here = saved_cfg.get(section, {}).get(key), getattr(getattr(cfg, section), key)
            if there != here:
                diffs.append(f"{section}.{key}: {there!r} there, {here!r} here")
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
                                     mesh, rules, cfg.batch_size, cfg.seq_len, step_fn.stage_layers))
    return result


def peak_flops() -> float | None:
    """This device's dense bf16 peak FLOP/s, for the MFU estimate: its shipped hardware
    profile's (``jaxpar.planning.hardware``); None for a device without one."""
    name = hardware_lib.shipped_for(jax.devices()[0].device_kind)
    return None if name is None else hardware_lib.load(name).peak("bfloat16")


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


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run is made of before any state exists: the mesh and its rules, the
    model's abstract structure, the optimizer and its learning-rate schedule, the
    pipeline schedule (or None), the frozen state every step takes (a GliDe draft's
    target), the train step, and the offload plan with the step's compile-only
    profile when one was made for it; ``programs``: the store of the run's jitted
    functions, shared with earlier runs of the same config (``_programs_of``)."""

    mesh: jax.sharding.Mesh
    rules: Any
    abstract_model: nnx.Module
    tx: optax.GradientTransformation
    lr: Callable[[int], float]
    stages: Schedule | None
    frozen: tuple
    step_fn: Any
    offload_plan: Any = None
    profile: dict | None = None
    row_split: weighted.RowSplit | None = None
    noise_scale: bool = False  # the step returns the norms jaxpar.train.noise_scale reads
    programs: dict = dataclasses.field(default_factory=dict)  # _programs_of's: the jitted functions


# The jitted functions of the last few runs' configs (their optimizer and schedule, train
# steps, initialisation and evaluation), for a later run of the same config in this
# process: a resumed run, a notebook's cell run again, a sweep's repeated point. Built
# afresh, each is a new function to JAX, traced, lowered and compiled (or loaded from the
# persistent cache) again; kept, the second run calls the programs the first compiled.
_PROGRAMS: dict[str, dict] = {}
_PROGRAMS_KEPT = 4
# What a run's programs do not depend on: where it writes, how often it saves or evaluates.
_NOT_IN_PROGRAMS = ("run_dir", "cache_dir", "checkpoint", "dry_run")


def _programs_of(cfg: Config, task, row_split, base_batch: int) -> dict:
    """The program store for runs of ``cfg`` at first batch ``base_batch``: shared with
    earlier runs of the same config in this process (most recent ``_PROGRAMS_KEPT``);
    a fresh one (nothing kept) for a task with frozen state (a GliDe draft's programs
    hold its target, whose weights a kept store would keep in memory after the run)
    or per-process batch shares (``data.batch_weights``), whose programs hold more than
    the config says."""
    if not isinstance(task, tasks.LanguageModel) or row_split is not None:
        return {}
    fields = to_dict(cfg)
    for name in _NOT_IN_PROGRAMS:
        fields.pop(name)
    fields["eval"].pop("every"), fields["eval"].pop("batches")
    key = json.dumps([fields, base_batch, jax.process_count()], sort_keys=True, default=str)
    programs = _PROGRAMS.pop(key, None) or {}
    _PROGRAMS[key] = programs  # the most recent last
    while len(_PROGRAMS) > _PROGRAMS_KEPT:
        del _PROGRAMS[next(iter(_PROGRAMS))]
    return programs


def build(cfg: Config, task, base_batch: int | None = None) -> Setup:
    """The mesh, the train step and what it needs for ``cfg``, its learning rate scaled
    for ``cfg.batch_size`` against ``base_batch`` (``base_batch_of``'s; None: a new run's); with
    ``offload`` requested, planned on the all-on-device step's compile-only profile (not
    compiled where the plan has one candidate and no budget to check, unless ``dry_run``
    reports its figures)."""
    mesh = build_mesh(cfg)
    rules = sharding_rules(cfg.model, mesh, sequence_parallel=cfg.layout.sequence_parallel)
    _check_batch(cfg, mesh, rules)
    abstract_model = nnx.eval_shape(task.model)
    base_batch = base_batch or cfg.optimizer.base_batch_size or cfg.batch_size
    scale = batch_scale(cfg.optimizer.batch_scaling, cfg.batch_size, base_batch)
    stages = pipeline_schedule(cfg, mesh, rules)
    frozen = task.frozen(mesh, rules)
    row_split = weighted.row_split_of(cfg, mesh)
    adascale = ((base_batch, cfg.batch_size, noise_lib.replicas_of(mesh))
                if cfg.optimizer.batch_scaling == "adascale" else None)
    noise = noise_lib.enabled(cfg, mesh)
    programs = _programs_of(cfg, task, row_split, base_batch)
    if "tx" not in programs:
        programs["tx"], programs["lr"] = make_optimizer(cfg.optimizer, cfg.steps, scale, adascale=adascale)
    tx, lr = programs["tx"], programs["lr"]

    def build_step(**offload):
        key = ("step", tuple(sorted(offload.items())))
        if key not in programs:
            programs[key] = make_train_step(
                abstract_model, tx, mesh, rules, grad_accum=cfg.layout.grad_accum,
                sequence=cfg.layout.sequence(cfg.execution.seq_layout), kernels=cfg.execution.kernels,
                pipeline=stages,
                stage_layers=None if stages is None else cfg.pipeline.stage_layers,
                weighted=None if row_split is None else row_split.unit, reduction=cfg.gradient_reduction,
                noise_scale=noise, **task.step_options(frozen), **offload)
        return programs[key]

    setup = Setup(mesh, rules, abstract_model, tx, lr, stages, frozen, build_step(), row_split=row_split,
                  noise_scale=noise, programs=programs)
    if not cfg.offload_requested:
        return setup
    abstract_state = setup.step_fn.abstract_state(abstract_model)
    # The all-on-device compile only informs the plan (and dry_run's figures): a fixed
    # placement without a budget (offload_lib.needs_profile) is planned without it.
    profile = (dry_run_profile(cfg, setup.step_fn, abstract_model, mesh, rules, stages)
               if cfg.dry_run or offload_lib.needs_profile(cfg, abstract_state) else None)
    plan = offload_lib.resolve(cfg, profile, abstract_state, mesh, rules, peak_flops())
    if plan.options.any:  # the step that runs is another program, its profile another
        return dataclasses.replace(setup, step_fn=build_step(offload=plan.options), offload_plan=plan)
    return dataclasses.replace(setup, offload_plan=plan, profile=profile)


def dry_run_fields(cfg: Config, setup: Setup) -> dict:
    """The step's compile-only profile (``dry_run=true`` prints it as one JSON line),
    with the offload plan's figures."""
    profile = setup.profile or dry_run_profile(cfg, setup.step_fn, setup.abstract_model, setup.mesh,
                                               setup.rules, setup.stages)
    if setup.offload_plan is not None:
        profile.update(offload_lib.dry_run_fields(setup.offload_plan))
    return profile


def batches(cfg: Config, task, setup: Setup) -> tuple:
    """``(tokenizer, Batches)``: the run's rows, its loader and evaluation batches."""
    tokenizer, train_rows, val_rows = task.data()
    val_rows_of = data_lib.eval_rows(len(val_rows), cfg.batch_size, cfg.eval.batches) if cfg.eval.every else []
    to_global = functools.partial(_global_batch, step_fn=setup.step_fn)
    batch_of = task.batches(tokenizer, train_rows, val_rows, setup.frozen, to_global, setup.step_fn.batch_sharding)
    return tokenizer, Batches(Loader(train_rows, cfg.batch_size, seed=cfg.seed), batch_of,
                              [(rows, data_lib.batch_of_rows(val_rows, rows)) for rows in val_rows_of])


def write_run_dir(cfg: Config, task) -> None:
    """The run dir's files besides checkpoints (process 0 writes them): the resolved
    config and the task's own (``save_files``)."""
    if jax.process_index() != 0:
        return
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    task.save_files(run_dir)


def initial_state(task, setup: Setup, restored, loader: Loader) -> tuple:
    """``(params, opt_state)``: fresh, or the checkpoint's (saved in model order, so
    put in the step's storage order), with the loader moved to its step."""
    step_fn = setup.step_fn
    if restored is None:
        create = setup.programs.get("create")
        if create is None:
            @nnx.jit
            def create(frozen):  # the frozen state an argument, not constants of the program
                return jaxpar.shard_model(task.initialise(task.model(), frozen), setup.mesh, setup.rules)

            setup.programs["create"] = create
        with jax.set_mesh(setup.mesh):  # where JAX traces Explicit axes' shardings (axis_types)
            return step_fn.init(create(setup.frozen))
    _, state, meta = restored
    state = step_fn.in_storage_order(state)
    loader.restore(meta["loader"])
    return state["params"], state["opt_state"]


def position_of(restored) -> dict:
    """Where a run stands, as a step's record says it (``stepping.finished`` reads it):
    ``step`` (0 without a checkpoint) and, where the optimizer counts it, AdaScale's
    ``adascale_progress`` (the sum of its gains)."""
    if restored is None:
        return {"step": 0}
    step, state, _ = restored
    adascale = adascale_lib.state_of(state["opt_state"])
    return {"step": step} if adascale is None else {"step": step, "adascale_progress": float(adascale.progress)}


def base_batch_of(cfg: Config, restored) -> int:
    """The global batch ``optimizer.batch_scaling`` scales against:
    ``optimizer.base_batch_size`` where given, else the run's first (the checkpoint's,
    or for a new run, or a checkpoint from before it was kept, this one)."""
    if cfg.optimizer.base_batch_size is not None:
        return cfg.optimizer.base_batch_size
    return cfg.batch_size if restored is None else int(restored[2].get("base_batch", cfg.batch_size))


def rescaled(cfg: Config, task, setup: Setup, base_batch: int) -> Setup:
    """``setup`` for ``base_batch`` (``base_batch_of``'s), rebuilt where it is not the
    base ``build`` took (a resumed run's first batch) and ``optimizer.batch_scaling``
    scales by it (the same state shapes, so the restored state fits the new step)."""
    if cfg.optimizer.batch_scaling == "none":
        return setup
    if base_batch != cfg.batch_size:
        log.info("global batch %d, the base %d: learning rate x%.3g (optimizer.batch_scaling=%s)",
                 cfg.batch_size, base_batch, batch_scale(cfg.optimizer.batch_scaling, cfg.batch_size, base_batch),
                 cfg.optimizer.batch_scaling)
    if base_batch == (cfg.optimizer.base_batch_size or cfg.batch_size):
        return setup
    return build(cfg, task, base_batch)


class TransformerTask:
    """A transformer's run (``task: lm`` or ``glide``: ``jaxpar.train.tasks``) as the
    loop's task: ``build``'s step, its batches, state and hooks."""

    def __init__(self, model_task):
        self.model_task, self.cfg = model_task, model_task.cfg
        # a draft's shape, which its arrays alone do not show
        glide = (("glide", "layers"), ("glide", "draft_vocab")) if self.cfg.task == "glide" else ()
        self.same_model = (SHAPE_KEYS, glide)

    def build(self) -> None:
        self.setup = setup = build(self.cfg, self.model_task)
        self.mesh = setup.mesh
        host_state = setup.offload_plan is not None and setup.offload_plan.options.state_on_host
        self.replica_parallel = False if host_state else None  # Checkpoints': the state in host memory

    def dry_run(self) -> dict:
        return dry_run_fields(self.cfg, self.setup)

    def restore_target(self):
        return self.setup.step_fn.abstract_state(self.setup.abstract_model)

    def start(self, restored, base_batch: int) -> Trainer:
        """The trainer: the step for ``base_batch``, the batches, the state (fresh or
        ``restored``) and the hooks (MFU, evaluation, the noise scale, batch weights)."""
        cfg, task = self.cfg, self.model_task
        setup = self.setup = rescaled(cfg, task, self.setup, base_batch)
        self.tokenizer, data = batches(cfg, task, setup)
        params, opt_state = initial_state(task, setup, restored, data.loader)
        trainer = Trainer(setup.step_fn, params, opt_state, data, lr=setup.lr, frozen=setup.frozen,
                          tokens_per_step=cfg.batch_size * cfg.seq_len, steps=cfg.steps)
        peak = peak_flops()
        if peak and task.counts_flops:
            trainer.add_hook(utilisation(flops_per_token(cfg), peak * setup.mesh.devices.size))
        if data.validation:
            trainer.add_hook(evaluation(setup.step_fn, data, setup.frozen, setup.programs), every=cfg.eval.every)
        if setup.noise_scale:
            trainer.add_hook(noise_lib.hook(cfg.batch_size))
        if setup.row_split is not None:  # data.batch_weights: each process's share, maybe re-measured
            weighted.start_shares(cfg, setup.step_fn, setup.row_split, data, trainer, resumed=restored is not None)
            if cfg.data.rebalance_every:
                trainer.add_hook(weighted.rebalancing(cfg, setup.step_fn, setup.row_split, data),
                                 every=cfg.data.rebalance_every)
        return trainer

    def save_files(self, run_dir: pathlib.Path) -> None:
        """The tokenizer (``jaxpar-generate`` needs only the run dir) and the task's own."""
        self.tokenizer.save(str(run_dir / "tokenizer.json"))
        self.model_task.save_files(run_dir)

    def close(self) -> None:
        pass


def task_of(cfg: Config, *, progress: bool = False) -> TransformerTask | recsys.DLRMTask:
    """The loop's task for ``cfg.task``: a DLRM (``jaxpar.train.recsys``), or a
    transformer's, its layout resolved first where the config leaves it to the planner
    (``mesh=auto``, ``pipeline.stage_layers=auto``: ``jaxpar.train.plan``)."""
    if cfg.task == "dlrm":
        return recsys.DLRMTask(cfg)
    if cfg.auto_mesh:  # the planner's best layout for the devices present
        from jaxpar.train.plan import auto

        cfg = auto(cfg)
    if cfg.pipeline.stage_layers == "auto":  # solved from pipeline.device_profile (jaxpar.planning.stages)
        from jaxpar.train.plan import auto_stage_layers

        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, stage_layers=auto_stage_layers(cfg)))
    return TransformerTask(tasks.of(cfg, progress=progress))


def train(cfg: Config, *, progress: bool = True) -> list[dict]:
    """Runs (or resumes) the training ``cfg`` describes; returns the per-step metrics
    (none, with one log line, when the run dir's checkpoint is at ``cfg.steps`` already).

    In the main thread, SIGINT or SIGTERM stops the run at the next step boundary with
    that step saved and raises ``jaxpar.train.stopping.Stopped`` (a second signal acts
    at once); several processes stop at the same step (``stopping``)."""
    check_output_dirs(cfg)
    task = task_of(cfg, progress=progress)
    cfg = task.cfg
    with contextlib.closing(task):  # a DLRM's cache and prefetch thread, on every way out
        task.build()
        if cfg.dry_run:
            print(json.dumps(task.dry_run(), separators=(",", ":")))
            return []
        with Checkpoints(pathlib.Path(cfg.run_dir), keep=cfg.checkpoint.keep,  # closed on every way out
                         replica_parallel=task.replica_parallel) as checkpoints:
            return _run(cfg, task, checkpoints, progress)
        # leaving the Checkpoints block waits for the last save


def _run(cfg: Config, task, checkpoints: Checkpoints, progress: bool) -> list[dict]:
    """``train``'s steps from the newest checkpoint in ``checkpoints`` (or step 0)."""
    check_same_model(checkpoints, cfg, *task.same_model)
    restored = checkpoints.restore_latest(task.restore_target())
    position = position_of(restored)
    start, done = position["step"], position.get("adascale_progress")
    if finished(position, cfg.steps):
        log.warning("%s is already at step %d%s (steps=%d): nothing to do; raise steps= to continue "
                    "or choose another run_dir", cfg.run_dir, start,
                    "" if done is None else f", progress {done:.1f}", cfg.steps)
        return []
    base_batch = base_batch_of(cfg, restored)
    trainer = task.start(restored, base_batch)  # its data read: a run it refuses says nothing of starting
    if restored is None:
        log.info("starting at step 0 on %s", describe_mesh(task.mesh))
    else:
        log.info("resuming from step %d (checkpoint %s) on %s", start, checkpoints.directory / str(start),
                 describe_mesh(task.mesh))
    write_run_dir(cfg, task)  # only now: a run refused above leaves no run dir
    recorder = Recorder(pathlib.Path(cfg.run_dir), start, cfg.steps, lead=jax.process_index() == 0,
                        progress=progress, done=done)
    log.info("compiling the train step (the first step waits for it)")
    with trainer.context():
        return run_steps(start, cfg.steps, cfg.checkpoint.every, one_step=trainer.step,
                         save=lambda step: save(checkpoints, step, trainer.checkpoint_state(), trainer.loader, cfg,
                                                base_batch=base_batch),  # a DLRM's with its cache flushed
                         recorder=recorder,
                         where=str(checkpoints.directory))
