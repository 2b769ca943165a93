"""Training configuration: nested frozen dataclasses, filled from YAML and ``key=value``.

The dataclasses are the one source of truth (names, types, defaults); a YAML file under
``train/configs/`` (or any path) only sets values, and command-line overrides use dotted
keys (``mesh.fsdp=4``, ``model.layers=2``). Unknown keys and wrong types are
``ConfigError``s naming the key and the valid keys near it (the reading, checking and
conversion of the values: ``jaxpar.train.config_load``).

The parallel layout's settings (``mesh.fsdp``, ``pipeline.schedule``, ``model.remat``,
``optimizer.grad_accum``, ``offload.params``, ... ``jaxpar.layout.KEYS``) are read into
one ``jaxpar.layout.Layout``, ``Config.layout``, rather than into their sections: the
keys stay where a user writes them, the values have one home, which the planner
enumerates and ``to_dict`` writes back under the same keys.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import typing
from typing import Any, Literal

import yaml

from jaxpar.hetero import reduction as reduction_lib
from jaxpar.kernels.dispatch import IMPLS as KERNEL_IMPLS
from jaxpar.layout import FIELD_OF as LAYOUT_FIELD_OF, KEYS as LAYOUT_KEYS, Layout
from jaxpar.models.config import CHECKPOINT_NAMES, PRESETS, ModelConfig, check_expert_ways
from jaxpar.models.dlrm import DLRM_PRESETS, DLRMConfig
from jaxpar.models.moe import PIPE_GROUPS
from jaxpar.offload.budget import parse_bytes
from jaxpar.offload.planner import PCIE5_X16_BANDWIDTH, REORDERED_STAGES, WHOLE_STAGES
from jaxpar.placement.mesh import AXIS_TYPES
from jaxpar.placement.execution import SEQUENCE_LAYOUTS
from jaxpar.kernels.dispatch import KernelOptions
from jaxpar.train import combinations
from jaxpar.train.config_load import ConfigError, _build, _coerce, _merge, _read_yaml, _set
from jaxpar.train.config_tasks import EmbeddingConfig, GlideConfig
from jaxpar.train.data import DataConfig
from jaxpar.train.pipelined import check_stage_layers
from jaxpar.train.recsys_data import SPARSE as CRITEO_FEATURES

CONFIG_DIR = pathlib.Path(__file__).parent / "configs"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The mesh beyond its sizes. The sizes ``mesh.data``, ``fsdp``, ``expert`` (a MoE
    model's experts), ``pipe``, ``seq`` and ``tensor`` are ``Config.layout``'s (``data``
    None takes the devices the others leave; ``tensor`` is ``k`` for 1D (Megatron) tensor
    parallelism or ``[q, q]`` for the 2D (SUMMA) grid). ``axis_types``: every axis ``auto`` or ``explicit``
    (``jaxpar.make_mesh``)."""

    axis_types: Literal[tuple(AXIS_TYPES)] = "auto"


# The most simulated CPU devices one program compiles for (measured with JAX 0.10: 2,048
# compile, 2,049 and up fail with "Multiprocess computations aren't implemented on the CPU
# backend"), so the planner compiles nothing wider (plan.compile_devices).
MAX_CPU_PROGRAM_DEVICES = 2048


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What the layout planner (``jaxpar-plan``, ``mesh=auto``; ``jaxpar.planning``) plans
    for. ``devices``: how many (unset: the devices present); ``device_memory``: bytes per
    device (``80GiB``; unset: the device's own where the backend says, else the hardware
    profile's); ``hardware``: ``h100``, ``h200``, ``a100``, ``cpu`` (the profile
    ``jaxpar-plan --calibrate`` measured here) or a profile's YAML path (unset: the
    present device's kind, ``cpu`` on CPUs); ``devices_per_node``: devices that share a
    node's fast links (unset: 8, or the devices one process has with ``mesh=auto``);
    ``compile_top``: the candidates that could still rank first are compiled for exact
    figures, at most ``3 x compile_top`` of them (0: the analytic model only);
    ``compile_devices``: the most (simulated CPU) devices a candidate is compiled on: it
    compiles with ``data`` cut to 2 and the batch with it, the same program per device
    (``jaxpar.planning.search.compiled_shape``); one that still needs more stays
    estimated, and the plan says so."""

    devices: int | None = None
    device_memory: str | int | None = None
    hardware: str | None = None
    devices_per_node: int | None = None
    compile_top: int = 12  # 36 programs: what jaxpar-plan 1b devices=8 hardware=h100 needs (33)
    compile_devices: int = 1024

    def __post_init__(self):
        for key in ("devices", "devices_per_node"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key}={value!r} must be a positive integer")
        if self.devices and self.devices_per_node and self.devices % self.devices_per_node \
                and self.devices > self.devices_per_node:
            raise ValueError(f"devices_per_node={self.devices_per_node} does not divide devices={self.devices}")
        if self.device_memory is not None:
            parse_bytes(self.device_memory, name="device_memory")
        if self.compile_top < 0:
            raise ValueError(f"plan.compile_top={self.compile_top!r} must not be negative")
        if not 1 <= self.compile_devices <= MAX_CPU_PROGRAM_DEVICES:
            raise ValueError(f"plan.compile_devices={self.compile_devices!r} must be within 1 and "
                             f"{MAX_CPU_PROGRAM_DEVICES}: XLA:CPU compiles no program of more devices in one "
                             f"process (\"Multiprocess computations aren't implemented on the CPU backend\")")

    @property
    def memory(self) -> int | None:
        return None if self.device_memory is None else parse_bytes(self.device_memory, name="device_memory")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to ``lr * min_lr_ratio``.

    ``optimizer.grad_accum`` (microbatches per step, accumulated inside the one jitted
    step), ``optimizer.reduction`` and ``optimizer.compression`` are ``Config.layout``'s.
    How the ``data`` replicas' gradients combine (``jaxpar.hetero.reduction``):
    ``reduction`` ``mean`` (XLA's all-reduce) or ``adasum`` (a power-of-two
    ``mesh.data``); ``compression`` ``dct_topk``: each replica sends only the entries
    above a threshold re-estimated every ``threshold_every`` steps, at most
    ``compression_ratio`` of each tensor, and carries the rest. The ratio's default,
    0.01, is the ~100x compression DCT reports (Gupta et al., 2020); as values plus
    int32 indices gathered from every replica, it moves fewer bytes than the all-reduce
    for fewer than ~100 replicas (the break-even ratio is ``1 / mesh.data``).

    ``batch_scaling``: how the schedule's peak (and end) learning rate follows the global
    batch when a resumed run changes ``batch_size`` (an elastic job): ``linear`` times
    ``batch_size / base`` (Goyal et al.), ``sqrt`` times its square root (Krizhevsky; Adam's
    usual rule), ``none`` unchanged; ``base`` is ``base_batch_size`` (the batch the
    learning rate was tuned at) where given, else the run's first batch size, kept in
    its checkpoints. The default is ``none``: a run that never resizes is unaffected, and
    which rule suits a model and optimizer is the user's to choose (linear scaling is
    SGD's rule and overshoots with Adam at large ratios). The schedule stays on the step
    clock (``warmup_steps`` and the cosine over ``steps`` count steps whatever the batch)
    and Adam's moments carry over as they are (they are per parameter, not per sample).
    ``adascale`` (needs ``eval.noise_scale=true``): AdaScale's gain, measured every step
    from the noise scale, in place of a fixed rule (``jaxpar.elastic.adascale``); the
    schedule then runs on its progress (the sum of the gains, in steps at the base
    batch), and so does the run's length: it ends when the progress reaches ``steps``,
    as AdaScale and AdaptDL define it (``jaxpar.train.stepping.finished``)."""

    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0  # global gradient norm clipping
    compression_ratio: float = 0.01
    threshold_every: int = 10
    batch_scaling: Literal["none", "linear", "sqrt", "adascale"] = "none"
    base_batch_size: int | None = None  # what batch_scaling scales against; None: the run's first

    def __post_init__(self):
        reduction_lib.Reduction("mean", "none", self.compression_ratio, self.threshold_every)  # its checks
        if self.base_batch_size is not None and self.base_batch_size < 1:
            raise ValueError(f"optimizer.base_batch_size={self.base_batch_size!r} must be at least 1")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # save every N steps (and at the last step); 0 saves only at the end
    keep: int = 3  # keep the last K


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """With ``mesh.pipe`` > 1 (``jaxpar.parallel.pipeline_schedule``): ``pipeline.schedule``,
    ``microbatches`` per step (None: twice ``mesh.pipe``) and ``virtual_stages`` per device
    (interleaved) are ``Config.layout``'s.

    ``stage_layers``: layers per stage, ``mesh.pipe x virtual_stages`` entries in stage
    order (stage ``s`` on device ``s % mesh.pipe``), each at least 1, summing to
    ``model.layers`` (``[3, 1, 2, 2]``; uneven stages are stored padded to the largest,
    ``jaxpar.train.pipelined``); "auto": chosen from ``device_profile``; None: even.
    ``device_profile``: a YAML file describing the pipeline's devices, what "auto" reads
    (needed with it)."""

    stage_layers: tuple[int, ...] | Literal["auto"] | None = None
    device_profile: str | None = None

    def __post_init__(self):
        if self.device_profile is not None:  # "~/gpus.yaml" as a user types it
            object.__setattr__(self, "device_profile", os.path.expanduser(self.device_profile))
        if self.stage_layers == "auto" and self.device_profile is None:
            raise ValueError("pipeline.stage_layers='auto' needs pipeline.device_profile=FILE (the YAML "
                             "of the pipeline devices' speeds and memories it allocates layers by)")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How the step computes, beyond the mesh sizes (``jaxpar.Execution``).

    Who computes each fused operation (``jaxpar.kernels.KernelOptions``): "auto" (the
    Pallas kernels on GPU, XLA elsewhere), "xla", "pallas" (on CPU in interpret mode:
    slow, for tests), and for attention "cudnn" (GPU only). ``loss`` "pallas" is the
    fused vocabulary projection + cross-entropy that never stores the logits; ``moe``
    "pallas" the grouped-matmul kernel for the experts' MLPs ("xla": ``jax.lax.ragged_dot``);
    ``moe_exchange`` how ``mesh.expert`` moves tokens: "padded" fixed per-destination
    all-to-all buffers, "ragged" ``jax.lax.ragged_all_to_all`` (GPU and TPU), "auto"
    ragged where the backend has it.

    With ``mesh.seq`` > 1, how attention runs over the split length
    (``jaxpar.ring_attention``): ``execution.seq_impl`` (``Config.layout``'s) the blockwise
    ring, the paper's Ring Self-Attention or Ulysses' all-to-all; ``seq_layout`` the token order the model
    keeps (zigzag: causal load balance, the loader permutes every batch; needs seq_len
    divisible by 2 x mesh.seq). The library's own default is "natural" (right for any
    caller); the trainer defaults to "zigzag" because it permutes its batches itself.

    ``execution.sequence_parallel`` (``Config.layout``'s): Megatron sequence parallelism
    with 1D ``mesh.tensor``: norms and residual adds work on length-split activations
    (``jaxpar.rules.SEQUENCE_PARALLEL``).
    """

    attention: Literal[KERNEL_IMPLS["attention"]] = "auto"
    norm: Literal[KERNEL_IMPLS["norm"]] = "auto"
    loss: Literal[KERNEL_IMPLS["loss"]] = "auto"
    moe: Literal[KERNEL_IMPLS["moe"]] = "auto"
    moe_exchange: Literal[KERNEL_IMPLS["moe_exchange"]] = "auto"
    seq_layout: Literal[SEQUENCE_LAYOUTS] = "zigzag"

    @property
    def kernels(self) -> KernelOptions:
        """The kernels chosen; ``ConfigError`` (one line) for one this device cannot run
        (``cudnn`` without a GPU, ``pallas`` or ``cudnn`` on a GPU older than 8.0)."""
        try:
            return KernelOptions(self.attention, self.norm, self.loss, self.moe, self.moe_exchange)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Train state in host memory (``jaxpar.offload``): where the parameters
    (``offload.params``) and the optimizer state (``offload.optimizer``) live between
    steps, ``device``, ``host`` or ``auto`` (the planner chooses under ``device_budget``),
    is ``Config.layout``'s; ``activations``: the
    ``checkpoint_name``s whose saved residuals go to the host (a list, or ``none``);
    ``device_budget``: bytes per device (``6GiB``, ``512MiB``, ``1.5GB``, an integer;
    unset: the device's own memory where the backend says, else no limit);
    ``resident_layers``: how many stacked layers keep their parameters on the device
    (unset: the planner's choice under a budget, else none with ``params=host``);
    ``prefetch``: layers fetched ahead; ``host_bandwidth``: host<->device bytes per second
    per direction, for the planner's step-time prediction (a number or ``64GB``)."""

    activations: tuple[str, ...] | Literal["none"] = ()
    device_budget: str | int | float | None = None
    resident_layers: int | None = None
    prefetch: int = 1
    host_bandwidth: str | float = PCIE5_X16_BANDWIDTH

    def __post_init__(self):
        if self.activations == "none":
            object.__setattr__(self, "activations", ())
        unknown = [name for name in self.activations if name not in CHECKPOINT_NAMES]
        if unknown:
            raise ValueError(f"offload.activations={list(self.activations)} names no checkpoint of the "
                             f"model ({', '.join(unknown)}); it defines {', '.join(CHECKPOINT_NAMES)}")
        if self.device_budget is not None:
            parse_bytes(self.device_budget, name="offload.device_budget")
        if isinstance(self.host_bandwidth, str):
            parse_bytes(self.host_bandwidth, name="offload.host_bandwidth")
        if not self.bandwidth > 0:
            raise ValueError(f"offload.host_bandwidth={self.host_bandwidth!r} must be positive")
        if self.prefetch < 1:
            raise ValueError(f"offload.prefetch={self.prefetch!r} must be at least 1")
        if self.resident_layers is not None and self.resident_layers < 0:
            raise ValueError(f"offload.resident_layers={self.resident_layers!r} must not be negative")

    @property
    def budget(self) -> int | None:
        """``device_budget`` in bytes (None: unset)."""
        return None if self.device_budget is None else parse_bytes(self.device_budget)

    @property
    def bandwidth(self) -> float:
        """``host_bandwidth`` in bytes per second."""
        if isinstance(self.host_bandwidth, str):
            return float(parse_bytes(self.host_bandwidth))
        return float(self.host_bandwidth)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 50  # validation loss every N steps (and at the last step); 0 never
    batches: int = 4
    # Log the gradient noise scale every step (McCandlish et al.'s simple estimator from the
    # data replicas' gradients and the batch's: jaxpar.train.noise_scale); needs mesh.data > 1.
    noise_scale: bool = False


@dataclasses.dataclass(frozen=True)
class Config:
    # With task glide, model.* is the target's (from target_run_dir), not set here; with
    # task dlrm, a DLRMConfig (model: dlrm or dlrm_criteo, jaxpar.models.DLRM_PRESETS).
    model: ModelConfig | DLRMConfig = ModelConfig()
    data: DataConfig = DataConfig()
    # "auto": the planner chooses the mesh, pipeline, remat, grad_accum and offload for the
    # devices present (jaxpar.train.plan.auto; plan.* says for what).
    mesh: MeshConfig | Literal["auto"] = MeshConfig()
    # The parallel layout (jaxpar.layout): mesh sizes, pipeline schedule, sequence
    # implementation, remat, accumulation, reduction, offload places, read from and
    # written to their public keys (mesh.fsdp, model.remat, ...: jaxpar.layout.KEYS).
    layout: Layout = dataclasses.field(default=Layout(data=None), metadata={"keys": tuple(LAYOUT_KEYS.values())})
    plan: PlanConfig = PlanConfig()
    pipeline: PipelineConfig = PipelineConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    execution: ExecutionConfig = ExecutionConfig()
    offload: OffloadConfig = OffloadConfig()
    run_dir: str = "runs/tiny"
    # Tokenizer/packed-data cache, keyed by content; None: the per-user
    # $XDG_CACHE_HOME/jaxpar, else ~/.cache/jaxpar (jaxpar.train.data.default_cache_dir).
    cache_dir: str | None = None
    steps: int = 200
    seed: int = 0
    batch_size: int = 16  # global, in sequences
    seq_len: int = 128
    dry_run: bool = False  # compile the step, print the profiler's JSON line, exit
    # "lm": train `model` as a language model; "glide": train a GliDe draft for the
    # frozen target in target_run_dir (a jaxpar run dir or a Hugging Face directory);
    # "dlrm": train a recommendation model (jaxpar.models.DLRM) on data.format criteo or
    # synthetic, batch_size samples a step (seq_len unused), its tables as embedding.* says.
    task: Literal["lm", "glide", "dlrm"] = "lm"
    target_run_dir: str | None = None
    glide: GlideConfig = GlideConfig()
    embedding: EmbeddingConfig = EmbeddingConfig()

    @property
    def auto_mesh(self) -> bool:
        return self.mesh == "auto"

    @property
    def gradient_reduction(self) -> reduction_lib.Reduction:
        """What ``make_train_step(..., reduction=)`` takes."""
        return reduction_lib.Reduction(self.layout.reduction, self.layout.compression,
                                       self.optimizer.compression_ratio, self.optimizer.threshold_every)

    @property
    def offload_requested(self) -> tuple[str, ...]:
        """The offload keys that ask for a plan (any but ``prefetch`` and
        ``host_bandwidth`` off their defaults), as ``key=value``; empty: everything stays
        on the device, unplanned."""
        shown = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - as the user wrote it
        places = [(f"offload.{k}", getattr(self.layout, f"offload_{k}"), "device") for k in ("params", "optimizer")]
        default = OffloadConfig()
        rest = [(f"offload.{k}", getattr(self.offload, k), getattr(default, k))
                for k in ("activations", "device_budget", "resident_layers")]
        return tuple(f"{key}={shown(value)!r}" for key, value, unset in places + rest if value != unset)

    def __post_init__(self):
        if (self.task == "dlrm") != isinstance(self.model, DLRMConfig):
            raise ValueError(f"task={self.task!r} with a {type(self.model).__name__} model: task dlrm "
                             f"takes a DLRM (model: {' or '.join(DLRM_PRESETS)}), the others a transformer")
        if self.task == "dlrm":
            return self._check_dlrm()
        if self.auto_mesh and self.task == "glide":
            raise ValueError("mesh=auto plans a language model's step; give task=glide a mesh")
        if self.task == "glide" and not self.target_run_dir:
            raise ValueError("task='glide' needs target_run_dir=DIR (the target model's jaxpar run "
                             "or Hugging Face directory)")
        for key in ("steps", "batch_size", "checkpoint.keep", "eval.batches"):
            value = _get(self, key)
            if value < 1:
                raise ValueError(f"{key}={value!r} must be at least 1")
        self.layout.check(mesh=not self.auto_mesh)
        if self.layout.expert != 1:
            check_expert_ways(self.model.moe, self.layout.expert)
        for key in ("checkpoint.every", "eval.every", "optimizer.warmup_steps"):
            if _get(self, key) < 0:
                raise ValueError(f"{key}={_get(self, key)!r} must not be negative")
        if self.model.moe is not None and self.model.moe.every > 1 and self.layout.pipe > 1 \
                and self.pipeline.stage_layers is not None:
            raise ValueError(f"pipeline.stage_layers with model.moe.every={self.model.moe.every} is not "
                             f"supported yet: {PIPE_GROUPS}")
        if isinstance(self.pipeline.stage_layers, tuple):  # its count is checked with the mesh (loop)
            check_stage_layers(self.pipeline.stage_layers, self.model.layers)
        # 256 byte symbols plus EOS is the smallest byte-level vocabulary.
        if self.task == "lm" and self.data.tokenizer is None and self.model.vocab_size < 257:
            raise ValueError(f"model.vocab_size={self.model.vocab_size} must be >= 257 to train a "
                             "byte-level BPE of that size (256 bytes + EOS)")
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len!r} must be at least 2")
        if self.optimizer.base_batch_size is not None and self.optimizer.batch_scaling == "none":
            raise ValueError(f"optimizer.base_batch_size={self.optimizer.base_batch_size} scales nothing with "
                             "optimizer.batch_scaling=none: give linear, sqrt or adascale, or drop it")
        if self.optimizer.batch_scaling == "adascale" and not self.eval.noise_scale:
            raise ValueError("optimizer.batch_scaling=adascale reads the gradient noise scale: give "
                             "eval.noise_scale=true")
        self._check_offload()
        combinations.check(self)  # the mesh's features too, once it is known
        if self.auto_mesh:
            return  # the rest checks the mesh: the plan's, once chosen
        layout, offload = self.layout, self.offload
        state_offload = [f"offload.{k}={v!r}" for k, v in (("params", layout.offload_params),
                                                             ("optimizer", layout.offload_optimizer)) if v != "device"]
        if layout.pipe > 1 and state_offload and (layout.schedule == "interleaved"
                                                  or self.pipeline.stage_layers is not None):
            raise ValueError(f"{state_offload[0]} with pipeline.schedule={layout.schedule} (stage_layers="
                             f"{self.pipeline.stage_layers}) is not supported yet: {REORDERED_STAGES}")
        if layout.pipe > 1 and offload.resident_layers:
            raise ValueError(f"offload.resident_layers={offload.resident_layers} with mesh.pipe={layout.pipe} is "
                             f"not supported yet: {WHOLE_STAGES}")
        seq = layout.seq
        ways = 2 * seq if self.execution.seq_layout == "zigzag" else seq
        if seq > 1 and self.seq_len % ways:
            raise ValueError(
                f"seq_len={self.seq_len} must be divisible by "
                + (f"2 x mesh.seq = {ways} for execution.seq_layout=zigzag" if ways > seq else f"mesh.seq={seq}")
            )

    def _check_offload(self):
        resident = self.offload.resident_layers
        if resident is not None and self.layout.offload_params == "device":
            raise ValueError(f"offload.resident_layers={resident} applies to "
                             "offload.params=host or auto (with params=device every layer is resident)")
        if resident is not None and resident > self.model.layers:
            raise ValueError(f"offload.resident_layers={resident} is above model.layers={self.model.layers}")

    def _check_dlrm(self):
        for key in ("steps", "batch_size", "checkpoint.keep", "eval.batches"):
            if _get(self, key) < 1:
                raise ValueError(f"{key}={_get(self, key)!r} must be at least 1")
        if self.data.format == "text":
            raise ValueError("task=dlrm reads data.format=criteo (a Criteo TSV at data.path) or synthetic")
        if self.data.format == "criteo" and not self.data.path:
            raise ValueError("data.format=criteo needs data.path=FILE (Criteo's TSV, plain or .gz)")
        if self.data.format == "criteo" and len(self.model.table_rows) != CRITEO_FEATURES:
            raise ValueError(f"data.format=criteo has {CRITEO_FEATURES} categorical features, but the model has "
                             f"{len(self.model.table_rows)} tables: give model=dlrm_criteo_small (or dlrm_criteo, "
                             f"or {CRITEO_FEATURES} model.table_rows)")
        if self.auto_mesh or any(getattr(self.layout, a) not in (1, None) for a in ("fsdp", "pipe", "seq")) \
                or self.layout.tensor != 1:
            raise ValueError("task=dlrm trains data parallel: give mesh.data (or nothing) and no other axis")


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_config(name_or_path: str, overrides: typing.Sequence[str] = ()) -> Config:
    """Builds a ``Config`` from a shipped config name or a YAML path, then ``key=value``s.

    Override values are parsed as YAML (``steps=30``, ``mesh.tensor=[2,2]``,
    ``dry_run=true``, ``run_dir=/tmp/x``). An override that is a ``.yaml`` path is an
    overlay: its sections are merged over the config's, in order with the other
    overrides (``jaxpar-train tiny plan.yaml steps=30``, the plan ``jaxpar-plan --out``
    wrote).

    Raises:
      ConfigError: no such config, an unknown key, or a value of the wrong type.
    """
    path = pathlib.Path(name_or_path)
    if not path.suffix:
        path = CONFIG_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ConfigError(
                f"no config {name_or_path!r}; shipped configs: {', '.join(shipped_configs())}, "
                "or give a path to a YAML file"
            )
    elif not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    values = _read_yaml(path)
    for item in overrides:
        if isinstance(values.get("model"), str):  # "model: tiny": overrides go beside the preset
            values["model"] = {"preset": values["model"]}
        if "=" not in item and pathlib.Path(item).suffix in (".yaml", ".yml"):
            _merge(values, _read_yaml(pathlib.Path(item)))  # an overlay (jaxpar-plan --out)
            continue
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value")
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        _set(values, key.strip(), value)
    if "model" in values:
        values["model"] = _from_preset(values["model"])
    values["layout"] = _layout_of(values)
    return _build(Config, values)


def _layout_of(values: dict) -> Layout:
    """The ``Layout`` the public keys of ``values`` set (``jaxpar.layout.KEYS``), taken out
    of their sections; each value checked against its field as the key names it."""
    hints = typing.get_type_hints(Layout)
    kwargs = {"data": None}  # unset: the devices the other axes leave
    for key, name in LAYOUT_FIELD_OF.items():
        section, leaf = key.split(".")
        if isinstance(values.get(section), dict) and leaf in values[section]:
            kwargs[name] = _coerce(values[section].pop(leaf), hints[name], key)
    return Layout(**kwargs)


def _from_preset(model: Any) -> Any:
    """The ``model`` section with its preset (``model: small``, or ``model: {preset:
    small, remat: full}``) expanded: the preset's fields (``jaxpar.models.PRESETS``, the
    one definition of each), then the section's own keys over them."""
    if isinstance(model, str):
        model = {"preset": model}
    if not isinstance(model, dict) or "preset" not in model:
        return model
    model = dict(model)
    name = model.pop("preset")
    presets = {**PRESETS, **DLRM_PRESETS}
    if name not in presets:
        raise ConfigError(f"model.preset={name!r} is not one of {sorted(presets)}")
    values = dataclasses.asdict(presets[name])
    own_moe = model.get("moe")
    if values.get("moe", 0) is None and isinstance(own_moe, dict) and "experts" not in own_moe:
        # a MoE key on a dense model is a mistake, not a request for 8 default experts
        key, value = next(iter(own_moe.items()), ("experts", None))
        raise ConfigError(f"model.moe.{key}={value!r}: model {name!r} has no model.moe; use a MoE preset "
                          "(model=moe_tiny) or give model.moe.experts to make its MLPs mixtures of experts")
    _merge(values, model)  # section by section: model.moe.experts=4 keeps the preset's other moe keys
    return values


def to_dict(cfg: Config) -> dict:
    """The config as plain data (for metadata and the run's ``config.yaml``), the layout
    under its public keys (``jaxpar.layout.KEYS``): ``load_config`` of it is ``cfg``."""
    out = dataclasses.asdict(cfg)
    del out["layout"]
    for key, value in cfg.layout.settings().items():
        section, leaf = key.split(".")
        if isinstance(out[section], dict):  # not mesh=auto's sizes: the planner's
            out[section][leaf] = tuple(value) if isinstance(value, list) else value
    return out
