"""What the rules do to a model's parameters: ``jaxpar.rules.explain``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.placement import rules as rules_lib
from jaxpar.placement.linen import is_box, linen_shardings
from jaxpar.placement.sharding import logical_axes, model_shardings, path_str


@dataclasses.dataclass(frozen=True)
class Placement:
    """One parameter: its logical ``names`` (None: unannotated, replicated), the
    ``spec`` they resolved to, and the bytes it takes in all and on each device."""

    path: str
    names: tuple[str | None, ...] | None
    spec: PartitionSpec
    shape: tuple[int, ...]
    nbytes: int
    bytes_per_device: int

    @property
    def replicated(self) -> bool:
        """Whether every device holds it whole (no dimension on a mesh axis of size > 1)."""
        return self.bytes_per_device == self.nbytes


@dataclasses.dataclass(frozen=True)
class RuleReport:
    """The placement of every parameter of a model on a mesh of ``devices`` devices;
    ``str()`` is the aligned table ``explain`` prints."""

    params: tuple[Placement, ...]
    mesh_shape: dict[str, int]

    @property
    def devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def bytes_per_device(self) -> int:
        """Parameter bytes on each device (every device holds the same amount)."""
        return sum(p.bytes_per_device for p in self.params)

    @property
    def replicated_fraction(self) -> float:
        """The share of parameter bytes that every device holds whole."""
        return sum(p.nbytes for p in self.params if p.replicated) / max(self.total_bytes, 1)

    def __str__(self) -> str:
        header = ("parameter", "logical axes", "mesh axes", "shape", "bytes/device")
        rows = [header] + [
            (p.path, _names(p.names), _axes(p.spec, self.mesh_shape), "x".join(map(str, p.shape)) or "()",
             f"{p.bytes_per_device:,}")
            for p in self.params
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths)), row[-1].rjust(widths[-1])]).rstrip()
                 for row in rows]
        mesh = " x ".join(f"{a}={n}" for a, n in self.mesh_shape.items() if n > 1) or "1 device"
        lines.append(
            f"total {self.total_bytes:,} bytes in {len(self.params)} parameter{'s' * (len(self.params) != 1)}; "
            f"per device {self.bytes_per_device:,} bytes on {mesh} (ideal 1/{self.devices}: "
            f"{self.total_bytes / self.devices:,.0f})")
        lines.append(f"replicated (every device holds them whole): {self.replicated_fraction:.1%} of parameter bytes")
        return "\n".join(lines)


def _names(names) -> str:
    return "(unannotated)" if names is None else ", ".join("-" if n is None else n for n in names)


def _axes(spec: PartitionSpec, mesh_shape: dict[str, int]) -> str:
    """``fsdp:4, -``: each dimension's mesh axes and how many ways they split it."""
    dims = []
    for axes in spec:
        axes = rules_lib.as_tuple(axes)
        ways = math.prod(mesh_shape[a] for a in axes)
        dims.append("+".join(axes) + f":{ways}" if axes else "-")
    return ", ".join(dims) or "-"


def explain(model_or_variables, mesh: jax.sharding.Mesh, rules: rules_lib.Rules | None = None) -> RuleReport:
    """Prints and returns where ``rules`` put each parameter of a model on ``mesh``.

    ``model_or_variables``: an NNX model or ``nnx.State``, or Linen variables (what
    ``model.init`` returns, boxed by ``nn.with_logical_partitioning``); abstract arrays
    (``jax.eval_shape``, ``nnx.eval_shape``) do. Parameters are resolved and checked
    as ``jaxpar.model_shardings`` / ``jaxpar.linen_shardings`` resolve them (the same
    errors).

    Returns:
      A ``RuleReport``: per parameter its path, logical names, mesh axes, shape and
      bytes per device; in total the bytes, the bytes per device and the replicated
      fraction (the share of parameter bytes every device holds whole).
    """
    if isinstance(model_or_variables, (nnx.Module, nnx.State)):
        params = _nnx_params(model_or_variables, mesh, rules)
    else:
        params = _linen_params(model_or_variables, mesh, rules)
    report = RuleReport(tuple(params), dict(mesh.shape))
    print(report)
    return report


def _placement(path: str, names, spec: PartitionSpec, array, mesh) -> Placement:
    """``array`` (concrete or abstract) placed by ``spec``: its bytes in all and per device."""
    shape = tuple(array.shape)
    nbytes = math.prod(shape) * np.dtype(array.dtype).itemsize
    ways = math.prod(mesh.shape[a] for axes in spec for a in rules_lib.as_tuple(axes))
    return Placement(path, names, spec, shape, nbytes, nbytes // ways)


def _nnx_params(model_or_state, mesh, rules) -> list[Placement]:
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    shardings = model_shardings(state, mesh, rules)
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return [
        _placement(path_str(path), logical_axes(variable), sharding.get_value().spec, variable.get_value(), mesh)
        for (path, variable), sharding in zip(
            jax.tree.leaves_with_path(state, is_leaf=is_variable), jax.tree.leaves(shardings, is_leaf=is_variable))
        if isinstance(variable, nnx.Param)
    ]


def _linen_params(variables, mesh, rules) -> list[Placement]:
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise ValueError("explain takes an NNX model or nnx.State, or Linen variables with a 'params' "
                         f"collection; got {type(variables).__name__} {list(variables) if isinstance(variables, Mapping) else ''}")
    shardings = linen_shardings({"params": variables["params"]}, mesh, rules)
    leaves = jax.tree.leaves_with_path({"params": variables["params"]}, is_leaf=is_box)
    return [
        _placement(path_str(path[1:]), _box_names(leaf), sharding.spec, getattr(leaf, "value", leaf), mesh)
        for (path, leaf), sharding in zip(leaves, jax.tree.leaves(shardings))
    ]


def _box_names(leaf):
    names = getattr(leaf, "names", None)
    return None if names is None else tuple(names)
