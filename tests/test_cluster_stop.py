"""What ``jaxpar-cluster run`` does with a job's processes, on real processes under
``JobProcess`` (the class its Ray actor runs, here without Ray): the exit statuses a stop
produces are the ones it resumes from, a failure is not, and a job larger than a node is
processes of equal size."""

import sys
import time

import pytest

from jaxpar.cluster.run import JobProcess, combined_status, processes_for, resumable

LOOP = ("import signal, sys, time\n"
        "{setup}\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")
# jaxpar-train's own: SIGTERM stops at the next step, which is saved, and exits 143
AT_A_STEP = "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))"
BEFORE_THE_LOOP = "pass"  # still loading or compiling: Python's default SIGTERM handling
IGNORES_IT = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"  # past the grace: SIGKILL


def started(tmp_path, setup):
    log = tmp_path / "job.log"
    job = JobProcess([sys.executable, "-c", LOOP.format(setup=setup)], {}, str(log))
    deadline = time.monotonic() + 30
    while "ready" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    return job


@pytest.mark.parametrize("setup, status", [(AT_A_STEP, 143), (BEFORE_THE_LOOP, -15), (IGNORES_IT, -9)])
def test_a_stopped_job_resumes_whenever_it_was_stopped(tmp_path, setup, status):
    job = started(tmp_path, setup)
    assert job.poll() is None
    assert job.stop(grace_s=1.0) == status and resumable(status)


def test_a_job_that_failed_does_not_resume(tmp_path):
    log = tmp_path / "job.log"
    job = JobProcess([sys.executable, "-c", "raise SystemExit(3)"], {}, str(log))
    deadline = time.monotonic() + 30
    while job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.stop(grace_s=5.0) == 3 and not resumable(3) and not resumable(1)
    missing = JobProcess(["/nonexistent/jaxpar-train"], {}, str(log))
    assert missing.poll() == 127 and not resumable(127)


def test_a_job_larger_than_a_node_is_processes_of_equal_size():
    assert processes_for(4, 8) == (1, 4) and processes_for(8, 8) == (1, 8)
    assert processes_for(16, 8) == (2, 8) and processes_for(12, 8) == (2, 6)
    assert processes_for(7, 4) == (7, 1)  # no equal split fits fewer: one device each
    assert processes_for(9, 4) == (3, 3)


def test_a_jobs_status_is_its_processes():
    assert combined_status([None, None]) is None and combined_status([0, None]) is None
    assert combined_status([0, 0]) == 0
    assert combined_status([143, 0]) == 143 and combined_status([-15, 143]) == -15  # stopped: it resumes
    assert combined_status([143, 1]) == 1 and combined_status([None, 3]) == 3  # a failure, even while others run
