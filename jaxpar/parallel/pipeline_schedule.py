"""Pipeline schedules as data: which stage runs which microbatch's forward or backward
at every tick, built once on the host and checked before any layer runs.

``P`` devices along ``pipe`` hold ``S = P V`` stages: with ``V`` virtual stages per
device (interleaved), stage ``s`` lives on device ``s % P`` as its virtual stage
``s // P`` (the circular assignment of Megatron-LM's interleaved schedule), so a
microbatch passes every device ``V`` times. One tick is one stage's forward or backward
of one microbatch (both counted as one unit of time, as the textbook bubble formulas
do); what a stage sends at the end of a tick (``ppermute``) its neighbour can use at the
next tick.

* ``gpipe``: every forward, then every backward (Huang et al., 2019). A stage keeps
  the activations of all ``M`` microbatches.
* ``1f1b``: after a warm-up of forwards, each device alternates one forward and one
  backward (PipeDream-Flush, Narayanan et al., 2021), so at most ``P - p`` microbatches
  are in flight on device ``p`` instead of ``M``. Same bubble as GPipe.
* ``interleaved``: 1F1B over ``V`` virtual stages per device; the bubble shrinks by
  ``V`` (Narayanan et al., 2021, Sec. 2.2) at the price of ``V`` times the transfers.

Bubble: idle stage-ticks over all stage-ticks of the schedule actually built
(``Schedule.bubble``), against the formula ``(P - 1) / (V M + P - 1)``
(``bubble_theory``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("gpipe", "1f1b", "interleaved")
IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    """``op``, ``microbatch``, ``stage`` are int arrays ``[ticks, P]``: at tick ``t``
    device ``p`` runs ``op[t, p]`` (``IDLE``, ``FORWARD`` or ``BACKWARD``) of microbatch
    ``microbatch[t, p]`` through global stage ``stage[t, p]`` (-1 when idle)."""

    kind: str
    devices: int
    microbatches: int
    virtual: int
    op: np.ndarray
    microbatch: np.ndarray
    stage: np.ndarray

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    def bubble(self) -> float:
        """Idle stage-ticks / all stage-ticks, counted from the table."""
        return float((self.op == IDLE).sum() / self.op.size)

    def bubble_theory(self) -> float:
        return bubble_theory(self.devices, self.microbatches, self.virtual)

    def in_flight(self) -> np.ndarray:
        """``[P]``: the most microbatch-stages whose forward has run on the device and
        whose backward has not: the activations the device must keep at once."""
        worst = np.zeros(self.devices, int)
        for p in range(self.devices):
            alive = np.cumsum(np.where(self.op[:, p] == FORWARD, 1, 0) - np.where(self.op[:, p] == BACKWARD, 1, 0))
            worst[p] = alive.max(initial=0)
        return worst


def bubble_theory(devices: int, microbatches: int, virtual: int = 1) -> float:
    """``(P - 1) / (V M + P - 1)``."""
    return (devices - 1) / (virtual * microbatches + devices - 1)


def build(kind: str, devices: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The ``kind`` schedule of ``microbatches`` over ``devices`` pipeline devices with
    ``virtual`` stages each (``interleaved`` only; 1 otherwise).

    Built by list scheduling: at every tick each device runs one ready operation,
    chosen by the schedule's rule. Raises ValueError on sizes the schedule cannot take.
    """
    P, M, V = devices, microbatches, virtual
    if kind not in KINDS:
        raise ValueError(f"pipeline schedule {kind!r} is not one of {KINDS}")
    if P < 1 or M < 1 or V < 1:
        raise ValueError(f"pipeline sizes must be positive: devices={P}, microbatches={M}, virtual={V}")
    if kind != "interleaved" and V != 1:
        raise ValueError(f"virtual stages ({V}) need the interleaved schedule, not {kind!r}")
    if kind in ("1f1b", "interleaved") and M < P:
        raise ValueError(f"{kind} needs at least as many microbatches as pipeline stages: "
                         f"microbatches={M} < pipe={P}")
    if kind == "interleaved" and M % P:
        raise ValueError(f"interleaved needs the microbatches divisible by the pipeline size: "
                         f"microbatches={M}, pipe={P}")
    S = P * V
    programs = [_program(kind, p, P, M, V) for p in range(P)]
    position = [0] * P  # the next operation of each device's program
    done = {FORWARD: np.full((M, S), -1), BACKWARD: np.full((M, S), -1)}  # tick it ran
    ops, mbs, stages = [], [], []
    t = 0
    while any(position[p] < len(programs[p]) for p in range(P)):
        row = [(IDLE, 0, -1)] * P
        for p in range(P):
            if position[p] < len(programs[p]) and _ready(*programs[p][position[p]], done, t, S):
                row[p] = programs[p][position[p]]
        if all(op == IDLE for op, _, _ in row):
            raise RuntimeError(f"{kind} schedule deadlocked at tick {t}: P={P}, M={M}, V={V}")
        for p, (op, m, stage) in enumerate(row):  # recorded after all chose: a result
            if op != IDLE:  # is usable from the next tick on
                done[op][m, stage] = t
                position[p] += 1
        ops.append([r[0] for r in row]), mbs.append([r[1] for r in row]), stages.append([r[2] for r in row])
        t += 1
    return Schedule(kind, P, M, V, np.array(ops), np.array(mbs), np.array(stages))


def _program(kind, p, P, M, V):
    """Device ``p``'s operations in the order it runs them (Megatron-LM's order).

    The ``k``-th forward of a device takes microbatches in groups of ``P`` through its
    virtual stages in turn (depth first: a group passes virtual stage 0, then 1, ...);
    the ``k``-th backward does the same with the virtual stages in reverse. GPipe runs
    all forwards, then all backwards; 1F1B runs ``warmup`` forwards, then alternates a
    forward and a backward, then the backwards left.
    """
    def order(k, backward):
        group, within = divmod(k, P * V)
        v = within // P
        return group * P + within % P, (V - 1 - v if backward else v) * P + p

    forwards = [(FORWARD, *order(k, False)) for k in range(M * V)]
    backwards = [(BACKWARD, *order(k, True)) for k in range(M * V)]
    if kind == "gpipe":
        return forwards + backwards
    warmup = min((P - p - 1) * 2 + (V - 1) * P if V > 1 else P - p - 1, M * V)
    program = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        program += [f, b]
    return program + backwards[len(forwards) - warmup:]


def _ready(op, m, stage, done, t, S) -> bool:
    """Whether the input of ``op`` on microbatch ``m`` at ``stage`` exists before tick ``t``:
    the previous stage's forward, or the next stage's backward (the last stage's
    backward starts from its own forward, through the loss)."""
    if op == FORWARD:
        source = None if stage == 0 else done[FORWARD][m, stage - 1]
    else:
        source = done[FORWARD][m, stage] if stage == S - 1 else done[BACKWARD][m, stage + 1]
    return source is None or 0 <= source < t
