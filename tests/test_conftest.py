"""The suite's per-run caches (conftest.py): one directory for all workers of a run, never
the user's ~/.cache, removed when the run ends."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a pytest run of its own, two workers

PROBE = '''
import os, pathlib

def test_{name}():
    cache = pathlib.Path(os.environ["XDG_CACHE_HOME"])
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "{name}").write_text("x")
    (pathlib.Path(__file__).parent / "{name}.seen").write_text(str(cache))
'''


def test_a_parallel_run_shares_one_cache_and_removes_it(tmp_path):
    shutil.copy(pathlib.Path(__file__).with_name("conftest.py"), tmp_path)
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(PROBE.format(name=name))
    (tmp_path / "tmp").mkdir()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadfile", str(tmp_path)],
                         cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp_path / "tmp")),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = {(tmp_path / f"{name}.seen").read_text() for name in ("a", "b")}
    assert len(seen) == 1 and seen.pop().startswith(str(tmp_path / "tmp" / "jaxpar-tests-"))
    assert not list((tmp_path / "tmp").glob("jaxpar-tests-*"))


def test_tree_rel_err_does_not_drop_a_zero_reference_or_a_nan():
    """A leaf whose reference is all zeros (a 0/0) and a NaN leaf make the error large,
    not vanish from the maximum."""
    import numpy as np

    from conftest import tree_rel_err

    rng = np.random.default_rng(0)
    ref = {"w": rng.normal(size=(3, 4)), "zero": np.zeros(5)}
    assert tree_rel_err(ref, ref) == 0.0
    assert tree_rel_err({**ref, "zero": np.full(5, 1e-3)}, ref) > 1e-5
    assert tree_rel_err({**ref, "w": np.full((3, 4), np.nan)}, ref) == np.inf
