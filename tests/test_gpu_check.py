"""bench/gpu_check.sh, the GPU user's first check (issue 35, item 9), on a machine without
a GPU: it says so in one line and writes nothing; its parts' code runs here in a smoke
(tiny shapes, Pallas interpret mode), and every GPU-sized case, option list and config
override it would use on a GPU is built and checked here, so that a typo cannot wait
for the first GPU to show itself."""

import argparse
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_GPU = "gpu_check: no GPU here (jax backend: cpu); nothing to check"


def load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


PACKAGE = ROOT / "bench" / "gpu_check"  # run as a folder: its modules import each other by plain names
sys.path.insert(0, str(PACKAGE))
try:
    import correctness
    import kernel_bench
    import orchestrate
    import processes
    import train_bench
finally:
    sys.path.remove(str(PACKAGE))


def sh(*args, env=None, timeout=120):
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=ROOT, timeout=timeout)


def test_without_a_gpu_one_line_nothing_written(tmp_path):
    out = sh("--out", str(tmp_path / "out"), env={"PYTHON": sys.executable})  # conftest: JAX_PLATFORMS=cpu
    assert out.returncode == 0
    assert (out.stdout + out.stderr).splitlines() == [NO_GPU]
    assert not (tmp_path / "out").exists()


def test_without_a_python_that_has_jax_one_line(tmp_path):
    out = sh("--out", str(tmp_path / "out"), env={"PYTHON": str(tmp_path / "no-such-python")})
    assert out.returncode == 0
    assert (out.stdout + out.stderr).splitlines() == [
        f"gpu_check: no GPU here (no Python with jax: tried {tmp_path / 'no-such-python'}); nothing to check"]


@pytest.mark.slow
def test_an_uninstalled_checkout_imports_as_the_package(tmp_path):
    """The parts import jaxpar from the checkout the script sits in, through links laid
    out as pyproject's package-dir installs it, ahead of any installed jaxpar (here the
    editable install of /work/main's checkout: the copy's files must win)."""
    copy = tmp_path / "checkout"
    for name in ("jaxpar", "kernels", "models", "train"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PACKAGE, copy / "bench" / "gpu_check", ignore=shutil.ignore_patterns("__pycache__"))
    copied = load(copy / "bench" / "gpu_check" / "processes.py", "copied_gpu_check_processes")
    shim = copied.make_shim(tmp_path / "shim")
    code = ("import jaxpar, jaxpar.kernels, jaxpar.train.config as c, jaxpar.train.loop as l; "
            "print(jaxpar.__file__); print(jaxpar.kernels.__file__); print(c.CONFIG_DIR); "
            "print(l.flops_per_token(c.load_config('small', [])) > 0)")
    # As the script runs its processes: in the shim's directory (`python -m` puts the
    # working directory first on sys.path), the shim on PYTHONPATH.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(shim)}, cwd=shim)
    assert out.returncode == 0, out.stderr
    package, kernels, configs, ok = out.stdout.split()
    assert pathlib.Path(package).resolve() == (copy / "jaxpar" / "__init__.py").resolve()
    assert pathlib.Path(kernels).resolve() == (copy / "kernels" / "__init__.py").resolve()
    assert (pathlib.Path(configs) / "1b.yaml").exists() and ok == "True"


def test_the_parts_bounds_add_up_to_the_time_limit():
    assert sum(bound for _, bound in orchestrate.PARTS) == orchestrate.TIME_LIMIT_S <= 560
    assert [name for name, _ in orchestrate.PARTS] == ["probe", "correctness", "model", "kernels", "train",
                                                     "offload", "serve"]


def test_a_part_killed_or_failing_is_recorded_and_the_summary_says_why():
    killed = orchestrate.finish("train", None, "x\nlast words\n", {"summary": "small: 1 tokens/s"}, 130.0, 400.0)
    assert killed["status"] == "failed" and "killed at its bound" in killed["reason"]
    assert "small: 1 tokens/s" in killed["reason"] and killed["tail"].endswith("last words\n")
    crashed = orchestrate.finish("model", 1, "Traceback ...\nValueError: boom\n", {}, 3.0, 100.0)
    assert crashed["status"] == "failed" and "ValueError: boom" in crashed["reason"]
    skipped = orchestrate.finish("serve", 0, "", {"status": "skipped", "reason": "skipped: no GPU"}, 1.0, 9.0)
    assert skipped["status"] == "skipped" and "tail" not in skipped
    assert orchestrate.line("serve", skipped).split()[:2] == ["serve", "skipped"]


def test_the_gpu_runs_options_and_overrides_are_valid():
    """bench/kernels.py takes the kernels part's options; jaxpar-train takes the train and
    offload parts' overrides (both configs, both offload modes)."""
    kernels = load(ROOT / "bench" / "kernels.py", "bench_kernels_for_gpu_check")
    args = kernels.parse_args(["--skip-train", "--json", "x.json", "--time-limit-s", "80", *kernel_bench.KERNEL_ARGS])
    assert args.attention_impls == ["jaxpar", "cudnn", "xla"] and "train" not in args.parts
    from jaxpar.train.config import load_config

    ns = argparse.Namespace(smoke=False, work=pathlib.Path("/tmp/w"))
    runs = train_bench.train_runs(ns)
    assert [r.config for r in runs] == ["small", "1b"]
    for run in runs:
        for _, extra in ((None, []), *train_bench.OFFLOAD_MODES):
            cfg = load_config(run.config, [*run.overrides, *extra, f"steps={run.steps}", "run_dir=/tmp/w/r"])
            assert cfg.steps == run.steps and run.warmup < run.steps
    assert load_config("1b", runs[1].overrides).batch_size == 8


def _lowered_not_run(jit):
    """``jax.jit`` whose programs the caller calls (not those called while tracing) are
    lowered for this CPU, not run: each call answers its outputs' shapes, each with
    ``program``, the lowered text (its module's name left out)."""
    tracing = []

    def lowered_jit(fn=None, **options):
        if fn is None:
            return lambda f: lowered_jit(f, **options)
        real = jit(fn, **options)

        def call(*args, **kwargs):
            if tracing:
                return real(*args, **kwargs)
            tracing.append(fn)
            try:
                lowered = real.lower(*args, **kwargs)
            finally:
                tracing.pop()
            program = re.sub(r"^module @\S+", "module", lowered.as_text())
            return jax.tree.map(lambda out: argparse.Namespace(program=program, shape=out.shape, dtype=out.dtype),
                                lowered.out_info)

        return call

    return lowered_jit


@pytest.mark.slow
def test_every_gpu_case_builds_its_inputs_and_passes_the_kernels_checks(monkeypatch):
    """The correctness part's GPU cases with ``interpret=None``, which off a GPU runs each
    kernel's reference: every case builds its inputs and passes the wrappers' shape
    checks (``jax.jit(...).lower``: traced and lowered for this CPU, not run, so no
    GPU-sized array is computed), and its error is 0: the kernel's program is the
    reference's, the same text (flash attention, the norms, cross-entropy), or, where
    the wrapper clips its indices first (decode, paged and ragged attention), has the
    reference's output shapes and dtypes. (tests/test_kernels_*.py and the smoke below
    compare those kernels' values with their references.)"""
    monkeypatch.setattr(jax, "jit", _lowered_not_run(jax.jit))

    clipping = ("decode_attention", "paged_decode_attention", "ragged_paged_attention")
    kernel = None

    def rel_err(got, want):
        assert (got.shape, got.dtype) == (want.shape, want.dtype), kernel
        return 0.0 if got.program == want.program or kernel in clipping else math.inf

    monkeypatch.setattr(correctness, "rel_err", rel_err)
    for case in correctness.correctness_cases(smoke=False):
        kernel = case.kernel
        errors = case.check(None)
        assert errors and max(errors.values()) == 0, case.name


@pytest.mark.slow
def test_smoke_runs_the_kernel_and_model_checks(tmp_path):
    """The orchestrator end to end in --smoke (the kernels in interpret mode): results.json
    and summary.txt, every case within tolerance."""
    out = subprocess.run([sys.executable, str(PACKAGE), "--smoke", "--out", str(tmp_path),
                          "--parts", "correctness", "model", "--time-limit-s", "2000"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    parts = results["parts"]
    assert results["smoke"] and set(parts) == {"probe", "correctness", "model"}
    assert all(p["status"] == "ok" for p in parts.values()), {k: p.get("reason") for k, p in parts.items()}
    cases = parts["correctness"]["cases"]
    assert {c["kernel"] for c in cases} == {"flash_attention", "decode_attention", "paged_decode_attention",
                                            "ragged_paged_attention", "norm", "linear_cross_entropy"}
    assert all(c["worst"] <= c["tolerance"] for c in cases)
    assert [r["status"] for r in parts["model"]["rows"]] == ["ok"]  # the bfloat16 model alone in --smoke
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("gpu_check SMOKE") and any(l.startswith("correctness  ok") for l in summary)
    assert (tmp_path / "gpu_check.log").exists()


def test_a_bounded_run_is_killed_with_everything_it_started(tmp_path):
    """A part past its bound is killed with its process group: a training run or a
    jaxpar-serve it started does not outlive it (holding the GPU's memory)."""
    pid_file = tmp_path / "pid"
    began = time.perf_counter()
    code, text = processes.run_bounded(["bash", "-c", f"echo started; sleep 60 & echo $! > {pid_file}; wait"], 1.5,
                                       new_session=True)
    assert code is None and text.startswith("started") and time.perf_counter() - began < 15
    stat = pathlib.Path(f"/proc/{pid_file.read_text().strip()}/stat")
    assert not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z"  # gone, or a zombie for init
