"""One description of a parallel layout: everything besides the model and the data that
changes how one training step runs on its devices.

``Layout`` is the mesh (``data``, ``fsdp``, ``expert``, ``pipe``, ``seq``, ``tensor`` 1D or a
square 2D grid), the pipeline's schedule, microbatches and virtual stages, the sequence-parallel
attention, Megatron sequence parallelism, the remat policy, gradient accumulation, how
the data replicas' gradients combine, and where the parameters and optimizer state live.
It is the one copy of those settings:

* a training config holds one (``jaxpar.train.config.Config.layout``), read from and
  written back to the public keys through ``KEYS`` (``mesh.fsdp``, ``model.remat``,
  ``optimizer.grad_accum``, ``offload.params``, ...);
* the planner (``jaxpar.planning.layout``) enumerates concrete ones, and
  ``overrides()`` is what ``jaxpar-plan --out`` and ``--json`` write of one;
* the ``Execution`` a step is traced under takes its sequence options from one
  (``sequence``; ``jaxpar.train.step.make_train_step`` builds it).

A config's layout may leave values to the library: ``data`` None (the devices the other
axes leave: a config's default; ``Layout()`` itself is one device),
``microbatches`` None (twice ``pipe``), ``offload_*`` ``auto`` (the offload planner's
choice). ``resolved`` fills in the first two and stays a ``Layout``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxpar.hetero.reduction import COMPRESSIONS, KINDS as REDUCTIONS
from jaxpar.offload.planner import PLACES as OFFLOAD_PLACES
from jaxpar.parallel.pipeline_schedule import KINDS as SCHEDULES
from jaxpar.placement.execution import SEQUENCE_IMPLS, SequenceOptions

# What a stacked layer keeps for its backward pass (``jaxpar.models.transformer.Remat``,
# the model's argument; a config's ``model.remat``).
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "names")

# Each field's public config key: how a config file, an override, ``jaxpar-plan --out``
# and a run's saved ``config.yaml`` name it. The one table between them.
KEYS = {
    "data": "mesh.data", "fsdp": "mesh.fsdp", "expert": "mesh.expert", "pipe": "mesh.pipe", "seq": "mesh.seq",
    "tensor": "mesh.tensor",
    "schedule": "pipeline.schedule", "microbatches": "pipeline.microbatches",
    "virtual_stages": "pipeline.virtual_stages",
    "seq_impl": "execution.seq_impl", "sequence_parallel": "execution.sequence_parallel",
    "remat": "model.remat", "remat_names": "model.remat_names",
    "grad_accum": "optimizer.grad_accum", "reduction": "optimizer.reduction",
    "compression": "optimizer.compression",
    "offload_params": "offload.params", "offload_optimizer": "offload.optimizer",
}
FIELD_OF = {key: name for name, key in KEYS.items()}
MESH_FIELDS = ("data", "fsdp", "expert", "pipe", "seq", "tensor")
# What the planner chooses, so what ``overrides()`` writes (pipeline keys only with
# pipe > 1, ``seq_impl`` only with seq > 1, ``expert`` only above 1: they change nothing
# otherwise). ``expert`` is enumerated for a MoE model only (``enumerate_layouts``).
PLANNED = ("data", "fsdp", "expert", "pipe", "seq", "tensor", "schedule", "microbatches", "virtual_stages", "seq_impl",
           "sequence_parallel", "remat", "grad_accum", "offload_params", "offload_optimizer")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel layout. ``tensor`` is an int (1D, Megatron) or ``(q, q)`` (2D, SUMMA).

    ``remat_names``: the ``checkpoint_name``s ``remat="names"`` saves. ``reduction`` /
    ``compression``: ``jaxpar.hetero.reduction``'s kind and compression (its ratio and
    re-estimation period are ``optimizer.compression_ratio`` / ``threshold_every``).
    ``expert``: the ways MoE layers split their experts (``jaxpar.models.moe``); outside
    them the batch is split over it as over ``data``.
    No checks here (the planner builds hundreds of thousands); ``check`` is a config's."""

    data: int | None = 1
    fsdp: int = 1
    expert: int = 1
    pipe: int = 1
    seq: int = 1
    tensor: int | tuple[int, ...] = 1
    schedule: Literal[SCHEDULES] = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 1
    seq_impl: Literal[SEQUENCE_IMPLS] = "ring"
    sequence_parallel: bool = False
    remat: Literal[REMAT_POLICIES] = "none"
    remat_names: tuple[str, ...] = ()
    grad_accum: int = 1
    reduction: Literal[REDUCTIONS] = "mean"
    compression: Literal[COMPRESSIONS] = "none"
    offload_params: Literal[OFFLOAD_PLACES] = "device"
    offload_optimizer: Literal[OFFLOAD_PLACES] = "device"

    def check(self, *, mesh: bool = True) -> None:
        """``ValueError`` naming the public key of the first value out of range
        (``mesh=False``: the mesh's sizes are not checked, ``mesh=auto`` plans them)."""
        names = (("fsdp", "expert", "pipe", "seq") if mesh else ()) + ("virtual_stages", "grad_accum")
        for name in names + (("data",) if mesh and self.data is not None else ()) + (
                ("microbatches",) if self.microbatches is not None else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"{KEYS[name]}={getattr(self, name)!r} must be at least 1")

    # ------------------------------------------------------------------ the mesh

    @property
    def tensor_ways(self) -> int:
        return math.prod(self.tensor) if isinstance(self.tensor, tuple) else self.tensor

    @property
    def devices(self) -> int:
        """Devices the layout takes (``data`` None counts as 1)."""
        return (self.data or 1) * self.fsdp * self.expert * self.pipe * self.seq * self.tensor_ways

    @property
    def data_ways(self) -> int:
        """Ways the batch is split: data x fsdp x expert (x the 2D grid's rows)."""
        rows = self.tensor[0] if isinstance(self.tensor, tuple) else 1
        return (self.data or 1) * self.fsdp * self.expert * rows

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """The mesh's axes, outermost first (``jaxpar.make_mesh``'s order; ``expert``
        only when above 1, as ``make_mesh`` makes it)."""
        sizes = {"data": self.data or 1, "fsdp": self.fsdp} | ({"expert": self.expert} if self.expert > 1 else {}) \
            | {"pipe": self.pipe, "seq": self.seq}
        if isinstance(self.tensor, tuple):
            return sizes | {"tensor_row": self.tensor[0], "tensor_col": self.tensor[1]}
        return sizes | {"tensor": self.tensor}

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches per step of a pipeline (``microbatches``, else twice ``pipe``)."""
        return self.microbatches or 2 * self.pipe

    def resolved(self, devices: int) -> Layout:
        """This layout on ``devices`` devices: ``data`` the devices the other axes leave
        where unset, ``microbatches`` twice ``pipe`` where unset with ``pipe`` > 1."""
        others = self.fsdp * self.expert * self.pipe * self.seq * self.tensor_ways
        return dataclasses.replace(self, data=self.data or max(1, devices // others),
                                   microbatches=self.pipeline_microbatches if self.pipe > 1 else self.microbatches)

    # ------------------------------------------------------------------ what it runs

    @property
    def offloads_state(self) -> bool:
        """Whether parameters or optimizer state may live in host memory (``auto`` may)."""
        return self.offload_params != "device" or self.offload_optimizer != "device"

    @property
    def lockstep(self) -> bool:
        """Whether a pipeline of this layout runs in lockstep: its stages move data by
        ``ppermute`` (ring or RSA attention over ``seq``, SUMMA over a 2D grid), which the
        schedule's per-device branches cannot hold, so every device runs a forward part
        and a backward part at each tick where any device has one
        (``jaxpar.parallel.pipeline.lockstep_tick``; ``stages_permute``, which
        ``jaxpar.train.pipelined.needs_lockstep`` asks of the mesh)."""
        return self.pipe > 1 and stages_permute(self.seq, self.seq_impl, isinstance(self.tensor, tuple))

    def sequence(self, seq_layout: str = "natural") -> SequenceOptions:
        """How attention runs over a split length, tokens in ``seq_layout`` order."""
        return SequenceOptions(self.seq_impl, seq_layout)

    # ------------------------------------------------------------------ its settings

    def settings(self, names: tuple[str, ...] = tuple(KEYS)) -> dict:
        """``names`` (default: every field) as their public dotted keys (lists for
        tuples, as YAML writes them)."""
        return {KEYS[name]: _plain(getattr(self, name)) for name in names}

    def overrides(self) -> dict:
        """The dotted ``jaxpar-train`` settings that select this layout of the planner's:
        what ``jaxpar-plan --out`` writes and ``--json`` lists."""
        names = [n for n in PLANNED if (self.pipe > 1 or n not in ("schedule", "microbatches", "virtual_stages"))
                 and (self.seq > 1 or n != "seq_impl") and (self.expert > 1 or n != "expert")]
        return {KEYS[name]: _plain(getattr(self, name)) for name in names}

    def describe(self) -> str:
        """``fsdp=4 tensor=2 +sp remat=full ga=2``: what differs from one plain device."""
        parts = [f"{k}={v}" for k, v in (("data", self.data or 1), ("fsdp", self.fsdp), ("expert", self.expert),
                                         ("pipe", self.pipe),
                                         ("seq", self.seq)) if v > 1]
        if isinstance(self.tensor, tuple):
            parts.append(f"tensor={self.tensor[0]}x{self.tensor[1]}")
        elif self.tensor > 1:
            parts.append(f"tensor={self.tensor}")
        if self.pipe > 1:
            parts.append(f"{self.schedule}/m{self.pipeline_microbatches}"
                         + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.seq > 1:
            parts.append(self.seq_impl)
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(f"remat={self.remat}")
        if self.grad_accum > 1:
            parts.append(f"ga={self.grad_accum}")
        if self.offload_params == "host":
            parts.append("params@host")
        if self.offload_optimizer == "host":
            parts.append("opt@host")
        return " ".join(parts) if parts else "one device"


def stages_permute(seq: int, seq_impl: str, grid: bool) -> bool:
    """Whether a pipeline stage moves data by ``ppermute``: ring or RSA attention over
    ``seq`` > 1, or SUMMA over a 2D tensor grid (``grid``); such a pipeline runs in
    lockstep (``Layout.lockstep``)."""
    return (seq > 1 and seq_impl != "ulysses") or grid


def from_overrides(values: dict) -> Layout:
    """The ``Layout`` a dict of dotted settings selects (``Layout.overrides``' and
    ``settings``' inverse; keys of other settings are ignored, missing ones default)."""
    kwargs = {FIELD_OF[k]: (tuple(v) if isinstance(v, list) else v) for k, v in values.items() if k in FIELD_OF}
    return Layout(**kwargs)


def _plain(value):
    return list(value) if isinstance(value, tuple) else value
