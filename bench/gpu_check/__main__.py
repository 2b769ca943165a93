"""A GPU user's first check, in one command (issue 35, item 9): ``bash bench/gpu_check.sh``.

    bash bench/gpu_check.sh [--out DIR] [--parts PART ...] [--time-limit-s 560] [--smoke]

(which runs ``python bench/gpu_check ARGS``, this folder, with a Python that has JAX).
On a machine whose JAX backend is a GPU it runs, each part in a process of its own and
each bounded, the checks and headline figures that BENCHMARKS.md marks "not yet
measured", and writes ``DIR/results.json`` (every figure, every error),
``DIR/summary.txt`` (one line per part, then each part's cases or tables, the tables as
BENCHMARKS.md prints them) and ``DIR/gpu_check.log`` (every part's whole output), each
rewritten as every part ends. DIR is ``--out``, else ``$OUT`` when set, else
``runs/gpu_check`` (``runs/`` is git-ignored). A part that fails or runs out of time is
recorded (``failed``, with the tail of its output) and the next one runs; a part whose
dependencies are missing is ``skipped`` with the reason. The exit status is 1 if any
part failed, else 0.

Without a GPU (JAX missing, or its backend not ``gpu``) it prints one line,
``gpu_check: no GPU here (jax backend: cpu); nothing to check``, writes nothing and exits 0.
``--smoke`` runs every part tiny on whatever backend there is (the kernels in Pallas
interpret mode off a GPU): a check of this script, not of a GPU, used by
``tests/test_gpu_check.py``.

The parts, in order, each with its bound; the module that runs it says what it runs.
Each bound is a hard kill of the part's process group; a part's deadline is the sum of
its own bound and those before it from the start, so time a part leaves unused passes to
the next ones and no part ever gets less than its own bound. The bounds add up to 560 s,
the default ``--time-limit-s`` (which scales them): under the 10 minutes one lent H100
call allows, with 40 s for the start.

* ``probe`` (40 s, ``probe.py``): device, compute capability, memory, JAX version, which
  optional packages import, jaxpar importable from this checkout.
* ``correctness`` (100 s, ``correctness.py``): jaxpar's Pallas kernels compiled, forward
  and backward, against their ``*_reference`` functions on random inputs.
* ``model`` (45 s, ``model_check.py``): the ``tiny`` Transformer's loss and gradients on
  jaxpar's kernels (and cuDNN attention) against XLA, float32 and bfloat16.
* ``kernels`` (100 s, ``kernel_bench.py``): ``bench/kernels.py`` on a reduced set:
  ceilings, norms, cross-entropy, attention, decode; its tables and targets.
* ``train`` (130 s, ``train_bench.py``): ``jaxpar-train small`` then ``1b``: step time,
  tokens/s, MFU, compile + first step, live device bytes.
* ``offload`` (80 s, ``train_bench.py``): ``small`` with parameters, then also the
  optimizer state, on the host, against ``train``'s all-on-device run.
* ``serve`` (65 s, ``serve_bench.py``): the serving engine, continuous then static
  batching, on a ``small`` target under load; ``jaxpar-serve`` over HTTP on ``train``'s
  run where its packages are installed.

What each part fills in BENCHMARKS.md: ``correctness`` and ``model`` are the first
compiled (not interpret-mode) runs of the kernels and of the model on them;
``kernels`` the "Kernels" section's ceilings, targets and tables; ``train`` the "GPU"
section's MFU, step time and tokens/s of ``small`` and ``1b``; ``offload`` the "Host
offload" GPU section's throughput with offload against all-on-device (on ``small``, not
the section's full capacity runs); ``serve`` the "Serving" section's GPU row (engine
mode; HTTP where its packages are installed).

The rest: ``orchestrate.py`` the driver and the outputs; ``part.py`` a part's process,
record and deadline; ``processes.py`` bounded processes and the shim. jaxpar need not be
installed: every process runs with a ``jaxpar`` package assembled from this checkout on
``PYTHONPATH`` (``processes.make_shim``: a temporary directory of symbolic links), ahead
of any installed copy. This folder is run as a script (``python bench/gpu_check``), so
it is first on ``sys.path`` and its modules import each other by their plain names; at
import they need only the standard library (the orchestrator never starts JAX).
"""

from __future__ import annotations

import sys

import correctness
import kernel_bench
import model_check
import orchestrate
import part
import probe
import serve_bench
import train_bench

PARTS = {"probe": probe.part_probe, "correctness": correctness.part_correctness, "model": model_check.part_model,
         "kernels": kernel_bench.part_kernels, "train": train_bench.part_train, "offload": train_bench.part_offload,
         "serve": serve_bench.part_serve, "serve_http": serve_bench.part_serve_http}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:  # a part, in the process the orchestrator started for it
        return part.child_main(argv[1:], PARTS)
    if argv[:1] == ["--train-child"]:  # a training run, in the process a train or offload part started
        return train_bench.train_child(argv[1:])
    return orchestrate.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
