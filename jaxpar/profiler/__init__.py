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
``collective_counts_by_axes`` the key to executions and ``collective_kinds_by_axes`` the key
to bytes by kind (what the planner needs to rescale a group of another size). The key joins with ``+``, in
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

import json
from typing import Any

import jax

from jaxpar.profiler.collectives import COLLECTIVE_KINDS, _collective_stats, collective_stats
from jaxpar.profiler.flops import _cost_dict, _trip_corrected_costs
from jaxpar.profiler.hlo import _parse_module, shape_bytes

__all__ = ["COLLECTIVE_KINDS", "collective_stats", "profile", "profile_json", "shape_bytes"]


# ----------------------------------------------------------------------------- profile


def profile(compiled: jax.stages.Compiled, mesh=None) -> dict[str, Any]:
    """Per-device memory, FLOPs and collective traffic of one execution of ``compiled``.

    See the module docstring for what each figure means and how it is counted.
    Memory and FLOP fields are None where the backend gives no such analysis. With the
    ``mesh`` (``jax.sharding.Mesh`` or ``AbstractMesh``) ``compiled`` was partitioned
    over, the result also has ``collectives_by_axes``, ``collective_counts_by_axes`` and
    ``collective_kinds_by_axes``.
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
