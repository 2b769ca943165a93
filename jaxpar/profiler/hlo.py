"""Reading an optimized HLO module's text: array shapes' bytes, instructions, computations,
and how many times each computation runs per execution (while loops' trip counts)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

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
    r"|branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
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


