"""One jitted optimizer step, sharded by the rules: data parallelism and FSDP/ZeRO-3.

Parameters, gradients and optimizer state take the parameters' shardings (the
``embed`` dimension over ``fsdp`` under the default rules), the batch is split over
``data`` and ``fsdp``; XLA inserts the all-gathers and reduce-scatters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
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
from jaxpar.offload import state as offload_state
from jaxpar.offload.fetch import is_split, to_device, to_host
from jaxpar.ops import kernel_ops
from jaxpar.placement import rules as rules_lib
from jaxpar.kernels.dispatch import KernelOptions
from jaxpar.placement.execution import Execution, OffloadOptions, SequenceOptions, use_execution
from jaxpar.placement.sharding import auto_axes, like_params, model_shardings, use_mesh

Batch = dict[str, jax.Array]
BATCH_AXES = ("batch", "length")
# What the data loader gives, each int32 [B, T].
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "mask")


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy in float32.

    Args:
      logits: ``[B, T, V]``; targets: int ``[B, T]``; mask: ``[B, T]`` (1 = counted).
    """
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    # A masked sum rather than a gather: with the vocabulary split over `tensor`, each
    # device picks from its own slice and one [B, T] all-reduce combines them (Megatron's
    # vocab-parallel cross-entropy); the full [B, T, V] logits are never gathered.
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    picked = jnp.where(vocab == targets[..., None], logits, 0.0).sum(-1)
    return masked_mean(logz - picked, mask)


def masked_mean(losses: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The mean of per-token ``losses [B, T]`` over the tokens ``mask`` counts."""
    if mask is None:
        return losses.mean()
    mask = mask.astype(jnp.float32)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)


@auto_axes  # the model is written for Auto axes: on an Explicit mesh it runs with them Auto
def loss_fn(model: nnx.Module, batch: Batch) -> jax.Array:
    """Loss of ``model`` on a batch with ``inputs``, ``targets`` (int ``[B, T]``) and
    optionally ``positions``, ``segment_ids`` and ``mask`` (all ``[B, T]``)."""
    x = model.features(batch["inputs"], positions=batch.get("positions"),
                       segment_ids=batch.get("segment_ids"))
    return head_loss(model, x, batch["targets"], batch.get("mask"))


def head_loss(model: nnx.Module, x: jax.Array, targets: jax.Array,
              mask: jax.Array | None = None) -> jax.Array:
    """The mean next-token loss of the last layer's output ``x [B, T, D]``: final norm,
    vocabulary projection and cross-entropy. Under ``execution.loss`` "pallas" the projection
    and the cross-entropy run as one fused kernel (``jaxpar.ops.kernel_ops.token_losses``): the
    ``[B, T, V]`` logits never exist."""
    losses = kernel_ops.token_losses(model.final_norm(x), model.head_weight(), targets)
    if losses is None:
        return cross_entropy(model.logits(x), targets, mask)
    return masked_mean(losses, mask)


def token_shares(mask: jax.Array) -> jax.Array:
    """Each microbatch's weight in the batch's loss: ``mask [k, ...]`` (``k`` microbatches'
    masks, 1 = counted) -> ``[k]`` float32, the microbatch's counted tokens over the whole
    batch's (all zero when no token counts).

    A microbatch's loss is the mean over its own tokens (``masked_mean``); times its
    share, it contributes ``sum_i loss_i / total`` with ``total`` the whole batch's
    count, so the microbatches' weighted losses (and gradients) add up to the whole
    batch's token-weighted mean. The plain mean of the microbatch means is not that
    when masks (packing, documents) count different numbers of tokens per microbatch.
    Gradient accumulation and the pipeline (``jaxpar.train.pipelined``) both weight by it.
    """
    counts = mask.astype(jnp.float32).reshape(mask.shape[0], -1).sum(axis=1)
    return counts / jnp.maximum(counts.sum(), 1.0)


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


def microbatches(x: jax.Array, count: int) -> jax.Array:
    """``[B, ...] -> [count, B / count, ...]``; microbatch ``j`` holds rows ``j, j + count,
    ...``, so each device's rows stay on it under data parallelism."""
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


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
        from jaxpar.train import pipelined

        if self.split is not None:
            shardings = jax.tree.map(lambda x: x.sharding, state)
            out = jax.tree.map(lambda s: s.offloaded if is_split(s) else s, shardings, is_leaf=is_split)
            return _converter(offload_state.join_layers, out)(state)
        return self._reorder(state, pipelined.to_model)

    def in_storage_order(self, state):
        """The inverse of ``in_model_order``: a model-order state stored as the step keeps
        it (under offload: split and placed in the memories ``execution.offload`` says)."""
        from jaxpar.train import pipelined

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
            from jaxpar.train import pipelined

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
            from jaxpar.train import pipelined

            params = jax.eval_shape(functools.partial(pipelined.to_storage, order=self.layer_order), params)
        state = {"params": params, "opt_state": jax.eval_shape(self.tx.init, params)}
        if sharding is not None or self.params_sharding is None:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)

    def compile(self, model: nnx.Module, batch_size: int, seq_len: int):
        """Compiles the step for ``model``'s shapes without running it.

        ``model`` may be abstract (``nnx.eval_shape``), so a 1B model compiles on a
        laptop; ``.memory_analysis()`` of the result gives exact per-device bytes.
        """
        state = self.abstract_state(model, stored=True)
        params, opt_state = state["params"], state["opt_state"]
        token = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=self.batch_sharding)
        batch = dict.fromkeys(BATCH_KEYS, token)
        with self.context():
            return self.step.lower(params, opt_state, batch).compile()

    def __call__(self, params, opt_state, batch: Batch, *frozen):
        with self.context():
            return self.step(params, opt_state, batch, *frozen)


def _batch_axes(mesh, resolved) -> tuple[tuple[str, ...], int]:
    """The mesh axes the rules split the batch over, and how many ways in all."""
    axes = rules_lib.as_tuple(rules_lib.logical_to_spec(("batch",), resolved)[0])
    return axes, math.prod(mesh.shape[a] for a in axes)


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
    """Builds the jitted train step for ``model``'s structure on ``mesh`` (or one device).

    With ``grad_accum=k`` the batch ``[B, T]`` is split into ``k`` microbatches of
    ``B / k`` rows (row ``r`` goes to microbatch ``r % k``, so each device's rows stay
    on it) whose losses and gradients are summed, each weighted by its share of the
    batch's counted tokens (``token_shares``), inside the one jitted step: the loss and
    gradients of the whole batch's token-weighted mean, whatever ``k``.

    ``pipeline``: a ``jaxpar.parallel.pipeline_schedule.Schedule`` over the mesh's ``pipe`` axis;
    the step then runs the model through it (``jaxpar.train.pipelined``), with the
    stacked layers stored in the order it reads them (``TrainStep.layer_order``).
    ``stage_layers``: with ``pipeline``, the layers of each of its ``P V`` stages in
    stage order (summing to the model's layers, each at least 1); None: ``L / (P V)``
    each. Uneven stages are stored padded to the largest (``jaxpar.train.pipelined``).

    ``loss``: ``(model, batch) -> scalar`` (default ``loss_fn``, next-token
    cross-entropy), or ``(model, batch, frozen) -> scalar`` with ``frozen``.

    ``frozen``: an ``nnx.State`` (another model's, as a GliDe draft reads its target's
    embedding and LM head) that the loss reads and the step never trains. The step then
    takes it on every call, ``step(params, opt_state, batch, frozen)``, placed like
    parameters by its logical annotations. An argument rather than something the loss
    closes over: a closed-over array becomes a constant of the compiled step (the
    target's weights copied into its HLO), and no gradient is taken with respect to it
    nor update made. Give its value (or abstract state) here for its shardings.

    ``offload``: which state lives in host memory between steps (``jaxpar.offload``; the
    step's ``execution.offload``): with ``params="host"`` the model fetches each
    host-resident stacked layer ``prefetch`` layers ahead of its use and the embedding,
    final norm and head where it reads them (``jaxpar.offload.fetch``); with
    ``optimizer="host"`` the update runs on the host (``jaxpar.offload.state``). Neither
    composes with ``pipeline`` yet. ``TrainStep.init`` places the state so, on one device
    too (``params_sharding`` / ``opt_sharding`` then name the device and memory kind).

    ``weighted``: with ``data.batch_weights`` (``jaxpar.train.weighted``), the batch holds
    each data-parallel device's slot of rows, real rows first, and every device runs its
    own real rows in microbatches of ``weighted`` rows before one sum over the data axes:
    the loss and gradients of the token-weighted mean over all real rows.

    ``reduction``: how the ``data`` replicas' gradients combine
    (``jaxpar.hetero.reduction.Reduction``): None or the uncompressed mean is this program
    as it is (XLA's all-reduce of the batch's gradients); Adasum or ``dct_topk``
    compression computes each replica's gradient under ``shard_map`` over ``data`` (after
    its ``grad_accum`` microbatches) and reduces them explicitly, ``dct_topk``'s residuals
    carried in the optimizer state (``TrainStep.tx`` is then ``optax.chain(carried, tx)``).
    Needs a mesh; not with ``pipeline`` or ``offload`` yet.

    ``noise_scale``: the step also returns ``grad_sq_small``, the mean over the ``data``
    replicas of each one's gradient's squared norm, and ``grad_sq_big``, the batch
    gradient's (``jaxpar.hetero.reduction.value_grads_and_replica_norm``: each replica's
    gradient under ``shard_map``, token-weighted and summed, so the update is the plain
    step's): what ``jaxpar.train.noise_scale`` estimates the gradient noise scale from.
    Needs a mesh; not with ``pipeline``, ``offload``, ``weighted`` or another reduction.
    """
    graphdef, params = nnx.split(model)
    resolved = None if mesh is None else rules_lib.for_mesh(mesh, rules_lib.DEFAULT_RULES if rules is None else rules)
    offload = offload or OffloadOptions()
    execution = Execution(resolved, kernels or KernelOptions(), sequence, offload)
    offloading = offload.state_on_host
    layer_order = None
    reduction = None if reduction is None or reduction.is_mean else reduction
    if reduction is not None:
        if pipeline is not None or offloading or weighted is not None:
            raise ValueError(f"optimizer.reduction={reduction.kind} / compression={reduction.compression} does "
                             "not compose with a pipeline, offload or data.batch_weights yet: give the mean, "
                             "no compression")
        reduction_lib.check(reduction, mesh)
        tx = reduction_lib.with_state(tx, reduction, mesh)
    if noise_scale and (mesh is None or pipeline is not None or offloading or weighted is not None
                        or reduction is not None):
        raise ValueError("eval.noise_scale needs a mesh and the plain mean over data replicas: not with a "
                         "pipeline, offload, data.batch_weights or another reduction yet")
    if stage_layers is not None and pipeline is None:
        raise ValueError(f"stage_layers={list(stage_layers)} needs a pipeline")
    if pipeline is not None and offloading:
        raise ValueError("offload.params=host / offload.optimizer=host do not compose with a pipeline yet: "
                         "a stage's layers would have to be fetched inside the schedule's shard_map")
    if pipeline is not None:
        if loss is not loss_fn or frozen is not None:
            raise ValueError("a pipelined step computes its own next-token loss: no loss= or frozen=")
        from jaxpar.train import pipelined

        layer_order = pipelined.storage_order(pipeline, model.cfg.layers, stage_layers)
        stage_layers = None if stage_layers is None else tuple(int(n) for n in stage_layers)

    def pipelined_loss_and_grads(params, batch):
        from jaxpar.train import pipelined

        # jaxpar's own model, as in loss_fn: on an Explicit mesh it runs with the axes
        # made Auto (auto_axes below), its shard_maps on the mesh in force there.
        on = jax.sharding.get_abstract_mesh() if mesh.explicit_axes else mesh
        return pipelined.loss_and_grads(graphdef, params, batch, pipeline, on, stage_layers)

    def loss_and_grads(params, batch, *frozen):
        if weighted is not None:  # unequal rows per data device (data.batch_weights)
            from jaxpar.train import weighted as weighted_lib

            axes, _ = _batch_axes(mesh, resolved)
            return weighted_lib.loss_and_grads(loss, graphdef, params, batch, frozen, mesh=mesh, axes=axes,
                                               unit=weighted)
        if pipeline is not None:
            run = auto_axes(pipelined_loss_and_grads, out_sharding=(PartitionSpec(), params_sharding))
            return run(params, batch)
        return jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p), batch, *frozen))(params)

    def accumulated(params, batch, *frozen):
        micro = jax.tree.map(lambda x: microbatches(x, grad_accum), batch)
        mask = micro.get("mask")
        shares = (jnp.full((grad_accum,), 1 / grad_accum, jnp.float32) if mask is None
                  else token_shares(mask))

        def body(carry, xs):
            micro, share = xs
            value, grads = loss_and_grads(params, micro, *frozen)
            # each sum where its gradient lives: a host-resident parameter's on the host
            return offload_state.accumulate(carry, (value, grads), share), None

        zeros = (jnp.zeros((), jnp.float32), offload_state.zeros_like(params) if offloading
                 else jax.tree.map(jnp.zeros_like, params))
        total, _ = jax.lax.scan(body, zeros, (micro, shares))
        return total

    def reduced(params, opt_state, batch, *frozen):
        grad_fn = loss_and_grads if grad_accum == 1 else accumulated
        return reduction_lib.value_and_grads(grad_fn, reduction, mesh, params_sharding, opt_sharding,
                                             params, opt_state, batch, *frozen)

    def with_noise(params, batch, *frozen):
        grad_fn = loss_and_grads if grad_accum == 1 else accumulated
        return reduction_lib.value_grads_and_replica_norm(grad_fn, mesh, params_sharding, params, batch, *frozen)

    @use_execution(execution)  # bound at trace time, whatever the caller's context
    def step(params, opt_state, batch, *frozen):
        extra = {}
        if noise_scale:
            value, grads, small = with_noise(params, batch, *frozen)
            extra = {"grad_sq_small": small, "grad_sq_big": optax.tree.norm(grads, squared=True)}
        elif reduction is not None:
            value, grads, opt_state = reduced(params, opt_state, batch, *frozen)
        elif grad_accum == 1:
            value, grads = loss_and_grads(params, batch, *frozen)
        else:
            value, grads = accumulated(params, batch, *frozen)
        if offloading:
            params, opt_state, norm = offload_state.update(tx, offload, grads, opt_state, params)
            return params, opt_state, {"loss": value, "grad_norm": norm}
        # the noise scale's norms reach a transformation that reads them (AdaScale's)
        updates, opt_state = optax.with_extra_args_support(tx).update(grads, opt_state, params, **extra)
        params = optax.apply_updates(params, updates)
        adascale = adascale_lib.state_of(opt_state)
        if adascale is not None:
            extra |= {"lr": adascale.rate, "adascale_gain": adascale.gain, "adascale_progress": adascale.progress}
        return params, opt_state, {"loss": value, "grad_norm": optax.tree.norm(grads), **extra}

    donate_argnums = (0, 1) if donate else ()
    if mesh is None and not offloading:
        return TrainStep(graphdef, tx, jax.jit(step, donate_argnums=donate_argnums),
                         None, None, None, None, execution, loss, layer_order, stage_layers=stage_layers)
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
    if offloading:
        params_sharding, opt_sharding, split = _offloaded_shardings(params, tx, offload, params_sharding,
                                                                    opt_sharding)
    jitted = jax.jit(
        step,
        in_shardings=(params_sharding, opt_sharding, batch_sharding, *frozen_sharding),
        out_shardings=(params_sharding, opt_sharding, replicated),
        donate_argnums=donate_argnums,
    )
    return TrainStep(graphdef, tx, jitted, mesh, params_sharding, opt_sharding, batch_sharding,
                     execution, loss, layer_order, split, stage_layers)


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
