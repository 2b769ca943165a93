"""The README's commands and the benchmark scripts run as a newcomer runs them."""

import pathlib
import subprocess

import pytest
import sys

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips the file

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_fsdp_memory_benchmark():
    out = run("bench/fsdp_memory.py", "--models", "tiny", "--seq-len", "32")
    assert out.returncode == 0, out.stderr
    ratio = [line.split("|")[5] for line in out.stdout.splitlines() if line.startswith("| tiny | 1.8M | 8 |")]
    assert ratio and 0.125 <= float(ratio[0]) < 0.13


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = readme.split("```bash\n")[1:3]
    demo, tests = (block.split("\n```")[0].strip() for block in blocks)
    assert "jaxpar-train tiny" in demo and "jaxpar-generate runs/tiny" in demo and "pytest" in tests
    assert tests in (ROOT / ".ci/run").read_text().splitlines()


def test_step_overhead_benchmark():
    out = run("bench/step_overhead.py", "--rounds", "1", "--steps", "2", "--batch", "2", "--seq-len", "16")
    assert out.returncode == 0, out.stderr
    assert "jaxpar / plain = " in out.stdout


def test_tensor_parallel_benchmark():
    out = run("bench/tensor_parallel.py", "--config", "tiny", "--devices", "4", "--batch", "2", "--seq-len", "64")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 4 |")]
    assert len(rows) == 3 and "1D + SP" in rows[1] and "2D SUMMA" in rows[2]


def test_pipeline_benchmark():
    out = run("bench/pipeline.py", "--config", "tiny", "--pipe", "2", "--microbatches", "4",
              "--schedules", "1f1b")
    assert out.returncode == 0, out.stderr
    assert "| 1f1b | 4 | 1 | 10 | 0.2000 | 0.2000 |" in out.stdout  # the profile table
    assert "| 1f1b | 1 |" in out.stdout and "no-bubble step" in out.stdout


def test_sequence_parallel_benchmark():
    out = run("bench/sequence_parallel.py", "--config", "tiny", "--impls", "ring",
              "--devices", "1", "2", "--lengths", "256", "512", "1024", "--budget-gib", "0.1")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ring |")]
    assert len(rows) == 2
    assert "ring, longest at N=2 / (N x longest at N=1)" in out.stdout


def test_kernels_benchmark_smoke():
    """bench/kernels.py --smoke: tiny shapes, Pallas interpret mode on CPU (a correctness
    smoke of the script, not a performance figure). The training part is skipped here:
    test_train runs execution.attention=pallas."""
    out = run("bench/kernels.py", "--smoke", "--skip-train")
    assert out.returncode == 0, out.stderr
    assert "| BxNxTxH | causal | impl | fwd ms | fwd TFLOP/s |" in out.stdout
    xla = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| 1x2x256x64 | yes | xla |")]
    assert xla and float(xla[0][4]) > 0 and float(xla[0][7]) < 1e-2  # timed, and close to float32
    assert "| 1x2x256x64 | yes | jaxpar |" in out.stdout and "| 1x2x256x64 | no | cudnn | needs GPU |" in out.stdout
    for header in ("| B | S | T | KV MB | impl |", "| norm | mode | impl |", "| NxDxV | mode | impl |"):
        assert header in out.stdout
    last = out.stdout.strip().splitlines()
    assert "| target (issue) | jaxpar measured | verdict |" in last[-7] and last[-1].startswith("| decode >= 70%")
