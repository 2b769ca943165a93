"""The mixture-of-experts MLP (``model.moe``, ``jaxpar.models.config.MoEConfig``).

A MoE layer's MLP is ``route -> permute -> expert_mlp -> combine``, each a small
function, so that expert parallelism can wrap the grouped matmul (``expert_mlp``) in a
``shard_map`` with an all-to-all either side without touching the rest:

* ``route``: float32 router scores ``[N, E]`` -> each token's ``k`` experts, their gates,
  and (with ``capacity_factor``) which assignments are kept (``capacity_mask``);
* ``permute``: the ``N * k`` token copies sorted by expert (a stable sort: token order
  within an expert) and each expert's count;
* ``expert_mlp``: every expert's MLP over its rows at once, ``jax.lax.ragged_dot``
  (dropless: no padding to a capacity, no token dropped unless a capacity is set);
* ``combine``: the rows back in token order, summed over each token's ``k`` experts
  weighted by their gates (0 for a dropped assignment: the residual carries the token).

Expert parallelism (``mesh.expert``: the rules split the experts ``exp`` over ``expert``,
and the batch over it too): each device routes and permutes its own tokens, and
``exchange`` sends each assignment to the device holding its expert and its output back,
by all-to-all with fixed per-destination buffers, the device computing its own experts'
rows between (``expert_mlp``). The router decides before the exchange, so a capacity's
per-sequence drops are those of one device.

Dimension letters: N tokens (``B * T``), E experts, k experts per token, D the model
width, F an expert's width.

Parameters (a stacked layer's lead with L):
  moe.router       [D, E]     (embed, None)                  applied in float32
  moe.router_bias  [E]        (None,)                        router="sigmoid_bias" only
  moe.gate, up     [E, D, F]  (exp, embed_moe, mlp_moe)      gate for swiglu only
  moe.down         [E, F, D]  (exp, mlp_moe, embed_moe)
Shared experts are the layer's dense ``mlp`` of width ``shared_experts * expert_width``.

The balance loss's statistics (``f``, ``P``) are those of the rows one loss call sees:
the whole batch under data, FSDP and tensor parallelism (each device's summed), but each
microbatch's under ``optimizer.grad_accum`` and each replica's under
``data.batch_weights``; the loss is not linear in them, so those runs' balance terms
differ from one device's whole-batch term. A capacity's "token order" is the order the
rows hold their tokens: under ``execution.seq_layout=zigzag``, the zigzag order.

Statistics. Each MoE layer also returns ``Aux.stats``, float32 ``[3, E]``: per expert the
assignments the router chose, its router probabilities summed over the tokens, and the
assignments a capacity kept; sums over tokens, so the train step adds them over
microbatches and ``psum``s them over replicas beside the gradient (never through a
gradient reduction: Adasum and the top-k exchange leave them alone), and the whole
step's are one device's whatever the layout. From them the step takes the router
bias's step and its metrics (``step_metrics``).

The router bias (DeepSeek-V3's auxiliary-loss-free balancing) is stored as a parameter
(so checkpoints, shardings and restores carry it as any other) but is no gradient
parameter (it only steers the choice, under ``stop_gradient``): the train step zeroes its
gradient before the optimizer and moves it by ``-bias_rate * sign(f_e - 1/E)``, ``f``
its layer's load over the whole step's tokens (``update_router_biases``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar import kernels
from jaxpar.kernels.dispatch import pallas_interpret
from jaxpar.models.config import ModelConfig, MoEConfig
from jaxpar.models.params import param as _param
from jaxpar.offload import fetch
from jaxpar.placement import rules as rules_lib
from jaxpar.placement.axes import local_axes, shard_index
from jaxpar.placement.execution import implementation, rules_for

BIAS = "router_bias"
# Why uneven pipeline stages take a MoE model only with ``every=1``: a stage holds whole
# stacked units, ``every = n > 1`` stacks groups of n layers (``ModelConfig.stacked_layers``),
# and pipeline.stage_layers counts layers.
PIPE_GROUPS = ("pipeline.stage_layers counts layers, and model.moe.every > 1 stacks them in groups of that "
               "many, which a stage holds whole; give even stages (no pipeline.stage_layers) or model.moe.every=1")
# The logical axes of the router, its bias, gate, up and down (MaxText's names).
NAMES = (("embed", None), (None,), ("exp", "embed_moe", "mlp_moe"), ("exp", "embed_moe", "mlp_moe"),
         ("exp", "mlp_moe", "embed_moe"))


class Aux(NamedTuple):
    """What MoE layers add beside their output: ``loss`` their float32 term of the training
    loss (the balance loss times its coefficient), ``stats`` float32 ``[..., 3, E]`` (a
    layer's ``[3, E]``; stacked layers' ``[L, 3, E]``): per expert the assignments chosen,
    the router probabilities summed over tokens, and the assignments kept (the module
    docstring's statistics)."""

    loss: jax.Array
    stats: jax.Array


class Routing(NamedTuple):
    """Where each of ``N`` tokens goes: ``experts`` int32 ``[N, k]``, ``gates`` float32
    ``[N, k]`` (0 where dropped), ``kept`` bool ``[N, k]``, and ``probs`` float32
    ``[N, E]``: the router probabilities the balance loss averages (the softmax, or the
    sigmoid scores normalised per token)."""

    experts: jax.Array
    gates: jax.Array
    kept: jax.Array
    probs: jax.Array


def route(logits: jax.Array, moe: MoEConfig, bias: jax.Array | None, rows: int) -> Routing:
    """``logits`` float32 ``[N, E]`` (``rows`` sequences of ``N / rows`` tokens) -> ``Routing``.

    Gates are computed (and normalised) before a capacity drops anything, as in Switch."""
    k = moe.experts_per_token
    if moe.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs, choice = scores, scores
    else:  # DeepSeek-V3: the bias steers the choice only, never the gates
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
        choice = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    _, experts = jax.lax.top_k(choice, k)
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.normalize:
        gates = gates / gates.sum(-1, keepdims=True)
    kept = jnp.ones(experts.shape, bool)
    if moe.capacity_factor is not None:
        kept = capacity_mask(experts, moe.experts, rows, moe.capacity_factor)
    return Routing(experts, jnp.where(kept, gates, 0.0), kept, probs)


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Assignments an expert keeps per sequence of ``tokens`` tokens: ``ceil(factor *
    tokens * k / experts)``."""
    return math.ceil(factor * tokens * k / experts)


def capacity_mask(experts: jax.Array, num_experts: int, rows: int, factor: float) -> jax.Array:
    """bool ``[N, k]``: which assignments ``experts [N, k]`` keeps under capacity ``factor``.

    Per sequence (``rows`` of ``N / rows`` tokens, so a sequence's drops do not depend on
    how the batch is split over devices or microbatches) and expert, the first
    ``capacity(...)`` assignments in token order are kept (a token's ``k`` experts are
    distinct, so token order is a total order within an expert)."""
    N, k = experts.shape
    T = N // rows
    limit = capacity(T, k, num_experts, factor)
    onehot = jax.nn.one_hot(experts.reshape(rows, T * k), num_experts, dtype=jnp.int32)  # [rows, T k, E]
    earlier = jnp.cumsum(onehot, axis=1) - onehot  # assignments before this one, per expert
    rank = (earlier * onehot).sum(-1)
    return (rank < limit).reshape(N, k)


def permute(x: jax.Array, experts: jax.Array, num_experts: int):
    """``x [N, D]`` copied once per assignment and sorted by expert: ``(xs [N k, D],
    order [N k], group_sizes int32 [E])``; row ``i`` of ``xs`` is assignment
    ``order[i]`` (token ``order[i] // k``)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return jnp.take(x, order // k, axis=0), order, group_sizes


def expert_mlp(xs: jax.Array, group_sizes: jax.Array, gate: jax.Array | None, up: jax.Array,
               down: jax.Array) -> jax.Array:
    """The grouped matmul: rows ``xs [M, D]`` sorted by expert (``group_sizes [E]`` each)
    through their expert's SwiGLU (``gate`` given) or GELU MLP, ``gate, up [E, D, F]``,
    ``down [E, F, D]`` -> ``[M, D]``; rows past ``sum(group_sizes)`` give zeros.

    Each grouped matmul is ``jax.lax.ragged_dot``, or with ``execution.moe`` resolving to
    ``"pallas"`` (``auto`` on a GPU of compute capability 8.0 or newer) the
    ``jaxpar.kernels.grouped_matmul`` kernel, which computes the same."""
    dot = jax.lax.ragged_dot
    if implementation("moe") == "pallas":
        dot = functools.partial(kernels.grouped_matmul, interpret=pallas_interpret())
    h = dot(xs, up, group_sizes)
    if gate is not None:
        h = jax.nn.silu(dot(xs, gate, group_sizes)) * h
    else:
        h = jax.nn.gelu(h, approximate=True)
    return dot(h, down, group_sizes)


def combine(ys: jax.Array, order: jax.Array, gates: jax.Array) -> jax.Array:
    """``ys [N k, D]`` in ``permute``'s order -> ``[N, D]``: each token's rows weighted by
    its ``gates [N, k]`` and summed."""
    N, k = gates.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    rows = jnp.take(ys, inverse, axis=0).reshape(N, k, -1)
    return jnp.einsum("NKD,NK->ND", rows, gates.astype(ys.dtype))


def load(experts: jax.Array, num_experts: int) -> jax.Array:
    """float32 ``[E]``: each expert's fraction of the ``N k`` assignments (the router's
    choice, before any capacity drop); sums to 1."""
    return jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.float32) / experts.size


def balance_loss(routing: Routing, num_experts: int) -> jax.Array:
    """Switch's load-balancing loss ``E * sum_e f_e P_e`` (``f = load``, ``P_e`` the mean
    router probability of expert ``e``): 1 when balanced. Hugging Face's Mixtral loss
    (``load_balancing_loss_func``) is ``k`` times this, over the layers' tokens pooled."""
    return num_experts * jnp.sum(load(routing.experts, num_experts) * routing.probs.mean(0))


class MoE(nnx.Module):
    """The routed experts of a MoE layer: ``x [B, T, D]`` -> ``(y [B, T, D], aux)``, with
    ``aux`` an ``Aux``: the layer's float32 term of the training loss (``balance_loss``
    times its coefficient) and its statistics ``[3, E]``, summed over the devices."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe = cfg.moe
        D, E, F = cfg.dim, moe.experts, moe.expert_width
        self.cfg = cfg
        self.router = _param(rngs, cfg, (D, E), NAMES[0])
        if moe.router == "sigmoid_bias":
            self.router_bias = _param(rngs, cfg, (E,), NAMES[1], nnx.initializers.zeros_init())
        self.gate = _param(rngs, cfg, (E, D, F), NAMES[2]) if cfg.mlp == "swiglu" else None
        self.up = _param(rngs, cfg, (E, D, F), NAMES[3])
        self.down = _param(rngs, cfg, (E, F, D), NAMES[4])

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Aux]:
        """With a mesh, each device routes and computes its own batch rows (``dispatch``
        under ``shard_map`` over the axes the rules split ``activation_batch`` over), and
        the balance statistics are summed over the devices after. Where the rules split
        the experts (``exp``) over axes the batch is split over too (``expert``), the
        expert weights stay split and the tokens travel (``exchange``); where they split the
        experts' width (``mlp_moe``) over axes the batch is not split over (``tensor``), it
        stays split, each device computes its slice of every row and the outputs are
        summed over those axes (``psum``: tensor parallelism within an expert). The other
        splits of the weights as stored (``embed_moe`` over ``fsdp``) are all-gathered
        whole inside (``_gathered``), so their gradients leave
        reduce-scattered onto their shards, as ZeRO-3 keeps them, rather than all-reduced
        whole. Without ``model.remat`` the backward pass keeps the gathered weights from
        the forward's (Mixtral's shape, 2 layers, fsdp=8, 8 x 1024 tokens, compiled for
        CPU: peak 28.0 GB a device, collectives 23.7 GB, against 19.8 and 43.4 GB with the
        weights gathered outside); with ``full`` or ``dots_no_batch`` it gathers them again
        (19.5 GB, 33.5 GB against 19.5, 43.4)."""
        cfg, moe = self.cfg, self.cfg.moe
        dtype, B = cfg.compute_dtype, x.shape[0]
        weights = (self.router[...].astype(jnp.float32),
                   self.router_bias[...].astype(jnp.float32) if moe.router == "sigmoid_bias" else None,
                   None if self.gate is None else self.gate[...].astype(dtype),
                   self.up[...].astype(dtype), self.down[...].astype(dtype))
        mesh = jax.sharding.get_abstract_mesh()
        local = None if mesh.empty else _on_mesh(mesh, moe, B)
        y, stats = (local or functools.partial(dispatch, moe=moe))(x, *weights)
        stats = stats.sum(0)
        return y, Aux(self._balance(stats), jax.lax.stop_gradient(stats))

    def _balance(self, stats: jax.Array) -> jax.Array:
        """The layer's loss term from ``stats`` ``[3, E]`` (every device's summed,
        ``dispatch``): Switch's ``E * sum_e f_e P_e`` times its coefficient, ``P_e`` the
        mean probability over tokens, ``f`` constant."""
        moe = self.cfg.moe
        if not moe.balance_loss:
            return jnp.zeros((), jnp.float32)
        counts, prob_sums = jax.lax.stop_gradient(stats[0]), stats[1]
        tokens = counts.sum() / moe.experts_per_token
        return moe.balance_loss * moe.experts * jnp.sum(counts / counts.sum() * prob_sums / tokens)


def _on_mesh(mesh, moe: MoEConfig, batch: int):
    """``dispatch`` under ``shard_map`` on ``mesh`` (``MoE.__call__``), or None where the
    rules split neither the rows nor the experts over it. Each device takes its rows
    (the axes ``activation_batch`` is split over). Experts split over axes that split
    the rows too (``expert`` in training) stay split and the tokens travel
    (``exchange``); experts split over axes that do not (``rules.EXPERTS_OWNED``:
    serving) stay split and each device runs its own experts over every row, the outputs
    summed over those axes (``owned``); otherwise they are gathered whole. The experts'
    width stays split over the axes that do not split the rows (``tensor``): each of
    those devices computes its slice of every row's experts, summed over them after."""
    rows = local_axes(mesh, "activation_batch", batch)
    rules = rules_for(mesh, "jaxpar.models.moe")
    specs = tuple(rules_lib.logical_to_spec(names, rules) for names in NAMES)
    split_experts = tuple(a for a in rules_lib.as_tuple(specs[3][0]) if mesh.shape[a] > 1)
    experts = split_experts if split_experts and set(split_experts) <= set(rows) else ()
    owned = split_experts if split_experts and not set(split_experts) & set(rows) else ()
    if not rows and not owned:
        return None
    width = tuple(a for a in rules_lib.as_tuple(specs[3][2]) if mesh.shape[a] > 1 and a not in rows)
    send = jax.lax.ragged_all_to_all if experts and implementation("moe_exchange") == "ragged" else None
    local = functools.partial(dispatch, moe=moe, expert_axes=experts, owned_axes=owned, width_axes=width,
                              ragged=send)
    split = PartitionSpec(rows or None)
    return jax.shard_map(_gathered(local, specs, experts + owned, width), mesh=mesh, in_specs=(split, *specs),
                         out_specs=(split, split), check_vma=False)


def _gathered(fn, specs, experts=(), width=()):
    """``fn(x, *weights)`` on one device (inside ``shard_map``) with each weight first
    all-gathered whole along the mesh axes its ``specs`` entry splits it over (but the
    expert weights' experts over the ``experts`` axes and their width over the ``width``
    axes, which stay split); the gather's transpose is a reduce-scatter of the gradient
    onto the weight's shards."""
    kept = {"exp": experts, "mlp_moe": width}

    def gather(w, spec, names):
        if w is None:
            return None
        for dim, (axes, name) in enumerate(zip(spec, names)):
            axes = tuple(a for a in rules_lib.as_tuple(axes) if a not in kept.get(name, ()))
            if axes:
                w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
        return w

    def run(x, *weights):
        return fn(x, *(gather(w, spec, names) for w, spec, names in zip(weights, specs, NAMES)))

    return run


def dispatch(x, router, bias, gate, up, down, *, moe: MoEConfig, expert_axes: tuple[str, ...] = (),
             owned_axes: tuple[str, ...] = (), width_axes: tuple[str, ...] = (), ragged=None):
    """The routed experts of ``x [B, T, D]`` (one device's rows): ``route -> permute ->
    expert_mlp -> combine``, with ``exchange`` around ``expert_mlp`` where the experts
    are split over ``expert_axes`` (``gate, up, down`` then this device's experts), or
    ``owned`` where they are split over ``owned_axes`` and every device holds the rows;
    ``ragged``: ``exchange_ragged``'s collective (``jax.lax.ragged_all_to_all``) to move
    the rows with instead of ``exchange``'s fixed buffers.
    Returns ``(y [B, T, D], stats [1, 3, E])``: float32 each expert's assignment count
    (the router's choice, before any capacity), its router probabilities summed over
    the tokens, and its assignments kept, which ``MoE`` sums over devices."""
    B, T, D = x.shape
    tokens = x.reshape(B * T, D)
    with jax.named_scope("router"):
        routing = route(tokens.astype(jnp.float32) @ router, moe, bias, rows=B)
    with jax.named_scope("experts"):
        xs, order, group_sizes = permute(tokens, routing.experts, moe.experts)
        mlp = functools.partial(expert_mlp, gate=gate, up=up, down=down)
        if expert_axes and ragged is not None:
            ys = exchange_ragged(mlp, xs, group_sizes, expert_axes, moe.experts_per_token, ragged)
        elif expert_axes:
            ys = exchange(mlp, xs, group_sizes, expert_axes, moe.experts_per_token)
        elif owned_axes:
            ys = owned(mlp, xs, group_sizes, owned_axes)
        else:
            ys = mlp(xs, group_sizes)
        y = combine(ys, order, routing.gates)
        if width_axes or owned_axes:  # each device's part of every row's output
            y = jax.lax.psum(y, (*width_axes, *owned_axes))
    flat = routing.experts.reshape(-1)
    counts = jnp.bincount(flat, length=moe.experts).astype(jnp.float32)
    kept = jnp.bincount(flat, routing.kept.reshape(-1).astype(jnp.float32), length=moe.experts)
    return y.reshape(B, T, D), jnp.stack([counts, routing.probs.sum(0), kept])[None]


def exchange(mlp, xs: jax.Array, group_sizes: jax.Array, axes: tuple[str, ...], k: int) -> jax.Array:
    """``mlp(rows, local_group_sizes)`` (this device's experts) over the rows ``xs [N k,
    D]`` of every device, sorted by expert (``group_sizes [E]`` each), the experts split
    in order over the mesh ``axes`` (``W`` devices, ``E / W`` experts each): each row is
    sent to its expert's device, computed there, and sent back; returns ``[N k, D]`` in
    ``xs``' order (inside ``shard_map``).

    Fixed per-destination buffers (``send_buffers``; the backend-neutral form, as XLA:CPU
    has no ``ragged_all_to_all``): dropless, each destination's buffer holds the most rows
    one device can send it, ``N * min(k, E / W)`` (a token's k experts are distinct), so
    each of the four buffers (sent, received, computed, returned) is ``W * N * min(k, E /
    W)`` rows of ``D``: ``W`` times the ``N k`` rows of the device's own permutation where
    ``E / W >= k``; and the grouped matmul runs over all of those rows (those past the
    received counts give zeros; a backend whose grouped matmul reads the group sizes
    skips them). ``ragged_all_to_all`` would send only the real rows: its offsets and
    sizes are ``send_buffers``' ``starts`` and ``per_dest`` and the received ``counts``."""
    W, axes, local, slots = _exchange_sizes(xs, group_sizes, axes, k)
    buffers, dest, pos = send_buffers(xs, group_sizes.reshape(W, local).sum(1), slots)
    received = jax.lax.all_to_all(buffers, axes, 0, 0, tiled=True)  # [W sources, slots, D]
    counts = jax.lax.all_to_all(group_sizes.reshape(W, local), axes, 0, 0, tiled=True)  # [W sources, E/W]
    # each received row's local expert (E/W past a source's rows), then grouped by it
    ends = jnp.cumsum(counts, axis=1)
    expert = (jnp.arange(slots)[None, :, None] >= ends[:, None, :]).sum(-1).reshape(-1)
    order = jnp.argsort(expert, stable=True)
    out = mlp(jnp.take(received.reshape(W * slots, -1), order, axis=0), counts.sum(0))
    out = jnp.zeros_like(out).at[order].set(out).reshape(W, slots, -1)
    returned = jax.lax.all_to_all(out, axes, 0, 0, tiled=True)  # [W destinations, slots, D]
    return returned[dest, pos]


def _exchange_sizes(xs: jax.Array, group_sizes: jax.Array, axes: tuple[str, ...], k: int) -> tuple:
    """``(W, axis name, E / W, slots)`` of an exchange over the mesh ``axes``: the devices,
    the name a collective takes, each device's experts, and the most rows one device can
    send another (``N * min(k, E / W)``: a token's k experts are distinct)."""
    W = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
    local = group_sizes.shape[0] // W
    return W, axes[0] if len(axes) == 1 else axes, local, xs.shape[0] // k * min(k, local)


def exchange_ragged(mlp, xs: jax.Array, group_sizes: jax.Array, axes: tuple[str, ...], k: int,
                    send=jax.lax.ragged_all_to_all) -> jax.Array:
    """``exchange`` with the real rows only (``execution.moe_exchange=ragged``: a GPU's or
    TPU's ``jax.lax.ragged_all_to_all``, ``send``): each destination's rows of ``xs``
    (contiguous, sorted by expert) go straight to the next free rows of its buffer, after
    the rows of the sources before this one, so a device receives its rows packed at the
    front of one ``[W * N * min(k, E / W), D]`` buffer (still sized for the worst case;
    the bytes on the links are the real rows'); each received row's local expert follows
    from the received counts, the rows are grouped by it for ``mlp``, and the outputs go
    back the same way, each to where its row came from. The offsets: where a source's
    rows land here is the running sum of the counts received; a sender learns where its
    rows land at each destination (and, for the way back, where each source's rows
    started there) by one all-to-all of those offsets."""
    W, name, local, slots = _exchange_sizes(xs, group_sizes, axes, k)
    a2a = lambda x: jax.lax.all_to_all(x, name, 0, 0, tiled=True)  # noqa: E731
    sent = group_sizes.reshape(W, local).sum(1)  # rows for each destination, from xs[starts]
    starts = jnp.cumsum(sent) - sent
    counts = a2a(group_sizes.reshape(W, local))  # [W sources, E/W]
    received = counts.sum(1)
    landed = jnp.cumsum(received) - received  # where each source's rows start here
    # one all-to-all for both ways: where this device's rows land at each destination, and
    # where each source's rows started in its xs (for the way back)
    there, origins = a2a(jnp.stack([landed, starts], axis=1)).T
    buffer = send(xs, jnp.zeros((W * slots, xs.shape[1]), xs.dtype), starts, sent, there, received, axis_name=name)
    # received rows in (source, local expert) segments, then padding: each row's expert
    ends = jnp.cumsum(counts.reshape(-1))
    segment = jnp.searchsorted(ends, jnp.arange(W * slots), side="right")
    expert = jnp.where(segment < W * local, segment % local, local)
    order = jnp.argsort(expert, stable=True)
    out = mlp(jnp.take(buffer, order, axis=0), counts.sum(0))
    out = jnp.zeros_like(out).at[order].set(out)
    return send(out, jnp.zeros_like(xs), landed, received, origins, sent, axis_name=name)


def owned(mlp, xs: jax.Array, group_sizes: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``mlp(rows, local_group_sizes)`` over this device's experts' rows of ``xs [N k, D]``
    (every row, sorted by expert, ``group_sizes [E]`` each; the experts split in order
    over the mesh ``axes``), zeros in the other rows (inside ``shard_map``): the rows are
    rotated so this device's experts' come first, the grouped matmul runs over them
    (rows past the groups give zeros), and they are rotated back. Summed over ``axes``
    after ``combine``, every row has all its experts' outputs."""
    mesh = jax.sharding.get_abstract_mesh()
    local = group_sizes.shape[0] // math.prod(mesh.shape[a] for a in axes)
    first = shard_index(mesh, axes) * local
    start = jnp.sum(jnp.where(jnp.arange(group_sizes.shape[0]) < first, group_sizes, 0))
    out = mlp(jnp.roll(xs, -start, axis=0), jax.lax.dynamic_slice_in_dim(group_sizes, first, local))
    return jnp.roll(out, start, axis=0)


def send_buffers(xs: jax.Array, per_dest: jax.Array, slots: int):
    """``xs [M, D]`` sorted by destination (``per_dest [W]`` rows each, none more than
    ``slots``) into fixed buffers ``[W, slots, D]`` (zeros past each destination's rows);
    returns ``(buffers, dest [M], pos [M])``, row ``i`` at ``buffers[dest[i], pos[i]]``.
    The one place ``jax.lax.ragged_all_to_all``'s offsets and sizes would replace."""
    M = xs.shape[0]
    starts = jnp.cumsum(per_dest) - per_dest
    dest = jnp.repeat(jnp.arange(per_dest.shape[0]), per_dest, total_repeat_length=M)
    pos = jnp.arange(M) - starts[dest]
    return jnp.zeros((per_dest.shape[0], slots, xs.shape[1]), xs.dtype).at[dest, pos].set(xs), dest, pos


def _is_bias(path) -> bool:
    return any(getattr(key, "key", getattr(key, "name", None)) == BIAS for key in path)


def deviations(stats: jax.Array) -> jax.Array:
    """float32 ``[L, E]``: each layer's load less an even share, ``f_e - 1/E``, from the
    step's statistics ``[L, 3, E]``."""
    counts = stats[:, 0]
    return counts / jnp.maximum(counts.sum(-1, keepdims=True), 1.0) - 1 / counts.shape[-1]


def update_router_biases(params, grads, stats: jax.Array, rate: float):
    """The router biases' step (DeepSeek-V3, ``router="sigmoid_bias"``): ``(grads,
    biases)``, the gradients with the biases' zeroed, so that the optimizer, its clipping
    and norms see none, and the biases (stacked ``[L, E]``) moved by ``-rate *
    sign(deviations(stats))`` (leaves of ``params``' structure, None where not a bias)
    for ``with_router_biases`` to put in after the optimizer's update."""
    step = rate * jnp.sign(deviations(stats))

    def moved(path, p):
        if not _is_bias(path):
            return None
        # with offloaded parameters (``jaxpar.offload``) a bias may lie in host memory, or
        # in two parts: its first rows on the device, the rest on the host
        first = any(getattr(key, "name", None) == "resident" for key in path)
        rows = step[:p.shape[0]] if first else step[step.shape[0] - p.shape[0]:]
        new = (fetch.to_device(p) - rows.reshape(p.shape)).astype(p.dtype)
        return fetch.to_host(new) if fetch.on_host(p) else new

    biases = jax.tree.map_with_path(moved, params)
    grads = jax.tree.map_with_path(lambda path, g: jnp.zeros_like(g) if _is_bias(path) else g, grads)
    return grads, biases


def with_router_biases(params, biases):
    """``params`` with the router biases ``update_router_biases`` computed."""
    return jax.tree.map(lambda p, b: p if b is None else b, params, biases, is_leaf=lambda x: x is None)


def step_metrics(stats: jax.Array, moe: MoEConfig) -> dict[str, jax.Array]:
    """A train step's MoE metrics from its statistics ``[L, 3, E]`` (the whole step's
    tokens, every MoE layer; ``metrics.jsonl``):

    * ``moe_balance_loss``: the balance loss's term of the loss, ``balance_loss * sum_l E
      sum_e f_le P_le`` over the step's tokens pooled (under ``optimizer.grad_accum`` and
      ``data.batch_weights`` the loss adds each microbatch's own, the module docstring);
    * ``moe_load_max``: the most assignments any expert of any layer was chosen for, over
      an even share (``N k / E``): 1 when balanced, ``E / k`` at worst;
    * ``moe_dropped``: the fraction of assignments a capacity dropped (0 dropless).

    A layer that saw no tokens (a pipeline stage's padding, ``jaxpar.train.pipelined``:
    zeros) adds nothing to any of them."""
    counts, prob_sums, kept = stats[:, 0], stats[:, 1], stats[:, 2]
    assigned = counts.sum(-1)  # [L]: N k each, 0 where a layer saw no tokens
    per_layer = jnp.maximum(assigned, 1.0)[:, None]  # N k >= 1 unchanged; a tokenless layer's 0 / 1
    tokens = per_layer / moe.experts_per_token
    balance = moe.experts * jnp.sum(counts / per_layer * prob_sums / tokens)
    return {"moe_balance_loss": moe.balance_loss * balance,
            "moe_load_max": jnp.max(counts * moe.experts / per_layer),
            "moe_dropped": 1 - kept.sum() / assigned.sum()}


def active_parameters(cfg: ModelConfig, total: int) -> int:
    """Of a model's ``total`` parameters, those one token uses: less the ``E - k`` routed
    experts it does not visit in each MoE layer."""
    moe = cfg.moe
    per_expert = (3 if cfg.mlp == "swiglu" else 2) * cfg.dim * moe.expert_width
    return total - (moe.experts - moe.experts_per_token) * per_expert * (cfg.layers // moe.every)
