"""Candidate layouts: every way to run one training step on N devices that the planner
weighs, and the rules that prune the ones that cannot run.

A candidate is a ``jaxpar.layout.Layout``, the one type a training config holds too: the
mesh with everything else that changes the compiled step (the pipeline's schedule,
microbatches and virtual stages, the sequence-parallel attention, Megatron sequence
parallelism, the remat policy, gradient accumulation and where the parameters and
optimizer state live). The planner's are concrete: ``data`` set, ``microbatches`` set
with ``pipe`` > 1 (None otherwise), offload ``device`` or ``host``, the mean reduction.
``Layout.overrides()`` is the ``jaxpar-train`` settings that select one.

``enumerate_layouts`` walks the space in nested loops whose ranges are BOUNDS, so what
a bound excludes is never generated (``BOUNDS`` says each); every layout it does
generate is either kept or pruned by a RULE, counted by rule (``RULES``). A tensor (or
any) group across nodes is not pruned: the cost model charges it the inter-node links,
and the ranking keeps tensor inside a node where those are slow.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterator

from jaxpar.layout import Layout, from_overrides  # noqa: F401 - the planner's candidates are Layouts
from jaxpar.models.config import ModelConfig
from jaxpar.parallel.pipeline_schedule import KINDS as SCHEDULES
from jaxpar.placement.execution import SEQUENCE_IMPLS

REMATS = ("none", "dots_no_batch", "dots", "full")
PLACES = ("device", "host")

BOUNDS = (
    "tensor <= heads (1D), q <= heads (2D q x q)",
    "pipe <= layers, and pipe x virtual_stages divides layers (MoE groups of model.moe.every, with every > 1)",
    "seq <= seq_len / 2",
    "data x fsdp <= batch_size (every data-parallel rank gets a row)",
    "grad_accum and microbatches: powers of two that divide the rows of a data-parallel rank",
    "microbatches <= 8 x pipe (the bubble is within 1/8 of its floor there)",
    "virtual_stages in (2, 4) with the interleaved schedule only",
)

RULES = {
    "heads": "heads not divisible by tensor (or by seq with Ulysses)",
    "mlp": "mlp_dim not divisible by tensor",
    "vocab": "vocab_size not divisible by tensor",
    "tensor_2d": "2D tensor grid: heads, mlp_dim and the rows must divide by q",
    "batch": "batch_size / grad_accum (or / microbatches) not divisible by the data-parallel degree",
    "seq_len": "seq_len not divisible by 2 x seq (zigzag ring layout)",
    "microbatches": "1F1B and interleaved need microbatches >= pipe (interleaved: a multiple of pipe)",
    "sequence_parallel": "Megatron sequence parallelism needs 1D tensor > 1",
    "offload": "offload with the interleaved schedule (its layers are stored reordered; not yet)",
    "dominated": "host offload or more grad_accum where the layout fits on the device with room to spare "
                 "(never faster, never ranked first)",
    "experts": "model.moe.experts not divisible by expert",
}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two(limit: int, dividing: int) -> list[int]:
    """1, 2, 4, ... up to ``limit`` that divide ``dividing``."""
    out, k = [], 1
    while k <= limit:
        if dividing % k == 0:
            out.append(k)
        k *= 2
    return out


@dataclasses.dataclass
class Space:
    """What ``enumerate_layouts`` may choose beyond the mesh (defaults: everything), and
    ``base``: the layout every candidate starts from, whose settings the planner does not
    choose (the replicas' reduction, ``remat_names``) carry over (a config's own)."""

    remats: tuple[str, ...] = REMATS
    schedules: tuple[str, ...] = SCHEDULES
    seq_impls: tuple[str, ...] = SEQUENCE_IMPLS
    offload: bool = True
    tensor_2d: bool = True
    max_grad_accum: int = 16
    base: Layout = Layout()


def _meshes(devices: int, model: ModelConfig, batch_size: int, seq_len: int, tensor_2d: bool,
            expert: int = 1) -> Iterator[dict]:
    """Every mesh within the BOUNDS. ``expert``: the config's ``mesh.expert`` where above
    1, kept as given; else, for a MoE model, every ``expert`` that divides its experts and
    the devices (1 for a dense one). The other axes share the devices it leaves."""
    if expert == 1 and model.moe is not None:
        for e in divisors(math.gcd(devices, model.moe.experts)):
            yield from _meshes_beside(devices, model, batch_size, seq_len, tensor_2d, e)
    else:
        yield from _meshes_beside(devices, model, batch_size, seq_len, tensor_2d, expert)


def _meshes_beside(devices: int, model: ModelConfig, batch_size: int, seq_len: int, tensor_2d: bool,
                   expert: int) -> Iterator[dict]:
    devices //= expert
    tensors: list = [t for t in divisors(devices) if t <= model.heads]
    if tensor_2d:
        tensors += [(q, q) for q in range(2, model.heads + 1) if devices % (q * q) == 0]
    for tensor in tensors:
        rest = devices // (math.prod(tensor) if isinstance(tensor, tuple) else tensor)
        for seq in divisors(rest):
            if seq > seq_len // 2:
                break
            for pipe in divisors(rest // seq):
                if pipe > model.stacked_layers:  # a stage holds whole stacked units (MoE groups)
                    break
                for fsdp in divisors(rest // seq // pipe):
                    data = rest // seq // pipe // fsdp
                    if data * fsdp * expert > batch_size:
                        continue
                    yield {"data": data, "fsdp": fsdp, "expert": expert, "pipe": pipe, "seq": seq, "tensor": tensor}


def mesh_rule(mesh: dict, model: ModelConfig, seq_len: int) -> str | None:
    """The RULE a mesh breaks whatever the other settings, or None."""
    tensor = mesh["tensor"]
    if isinstance(tensor, tuple):
        q = tensor[0]
        if model.heads % q or model.mlp_dim % q or model.vocab_size % q or model.dim % q:
            return "tensor_2d"
    else:
        if model.heads % tensor:
            return "heads"
        if model.mlp_dim % tensor:
            return "mlp"
        if model.vocab_size % tensor:
            return "vocab"
    if mesh["seq"] > 1 and seq_len % (2 * mesh["seq"]):
        return "seq_len"
    if model.moe is not None and model.moe.experts % mesh["expert"]:
        return "experts"
    return None


def enumerate_layouts(devices: int, model: ModelConfig, batch_size: int, seq_len: int, *,
                      space: Space = Space(), roomy: Callable[[Layout], bool] | None = None,
                      ) -> tuple[list[Layout], collections.Counter]:
    """``(kept layouts, pruned count by RULES key)``. ``roomy(layout)`` (a kept layout,
    its state on the device): True when it fits with room to spare, which prunes (rule
    ``dominated``) its host-offload variants and, at ``grad_accum=1``, its variants with
    more gradient accumulation: each is the same step plus host transfers or more
    collectives, never predicted faster, and ranked after it in a tie."""
    kept: list[Layout] = []
    pruned: collections.Counter = collections.Counter()
    for mesh in _meshes(devices, model, batch_size, seq_len, space.tensor_2d, space.base.expert):
        rule = mesh_rule(mesh, model, seq_len)
        if rule:
            pruned[rule] += _count(_choices(mesh, model, batch_size, space), space)
            continue
        for layout, rule in _options(mesh, model, batch_size, space, roomy):
            if rule:
                pruned[rule] += 1
            else:
                kept.append(layout)
    return kept, pruned


def _choices(mesh: dict, model: ModelConfig, batch_size: int, space: Space) -> tuple:
    """``(base layout, (schedule, microbatches, virtual) choices, seq_impls, sequence
    parallelism, grad_accums, host-offload places)`` of a mesh."""
    base = dataclasses.replace(space.base, **mesh)
    rows = batch_size // base.data_ways if batch_size % base.data_ways == 0 else 0
    if mesh["pipe"] > 1:
        pipes = [(s, m, v) for s in space.schedules for v in ((2, 4) if s == "interleaved" else (1,))
                 if model.stacked_layers % (mesh["pipe"] * v) == 0
                 for m in powers_of_two(min(max(rows, 1), 8 * mesh["pipe"]), max(rows, 1))]
        accums = [1]
    else:
        pipes = [("1f1b", None, 1)]
        accums = powers_of_two(min(max(rows, 1), space.max_grad_accum), max(rows, 1))
    seq_impls = space.seq_impls if mesh["seq"] > 1 else ("ring",)
    one_d = not isinstance(mesh["tensor"], tuple) and mesh["tensor"] > 1
    hosts = [(p, o) for p in PLACES for o in PLACES][1:] if space.offload else []
    return base, pipes, seq_impls, ((False, True) if one_d else (False,)), accums, hosts


def _count(choices: tuple, space: Space) -> int:
    """How many layouts ``_options`` yields for these choices."""
    _, pipes, seq_impls, sps, accums, hosts = choices
    return len(pipes) * len(seq_impls) * len(sps) * len(space.remats) * len(accums) * (1 + len(hosts))


def _options(mesh: dict, model: ModelConfig, batch_size: int, space: Space,
             roomy: Callable[[Layout], bool] | None = None) -> Iterator[tuple[Layout | None, str | None]]:
    """Every setting beyond the mesh, each with the RULE it breaks (or None); a pruned
    host-offload variant is not built (None with its rule)."""
    base, pipes, seq_impls, sps, accums, hosts = _choices(mesh, model, batch_size, space)
    for schedule, micro, virtual in pipes:
        for seq_impl in seq_impls:
            spacious = set()  # (sp, remat) whose grad_accum=1 layout fits with room: more accumulation dominated
            for accum in accums:
                settings = dict(schedule=schedule, microbatches=micro, virtual_stages=virtual, seq_impl=seq_impl,
                                grad_accum=accum)
                rule = _rule(dataclasses.replace(base, **settings), model, batch_size)  # whatever sp and remat
                if rule:
                    yield from ((None, rule) for _ in range(len(sps) * len(space.remats) * (1 + len(hosts))))
                    continue
                for sp in sps:
                    for remat in space.remats:
                        if (sp, remat) in spacious:
                            yield from ((None, "dominated") for _ in range(1 + len(hosts)))
                            continue
                        layout = dataclasses.replace(base, **settings, sequence_parallel=sp, remat=remat,
                                                     offload_params="device", offload_optimizer="device")
                        yield layout, None
                        fits_well = roomy is not None and roomy(layout)
                        if fits_well and accum == 1:
                            spacious.add((sp, remat))
                        if hosts and schedule == "interleaved" and mesh["pipe"] > 1:
                            yield from ((None, "offload") for _ in hosts)
                        elif fits_well:
                            yield from ((None, "dominated") for _ in hosts)
                        else:
                            for params, opt in hosts:
                                yield dataclasses.replace(layout, offload_params=params, offload_optimizer=opt), None


def _rule(layout: Layout, model: ModelConfig, batch_size: int) -> str | None:
    ways = layout.data_ways
    split = layout.microbatches if layout.pipe > 1 else layout.grad_accum
    if batch_size % (split * ways):
        return "batch"
    if layout.pipe > 1 and layout.schedule in ("1f1b", "interleaved"):
        if layout.microbatches < layout.pipe or (layout.schedule == "interleaved" and layout.microbatches % layout.pipe):
            return "microbatches"
    if layout.seq > 1 and layout.seq_impl == "ulysses" and model.heads % (layout.seq * layout.tensor_ways):
        return "heads"
    if (layout.offload_params == "host" or layout.offload_optimizer == "host") and layout.pipe > 1 \
            and layout.schedule == "interleaved":
        return "offload"
    return None
