"""The analytic memory model: bytes per device of one train step, by part, for any
layout and device count, without compiling.

Parts (all per device):

``params`` / ``optimizer``
    the parameter shards and Adam's two moments (the parameters' dtype), exact from
    the model's annotations and rules (``workload.shards``); in host memory instead
    with ``offload.params`` / ``offload.optimizer`` = host (then ``params`` counts the
    layers fetched to the device at once, ``prefetch + 1``).
``batch``
    the step's five int32 ``[B, T]`` inputs, split over the data axes and ``seq``.
``gradients``
    one gradient per parameter shard in float32, twice with gradient accumulation
    (the running sum and a microbatch's).
``activations``
    what each layer keeps for its backward pass, by remat policy (below), times the
    layers a device runs; in a pipeline (``jaxpar.parallel.pipeline``: a stage's backward
    recomputes it from its stashed input) the stage inputs of the most microbatches in
    flight (from the schedule built) plus one stage's saved set.
``workspace``
    the largest transient: the logits, their exponentials and their gradient
    (``[b, t, V / tensor]`` in float32, three copies; on a q x q grid SUMMA's head also
    keeps its q block products, q + 2 copies), or a layer's own working set while it
    recomputes and differentiates (1.5 times the ``none`` policy's saved set: the factor
    that fits the compiled ``1b`` programs best), or RSA's backward over its float32
    scores (``RSA_SCORE_COPIES`` of them), whichever is larger; plus
    one layer's gathered weights under FSDP or ``seq``, and a 2D grid's weight panels
    (twice: the next layer's gather overlaps), and
    float32 copies of the vocabulary table whole where ``fsdp`` or ``seq`` splits it
    (the head's gathered weight, the lookup's gradient before its reduce-scatter; three
    in a pipeline, which also holds the gathered lookup table, and on a 2D grid, whose
    head moves weight panels; none without FSDP, ``seq``, ``pipe`` or a grid, where the
    head is the parameter itself and its gradient is counted already).

What a layer keeps (local shapes: ``b`` rows, ``t = T / seq`` tokens, heads and MLP
width split over ``tensor``; with Megatron SP the residual stream's tokens too):
``full`` its input ``[b, t, D]``; ``dots_no_batch`` also the projections' outputs (q,
k, v, the attention output projection, gate and up; the down projection's output is
the next layer's input; on a ``q x q`` grid q, k, v, gate and up as SUMMA's ``q``
float32 block products each, which the dots policies keep in place of their sum,
measured on ``small``'s 2 x 2 and 4 x 4 grids: the layer scan's saved stack,
``bench/plan_memory_explain.py``); ``dots`` also the attention scores ``[b, N, t, T]`` (with ring
or RSA attention over ``seq``, each block's once, not their softmax) and the attention
output; ``none`` also the norms' outputs, the rotated q and k, the softmax
probabilities (not with attention over ``seq``: Ulysses' keeps its scores only, and a
ring's loop nothing more than under ``dots``) and the MLP's elementwise results.
Computed in the compute dtype; XLA:CPU computes a bfloat16 matmul in float32 and keeps
its float32 result, and keeps float32 copies of the MLP's bfloat16 elementwise results,
so ``backend="cpu"`` counts those at 4 bytes (the figures a CPU compile reports).

Accuracy against compiled programs is measured, not assumed: ``bench/plan_memory.py``
(BENCHMARKS.md, "Planning") compares it with XLA's buffer assignment for a sample of
the candidates of ``tiny``, ``small`` and ``1b`` on 8 and 16 simulated devices. The
planner uses this model to rank and prune every candidate, then compiles the best ones
for their exact figures (``jaxpar.planning.search``).
"""

from __future__ import annotations

import functools

from jaxpar.parallel import pipeline_schedule
from jaxpar.planning.layout import Layout
from jaxpar.planning.workload import Workload, shards

PARTS = ("params", "optimizer", "batch", "gradients", "activations", "workspace")


_LAST: dict[str, tuple] = {}  # the last (work, layout) of each helper: the cost model asks again at once


def layout_shards(work: Workload, layout: Layout) -> dict[str, int]:
    """``shards`` of ``layout``'s mesh (``LayoutError`` where a dimension does not divide)."""
    last = _LAST.get("shards")
    if last is not None and last[0] is work and last[1] is layout:
        return last[2]
    out = shards(work, layout.mesh_sizes, layout.sequence_parallel)
    _LAST["shards"] = (work, layout, out)
    return out


def local_sizes(work: Workload, layout: Layout) -> dict[str, float]:
    """Local activation sizes (elements) of one layer for one microbatch (not to be
    modified: the last one is handed out again)."""
    last = _LAST.get("sizes")
    if last is not None and last[0] is work and last[1] is layout:
        return last[2]
    out = _local_sizes(work, layout)
    _LAST["sizes"] = (work, layout, out)
    return out


def _local_sizes(work: Workload, layout: Layout) -> dict[str, float]:
    m = work.model
    q = layout.tensor[0] if isinstance(layout.tensor, tuple) else 1
    tp = layout.tensor_ways if not isinstance(layout.tensor, tuple) else q
    split = layout.microbatches if layout.pipe > 1 else layout.grad_accum
    b = work.batch_size / (layout.data_ways * split)
    t = work.seq_len / layout.seq
    heads = m.heads / tp
    kv = m.kv_heads / tp if m.kv_heads % tp == 0 else m.kv_heads
    mlp = m.mlp_dim / tp
    width = m.dim / q  # the 2D grid splits the features too
    norm_tokens = b * t / (tp if layout.sequence_parallel else 1)
    if layout.seq > 1 and layout.seq_impl == "ulysses":  # heads split, the whole length local
        scores = b * heads / layout.seq * work.seq_len * work.seq_len
    elif layout.seq > 1:  # the ring's blocks, one at a time (its backward recomputes them)
        scores = b * heads * t * t
    else:
        scores = b * heads * t * work.seq_len
    out = {"ring_scores": b * heads * t * work.seq_len, "btd": b * t * width, "norm": norm_tokens * width,
           "q": b * t * heads * m.head_dim,
           "kv": b * t * kv * m.head_dim, "btf": b * t * mlp, "scores": scores,
           "logits": b * t * m.vocab_size / tp}
    if work.moe_layers:  # a MoE layer's rows: the device's tokens whole over seq and tensor
        e, rows = m.moe, b * work.seq_len
        out["moe_tokens"] = rows * e.experts_per_token  # the permuted copies
        out["moe_rows"] = rows * work.routed_rows(layout.expert)
        # the dense MLP's width, the layers' mean (a MoE layer's is its shared experts')
        width = (m.layers - work.moe_layers) * m.mlp_dim + work.moe_layers * e.shared_experts * e.expert_width
        out["btf"] = b * t * width / m.layers / tp
    return out


def layer_saved(work: Workload, layout: Layout, *, backend: str = "gpu", remat: str | None = None,
                x: dict[str, float] | None = None) -> float:
    """Bytes one layer keeps for its backward pass for one microbatch (``remat``: in
    place of the layout's; ``x``: its ``local_sizes``, where known); a MoE model's
    layers' mean (``moe_saved``)."""
    m = work.model
    remat = remat or layout.remat
    c = m.compute_dtype.itemsize
    mm = 4 if backend == "cpu" else c  # a matmul's result (XLA:CPU: float32)
    x = x or local_sizes(work, layout)
    gates = 2 if m.mlp == "swiglu" else 1
    saved = x["norm"] * c  # the layer's input (the scan's carry; split over tensor with SP)
    if remat == "full":
        return saved
    if work.moe_layers:
        saved += moe_saved(work, layout, x, c, mm, backend) * work.moe_layers / m.layers
    # q, k, v, the attention output projection's result (after SP's reduce-scatter), the
    # MLP's gate and up; the down projection's result is the next layer's input. On a
    # q x q grid the dots policies keep each of q, k, v, gate and up as SUMMA's q float32
    # block products (``product_0 .. product_{q-1}``: dots), not their sum, which they
    # recompute; ``none`` keeps the sum.
    grid = layout.tensor[0] if isinstance(layout.tensor, tuple) and remat != "none" else 1
    saved += (x["q"] + 2 * x["kv"] + gates * x["btf"]) * (grid * 4 if grid > 1 else mm) + x["norm"] * mm
    if remat == "dots_no_batch":
        return saved
    ring = layout.seq > 1 and layout.seq_impl != "ulysses"  # every block's scores, once
    saved += (x["ring_scores"] if ring else x["scores"]) * mm + x["q"] * mm
    if remat == "dots" or ring:  # a ring's loop keeps no more without remat
        return saved
    # none: the rest, the softmax in float32; XLA:CPU also keeps the MLP's elementwise
    # results in float32 when it computes them from bfloat16
    probabilities = x["scores"] * 4 if layout.seq == 1 else 0.0  # Ulysses' attention keeps its scores only
    return (saved + 2 * x["norm"] * (4 + c) + (x["q"] + x["kv"]) * c + probabilities
            + 2 * x["btf"] * c + (4 * x["btf"] * 4 if mm > c else 0))


def moe_saved(work: Workload, layout: Layout, x: dict[str, float], c: int, mm: int, backend: str) -> float:
    """Bytes a MoE layer's routed experts keep for the backward pass (any remat policy
    but ``full``: a grouped matmul is no dot the ``dots`` policies save, so they keep
    what ``none`` does): the permuted copies, the buffers sent and received and the rows'
    output (``D`` each), the gate and up results (``F / tensor`` each, matmul results). XLA:CPU
    has no grouped matmul: ``jax.lax.ragged_dot``'s generic form masks the rows into one
    dense ``[E / expert, rows, D]`` operand (``F`` for the down projection) and keeps it."""
    m = work.model
    gates = 2 if m.mlp == "swiglu" else 1
    width = m.moe.expert_width / layout.tensor_ways  # each tensor device's slice
    saved = x["moe_tokens"] * m.dim * c + x["moe_rows"] * (3 * m.dim * c + gates * width * mm)
    if backend == "cpu":
        saved += m.moe.experts / layout.expert * x["moe_rows"] * (m.dim + width) * c
    return saved


@functools.lru_cache(maxsize=4096)
def schedule_figures(kind: str, pipe: int, microbatches: int, virtual: int) -> tuple[float, int]:
    """``(bubble, most microbatches in flight on a device)`` of the schedule built."""
    schedule = pipeline_schedule.build(kind, pipe, microbatches, virtual)
    return schedule.bubble(), int(schedule.in_flight().max())


def in_flight(layout: Layout) -> int:
    """Microbatches whose activations a device holds at once."""
    if layout.pipe == 1:
        return 1
    return schedule_figures(layout.schedule, layout.pipe, layout.microbatches, layout.virtual_stages)[1]


# RSA's backward holds its float32 scores [b, N, t, T] (the local queries against every
# key) about six times at once on XLA:CPU (1b seq=2 tensor=4 rsa remat=full: a pad and a
# convert of them, two copies each, and the softmax's div, sum and max; 28 GiB of a 32 GiB
# peak, bench/plan_memory_explain.py). 6 fits the four 1b RSA rows of BENCHMARKS.md's
# memory sample best (-14% to +7%, from -52% to -11%); the smaller configs' scores are
# too small to matter.
RSA_SCORE_COPIES = 6


def estimate(work: Workload, layout: Layout, *, backend: str = "gpu", prefetch: int = 1) -> dict[str, float]:
    """Bytes per device by ``PARTS``, plus ``host`` (state in host memory) and
    ``device`` (the sum of the parts: the step's peak on the device)."""
    m = work.model
    s = layout_shards(work, layout)
    layers_here = m.layers / layout.pipe
    per_layer = s["layer_params"] / layers_here  # one stacked layer's parameter shard
    params_dev = s["params"]
    host = 0.0
    if layout.offload_params == "host":
        fetched = min(prefetch + 1, m.layers) * per_layer
        host += s["params"]
        params_dev = fetched
    optimizer = 2 * s["params"]
    if layout.offload_optimizer == "host":
        host += optimizer
        optimizer = 0.0
    x = local_sizes(work, layout)
    batch = 5 * 4 * work.batch_size * work.seq_len / (layout.data_ways * layout.seq)
    grads = 4 * s["elements"] * (2 if layout.grad_accum > 1 else 1)  # float32
    saved = layer_saved(work, layout, backend=backend, x=x)
    if layout.pipe == 1:
        activations = saved * layers_here
    else:  # the stash: each in-flight microbatch's stage input; a stage's backward recomputes it
        activations = in_flight(layout) * x["btd"] * m.compute_dtype.itemsize + saved * layers_here / layout.virtual_stages
    one_layer = layer_saved(work, layout, backend=backend, remat="none", x=x)
    # One layer's weights gathered for its use (twice: the next one's gather overlaps):
    # over fsdp and seq, and on a 2D grid over tensor_row too (SUMMA's panels).
    ways = layout.fsdp * layout.seq * (layout.tensor[0] if isinstance(layout.tensor, tuple) else 1)
    gathered = 2 * per_layer * ways if ways > 1 else 0.0
    tp = layout.tensor[0] if isinstance(layout.tensor, tuple) else layout.tensor_ways
    # The vocabulary tables whole over fsdp: the head gathered and the lookup table's
    # gradient before its reduce-scatter; a pipeline's step also holds the gathered lookup
    # table, and SUMMA's head a moving panel of the head's weight.
    grid = isinstance(layout.tensor, tuple)
    tables = (3 if layout.pipe > 1 or grid else 2) * 4 * m.vocab_size / tp * m.dim
    if layout.fsdp * layout.seq == 1 and layout.pipe == 1 and not grid:
        tables = 0.0  # not split: the head is the parameter, its gradient counted already
    # The logits, their exponentials and gradient; SUMMA's head keeps its q block
    # products and their sum (q + 2 in all).
    copies = layout.tensor[0] + 2 if isinstance(layout.tensor, tuple) else 3
    rsa = RSA_SCORE_COPIES * 4 * x["ring_scores"] if layout.seq > 1 and layout.seq_impl == "rsa" else 0.0
    workspace = max(copies * 4 * x["logits"], 1.5 * one_layer, rsa) + gathered + tables
    parts = {"params": params_dev, "optimizer": optimizer, "batch": batch, "gradients": grads,
             "activations": activations, "workspace": workspace}
    parts["device"] = sum(parts.values())
    parts["host"] = host
    return parts
