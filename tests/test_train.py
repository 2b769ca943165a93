"""jaxpar-train end to end on a small slice of the standard library."""

import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import lowerings, rel_err
from jaxpar.train.checkpoints import Checkpoints
from jaxpar.train.config import load_config
from jaxpar.train.data import default_cache_dir
from jaxpar.train.loop import TrainingError, build_model, train
from jaxpar.train.stopping import stop_on_signals

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips the file

SMALL = [
    "model.layers=2", "model.vocab_size=512", "data.max_files=120",
    "data.val_fraction=0.1", "seq_len=64", "batch_size=8", "eval.batches=2",
    "optimizer.warmup_steps=2",
]


@pytest.fixture(scope="module")
def cache():
    """The test run's shared tokenizer/packed-data cache (conftest's XDG_CACHE_HOME): the
    tokenizer of SMALL is trained once per run, for every file and CLI run that uses it."""
    return default_cache_dir()


def config(run_dir, cache, *extra):
    return load_config("tiny", SMALL + [f"run_dir={run_dir}", f"cache_dir={cache}", *extra])


def metrics(run_dir):
    return [json.loads(l) for l in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def tensorboard_steps(run_dir) -> dict[str, list[int]]:
    """The steps of every scalar in the run's TensorBoard event files, in file order,
    read record by record (no purging: what any reader sees)."""
    from tensorboardX.proto.event_pb2 import Event

    steps = {}
    for path in sorted((pathlib.Path(run_dir) / "tensorboard").glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            length = int.from_bytes(data[at:at + 8], "little")
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 16 + length
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
    return steps


def cli(*args, timeout=600, devices=None):
    env = None if devices is None else dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices))
    return subprocess.run([sys.executable, "-m", "jaxpar.commands.train", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def resumable(cache) -> list[str]:
    """The arguments of the 16-step runs that are stopped and resumed: one train-step program
    (the step count is in it, the learning rate's schedule) for every run of this file that
    can share one, compiled once for the test run (the persistent compilation cache)."""
    return SMALL + ["steps=16", "checkpoint.every=4", "eval.every=0", f"cache_dir={cache}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """An uninterrupted run of ``resumable``, evaluated at steps 6, 12 and 16 (the last):
    ``(run_dir, history)``. Tests read it, and copy it to resume it; its own checks are
    test_short_run_learns_and_writes_its_outputs's."""
    run = tmp_path_factory.mktemp("reference") / "run"
    history = train(load_config("tiny", resumable(cache) + ["eval.every=6", f"run_dir={run}"]), progress=False)
    return run, history


def losses(history, key="loss") -> list[float]:
    return [r[key] for r in history if key in r]


def copy_run(reference, to: pathlib.Path) -> pathlib.Path:
    shutil.copytree(reference[0], to)
    return to


def test_short_run_learns_and_writes_its_outputs(cache, reference, capsys):
    run, history = reference
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 17)) and rows == history
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "device_live_bytes"} <= set(rows[0])
    # data=8: every device holds the parameters and Adam's two moments, float32, and more
    params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
        lambda: build_model(config(run, cache))))))
    assert all(r["device_live_bytes"] >= 3 * 4 * params for r in rows)
    val = losses(rows, "val_loss")
    # Untrained, the loss is ln(512) = 6.24; by step 6 it has fallen well below, and goes on.
    assert len(val) == 3 and val[0] < np.log(512) - 0.5 and val[2] < val[0]
    assert sorted(os.listdir(run / "checkpoints")) == ["12", "16", "8"]  # checkpoint.keep=3
    assert (run / "config.yaml").exists()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    # jaxpar-generate's main in this process (a subprocess spent its time importing)
    from jaxpar.commands.generate import main as generate

    capsys.readouterr()
    assert generate([str(run), "--prompt", "def main(", "--max-new-tokens", "8", "--json"]) == 0
    sample = json.loads(capsys.readouterr().out)
    assert 0 < len(sample["tokens"]) <= 8 and sample["tokens_per_s"] >= 0  # may stop at EOS

    # An exported Hugging Face copy generating the same tokens: test_glide's
    # test_generate_with_trained_drafts_gives_the_targets_tokens.


def test_new_run_dirs_share_the_per_user_cache_and_cache_dir_overrides_it(tmp_path, monkeypatch):
    """Without cache_dir, the tokenizer and packed rows go to $XDG_CACHE_HOME/jaxpar, and a
    run in another run dir reuses them: it trains and packs nothing (the entries are not
    rewritten). cache_dir= puts them elsewhere and leaves the per-user cache alone. The
    second and third runs, of the same config in other run dirs, lower no program: they
    call the first run's (jaxpar.train.loop keeps a config's jitted functions)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    shared = tmp_path / "xdg" / "jaxpar"
    args = [*SMALL, "steps=1", "eval.every=0", "checkpoint.every=0", "data.max_files=20", "seq_len=32"]

    def entries(directory):
        return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}

    train(load_config("tiny", args + [f"run_dir={tmp_path / 'a'}"]), progress=False)
    made = entries(shared)
    assert sorted(name.split("-")[0] for name in made) == ["packed", "packed", "tokenizer"], made
    assert not (tmp_path / "a" / "cache").exists()

    with lowerings() as lowered:
        train(load_config("tiny", args + [f"run_dir={tmp_path / 'b'}"]), progress=False)
        assert entries(shared) == made
        assert (tmp_path / "b" / "tokenizer.json").read_text() == (tmp_path / "a" / "tokenizer.json").read_text()

        mine = tmp_path / "mine"
        train(load_config("tiny", args + [f"run_dir={tmp_path / 'c'}", f"cache_dir={mine}"]), progress=False)
        assert sorted(entries(mine)) == sorted(made) and entries(shared) == made
    assert lowered == []


def wait_for_steps(proc, run, steps: int) -> None:
    """Returns once ``run``'s metrics have ``steps`` lines (``proc`` still running)."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and len(metrics(run)) >= steps:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be stopped"


def test_sigint_sigterm_and_sigkill_stop_and_resume_to_the_same_losses(tmp_path, cache, reference, capfd,
                                                                       monkeypatch):
    """One run dir through three stops (a last start finishes it): SIGINT, then SIGTERM,
    each sent while the run saves every step: one line, exit 130 / 143, the step it
    stopped at saved and no half-written checkpoint. Then SIGKILL while it saves every 4
    steps (nothing flushed), in a process of its own: restarted, it resumes from its last
    checkpoint, behind its last logged step, and drops the save the kill cut short.
    Throughout, the losses are the uninterrupted run's. Each start says where it starts
    (a resumed run: from which step and checkpoint) and that the step compiles.
    (SIGKILL once had a test of its own, from step 0; one run dir saves a process. The
    SIGINT and SIGTERM starts and the last are jaxpar-train's main in this process, each
    signal sent to this process by the run itself once a step is logged (a process of
    their own spent its time importing; test_a_second_ctrl_c_ends_jaxpar_train_at_once
    sends Ctrl-C to a fresh one).)"""
    from jaxpar.commands.train import main
    from jaxpar.train.stepping import Recorder

    run = tmp_path / "stopped"
    command = [sys.executable, "-m", "jaxpar.commands.train", "tiny", *resumable(cache), f"run_dir={run}", "--no-progress"]
    starts = "jaxpar-train: starting at step 0 on mesh data=8 (8 cpu devices)"

    def resumes(step):
        return (f"jaxpar-train: resuming from step {step} (checkpoint {run / 'checkpoints' / str(step)}) on "
                "mesh data=8 (8 cpu devices)")

    def saved():
        return max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())

    write = Recorder.write
    for signum, after in ((signal.SIGINT, 3), (signal.SIGTERM, 7)):
        def write_then_signal(self, record, postfix, signum=signum, after=after):
            write(self, record, postfix)
            if record["step"] == after:
                handler = signal.getsignal(signum)  # the loop's, which puts the previous one back
                os.kill(os.getpid(), signum)
                wait_for_handlers(lambda: signal.getsignal(signum) is not handler)

        monkeypatch.setattr(Recorder, "write", write_then_signal)
        capfd.readouterr()
        code = main([*command[3:], "checkpoint.every=1"])
        err = capfd.readouterr().err
        assert code == 128 + signum, err
        step = len(metrics(run))
        assert step == after
        # orbax's own advice, when a loaded machine makes a save wait for the last one
        # ("WARNING:absl:Waiting for previous save to complete took 1.4 seconds"), is not ours
        lines = [line for line in err.strip().splitlines() if not line.startswith("WARNING:absl:")]
        assert lines[-3:] == [  # after the data's lines, where this run made the data first
            starts, "jaxpar-train: compiling the train step (the first step waits for it)",
            f"jaxpar-train: stopped at step {step}; last checkpoint at step {step}; "
            "rerun the same command to resume"], err
        starts = resumes(step)
        assert saved() == step
        assert not list((run / "checkpoints").glob("*tmp*"))
    monkeypatch.setattr(Recorder, "write", write)

    # SIGKILL at step 10 or later: checkpoint.every=4 leaves step 8's (or the stop's) behind it
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_steps(proc, run, 10)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert err.splitlines()[0] == starts, err
    assert len(metrics(run)) < 16
    starts = resumes(saved())

    # The last start in this process (as test_bad_input_is_one_line_and_writes_nothing)
    capfd.readouterr()
    assert main(command[3:]) == 0
    err = capfd.readouterr().err
    assert err.splitlines()[0] == starts, err
    assert losses(metrics(run)) == losses(reference[1])
    assert not list((run / "checkpoints").glob("*tmp*"))  # the save the kill cut short


def wait_for_handlers(done=lambda: False, seconds: float = 5.0) -> None:
    """Gives Python's signal handlers the time to run, until ``done()``: a signal sent to
    this process may reach another of its threads (JAX's, orbax's), and the main thread
    runs the handler only when it next checks, which on a loaded machine can be after
    ``os.kill`` returns. A handler that raises ends the wait."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_second_signal_acts_as_without_the_stop_request():
    """The first SIGINT or SIGTERM sets the request and puts the handlers back: a second
    Ctrl-C raises KeyboardInterrupt at once; on leaving, the handlers are as before."""
    # Python's own Ctrl-C handler to start from, whatever this (pytest worker) process had
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _second_signal_checks()
    finally:
        signal.signal(signal.SIGINT, inherited)


def _second_signal_checks():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for first in (signal.SIGINT, signal.SIGTERM):
        with stop_on_signals() as stop:
            assert stop.agreed() is None
            os.kill(os.getpid(), first)
            wait_for_handlers(lambda: stop.agreed() is not None)
            assert stop.agreed() == first
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                wait_for_handlers()
        assert {s: signal.getsignal(s) for s in before} == before


def test_a_second_ctrl_c_ends_jaxpar_train_at_once():
    """jaxpar-train's handlers as its main() nests them around the loop's: the first
    Ctrl-C asks for a stop, the second exits at once with one line and status 130
    (not orbax's traceback of the save it broke, nor a wait for its threads). In a
    subprocess, where signals are sent at known points rather than raced against a
    run's save."""
    from conftest import run_python

    result = run_python("""
        import os, signal, time
        from jaxpar.commands.train import _ctrl_c_exits_at_once
        from jaxpar.train.stopping import stop_on_signals
        with _ctrl_c_exits_at_once(), stop_on_signals() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.agreed() == signal.SIGINT
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        print("not stopped")
    """, devices=1, timeout=60)
    assert result.returncode == 130 and result.stdout == "", result.stderr
    assert result.stderr.splitlines() == ["jaxpar-train: interrupted"]


def test_checkpoint_restores_on_another_mesh(tmp_path, cache, reference):
    run = copy_run(reference, tmp_path / "run")  # saved on mesh data=8
    shutil.rmtree(run / "checkpoints" / "16")
    second = train(load_config("tiny", resumable(cache) + [f"run_dir={run}", "mesh.data=2", "mesh.fsdp=4"]),
                   progress=False)
    assert [r["step"] for r in second] == [13, 14, 15, 16]
    assert rel_err(losses(second), losses(reference[1][12:])) < 1e-5
    assert [r["step"] for r in metrics(run)] == list(range(1, 17))
    # TensorBoard too: steps 13-16 of the first run dropped, each step once, in order
    # (its step-16 validation loss with them: this run does not evaluate).
    steps = tensorboard_steps(run)
    assert steps.pop("val_loss") == [6, 12]
    assert set(steps) == {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "device_live_bytes"}
    assert all(s == list(range(1, 17)) for s in steps.values()), steps


def corrupt(step_dir: pathlib.Path) -> None:
    for path in step_dir.rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")


def skipped(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage()]


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path, cache, reference, caplog, capfd):
    """The unreadable step is moved to checkpoints/corrupt/ with one log line, retrained
    and saved again, so the next start resumes from it (here: finds the run finished,
    and says so in one line, leaving the run dir untouched); with every checkpoint
    unreadable the run starts over and ends with its final checkpoint saved.
    (jaxpar-train's main in this process, as test_bad_input_is_one_line_and_writes_nothing:
    capfd reads file descriptor 2, and caplog sees any orbax record that reached a
    handler; a fresh process's stderr is one line: test_empty_data_directory.)"""
    from jaxpar.commands.train import main

    run = copy_run(reference, tmp_path / "run")  # checkpoints 8, 12 and 16
    corrupt(run / "checkpoints" / "16")
    command = ["tiny", *resumable(cache), f"run_dir={run}", "--no-progress"]
    capfd.readouterr()
    with caplog.at_level(logging.WARNING):
        assert main(command) == 0
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 3, err  # orbax's own errors about the files it met held back
    assert not [r for r in caplog.records if r.name == "absl"], caplog.records
    assert re.fullmatch(rf"jaxpar-train: checkpoint at step 16 in {run / 'checkpoints'} cannot be "
                        r"restored \(\w+: .+\); moved to checkpoints/corrupt/16; trying the previous one",
                        lines[0]), lines[0]
    assert lines[1:] == [f"jaxpar-train: resuming from step 12 (checkpoint {run / 'checkpoints' / '12'}) on mesh "
                         "data=8 (8 cpu devices)", "jaxpar-train: compiling the train step (the first step waits for it)"]
    again = metrics(run)
    assert [r["step"] for r in again] == list(range(1, 17))
    assert rel_err(losses(again[12:]), losses(reference[1][12:])) < 1e-6
    assert sorted(os.listdir(run / "checkpoints")) == ["12", "16", "8", "corrupt"]
    assert os.listdir(run / "checkpoints" / "corrupt") == ["16"]

    # The next start restores step 16 (no line about it) and finds the run finished:
    # steps= at or below the run dir's step is one line, exit 0, the run dir untouched.
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main([*command, "steps=10"]) == 0
    out = capfd.readouterr()
    assert out.err.strip().splitlines() == [
        f"jaxpar-train: {run} is already at step 16 (steps=10): nothing to do; raise steps= to continue "
        "or choose another run_dir"], out.err
    assert out.out == ""
    assert not [r for r in caplog.records if r.name == "absl"], caplog.records
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before

    for step in (8, 12, 16):
        corrupt(run / "checkpoints" / str(step))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fourth = train(load_config("tiny", resumable(cache) + [f"run_dir={run}"]), progress=False)
    assert len(skipped(caplog)) == 3
    assert [r["step"] for r in fourth] == list(range(1, 17))
    assert sorted(os.listdir(run / "checkpoints" / "corrupt")) == ["12", "16", "16-2", "8"]
    with Checkpoints(run, keep=3) as checkpoints:
        assert checkpoints.steps() == [8, 12, 16] and checkpoints.read_meta(16)["step"] == 16


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, cache):
    run = tmp_path / "run"
    cfg = config(run, cache, "steps=20", "checkpoint.every=1", "eval.every=0",
                 "optimizer.lr=1e30", "optimizer.clip_norm=1e30", "optimizer.warmup_steps=0")
    with pytest.raises(TrainingError, match=r"loss is (nan|inf) at step (\d+); stopped\. The last good checkpoint"):
        train(cfg, progress=False)
    saved = sorted(int(p) for p in os.listdir(run / "checkpoints"))
    assert saved and saved[-1] == len(metrics(run))


@pytest.mark.parametrize(
    "override,code,message",
    [
        ("mesh.fdsp=2", 2, "unknown config key 'mesh.fdsp'; valid keys near it: mesh.fsdp"),
        ("steps=ten", 2, "steps='ten' must be an integer"),
        ("batch_size=12", 2, "batch_size=12 / optimizer.grad_accum=1 must be a multiple of the data-parallel degree data*fsdp=8"),
        ("mesh.tensor=[2,2] batch_size=2", 2, "must be a multiple of the data-parallel degree data*fsdp*tensor_row=4"),
        ("mesh.fsdp=3", 2, "does not divide 8 devices"),
        ("mesh.pipe=2 pipeline.microbatches=3", 2, "batch_size=8 is not divisible by pipeline.microbatches x the data-parallel degree = 3 x 4 = 12"),
        ("mesh.pipe=2 pipeline.microbatches=1 batch_size=8", 2, "1f1b needs at least as many microbatches as pipeline stages: microbatches=1 < pipe=2"),
        ("execution.attention=cudnn", 2, "execution.attention='cudnn' needs a GPU; JAX's backend here is 'cpu'"),
        ("mesh.seq=4 seq_len=60", 2, "seq_len=60 must be divisible by 2 x mesh.seq = 8 for execution.seq_layout=zigzag"),
        # found only once the step is compiled for its profile; still exit 2, nothing written
        ("offload.optimizer=auto offload.device_budget=1KiB", 2,
         "offload.device_budget=1KiB is below what any plan needs: the smallest (params=device optimizer=host) needs"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, cache, capfd, override, code, message):
    """jaxpar-train's main in this process (its 8 devices; capfd reads file descriptor 2,
    XLA's own lines included): a subprocess per case spent its time importing. A fresh
    process's stderr is one line too: test_empty_data_directory."""
    from jaxpar.commands.train import main

    run = tmp_path / "run"
    capfd.readouterr()
    assert main(["tiny", *SMALL, f"run_dir={run}", f"cache_dir={cache}", *override.split()]) == code
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert not run.exists()


def test_run_dir_of_another_model_is_refused_untouched(cache, reference, capfd):
    """(jaxpar-train's main in this process, as test_bad_input_is_one_line_and_writes_nothing.)"""
    from jaxpar.commands.train import main

    run = reference[0]  # a checkpoint of model.layers=2
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    capfd.readouterr()
    assert main(["tiny", *SMALL, f"run_dir={run}", f"cache_dir={cache}", "model.layers=3"]) == 1
    assert "holds a checkpoint of a different model (model.layers: 2 there, 3 here)" in capfd.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before


def test_empty_data_directory(tmp_path, cache):
    (tmp_path / "empty").mkdir()
    out = cli("tiny", *SMALL, f"run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'empty'}")
    assert out.returncode == 1
    assert len(out.stderr.strip().splitlines()) == 1 and "empty" in out.stderr
    assert not (tmp_path / "run").exists()  # made only once a run can start


def test_dry_run_prints_the_profile_and_writes_nothing(tmp_path, cache, capsys):
    """data=8 against data=2 x fsdp=4: the parameters and Adam's moments split 4 ways,
    gathered for use. steps=16: both steps are programs of this file's runs already
    (the reference's, and test_checkpoint_restores_on_another_mesh's), compiled once."""
    profiles = {}
    for mesh in ("mesh.data=8", "mesh.data=2 mesh.fsdp=4"):
        train(config(tmp_path / "run", cache, "dry_run=true", "steps=16", *mesh.split()), progress=False)
        profiles[mesh] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not (tmp_path / "run").exists()
    dp, fsdp = profiles["mesh.data=8"], profiles["mesh.data=2 mesh.fsdp=4"]
    for key in ("argument_bytes", "output_bytes", "temp_bytes", "flops", "collective_bytes", "collectives"):
        assert key in fsdp
    assert 0.24 < fsdp["argument_bytes"] / dp["argument_bytes"] < 0.26  # 0.251: 1/4, and the batch
    assert fsdp["collectives"]["all-gather"] > 0 and dp["collectives"]["all-gather"] == 0


def test_fsdp_meshes_compile_without_involuntary_rematerialization():
    """XLA warns "[SPMD] Involuntary full rematerialization" when it can only reshard by
    replicating a whole array; the embedding lookup's gradient on data x fsdp (x tensor)
    meshes did (the README's first example, `mesh.fsdp=4`). A fresh process with the
    compilation cache off, so XLA partitions the programs and would print it."""
    from conftest import run_python

    result = run_python(f"""
        import os
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        from jaxpar.train.config import load_config
        from jaxpar.train.loop import train
        for mesh in (["mesh.fsdp=4"], ["mesh.fsdp=2", "mesh.tensor=2", "model.position=learned"]):
            train(load_config("tiny", ["dry_run=true", "model.layers=2", *mesh]), progress=False)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Involuntary full rematerialization" not in result.stderr, result.stderr[-2000:]


def test_dry_run_reports_the_pipeline(tmp_path, cache, capsys):
    """pipe=4 x data=2, M=8: bubble from the schedule and the formula, and what each
    stage keeps: all 8 microbatches' stage inputs under GPipe, 4 - p under 1F1B (bf16
    compute: XLA:CPU once aborted on the pipeline's bf16 input-gradient all-reduce)."""
    profiles = {}
    for kind in ("gpipe", "1f1b"):
        train(config(tmp_path / "run", cache, "dry_run=true", "mesh.pipe=4", "model.layers=4",
                     "model.dtype=bfloat16", "batch_size=16", f"pipeline.schedule={kind}",
                     "pipeline.microbatches=8"), progress=False)
        profiles[kind] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gpipe, one_f_one_b = profiles["gpipe"], profiles["1f1b"]
    stage_input = 16 // 8 // 2 * 64 * 128 * 2  # [B/M/data, T, D] bfloat16
    for profile, in_flight in ((gpipe, [8] * 4), (one_f_one_b, [4, 3, 2, 1])):
        assert profile["pipeline_bubble"] == profile["pipeline_bubble_theory"] == 3 / 11
        stages = profile["pipeline_stages"]
        assert [s["in_flight"] for s in stages] == in_flight
        assert [s["stage_input_bytes"] for s in stages] == [n * stage_input for n in in_flight]
        assert [s["stages"] for s in stages] == [[0], [1], [2], [3]]
    assert one_f_one_b["temp_bytes"] < gpipe["temp_bytes"]


def test_dry_run_of_interleaved_stages_moves_no_layers(tmp_path, cache, capsys):
    """pipe=2 x 2 virtual stages: the layers are stored where their stages run, so the
    step has no all-to-all (re-laying model-order layers out every step took one per
    layer parameter)."""
    train(config(tmp_path / "run", cache, "dry_run=true", "mesh.pipe=2", "model.layers=4", "batch_size=16",
                 "pipeline.schedule=interleaved", "pipeline.virtual_stages=2"), progress=False)
    profile = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert profile["pipeline_virtual_stages"] == 2
    assert profile["collective_counts"]["all-to-all"] == 0 and profile["collectives"]["all-to-all"] == 0


def test_mfu_flops_per_token_matches_the_compiled_step():
    """The progress bar's MFU numerator agrees with XLA's count for the whole step."""
    import optax
    from flax import nnx

    from jaxpar.models import Transformer
    from jaxpar.profiler import profile
    from jaxpar.train.loop import flops_per_token
    from jaxpar.train.step import make_train_step

    cfg = load_config("tiny", ["seq_len=128"])
    model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    compiled = make_train_step(model, optax.sgd(0.1)).compile(model, batch_size=2, seq_len=128)
    ratio = profile(compiled)["flops"] / (flops_per_token(cfg) * 2 * 128)
    assert 0.95 < ratio < 1.15, ratio
