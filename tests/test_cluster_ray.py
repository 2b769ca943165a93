"""``jaxpar-cluster run`` on a local Ray instance (issue 40, item 5): two tiny jobs on
2 declared devices under a scheduler that resizes one of them mid-run (2 devices at
batch 8 to 1 at batch 16) and gives the device freed to the other, which waited. Every
job finishes, the resized job trains its samples and
its losses equal the same job run alone on the same devices and batches (from the step
it was stopped at: 1e-5), no ``jaxpar-train`` process is left, nor after a SIGTERM
mid-run, and the errors (a Ray address that does not answer, a bad
JOBS.yaml, a scheduler that does not exist) are one line and a non-zero exit, quickly."""

import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'jaxpar[cluster]' or '.[test]')")

from jaxpar.elastic.scheduler import Allocation  # noqa: E402
from jaxpar.cluster.jobs import JobsError, load_jobs  # noqa: E402
from jaxpar.cluster.run import RunError, Running, metrics, run_jobs, train_command  # noqa: E402
from jaxpar.train.config import load_config  # noqa: E402
from jaxpar.train.loop import train  # noqa: E402
from jaxpar.train.stopping import Stopped, StopRequest  # noqa: E402

pytestmark = pytest.mark.slow  # Ray and jaxpar-train processes

TESTS = pathlib.Path(__file__).parent
# checkpoint.every=0: a job saves when it is stopped (the step it resumes from) and at its end
OVERRIDES = ["model.layers=2", "model.vocab_size=512", "data.max_files=40", "data.val_fraction=0.1",
             "seq_len=32", "eval.every=0", "optimizer.warmup_steps=2", "checkpoint.every=0",
             "checkpoint.keep=100"]
# b shrinks from 2 devices to 1 (and doubles its batch) after 2 steps; c, waiting for a
# device from the start (first come, first served: b came first), takes the device freed.
# b is the job of two processes, with steps enough (a few seconds of them) for its stop to
# land before its end. (A third job, a, once ran beside b from the start: a training
# process more that checked nothing c does not.)
B_STEPS = 24
JOBS = [
    {"id": "b", "steps": B_STEPS, "devices": 2, "min_batch": 8, "max_batch": 16},
    {"id": "c", "steps": 4, "devices": 1},
]
ONE_JOB = [{"id": "a", "steps": 4, "devices": 1}]


class Fifo:
    """Arrival order, each job its requested devices while they last."""

    name = "fifo-test"

    def decide(self, now_s, jobs, devices):
        decision, free = {}, devices
        for job in sorted(jobs, key=lambda j: (j.arrival_s, j.id)):
            want = self.want(job)
            if want <= free:
                decision[job.id], free = Allocation(want, job.model.base_batch), free - want
        return decision

    def want(self, job):
        return job.requested_devices


class ShrinkB(Fifo):
    """FIFO, except that job ``b`` runs on one device at batch 16 once it has trained two
    steps."""

    name = "shrink-b"

    def decide(self, now_s, jobs, devices):
        decision = super().decide(now_s, jobs, devices)
        if "b" in decision and self.shrunk(next(j for j in jobs if j.id == "b")):
            decision["b"] = Allocation(1, 16)
        return decision

    def want(self, job):
        return 1 if job.id == "b" and self.shrunk(job) else job.requested_devices

    @staticmethod
    def shrunk(job):
        return job.progress >= 2 * job.model.base_batch


def write_jobs(path, jobs=JOBS) -> pathlib.Path:
    import yaml

    path.write_text(yaml.safe_dump([{"config": "tiny", "overrides": OVERRIDES, "batch_size": 8, **j} for j in jobs],
                                   sort_keys=False))
    return path


# jaxpar-cluster itself (its main, as the installed script runs it).
CLI = """
import sys
from jaxpar.commands.cluster import main
sys.exit(main())
"""


def cluster(*args, timeout=300) -> subprocess.CompletedProcess:
    """``jaxpar-cluster run ARGS``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", CLI, "run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def cluster_here(capsys, *args) -> subprocess.CompletedProcess:
    """``jaxpar-cluster run ARGS`` as ``cluster`` runs it, its main in this process, for
    the errors found before any Ray instance or job starts (bad input: ``parser.error``'s
    exit 2; an address that does not answer: 1): their one line and exit status, without
    a process start and import of Ray, JAX and jaxpar per case. ``returncode``, ``stdout``
    and ``stderr`` as ``cluster``'s."""
    from jaxpar.commands.cluster import main

    capsys.readouterr()
    try:
        code = main(["run", *args])
    except SystemExit as e:  # parser.error
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["jaxpar-cluster", "run", *args], code, out.out, out.err)


def training_processes(under: pathlib.Path) -> list[int]:
    """Pids of the ``jaxpar.commands.train`` processes with a run dir under ``under`` (from /proc)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"jaxpar.commands.train" in argv and any(str(under).encode() in a for a in argv):
            pids.append(int(proc.name))
    return pids


def train_alone(argv, env, *overrides) -> None:
    """What ``train_command``'s ``argv`` and ``env`` run, in this process: its overrides
    (then ``overrides``), on the first ``--simulate-devices`` of this process's 8 devices
    (``mesh.data``; the job's mesh is data parallel over all of its devices), without a
    process start and JAX import per run."""
    config, *rest = argv[argv.index("jaxpar.commands.train") + 1:]
    at = rest.index("--simulate-devices")
    devices = int(rest[at + 1])
    assert rest[at:] == ["--simulate-devices", str(devices), "--no-progress"], argv
    assert env == {"JAX_NUM_CPU_DEVICES": str(devices)}, env
    train(load_config(config, [*rest[:at], f"mesh.data={devices}", *overrides]), progress=False)


def test_a_resized_job_and_one_that_waited_finish_exactly_and_leave_nothing(tmp_path, monkeypatch):
    """On nodes of one device: b (2 devices) runs as 2 processes (JAX's distributed
    runtime over gloo), b resumes as 1 process and c, which waited, runs on the device b
    freed; b still has the losses of one process on the same devices and batches. (A
    job once took 2 devices of 4, a second pair of processes that checked nothing b's
    does not.)"""
    work = tmp_path / "work"
    # four training processes and Ray's: about 50 s alone on 2 cores, up to 372 s beside the suite's other
    # workers (with a fifth process, 2026-11-29)
    done = cluster(str(write_jobs(tmp_path / "jobs.yaml")), "--scheduler", "test_cluster_ray:ShrinkB",
                   "--devices", "2", "--devices-per-node", "1", "--round-s", "0.5", "--work-dir", str(work),
                   timeout=600)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in work.glob("*.log")) == ["b.1.log", "b.log", "c.log"]
    rows = {r["id"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert sorted(rows) == ["b", "c"]
    assert rows["c"]["resizes"] == 0
    assert rows["b"]["resizes"] == 1
    (first, two, eight), (stopped_at, one, sixteen) = rows["b"]["segments"]
    assert (first, two, eight, one, sixteen) == (0, 2, 8, 1, 16) and 2 <= stopped_at < B_STEPS
    steps = {"b": stopped_at + -(-(B_STEPS - stopped_at) * 8 // 16), "c": 4}  # b's B_STEPS * 8 samples
    for job in JOBS:
        assert len(metrics(work / job["id"])) == steps[job["id"]]
        assert rows[job["id"]]["final_loss"] == metrics(work / job["id"])[-1]["loss"]
    assert training_processes(tmp_path) == []

    # b alone on the same devices and batches, stopped as its resize stopped it: 2 at batch
    # 8, a SIGTERM seen at the step it was stopped at (that step saved, Stopped raised),
    # then again on 1 at batch 16 from that checkpoint.
    spec = {s.id: s for s in load_jobs(tmp_path / "jobs.yaml")}["b"]
    alone = tmp_path / "alone"
    with monkeypatch.context() as patch:
        asked = itertools.count(1)  # the loop asks after each step but the last
        patch.setattr(StopRequest, "agreed", lambda self: signal.SIGTERM if next(asked) == stopped_at else None)
        with pytest.raises(Stopped) as stopped:
            train_alone(*train_command(spec, alone, 2))
    assert (stopped.value.step, stopped.value.saved) == (stopped_at, stopped_at)
    train_alone(*train_command(spec, alone, 1, 16, steps["b"]))
    expected, got = [r["loss"] for r in metrics(alone)], [r["loss"] for r in metrics(work / "b")]
    assert len(got) == len(expected) == steps["b"]
    assert max(abs(g - e) / abs(e) for g, e in zip(got, expected)) < 1e-5


def test_sigterm_stops_every_job_and_leaves_nothing(tmp_path):
    """SIGTERM (as Ctrl-C) to jaxpar-cluster while a job trains: one line, exit 143, its
    training process gone."""
    work = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", CLI, "run", str(write_jobs(tmp_path / "jobs.yaml", ONE_JOB)),
                             "--scheduler", "test_cluster_ray:Fifo", "--work-dir", str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not training_processes(work) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert training_processes(work), "the job never started"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.splitlines()[-1] == "jaxpar-cluster: stopped by SIGTERM; every job stopped", err
    assert out == "" and training_processes(work) == []


def test_a_ray_address_that_does_not_answer_is_one_line_quickly(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    done = cluster_here(capsys, str(write_jobs(tmp_path / "jobs.yaml")), "--scheduler", "test_cluster_ray:Fifo",
                        "--address", f"127.0.0.1:{port}")
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"jaxpar-cluster: error: no Ray cluster answers at 127.0.0.1:{port} within 10 s")
    assert done.stderr.count("\n") == 1, done.stderr
    assert time.monotonic() - start < 30


def test_bad_jobs_and_schedulers_are_one_line(tmp_path, capsys):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("- id: a\n  config: tiny\n  steps: 3\n  devices: 1\n  batch_size: 8\n"
                    "- id: b\n  config: tiny\n  steps: x\n  devices: 1\n  batch_size: 8\n")
    with pytest.raises(JobsError, match=r"jobs.yaml:6: job 1 \(b\): steps must be a positive integer, not 'x'$"):
        load_jobs(jobs)
    jobs.write_text("- {id: a, config: tiny, steps: 3, devices: 3, max_devices: 2, batch_size: 8}\n")
    with pytest.raises(JobsError, match=r"devices=3 must lie in \[min_devices=1, max_devices=2\]"):
        load_jobs(jobs)
    jobs.write_text("- {id: a, config: tiny, steps: 3, devise: 3}\n")
    with pytest.raises(JobsError, match="unknown field 'devise' \\(did you mean 'devices'\\?\\)"):
        load_jobs(jobs)
    jobs.write_text("- {id: a, config: tiny, steps: 3, devices: 1, overrides: [model.layerz=2]}\n")
    with pytest.raises(JobsError, match="job 0 \\(a\\): .*layerz"):
        load_jobs(jobs)

    specs = load_jobs(write_jobs(jobs))
    with pytest.raises(RunError, match="^job b asks for 2 devices; the cluster has 1$"):
        run_jobs(specs, Fifo(), devices=1, work_dir=tmp_path)

    class Idle(Fifo):
        def decide(self, now_s, jobs, devices):
            return {}

    with pytest.raises(RunError, match=r"^scheduler 'fifo-test' runs none of the waiting jobs \['b', 'c'\]"):
        run_jobs(specs, Idle(), devices=4, work_dir=tmp_path)

    jobs.write_text("- {id: a, config: tiny, steps: 3, devices: 1, overrides: [model.layerz=2]}\n")
    done = cluster_here(capsys, str(jobs), "--scheduler", "fifo")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "layerz" in done.stderr, done.stderr
    done = cluster_here(capsys, str(write_jobs(jobs)), "--scheduler", "no-such-scheduler")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("jaxpar-cluster: error: no scheduler 'no-such-scheduler'; choose from fifo")
    assert done.stderr.count("\n") == 1, done.stderr


def test_an_adascale_job_counts_progress_as_jaxpar_train_does(tmp_path):
    """A job whose config says optimizer.batch_scaling=adascale: its batch is the base
    jaxpar-train scales against, its steps stay the job's at any batch (the run ends where
    the sum of AdaScale's gains reaches them), and its progress is that sum as logged,
    times the job's batch (hand-written records), not the steps times their batches."""
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("- {id: a, config: tiny, steps: 10, devices: 2, batch_size: 16,\n"
                    "   overrides: [optimizer.batch_scaling=adascale, eval.noise_scale=true]}\n"
                    "- {id: b, config: tiny, steps: 10, devices: 2, batch_size: 16}\n")
    ada, plain = load_jobs(jobs)
    assert ada.adascale and not plain.adascale and ada.target == plain.target == 160
    argv, _ = train_command(ada, tmp_path / "a", 2, 32, 10)
    assert {"optimizer.base_batch_size=16", "steps=10", "batch_size=32"} <= set(argv)
    cfg = load_config(ada.config, [a for a in argv if "=" in a])  # as jaxpar-train reads it
    assert (cfg.optimizer.base_batch_size, cfg.batch_size, cfg.steps) == (16, 32, 10)
    assert not any("base_batch_size" in a for a in train_command(plain, tmp_path / "b", 2, 32, 10)[0])

    for spec in (ada, plain):
        run = Running(spec, tmp_path / spec.id, segments=[(0, 2, 16), (2, 2, 32)])
        run.run_dir.mkdir()
        progress = [1.0, 2.0, 3.75, 5.5]  # gain 1 at the base batch, then 1.75 at 32
        run.run_dir.joinpath("metrics.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "loss": 1.0, "adascale_progress": p}) + "\n" for i, p in enumerate(progress)))
        if spec.adascale:
            assert run.samples_done() == 5.5 * 16 and run.samples_done(2) == 2 * 16
        else:
            assert run.samples_done() == 2 * 16 + 2 * 32 and run.samples_done(2) == 2 * 16
