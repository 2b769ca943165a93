"""One jitted optimizer step, sharded by the rules: data parallelism and FSDP/ZeRO-3.

Parameters, gradients and optimizer state take the parameters' shardings (the
``embed`` dimension over ``fsdp`` under the default rules), the batch is split over
``data`` and ``fsdp``; XLA inserts the all-gathers and reduce-scatters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.elastic import adascale as adascale_lib
from jaxpar.hetero import reduction as reduction_lib
from jaxpar.offload import planner as offload_planner
from jaxpar.offload import state as offload_state
from jaxpar.offload.fetch import is_split, to_device, to_host
from jaxpar.placement import rules as rules_lib
from jaxpar.kernels.dispatch import KernelOptions
from jaxpar.models import moe as moe_lib
from jaxpar.placement.execution import Execution, OffloadOptions, SequenceOptions, use_execution
from jaxpar.placement.sharding import like_params, model_shardings, use_mesh
from jaxpar.train import combinations, gradients, pipelined
from jaxpar.train.losses import Batch, loss_and_stats, loss_fn

BATCH_AXES = ("batch", "length")
# What the data loader gives, each int32 [B, T].
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "mask")


@functools.cache
def _cached_converter(fn: Callable, kwargs: tuple, shardings: tuple, treedef) -> Callable:
    return jax.jit(functools.partial(fn, **dict(kwargs)), out_shardings=jax.tree.unflatten(treedef, shardings))


def _converter(fn: Callable, out_shardings, **kwargs) -> Callable:
    """``fn(state, **kwargs)`` (``pipelined.to_model`` / ``to_storage``,
    ``jaxpar.offload.state.split_layers`` / ``join_layers``; ``kwargs`` hashable) jitted
    once per layout, its results placed on ``out_shardings``: every checkpoint save
    calls one."""
    shardings, treedef = jax.tree.flatten(out_shardings)
    return _cached_converter(fn, tuple(sorted(kwargs.items())), tuple(shardings), treedef)


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A compiled step ``(params, opt_state, batch) -> (params, opt_state, metrics)``
    (``(params, opt_state, batch, frozen)`` when built with ``frozen``).

    ``params`` is the model's ``nnx.State``; ``graphdef`` rebuilds the model from it.
    ``loss`` is the step's ``(model, batch[, frozen]) -> scalar``, for evaluation.
    ``params_sharding`` / ``opt_sharding`` are what ``init`` places the state with
    (None without a mesh). ``execution``: the rules, kernels and sequence options the
    step was traced under, bound into the jitted step when it was built (so the context
    a call is made in cannot change the program); with ``sequence.layout="zigzag"`` the
    batches' tokens must be in ``to_zigzag`` order.

    ``layer_order``: with an interleaved pipeline, or uneven stages (``stage_layers``,
    layers per stage), the stacked layers of ``params`` (and of the optimizer state's
    copies of them) are stored device-major, position ``j`` of the ``layers`` axis
    holding model layer ``layer_order[j]``, or padding (zeros) where it is -1
    (``jaxpar.train.pipelined.storage_order``), so that a step re-lays nothing out; None
    when they are in the model's order. ``stage_layers``: the layers per stage the step
    was built with (None: even stages), for the profiler's padding figures. ``init`` stores them so; ``in_model_order`` puts
    a state back in the model's order (what checkpoints save, so a checkpoint is the
    model's whatever the schedule, and ``jaxpar.train.runs`` and a run on another
    schedule read it as it is) and ``in_storage_order`` stores a restored one again;
    ``model`` rebuilds the model from stored parameters (evaluation).

    ``execution.offload``: which state lives in host memory (``jaxpar.offload``);
    ``params_sharding`` / ``opt_sharding`` then carry the memory kinds, and with
    ``split = (R, L)`` each stacked leaf is stored as a ``jaxpar.offload.fetch.Split`` of
    its first ``R`` layers (device) and the rest (host), which ``in_model_order`` joins
    into one ``[L, ...]`` array in host memory and ``in_storage_order`` splits again.
    """

    graphdef: Any
    tx: optax.GradientTransformation
    step: Callable
    mesh: jax.sharding.Mesh | None
    params_sharding: Any
    opt_sharding: Any
    batch_sharding: Any
    execution: Execution = Execution()
    loss: Callable = loss_fn
    layer_order: np.ndarray | None = None
    split: tuple[int, int] | None = None
    stage_layers: tuple[int, ...] | None = None

    @property
    def offloading(self) -> bool:
        """Whether parameters or optimizer state live in host memory between steps."""
        return self.execution.offload.state_on_host

    @property
    def sequence(self) -> SequenceOptions:
        return self.execution.sequence

    def context(self):
        """The mesh and rules to run under, and the step's ``execution`` (for work traced
        beside the step, such as evaluation)."""
        stack = contextlib.ExitStack()
        if self.mesh is not None:
            stack.enter_context(use_mesh(self.mesh, self.execution.rules))
        stack.enter_context(use_execution(self.execution))
        return stack

    def init(self, model: nnx.Module):
        """Returns ``(params, opt_state)`` placed on the mesh (and stored as this step
        keeps them, see ``layer_order``)."""
        params = nnx.state(model)
        if self.offloading:
            return self._offloaded_init(params)
        init = jax.jit(self.tx.init, out_shardings=self.opt_sharding)
        if self.mesh is not None:
            params = jax.device_put(params, self.params_sharding)
        params = self.in_storage_order(params)
        return params, init(params)

    def _offloaded_init(self, params):
        """``init`` under offload: the parameters stored where they live, the optimizer
        state initialised where it lives (on the host with ``optimizer=host``)."""
        params = self.in_storage_order(params)
        if self.execution.offload.optimizer == "host":
            init = lambda p: offload_state.run_on_host(self.tx.init)(jax.tree.map(to_host, p))  # noqa: E731
        else:
            init = lambda p: self.tx.init(jax.tree.map(to_device, p))  # noqa: E731
        return params, jax.jit(init, out_shardings=self.opt_sharding)(params)

    def in_model_order(self, state):
        """``state`` (arrays: parameters, optimizer state or a tree of both, as this step
        keeps them) with its stacked layers in the model's order, each array on its
        sharding (a split stacked leaf joined in host memory); ``state`` itself when
        ``layer_order`` and ``split`` are None."""
        if self.split is not None:
            shardings = jax.tree.map(lambda x: x.sharding, state)
            out = jax.tree.map(lambda s: s.offloaded if is_split(s) else s, shardings, is_leaf=is_split)
            return _converter(offload_state.join_layers, out)(state)
        return self._reorder(state, pipelined.to_model)

    def in_storage_order(self, state):
        """The inverse of ``in_model_order``: a model-order state stored as the step keeps
        it (under offload: split and placed in the memories ``execution.offload`` says)."""
        if self.offloading:
            shardings = self._stored_shardings(state)
            if self.split is None:
                return jax.device_put(state, shardings)
            return _converter(offload_state.split_layers, shardings, resident=self.split[0],
                              layers=self.split[1])(state)
        return self._reorder(state, pipelined.to_storage)

    def _stored_shardings(self, state):
        """The storage shardings of a model-order ``state``: each subtree shaped like the
        parameters (or the optimizer state) takes ``params_sharding`` (``opt_sharding``)."""
        model_form = lambda tree: jax.tree.structure(  # noqa: E731
            jax.tree.map(lambda s: 0, tree, is_leaf=is_split))
        kinds = {model_form(self.params_sharding): self.params_sharding,
                 model_form(self.opt_sharding): self.opt_sharding}
        structure = lambda node: jax.tree.structure(jax.tree.map(lambda _: 0, node))  # noqa: E731
        return jax.tree.map(lambda node: kinds[structure(node)], state,
                            is_leaf=lambda node: structure(node) in kinds)

    def _reorder(self, state, reorder: Callable):
        if self.layer_order is None:
            return state
        shardings = jax.tree.map(lambda x: x.sharding, state)
        return _converter(reorder, shardings, order=tuple(int(i) for i in self.layer_order))(state)

    def model(self, params) -> nnx.Module:
        """The model that ``params`` (as this step keeps them) are; traceable."""
        if self.layer_order is not None:
                params = pipelined.to_model(params, self.layer_order)
        return nnx.merge(self.graphdef, params)

    def abstract_state(self, model: nnx.Module, sharding=None, *, stored: bool = False) -> dict:
        """``{"params", "opt_state"}`` as ``ShapeDtypeStruct``s with this step's shardings,
        memory kinds included (or ``sharding`` for every array, or none without a mesh):
        in model order, the target a checkpoint restores onto; with ``stored`` as the step
        keeps them (``split`` stacked leaves), the inputs ``compile`` lowers for."""
        params = nnx.state(model)
        shardings = {"params": self.params_sharding, "opt_state": self.opt_sharding}
        if self.split is not None:
            if stored:
                params = jax.eval_shape(functools.partial(
                    offload_state.split_layers, resident=self.split[0], layers=self.split[1]), params)
            else:
                shardings = jax.tree.map(lambda s: s.offloaded if is_split(s) else s, shardings,
                                         is_leaf=is_split)
        elif stored and self.layer_order is not None:  # padded where the stages are uneven
                params = jax.eval_shape(functools.partial(pipelined.to_storage, order=self.layer_order), params)
        state = {"params": params, "opt_state": jax.eval_shape(self.tx.init, params)}
        if sharding is not None or self.params_sharding is None:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)

    def compile(self, model: nnx.Module, batch_size: int, seq_len: int, compiler_options: dict | None = None):
        """Compiles the step for ``model``'s shapes without running it.

        ``model`` may be abstract (``nnx.eval_shape``), so a 1B model compiles on a
        laptop; ``.memory_analysis()`` of the result gives exact per-device bytes.
        ``compiler_options``: XLA's, for this compile only (``Lowered.compile``'s).
        """
        state = self.abstract_state(model, stored=True)
        params, opt_state = state["params"], state["opt_state"]
        token = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=self.batch_sharding)
        batch = dict.fromkeys(BATCH_KEYS, token)
        with self.context():
            return self.step.lower(params, opt_state, batch).compile(compiler_options)

    def __call__(self, params, opt_state, batch: Batch, *frozen):
        with self.context():
            return self.step(params, opt_state, batch, *frozen)


def make_train_step(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh | None = None,
    rules: rules_lib.Rules | None = None,
    *,
    grad_accum: int = 1,
    donate: bool = True,
    sequence: SequenceOptions = SequenceOptions(),
    kernels: KernelOptions | None = None,
    pipeline=None,
    stage_layers: tuple[int, ...] | None = None,
    loss: Callable = loss_fn,
    frozen: Any = None,
    offload: OffloadOptions | None = None,
    reduction: reduction_lib.Reduction | None = None,
    weighted: int | None = None,
    noise_scale: bool = False,
) -> TrainStep:
    """Builds the jitted train step for ``model``'s structure on ``mesh`` (or one device),
    its loss and gradients composed from the parts of ``jaxpar.train.gradients``: a source
    (the plain ``loss``, or ``pipeline``), ``grad_accum`` microbatches, and a per-replica
    part where ``reduction``, ``weighted`` or ``noise_scale`` asks for one.

    ``grad_accum=k``: ``k`` microbatches of ``B / k`` rows, each weighted by its share of
    the batch's counted tokens: the whole batch's token-weighted mean, whatever ``k``.
    ``pipeline``: a ``jaxpar.parallel.pipeline_schedule.Schedule`` over the ``pipe`` axis
    (``jaxpar.train.pipelined``), the stacked layers stored in the order it reads them
    (``TrainStep.layer_order``); ``stage_layers``: its ``P V`` stages' layers (None: even).
    ``loss``: ``(model, batch) -> scalar`` (default ``loss_fn``), or ``(model, batch,
    frozen) -> scalar`` with ``frozen``: an ``nnx.State`` (a GliDe draft's target's
    embedding and head) the loss reads and the step never trains, an argument of every
    call (``step(params, opt_state, batch, frozen)``) rather than a constant baked into
    the program; give its value or abstract state here for its shardings.
    ``offload``: which state lives in host memory between steps (``jaxpar.offload``);
    ``TrainStep.init`` places it so, on one device too.
    ``weighted``: HetSeq's unequal rows per data device (``jaxpar.train.weighted``), run
    in microbatches of ``weighted`` rows (``weighted / grad_accum`` with ``grad_accum``:
    the replica's loop is the accumulation, its microbatches made ``grad_accum`` times
    smaller). ``reduction``: how the ``data`` replicas'
    gradients combine (``jaxpar.hetero.reduction.Reduction``; the uncompressed mean is
    XLA's all-reduce); ``dct_topk``'s residuals are carried in the optimizer state
    (``TrainStep.tx`` is then ``optax.chain(carried, tx)``). ``noise_scale``: the step also
    returns ``grad_sq_small`` and ``grad_sq_big`` (``jaxpar.train.noise_scale``).
    ``_refuse`` names the combinations not built yet.
    """
    graphdef, params = nnx.split(model)
    reduction = None if reduction is None or reduction.is_mean else reduction
    offload = offload or OffloadOptions()
    moe = getattr(getattr(model, "cfg", None), "moe", None)
    _refuse(mesh, pipeline, offload, reduction, weighted, noise_scale, grad_accum, stage_layers, loss, frozen,
            moe=moe is not None)
    resolved = None if mesh is None else rules_lib.for_mesh(mesh, rules_lib.DEFAULT_RULES if rules is None else rules)
    execution = Execution(resolved, kernels or KernelOptions(), sequence, offload)
    if reduction is not None:
        reduction_lib.check(reduction, mesh)
        tx = reduction_lib.with_state(tx, reduction, mesh)
    layer_order, stage_layers = _storage_order(pipeline, model, stage_layers, offload)
    shardings = _shardings(params, tx, mesh, rules, resolved, offload, reduction, frozen)
    source = (gradients.plain(loss_and_stats if loss is loss_fn else loss, graphdef) if pipeline is None
              else pipelined.source(graphdef, pipeline, mesh, stage_layers, shardings.params))
    if weighted is not None:
        weighted //= grad_accum  # _refuse: a divisor
    elif grad_accum > 1:
        source = gradients.accumulated(source, grad_accum)
    replicas = gradients.Replicas(reduction, weighted, noise_scale)
    step = _step(source, replicas, tx, mesh, offload, shardings, execution, moe)
    donate_argnums = (0, 1) if donate else ()
    if mesh is None and not offload.state_on_host:
        return TrainStep(graphdef, tx, jax.jit(step, donate_argnums=donate_argnums),
                         None, None, None, None, execution, loss, layer_order, stage_layers=stage_layers)
    jitted = jax.jit(
        step,
        in_shardings=(shardings.params, shardings.opt, shardings.batch, *shardings.frozen),
        out_shardings=(shardings.params, shardings.opt, shardings.replicated),
        donate_argnums=donate_argnums,
        compiler_options=SIMULATED_DEVICES if (offload.state_on_host or pipeline is not None) and _simulated(mesh) else None,
    )
    return TrainStep(graphdef, tx, jitted, mesh, shardings.params, shardings.opt, shardings.batch,
                     execution, loss, layer_order, shardings.split, stage_layers)


# XLA:CPU's concurrency-optimized scheduler (its default) let the simulated devices of one
# CPU meet a step's collectives in different orders: jaxpar-train moe_tiny with
# offload.params=host and offload.optimizer=host on mesh.data=4 had three devices in the
# loss's token-count all-reduce while the fourth was still in the layer scan's
# routing-statistics all-reduce, and XLA aborted the process after 40 s (every try; with
# the memory-optimized scheduler, none). The same with a branching pipeline
# (2026-11-30): tiny seq_len=512 under fsdp=2 pipe=2 tensor=2 1f1b/m8 had four devices in a
# tick's collective-permute while the others were still in their stage's fsdp gathers and
# tensor all-reduces (aborted within 6 steps, three tries of three; none since). So host-resident
# steps and pipelines ask for it; the others keep XLA's default schedule, and so do the
# planner's compiled figures (``jaxpar.train.plan.FIGURE_OPTIONS`` names it), whose
# buffers the memory model is measured against (the memory-optimized one lowers the 1b
# step's peak by 11%). Neither scheduler is safe for every step, so the choice stays per
# kind of step rather than for every simulated mesh: under the memory-optimized one, tiny
# seq_len=512 fsdp=4 tensor=2 remat=dots (no pipeline) aborted the same way on its first
# steps, where the default runs it (2026-11-30); XLA:CPU has no option that fixes the
# order in which one process's devices meet their collectives.
SIMULATED_DEVICES = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def _simulated(mesh) -> bool:
    """Whether ``mesh`` is several devices of XLA:CPU."""
    return mesh is not None and mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"


def _storage_order(pipeline, model: nnx.Module, stage_layers, offload: OffloadOptions) -> tuple:
    """``(layer_order, stage_layers)``: how ``pipeline`` stores ``model``'s stacked layers
    (``TrainStep.layer_order``; None: in the model's order) and its stages' layer counts
    as ints; reordered storage is refused with host-resident state."""
    if pipeline is None:  # any model: only jaxpar's own pipelines (model.cfg.stacked_layers)
        return None, stage_layers
    if model.cfg.moe is not None and model.cfg.moe.every > 1 and stage_layers is not None:
        raise ValueError(f"pipeline.stage_layers with model.moe.every={model.cfg.moe.every} is not supported yet: "
                         f"{moe_lib.PIPE_GROUPS}")
    layer_order = pipelined.storage_order(pipeline, model.cfg.stacked_layers, stage_layers)
    if layer_order is not None and offload.state_on_host:
        raise ValueError(f"offload with pipeline {pipeline.kind!r} (stage_layers={stage_layers}) is not "
                         f"supported yet: {offload_planner.REORDERED_STAGES}")
    return layer_order, None if stage_layers is None else tuple(int(n) for n in stage_layers)


def _refuse(mesh, pipeline, offload: OffloadOptions, reduction, weighted, noise_scale: bool, grad_accum: int,
            stage_layers, loss, frozen, moe: bool = False) -> None:
    """One ``ValueError`` line for options that do not compose: the pairs of
    ``jaxpar.train.combinations`` (the table a config is checked against), then what the
    step's own arguments need."""
    shape = {} if mesh is None else dict(mesh.shape)
    tensor = [shape[a] for a in ("tensor", "tensor_row", "tensor_col") if shape.get(a, 1) > 1]
    present = {
        "model.moe": moe and "model.moe",
        "offload": offload.state_on_host and f"offload.params={offload.params!r} optimizer={offload.optimizer!r}",
        "data.batch_weights": weighted is not None and "data.batch_weights",
        "optimizer.reduction=adasum": reduction is not None and reduction.kind == "adasum" and "reduction=adasum",
        "optimizer.compression=dct_topk": reduction is not None and reduction.compressed and "compression=dct_topk",
        "eval.noise_scale": noise_scale and "noise_scale", "task=glide": frozen is not None and "frozen=",
        "optimizer.grad_accum": grad_accum > 1 and f"grad_accum={grad_accum}",
        "mesh.fsdp": shape.get("fsdp", 1) > 1 and f"mesh.fsdp={shape.get('fsdp')}",
        "mesh.tensor": bool(tensor) and f"mesh.tensor={tensor}",
        "mesh.pipe": pipeline is not None and "pipeline", "mesh.seq": shape.get("seq", 1) > 1 and f"mesh.seq={shape.get('seq')}",
    }
    line = combinations.refusal({key: shown for key, shown in present.items() if shown})
    if line is not None:
        raise ValueError(line)
    if weighted is not None and weighted % grad_accum:
        raise ValueError(f"data.batch_weights' microbatches of {weighted} rows cannot make "
                         f"optimizer.grad_accum={grad_accum} smaller ones")
    if noise_scale and mesh is None:
        raise ValueError("eval.noise_scale needs a mesh: it compares the data replicas' gradients")
    if pipeline is not None and offload.resident_layers not in (None, 0):
        raise ValueError(f"offload.resident_layers={offload.resident_layers} with mesh.pipe is not supported yet: "
                         f"{offload_planner.WHOLE_STAGES}")
    if stage_layers is not None and pipeline is None:
        raise ValueError(f"stage_layers={list(stage_layers)} needs a pipeline")
    if pipeline is not None and (loss is not loss_fn or frozen is not None):
        raise ValueError("a pipelined step computes its own next-token loss: no loss= or frozen=")


@dataclasses.dataclass(frozen=True)
class _Shardings:
    """Where the step's inputs and outputs live (all None without a mesh or offload)."""

    params: Any = None
    opt: Any = None
    batch: Any = None
    replicated: Any = None
    frozen: tuple = ()
    split: tuple[int, int] | None = None


def _shardings(params, tx, mesh, rules, resolved, offload: OffloadOptions, reduction, frozen) -> _Shardings:
    if mesh is None and not offload.state_on_host:
        return _Shardings()
    if mesh is None:  # offloading on one device: a sharding of its own, for the memory kinds
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        params_sharding, replicated = jax.tree.map(lambda _: one, params), one
        batch_sharding, frozen_sharding = None, () if frozen is None else (None,)
    else:
        params_sharding = model_shardings(params, mesh, rules)
        replicated = NamedSharding(mesh, PartitionSpec())
        batch_sharding = NamedSharding(mesh, rules_lib.logical_to_spec(BATCH_AXES, resolved))
        frozen_sharding = () if frozen is None else (model_shardings(frozen, mesh, rules),)
    opt_sharding = like_params(jax.eval_shape(tx.init, params), params, params_sharding, replicated)
    if reduction is not None:  # the carried residuals: per replica, split over data
        opt_sharding = reduction_lib.state_shardings(reduction, opt_sharding, params_sharding, mesh)
    split = None
    if offload.state_on_host:
        params_sharding, opt_sharding, split = _offloaded_shardings(params, tx, offload, params_sharding,
                                                                    opt_sharding)
    return _Shardings(params_sharding, opt_sharding, batch_sharding, replicated, frozen_sharding, split)


def _step(source: gradients.GradFn, replicas: gradients.Replicas, tx, mesh, offload: OffloadOptions,
          shardings: _Shardings, execution: Execution, moe=None) -> Callable:
    """``(params, opt_state, batch, *frozen) -> (params, opt_state, metrics)``: the loss,
    gradients and statistics from ``source`` (per replica where ``replicas`` asks for it),
    then the update. A MoE model (``moe``, its ``MoEConfig``) adds its metrics
    (``jaxpar.models.moe.step_metrics``), and with ``router="sigmoid_bias"`` its router
    biases take their own step from the statistics (``update_router_biases``) rather than
    the optimizer's."""
    bias_rate = moe.bias_rate if moe is not None and moe.router == "sigmoid_bias" else None
    per_replica = replicas != gradients.Replicas()
    compressed = replicas.reduction is not None and replicas.reduction.compressed
    # DCT's carried state in host memory (offload.optimizer=host) is exchanged on the
    # device: each replica's residuals are fetched with its gradients and stored back
    carried_on_host = compressed and offload.optimizer == "host"
    if per_replica:
        state_sharding = shardings.opt[0] if compressed else None
        if carried_on_host:
            state_sharding = jax.tree.map(lambda s: s.with_memory_kind("device"), state_sharding)
        combined = gradients.over_replicas(source, replicas, mesh, shardings.params, state_sharding)

    @use_execution(execution)  # bound at trace time, whatever the caller's context
    def step(params, opt_state, batch, *frozen):
        measured = {}
        if per_replica:
            state = opt_state[0] if compressed else None
            if carried_on_host:
                state = jax.tree.map(to_device, state)
            value, grads, stats, state, measured = combined(params, state, batch, *frozen)
            if compressed:
                opt_state = (jax.tree.map(to_host, state) if carried_on_host else state, *opt_state[1:])
        else:
            value, grads, stats = source(params, batch, *frozen)
        # a MoE model's metrics (none through a loss of the caller's own); not the
        # optimizer's extra arguments, as the noise scale's norms in `measured` are
        routing = moe_lib.step_metrics(stats["moe"], moe) if "moe" in stats else {}
        if bias_rate is not None and "moe" in stats:
            grads, biases = moe_lib.update_router_biases(params, grads, stats["moe"], bias_rate)
        if replicas.measure:
            measured["grad_sq_big"] = offload_state.squared_norm(grads)
        # the noise scale's norms reach a transformation that reads them (AdaScale's)
        if offload.state_on_host:
            params, opt_state, norm = offload_state.update(tx, offload, grads, opt_state, params, measured)
        else:
            updates, opt_state = optax.with_extra_args_support(tx).update(grads, opt_state, params, **measured)
            params, norm = optax.apply_updates(params, updates), optax.tree.norm(grads)
        if bias_rate is not None and "moe" in stats:
            params = moe_lib.with_router_biases(params, biases)
        adascale = adascale_lib.state_of(opt_state)
        if adascale is not None:  # scalars, on the host with offload.optimizer=host
            measured |= {"lr": to_device(adascale.rate), "adascale_gain": to_device(adascale.gain),
                         "adascale_progress": to_device(adascale.progress)}
        return params, opt_state, {"loss": value, "grad_norm": norm, **measured, **routing}

    return step


def _offloaded_shardings(params, tx, offload: OffloadOptions, params_sharding, opt_sharding):
    """The parameters' and optimizer state's shardings under ``offload``: as stored
    (``Split`` stacked leaves with ``0 < resident < L``), with the memory kinds
    ``jaxpar.offload.state.storage_shardings`` gives them; and ``TrainStep.split``."""
    stacked = [x.shape[0] for path, x in jax.tree.leaves_with_path(params) if offload_state.is_layers(path)]
    layers = stacked[0] if stacked else 0
    resident = offload_state.resident_count(offload, layers)
    params_kind = offload_state.HOST_KIND if offload.params == "host" else offload_state.DEVICE_KIND
    optimizer_kind = offload_state.HOST_KIND if offload.optimizer == "host" else offload_state.DEVICE_KIND
    params_sharding = offload_state.storage_shardings(
        params_sharding, resident=resident, layers=layers, resident_kind=offload_state.DEVICE_KIND,
        offloaded_kind=params_kind, rest_kind=params_kind)
    opt_sharding = offload_state.storage_shardings(
        opt_sharding, resident=resident, layers=layers, resident_kind=optimizer_kind,
        offloaded_kind=optimizer_kind, rest_kind=optimizer_kind)
    split = (resident, layers) if 0 < resident < layers else None
    if split is not None:  # the optimizer state mirrors the stored parameters' structure
        stored = jax.eval_shape(functools.partial(offload_state.split_layers, resident=resident, layers=layers),
                                params)
        assert jax.tree.structure(jax.eval_shape(tx.init, stored)) == jax.tree.structure(opt_sharding)
    return params_sharding, opt_sharding, split
