"""FLOPs and bytes accessed of a compiled program, every while loop's body counted its
trip count times (``jaxpar.profiler``'s docstring)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator

import jax

from jaxpar.profiler.hlo import _Instruction, _Module, _balanced, _callees, _trip_count

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


