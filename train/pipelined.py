"""The transformer's loss and gradients through a pipeline schedule
(``jaxpar.pipeline``): the embedding before the first stage, the stacked layers split
into ``S = P V`` stages of ``L / S`` layers, the final norm, vocabulary projection and
cross-entropy after the last.

The batch ``[B, T]`` is cut into ``M`` microbatches of ``B / M`` rows (row ``r`` to
microbatch ``r % M``); the loss is the mean of the microbatch losses, as with gradient
accumulation. Inside the pipeline (``shard_map`` manual over ``pipe`` only) the other
mesh axes stay automatic, so data, FSDP, 1D tensor and Ulysses sequence parallelism
compose with it as they do without it.

Refused for now: ring (and rsa) attention over ``seq`` and the 2D tensor grid. Both
move data by ``ppermute``, and inside the schedule's per-device ``lax.switch`` (stage
0 runs a forward while stage 1 idles) XLA:CPU pairs a collective-permute across
devices in different branches: wrong values or a crash, measured. All-reduces and
all-to-alls, grouped per pipeline stage, are unaffected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import pipeline
from jaxpar.models.transformer import run_layers
from jaxpar.pipeline_schedule import Schedule
from jaxpar.sequence_parallel import current_options
from jaxpar.train.step import cross_entropy, microbatches


def unsupported_with_pipeline(mesh) -> str | None:
    """Why ``mesh`` (with the sequence options in force) cannot run the pipeline yet, or None."""
    seq = mesh.shape.get("seq", 1)
    if seq > 1 and current_options().impl != "ulysses":
        return (f"pipeline parallelism with seq={seq} needs the ulysses attention for now "
                f"(not {current_options().impl!r}: its ppermutes cannot run inside the schedule)")
    if mesh.shape.get("tensor_row", 1) > 1:
        return "pipeline parallelism with a 2D tensor grid is not supported yet (SUMMA's ppermutes)"
    return None


def loss_and_grads(graphdef, params, batch: dict, schedule: Schedule, mesh):
    """``(loss, grads)`` of the model ``nnx.merge(graphdef, params)`` on ``batch`` (the
    train step's keys, each ``[B, T]``), ``grads`` shaped like ``params``."""
    model = nnx.merge(graphdef, params)
    cfg, S, M = model.cfg, schedule.devices * schedule.virtual, schedule.microbatches
    if cfg.layers % S:
        raise ValueError(f"{cfg.layers} layers do not split into pipe x virtual stages = "
                         f"{schedule.devices} x {schedule.virtual} = {S}")
    unsupported = unsupported_with_pipeline(mesh)
    if unsupported:
        raise ValueError(unsupported)
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

    def embed(rest):
        return microbatches(shell(rest).embed_tokens(batch["inputs"], positions), M)

    def stage(w, x, side):
        return run_layers(cfg, layers_def, w, x, side["positions"], side.get("segment_ids"))

    def head(rest, x, side):
        return cross_entropy(shell(rest).logits(x), side["targets"], side["mask"])

    x, embed_vjp = jax.vjp(embed, rest)
    stages = jax.tree.map(lambda w: w.reshape(S, cfg.layers // S, *w.shape[1:]), layer_state)
    loss, (g_stages, g_head, g_x) = pipeline.value_and_grad(stage, head, stages, rest, x, side,
                                                            schedule, mesh=mesh)
    g_layers = jax.tree.map(lambda g: g.reshape(cfg.layers, *g.shape[2:]), g_stages)
    g_rest = jax.tree.map(jnp.add, g_head, embed_vjp(g_x)[0])
    _, grads = nnx.split(nnx.merge(split_def, g_layers, g_rest))
    return loss, grads
