"""Collective traffic of a partitioned HLO module: bytes each device sends, by kind and
by the mesh axes each collective's groups span (``jaxpar.profiler``'s docstring says
how each is counted)."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

import numpy as np

from jaxpar.profiler.hlo import (_IOTA, _Instruction, _Module, _balanced, _execution_counts, _parse_module,
                                 _split_top, shape_bytes)

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all",
)

# ------------------------------------------------------------------------- collectives


def _replica_group_size(attrs: str) -> int | None:
    """Devices per group in ``replica_groups=...``; None for ``{}`` or no groups (all)."""
    m = re.search(r"replica_groups=", attrs)
    if m is None:
        return None
    at = m.end()
    if attrs.startswith("maximal_mesh[", at):
        return 1
    if attrs.startswith("mesh[", at):  # mesh['x'=2,'y'=4](, device_ids=(...))? {'y', ...}
        end = _balanced(attrs, at + len("mesh"))
        sizes = dict(re.findall(r"'?([^'=,\s]+)'?=(\d+)", attrs[at + len("mesh["):end - 1]))
        rest = attrs[end:]
        if rest.startswith(", device_ids="):
            rest = rest[_balanced(rest, len(", device_ids=")):]
        brace = rest.index("{")
        size = 1
        for axis in _split_top(rest[brace + 1:_balanced(rest, brace) - 1]):
            sub = re.fullmatch(r"'?([^':]+)'?:\((\d+)\)(\d+)", axis)  # 'x':(pre)size
            size *= int(sub.group(3)) if sub else int(sizes[axis.strip("'")])
        return size
    if attrs.startswith("[", at):  # iota: [num_groups,group_size]<=[...]
        return int(attrs[at + 1:attrs.index("]", at)].split(",")[-1])
    first = re.match(r"\{\s*\{([^}]*)\}", attrs[at:])  # explicit: {{0,1},{2,3}}
    return len([x for x in first.group(1).split(",") if x.strip()]) if first else None


def _group_size(inst: _Instruction, module: _Module) -> int:
    """Devices that take part in each instance of a collective, following XLA's
    collective group modes (``CollectiveOpGroupMode``)."""
    size = _replica_group_size(inst.attrs)
    if "replica_groups=mesh[" in inst.attrs or "use_global_device_ids=true" in inst.attrs:
        # flattened ids over replicas x partitions
        return size or module.replica_count * module.num_partitions
    if "channel_id=" not in inst.attrs:  # cross-replica
        return size or module.replica_count
    if inst.opcode.startswith("all-to-all"):  # cross-partition (no global-ids flag)
        return size or module.num_partitions
    # cross-replica-and-partition: groups of replicas, each spanning every partition
    return (size or module.replica_count) * module.num_partitions


def _collective_kind(opcode: str) -> str | None:
    kind = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return kind if kind in COLLECTIVE_KINDS else None


def _sent_bytes(inst: _Instruction, kind: str, module: _Module) -> Fraction:
    """Bytes one device sends for one execution of ``inst`` under the ring model."""
    operands = inst.operands[:1] if kind == "collective-permute" else inst.operands
    missing = [o for o in operands if o not in module.shapes]
    if missing:
        raise ValueError(f"{inst.name}: operands {missing} are not defined in the HLO text")
    size = sum(shape_bytes(module.shapes[o]) for o in operands)
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", inst.attrs)
        found = re.findall(r"\{(\d+),(\d+)", pairs.group(0)) if pairs else []
        senders = sum(a != b for a, b in found)
        # Averaged over the devices: a broadcast tree's round has only some senders.
        return Fraction(size * senders, module.replica_count * module.num_partitions)
    return ring_factor(kind, _group_size(inst, module)) * size


def ring_factor(kind: str, n: int) -> Fraction:
    """Bytes one device sends per byte of operand in a collective of ``kind`` over a
    group of ``n`` devices, under the ring model (a collective-permute's depend on its
    pairs, not on a group: ``_sent_bytes``)."""
    return {
        "all-reduce": Fraction(2 * (n - 1), n),
        "all-gather": Fraction(n - 1),
        "reduce-scatter": Fraction(n - 1, n),
        "all-to-all": Fraction(n - 1, n),
    }[kind]


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def collective_stats(hlo_text: str, mesh=None) -> dict[str, Any]:
    """Collective traffic of one execution of an optimized, partitioned HLO module
    (``compiled.as_text()``), per device, under the ring model of the module docstring.

    Args:
      hlo_text: the module's text.
      mesh: optional ``jax.sharding.Mesh`` / ``AbstractMesh`` (anything with
        ``axis_names`` and a ``shape`` mapping name -> size) the program was
        partitioned over; with it the traffic is also split by mesh axes.

    Returns:
      ``collective_bytes`` (total), ``collectives`` (kind -> bytes),
      ``collective_counts`` (kind -> executions) and ``loops_without_trip_count``;
      with a ``mesh`` also ``collectives_by_axes`` (axes key -> bytes),
      ``collective_counts_by_axes`` (axes key -> executions) and
      ``collective_kinds_by_axes`` (axes key -> kind -> bytes).
    """
    return _collective_stats(_parse_module(hlo_text), mesh)


def _collective_stats(module: _Module, mesh=None) -> dict[str, Any]:
    counts, unknown = _execution_counts(module)
    axes = None if mesh is None else _mesh_axes(mesh)
    sent = {kind: Fraction(0) for kind in COLLECTIVE_KINDS}
    executions = {kind: 0 for kind in COLLECTIVE_KINDS}
    sent_by_axes: dict[str, Fraction] = {}
    executions_by_axes: dict[str, int] = {}
    kinds_by_axes: dict[str, dict[str, Fraction]] = {}
    for comp in module.computations.values():
        runs = counts[comp.name]
        for inst in comp.instructions:
            kind = _collective_kind(inst.opcode)
            if kind is None or runs == 0:
                continue
            nbytes = runs * _sent_bytes(inst, kind, module)
            sent[kind] += nbytes
            executions[kind] += runs
            if axes is None:
                continue
            key = _axes_key(inst, kind, module, *axes)
            if not key:
                if nbytes == 0:
                    continue  # a group of one device, or a permute to self: nothing moves
                key = "unknown"
            sent_by_axes[key] = sent_by_axes.get(key, Fraction(0)) + nbytes
            executions_by_axes[key] = executions_by_axes.get(key, 0) + runs
            by_kind = kinds_by_axes.setdefault(key, {})
            by_kind[kind] = by_kind.get(kind, Fraction(0)) + nbytes
    result = {
        "collective_bytes": _number(sum(sent.values())),
        "collectives": {kind: _number(b) for kind, b in sent.items()},
        "collective_counts": executions,
        "loops_without_trip_count": unknown,
    }
    if axes is not None:
        result["collectives_by_axes"] = {k: _number(sent_by_axes[k]) for k in sorted(sent_by_axes)}
        result["collective_counts_by_axes"] = {k: executions_by_axes[k]
                                               for k in sorted(executions_by_axes)}
        result["collective_kinds_by_axes"] = {k: {kind: _number(b) for kind, b in sorted(kinds_by_axes[k].items())}
                                              for k in sorted(kinds_by_axes)}
    return result


# ---------------------------------------------------------------------- by mesh axes


def _mesh_axes(mesh) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(axis names, sizes) of a ``Mesh``, ``AbstractMesh`` or look-alike."""
    names = tuple(str(n) for n in mesh.axis_names)
    return names, tuple(int(mesh.shape[n]) for n in names)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _iota(attrs: str, at: int) -> np.ndarray | None:
    """``[G,S]<=[d0,d1,...]T(p0,p1,...)`` at ``attrs[at]`` as a (G, S) array of ids."""
    m = _IOTA.match(attrs, at)
    if m is None:
        return None
    shape, dims = _int_list(m.group(1)), _int_list(m.group(2))
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose(_int_list(m.group(3)))
    return ids.reshape(-1, shape[-1])


def _first_replica_group(attrs: str) -> list[int] | None:
    """The first group of ``replica_groups`` in the explicit or iota spelling; None for
    ``{}`` or no groups (every participant).

    Raises:
      ValueError: a spelling this parser does not map to ids (the mesh form is read
        by ``_mesh_group_ids``).
    """
    m = re.search(r"replica_groups=", attrs)
    if m is None:
        return None
    at = m.end()
    if attrs.startswith("[", at):
        ids = _iota(attrs, at)
        if ids is None:
            raise ValueError(f"unparsed iota replica groups: {attrs[at:at + 80]!r}")
        return [int(i) for i in ids[0]]
    first = re.match(r"\{\s*\{([^}]*)\}", attrs[at:])
    if first:
        return _int_list(first.group(1))
    if re.match(r"\{\s*\}", attrs[at:]):
        return None
    raise ValueError(f"unparsed replica groups: {attrs[at:at + 80]!r}")


def _mesh_form(attrs: str):
    """``mesh['x'=2,'y'=4](, device_ids=(...))? {'y', 'x':(1)2}`` as (sizes: name -> size,
    device ids in mesh order or None, [(axis, pre-size or None, size or None)]), or None."""
    m = re.search(r"replica_groups=mesh\[", attrs)
    if m is None:
        return None
    at = m.end() - 1
    end = _balanced(attrs, at)
    sizes = {k: int(v) for k, v in re.findall(r"'?([^'=,\s]+)'?=(\d+)", attrs[at + 1:end - 1])}
    rest = attrs[end:]
    device_ids = None
    if rest.startswith(", device_ids="):
        close = _balanced(rest, len(", device_ids="))
        inner = rest[len(", device_ids=") + 1:close - 1].strip()
        if inner.startswith("[["):
            device_ids = np.array(_int_list(re.sub(r"[\[\]]", "", inner)))
        elif inner.startswith("["):
            iota = _iota(inner, 0)
            bare = re.fullmatch(r"\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?", inner)  # [2,4]T(1,0): no <=
            if iota is not None:
                device_ids = iota.reshape(-1)
            elif bare is not None:
                ids = np.arange(math.prod(_int_list(bare.group(1)))).reshape(_int_list(bare.group(1)))
                device_ids = (ids.transpose(_int_list(bare.group(2))) if bare.group(2) else ids).reshape(-1)
        rest = rest[close:]
        if device_ids is None or device_ids.size != math.prod(sizes.values()):
            raise ValueError(f"unparsed mesh device ids: {inner[:80]!r}")
    brace = rest.index("{")
    group = []
    for axis in _split_top(rest[brace + 1:_balanced(rest, brace) - 1]):
        sub = re.fullmatch(r"'?([^':]+)'?:\((\d+)\)(\d+)", axis)
        group.append((sub.group(1), int(sub.group(2)), int(sub.group(3))) if sub
                     else (axis.strip("'"), None, None))
    return sizes, device_ids, group


def _mesh_group_ids(sizes: dict[str, int], device_ids, group) -> list[int]:
    """Device ids of the first group (the one at coordinate 0 off the group's axes) of a
    mesh-form collective."""
    names = list(sizes)
    dims = [sizes[n] for n in names]
    coords = np.indices(dims).reshape(len(dims), -1)  # (axes, devices) in mesh order
    rest = coords.copy()  # coordinates with the group's (sub-)axis components removed
    for axis, pre, size in group:
        a = names.index(axis)
        if pre is None:
            rest[a] = 0
        else:
            post = sizes[axis] // (pre * size)
            rest[a] -= (coords[a] // post) % size * post
    ids = np.arange(coords.shape[1]) if device_ids is None else device_ids
    return [int(i) for i in ids[(rest == 0).all(axis=0)]]


def _key(ids: list[list[int]], names, dims) -> str:
    """Mesh axes (of size > 1) whose coordinate varies within each list of ``ids``."""
    varies = [False] * len(names)
    for group in ids:
        if any(i < 0 or i >= math.prod(dims) for i in group):
            return "unknown"
        coords = np.unravel_index(np.array(group, dtype=np.int64), dims)
        for a, c in enumerate(coords):
            varies[a] |= bool(len(c) and (c != c[0]).any())
    return "+".join(n for n, d, v in zip(names, dims, varies, strict=True) if d > 1 and v)


def _axes_key(inst: _Instruction, kind: str, module: _Module, names, dims) -> str:
    """Key naming the mesh axes ``inst``'s groups span; "" for a group that moves nothing,
    "unknown" for one this cannot map. A logical device id (flattened over replicas x
    partitions: ``replica * num_partitions + partition``) sits at mesh position
    ``np.unravel_index(id, dims)``, as in jax.jit's SPMD programs."""
    R, P = module.replica_count, module.num_partitions
    if "replica_groups=maximal_mesh[" in inst.attrs:
        return ""  # one device
    try:
        if kind == "collective-permute":
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", inst.attrs)
            found = re.findall(r"\{(\d+),(\d+)", pairs.group(0)) if pairs else []
            # With a channel the pairs are partitions (of replica 0), without one replicas.
            scale = 1 if "channel_id=" in inst.attrs else P
            pairs_ids = [[int(a) * scale, int(b) * scale] for a, b in found if a != b]
            if not pairs_ids:
                return ""
            return _key(pairs_ids, names, dims) if R * P == math.prod(dims) else "unknown"
        form = _mesh_form(inst.attrs)
        if form is not None:
            sizes, device_ids, group = form
            if all(axis in names for axis, _, _ in group):  # the program's names are the mesh's
                spanned = {axis for axis, _, size in group if size is None or size > 1}
                return "+".join(n for n, d in zip(names, dims, strict=True)
                                if d > 1 and n in spanned)
            ids = _mesh_group_ids(sizes, device_ids, group)
        else:
            group = _first_replica_group(inst.attrs)
            if "use_global_device_ids=true" in inst.attrs:  # flattened ids
                ids = list(range(R * P)) if group is None else group
            elif "channel_id=" not in inst.attrs:  # cross-replica, in each partition
                ids = [r * P for r in (range(R) if group is None else group)]
            elif inst.opcode.startswith("all-to-all"):  # cross-partition, in each replica
                ids = list(range(P)) if group is None else group
            else:  # cross-replica-and-partition: the group's replicas, every partition
                ids = [r * P + p for r in (range(R) if group is None else group) for p in range(P)]
        if len(set(ids)) <= 1:
            return ""
        return _key([ids], names, dims) if R * P == math.prod(dims) else "unknown"
    except (ValueError, KeyError, IndexError, AttributeError):
        return "unknown"


