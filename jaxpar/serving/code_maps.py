"""Memory mappings a CPU serving process would need for its compiled programs, checked
before compiling them.

On XLA:CPU every compiled executable maps its JIT code into the process: a serving step
program adds roughly 300-400 entries to ``/proc/self/maps`` (``MAPS_PER_PROGRAM``), a
speculative round's program (both models, the draft's steps, the acceptance) about
three times that (``MAPS_PER_SPECULATIVE_PROGRAM``). Linux caps a process at
``vm.max_map_count`` mappings (``/proc/sys/vm/max_map_count``, 65,530 by default), and
past it the next mapping fails and the process segfaults inside XLA (a CI worker did).
``Engine.warm_up`` compiles every program up front. Since the ragged step (a program per
token bucket, whatever the context: 6 at the default flags, 3 + 4 with a draft) that is
a few thousand mappings; before it, every (decode rows, prompt tokens, pages read)
bucket was a program: 138 at ``--max-context 2048``, 184 at SmolLM2's 8,192, which
this guard refused at the default flags. It stays as the last guard: several replicas
in one process, or a much larger token budget, still multiply the programs.

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
# one, counting /proc/self/maps lines around each compile (2026-11-28, the ragged step:
# one flat token batch, attention in a loop over blocks of pages, the sampling in a
# loop over chunks of rows):
#   SmolLM2-135M's shape (dim 576, 30 layers, 9/3 heads, vocab 49152), context 8192,
#   token buckets 16 ... 256 (5 programs): 313, 319, 321, 327, 327.
#   (Before it, with the buckets' programs: a mean of 354, max 395, at context 2048.)
# So the count follows the program's kernels, not the model's size (30 layers cost what
# 2 do). A plain small jitted function (tanh(x @ x.T).sum(0), 20 shapes) adds
# about 6 each, so it is the step programs' many fused kernels that cost. 360 covers the
# measured ones with room.
MAPS_PER_PROGRAM = 360

# The same for a round_step program (an Engine with a draft), measured alike by
# bench/serve_startup.py (the whole process's mappings once it listens, less the same
# server's without a draft): SmolLM2-135M's shape with a random 2-layer draft (dim 128,
# vocab 49152), gamma 4 (the default), 7 round programs: about 810 each (2026-11-28).
# (Before the ragged step, its speculative_step programs: a mean of 1,019, max 1,094.)
# It grows with gamma (not measured why); GliDe and tree methods were not measured.
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
            f"lower --max-num-batched-tokens (its buckets are the programs), run fewer replicas per process, "
            f"or raise the limit with `sysctl -w vm.max_map_count={suggested_limit(estimate)}`")


def check_code_mappings(programs: int, *, platform: str, maps_per_program: int = MAPS_PER_PROGRAM) -> None:
    """Raises ValueError (one line) where compiling ``programs`` programs on
    ``platform`` (``jax.default_backend()``'s name) would come near ``vm.max_map_count``.
    Checks only ``"cpu"``, and only where both counts can be read. An engine passes its
    programs' average (``Engine.maps_per_program``)."""
    if platform != "cpu":
        return
    current, limit = current_mappings(), map_limit()
    if current is None or limit is None:
        return
    error = estimate_error(current, programs, limit, maps_per_program)
    if error is not None:
        raise ValueError(error)
