"""When the question is wrong: the best layout of a plan far below what its compute alone
reaches, because the batch is too small for the devices (or the model for its tensor
and pipeline splits), and what would help.

``diagnose`` compares the best candidate's MFU with its compute-only MFU (the same
step without communication, bubble and offload: what the hardware reaches on that
layout's work). Below ``REACH_FRACTION`` of it, one line names the batch per device and
the two ways up to ``REACH_FRACTION`` of the compute-only MFU, both with the analytic
models (``cost.step_time``, ``memory.estimate`` with the plan's margin; nothing
compiled), each over a small family of layouts (the best one, and every split of the
devices between ``data`` and ``fsdp`` under remat none, dots and full): the global
batch at which one of them reaches it on these devices (``batch_size`` doubled up to
``MAX_GROWTH`` times; a pipeline's microbatches with it up to ``8 x pipe``), and the
largest device count, halving, at which one does with this batch (the best layout's
axes halved, ``data`` first, then ``fsdp``, ``seq``, ``pipe`` and 1D ``tensor``).
"""

from __future__ import annotations

import dataclasses

from jaxpar.planning import cost, memory
from jaxpar.planning.layout import Layout
from jaxpar.planning.workload import LayoutError, Workload

REACH_FRACTION = 0.5  # flagged below half the compute-only MFU; the target of what would help
MAX_GROWTH = 2 ** 12  # the largest batch multiple tried
SHRINK_ORDER = ("data", "fsdp", "seq", "pipe", "tensor")


def _mfu(work: Workload, layout: Layout, hw, per_node: int) -> float:
    step = cost.step_time(work, layout, hw, devices_per_node=min(per_node, layout.devices))
    return work.model_flops() / (step.total * layout.devices * hw.peak(work.model.dtype))


def _halved(layout: Layout) -> Layout | None:
    """``layout`` on half (or fewer) its devices: its first axis in ``SHRINK_ORDER`` above
    1 divided by its smallest prime factor; None when none is left to shrink."""
    for axis in SHRINK_ORDER:
        n = getattr(layout, axis)
        if isinstance(n, int) and n > 1:
            factor = next(p for p in range(2, n + 1) if n % p == 0)
            return dataclasses.replace(layout, **{axis: n // factor})
    return None


def _family(layout: Layout, devices: int) -> list[Layout]:
    """``layout`` and the plain data-parallel layouts of ``devices`` (every split of them
    between ``data`` and ``fsdp`` in powers of two, remat none, dots and full)."""
    out, f = [layout], 1
    while f <= devices and devices % f == 0:
        out += [Layout(data=devices // f, fsdp=f, remat=r) for r in ("none", "dots", "full")]
        f *= 2
    return out


def _best(work: Workload, layouts: list[Layout], hw, per_node: int, fits) -> tuple[float, Layout | None]:
    """The highest MFU among ``layouts`` that divide the batch and fit (``fits(layout)``)."""
    best = (0.0, None)
    for layout in layouts:
        split = layout.pipeline_microbatches if layout.pipe > 1 else layout.grad_accum
        if work.batch_size % (layout.data_ways * split) or not fits(work, layout):
            continue
        mfu = _mfu(work, layout, hw, per_node)
        if mfu > best[0]:
            best = (mfu, layout)
    return best


def _batch_for(work, layout, hw, per_node, target, fits) -> tuple[int, Layout] | None:
    growth = 2
    while growth <= MAX_GROWTH:
        bigger = dataclasses.replace(work, batch_size=work.batch_size * growth)
        grown = layout if layout.pipe == 1 else dataclasses.replace(
            layout, microbatches=min(layout.pipeline_microbatches * growth, 8 * layout.pipe))
        mfu, chosen = _best(bigger, _family(grown, layout.devices), hw, per_node, fits)
        if mfu >= target:
            return bigger.batch_size, chosen
        growth *= 2
    return None


def _devices_for(work, layout, hw, per_node, target, fits) -> Layout | None:
    devices, smaller = layout.devices // 2, _halved(layout)
    while devices >= 1:
        base = [smaller] if smaller is not None and smaller.devices == devices else []
        mfu, chosen = _best(work, base + _family(Layout(data=devices), devices)[1:], hw, per_node, fits)
        if mfu >= target:
            return chosen
        devices //= 2
        while smaller is not None and smaller.devices > devices:
            smaller = _halved(smaller)
    return None


def diagnose(plan, memory_margin: float) -> str | None:
    """One line when ``plan.best`` reaches under ``REACH_FRACTION`` of its compute-only
    MFU, else None; an estimated layout's memory fits with ``memory_margin``."""
    work, hw, best = plan.work, plan.hardware, plan.best
    if not best.fits:
        return None
    peak = hw.peak(work.model.dtype) * plan.devices
    mfu = work.model_flops() / (best.time.total * peak)
    reach = work.model_flops() / (best.time.compute * peak)
    if mfu >= REACH_FRACTION * reach:
        return None
    target = REACH_FRACTION * reach
    split = best.time.split()
    idle = (split["communication"] + split["bubble"] + split["offload"]) / best.time.total
    per_device = work.batch_size / plan.devices
    line = (f"the best layout reaches MFU {mfu:.1%} where its compute alone would reach {reach:.0%}: "
            f"communication, bubble and offload take {idle:.0%} of its step, with a batch of {work.batch_size:,} x "
            f"{work.seq_len:,} tokens over {plan.devices:,} devices ({per_device:.3g} sequences a device).")
    backend = "cpu" if hw.name == "cpu" else "gpu"

    def fits(w: Workload, layout: Layout) -> bool:
        try:
            return memory.estimate(w, layout, backend=backend)["device"] * memory_margin <= plan.device_memory
        except LayoutError:
            return False

    helps = []
    found = _batch_for(work, best.layout, hw, plan.devices_per_node, target, fits)
    if found is not None:
        each = found[0] / plan.devices
        helps.append(f"batch_size={found[0]:,} ({each:.3g} sequence{'' if each == 1 else 's'} a device; "
                     f"{found[1].describe()})")
    smaller = _devices_for(work, best.layout, hw, plan.devices_per_node, target, fits)
    if smaller is not None:
        helps.append(f"this batch on {smaller.devices:,} devices ({smaller.describe()})")
    if helps:
        line += f" {target:.0%} MFU (half that) is predicted with " + ", or with ".join(helps) + "."
    else:
        line += (f" Neither a batch up to {MAX_GROWTH:,}x this one nor fewer devices reach {target:.0%} MFU "
                 "(half that): the model is too small for this hardware.")
    return line
