"""The transformer's loss and gradients through a pipeline schedule
(``jaxpar.parallel.pipeline``): the stacked layers split into ``S = P V`` stages of ``L / S``
layers (or ``stage_layers[s]``, uneven stages, below); the token embedding before the
schedule (every ``pipe`` device, see ``jaxpar.parallel.pipeline.value_and_grad`` for
why), the final norm, vocabulary projection and cross-entropy on the last stage.

The batch ``[B, T]`` is cut into ``M`` microbatches of ``B / M`` rows (row ``r`` to
microbatch ``r % M``); each microbatch's loss (the mean over its tokens) is weighted by
its share of the batch's counted tokens (``jaxpar.train.gradients.token_shares``), as with
gradient accumulation: the loss is the whole batch's token-weighted mean. Inside the
pipeline (``shard_map`` manual over ``pipe`` only) the other mesh axes stay
automatic, so data, FSDP, tensor (1D and 2D) and sequence parallelism
compose with it as they do without it. Every ``pipe`` device holds the embedding,
final norm and head parameters (``pipe`` is not in their sharding), as Megatron-LM
keeps the tied embedding on both the first and the last stage; their gradients are
summed over ``pipe`` once per step.

The stacked layers are stored device-major (``storage_order``): device ``p``'s block
of the ``layers`` axis (split over ``pipe``) holds its stages ``p, P + p, ...`` in turn,
so a step reads each device's stages where they lie. With one stage per device that is
the model's order; with interleaved virtual stages it is not, and the train step keeps
the parameters (and the optimizer state) so between steps, putting them in model order
for checkpoints and evaluation (``jaxpar.train.step.TrainStep.in_model_order``).

Uneven stages (``stage_layers``, ``pipeline.stage_layers``: a slower device, or the
first and last stages that also run the embedding and the head, given fewer layers).
One SPMD program gives every device the same shapes, so each stage is stored padded to
the most loaded one's ``Lmax`` layers: the stored ``layers`` axis is ``[P V Lmax]``,
device-major as above, stage ``s``'s layers first in its block of ``Lmax`` and zeros
after them (``storage_order`` marks those positions -1). A stage runs its first
``stage_layers[s]`` layers and skips the rest (``masked_layers``; a tick lasts as long
as its slowest device, so skipping is what lets a slower device keep pace with fewer
layers): the padding changes no value and no gradient, its parameters' gradients are exactly zero, so AdamW keeps
them zero (zero moments, zero decay). Checkpoints stay the model's ``[L, ...]``
(``to_model`` drops the padding, ``to_storage`` adds it), so a run resumes under other
``stage_layers``, or even ones. The cost is memory: every ``pipe`` device holds ``V
Lmax`` layers of parameters and optimizer state, ``P V Lmax - L`` of them padding in
all (``profile_fields``' ``pipeline_padding_bytes``). The model-order layers stay split
over ``pipe`` as the rules place them, so ``L`` must still divide by ``P``.

Ring (and rsa) attention over ``seq`` and the 2D tensor grid (SUMMA) move data by
``ppermute`` inside a stage, which the schedule's per-device branches cannot hold; with
either, the pipeline runs in lockstep (``jaxpar.parallel.pipeline.value_and_grad``): same
results and memory, a forward plus a backward per mixed tick.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.layout import stages_permute
from jaxpar.offload.fetch import to_device
from jaxpar.parallel import pipeline
from jaxpar.placement import rules as rules_lib
from jaxpar.models.transformer import ACT_BTD, Remat, run_layers, run_layers_and_aux
from jaxpar.parallel.pipeline_schedule import Schedule
from jaxpar.placement.execution import current
from jaxpar.placement.sharding import auto_axes
from jaxpar.train.gradients import GradFn, microbatches, token_shares
from jaxpar.train.losses import head_loss


def needs_lockstep(mesh) -> bool:
    """Whether a stage on ``mesh`` (with the sequence options in force) communicates by
    ``ppermute``: ring or rsa attention over ``seq``, SUMMA over the 2D tensor grid."""
    return stages_permute(mesh.shape.get("seq", 1), current().sequence.impl, mesh.shape.get("tensor_row", 1) > 1)


def check_stage_layers(stage_layers, layers: int, devices: int | None = None, virtual: int = 1) -> None:
    """Raises a one-line ValueError naming ``stage_layers`` (``pipeline.stage_layers``)
    where it cannot split ``layers``: an entry below 1, a sum other than ``layers``,
    and, given the mesh (``devices`` on ``pipe``, ``virtual`` stages each), a count
    other than ``devices x virtual`` or ``layers`` not dividing over ``devices`` (the
    model-order layers, what checkpoints keep, stay split over ``pipe``)."""
    shown = f"pipeline.stage_layers={list(stage_layers)}"
    bad = [n for n in stage_layers if n < 1]
    if bad:
        raise ValueError(f"{shown} has an entry of {bad[0]}: every stage needs at least one layer")
    if sum(stage_layers) != layers:
        raise ValueError(f"{shown} sums to {sum(stage_layers)} layers, but model.layers={layers}")
    if devices is None:
        return
    if len(stage_layers) != devices * virtual:
        raise ValueError(f"{shown} has {len(stage_layers)} entries for mesh.pipe x pipeline.virtual_stages "
                         f"= {devices} x {virtual} = {devices * virtual} stages")
    if layers % devices:
        raise ValueError(f"{shown}: model.layers={layers} does not divide over mesh.pipe={devices}, and "
                         "checkpoints keep the model's layers split over pipe")


def stage_sizes(schedule: Schedule, layers: int, stage_layers=None) -> tuple[int, ...]:
    """Layers per stage ``s = 0 .. S - 1``: ``stage_layers`` (checked), or ``L / S`` each."""
    P, V = schedule.devices, schedule.virtual
    if isinstance(stage_layers, str):
        raise ValueError(f"stage_layers={stage_layers!r}: give the layers per stage (resolve 'auto' first)")
    if stage_layers is not None:
        check_stage_layers(stage_layers, layers, P, V)
        return tuple(int(n) for n in stage_layers)
    if layers % (P * V):
        raise ValueError(f"{layers} layers do not split into pipe x virtual stages = {P} x {V} = {P * V}")
    return (layers // (P * V),) * (P * V)


def stored_layout(schedule: Schedule, layers: int, stage_layers=None) -> np.ndarray:
    """``[P, V, Lmax]`` int: the model layer each stored position holds, -1 for padding.
    Position ``[p, v, l]`` is stage ``v P + p``'s layer ``l``: its first
    ``stage_layers[s]`` positions hold its layers in model order."""
    P, V = schedule.devices, schedule.virtual
    sizes = stage_sizes(schedule, layers, stage_layers)
    starts = np.cumsum((0, *sizes))
    layout = np.full((P, V, max(sizes)), -1)
    for s, n in enumerate(sizes):
        layout[s % P, s // P, :n] = np.arange(starts[s], starts[s] + n)
    return layout


def storage_order(schedule: Schedule, layers: int, stage_layers=None) -> np.ndarray | None:
    """Which model layer each position of the stored ``layers`` axis holds under
    ``schedule``: ``[P V Lmax]`` int, device-major (device ``p``'s ``V Lmax`` positions
    hold its stages ``v P + p`` for ``v = 0 .. V - 1``, each padded to ``Lmax``
    layers), -1 at a padded position; or None where that is the model's order (even
    stages, ``V = 1``)."""
    order = stored_layout(schedule, layers, stage_layers).reshape(-1)
    return None if np.array_equal(order, np.arange(layers)) else order


def _is_layers(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def to_storage(tree, order):
    """``tree`` (parameters, or any state holding copies of them such as Adam's moments)
    with every leaf under ``layers`` (``[L, ...]``) from model order into ``order`` (a
    sequence of layer indices, -1 for a padded position). Padding is zeros rather than
    a copy of a layer: with zero gradients AdamW then leaves it zero, moments and all."""
    order = np.asarray(order)
    take, padded = np.maximum(order, 0), order < 0

    def store(x):
        x = x[take]
        if not padded.any():
            return x
        return jnp.where(padded.reshape(-1, *[1] * (x.ndim - 1)), jnp.zeros((), x.dtype), x)

    return jax.tree.map_with_path(lambda path, x: store(x) if _is_layers(path) else x, tree)


def to_model(tree, order):
    """The inverse of ``to_storage``: stored ``layers`` leaves back in model order
    (``[L, ...]``, the padding dropped)."""
    order = np.asarray(order)
    where = np.argsort(order, kind="stable")[int((order < 0).sum()):]  # model layer l's position
    return jax.tree.map_with_path(lambda path, x: x[where] if _is_layers(path) else x, tree)


def masked_layers(cfg, layers_def, layer_state, x, positions, segment_ids, count, *, lockstep: bool,
                  remat: Remat = Remat()):
    """The first ``count`` (an int32 scalar, traced) of a stage's stacked layers
    (``layer_state`` leaves ``[Lmax, ...]``) over ``x [B, T, D]``; the others pass ``x``
    through unchanged, and their parameters get zero gradients. ``(x, term, stats)`` as
    ``run_stage`` returns them, a skipped layer's statistics zeros.

    A skipped layer is a ``lax.cond``: it is not computed (the point of giving a stage
    fewer layers), and the cond's VJP gives its parameters exact zeros. In ``lockstep``
    (a layer that communicates by ``ppermute``, ``needs_lockstep``) every device must run
    the same collectives, so the layer runs everywhere and ``where`` keeps its input:
    the padding's parameters are finite (zeros as stored), so the zero cotangent ``where``
    gives the layer makes zero gradients too (a NaN there would not: ``0 * NaN``).
    """
    def run(layer, x):  # one layer, remat as every stacked layer (run_layers)
        x, term, stats = run_stage(cfg, layers_def, jax.tree.map(lambda w: w[None], layer), x, positions,
                                   segment_ids, remat)
        return x, term, jax.tree.map(lambda s: s[0], stats)

    def skip(layer, x):
        return x, jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, stats_shape)

    def body(carry, scanned):
        (x, total), (layer, i) = carry, scanned
        if lockstep:
            y, term, stats = run(layer, x)
            kept = i < count
            return (jnp.where(kept, y, x), total + jnp.where(kept, term, 0.0)), \
                jax.tree.map(lambda s: jnp.where(kept, s, 0), stats)
        y, term, stats = jax.lax.cond(i < count, run, skip, layer, x)
        return (y, total + term), stats

    first = jax.tree.map(lambda w: w[0], layer_state)
    stats_shape = jax.eval_shape(run, first, x)[2]
    Lmax = jax.tree.leaves(layer_state)[0].shape[0]
    (x, term), stats = jax.lax.scan(body, (x, jnp.zeros((), jnp.float32)), (layer_state, jnp.arange(Lmax)))
    return x, term, stats


def run_stage(cfg, layers_def, layer_state, x, positions, segment_ids, remat: Remat = Remat()):
    """A stage's stacked layers over ``x``: ``(x, term, stats)``, a MoE model's loss term
    and routing statistics ``[L, 3, E]`` (``run_layers_and_aux``), a dense model's
    ``0.0`` and ``()``."""
    if cfg.moe is None:
        return run_layers(cfg, layers_def, layer_state, x, positions, segment_ids, remat=remat), \
            jnp.zeros((), jnp.float32), ()
    x, aux = run_layers_and_aux(cfg, layers_def, layer_state, x, positions, segment_ids, remat=remat)
    return x, aux.loss, aux.stats


def loss_and_grads(graphdef, params, batch: dict, schedule: Schedule, mesh, stage_layers=None):
    """``(loss, grads, stats)`` of the model ``nnx.merge(graphdef, params)`` on ``batch``
    (the train step's keys, each ``[B, T]``), ``grads`` shaped like ``params``, ``stats``
    as ``jaxpar.train.losses.loss_and_stats``'s summed over the microbatches (a MoE
    model's ``{"moe": [L, 3, E]}``, ``{}``). The stacked layers of ``params`` (and of
    ``grads`` and ``stats``) are in ``storage_order`` for ``stage_layers`` (None: even
    stages), padded where those are uneven (a padding layer's statistics zeros)."""
    model = nnx.merge(graphdef, params)
    cfg, M = model.cfg, schedule.microbatches
    layout = stored_layout(schedule, cfg.stacked_layers, stage_layers)  # [P, V, Lmax]
    counts = (layout >= 0).sum(axis=-1)  # [P, V]: each stage's real layers
    lockstep = needs_lockstep(mesh)
    split_def, layer_state, rest = nnx.split(model, nnx.PathContains("layers"), ...)
    layers_def, _ = nnx.split(model.layers)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), layer_state)

    def shell(rest):  # the model around its layers: embedding, final norm, head
        return nnx.merge(split_def, shapes, rest)

    B, T = batch["inputs"].shape
    positions = batch.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    side = {"positions": positions, "targets": batch["targets"],
            "mask": batch.get("mask", jnp.ones((B, T), jnp.int32))}
    if batch.get("segment_ids") is not None:
        side["segment_ids"] = batch["segment_ids"]
    side = jax.tree.map(lambda x: microbatches(x, M), side)
    side["share"] = token_shares(side["mask"])  # [M]

    def embed(rest, tokens, side):
        return shell(rest).embed_tokens(tokens, side["positions"])

    def stage(w, x, side, count=None):
        if count is None:
            x, term, stats = run_stage(cfg, layers_def, w, x, side["positions"], side.get("segment_ids"),
                                       model.remat)
        else:
            x, term, stats = masked_layers(cfg, layers_def, w, x, side["positions"], side.get("segment_ids"),
                                           count, lockstep=lockstep, remat=model.remat)
        return x, side["share"] * term, stats  # the term weighted as the head's loss

    def head(rest, x, side):
        return side["share"] * head_loss(shell(rest), x, side["targets"], side["mask"])

    # Host-resident parameters (jaxpar.offload): the stages fetch their layers inside the
    # schedule as the model's layer loop does; the parts around the layers (embedding,
    # final norm, head: a few MB) are fetched once per step, so their gradients, which
    # the last stage's branch and the others' must agree on, are the device's.
    rest = jax.tree.map(to_device, rest)
    # Stored device-major: [P V Lmax, ...] -> [P, V, Lmax, ...] moves nothing between devices.
    stages = jax.tree.map(lambda w: w.reshape(*layout.shape, *w.shape[1:]), layer_state)
    even = bool((counts == layout.shape[-1]).all())
    loss, (g_stages, g_rest), stats = pipeline.value_and_grad(
        embed, stage, head, stages, rest, microbatches(batch["inputs"], M), side, schedule, mesh=mesh,
        lockstep=lockstep, stage_consts=None if even else jnp.asarray(counts, jnp.int32))
    g_layers = jax.tree.map(lambda g: g.reshape(layout.size, *g.shape[3:]), g_stages)
    _, grads = nnx.split(nnx.merge(split_def, g_layers, g_rest))
    # [P, V, Lmax, 3, E] -> [P V Lmax, 3, E]: in the stored layers' order, padding (zeros) and all
    stats = jax.tree.map(lambda s: s.reshape(layout.size, *s.shape[3:]), stats)
    return loss, grads, ({} if cfg.moe is None else {"moe": stats})


def source(graphdef, schedule: Schedule, mesh, stage_layers, params_sharding) -> GradFn:
    """The step's gradient source through ``schedule`` (``jaxpar.train.gradients``):
    ``loss_and_grads`` of jaxpar's own model, which, as ``loss_fn`` does, runs on an
    Explicit mesh with the axes made Auto, its ``shard_map`` on the mesh in force there."""
    def run(params, batch):
        context = jax.sharding.get_abstract_mesh()
        # inside another shard_map (a data replica's, jaxpar.train.gradients.over_replicas)
        # or on Explicit axes, the schedule's shard_map runs on the mesh in force there
        on = context if mesh.explicit_axes or (not context.empty and context.manual_axes) else mesh
        return loss_and_grads(graphdef, params, batch, schedule, on, stage_layers)

    return auto_axes(run, out_sharding=(jax.sharding.PartitionSpec(), params_sharding, jax.sharding.PartitionSpec()))


def profile_fields(schedule: Schedule, state, model_cfg, mesh, rules, batch_size: int, seq_len: int,
                   stage_layers=None) -> dict:
    """What the compile-only profiler adds for a pipelined step.

    ``pipeline_bubble`` is counted from the schedule actually built (idle stage-ticks
    over all stage-ticks), ``pipeline_bubble_theory`` is ``(P-1)/(VM+P-1)``. The
    compiled program is one SPMD program, so its ``temp_bytes`` is the same on every
    device, with the stash sized for the busiest one; ``pipeline_stages`` gives what
    each ``pipe`` device actually holds: its stages and their layers (``layers``, as
    ``stage_layers`` gives them, or the even split), its stored layers' parameter bytes
    (``V Lmax`` layers, padding included; from ``state["params"]``, abstract arrays with
    their shardings, a layer's bytes as one device holds them), the padded layers among
    them (``padding_layers``) and what those cost in parameters and optimizer state
    (``padding_bytes``, from ``state["opt_state"]``'s stacked leaves too), the most
    microbatches whose stage input it keeps at once, and their bytes (``[B/M, T, D]`` in
    the compute dtype, split as the rules lay the activations out).
    ``pipeline_padding_bytes`` is the padding's parameters and optimizer state summed
    over the ``pipe`` devices, ``(P V Lmax - L)`` layers' worth (0 for even stages): what
    uneven stages cost in memory over storing each stage's own layers only.
    """
    P, V, M = schedule.devices, schedule.virtual, schedule.microbatches
    sizes = stage_sizes(schedule, model_cfg.stacked_layers, stage_layers)
    held = V * max(sizes)  # stored layers per pipe device
    param_layer, opt_layer = _layer_bytes(state["params"]), _layer_bytes(state["opt_state"])
    spec = rules_lib.logical_to_spec(ACT_BTD, rules)
    ways = [math.prod(mesh.shape[a] for a in rules_lib.as_tuple(axes)) for axes in spec]
    shape = (batch_size // M, seq_len, model_cfg.dim)
    stage_input = math.prod(n // w for n, w in zip(shape, ways)) * model_cfg.compute_dtype.itemsize
    in_flight = schedule.in_flight()

    def device(p):
        layers = [sizes[v * P + p] for v in range(V)]
        padding = held - sum(layers)
        return {"device": p, "stages": [v * P + p for v in range(V)], "layers": layers,
                "layer_parameter_bytes": held * param_layer, "padding_layers": padding,
                "padding_bytes": padding * (param_layer + opt_layer),
                "in_flight": int(in_flight[p]), "stage_input_bytes": int(in_flight[p]) * stage_input}

    return {
        "pipeline_schedule": schedule.kind,
        "pipeline_microbatches": M,
        "pipeline_virtual_stages": V,
        "pipeline_stage_layers": list(sizes),
        "pipeline_bubble": schedule.bubble(),
        "pipeline_bubble_theory": schedule.bubble_theory(),
        "pipeline_padding_bytes": (P * held - model_cfg.stacked_layers) * (param_layer + opt_layer),
        "pipeline_stages": [device(p) for p in range(P)],
    }


def _layer_bytes(tree) -> int:
    """One stacked layer's bytes on one device: over the leaves under ``layers`` (abstract
    arrays with shardings), a shard's size without its ``layers`` axis (split over
    ``pipe``; the other axes' splits kept)."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if _is_layers(path):
            total += math.prod(x.sharding.shard_shape(x.shape)[1:]) * x.dtype.itemsize
    return total
