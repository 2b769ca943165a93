#!/usr/bin/env bash
# A GPU user's first check, in one command (issue 35, item 9):
#
#     bash bench/gpu_check.sh [--out DIR] [--parts PART ...] [--time-limit-s 560]
#
# On a machine whose JAX backend is a GPU: the kernel and model checks that have a GPU
# path, compiled (no interpret mode), then the headline GPU figures BENCHMARKS.md marks
# "not yet measured", each part in a process of its own with a hard bound, continuing
# past a failed part; DIR/results.json (every figure), DIR/summary.txt (one line per
# part, then the kernel tables) and DIR/gpu_check.log. DIR: --out, else $OUT, else
# runs/gpu_check. Exit 1 if a part failed, else 0.
#
# Bounds (bench/gpu_check/: __main__.py's docstring, and each part's module's, say what
# each part runs), 560 s in all, under 10 minutes on one H100; time a part leaves unused
# passes to the ones after it:
#
#     probe 40 s | correctness 100 s | model 45 s | kernels 100 s | train 130 s
#     offload 80 s | serve 65 s
#
# Without a GPU (no Python with JAX, or JAX's backend is not gpu): one line on stdout,
# nothing written, exit 0.
#
# The interpreter: $PYTHON, else the first of python, python3 that has JAX; it runs the
# folder bench/gpu_check (its __main__.py). jaxpar need not be installed: the parts
# import it from this checkout.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

has_jax() {
    command -v "$1" >/dev/null 2>&1 &&
        "$1" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("jax") is None)' >/dev/null 2>&1
}

if [ -n "${PYTHON:-}" ]; then
    candidates=("$PYTHON")
else
    candidates=(python python3)
fi
py=""
for candidate in "${candidates[@]}"; do
    if has_jax "$candidate"; then
        py="$candidate"
        break
    fi
done
if [ -z "$py" ]; then
    echo "gpu_check: no GPU here (no Python with jax: tried ${candidates[*]}); nothing to check"
    exit 0
fi
exec "$py" "$here/gpu_check" "$@"
