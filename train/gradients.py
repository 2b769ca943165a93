"""The parts a train step's loss and gradients are built from (``make_train_step``).

A *gradient function* maps ``(params, batch, *frozen)`` to ``(loss, grads, stats)``:
``stats`` a dict of float32 arrays that are sums over the batch's rows (a MoE model's
routing statistics, ``jaxpar.train.losses.loss_and_stats``; ``{}`` otherwise), added over
microbatches and ``psum``-ed over replicas beside the gradient, whatever reduction the
gradient takes. The step composes one from parts, each a small function:

* a source, how a batch becomes a loss: ``plain`` (the model's loss under
  ``jax.value_and_grad``) or through a pipeline schedule (``jaxpar.train.pipelined.source``);
* ``accumulated``: the source over ``k`` microbatches, each weighted by its share of
  the batch's counted tokens;
* ``over_replicas``: the source run by each ``data`` replica on its own rows under one
  ``shard_map`` manual over ``data`` (the other mesh axes stay automatic, so FSDP,
  tensor and sequence sharding work inside a replica as without it), then the replicas
  combined as ``Replicas`` says: how (the token-weighted mean, Adasum, DCT top-k:
  ``jaxpar.hetero.reduction``), over which rows (HetSeq's unequal rows per replica,
  ``jaxpar.train.weighted``: a data-dependent count of microbatches) and what the step
  also measures (the noise scale's per-replica squared norm, ``jaxpar.train.noise_scale``).
  Without any of those the step needs no replica part: XLA all-reduces the gradient of
  the whole batch's loss itself.

``over_replicas`` is the one per-replica path: every feature that needs each replica's
own gradient is an option of it, not a ``shard_map`` of its own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.hetero import reduction as reduction_lib
from jaxpar.offload import state as offload_state
from jaxpar.offload.fetch import to_device
from jaxpar.placement.execution import current, use_execution
from jaxpar.placement.sharding import auto_axes

GradFn = Callable[..., tuple[jax.Array, Any, dict]]  # (params, batch, *frozen) -> (loss, grads, stats)
AXIS = reduction_lib.AXIS


def plain(loss: Callable, graphdef) -> GradFn:
    """``loss(model, batch, *frozen)``'s value and gradient with respect to the model's
    parameters (``nnx.merge(graphdef, params)``), and its statistics: ``loss`` returns a
    scalar (no statistics) or ``(scalar, stats)`` (``jaxpar.train.losses.loss_and_stats``)."""
    def with_stats(p, batch, *frozen):
        out = loss(nnx.merge(graphdef, p), batch, *frozen)
        return out if isinstance(out, tuple) else (out, {})

    def grad_fn(params, batch, *frozen):
        (value, stats), grads = jax.value_and_grad(with_stats, has_aux=True)(params, batch, *frozen)
        return value, grads, stats

    return grad_fn


def microbatches(x: jax.Array, count: int) -> jax.Array:
    """``[B, ...] -> [count, B / count, ...]``; microbatch ``j`` holds rows ``j, j + count,
    ...``, so each device's rows stay on it under data parallelism."""
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


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


def accumulated(grad_fn: GradFn, count: int) -> GradFn:
    """``grad_fn`` over ``count`` microbatches of the batch (``microbatches``), each
    weighted by its share of the counted tokens (``token_shares``): the loss and
    gradients of the whole batch's token-weighted mean, whatever ``count``, and the
    microbatches' statistics summed. Each sum is made where its gradient lives: a
    host-resident parameter's on the host."""
    def run(params, batch, *frozen):
        micro = jax.tree.map(lambda x: microbatches(x, count), batch)
        mask = micro.get("mask")
        shares = jnp.full((count,), 1 / count, jnp.float32) if mask is None else token_shares(mask)

        def body(carry, xs):
            micro, share = xs
            value, grads, stats = grad_fn(params, micro, *frozen)
            return offload_state.accumulate(carry, (value, grads), share), stats

        zeros = (jnp.zeros((), jnp.float32), offload_state.zeros_like(params))
        (value, grads), stats = jax.lax.scan(body, zeros, (micro, shares))
        return value, grads, jax.tree.map(lambda s: s.sum(0), stats)

    return run


@dataclasses.dataclass(frozen=True)
class Replicas:
    """What the per-replica part does (``over_replicas``).

    reduction: how the replicas' gradients combine; None is the token-weighted mean (each
    replica's gradient times its share of the batch's counted tokens, summed: the plain
    step's gradient). rows: HetSeq's unequal rows (``data.batch_weights``): each replica's
    slot of rows holds its real rows first, and it runs as many microbatches of ``rows``
    rows as it has real rows for. measure: the step also returns ``grad_sq_small``, the
    mean over the replicas of each one's gradient's squared norm (the noise scale's small
    batch).
    """

    reduction: reduction_lib.Reduction | None = None
    rows: int | None = None
    measure: bool = False


def own_rows(grad_fn: GradFn, unit: int) -> Callable:
    """``(params, batch, *frozen) -> (loss, grads, stats, tokens)``: ``grad_fn`` over the
    real rows of one replica's slot ``batch`` (real rows first, then rows whose ``mask``
    is all zero) in microbatches of ``unit`` rows, as many as its real rows need (a
    ``fori_loop`` whose trip count is this replica's own), each weighted by its counted
    tokens: the token-weighted mean over the real rows, their statistics summed, and their
    counted tokens. Each sum is made where its gradient lives (as ``accumulated`` makes it)."""
    def run(params, batch, *frozen):
        counted = batch["mask"].sum(axis=1) > 0
        last = jnp.max(jnp.where(counted, jnp.arange(counted.shape[0]) + 1, 0))
        rows_of = lambda i: jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * unit, unit), batch)  # noqa: E731

        def microbatch(i, carry):
            total, tokens, grads, stats = carry
            rows = rows_of(i)
            count = rows["mask"].sum().astype(jnp.float32)
            value, g, s = grad_fn(params, rows, *frozen)
            return (total + count * value, tokens + count, offload_state.accumulate(grads, g, count),
                    jax.tree.map(jnp.add, stats, s))

        shapes = jax.eval_shape(lambda: grad_fn(params, rows_of(0), *frozen)[2])
        zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), offload_state.zeros_like(params),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        total, tokens, grads, stats = jax.lax.fori_loop(0, (last + unit - 1) // unit, microbatch, zeros)
        scale = 1.0 / jnp.maximum(tokens, 1.0)
        return total * scale, offload_state.scaled(grads, scale), stats, tokens

    return run


def over_replicas(grad_fn: GradFn, replicas: Replicas, mesh, params_sharding, state_sharding=None) -> Callable:
    """``(params, state, batch, *frozen) -> (loss, grads, stats, state, measured)``:
    ``grad_fn`` per ``data`` replica on its own rows (the module docstring), combined as
    ``replicas`` says, the statistics ``psum``-ed. ``state`` is DCT's carried state (``jaxpar.hetero.reduction.ResidualState``, its
    leaves split over ``data``; None otherwise), returned updated; ``measured`` holds
    ``grad_sq_small`` and ``batch_small`` with ``replicas.measure`` (else it is empty):
    the mean over the replicas of each one's squared gradient norm, and the batch that
    mean is one of, the harmonic mean of the replicas' real rows (each replica's squared
    norm is ``|G|^2 + tr(Sigma) / b_r`` in expectation: ``batch / replicas`` with equal
    rows, HetSeq's unequal rows too, whatever their shares at this step). The loss is the
    token-weighted mean over the replicas with the mean, else the mean of the replicas'
    losses. On an Explicit mesh it runs with the axes made Auto, as the model's loss does."""
    run = functools.partial(_per_replica, grad_fn, replicas, mesh)
    return auto_axes(run, out_sharding=(PartitionSpec(), params_sharding, PartitionSpec(), state_sharding,
                                        PartitionSpec()))


def _per_replica(grad_fn: GradFn, replicas: Replicas, mesh, params, state, batch, *frozen):
    on = jax.sharding.get_abstract_mesh() if mesh.explicit_axes else mesh
    rules = reduction_lib.without_axis(current().rules, AXIS)
    reduction, n = replicas.reduction, reduction_lib.replicas(mesh)

    def replica(params, state, batch, *frozen):
        with use_execution(rules=rules):  # inside, `data` is manual: activations name it no more
            if replicas.rows is not None:
                value, grads, stats, tokens = own_rows(grad_fn, replicas.rows)(params, batch, *frozen)
            else:
                value, grads, stats = grad_fn(params, batch, *frozen)
                tokens = batch["mask"].astype(jnp.float32).sum() if "mask" in batch else jnp.ones((), jnp.float32)
        measured = {}
        if replicas.measure:  # each replica's squared norm, and the small batch they measure
            rows = jnp.maximum((batch["mask"].sum(axis=1) > 0).sum(), 1).astype(jnp.float32)
            measured = {"grad_sq_small": jax.lax.pmean(offload_state.squared_norm(grads), AXIS),
                        "batch_small": 1 / jax.lax.pmean(1 / rows, AXIS)}
        if reduction is None:
            share = tokens / jnp.maximum(jax.lax.psum(tokens, AXIS), 1.0)
            value, grads = jax.lax.psum((share * value, jax.tree.map(lambda g: (share * g).astype(g.dtype), grads)),
                                        AXIS)
        else:
            value = jax.lax.pmean(value, AXIS)
            if reduction.compressed:
                # on the device: a host-resident parameter's gradient meets its residual there
                grads, state = reduction_lib.exchange(jax.tree.map(to_device, grads), state, reduction, n)
            else:
                grads = reduction_lib.adasum_over(grads, AXIS, n)
        return value, grads, jax.lax.psum(stats, AXIS), state, measured

    whole, split = PartitionSpec(), PartitionSpec(AXIS)
    compressed = reduction is not None and reduction.compressed
    state_spec = reduction_lib.ResidualState(split, split, whole) if compressed else None
    # check_vma off: a gradient taken inside with respect to a replicated input is the
    # replica's own (with it on, JAX would sum it over `data` by the transpose rule); and
    # JAX 0.10 crashes checking the varying-manual-axes types of own_rows' loop (a
    # segfault while linearising the layers' scan).
    return jax.shard_map(replica, mesh=on, in_specs=(whole, state_spec, split, *(whole,) * len(frozen)),
                         out_specs=(whole, whole, whole, state_spec, whole), axis_names={AXIS}, check_vma=False,
                         )(params, state, batch, *frozen)
