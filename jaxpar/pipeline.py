"""One SPMD program that runs any pipeline schedule (``jaxpar.pipeline_schedule``).

The schedule is data: a table of (operation, microbatch, stage) per tick and device.
``value_and_grad`` scans over its ticks under ``shard_map`` over ``pipe``; at every tick
each device runs what its row says, a stage's forward or its backward (an explicit
``jax.vjp`` of the stage, recomputing it from the stashed stage input, so the
activations a device keeps are the stage inputs of the microbatches in flight: ``M``
for GPipe, at most ``P`` for 1F1B), then sends its output to the next device and its
input gradient to the previous one (``ppermute``, circular, so interleaved stages wrap
round). Which buffer slot every arrival, stash and read uses is worked out on the host
from the table, so the device loop only indexes.

Shapes: ``P`` devices on ``pipe``, ``V`` virtual stages each, ``S = P V`` stages,
``M`` microbatches of activations ``x [M, *A]``. Stage parameters are stacked on a
leading ``[S, ...]`` axis; stage ``s`` runs on device ``s % P``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.pipeline_schedule import BACKWARD, FORWARD, Schedule


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Host-side tables ``[ticks, P]`` (int32) that the device loop indexes, and the
    buffer sizes. ``slot`` is the stash slot of the op's stage input; ``read`` the
    receive slot its input (forward) or output gradient (backward) is read from;
    ``arrive_f``/``arrive_b`` the receive slot what arrives at the end of the tick is
    written to (-1: nothing arrives)."""

    op: np.ndarray
    microbatch: np.ndarray
    virtual: np.ndarray
    first: np.ndarray
    last: np.ndarray
    slot: np.ndarray
    read: np.ndarray
    arrive_f: np.ndarray
    arrive_b: np.ndarray
    stash_size: int
    recv_f_size: int
    recv_b_size: int


class _Slots:
    """A free list of buffer slots; records the most ever in use."""

    def __init__(self):
        self.free, self.size = [], 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.size += 1
        return self.size - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)


def plan(schedule: Schedule) -> _Plan:
    """Buffer slots for ``schedule``, by replaying it on the host."""
    T, P, S = schedule.ticks, schedule.devices, schedule.devices * schedule.virtual
    table = {name: np.full((T, P), -1, np.int32) for name in ("slot", "read", "arrive_f", "arrive_b")}
    stash = [_Slots() for _ in range(P)]
    recv_f, recv_b = [_Slots() for _ in range(P)], [_Slots() for _ in range(P)]
    stashed, waiting_f, waiting_b = {}, {}, {}  # (m, stage) -> slot
    for t in range(T):
        for p in range(P):
            op, m, s = schedule.op[t, p], schedule.microbatch[t, p], schedule.stage[t, p]
            if op == FORWARD:
                if s > 0:
                    table["read"][t, p] = slot = waiting_f.pop((m, s))
                    recv_f[p].give(slot)
                table["slot"][t, p] = stashed[m, s] = stash[p].take()
            elif op == BACKWARD:
                table["slot"][t, p] = slot = stashed.pop((m, s))
                stash[p].give(slot)
                if s < S - 1:
                    table["read"][t, p] = slot = waiting_b.pop((m, s))
                    recv_b[p].give(slot)
        for p in range(P):  # what this tick sends arrives at its end
            op, m, s = schedule.op[t, p], schedule.microbatch[t, p], schedule.stage[t, p]
            if op == FORWARD and s < S - 1:
                to = (p + 1) % P
                table["arrive_f"][t, to] = waiting_f[m, s + 1] = recv_f[to].take()
            elif op == BACKWARD and s > 0:
                to = (p - 1) % P
                table["arrive_b"][t, to] = waiting_b[m, s - 1] = recv_b[to].take()
    stage = schedule.stage
    return _Plan(
        op=schedule.op.astype(np.int32), microbatch=schedule.microbatch.astype(np.int32),
        virtual=np.where(stage >= 0, stage // P, 0).astype(np.int32),
        first=(stage == 0).astype(np.int32), last=(stage == S - 1).astype(np.int32),
        stash_size=max(1, max(s.size for s in stash)), recv_f_size=max(1, max(s.size for s in recv_f)),
        recv_b_size=max(1, max(s.size for s in recv_b)), **table)


def value_and_grad(
    stage_fn: Callable,
    head_fn: Callable,
    stage_params,
    head_params,
    x: jax.Array,
    side,
    schedule: Schedule,
    *,
    mesh,
    axis: str = "pipe",
):
    """Runs ``schedule``: the mean over microbatches ``m`` of
    ``head_fn(head_params, stage_{S-1}(... stage_0(x[m])), side[m])`` and its gradients.

    Args:
      stage_fn: ``(stage_params_s, a, side_m) -> a``, one stage (a chunk of layers),
        ``a`` of shape ``A``; ``side_m`` is microbatch ``m``'s slice of ``side``.
      head_fn: ``(head_params, a, side_m) -> scalar``, after the last stage (the loss).
      stage_params: pytree of arrays with leading ``[S, ...]``, stage ``s``'s parameters
        (``S = schedule.devices * schedule.virtual``).
      head_params: pytree, replicated over ``axis``.
      x: ``[M, *A]`` the first stage's inputs.
      side: pytree with leading ``[M]`` that stages and head read (targets, positions).
      schedule: from ``jaxpar.pipeline_schedule.build``; mesh: has ``axis`` of size
        ``schedule.devices``.

    Returns:
      ``(loss, (stage_grads [S, ...], head_grads, x_grads [M, *A]))``.
    """
    P, V, M = schedule.devices, schedule.virtual, schedule.microbatches
    if mesh.shape[axis] != P:
        raise ValueError(f"the schedule has {P} pipeline devices, the mesh {axis}={mesh.shape[axis]}")
    p_plan = plan(schedule)
    tables = {k: jnp.asarray(getattr(p_plan, k)) for k in
              ("op", "microbatch", "virtual", "first", "last", "slot", "read", "arrive_f", "arrive_b")}
    # [S, ...] with s = v P + p -> [P, V, ...]: device p's block is its V stages.
    by_device = jax.tree.map(lambda a: jnp.swapaxes(a.reshape(V, P, *a.shape[1:]), 0, 1), stage_params)

    def local(params, head_params, x, side, tables):
        params = jax.tree.map(lambda a: a[0], params)  # [V, ...]
        me = jax.lax.axis_index(axis)
        row = jax.tree.map(lambda a: a[:, me], tables)  # [ticks] each
        shape, dtype = x.shape[1:], x.dtype
        zeros_a = jnp.zeros(shape, dtype)
        state = dict(
            stash=jnp.zeros((p_plan.stash_size, *shape), dtype),
            recv_f=jnp.zeros((p_plan.recv_f_size, *shape), dtype),
            recv_b=jnp.zeros((p_plan.recv_b_size, *shape), dtype),
            grads=jax.tree.map(jnp.zeros_like, params),
            head_grads=jax.tree.map(jnp.zeros_like, head_params),
            dx=jnp.zeros_like(x),
            loss=jnp.zeros((), jnp.float32),
        )

        def at(tree, i):
            return jax.tree.map(lambda w: w[i], tree)

        def forward(state, op):
            m, v, slot = op["microbatch"], op["virtual"], op["slot"]
            a = jnp.where(op["first"] == 1, x[m], state["recv_f"][jnp.maximum(op["read"], 0)])
            state = dict(state, stash=state["stash"].at[slot].set(a))
            out = stage_fn(at(params, v), a, at(side, m))
            loss = jax.lax.cond(op["last"] == 1,
                                lambda: head_fn(head_params, out, at(side, m)).astype(jnp.float32),
                                lambda: jnp.zeros((), jnp.float32))
            return dict(state, loss=state["loss"] + loss), out, zeros_a

        def backward(state, op):
            m, v = op["microbatch"], op["virtual"]
            a, side_m = state["stash"][op["slot"]], at(side, m)

            def through_head():
                def fn(w, h, a):
                    return head_fn(h, stage_fn(w, a, side_m), side_m)

                loss, vjp = jax.vjp(fn, at(params, v), head_params, a)
                return vjp(jnp.ones_like(loss))

            def through_stage():
                _, vjp = jax.vjp(lambda w, a: stage_fn(w, a, side_m), at(params, v), a)
                g_w, g_a = vjp(state["recv_b"][jnp.maximum(op["read"], 0)])
                return g_w, jax.tree.map(jnp.zeros_like, head_params), g_a

            g_w, g_head, g_a = jax.lax.cond(op["last"] == 1, through_head, through_stage)
            grads = jax.tree.map(lambda acc, g: acc.at[v].add(g), state["grads"], g_w)
            head_grads = jax.tree.map(jnp.add, state["head_grads"], g_head)
            dx = jnp.where(op["first"] == 1, state["dx"].at[m].set(g_a), state["dx"])
            return dict(state, grads=grads, head_grads=head_grads, dx=dx), zeros_a, g_a

        def idle(state, op):
            return state, zeros_a, zeros_a

        def tick(state, op):
            state, out_f, out_b = jax.lax.switch(op["op"], [idle, forward, backward], state, op)
            sent_f = jax.lax.ppermute(out_f, axis, [(d, (d + 1) % P) for d in range(P)])
            sent_b = jax.lax.ppermute(out_b, axis, [(d, (d - 1) % P) for d in range(P)])
            recv_f = jnp.where(op["arrive_f"] >= 0,
                               state["recv_f"].at[jnp.maximum(op["arrive_f"], 0)].set(sent_f), state["recv_f"])
            recv_b = jnp.where(op["arrive_b"] >= 0,
                               state["recv_b"].at[jnp.maximum(op["arrive_b"], 0)].set(sent_b), state["recv_b"])
            return dict(state, recv_f=recv_f, recv_b=recv_b), None

        state, _ = jax.lax.scan(tick, state, row)
        total = functools.partial(jax.lax.psum, axis_name=axis)
        loss = total(state["loss"]) / M
        head_grads = jax.tree.map(lambda g: total(g) / M, state["head_grads"])
        dx = total(state["dx"]) / M
        grads = jax.tree.map(lambda g: (g / M)[None], state["grads"])
        return loss, grads, head_grads, dx

    spec, whole = PartitionSpec(axis), PartitionSpec()
    loss, grads, head_grads, dx = jax.shard_map(
        local, mesh=mesh, in_specs=(spec, whole, whole, whole, whole), axis_names={axis},
        out_specs=(whole, spec, whole, whole), check_vma=False,
    )(by_device, head_params, x, side, tables)
    grads = jax.tree.map(lambda g: jnp.swapaxes(g, 0, 1).reshape(P * V, *g.shape[2:]), grads)
    return loss, (grads, head_grads, dx)
