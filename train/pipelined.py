"""The transformer's loss and gradients through a pipeline schedule
(``jaxpar.parallel.pipeline``): the stacked layers split into ``S = P V`` stages of ``L / S``
layers; the token embedding before the schedule (every ``pipe`` device, see
``jaxpar.parallel.pipeline.value_and_grad`` for why), the final norm, vocabulary projection and
cross-entropy on the last stage.

The batch ``[B, T]`` is cut into ``M`` microbatches of ``B / M`` rows (row ``r`` to
microbatch ``r % M``); each microbatch's loss (the mean over its tokens) is weighted by
its share of the batch's counted tokens (``jaxpar.train.step.token_shares``), as with
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

from jaxpar.parallel import pipeline
from jaxpar.placement import rules as rules_lib
from jaxpar.models.transformer import ACT_BTD, run_layers
from jaxpar.parallel.pipeline_schedule import Schedule
from jaxpar.placement.execution import current
from jaxpar.train.step import head_loss, microbatches, token_shares


def needs_lockstep(mesh) -> bool:
    """Whether a stage on ``mesh`` (with the sequence options in force) communicates by
    ``ppermute``: ring or rsa attention over ``seq``, SUMMA over the 2D tensor grid."""
    ring = mesh.shape.get("seq", 1) > 1 and current().sequence.impl != "ulysses"
    return ring or mesh.shape.get("tensor_row", 1) > 1


def storage_order(schedule: Schedule, layers: int) -> np.ndarray | None:
    """Which model layer each position of the stored ``layers`` axis holds under
    ``schedule``: ``[L]`` int, device-major (device ``p``'s ``L / P`` positions hold its
    stages ``v P + p`` for ``v = 0 .. V - 1``, each ``L / S`` layers in model order), or
    None where that is the model's order (``V = 1``)."""
    P, V = schedule.devices, schedule.virtual
    if layers % (P * V):
        raise ValueError(f"{layers} layers do not split into pipe x virtual stages = {P} x {V} = {P * V}")
    if V == 1:
        return None
    model_layer = np.arange(layers).reshape(V, P, layers // (P * V))  # [v, p, l]
    return model_layer.transpose(1, 0, 2).reshape(-1)


def _is_layers(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def to_storage(tree, order):
    """``tree`` (parameters, or any state holding copies of them such as Adam's moments)
    with every leaf under ``layers`` (``[L, ...]``) from model order into ``order`` (a
    sequence of layer indices)."""
    order = np.asarray(order)
    return jax.tree.map_with_path(lambda path, x: x[order] if _is_layers(path) else x, tree)


def to_model(tree, order):
    """The inverse of ``to_storage``: stored ``layers`` leaves back in model order."""
    return to_storage(tree, np.argsort(order))


def loss_and_grads(graphdef, params, batch: dict, schedule: Schedule, mesh):
    """``(loss, grads)`` of the model ``nnx.merge(graphdef, params)`` on ``batch`` (the
    train step's keys, each ``[B, T]``), ``grads`` shaped like ``params``. The stacked
    layers of ``params`` (and of ``grads``) are in ``storage_order``."""
    model = nnx.merge(graphdef, params)
    P, V, M = schedule.devices, schedule.virtual, schedule.microbatches
    cfg, S = model.cfg, P * V
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

    def stage(w, x, side):
        return run_layers(cfg, layers_def, w, x, side["positions"], side.get("segment_ids"))

    def head(rest, x, side):
        return side["share"] * head_loss(shell(rest), x, side["targets"], side["mask"])

    # Stored device-major: [L, ...] -> [P, V, L / S, ...] moves nothing between devices.
    stages = jax.tree.map(lambda w: w.reshape(P, V, cfg.layers // S, *w.shape[1:]), layer_state)
    loss, (g_stages, g_rest) = pipeline.value_and_grad(
        embed, stage, head, stages, rest, microbatches(batch["inputs"], M), side, schedule, mesh=mesh,
        lockstep=needs_lockstep(mesh))
    g_layers = jax.tree.map(lambda g: g.reshape(cfg.layers, *g.shape[3:]), g_stages)
    _, grads = nnx.split(nnx.merge(split_def, g_layers, g_rest))
    return loss, grads


def profile_fields(schedule: Schedule, state, model_cfg, mesh, rules, batch_size: int, seq_len: int) -> dict:
    """What the compile-only profiler adds for a pipelined step.

    ``pipeline_bubble`` is counted from the schedule actually built (idle stage-ticks
    over all stage-ticks), ``pipeline_bubble_theory`` is ``(P-1)/(VM+P-1)``. The
    compiled program is one SPMD program, so its ``temp_bytes`` is the same on every
    device, with the stash sized for the busiest one; ``pipeline_stages`` gives what
    each ``pipe`` device actually holds: its stages, its layers' parameter bytes
    (``state["params"]``, abstract arrays with their shardings), the most microbatches
    whose stage input it keeps at once, and their bytes (``[B/M, T, D]`` in the compute
    dtype, split as the rules lay the activations out).
    """
    P, V, M = schedule.devices, schedule.virtual, schedule.microbatches
    layers = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state["params"]) if _is_layers(path)]
    layer_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in layers)
    spec = rules_lib.logical_to_spec(ACT_BTD, rules)
    ways = [math.prod(mesh.shape[a] for a in rules_lib.as_tuple(axes)) for axes in spec]
    shape = (batch_size // M, seq_len, model_cfg.dim)
    stage_input = math.prod(n // w for n, w in zip(shape, ways)) * model_cfg.compute_dtype.itemsize
    in_flight = schedule.in_flight()
    return {
        "pipeline_schedule": schedule.kind,
        "pipeline_microbatches": M,
        "pipeline_virtual_stages": V,
        "pipeline_bubble": schedule.bubble(),
        "pipeline_bubble_theory": schedule.bubble_theory(),
        "pipeline_stages": [
            {"device": p, "stages": [v * P + p for v in range(V)], "layer_parameter_bytes": layer_bytes,
             "in_flight": int(in_flight[p]), "stage_input_bytes": int(in_flight[p]) * stage_input}
            for p in range(P)],
    }
