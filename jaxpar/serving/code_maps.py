"""Memory mappings a CPU serving process would need for its compiled programs, checked
before compiling them.

On XLA:CPU every compiled executable maps its JIT code into the process: a serving step
program adds roughly 240-400 entries to ``/proc/self/maps`` (``MAPS_PER_PROGRAM``), a
speculative step (target and draft, the draft's rounds) about three times that
(``MAPS_PER_SPECULATIVE_PROGRAM``). Linux
caps a process at ``vm.max_map_count`` mappings (``/proc/sys/vm/max_map_count``, 65,530
by default), and past it the next mapping fails and the process segfaults inside XLA
(a CI worker did). ``Engine.warm_up`` compiles every step shape up front: about 138
programs at ``--max-context 2048`` with the default flags, more with a longer context, a
draft (``speculative_step`` programs) or several replicas in one process. So a large
configuration crashes during warm-up with no word of why.

``check_code_mappings`` runs before the compiles and turns that crash into one line: the
programs about to be compiled, the mappings they would bring the process to against
the limit, and what to change. It checks only the CPU backend (a GPU executable's code
lives on the device, not in host mappings) and only where ``/proc`` says both numbers
(Linux); elsewhere it lets the compiles run.
"""

from __future__ import annotations

import math

# /proc/self/maps entries one compiled serving step program adds on XLA:CPU. Measured
# with JAX/jaxlib 0.10.2 at JAX's default XLA flags (no XLA_FLAGS; the tests' conftest
# sets --xla_backend_optimization_level=0, which is not what serving runs), on Linux
# x86-64, in a fresh process: Engine(...).warm_up_programs() lowered and compiled one by
# one, counting /proc/self/maps lines around each compile (2026-11-28, with the packed
# row's attention as a lax.switch over 1, 2 or all 4 sequences' pages:
# jaxpar.serving.pages.PACKED_SEQUENCES).
#   SmolLM2-135M's shape (dim 576, 30 layers, 9/3 heads, vocab 49152), max_context 2048,
#   default flags (138 programs, page widths 16/64/128), every 8th program, 18 of them:
#   mean 354 after the first, min 239, max 395 per program.
#   The tests' small model (dim 32, 2 layers, vocab 96), max_batch 4, max_context 256,
#   page_size 8, max_num_batched_tokens 64: all 24 programs, mean 343, min 248, max 396.
#   (Before the switch: means 286 and 289, max 328.)
# So the count follows the program's kernels, not the model's size (30 layers cost what
# 2 do). A plain small jitted function (tanh(x @ x.T).sum(0), 20 shapes) adds
# about 6 each, so it is the step programs' many fused kernels that cost. 360 is the
# mean rounded up; with the 10% headroom below, the check holds up to ~400 a program.
MAPS_PER_PROGRAM = 360

# The same for a speculative_step program (an Engine with a draft), measured alike:
#   SmolLM2-135M's shape as above with a 2-layer draft (dim 128, vocab 49152), gamma 4
#   (the default), max_context 2048 (105 programs), every 11th, 10 of them: mean 1,019
#   after the first, min 668, max 1,094 (922 before the switch).
#   The small model as its own draft, gamma 3, all 24 programs: mean 780, max 1,041.
#   Prefill-only ones (no decode rows) cost what a step does.
# It grows with gamma (not measured why); GliDe and tree methods were not measured.
# 1,050 covers the SmolLM2 mean at the default gamma.
MAPS_PER_SPECULATIVE_PROGRAM = 1050

# Refuse past this fraction of vm.max_map_count: the estimate is an average, and the
# process maps more as it runs (buffers, threads, the persistent cache's files).
HEADROOM = 0.9

MAPS = "/proc/self/maps"
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


def current_mappings() -> int | None:
    """The memory mappings this process has now (lines of ``/proc/self/maps``); None
    where there is no ``/proc`` (macOS, Windows)."""
    try:
        with open(MAPS, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int | None:
    """``vm.max_map_count``, the most mappings a process may have; None if unreadable."""
    try:
        with open(MAX_MAP_COUNT) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def suggested_limit(estimate: int) -> int:
    """A ``vm.max_map_count`` with room for ``estimate`` mappings twice over, rounded up
    to a multiple of 65,536."""
    return max(1, math.ceil(2 * estimate / 65536)) * 65536


def estimate_error(current: int, programs: int, limit: int, maps_per_program: int = MAPS_PER_PROGRAM) -> str | None:
    """The one-line error compiling ``programs`` more programs would earn with
    ``current`` mappings and a limit of ``limit``; None where they fit (an estimate of
    ``current + programs * maps_per_program`` within ``HEADROOM`` of ``limit``)."""
    if programs <= 0:
        return None
    estimate = current + programs * maps_per_program
    allowed = int(limit * HEADROOM)
    if estimate <= allowed:
        return None
    return (f"compiling {programs:,} programs would bring this process to about {estimate:,} memory mappings "
            f"({current:,} now + {programs:,} x ~{maps_per_program} for XLA:CPU's code), over "
            f"{HEADROOM:.0%} of vm.max_map_count={limit:,} ({allowed:,}), and past the limit XLA segfaults: "
            f"lower --max-context, --max-num-batched-tokens or --max-batch, run fewer replicas per process, "
            f"or raise the limit with `sysctl -w vm.max_map_count={suggested_limit(estimate)}`")


def check_code_mappings(programs: int, *, platform: str, maps_per_program: int = MAPS_PER_PROGRAM) -> None:
    """Raises ValueError (one line) where compiling ``programs`` programs on
    ``platform`` (``jax.default_backend()``'s name) would come near ``vm.max_map_count``.
    Checks only ``"cpu"``, and only where both counts can be read. An engine with a draft
    passes ``maps_per_program=MAPS_PER_SPECULATIVE_PROGRAM``."""
    if platform != "cpu":
        return
    current, limit = current_mappings(), map_limit()
    if current is None or limit is None:
        return
    error = estimate_error(current, programs, limit, maps_per_program)
    if error is not None:
        raise ValueError(error)
