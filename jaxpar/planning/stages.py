"""``pipeline.stage_layers=auto``: the layers per pipeline rank on ranks of unequal speed
and memory (issue 39; Sky Computing, Zhu, Li and You 2022, arXiv:2202.11836), and the
step time the planner predicts for any split of the layers over the ranks.

Figures (``StageModel``), from the planner's own models of the layout the run uses:

time
    the cost model's (``jaxpar.planning.cost``) compute and tensor traffic of one
    pipeline's whole step (the same layout with ``pipe`` 1 and the ``M`` microbatches as
    gradient accumulation: the same microbatch, every layer once), split into the
    head's share (its matmul FLOPs at the matmul rate and four float32 passes over the
    logits, as the cost model counts them) and the layers' (the rest, the same for each
    of the model's identical layers; their optimizer update counted with them), per
    microbatch on a device of speed 1 (the hardware profile's). The head runs on the
    last stage (``jaxpar.parallel.pipeline``: inside the schedule); the embedding runs
    before the schedule, on no stage. A backward takes ``backward_ratio`` (2) times a
    forward, the cost model's 4 : 2 FLOPs per parameter and token (jaxpar's stage
    backward also recomputes the stage's forward from its stashed input, nearer 3:
    the cost model's step time of a pipeline counts that recompute,
    ``cost.recompute_flops``, this model of one stage's share does not).
memory
    the memory model's (``jaxpar.planning.memory``) bytes per device are affine in the
    layers a rank holds: evaluated at one and two layers per rank they give a layer's
    state (parameters, Adam's moments, the float32 gradient), what a layer saves for
    its backward, and the rest. A rank holds the rest, the stage inputs it stashes
    (its own count in flight, from the schedule built), its own layers' saved
    activations, and the state of as many layers as the largest stage has: one SPMD
    program gives every stage the same parameter shapes, padded to the largest
    (``jaxpar.parallel.pipeline``, "Uneven stages"), so a rank's parameters and
    optimizer state do not shrink with its layers.
sends
    one stage input ``[b, t, D]`` per hop over the ``pipe`` links.

Step time (``simulate``): the schedule table (``jaxpar.parallel.pipeline_schedule``)
played with each stage's own forward and backward times, as the SPMD program runs it:
tick by tick, each device through its own operation; a tick at whose end something is
sent ends in a collective-permute over the ``pipe`` ring, which a device leaves once it
and both its ring neighbours have finished the tick, plus the send's time (pairwise
exchanges, as on GPUs; XLA:CPU's rendezvous over every device, a barrier, is slower
still). So a slow stage delays its neighbours at every tick it sends, and through them
the rest; and in 1F1B's steady state, where neighbours run a forward and a backward in
the same tick, every tick lasts a backward. Exact for these figures, no further
approximation: the asynchronous pipeline's ``(M - 1) max_s t_s + sum_s t_s``, which it
equals on GPipe's and 1F1B's 2-stage cases, is not what this program runs. It is the
branching program's (``lockstep`` ticks, taken with ring attention or SUMMA inside a
stage, run a forward and a backward part each and are not modelled).

Allocation (``allocate_stages``): ``jaxpar.hetero.allocate`` minimises the slowest
stage (the head's time the last rank's fixed cost) within each rank's memory. Because
of the padding, the memory a rank may give its own layers depends on the largest
stage: for each largest-stage size ``K`` (from the even one up) each rank's room for
layers is found and allocated within, until a split reaches the unbounded optimum.
Each of these and the even split (where it fits) is then improved one layer at a time
(the best move of a layer across a stage boundary, while one shortens the predicted
step: the slowest stage is not the whole step, sends and a tick's neighbours count
too), and the shortest predicted step wins, so ``auto`` is never predicted slower than
``even``.

Interleaved stages (``virtual_stages`` > 1) are refused: a rank's ``V`` stages share
its memory and its ticks, which the per-rank allocation does not model; give
``pipeline.stage_layers`` explicitly there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from jaxpar.hetero.allocation import allocate, even_split, stage_times
from jaxpar.offload.budget import format_bytes
from jaxpar.parallel import pipeline_schedule
from jaxpar.parallel.pipeline_schedule import BACKWARD, FORWARD
from jaxpar.planning import cost, memory
from jaxpar.planning.devices import DeviceProfile, ProfileError
from jaxpar.planning.hardware import Hardware
from jaxpar.planning.layout import Layout
from jaxpar.planning.workload import Workload

BACKWARD_RATIO = cost.BACKWARD_RATIO  # backward / forward time: the cost model's 4 and 2 FLOPs per parameter and token


@functools.lru_cache(maxsize=256)
def _table(kind: str, pipe: int, microbatches: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(op [ticks, P], stage [ticks, P], sends [ticks])`` of the schedule built; a
    tick sends where some device runs a forward of a stage before the last or a
    backward of a stage after the first (``jaxpar.parallel.pipeline.plan``'s
    ``sends_f | sends_b``)."""
    s = pipeline_schedule.build(kind, pipe, microbatches)
    last = s.devices * s.virtual - 1
    sends = (((s.op == FORWARD) & (s.stage < last)) | ((s.op == BACKWARD) & (s.stage > 0))).any(axis=1)
    return s.op, s.stage, sends


def simulate(kind: str, microbatches: int, forward, backward, send: float = 0.0):
    """Seconds of one step of the ``kind`` schedule over ``P`` stages (one per device),
    stage ``s`` taking ``forward[..., s]`` and ``backward[..., s]`` per microbatch and
    each tick's sends ``send`` (the module's docstring). Leading axes are independent
    cases, played together: a float for ``[P]`` times, an array ``[...]`` otherwise."""
    f, b = np.asarray(forward, np.float64), np.asarray(backward, np.float64)
    op, stage, sends = _table(kind, f.shape[-1], microbatches)
    column = np.where(stage >= 0, stage, 0)
    duration = (np.where(op == FORWARD, f[..., column], 0.0)
                + np.where(op == BACKWARD, b[..., column], 0.0))  # [..., ticks, P]
    now = np.zeros(f.shape)
    for t in range(op.shape[0]):
        now = now + duration[..., t, :]
        if sends[t]:  # a device leaves the ring's collective-permute once both neighbours have joined it
            now = np.maximum(np.maximum(np.roll(now, 1, axis=-1), now), np.roll(now, -1, axis=-1)) + send
    step = now.max(axis=-1)
    return float(step) if step.ndim == 0 else step


@dataclasses.dataclass(frozen=True)
class StageModel:
    """Per-microbatch seconds on a device of speed 1 and bytes per device (the
    module's docstring) of one layout's pipeline."""

    schedule: str
    pipe: int
    microbatches: int
    layers: int
    layer_time: float  # one layer's forward and backward
    head_time: float  # the head's and the loss', on the last stage
    send_time: float  # one stage input to the next rank (or its gradient back)
    layer_state: float  # bytes a rank keeps per layer of the largest stage
    layer_saved: float  # bytes a rank keeps per layer of its own, for the backward
    fixed: tuple[float, ...]  # bytes each rank keeps whatever its layers
    backward_ratio: float = BACKWARD_RATIO

    def step_time(self, stage_layers, speeds: Sequence[float]):
        """The predicted seconds of one step with ``stage_layers`` (``[P]``, or ``[C,
        P]`` for ``C`` splits at once) on ranks of ``speeds``."""
        work = np.asarray(stage_layers, np.float64) * self.layer_time
        work[..., -1] += self.head_time
        work = work / np.asarray(speeds, np.float64) / (1 + self.backward_ratio)
        return simulate(self.schedule, self.microbatches, work, work * self.backward_ratio, self.send_time)

    def stage_times(self, stage_layers: Sequence[int], speeds: Sequence[float]) -> np.ndarray:
        """Each rank's seconds per microbatch, forward and backward."""
        fixed = [0.0] * (len(speeds) - 1) + [self.head_time]
        return stage_times(stage_layers, [self.layer_time] * self.layers, speeds, fixed)

    def memory(self, stage_layers: Sequence[int]) -> np.ndarray:
        """Bytes per device of each rank."""
        n = np.asarray(stage_layers, np.float64)
        return np.asarray(self.fixed) + n.max() * self.layer_state + n * self.layer_saved

    def fits(self, stage_layers: Sequence[int], memories: Sequence[int | None]) -> bool:
        return all(m is None or u <= m for u, m in zip(self.memory(stage_layers), memories))


def stage_model(work: Workload, layout: Layout, hw: Hardware, *, devices_per_node: int,
                backend: str = "gpu", backward_ratio: float = BACKWARD_RATIO) -> StageModel:
    """The ``StageModel`` of ``layout``'s pipeline (``pipe`` > 1, one stage per rank)."""
    P, M, m = layout.pipe, layout.microbatches, work.model
    if P < 2:
        raise ProfileError(f"pipeline.stage_layers=auto needs mesh.pipe > 1, got {P}")
    if layout.virtual_stages != 1:
        raise ProfileError(f"pipeline.stage_layers=auto needs pipeline.virtual_stages=1, got {layout.virtual_stages}: "
                           "a rank's interleaved stages share its memory and ticks; give pipeline.stage_layers")
    if m.layers < P:
        raise ProfileError(f"{m.layers} layers cannot make {P} stages of at least one layer each")
    whole = dataclasses.replace(layout, pipe=1, schedule="1f1b", microbatches=1, virtual_stages=1, grad_accum=M)
    step = cost.step_time(work, whole, hw, devices_per_node=devices_per_node)
    sent, _ = cost.comm_bytes(work, whole)
    tensor = sum(nbytes / cost.bandwidth(key, whole.mesh_sizes, hw, devices_per_node)
                 for key, nbytes in sent.items() if any(a in cost.CRITICAL for a in key.split("+")))
    x = memory.local_sizes(work, layout)
    head = (6 * m.vocab_size * m.dim * work.tokens / whole.devices / (hw.peak(m.dtype) * hw.efficiency["matmul"])
            + M * 4 * 4 * x["logits"] / hw.hbm_bandwidth)
    layers = step.compute + tensor - head
    c = m.compute_dtype.itemsize
    send = x["btd"] * c / cost.bandwidth("pipe", layout.mesh_sizes, hw, devices_per_node)
    # Bytes: the memory model at one and two layers per rank (it is affine in them).
    one, two = (memory.estimate(Workload(dataclasses.replace(m, layers=k * P), work.batch_size, work.seq_len),
                                layout, backend=backend)["device"] for k in (1, 2))
    saved = memory.layer_saved(work, layout, backend=backend)
    stash = pipeline_schedule.build(layout.schedule, P, M).in_flight() * x["btd"] * c
    rest = one - (two - one) - stash.max()
    return StageModel(layout.schedule, P, M, m.layers, layer_time=layers / (m.layers * M), head_time=head / M,
                      send_time=send, layer_state=two - one - saved, layer_saved=saved,
                      fixed=tuple(float(rest + s) for s in stash), backward_ratio=backward_ratio)


def _infeasible(model: StageModel, memories, source: str) -> ProfileError:
    one = model.layer_state + model.layer_saved
    for r, (f, room) in enumerate(zip(model.fixed, memories)):
        if room is not None and f + one > room:
            return ProfileError(f"{source}: rank {r}'s memory ({format_bytes(room)}) holds no stage: one layer "
                                f"needs {format_bytes(f + one)} there ({format_bytes(f)} whatever its layers)")
    return ProfileError(
        f"{source}: no split of {model.layers} layers over {model.pipe} pipeline ranks fits their memory "
        f"({', '.join('unbounded' if m is None else format_bytes(m) for m in memories)}): a layer needs "
        f"{format_bytes(model.layer_state)} of state on every rank (stages are padded to the largest) and "
        f"{format_bytes(model.layer_saved)} of activations on its own, each rank {format_bytes(min(model.fixed))} "
        f"or more besides")


def allocate_stages(model: StageModel, speeds: Sequence[float], memories: Sequence[int | None],
                    source: str = "device profile") -> tuple[int, ...]:
    """The layers per rank with the shortest predicted step (the module's docstring).

    Raises:
      ProfileError: no split fits the ranks' memory (one line, naming the rank or the sizes).
    """
    L, P = model.layers, len(speeds)
    costs, head = [1.0] * L, [0.0] * (P - 1) + [model.head_time / model.layer_time]
    unbounded = allocate(costs, speeds, fixed_costs=head)
    even = even_split(L, P)
    candidates = [even] if model.fits(even, memories) else []
    if model.fits(unbounded, memories):
        candidates.append(unbounded)
    else:
        target = stage_times(unbounded, costs, speeds, head).max()
        rest = [math.inf if m is None else m - f for m, f in zip(memories, model.fixed)]
        for K in range(-(-L // P), L - P + 2):  # the largest stage's size
            room = [r - K * model.layer_state for r in rest]
            caps = [K if r == math.inf else min(K, math.floor(r / model.layer_saved)) if model.layer_saved > 0
                    else (K if r >= 0 else 0) for r in room]
            if min(caps) < 1 or sum(caps) < L:
                continue
            split = allocate(costs, speeds, caps, [1.0] * L, fixed_costs=head)
            candidates.append(split)
            if stage_times(split, costs, speeds, head).max() <= target * (1 + 1e-12):
                break
    if not candidates:
        raise _infeasible(model, memories, source)
    improved = [_descend(model, split, speeds, memories) for split in dict.fromkeys(candidates)]
    return min(improved, key=lambda split: model.step_time(split, speeds))  # ties: from the even split


def _descend(model: StageModel, split: tuple[int, ...], speeds, memories) -> tuple[int, ...]:
    """``split`` improved one layer at a time: while moving a layer across a stage
    boundary shortens the predicted step and fits, the best such move is made."""
    P = len(split)
    moves = np.zeros((2 * (P - 1), P), int)  # rank r takes a layer from rank r + 1, or gives it one
    for r in range(P - 1):
        moves[2 * r, r], moves[2 * r, r + 1] = 1, -1
        moves[2 * r + 1] = -moves[2 * r]
    now = model.step_time(split, speeds)
    while True:
        moved = [tuple(int(n) for n in row) for row in np.asarray(split) + moves]
        moved = [m for m in moved if min(m) >= 1 and model.fits(m, memories)]
        if not moved:
            return split
        times = model.step_time(moved, speeds)
        k = int(np.argmin(times))
        if times[k] >= now * (1 - 1e-12):
            return split
        now, split = float(times[k]), moved[k]


def resolve_stage_layers(profile: DeviceProfile, work: Workload, layout: Layout, hw: Hardware, *,
                         devices_per_node: int, backend: str = "gpu") -> tuple[int, ...]:
    """``pipeline.stage_layers=auto``: the layers of each of ``layout.pipe`` ranks
    (``sum == work.model.layers``, each at least 1) for ``profile``'s speeds and memories.

    Raises:
      ProfileError: the profile lists another number of ranks, ``layout`` is not a
        pipeline of one stage per rank, or no split fits the memory (one line each).
    """
    model = stage_model(work, layout, hw, devices_per_node=devices_per_node, backend=backend)
    profile.check_ranks(layout.pipe)
    return allocate_stages(model, profile.speeds, profile.memories, profile.source)


def compare(profile: DeviceProfile, model: StageModel) -> dict:
    """The even split against ``auto``'s: layers, predicted step seconds, bytes per
    rank (JSON-ready; ``even_step_s`` is None where the even split does not fit)."""
    profile.check_ranks(model.pipe)
    auto = allocate_stages(model, profile.speeds, profile.memories, profile.source)
    even = even_split(model.layers, model.pipe)
    even_fits = model.fits(even, profile.memories)
    auto_s, even_s = model.step_time(auto, profile.speeds), model.step_time(even, profile.speeds)
    return {"stage_layers": list(auto), "auto_step_s": auto_s,
            "even_stage_layers": list(even), "even_step_s": even_s if even_fits else None,
            "speedup": even_s / auto_s if even_fits else None,
            "speeds": list(profile.speeds),
            "auto_stage_s": model.stage_times(auto, profile.speeds).tolist(),
            "even_stage_s": model.stage_times(even, profile.speeds).tolist(),
            "auto_memory_bytes": model.memory(auto).tolist(), "even_memory_bytes": model.memory(even).tolist()}
