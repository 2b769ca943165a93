"""One SPMD program that runs any pipeline schedule (``jaxpar.parallel.pipeline_schedule``).

The schedule is data: a table of (operation, microbatch, stage) per tick and device.
``value_and_grad`` scans over its ticks under ``shard_map`` over ``pipe``; at every tick
each device runs what its row says, a stage's forward or its backward (an explicit
``jax.vjp`` of the stage, recomputing it from the stashed stage input, so the
activations a device keeps are the stage inputs of the microbatches in flight: ``M``
for GPipe, at most ``P`` for 1F1B), then sends its output to the next device and its
input gradient to the previous one (``ppermute``, circular, so interleaved stages wrap
round).

Three parts, each a function of its own:

* ``plan``: the schedule's arithmetic on the host, no JAX: per tick and device the
  operation, microbatch, virtual stage and which buffer slot every arrival, stash and
  read uses, so the device loop only indexes;
* ``branching_tick``: one tick on one device, which runs its own operation
  (``lax.switch``);
* ``lockstep_tick``: one tick on one device, which runs a forward part and a backward
  part whenever any device has one, keeping only its own (for stages that communicate
  by ``ppermute``, see ``value_and_grad``).

``value_and_grad`` scans one of the ticks, followed by the sends, over the plan.

Shapes: ``P`` devices on ``pipe``, ``V`` virtual stages each, ``S = P V`` stages,
``M`` microbatches whose activations between stages are ``[*A]``. Stage ``s`` runs on
device ``s % P`` as its virtual stage ``s // P``; stage parameters are stacked
device-major, ``[P, V, ...]`` (``[p, v]`` is stage ``v P + p``), so that with the leading
axis split over ``pipe`` each device already holds its own stages.

Uneven stages. One SPMD program gives every stage the same parameter shapes, so stages
of unequal work (``jaxpar.train.pipelined``: a stage of fewer layers than another) are
stored padded to the largest, and ``stage_consts`` (leading ``[P, V]``, like the
parameters, never differentiated) tells each stage's ``stage_fn`` which of its
parameters are real: ``value_and_grad`` hands stage ``s`` its slice as a fourth
argument. The schedule is the same table whatever a stage's work.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.parallel.pipeline_schedule import BACKWARD, FORWARD, Schedule


@dataclasses.dataclass(frozen=True)
class Plan:
    """Host-side tables that the device loop indexes, and the buffer sizes.

    Per tick and device, ``[ticks, P]`` int32: ``op`` (``IDLE``, ``FORWARD``,
    ``BACKWARD``), ``microbatch``, ``virtual`` (the device's virtual stage, 0 when idle),
    ``first`` / ``last`` (1 on the first / last stage); ``slot`` the stash slot of the
    op's stage input; ``read`` the receive slot its input (forward) or output gradient
    (backward) is read from; ``arrive_f`` / ``arrive_b`` the receive slot what arrives
    at the end of the tick is written to (-1: none of these).

    Per tick, the same for every device, ``[ticks]`` bool: ``any_forward`` /
    ``any_backward`` (some device runs one), ``head_forward`` / ``head_backward`` (some
    device runs the last stage's forward / backward, so the head's), ``sends_f`` /
    ``sends_b`` (something travels forward / backward at the tick's end).
    """

    op: np.ndarray
    microbatch: np.ndarray
    virtual: np.ndarray
    first: np.ndarray
    last: np.ndarray
    slot: np.ndarray
    read: np.ndarray
    arrive_f: np.ndarray
    arrive_b: np.ndarray
    any_forward: np.ndarray
    any_backward: np.ndarray
    head_forward: np.ndarray
    head_backward: np.ndarray
    sends_f: np.ndarray
    sends_b: np.ndarray
    stash_size: int
    recv_f_size: int
    recv_b_size: int

    def rows(self) -> dict[str, np.ndarray]:
        """The tables a tick reads, by name (``PER_DEVICE`` ones ``[ticks, P]``, the others ``[ticks]``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.endswith("_size")}


PER_DEVICE = ("op", "microbatch", "virtual", "first", "last", "slot", "read", "arrive_f", "arrive_b")


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


def plan(schedule: Schedule) -> Plan:
    """The tables for ``schedule``, its buffer slots found by replaying it on the host:
    a tick's reads free their slots before what arrives at its end takes one."""
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
    op, stage = schedule.op.astype(np.int32), schedule.stage
    return Plan(
        op=op, microbatch=schedule.microbatch.astype(np.int32),
        virtual=np.where(stage >= 0, stage // P, 0).astype(np.int32),
        first=(stage == 0).astype(np.int32), last=(stage == S - 1).astype(np.int32),
        any_forward=(op == FORWARD).any(axis=1), any_backward=(op == BACKWARD).any(axis=1),
        head_forward=((op == FORWARD) & (stage == S - 1)).any(axis=1),
        head_backward=((op == BACKWARD) & (stage == S - 1)).any(axis=1),
        sends_f=(table["arrive_f"] >= 0).any(axis=1), sends_b=(table["arrive_b"] >= 0).any(axis=1),
        stash_size=max(1, max(s.size for s in stash)), recv_f_size=max(1, max(s.size for s in recv_f)),
        recv_b_size=max(1, max(s.size for s in recv_b)), **table)


@dataclasses.dataclass(frozen=True)
class Local:
    """What one device's ticks compute with (arrays as that device sees them).

    ``stage_fn``, ``head_fn``: as ``value_and_grad`` takes them; ``params``: the
    device's stages' parameters, leading ``[V, ...]``; ``outer``: the embedding's and
    head's parameters; ``x``: ``[M, *A]``, every microbatch's embedding (the first
    stage's inputs); ``side``: leading ``[M]``; ``consts``: the device's stages'
    ``stage_consts`` (leading ``[V]``), or None when ``stage_fn`` takes none.
    """

    stage_fn: Callable
    head_fn: Callable
    params: object
    outer: object
    x: jax.Array
    side: object
    consts: object = None

    def stage(self, v, w, a, side_m) -> tuple[jax.Array, jax.Array, object]:
        """The device's virtual stage ``v`` (traced) with parameters ``w`` on ``a``:
        ``(out, term, stats)`` as ``stage_fn`` returns them."""
        if self.consts is None:
            return self.stage_fn(w, a, side_m)
        return self.stage_fn(w, a, side_m, _at(self.consts, v))

    def zeros_a(self) -> jax.Array:
        """Zeros of one activation, ``[*A]``."""
        return jnp.zeros(self.x.shape[1:], self.x.dtype)


def init_state(local: Local, sizes: Plan, stats) -> dict:
    """A device's loop state: the stash of stage inputs ``[stash_size, *A]``, the receive
    buffers ``recv_f [recv_f_size, *A]`` (activations) and ``recv_b [recv_b_size, *A]``
    (output gradients), the gradients of its stages ``grads`` (``[V, ...]``) and of the
    outer parameters, the first stage's input gradients ``dx [M, *A]``, ``loss``, and
    ``stats``: zeros shaped as one stage's statistics, for each of its stages
    (``[V, ...]``)."""
    a = local.x.shape[1:]
    V = jax.tree.leaves(local.params)[0].shape[0]
    return dict(
        stats=jax.tree.map(lambda s: jnp.zeros((V, *s.shape), s.dtype), stats),
        stash=jnp.zeros((sizes.stash_size, *a), local.x.dtype),
        recv_f=jnp.zeros((sizes.recv_f_size, *a), local.x.dtype),
        recv_b=jnp.zeros((sizes.recv_b_size, *a), local.x.dtype),
        grads=jax.tree.map(jnp.zeros_like, local.params),
        outer_grads=jax.tree.map(jnp.zeros_like, local.outer),
        dx=jnp.zeros_like(local.x),
        loss=jnp.zeros((), jnp.float32),
    )


def _at(tree, i):
    return jax.tree.map(lambda w: w[i], tree)


def _add_at(tree, v, values, keep=None):
    """``tree`` (leaves ``[V, ...]``) with ``values`` added at ``v`` (where ``keep``, if
    given: a lockstep tick computes every kind and keeps its own)."""
    if keep is None:
        return jax.tree.map(lambda acc, x: acc.at[v].add(x), tree, values)
    return jax.tree.map(lambda acc, x: jnp.where(keep, acc.at[v].add(x), acc), tree, values)


def _stage_input(local: Local, state: dict, op: dict) -> jax.Array:
    """The microbatch's embedding on stage 0, what arrived from the previous stage elsewhere."""
    return jnp.where(op["first"] == 1, local.x[op["microbatch"]], state["recv_f"][jnp.maximum(op["read"], 0)])


def branching_tick(local: Local, state: dict, op: dict) -> tuple[dict, jax.Array, jax.Array]:
    """One tick on one device: its own operation, ``op`` (this device's row of the
    ``Plan``'s tables at this tick, scalars). Returns ``(state, out_f, out_b)``: the
    stage's output to send forward and its input gradient to send back (``[*A]``
    each, zeros where the operation sends none)."""
    zeros_a = local.zeros_a()

    def forward(state):
        v, slot, side_m = op["virtual"], op["slot"], _at(local.side, op["microbatch"])
        a = _stage_input(local, state, op)
        state = dict(state, stash=state["stash"].at[slot].set(a))
        out, term, stats = local.stage(v, _at(local.params, v), a, side_m)
        loss = jax.lax.cond(op["last"] == 1,
                            lambda: local.head_fn(local.outer, out, side_m).astype(jnp.float32),
                            lambda: jnp.zeros((), jnp.float32))
        return dict(state, loss=state["loss"] + term.astype(jnp.float32) + loss,
                    stats=_add_at(state["stats"], v, stats)), out, zeros_a

    def backward(state):
        m, v = op["microbatch"], op["virtual"]
        w, a, side_m = _at(local.params, v), state["stash"][op["slot"]], _at(local.side, m)
        g_out = state["recv_b"][jnp.maximum(op["read"], 0)]

        def through_head():  # the last stage: loss -> head -> stage, and the stage's term
            def total(w, h, a):
                out, term, _ = local.stage(v, w, a, side_m)
                return local.head_fn(h, out, side_m).astype(jnp.float32) + term.astype(jnp.float32)

            loss, vjp = jax.vjp(total, w, local.outer, a)
            return vjp(jnp.ones_like(loss))

        def through_stage():
            (_, term), vjp = jax.vjp(lambda w, a: local.stage(v, w, a, side_m)[:2], w, a)
            g_w, g_a = vjp((g_out, jnp.ones_like(term)))
            return g_w, jax.tree.map(jnp.zeros_like, local.outer), g_a

        g_w, g_outer, g_a = jax.lax.cond(op["last"] == 1, through_head, through_stage)
        grads = _add_at(state["grads"], v, g_w)
        outer_grads = jax.tree.map(jnp.add, state["outer_grads"], g_outer)
        dx = jnp.where(op["first"] == 1, state["dx"].at[m].set(g_a), state["dx"])
        return dict(state, grads=grads, outer_grads=outer_grads, dx=dx), zeros_a, g_a

    def idle(state):
        return state, zeros_a, zeros_a

    return jax.lax.switch(op["op"], [idle, forward, backward], state)


def lockstep_tick(local: Local, state: dict, op: dict) -> tuple[dict, jax.Array, jax.Array]:
    """One tick on one device that every device runs alike: a forward part if any
    device has a forward at this tick (``op["any_forward"]``), then a backward part if
    any has a backward; a device whose own operation is not the part's computes on
    stale buffers and keeps nothing of it. The head runs (forward, or forward and
    backward) only in the parts where some device runs the last stage
    (``op["head_forward"]``, ``op["head_backward"]``): every device then, since the head
    may communicate too (SUMMA), and only the last stage's keeps it. Same arguments,
    results and state as ``branching_tick``.

    Why: with ``branching_tick`` stage 0 may run a forward while stage 1 runs a
    backward, so a collective inside those branches is executed by only some devices.
    All-reduces and all-to-alls grouped within a stage are fine, but a
    collective-permute is one instruction over every device (XLA:CPU's runtime
    rendezvous on all its pairs), and devices in other branches never join it: wrong
    values or a hang, measured on CPU. Here the predicates are the same on every device,
    so all take the same branch. Same results and memory; a tick where some devices run
    forwards and others backwards costs a forward plus a backward instead of the longer
    of the two."""
    zeros_a = local.zeros_a()
    no_loss = lambda: jnp.zeros((), jnp.float32)  # noqa: E731

    def forward(state):
        m, v, slot = op["microbatch"], op["virtual"], jnp.maximum(op["slot"], 0)
        is_f, side_m = op["op"] == FORWARD, _at(local.side, m)
        a = _stage_input(local, state, op)
        out, term, stats = local.stage(v, _at(local.params, v), a, side_m)
        loss = jax.lax.cond(op["head_forward"],
                            lambda: local.head_fn(local.outer, out, side_m).astype(jnp.float32), no_loss)
        keep = is_f & (op["last"] == 1)
        loss = jnp.where(keep, loss, 0.0) + jnp.where(is_f, term.astype(jnp.float32), 0.0)
        return dict(state, stash=jnp.where(is_f, state["stash"].at[slot].set(a), state["stash"]),
                    loss=state["loss"] + loss, stats=_add_at(state["stats"], v, stats, is_f)), \
            jnp.where(is_f, out, zeros_a)

    def backward(state):
        """The stage's VJP, its output gradient the head's on the last stage and the
        received one elsewhere (and its term's 1)."""
        m, v, is_b, last = op["microbatch"], op["virtual"], op["op"] == BACKWARD, op["last"] == 1
        a, side_m = state["stash"][jnp.maximum(op["slot"], 0)], _at(local.side, m)
        (out, term), stage_vjp = jax.vjp(lambda w, a: local.stage(v, w, a, side_m)[:2], _at(local.params, v), a)

        def through_head():
            loss, head_vjp = jax.vjp(lambda h, out: local.head_fn(h, out, side_m), local.outer, out)
            return head_vjp(jnp.ones_like(loss))

        def no_head():
            return jax.tree.map(jnp.zeros_like, local.outer), jnp.zeros_like(out)

        g_outer, g_head = jax.lax.cond(op["head_backward"], through_head, no_head)
        g_w, g_a = stage_vjp((jnp.where(last, g_head, state["recv_b"][jnp.maximum(op["read"], 0)]),
                              jnp.ones_like(term)))
        grads = _add_at(state["grads"], v, g_w, is_b)
        outer_grads = jax.tree.map(lambda acc, g: jnp.where(is_b & last, acc + g, acc),
                                   state["outer_grads"], g_outer)
        dx = jnp.where(is_b & (op["first"] == 1), state["dx"].at[m].set(g_a), state["dx"])
        return dict(state, grads=grads, outer_grads=outer_grads, dx=dx), jnp.where(is_b, g_a, zeros_a)

    state, out_f = jax.lax.cond(op["any_forward"], forward, lambda state: (state, zeros_a), state)
    state, out_b = jax.lax.cond(op["any_backward"], backward, lambda state: (state, zeros_a), state)
    return state, out_f, out_b


def _send(state: dict, op: dict, out_f: jax.Array, out_b: jax.Array, axis: str, P: int) -> dict:
    """Outputs to the next device, input gradients to the previous one, written to the
    receive slots the plan gives; only at ticks where some device sends (GPipe's
    forward phase sends no gradients, idle ticks nothing)."""

    def shift(sends, out, step):
        pairs = [(d, (d + step) % P) for d in range(P)]
        return jax.lax.cond(sends, lambda: jax.lax.ppermute(out, axis, pairs), lambda: jnp.zeros_like(out))

    sent_f, sent_b = shift(op["sends_f"], out_f, 1), shift(op["sends_b"], out_b, -1)
    recv_f = jnp.where(op["arrive_f"] >= 0,
                       state["recv_f"].at[jnp.maximum(op["arrive_f"], 0)].set(sent_f), state["recv_f"])
    recv_b = jnp.where(op["arrive_b"] >= 0,
                       state["recv_b"].at[jnp.maximum(op["arrive_b"], 0)].set(sent_b), state["recv_b"])
    return dict(state, recv_f=recv_f, recv_b=recv_b)


def value_and_grad(
    embed_fn: Callable,
    stage_fn: Callable,
    head_fn: Callable,
    stage_params,
    outer_params,
    inputs,
    side,
    schedule: Schedule,
    *,
    mesh,
    axis: str = "pipe",
    lockstep: bool = False,
    stage_consts=None,
):
    """Runs ``schedule``: the sum over microbatches ``m`` of ``head_fn(outer_params,
    stage_{S-1}(... stage_0(embed_fn(outer_params, inputs[m], side[m]))), side[m])``
    and of every stage's own term of the loss on ``m`` (a MoE layer's balance loss), and
    its gradients (``head_fn`` and the terms weight their microbatch: by ``1 / M`` for
    the mean, by its share of the tokens for a token-weighted mean); and the stages'
    statistics summed over the microbatches.

    The head runs on the device of stage ``S - 1``, inside the schedule. The embedding
    runs before the schedule, for all microbatches, outside the ``shard_map`` (so
    sharded by the other axes only, and replicated over ``axis``), and its gradient
    after it, from the first stage's input gradients. Inside the ``shard_map`` (manual
    over ``axis``) a lookup into a table sharded over ``fsdp`` aborts XLA's SPMD
    partitioner (jax 0.10.2, ``ExpandDeviceGroupsWithIota``), measured.

    Args:
      embed_fn: ``(outer_params, inputs_m, side_m) -> a``, before the first stage (the
        token embedding), ``a`` of shape ``A``.
      stage_fn: ``(stage_params_s, a, side_m) -> (a, term, stats)``, one stage (a chunk
        of layers); ``side_m`` is microbatch ``m``'s slice of ``side``; ``term`` a scalar
        the stage adds to the loss (differentiated; ``0.0`` where it adds none);
        ``stats`` a pytree of arrays (``()`` for none), summed over microbatches, not
        differentiated (a MoE stage's routing counts).
      head_fn: ``(outer_params, a, side_m) -> scalar``, after the last stage (the loss).
      stage_params: pytree of arrays with leading ``[P, V, ...]``, device-major:
        ``[p, v]`` holds stage ``v P + p``'s parameters (device ``p``'s ``v``-th).
      outer_params: pytree, replicated over ``axis``: what ``embed_fn`` and ``head_fn``
        read (the embedding, the final norm, the head; tied weights are shared).
      inputs: pytree with leading ``[M]``, what ``embed_fn`` reads (the tokens).
      side: pytree with leading ``[M]`` that stages and head read (targets, positions).
      schedule: from ``jaxpar.parallel.pipeline_schedule.build``; mesh: has ``axis`` of size
        ``schedule.devices``.
      lockstep: every device runs the same program at every tick (see below) instead
        of branching on its own operation. Needed when ``stage_fn`` or ``head_fn``
        communicate by ``ppermute`` (ring attention, SUMMA).
      stage_consts: None, or a pytree of arrays with leading ``[P, V]``, device-major
        like ``stage_params``: stage ``s``'s slice is passed to ``stage_fn`` as a fourth
        argument, ``stage_fn(stage_params_s, a, side_m, stage_consts_s)``, and is not
        differentiated (how many of its padded layers an uneven stage runs). A device
        reads its own (a traced value, not a Python one: one program serves every
        device).

    With ``lockstep`` every device runs ``lockstep_tick`` instead of branching on its
    own operation (``branching_tick``): a collective-permute inside a branch that only
    some devices take gives wrong values or hangs (``lockstep_tick`` says why, and what
    it costs).

    Returns:
      ``(loss, (stage_grads [P, V, ...], outer_grads), stage_stats [P, V, ...])``.
    """
    P = schedule.devices
    if mesh.shape[axis] != P:
        raise ValueError(f"the schedule has {P} pipeline devices, the mesh {axis}={mesh.shape[axis]}")
    p_plan = plan(schedule)
    tables = {k: jnp.asarray(t) for k, t in p_plan.rows().items()}
    x, embed_vjp = jax.vjp(lambda h: jax.vmap(embed_fn, (None, 0, 0))(h, inputs, side), outer_params)
    tick = lockstep_tick if lockstep else branching_tick
    device = _on_device(stage_fn, head_fn, stage_consts is not None, p_plan, tick, axis, P)

    spec, whole = PartitionSpec(axis), PartitionSpec()
    loss, grads, outer_grads, dx, stats = jax.shard_map(
        device, mesh=mesh, in_specs=(spec, spec, whole, whole, whole, whole), axis_names={axis},
        out_specs=(whole, spec, whole, whole, spec), check_vma=False,
    )(stage_params, () if stage_consts is None else stage_consts, outer_params, x, side, tables)
    outer_grads = jax.tree.map(jnp.add, outer_grads, embed_vjp(dx)[0])
    return loss, (grads, outer_grads), stats


def _on_device(stage_fn, head_fn, has_consts: bool, p_plan, tick, axis: str, P: int):
    """``value_and_grad``'s ``shard_map`` body: the schedule's ticks on one device of
    ``axis``; returns its loss, stage gradients, outer gradients, the first stage's
    input gradients (summed over ``axis`` where every device holds them) and its stages'
    statistics."""

    def device(params, consts, outer, x, side, tables):
        first = functools.partial(jax.tree.map, lambda a: a[0])  # this device's block of [P, ...]
        local = Local(stage_fn, head_fn, first(params), outer, x, side,
                      first(consts) if has_consts else None)
        me = jax.lax.axis_index(axis)
        # [ticks] each: this device's column of the per-device tables, the per-tick ones whole.
        rows = {k: t[:, me] if k in PER_DEVICE else t for k, t in tables.items()}

        def step(state, op):
            state, out_f, out_b = tick(local, state, op)
            return _send(state, op, out_f, out_b, axis, P), None

        one = jax.eval_shape(lambda: local.stage(0, _at(local.params, 0), local.zeros_a(), _at(side, 0))[2])
        state, _ = jax.lax.scan(step, init_state(local, p_plan, one), rows)
        total = functools.partial(jax.lax.psum, axis_name=axis)
        loss = total(state["loss"])
        outer_grads = jax.tree.map(total, state["outer_grads"])
        # In float32: XLA:CPU (jax 0.10.2) aborts promoting a bf16 all-reduce here.
        dx = total(state["dx"].astype(jnp.float32)).astype(x.dtype)
        grads, stats = jax.tree.map(lambda g: g[None], (state["grads"], state["stats"]))
        return loss, grads, outer_grads, dx, stats

    return device
