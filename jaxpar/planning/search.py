"""The planner: every candidate layout ranked by predicted step time among those that
fit the device's memory, the best of them compiled for their exact figures.

1. ``layout.enumerate_layouts`` generates the candidates within its bounds and prunes
   those its rules refuse (counted by rule); a parameter dimension that does not divide
   over its mesh axes prunes too (rule ``shape``).
2. Every candidate gets the analytic memory (``memory.estimate``) and step time
   (``cost.step_time``); host-offload variants of a layout whose on-device estimate
   fits ``DOMINANT`` times over, and at ``grad_accum=1`` its variants with more
   accumulation, are pruned (rule ``dominated``) before they are.
3. The ranking is by predicted step time among the candidates that fit, compiled and
   estimated alike (within 0.1% of the same time: the fewest host transfers, the least
   gradient accumulation, then the least memory). An estimated candidate fits only
   with the memory model's margin (``MEMORY_LOW``): its estimate times 1.25 within
   ``device_memory``.
4. The bound: the candidates compiled (``compile``, the caller's: ``jaxpar.train.plan``
   builds the very train step ``jaxpar-train`` runs), fastest estimate first, are every
   one that could still rank first (``could_rank_first``): an estimate within
   ``TIME_MARGIN`` of the best fitting step and a memory estimate that could fit
   (``MEMORY_HIGH``), until none is left; so the first line is compiled and no
   estimated candidate that fits is predicted faster than it. ``3 x compile_top``
   programs at most: reached, the compiled candidates rank before the estimated ones
   (the first line is still compiled) and the plan says how many could still rank first.
   Each program is compiled at the smallest device count that gives the same
   per-device program (``compiled_shape``: ``data`` cut to ``COMPILE_DATA``, the batch
   with it; its collectives over ``data`` rescaled to the full group, ``rescaled``), on
   at most ``compile_devices`` devices: a candidate that needs more stays estimated and
   the plan says how many could still rank first.
   Compiled figures replace the analytic ones (memory, collectives by axis) and are
   cached on disk (``cache.FigureCache``), keyed by model shape and layout, so a
   second plan compiles nothing. Offload variants of a layout share its compile
   (XLA:CPU does not tell host from device memory): their device bytes are the
   compiled peak minus the host-resident state, counted exactly.
5. ``advice.diagnose``: when the best candidate's MFU is far below what its compute
   alone reaches, one line says why and what would help (``Plan.advice``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable

from jaxpar.inputs import InputError
from jaxpar.planning import advice, cost, memory
from jaxpar.planning.cache import FigureCache, key as cache_key
from jaxpar.planning.hardware import Hardware
from jaxpar.planning.layout import BOUNDS, RULES, Layout, Space, enumerate_layouts
from jaxpar.planning.workload import LayoutError, Workload, shards
from jaxpar.profiler.collectives import ring_factor

GIB = 2 ** 30

# How far an estimate may be from its compiled figures. Memory (BENCHMARKS.md,
# "Planning", 144 compiled candidates of tiny, small and 1b on 8 and 16 devices, compiled
# 2026-11-30): at the 90th percentile of every config the compiled peak is at most 1.234
# times the estimate (x 1.25), and the estimate at most 1.241 times the compiled peak
# (x 1.25) but for two Ulysses layouts, whose full-length scores the model over-counts
# (1.293 and 1.546, 1b's seq=4 tensor=2 ulysses sp remat=full): such a layout estimated
# just over the device's memory may be left out uncompiled, where the worst case as the
# margin would have the planner compile every fast layout up to 1.55 x the memory
# (1b on 8 H100s: 75 that could rank first instead of 35).
MEMORY_LOW = 1.25   # an estimated candidate fits when estimate x MEMORY_LOW <= device_memory
MEMORY_HIGH = 1.25  # it could fit (and is compiled if it could rank first) when estimate / MEMORY_HIGH does
# Step time: compiling replaces the counted collectives (bytes and counts by axis) with
# the program's own (but for pipe > 1, whose profiled collectives are an upper bound:
# cost.step_time); compute is the same model either way. Measured by
# bench/plan_margin.py (BENCHMARKS.md, "Planning", the ranking's margin): over 58
# compiled candidates (34 programs) of tiny, small (h100) and tiny at seq_len 512 (a100) on 8 devices,
# compiled within a 10% margin, the compiled prediction was never below the estimate
# (1.04x to 3.98x it, median 1.20x: the counted collectives are a lower bound); 1% is
# kept for ties (the ranking's 0.1%) and configs not measured.
TIME_MARGIN = 0.01
# A layout whose on-device estimate fits this many times over is not offloaded or
# accumulated further (rule ``dominated``): twice the memory margin, beyond the largest
# underestimate measured (1.63x in the sample above), so that its compile fits too.
DOMINANT = 2 * MEMORY_LOW
# A layout is compiled at the smallest device count that gives the same per-device
# program: ``data`` cut to COMPILE_DATA, the global batch with it. ``data`` replicas hold
# the same parameters, optimizer state and rows each (``data_ways`` and the rows per
# device are unchanged); only the gradient reduction's group spans them, so the
# program's memory and FLOPs per device are the same and the collectives whose group
# spans ``data`` are rescaled to the full group (``rescaled``). 2 keeps those
# collectives in the program (their kinds and counts as compiled); ``fsdp``, ``seq``,
# ``tensor``, ``pipe`` and ``expert`` shard parameters or activations, so their sizes
# change the per-device program and stay.
COMPILE_DATA = 2


class PlanError(InputError):
    """Nothing fits (one line: the smallest memory that would work)."""


@dataclasses.dataclass
class Candidate:
    layout: Layout
    memory: dict[str, float]  # memory.estimate's parts, "device", "host"
    time: cost.StepTime
    source: str = "analytic"  # or "compiled"
    fits: bool = False

    def summary(self, work: Workload, hw: Hardware) -> dict:
        step = self.time.total
        return {"layout": self.layout.describe(), "overrides": self.layout.overrides(),
                "memory_bytes": int(self.memory["device"]), "host_bytes": int(self.memory["host"]),
                "memory_parts": {k: int(self.memory[k]) for k in memory.PARTS},  # the estimate's
                "memory_source": self.source, "fits": self.fits, "step_time_s": step,
                "tokens_per_s": work.tokens / step,
                "mfu": work.model_flops() / (step * self.layout.devices * hw.peak(work.model.dtype)),
                "split": self.time.split()}


@dataclasses.dataclass
class Plan:
    work: Workload
    hardware: Hardware
    devices: int
    devices_per_node: int
    device_memory: int
    candidates: list[Candidate]  # ranked, best first
    considered: int
    pruned: collections.Counter
    compiled: int
    cached: int
    seconds: float
    compile_limit: int = 0  # the most programs compile_figures would take (0: analytic only)
    unverified: int = 0  # candidates that could still rank first when the search stopped
    stopped_by: str = ""  # why: "limit" (compile_limit) or "devices" (compile_devices)
    compile_devices: int | None = None  # the most devices a program could be compiled for
    advice: str | None = None  # advice.diagnose's line: the question is wrong

    def compile_note(self) -> str:
        """How many candidates were compiled and why (the bound)."""
        if not self.compile_limit:
            return "nothing compiled (analytic only): the first line is an estimate"
        why = (f"every candidate that could rank first (an estimate within {TIME_MARGIN:.0%} of the best "
               f"fitting step, its memory estimate / {MEMORY_HIGH} within device memory)")
        done = f"{self.compiled + self.cached} compiled ({self.cached} from the cache)"
        if self.unverified and self.stopped_by == "devices":
            return (f"{done}; {self.unverified} estimated candidates could still rank first (an estimate within "
                    f"{TIME_MARGIN:.0%} of the best fitting step) but need more than plan.compile_devices="
                    f"{self.compile_devices} devices even with data cut to {COMPILE_DATA}, so they stay estimated"
                    + (", ranked after the compiled ones" if self.compiled + self.cached else
                       ": the first line is an estimate"))
        if self.unverified:
            return (f"{done}, stopped at plan.compile_top's limit of {self.compile_limit} (3 x compile_top): "
                    f"{self.unverified} estimated candidates could still rank first, so the compiled ones are ranked "
                    "before them; raise plan.compile_top to verify them")
        return (f"{done}: {why}; each with data cut to {COMPILE_DATA} and the batch with it "
                "(the same program per device on fewer devices)")

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def to_json(self) -> dict:
        return {"devices": self.devices, "devices_per_node": self.devices_per_node,
                "device_memory": self.device_memory, "hardware": self.hardware.name,
                "considered": self.considered, "pruned": dict(self.pruned),
                "kept": len(self.candidates), "compiled": self.compiled, "from_cache": self.cached,
                "seconds": round(self.seconds, 3), "bounds": list(BOUNDS), "compile_bound": self.compile_note(),
                "margins": {"time": TIME_MARGIN, "memory_low": MEMORY_LOW, "memory_high": MEMORY_HIGH},
                "unverified": self.unverified, "advice": self.advice,
                "candidates": [c.summary(self.work, self.hardware) for c in self.candidates]}


def _fmt_bytes(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / 2 ** 20:,.0f} MiB"


def best_of_each_mesh(ranked: list[Candidate], count: int) -> list[Candidate]:
    """The first candidate of each mesh (axis sizes) in ``ranked``, ``count`` of them."""
    out, meshes = [], set()
    for c in ranked:
        mesh = tuple(c.layout.mesh_sizes.items())
        if mesh not in meshes:
            out.append(c)
            meshes.add(mesh)
            if len(out) == count:
                break
    return out


def table(plan: Plan, top: int = 12, *, every: bool = False) -> str:
    """The ranked table with the search's counts: the best candidate of each mesh (its
    axis sizes), ``top`` rows; ``every``: every candidate, ranked."""
    hw, work = plan.hardware, plan.work
    head = ("| # | layout | memory/device | fits | step | tokens/s | MFU | compute | comm | bubble | offload |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    rows = ([f"The question is wrong: {plan.advice}", ""] if plan.advice else []) + [head]
    ranks = {id(c): rank for rank, c in enumerate(plan.candidates, 1)}
    shown = plan.candidates[:top] if every else best_of_each_mesh(plan.candidates, top)
    for c in shown:
        i = ranks[id(c)]
        s = c.summary(work, hw)
        split = s["split"]
        mark = "" if c.source == "compiled" else " (est.)"
        rows.append(f"| {i} | {s['layout']} | {_fmt_bytes(s['memory_bytes'])}{mark} | {'yes' if c.fits else 'no'} | "
                    f"{s['step_time_s'] * 1e3:,.1f} ms | {s['tokens_per_s']:,.0f} | {s['mfu']:.1%} | "
                    + " | ".join(f"{split[k] / s['step_time_s']:.0%}" for k in ("compute", "communication",
                                                                                 "bubble", "offload")) + " |")
    pruned = ", ".join(f"{n} {RULES.get(rule, rule)}" for rule, n in plan.pruned.most_common()) or "none"
    fitting = sum(c.fits for c in plan.candidates)
    rows.append("")
    rows.append(f"{plan.considered:,} candidates considered on {plan.devices} devices ({plan.devices_per_node} per "
                f"node, {hw.name}, {_fmt_bytes(plan.device_memory)} each); pruned: {pruned}; "
                f"{len(plan.candidates):,} kept, {fitting:,} fit; searched in {plan.seconds:.1f} s.")
    rows.append(f"{plan.compile_note()}.")
    rows.append(("Every candidate, ranked" if every else "The best candidate of each mesh, # its rank among all")
                + " by predicted step among those that fit; (est.): the analytic figures (not compiled), fitting "
                f"only with the memory margin (estimate x {MEMORY_LOW} within device memory).")
    rows.append("Bounds (never generated): " + "; ".join(BOUNDS) + ".")
    return "\n".join(rows)


def _compiled_memory(work: Workload, layout: Layout, figures: dict, prefetch: int = 1) -> dict[str, float]:
    """Device and host bytes of ``layout`` from its all-on-device compile: the compiled
    peak less the state ``layout`` keeps on the host, plus the layers fetched at once."""
    s = shards(work, layout.mesh_sizes, layout.sequence_parallel)
    peak = figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"] + figures["temp_bytes"]
    host = 0.0
    if layout.offload_params == "host":
        host += s["params"]
        peak -= s["params"] - min(prefetch + 1, work.model.layers) * s["layer_params"] / work.model.layers
    if layout.offload_optimizer == "host":
        host += 2 * s["params"]
        peak -= 2 * s["params"]
    return {"device": peak, "host": host}


def _rank_key(c: Candidate, compiled_first: bool = False) -> tuple:
    """Fitting first, then fastest; within 0.1% of the same time, the fewest host
    transfers, then the least gradient accumulation, then the least memory.
    ``compiled_first`` (the compile limit stopped the bound): compiled before estimated."""
    offloaded = (c.layout.offload_params == "host") + (c.layout.offload_optimizer == "host")
    return (not c.fits, compiled_first and c.source != "compiled", round(math.log(c.time.total), 3), offloaded,
            c.layout.grad_accum, c.memory["device"], c.layout.describe())


def estimate_fits(device_bytes: float, device_memory: int) -> bool:
    """An estimated candidate fits: its estimate with the memory margin does."""
    return device_bytes * MEMORY_LOW <= device_memory


def could_rank_first(c: Candidate, bound: float, device_memory: int) -> bool:
    """``c`` (estimated) could rank first against a best fitting step of ``bound``
    seconds: its estimate is within ``TIME_MARGIN`` of it and its memory could fit."""
    return c.time.total * (1 - TIME_MARGIN) < bound and c.memory["device"] / MEMORY_HIGH <= device_memory


def compiled_shape(work: Workload, layout: Layout) -> tuple[Workload, Layout]:
    """The workload and layout compiled for ``layout``: ``data`` cut to COMPILE_DATA and
    the batch with it (the same per-device program on fewer devices)."""
    data = layout.data or 1
    if data <= COMPILE_DATA:
        return work, layout
    return (dataclasses.replace(work, batch_size=work.batch_size * COMPILE_DATA // data),
            dataclasses.replace(layout, data=COMPILE_DATA))


def rescaled(figures: dict, compiled: Layout, layout: Layout) -> dict:
    """``figures`` of ``compiled`` (``compiled_shape``'s) for ``layout``: each collective
    whose group spans ``data`` scaled by its kind's ring factor from the compiled group
    size to the full one (counts unchanged); memory and FLOPs per device as compiled."""
    if compiled == layout or "collective_kinds_by_axes" not in figures:
        return figures
    small, full = compiled.mesh_sizes, layout.mesh_sizes
    by_axes, kinds, totals = dict(figures["collectives_by_axes"]), {}, dict(figures.get("collectives", {}))
    for key, by_kind in figures["collective_kinds_by_axes"].items():
        axes = key.split("+")
        if "data" not in axes:
            kinds[key] = by_kind
            continue
        n, m = math.prod(full[a] for a in axes), math.prod(small[a] for a in axes)
        # a collective-permute (a shift) sends its operand whatever the group: unscaled
        kinds[key] = {kind: b if kind == "collective-permute" else
                      b * float(ring_factor(kind, n) / ring_factor(kind, m)) for kind, b in by_kind.items()}
        by_axes[key] = sum(kinds[key].values())
        for kind, b in kinds[key].items():
            totals[kind] = totals.get(kind, 0) + b - by_kind[kind]
    return {**figures, "collectives_by_axes": by_axes, "collective_kinds_by_axes": kinds, "collectives": totals,
            "collective_bytes": sum(totals.values())}


def _on_device(layout: Layout) -> Layout:
    return dataclasses.replace(layout, offload_params="device", offload_optimizer="device")


@dataclasses.dataclass
class _Compiler:
    """Compiled figures for candidates: each layout's program (its state on the device:
    offload variants share it; ``compiled_shape``: on the fewest devices that give the
    same per-device program) taken from the disk cache, else compiled and cached."""

    work: Workload
    hw: Hardware
    devices_per_node: int
    compile: Callable[[Layout, int], dict]
    cache: FigureCache
    backend: str
    progress: Callable[[str], None] | None
    max_devices: int | None = None  # the most devices a program may be compiled for
    figures: dict = dataclasses.field(default_factory=dict)  # on-device layout -> figures
    compiled: int = 0
    cached: int = 0

    def can_compile(self, layout: Layout) -> bool:
        return self.max_devices is None or compiled_shape(self.work, layout)[1].devices <= self.max_devices

    def apply(self, candidate: Candidate, device_memory: int) -> None:
        """Replaces ``candidate``'s estimates by its compiled figures."""
        layout = _on_device(candidate.layout)
        if layout not in self.figures:
            work, small = compiled_shape(self.work, layout)
            key = cache_key(work, small, self.backend)
            found = self.cache.get(key)
            if found is None:
                if self.progress:
                    self.progress(f"compiling {layout.describe()}" + (
                        "" if small == layout else f" as {small.describe()} on {small.devices} devices "
                                                   f"(batch_size={work.batch_size}: the same program per device)"))
                found = self.cache.put(key, self.compile(small, work.batch_size))
                self.compiled += 1
            else:
                self.cached += 1
            self.figures[layout] = rescaled(found, small, layout)
        figures = self.figures[layout]
        candidate.memory = {**candidate.memory, **_compiled_memory(self.work, candidate.layout, figures)}
        candidate.source = "compiled"
        candidate.time = cost.step_time(self.work, candidate.layout, self.hw, devices_per_node=self.devices_per_node,
                                        compiled=figures, compiled_backend=self.backend)
        candidate.fits = candidate.memory["device"] <= device_memory

    def refine(self, candidates: list[Candidate], device_memory: int, limit: int) -> tuple[int, str]:
        """Compiles, fastest estimate first, every candidate that could still rank first
        (``could_rank_first``) until none is left or ``limit`` were compiled (from the
        cache or not); each compile gives every offload variant of its layout the same
        figures. With nothing that fits or could fit, the smallest is compiled (the
        refusal names its compiled size). Returns how many could still rank first when
        it stopped (0: the bound holds) and why: ``limit`` reached, or ``devices`` (the
        rest need more than ``max_devices`` even with ``data`` cut)."""
        siblings = collections.defaultdict(list)
        for c in candidates:
            siblings[_on_device(c.layout)].append(c)
        done = 0
        while True:
            top = min((c for c in candidates if c.fits), key=lambda c: c.time.total, default=None)
            bound = math.inf if top is None else top.time.total
            open_ = [c for c in candidates if c.source != "compiled" and could_rank_first(c, bound, device_memory)]
            if not open_ and top is None:
                smallest = min(candidates, key=lambda c: c.memory["device"])
                open_ = [smallest] if smallest.source != "compiled" else []
            if not open_:
                return 0, ""
            compilable = [c for c in open_ if self.can_compile(c.layout)]
            if not compilable:
                return len(open_), "devices"
            if done >= limit:
                return len(open_), "limit"
            chosen = min(compilable, key=lambda c: c.time.total)
            for c in siblings[_on_device(chosen.layout)]:
                self.apply(c, device_memory)
            done += 1


def _estimates(work, devices, hw, *, device_memory, devices_per_node, space, backend):
    """Every candidate with its analytic figures, and the pruning counts. A layout whose
    on-device estimate fits ``DOMINANT`` times over is not offloaded, nor (at
    ``grad_accum=1``) accumulated further (rule ``dominated``): such a variant's step is
    its own plus host transfers or more collectives (``cost``), never faster, and it
    ranks after it (fitting first, then time, then fewer host transfers, less
    accumulation); the margin keeps the layout fitting once compiled."""
    estimated: dict[int, tuple[Layout, dict]] = {}

    def roomy(layout: Layout) -> bool:
        try:
            mem = memory.estimate(work, layout, backend=backend)
        except LayoutError:
            return False  # pruned with its variants below (rule shape)
        estimated[id(layout)] = (layout, mem)
        return mem["device"] * DOMINANT <= device_memory

    layouts, pruned = enumerate_layouts(devices, work.model, work.batch_size, work.seq_len, space=space,
                                        roomy=roomy)
    candidates = []
    for layout in layouts:
        known = estimated.pop(id(layout), None)
        try:
            mem = known[1] if known is not None and known[0] is layout else memory.estimate(work, layout,
                                                                                            backend=backend)
        except LayoutError:
            pruned["shape"] += 1
            continue
        step = cost.step_time(work, layout, hw, devices_per_node=devices_per_node)
        candidates.append(Candidate(layout, mem, step, fits=estimate_fits(mem["device"], device_memory)))
    return candidates, len(layouts) + sum(pruned.values()) - pruned["shape"], pruned


def _refuse(candidates: list[Candidate], pruned, devices: int, device_memory: int) -> None:
    """``PlanError`` when no candidate is left or the best does not fit."""
    if not candidates:
        raise PlanError(f"no layout of {devices} devices can run this model and batch: "
                        + (", ".join(f"{n} {RULES.get(r, r)}" for r, n in pruned.most_common()) or "no candidates"))
    if not candidates[0].fits:
        smallest = min(candidates, key=lambda c: c.memory["device"])
        need = smallest.memory["device"] * (1 if smallest.source == "compiled" else MEMORY_LOW)
        raise PlanError(
            f"no layout fits device_memory={_fmt_bytes(device_memory)} per device: the smallest, "
            f"{smallest.layout.describe()}, needs {_fmt_bytes(smallest.memory['device'])} "
            + ("(compiled)" if smallest.source == "compiled" else f"(estimated; x {MEMORY_LOW} with its margin)")
            + f"; give device_memory >= {math.ceil(need / GIB * 10) / 10}GiB, more devices, or a smaller batch_size")


def search(work: Workload, devices: int, hw: Hardware, *, device_memory: int, devices_per_node: int,
           space: Space = Space(), compile: Callable[[Layout, int], dict] | None = None, compile_top: int = 8,
           cache: FigureCache | None = None, backend: str = "cpu", progress: Callable[[str], None] | None = None,
           compile_devices: int | None = None) -> Plan:
    """The ranked ``Plan`` of ``work`` on ``devices`` devices of ``hw``.

    ``compile(layout, batch_size) -> figures`` (the profiler's, with
    ``collectives_by_axes`` and ``collective_kinds_by_axes``) for the candidates that
    could rank first, each as ``compiled_shape`` gives it, ``backend`` naming what it
    compiles for, at most ``3 x compile_top`` of them and none on more than
    ``compile_devices`` devices; None (or ``compile_top=0``): analytic only.

    Raises:
      PlanError: no candidate fits ``device_memory`` (naming the smallest that would).
    """
    began = time.perf_counter()
    # The estimate describes the program that is compiled (XLA:CPU keeps bfloat16 matmul
    # results in float32, a GPU in bfloat16), so that it ranks candidates as their
    # compiles will; with nothing compiled, the hardware's own program.
    estimate_for = backend if compile is not None else ("cpu" if hw.name == "cpu" else "gpu")
    candidates, considered, pruned = _estimates(work, devices, hw, device_memory=device_memory,
                                                devices_per_node=devices_per_node, space=space,
                                                backend=estimate_for)
    compiler, limit, unverified, stopped_by = None, 0, 0, ""
    if compile is not None and candidates and compile_top > 0:
        compiler = _Compiler(work, hw, devices_per_node, compile, cache or FigureCache(None), backend, progress,
                             max_devices=compile_devices)
        limit = 3 * compile_top
        unverified, stopped_by = compiler.refine(candidates, device_memory, limit)
    candidates.sort(key=lambda c: _rank_key(c, compiled_first=unverified > 0))
    _refuse(candidates, pruned, devices, device_memory)
    plan = Plan(work, hw, devices, devices_per_node, device_memory, candidates, considered, pruned,
                compiler.compiled if compiler else 0, compiler.cached if compiler else 0, 0.0,
                compile_limit=limit, unverified=unverified, stopped_by=stopped_by, compile_devices=compile_devices)
    plan.advice = advice.diagnose(plan, MEMORY_LOW)
    plan.seconds = time.perf_counter() - began
    return plan
