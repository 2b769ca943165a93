"""The README's main job and the benchmark script run as a newcomer runs them."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_demo_trains_on_the_mesh():
    out = run("-m", "jaxpar.demo", "--steps", "10")
    assert out.returncode == 0, out.stderr
    assert "mesh {'data': 1, 'fsdp': 8" in out.stdout
    diff = float(out.stdout.split("max relative difference ")[1].split()[0])
    assert diff < 1e-5
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0] - 1.0


def test_demo_rejects_bad_arguments():
    out = run("-m", "jaxpar.demo", "--batch", "3")
    assert out.returncode == 2
    assert "--batch a multiple of 8" in out.stderr.strip().splitlines()[-1]


def test_fsdp_memory_benchmark():
    out = run("bench/fsdp_memory.py", "--models", "tiny", "--seq-len", "32")
    assert out.returncode == 0, out.stderr
    ratio = [line.split("|")[5] for line in out.stdout.splitlines() if line.startswith("| tiny | 1.8M | 8 |")]
    assert ratio and 0.125 <= float(ratio[0]) < 0.13


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = readme.split("```bash\n")[1:3]
    demo, tests = (block.split("\n```")[0].strip() for block in blocks)
    assert "jaxpar.demo" in demo and "pytest" in tests
    assert tests in (ROOT / ".ci/run").read_text().splitlines()
