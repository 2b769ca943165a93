"""The step-time model: how long one training step of a layout takes on a hardware
profile, split into compute, exposed communication, pipeline bubble and offload.

Compute
    FLOPs per device, counted (``6 x matmul parameters x tokens``, a MoE layer's routed
    experts as their grouped matmuls run, ``expert_rows``, plus attention's
    ``12 L N H T`` per token; a compiled program's own count adds XLA's elementwise
    FLOPs, which run at memory speed, so it is not used here), plus
    what the remat policy recomputes: ``full`` one more forward of everything,
    ``dots_no_batch`` attention's two products again; and in jaxpar's pipeline one more
    forward of everything whatever the policy: a stage's backward recomputes its forward
    from the stashed stage input, ``jaxpar.parallel.pipeline``), divided over the devices, at
    ``peak x efficiency`` of each op class (matmul, attention); plus elementwise
    traffic (norms, activations, residuals, the loss, the optimizer update) at
    ``hbm_bandwidth``.
Communication
    bytes each device sends per step by mesh axis (the profiler's
    ``collectives_by_axes`` where compiled, else counted as below), over the bandwidth
    of the links that axis spans: intra-node when the axis' devices sit within
    ``devices_per_node`` (``jaxpar.make_mesh`` puts ``tensor`` innermost, ``data``
    outermost), inter-node otherwise; plus ``collective_latency`` per collective.
    Counted: ``data`` all-reduces the gradients; ``fsdp`` (and ``seq``, which shards
    the weights too) all-gathers each layer's weights in the forward and backward pass
    (once more under full remat) and reduce-scatters its gradients, per microbatch;
    ``tensor`` all-reduces (or, with sequence parallelism, reduce-scatters and
    all-gathers) a ``[b, t, D]`` activation twice per layer forward and twice backward;
    the 2D grid broadcasts blocks of both operands of every projection (SUMMA); ``seq``
    passes key/value blocks round the ring (Ulysses: four all-to-alls); ``pipe`` sends
    a stage's output forward and its gradient back per microbatch; ``expert`` sends a
    MoE layer's fixed buffers out and back forward and backward (``expert_rows``), and
    there the experts' gradients all-reduce over ``data`` and the rest over ``data x
    expert``, and ``tensor`` all-reduces the rows' outputs (each device computes a
    slice of the experts' width) forward and their gradient backward.
Overlap (stated, one rule per kind of traffic, each compute second hides at most once)
    the ring's key/value passing (traffic keyed ``seq`` alone, ring or RSA) runs under
    attention's own compute: exposed ``t - comm_overlap x min(t, attention)``; weight
    gathers and gradient reductions (``data``, ``fsdp``, ``fsdp+seq``, ...) run under
    the rest of the step's compute (XLA's async collectives) the same way; ``tensor``
    and ``pipe`` traffic and Ulysses' all-to-alls sit on the critical path (a layer
    waits for its all-reduce, a stage for its input, attention for its heads) and are
    fully exposed. ``comm_overlap`` is the profile's: 1 on GPUs, 0 on XLA:CPU.
Bubble
    the idle fraction of the schedule actually built
    (``jaxpar.parallel.pipeline_schedule``): the critical-path time divided by
    ``1 - bubble``. A pipeline in lockstep (``Layout.lockstep``: ring or RSA attention
    over ``seq``, or a 2D grid, inside its stages) runs a forward part at every tick
    where any device has a forward and a backward part where any has a backward, every
    device alike (``jaxpar.parallel.pipeline.lockstep_tick``): there the step is those
    parts' sum over the schedule's ticks (``lockstep_ticks``; the same as the bubble's
    for GPipe, whose ticks are all forwards or all backwards, up to twice it for 1F1B's
    mixed ones), a backward taking ``BACKWARD_RATIO`` forwards.
Offload
    host<->device bytes per step (host parameters fetched each pass, gradients and
    updates of a host optimizer) at ``host_bandwidth``, overlapped with compute as
    above.

Compiled on XLA:CPU, a bfloat16 model's activation collectives run in float32 (the
profiler's docstring): for a GPU profile the ``tensor``, ``seq`` and ``pipe`` bytes of a
CPU-compiled bfloat16 program are halved.
"""

from __future__ import annotations

import dataclasses
import functools

from jaxpar.parallel import pipeline_schedule
from jaxpar.planning.hardware import Hardware
from jaxpar.planning.layout import Layout
from jaxpar.planning.memory import layout_shards, local_sizes, schedule_figures
from jaxpar.planning.workload import Workload

BACKWARD_RATIO = 2.0  # backward / forward time: 4 and 2 FLOPs per parameter and token
AXIS_ORDER = ("data", "fsdp", "expert", "pipe", "seq", "tensor", "tensor_row", "tensor_col")
CRITICAL = ("tensor", "tensor_row", "tensor_col", "pipe", "expert")  # exposed, whatever the overlap


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float
    communication: float  # exposed
    bubble: float
    offload: float
    latency: float
    flops: float  # per device, executed (recompute included)

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.bubble + self.offload + self.latency

    def split(self) -> dict[str, float]:
        return {"compute": self.compute, "communication": self.communication + self.latency,
                "bubble": self.bubble, "offload": self.offload}


def recompute_flops(work: Workload, remat: str, stages: bool = False) -> tuple[float, float]:
    """``(matmul, attention)`` FLOPs the remat policy adds per step (all devices), and
    with ``stages`` those of jaxpar's pipeline, whose stage backward recomputes the
    stage's forward (the head's too, on the last stage) from its stashed input."""
    m = work.model
    matmul = attention = 0.0
    if remat == "full":
        matmul += 2 * (work.matmul_params - m.vocab_size * m.dim) * work.tokens
        attention += work.attention_flops() / 3
    elif remat == "dots_no_batch":
        attention += work.attention_flops() / 3
    if stages:
        matmul += 2 * work.matmul_params * work.tokens
        attention += work.attention_flops() / 3
    return matmul, attention


def expert_rows(work: Workload, layout: Layout, ragged: bool = False) -> float:
    """Rows one device's grouped matmuls run over per MoE layer per step, all
    microbatches: its own tokens (the batch split over data, fsdp and expert; whole over
    ``seq``, which repeats the experts' work, and over ``tensor``, whose devices each
    take a slice of the experts' width) times ``k``; with expert parallelism the fixed
    per-destination buffers' ``W x min(k, E / W)`` rows a token
    (``jaxpar.models.moe.exchange``), or with ``ragged`` (a GPU's or TPU's
    ``exchange_ragged``) ``k`` rows a token, an even load."""
    return work.tokens / layout.data_ways * work.routed_rows(layout.expert, ragged)


def flops(work: Workload, layout: Layout, ragged: bool = False, own_pipeline: bool = True) -> tuple[float, float]:
    """``(matmul, attention)`` FLOPs per device per step, recompute included (with
    ``own_pipeline``, a ``pipe > 1`` layout's as jaxpar's pipeline recomputes); a MoE
    layer's routed experts as built (``expert_rows``), not an even share of the batch."""
    stages = own_pipeline and layout.pipe > 1
    extra_mm, extra_att = recompute_flops(work, layout.remat, stages)
    matmul = work.model_flops() - work.attention_flops() + extra_mm
    attention = work.attention_flops() + extra_att
    if not work.moe_layers:
        return matmul / layout.devices, attention / layout.devices
    # a matmul's forward is 2 FLOPs a weight a row
    passes = 6 + (2 if layout.remat == "full" else 0) + (2 if stages else 0)
    per_row = passes * work.expert_params * work.moe_layers
    routed = work.tokens * work.model.moe.experts_per_token * per_row
    mine = expert_rows(work, layout, ragged) * per_row / (layout.tensor_ways * layout.pipe)  # a stage's MoE layers
    return (matmul - routed) / layout.devices + mine, attention / layout.devices


def elementwise_bytes(work: Workload, layout: Layout, own_pipeline: bool = True) -> float:
    """Device memory traffic of the step's elementwise work, per device: ten passes over
    each ``[b, t, D]`` and four over each ``[b, t, F]`` per layer forward (norms,
    residuals, RoPE, the gating), twice that backward, once more under full remat and
    once more in jaxpar's pipeline (``own_pipeline``); four float32 passes over the
    logits; seven over every parameter shard (AdamW)."""
    m = work.model
    x = local_sizes(work, layout)
    c = m.compute_dtype.itemsize
    passes = 3 + (1 if layout.remat == "full" else 0) + (1 if own_pipeline and layout.pipe > 1 else 0)
    split = layout.microbatches if layout.pipe > 1 else layout.grad_accum
    per_layer = (10 * x["norm"] + 4 * x["btf"]) * c * passes
    layers = m.layers / layout.pipe
    s = layout_shards(work, layout)
    return split * (per_layer * layers + 4 * 4 * x["logits"]) + 7 * 4 * s["elements"]


def comm_bytes(work: Workload, layout: Layout, ragged: bool = False) -> tuple[dict[str, float], dict[str, int]]:
    """Counted bytes each device sends per step, and collectives, by mesh-axis key
    (``ragged``: a MoE layer's exchange sends its real rows, ``expert_rows``)."""
    m = work.model
    c = m.compute_dtype.itemsize
    x = local_sizes(work, layout)
    s = layout_shards(work, layout)
    params, grads = s["params"], s["elements"] * 4
    split = layout.microbatches if layout.pipe > 1 else layout.grad_accum
    layers = m.layers / layout.pipe
    full = layout.remat == "full"
    sent: dict[str, float] = {}
    count: dict[str, int] = {}

    def add(key, nbytes, n):
        if nbytes > 0:
            sent[key] = sent.get(key, 0.0) + nbytes
            count[key] = count.get(key, 0) + int(n)

    d, f, sq, w = layout.data, layout.fsdp, layout.seq, layout.expert
    # the experts' gradients all-reduce over data; the rest over data x expert, which
    # splits the batch too
    experts = 4 * work.moe_layers * work.expert_params * (m.moe.experts if work.moe_layers else 0) / (
        w * f * layout.tensor_ways)
    rest = "+".join(a for a, n in (("data", d), ("expert", w)) if n > 1)  # the profiler's key: axes above 1
    for key, n, nbytes in (("data", d, experts), (rest, d * w, grads - experts)):
        if n > 1:
            add(key, 2 * (n - 1) / n * nbytes, 1)
    for axis, n in (("fsdp", f), ("seq", sq)):
        if n > 1:
            gathers = 2 + (1 if full else 0)
            add(axis, split * (gathers * (n - 1) * params + (n - 1) * grads), split * layers * (gathers + 1))
    if isinstance(layout.tensor, tuple):
        q = layout.tensor[0]
        width = m.dim / q
        blocks = (x["btd"] * c + width * (m.heads * m.head_dim / q) * c) * 4 + \
                 (x["btd"] * c + width * (m.mlp_dim / q) * c) * 3  # 4 attention + 3 MLP projections
        add("tensor_row+tensor_col", split * layers * 3 * (q - 1) * blocks, split * layers * 42)
    elif layout.tensor > 1:
        tp = layout.tensor
        per_layer = (4 + (2 if full else 0)) * 2 * (tp - 1) / tp * x["btd"] * c
        add("tensor", split * (layers * per_layer + 2 * 2 * (tp - 1) / tp * x["btd"] * c),
            split * (layers * (6 if full else 4) + 2))
    if sq > 1:
        passes = 3 + (1 if full else 0)
        if layout.seq_impl == "ulysses":
            per_layer = passes * (sq - 1) / sq * (2 * x["q"] + 2 * x["kv"]) * c  # q, k, v in, the output back
            add("seq", split * layers * per_layer, split * layers * 4 * passes)
        else:
            per_layer = passes * (sq - 1) * 2 * x["kv"] * c
            add("seq", split * layers * per_layer, split * layers * passes * (sq - 1))
    if layout.pipe > 1:
        add("pipe", 2 * layout.microbatches * layout.virtual_stages * x["btd"] * c,
            2 * layout.microbatches * layout.virtual_stages)
    moe_here = work.moe_layers / layout.pipe  # the MoE layers of a device's stages
    if work.moe_layers and layout.expert > 1:  # each buffer out and back, forward and backward
        w, exchanges = layout.expert, 4 + (2 if full else 0)
        add("expert", exchanges * (w - 1) / w * expert_rows(work, layout, ragged) * m.dim * c * moe_here,
            split * moe_here * (exchanges + 1 + (1 if full else 0)))
    if work.moe_layers and layout.tensor_ways > 1:  # the rows' outputs summed over the width's slices
        tp, rows = layout.tensor_ways, work.tokens / layout.data_ways
        passes = 2 + (1 if full else 0)  # the output forward, the input's gradient backward
        add("tensor", passes * 2 * (tp - 1) / tp * rows * m.dim * c * moe_here,
            split * moe_here * passes)
    return sent, count


def bandwidth(key: str, sizes: dict[str, int], hw: Hardware, devices_per_node: int) -> float:
    """Bytes/s one device sends over the axes ``key`` names (``data+fsdp``): intra-node
    when their devices all sit in one node, else inter-node."""
    inside = _within_node(key, tuple(sizes.items()), devices_per_node)
    return hw.intra_node_bandwidth if inside else hw.inter_node_bandwidth


@functools.lru_cache(maxsize=65536)
def _within_node(key: str, sizes: tuple[tuple[str, int], ...], devices_per_node: int) -> bool:
    """Whether the devices of the axes ``key`` names all sit in one node."""
    sizes = dict(sizes)
    axes = [a for a in key.split("+") if a in sizes]
    if not axes:
        return False
    order = [a for a in AXIS_ORDER if a in sizes]
    outer = min(order.index(a) for a in axes)
    span = 1
    for a in order[outer:]:
        span *= sizes[a]
    return span <= devices_per_node


@functools.lru_cache(maxsize=4096)
def lockstep_ticks(kind: str, pipe: int, microbatches: int, virtual: int) -> float:
    """A lockstep pipeline's time over its useful work: the sum over the schedule's
    ticks of a forward part (where any device has a forward) and a backward part (where
    any has a backward), over each device's ``M V`` forwards and backwards."""
    s = pipeline_schedule.build(kind, pipe, microbatches, virtual)
    f, b = (s.op == pipeline_schedule.FORWARD).any(axis=1), (s.op == pipeline_schedule.BACKWARD).any(axis=1)
    return float((f.sum() + BACKWARD_RATIO * b.sum()) / (microbatches * virtual * (1 + BACKWARD_RATIO)))


def offload_bytes(work: Workload, layout: Layout) -> float:
    s = layout_shards(work, layout)
    moved = 0.0
    if layout.offload_params == "host":
        moved += (2 + (1 if layout.remat == "full" else 0)) * layout.grad_accum * s["params"]
    if layout.offload_optimizer == "host":
        moved += s["elements"] * 4 + s["params"]  # gradients to the host, parameters back
    return moved


def step_time(work: Workload, layout: Layout, hw: Hardware, *, devices_per_node: int,
              compiled: dict | None = None, compiled_backend: str = "cpu", own_pipeline: bool = True) -> StepTime:
    """The predicted ``StepTime`` of ``layout``; ``compiled``: the profiler's figures of
    its program, whose ``collectives_by_axes`` and ``collective_counts_by_axes`` replace
    the counted traffic, but for a pipeline (``pipe > 1``): its tick loop holds each
    device's forward, backward and head as branches of conditionals, which the profiler
    counts as if every branch ran at every tick (its stated upper bound: 10-20x the
    traffic of ``pipe=2`` programs on 16 devices, BENCHMARKS "Planning"), so there the
    count stands. ``own_pipeline``: a ``pipe > 1`` layout as jaxpar's pipeline runs it
    (in lockstep where ``Layout.lockstep``, and its stage backward recomputing the
    stage's forward); ``False``: as another library's does (Megatron's, for published
    runs), each device running its own operation and no forward recomputed but by the
    remat policy."""
    m = work.model
    # off a CPU, expert parallelism exchanges real rows (jax.lax.ragged_all_to_all) and the
    # grouped matmuls skip the buffers' empty rows: k rows a token
    ragged = hw.name != "cpu"
    matmul, attention = flops(work, layout, ragged, own_pipeline)
    peak = hw.peak(m.dtype)
    t_matmul = matmul / (peak * hw.efficiency["matmul"])
    t_attention = attention / (peak * hw.efficiency["attention"])
    compute = t_matmul + t_attention + elementwise_bytes(work, layout, own_pipeline) / hw.hbm_bandwidth
    if compiled and "collectives_by_axes" in compiled and layout.pipe == 1:
        sent = dict(compiled["collectives_by_axes"])
        count = dict(compiled.get("collective_counts_by_axes", {}))
        if compiled_backend == "cpu" and hw.name != "cpu" and m.dtype != "float32":
            sent = {k: v / 2 if any(a in k for a in ("tensor", "seq", "pipe")) else v for k, v in sent.items()}
        if ragged and compiled_backend == "cpu" and "expert" in sent:  # XLA:CPU's program sends padded buffers
            sent["expert"] = comm_bytes(work, layout, ragged)[0].get("expert", 0.0)
    else:
        sent, count = comm_bytes(work, layout, ragged)
    sizes = layout.mesh_sizes
    critical = ring = overlapped = 0.0
    for key, nbytes in sent.items():
        t = nbytes / bandwidth(key, sizes, hw, devices_per_node)
        if any(a in key.split("+") for a in CRITICAL) or (key == "seq" and layout.seq_impl == "ulysses"):
            critical += t  # a layer waits for its all-reduce, a stage for its input, attention for its all-to-all
        elif key == "seq":
            ring += t  # the ring's key/value blocks: under attention's own compute
        else:
            overlapped += t  # weights and gradients: under the step's compute
    exposed_ring = ring - hw.comm_overlap * min(ring, t_attention)
    exposed_overlapped = overlapped - hw.comm_overlap * min(overlapped, compute - min(ring, t_attention))
    latency = sum(count.values()) * hw.collective_latency
    bubble = 0.0
    if own_pipeline and layout.lockstep:  # the bubble then also counts the parts a device computes for nothing
        ticks = lockstep_ticks(layout.schedule, layout.pipe, layout.microbatches, layout.virtual_stages)
        bubble = (compute + critical) * (ticks - 1)
    elif layout.pipe > 1:
        fraction, _ = schedule_figures(layout.schedule, layout.pipe, layout.microbatches, layout.virtual_stages)
        bubble = (compute + critical) * fraction / (1 - fraction)
    transfer = offload_bytes(work, layout) / hw.host_bandwidth
    offload = transfer - hw.comm_overlap * min(transfer, compute)
    return StepTime(compute=compute, communication=critical + exposed_ring + exposed_overlapped, bubble=bubble,
                    offload=offload, latency=latency, flops=matmul + attention)
