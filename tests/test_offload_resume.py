"""Resuming runs that offload (issue 18, item 2), end to end through ``train()``.

A run that keeps its state in host memory resumes exactly after a SIGKILL; a checkpoint
written with ``offload.*`` set continues without it and the reverse (state is state,
placement is a plan: checkpoints hold the model-order state, wherever it lived); and a
restore with offload puts every leaf in the memory the plan says, before any step.

The offloaded runs use ``offload.params=host offload.optimizer=host
offload.resident_layers=1`` on a 2-layer model: every stacked leaf is stored as a
``Split`` of one device-resident layer and one host-resident layer, the form whose
conversion to and from the checkpoint's model order can go wrong; and two checkpoint
names' saved residuals in host memory (one offloaded program for every offloaded run
here, compiled once)."""

import functools
import gc
import shutil
import signal
import subprocess
import sys
import sysconfig

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err, tree_rel_err
from jaxpar.offload.fetch import Split
from jaxpar.train import offload as offload_lib
from jaxpar.train import tasks
from jaxpar.train.checkpoints import Checkpoints
from jaxpar.train.config import load_config
from jaxpar.train.data import default_cache_dir
from jaxpar.train.loop import build, train
from jaxpar.train.runs import load_run
from test_train import SMALL, metrics, wait_for_steps

pytestmark = pytest.mark.slow  # end-to-end runs, as tests/test_train.py

STEPS, EVERY = 16, 4  # saved at 4, 8, 12 and 16
START = 8  # the continued runs start from step 8's checkpoint
# The tiny preset at width 32 (2 heads of 16, MLP 64) over 32-token rows: a step's
# arithmetic, which XLA:CPU runs unoptimised here (conftest.py, FAST_COMPILE), costs a
# tenth of the preset's at width 128 over 64 tokens, and every layer is still split in
# two memories. The text: the standard library's email package (0.3 MB, for 4,000
# tokens of training), not the whole library, which every run would walk to list it.
# Data parallel over 2 of the 8 simulated devices: a save has orbax slice each
# replicated array into one piece per replica, a program per piece and device (16
# here, 64 over all 8).
SHAPE = ["model.dim=32", "model.heads=2", "model.kv_heads=2", "model.head_dim=16", "model.mlp_dim=64", "seq_len=32",
         f"data.path={sysconfig.get_paths()['stdlib']}/email/*.py", "mesh.data=2"]
OFFLOAD = ["offload.params=host", "offload.optimizer=host", "offload.resident_layers=1",
           "offload.activations=[layer_input,mlp_hidden]"]
HOST, DEVICE = "pinned_host", "device"


def args(run, *extra) -> list[str]:
    return [*SMALL, *SHAPE, f"steps={STEPS}", f"checkpoint.every={EVERY}", "eval.every=0",
            f"cache_dir={default_cache_dir()}", f"run_dir={run}", *extra]


def run_train(run, *extra) -> list[dict]:
    return train(load_config("tiny", args(run, *extra)), progress=False)


def losses(run) -> list[float]:
    return [r["loss"] for r in metrics(run)]


@functools.lru_cache
def _finished(run):
    """``load_run(run)``, once per run dir: the runs here are finished (16 steps) when
    their parameters are read, and the reference runs' are read by several tests."""
    return load_run(run)


def final_params(run):
    """The parameters of ``run``'s newest checkpoint (step 16), on one device (a new
    ``State`` each call: callers may delete from it)."""
    return nnx.state(_finished(run))


def assert_same_final_params(run, reference) -> None:
    """``run``'s final parameters are ``reference``'s within 1e-6 (relative, per leaf),
    the embedding's within 1e-5: the rows of tokens a batch rarely holds get gradients
    near zero, which Adam's normalisation scales up to whole steps, rounding differences
    of the offloaded step's arithmetic included (the uninterrupted offloaded run's own
    embedding is 3e-6 from the all-on-device run's, its layers 2e-7)."""
    got, want = final_params(run), final_params(reference)
    assert tree_rel_err(got["embed"], want["embed"]) < 1e-5
    del got["embed"], want["embed"]
    assert tree_rel_err(got, want) < 1e-6


def param_bytes(run) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(final_params(run)))


@pytest.fixture(scope="module")
def on_device(tmp_path_factory):
    """An uninterrupted all-on-device run of 16 steps: its run dir."""
    run = tmp_path_factory.mktemp("on_device") / "run"
    run_train(run)
    return run


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    """An uninterrupted run of the same 16 steps with ``OFFLOAD``: its run dir."""
    run = tmp_path_factory.mktemp("offloaded") / "run"
    run_train(run, *OFFLOAD)
    return run


def resumable_copy(source, run) -> None:
    """``run``: a copy of ``source`` as it was after step 8 (the later checkpoints gone;
    the loop drops the metrics after its checkpoint itself)."""
    shutil.copytree(source, run)
    for step in range(START + 1, STEPS + 1):
        shutil.rmtree(run / "checkpoints" / str(step), ignore_errors=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(START)]  # keep=3: 8, 12, 16


def test_offloaded_run_killed_and_restarted_gives_the_same_losses(tmp_path, offloaded, on_device):
    """SIGKILL mid-run (the CLI), then the same run again (in-process): the losses and
    the final parameters are the uninterrupted offloaded run's, bit for bit. (Killed
    once step 9 is logged: step 8's save waited for step 4's, which is on disk then,
    and 7 steps are left for the kill to land in.)"""
    run = tmp_path / "killed"
    command = [sys.executable, "-m", "jaxpar.commands.train", "tiny", *args(run, *OFFLOAD), "--no-progress"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_steps(proc, run, START + 1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics(run)) < STEPS
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] < STEPS  # it resumes from an offloaded run's checkpoint

    resumed = run_train(run, *OFFLOAD)
    assert [r["step"] for r in resumed] == list(range(saved[-1] + 1, STEPS + 1))
    assert losses(run) == losses(offloaded)
    for got, want in zip(jax.tree.leaves(final_params(run)), jax.tree.leaves(final_params(offloaded)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not list((run / "checkpoints").glob("*tmp*"))  # the save the kill cut short
    # and offloading is the all-on-device arithmetic (tests/test_offload.py, per step)
    assert rel_err(losses(offloaded), losses(on_device)) < 1e-6


def test_a_checkpoint_saved_with_offload_continues_without_it(tmp_path, offloaded, on_device):
    """8 steps offloaded, then 8 with everything on the device in the same run dir: the
    16 losses and the final parameters are those of the all-on-device run."""
    run = tmp_path / "run"
    resumable_copy(offloaded, run)
    resumed = run_train(run)
    assert [r["step"] for r in resumed] == list(range(START + 1, STEPS + 1))
    assert rel_err(losses(run), losses(on_device)) < 1e-6
    assert_same_final_params(run, on_device)
    # the continuation kept its state on the device: parameters and Adam's two moments,
    # float32, on every device (data=2)
    nbytes = param_bytes(run)
    assert all(r["device_live_bytes"] >= 3 * nbytes for r in resumed)


def test_a_checkpoint_saved_without_offload_continues_with_it(tmp_path, on_device):
    """8 steps all on the device, then 8 with ``OFFLOAD`` (two checkpoint names'
    residuals offloaded too): the losses and final parameters of the all-on-device run,
    and only the resident layer's parameters on the device after each step."""
    run = tmp_path / "run"
    resumable_copy(on_device, run)
    gc.collect()
    before = offload_lib.device_live_bytes()  # arrays other tests left alive: not this run's
    resumed = run_train(run, *OFFLOAD)
    assert [r["step"] for r in resumed] == list(range(START + 1, STEPS + 1))
    assert rel_err(losses(run), losses(on_device)) < 1e-6
    assert_same_final_params(run, on_device)
    # one of the two layers' parameters (less than all of them) is what stays on the
    # device; the all-on-device run holds 3x all of them
    nbytes = param_bytes(run)
    assert all(r["device_live_bytes"] - before < nbytes for r in resumed)


def planned_step(cfg):
    """The loop's offloaded step for ``cfg`` (``train``'s ``build``: its step and plan,
    the all-on-device step not compiled for a fixed placement without a budget):
    ``(step, plan, abstract_model)``."""
    setup = build(cfg, tasks.of(cfg))
    return setup.step_fn, setup.offload_plan, setup.abstract_model


def planned_kinds(state, plan):
    """The memory kind of each leaf of a model-order ``state`` in storage form, as the
    plan says: of each stacked leaf ``[L, ...]`` the first ``resident_layers`` layers on
    the device, the rest on the host (a ``Split`` of two kinds when both are there); the
    other parameters on the host with ``params=host``; every optimizer leaf on the host
    with ``optimizer=host``."""
    options, L, R = plan.options, plan.layers, plan.resident_layers

    def place(params_kind, layers_kinds):
        def kind(path, _):
            if not any(getattr(k, "key", None) == "layers" for k in path):
                return params_kind
            return Split(*layers_kinds) if 0 < R < L else layers_kinds[0 if R == L else 1]
        return kind

    host_params = options.params == "host"
    opt_kind = HOST if options.optimizer == "host" else DEVICE
    return {"params": jax.tree.map_with_path(place(HOST if host_params else DEVICE,
                                                   (DEVICE, HOST if host_params else DEVICE)), state["params"]),
            "opt_state": jax.tree.map_with_path(place(opt_kind, (opt_kind, opt_kind)), state["opt_state"])}


def flat(tree) -> list[tuple[str, object]]:
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree.leaves_with_path(tree)]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """``planned_step`` for the offloaded runs' config, built once for both sources."""
    return planned_step(load_config("tiny", args(tmp_path_factory.mktemp("planned") / "unused", *OFFLOAD)))


@pytest.mark.parametrize("source", ["on_device", "offloaded"])
def test_a_restore_with_offload_places_every_leaf_where_the_plan_says(request, planned, source):
    """The loop's restore path (``restore_latest`` onto ``abstract_state``, then
    ``in_storage_order``) from a checkpoint written on the device or offloaded: every
    stored leaf has the plan's memory kind and the step's sharding, the joined stacked
    leaves come back in host memory without a detour through the device, and the
    values are the checkpoint's."""
    run = request.getfixturevalue(source)
    step_fn, plan, abstract_model = planned
    assert (plan.options.params, plan.options.optimizer, plan.layers, plan.resident_layers) == ("host", "host", 2, 1)
    target = step_fn.abstract_state(abstract_model)
    with Checkpoints(run, keep=3) as checkpoints:
        step, state, _ = checkpoints.restore_latest(target)
    assert step == STEPS
    # model order: every leaf on the target's sharding, the stacked ones joined on the host
    for (path, got), (_, want) in zip(flat(state), flat(target), strict=True):
        assert got.sharding == want.sharding, path
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state)} == {HOST}

    stored = step_fn.in_storage_order(state)
    assert flat(jax.tree.map(lambda x: x.sharding.memory_kind, stored)) == flat(planned_kinds(state, plan))
    shardings = {"params": step_fn.params_sharding, "opt_state": step_fn.opt_sharding}
    assert flat(jax.tree.map(lambda x: x.sharding, stored)) == flat(shardings)
    assert {x.shape[0] for p, x in flat(stored) if p.endswith(".resident")} == {1}
    for (path, got), (_, want) in zip(flat(step_fn.in_model_order(stored)), flat(state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)
