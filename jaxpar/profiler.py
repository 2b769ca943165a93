"""Compile-only profiler: per-device memory, FLOPs and collective traffic of one step.

Colossal-Auto's symbolic profiler, done with XLA's ahead-of-time compilation: lower and
compile a program on abstract inputs (``TrainStep.compile``), then read the compiled
program. Nothing runs, so a 1B model profiles on a laptop, and every figure is exact
for the program XLA actually built: the SPMD-partitioned module, whose shapes are
per device. All figures are per device for one execution of the program.

Memory, from ``compiled.memory_analysis()`` (XLA's buffer assignment):

* ``argument_bytes``, ``output_bytes``, ``temp_bytes``, ``alias_bytes`` (output bytes
  that reuse a donated argument's buffer), ``generated_code_bytes``.
* ``peak_bytes = argument_bytes + output_bytes - alias_bytes + temp_bytes``: every
  buffer the program owns at once. Arguments are live for the whole call; outputs
  that do not alias an argument get their own buffers; ``temp_bytes`` is the size of
  the temporary allocation, which buffer assignment has already packed by liveness,
  so it is the temporaries' high-water mark. Treating all three as live together makes
  this an upper bound on the true high-water mark (tight for a train step, whose
  outputs are mostly aliased to donated arguments).
* ``host_argument_bytes``, ``host_output_bytes``, ``host_alias_bytes``,
  ``host_temp_bytes``: the same figures for buffers in host memory (JAX's
  ``pinned_host`` memory kind, memory space ``S(5)`` in the HLO).

How device bytes are accounted depends on the compiler, which matters once state is
offloaded (``jaxpar.offload``):

* XLA:CPU (the tests) has one memory. A ``pinned_host`` argument or output is counted
  in ``argument_bytes`` / ``output_bytes`` like any other buffer, and every ``host_*``
  figure stays 0 (checked on jax 0.10.2: a jit taking a 4 MiB ``pinned_host`` and a
  4 MiB ``device`` argument reports ``argument_bytes`` 8 MiB, ``host_argument_bytes``
  0). A memory-kind change inside ``jit`` lowers to nothing there either. So on CPU
  ``peak_bytes`` is device plus host bytes together, the all-on-device figure whatever
  the placement: the offload planner does its own accounting from the shardings
  (``jaxpar.offload.planner``), and the training loop's ``device_live_bytes`` reads
  each live array's memory kind.
* XLA:GPU recomputes the figures from its buffer allocations by memory space
  (``CompiledMemoryStats::PopulateBufferStatsFromAllocations``): ``argument_bytes``,
  ``output_bytes``, ``alias_bytes`` and ``temp_bytes`` count device memory (HBM) only,
  and host-resident arguments, outputs and temporaries (offloaded activations) land in
  the ``host_*`` figures, so ``peak_bytes`` is the device's own peak under offload.
  (From XLA's source; not yet checked on a GPU here.)

FLOPs, from ``compiled.cost_analysis()`` (a dict, or a list of dicts in older JAX):

* ``xla_flops``: XLA's figure as reported. XLA's ``HloCostAnalysis`` counts a while
  loop's body ONCE, whatever its trip count (checked on jax 0.10.2: a ``lax.scan``
  of 4 matmuls reports the flops of one), so for a model that scans over layers it
  misses ``(L - 1) / L`` of the layer work.
* ``flops`` (and ``bytes_accessed``): the same analysis with every loop body counted
  trip-count times. The body of each while loop is cut out of the module text as a
  module of its own, costed with the same analysis, and the total is corrected
  bottom-up: ``true(c) = raw(c) + sum over loops w in c of
  (trip(w) * true(body(w)) - raw(body(w)) + (trip(w) + 1) * true(cond(w)) - raw(cond(w)))``.
  ``flops_trip_corrected`` says whether that worked; when it did not (a loop with no
  known trip count, or the private ``jaxlib`` entry points missing) ``flops`` is
  ``xla_flops``. Loops inside conditional branches are not corrected.

Collective traffic, parsed from ``compiled.as_text()``:

* ``collective_bytes``: bytes SENT per device per execution, summed over all-gather,
  all-reduce, reduce-scatter, all-to-all and collective-permute (their async
  ``-start`` forms included; ``-done`` halves are not counted again).
* ``collectives``: kind -> bytes, and ``collective_counts``: kind -> executions.

The byte model is the bandwidth-optimal ring algorithm, with ``S`` the total size of
the op's operands on one device (a tuple-shaped, combined collective sums its
operands) and ``n`` the size of its replica group:

=====================  ==========================================================
all-reduce             ``2 (n - 1) / n * S``  (reduce-scatter then all-gather)
all-gather             ``(n - 1) * S``  = ``(n - 1) / n`` of the gathered result
reduce-scatter         ``(n - 1) / n * S``  (S is the unscattered input)
all-to-all             ``(n - 1) / n * S``  (the slice kept locally is not sent)
collective-permute     ``S * senders / devices`` (the mean over devices: S for a ring
                       shift where every device sends; less for a broadcast-tree round)
=====================  ==========================================================

So ``n = 1`` costs nothing. ``n`` comes from ``replica_groups`` in any of XLA's
spellings: explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` (group size is the last
of the first brackets), mesh axes ``mesh['x'=2,'y'=4] {'y'}`` (product of the named
axes' sizes, ``'y':(1)2`` naming a sub-axis of size 2), and empty ``{}`` (every
participant), interpreted by the op's group mode (``channel_id`` /
``use_global_device_ids``) as XLA does. An op inside a while loop counts once per
iteration: the loop's ``known_trip_count`` (which XLA's trip-count annotator writes
into the while op's ``backend_config``; present for ``lax.scan`` and ``fori_loop``)
multiplies everything its body runs, nested loops multiplying through. A loop with
no known trip count is counted once and reported in ``loops_without_trip_count``;
conditional branches are all counted, as if each ran once (an upper bound).
Send/recv and ragged all-to-all are not counted. Byte figures are ints when whole,
floats otherwise (``2 * 7/8 * 12`` bytes is 21, ``2 * 7/8 * 20`` is 35.0).

Given the mesh the program was partitioned over (``profile(compiled, mesh)``,
``collective_stats(text, mesh)``), the same bytes are also split by mesh axes:
``collectives_by_axes`` maps a key naming the axes a collective's group spans to bytes,
and ``collective_counts_by_axes`` the key to executions. The key joins with ``+``, in
mesh order, the axes of size > 1 whose coordinate varies within the op's first group
(``"fsdp"``, ``"data+fsdp"``); a collective-permute's names the axes that differ between
source and target in any pair. A logical device id ``i`` (the partition id, or with
``use_global_device_ids`` the id flattened over replicas x partitions), as jax.jit's SPMD
programs number them, sits at mesh position ``np.unravel_index(i, mesh sizes)``; empty
groups span every participant, the group mode deciding who participates as for ``n``;
the mesh spelling's axis names are taken as the mesh's own when they all are, and
otherwise its groups are expanded to ids. A group of one device (which sends nothing)
is left out, so these bytes sum to ``collective_bytes``; a group that cannot be mapped
(a mesh of another size than the program's) is counted under ``"unknown"``.

The figures describe the compiled program, so they inherit the backend's choices.
XLA:CPU (which the tests use) runs bf16 collectives in f32, converting around them,
and reduces FSDP gradients with all-reduce and a slice rather than reduce-scatter; a
CPU-compiled profile therefore moves more bytes than the GPU/TPU program would.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import jax
import numpy as np

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all",
)

# Bits per element of every HLO primitive type; tuples and tokens hold no data of their own.
_DTYPE_BITS: dict[str, int] = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8,
    "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8,
    "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "token": 0, "opaque": 0,
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_IOTA = re.compile(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_CALLEE_ATTR = re.compile(
    r"(?:^|,\s*)(calls|to_apply|body|condition|true_computation|false_computation"
    r"|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape: ``f32[8,128]{1,0}`` -> 4096; tuples sum their elements.

    Sub-byte types round up per array. Dynamic dimensions (``<=8``) count at their bound.

    Raises:
      ValueError: an element type this table does not know.
    """
    total = 0
    for dtype, dims in _ARRAY.findall(_COMMENT.sub("", shape)):
        if dtype not in _DTYPE_BITS:
            raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
        size = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        total += (size * _DTYPE_BITS[dtype] + 7) // 8
    return total


# ----------------------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


@dataclasses.dataclass
class _Computation:
    name: str
    is_entry: bool
    lines: list[str]
    instructions: list[_Instruction]


@dataclasses.dataclass
class _Module:
    computations: dict[str, _Computation]  # in text order: callees before callers
    shapes: dict[str, str]  # instruction name -> shape; names are unique per module
    replica_count: int
    num_partitions: int

    @property
    def entry(self) -> _Computation:
        return next(c for c in self.computations.values() if c.is_entry)


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    quoted = False
    for i in range(start, len(text)):
        ch = text[i]
        if quoted:
            quoted = ch != '"' or text[i - 1] == "\\"
        elif ch == '"':
            quoted = True
        elif ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO: {text[start:start + 200]!r}")


def _split_top(text: str) -> list[str]:
    """Splits on commas that are not inside brackets."""
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return [p.strip() for p in parts if p.strip()]


def _parse_instruction(line: str) -> _Instruction | None:
    m = re.match(r"\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*", line)
    if m is None:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        return None
    end = _balanced(rest, op.end() - 1)
    # An operand prints as `%name`, or as `f32[8]{0} %name` with shapes on.
    operands = tuple(
        o.split()[-1].lstrip("%") for o in _split_top(_COMMENT.sub("", rest[op.end():end - 1]))
    )
    return _Instruction(m.group(1), shape, op.group(1), operands, rest[end:])


def _parse_module(text: str) -> _Module:
    header = text.split("\n", 1)[0]
    replica_count = re.search(r"\breplica_count=(\d+)", header)
    num_partitions = re.search(r"\bnum_partitions=(\d+)", header)
    computations: dict[str, _Computation] = {}
    shapes: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = re.match(r"(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$", line)
            if m and not line.startswith("HloModule"):
                current = _Computation(m.group(2), bool(m.group(1)), [line], [])
            continue
        current.lines.append(line)
        if line.strip() == "}":
            computations[current.name] = current
            current = None
            continue
        inst = _parse_instruction(line)
        if inst is not None:
            current.instructions.append(inst)
            shapes[inst.name] = inst.shape
    if not any(c.is_entry for c in computations.values()):
        raise ValueError("no ENTRY computation in the HLO text")
    return _Module(
        computations,
        shapes,
        int(replica_count.group(1)) if replica_count else 1,
        int(num_partitions.group(1)) if num_partitions else 1,
    )


def _trip_count(inst: _Instruction) -> int | None:
    m = _TRIP_COUNT.search(inst.attrs)
    return int(m.group(1)) if m else None


def _callees(inst: _Instruction) -> Iterator[tuple[str, str]]:
    """(attribute, computation name) for every computation ``inst`` calls."""
    if inst.opcode in ("async-done", "async-update"):
        return  # the same computation as its async-start: count it there only
    for attr, value in _CALLEE_ATTR.findall(inst.attrs):
        for name in re.findall(r"%?([\w.\-]+)", value):
            yield attr, name


def _call_order(module: _Module) -> list[str]:
    """Computations reachable from the entry, every caller before its callees."""
    done: set[str] = set()
    post: list[str] = []

    def visit(name: str) -> None:
        done.add(name)
        for inst in module.computations[name].instructions:
            for _, callee in _callees(inst):
                if callee in module.computations and callee not in done:
                    visit(callee)
        post.append(name)

    visit(module.entry.name)
    return post[::-1]


def _execution_counts(module: _Module) -> tuple[dict[str, int], int]:
    """How many times each computation runs per execution of the entry, and how many
    while-loop executions had no known trip count (their bodies count once)."""
    counts = dict.fromkeys(module.computations, 0)
    counts[module.entry.name] = 1
    unknown = 0
    for name in _call_order(module):
        runs = counts[name]
        for inst in module.computations[name].instructions:
            trips = _trip_count(inst) if inst.opcode == "while" else None
            if inst.opcode == "while" and trips is None:
                unknown += runs
                trips = 1
            for attr, callee in _callees(inst):
                if callee not in counts:
                    continue
                if attr == "body":
                    counts[callee] += runs * trips
                elif attr == "condition":
                    counts[callee] += runs * (trips + 1)
                else:
                    counts[callee] += runs
    return counts, unknown


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
    n = _group_size(inst, module)
    factor = {
        "all-reduce": Fraction(2 * (n - 1), n),
        "all-gather": Fraction(n - 1),
        "reduce-scatter": Fraction(n - 1, n),
        "all-to-all": Fraction(n - 1, n),
    }[kind]
    return factor * size


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
      with a ``mesh`` also ``collectives_by_axes`` (axes key -> bytes) and
      ``collective_counts_by_axes`` (axes key -> executions).
    """
    return _collective_stats(_parse_module(hlo_text), mesh)


def _collective_stats(module: _Module, mesh=None) -> dict[str, Any]:
    counts, unknown = _execution_counts(module)
    axes = None if mesh is None else _mesh_axes(mesh)
    sent = {kind: Fraction(0) for kind in COLLECTIVE_KINDS}
    executions = {kind: 0 for kind in COLLECTIVE_KINDS}
    sent_by_axes: dict[str, Fraction] = {}
    executions_by_axes: dict[str, int] = {}
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


# ------------------------------------------------------------------------------- flops


def _cost_dict(cost) -> dict[str, float]:
    """``cost_analysis()`` as one dict: JAX has returned a dict, a list of dicts (one
    per HLO module, summed here) and None (backends without an analysis)."""
    if cost is None:
        return {}
    if isinstance(cost, dict):
        cost = [cost]
    total: dict[str, float] = {}
    for part in cost:
        for key, value in (part or {}).items():
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0.0) + float(value)
    return total


def _subgraph_text(module: _Module, root: str) -> str:
    """HLO text of a module whose entry is ``root`` and holds what ``root`` calls."""
    keep, stack = set(), [root]
    while stack:
        name = stack.pop()
        if name in keep or name not in module.computations:
            continue
        keep.add(name)
        for inst in module.computations[name].instructions:
            stack.extend(callee for _, callee in _callees(inst))
    header = (f"HloModule profiler_subgraph, replica_count={module.replica_count}, "
              f"num_partitions={module.num_partitions}")
    blocks = [header]
    for name, comp in module.computations.items():
        if name in keep:
            first = re.sub(r"^ENTRY\s+", "", comp.lines[0])
            lines = [("ENTRY " if name == root else "") + first, *comp.lines[1:]]
            blocks.append("\n".join(_without_metadata(line) for line in lines))
    return "\n\n".join(blocks) + "\n"


def _without_metadata(line: str) -> str:
    """Drops ``metadata={...}``: its ``stack_frame_id``s point into a table that the
    text does not carry, and XLA warns about each one when it parses them."""
    at = line.find(", metadata={")
    if at < 0:
        return line
    return line[:at] + line[_balanced(line, at + len(", metadata=")):]


def _loops_in(module: _Module, name: str) -> Iterator[_Instruction]:
    """While ops ``name`` runs directly or through ``call`` / async wrappers."""
    for inst in module.computations[name].instructions:
        if inst.opcode == "while":
            yield inst
        elif inst.opcode in ("call", "async-start"):
            for _, callee in _callees(inst):
                if callee in module.computations:
                    yield from _loops_in(module, callee)


def _trip_corrected_costs(
    compiled, module: _Module, raw: dict[str, float]
) -> dict[str, float] | None:
    """``raw`` with every while body counted trip-count times, or None if not possible."""
    keys = ("flops", "bytes accessed")
    entry = module.entry.name
    if not any(True for _ in _loops_in(module, entry)):
        return raw
    try:  # private jaxlib entry points: re-parse HLO text and run XLA's HloCostAnalysis
        from jax._src.lib import _jax, hlo
        analyse = _jax.hlo_module_cost_analysis
        parse = hlo.hlo_module_from_text
        client = compiled.runtime_executable().client
    except (ImportError, AttributeError):
        return None
    raw_cost: dict[str, dict[str, float]] = {entry: raw}

    def cost_of(name: str) -> dict[str, float]:
        if name not in raw_cost:
            try:
                module_of = parse(_subgraph_text(module, name))
                raw_cost[name] = _cost_dict(analyse(client, module_of))
            except Exception as e:  # XLA refused the cut-out module: keep XLA's own figure
                raise LookupError(f"cannot cost {name}: {e}") from e
        return raw_cost[name]

    def true(name: str) -> dict[str, float]:
        total = {k: cost_of(name).get(k, 0.0) for k in keys}
        for loop in _loops_in(module, name):
            trips = _trip_count(loop)
            if trips is None:
                raise LookupError(f"{loop.name} has no known trip count")
            for attr, callee in _callees(loop):
                if attr not in ("body", "condition"):
                    continue
                times = trips + (attr == "condition")
                inner = true(callee)
                for k in keys:
                    total[k] += times * inner[k] - cost_of(callee).get(k, 0.0)
        return total

    try:
        return true(entry)
    except LookupError as e:
        warnings.warn(f"profile: flops count while-loop bodies once: {e}", stacklevel=3)
        return None


# ----------------------------------------------------------------------------- profile


def profile(compiled: jax.stages.Compiled, mesh=None) -> dict[str, Any]:
    """Per-device memory, FLOPs and collective traffic of one execution of ``compiled``.

    See the module docstring for what each figure means and how it is counted.
    Memory and FLOP fields are None where the backend gives no such analysis. With the
    ``mesh`` (``jax.sharding.Mesh`` or ``AbstractMesh``) ``compiled`` was partitioned
    over, the result also has ``collectives_by_axes`` and ``collective_counts_by_axes``.
    """
    module = _parse_module(compiled.as_text())
    memory = compiled.memory_analysis()
    host_keys = ("host_argument_bytes", "host_output_bytes", "host_alias_bytes", "host_temp_bytes")
    if memory is None:
        mem = dict.fromkeys(
            ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
             "generated_code_bytes", "peak_bytes", *host_keys))
    else:
        mem = {
            "argument_bytes": int(memory.argument_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes),
            "alias_bytes": int(getattr(memory, "alias_size_in_bytes", 0)),
            "temp_bytes": int(memory.temp_size_in_bytes),
            "generated_code_bytes": int(getattr(memory, "generated_code_size_in_bytes", 0)),
        }
        mem["peak_bytes"] = (mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"]
                             + mem["temp_bytes"])
        for key in host_keys:  # host_argument_bytes <- host_argument_size_in_bytes
            mem[key] = int(getattr(memory, key.replace("_bytes", "_size_in_bytes"), 0))
    raw = _cost_dict(compiled.cost_analysis())
    corrected = _trip_corrected_costs(compiled, module, raw)
    best = raw if corrected is None else corrected
    return {
        **mem,
        "flops": best.get("flops"),
        "bytes_accessed": best.get("bytes accessed"),
        "xla_flops": raw.get("flops"),
        "flops_trip_corrected": corrected is not None,
        **_collective_stats(module, mesh),
    }


def profile_json(compiled: jax.stages.Compiled, mesh=None) -> str:
    """``profile(compiled, mesh)`` as one line of JSON."""
    return json.dumps(profile(compiled, mesh), separators=(",", ":"))
