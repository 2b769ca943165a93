"""tests/exact/ (offloading's checks against the all-on-device step, held to 1e-6 by
issue 18; the embedding cache's against the whole table on the device, bit for bit by
issue 37) in a pytest of their own, with XLA:CPU's default fusion emitters: the rest of
the suite compiles with the elemental ones, which contract different multiply-adds into
FMAs in two programs that fuse differently (conftest.py, EXACT)."""

import os
import pathlib
import subprocess
import sys

import pytest

from conftest import EXACT

TESTS = pathlib.Path(__file__).resolve().parent


@pytest.mark.slow
def test_exact_checks_under_the_default_emitters():
    env = dict(os.environ, **{EXACT: "1"})
    env.pop("PYTEST_XDIST_TESTRUNUID", None)  # caches of its own, removed when it ends
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider",
                          "--durations=5", str(TESTS / "exact")], cwd=TESTS.parent, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]
    assert " passed" in out.stdout and " failed" not in out.stdout
