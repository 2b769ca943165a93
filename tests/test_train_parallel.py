"""jaxpar-train's parallel layouts and kernels against one device, end to end on a small
slice of the standard library (apart from test_train.py so the two test workers share
the long runs)."""

import shutil

import pytest
from flax import nnx

from conftest import rel_err, tree_rel_err
from jaxpar.train.config import load_config
from jaxpar.train.data import default_cache_dir
from jaxpar.train.loop import train
from jaxpar.train.runs import load_run
from test_train import SMALL, cli, config, metrics

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips the file


@pytest.fixture(scope="module")
def cache():
    return default_cache_dir()  # the test run's, shared with test_train.py (conftest)


# The 3-step runs on 32 tokens compared with one device, during tiny's warm-up (at full
# learning rate AdamW's g / sqrt(v) amplifies float32 reduction-order differences step
# after step): SMALL's batch of 8 and 32 tokens (8 per ring step in the 4D run).
THREE_STEPS = ("steps=3", "eval.every=3", "checkpoint.every=0", "seq_len=32", "optimizer.warmup_steps=20")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, cache):
    """The XLA computations on one device (the first of this process's 8, mesh.data=1):
    the 3-step run's history, which every parallel run of this file is compared with."""
    return train(config(tmp_path_factory.mktemp("one") / "run", cache, *THREE_STEPS, "mesh.data=1",
                        "execution.attention=xla", "execution.norm=xla", "execution.loss=xla"), progress=False)


def test_4d_run_matches_one_device(tmp_path, cache, one_device):
    """pipe=2 x seq=2 (ring) x tensor=[2,2] on 16 devices (a process of its own: this one
    has 8): three steps' losses equal one device's. The 16-device run's attention is the
    Pallas flash kernel (interpret mode): the ring's steps on it inside the pipeline's
    lockstep ticks, GPU's default path. (The norm and loss kernels train like XLA on
    data x fsdp x tensor in test_pallas_kernels_train_like_xla; here they cost 8 CPU-s of
    interpret mode.) Interpret mode's steps take time in proportion to
    the tokens, and an evaluation would be one more such program: eval.every=0 (the
    losses are compared)."""
    four_d = ("mesh.pipe=2", "mesh.seq=2", "mesh.tensor=[2,2]")
    out = cli("tiny", *SMALL, *THREE_STEPS, "eval.every=0", f"cache_dir={cache}", f"run_dir={tmp_path / '4d'}",
              *four_d, "execution.attention=pallas", devices=16)
    assert out.returncode == 0, out.stderr[-2000:]
    got = [r["loss"] for r in metrics(tmp_path / "4d")]
    want = [r["loss"] for r in one_device if "loss" in r]
    assert len(got) == len(want) == 3 and rel_err(got, want) < 1e-5


def same_losses(history, reference) -> None:
    for key in ("loss", "val_loss"):
        got = [r[key] for r in history if key in r]
        want = [r[key] for r in reference if key in r]
        assert len(got) == len(want) > 0 and rel_err(got, want) < 1e-5, key


def test_the_readmes_fsdp_command_trains_like_one_device(tmp_path, cache, one_device):
    """README: ``jaxpar-train tiny mesh.fsdp=4 model.layers=2 steps=30 run_dir=runs/try``,
    shortened to THREE_STEPS on SMALL's data (its model.layers=2 the README's): on the
    8 devices, data=2 x fsdp=4, the losses and validation loss are one device's."""
    history = train(load_config("tiny", [*SMALL, f"run_dir={tmp_path / 'try'}", f"cache_dir={cache}", *THREE_STEPS,
                                         "mesh.fsdp=4", "model.layers=2"]), progress=False)
    same_losses(history, one_device)


def test_pallas_kernels_train_like_xla(tmp_path, cache, one_device):
    """execution.attention, execution.norm and execution.loss = pallas (interpret mode on CPU, each kernel
    per device under shard_map on a data=2 x fsdp=2 x tensor=2 mesh: heads and the loss's
    vocabulary split over tensor) give the losses and validation loss of the XLA
    computations on one device (once a data=8 run of their own: one more program)."""
    history = train(config(tmp_path / "pallas", cache, *THREE_STEPS, "mesh.fsdp=2", "mesh.tensor=2",
                           "execution.attention=pallas", "execution.norm=pallas", "execution.loss=pallas"),
                    progress=False)
    same_losses(history, one_device)


def test_an_offloaded_pipeline_trains_like_one_device(tmp_path, cache, one_device):
    """Parameters and optimizer state in host memory under pipe=2 (1F1B, data=4): each
    stage fetches its own layers inside the schedule; the losses and validation loss are
    one device's (the step itself, against one device's gradients, cell by cell:
    tests/test_combinations_train.py)."""
    history = train(config(tmp_path / "run", cache, *THREE_STEPS, "mesh.pipe=2", "pipeline.microbatches=2",
                           "offload.params=host", "offload.optimizer=host"), progress=False)
    same_losses(history, one_device)


# pipe=2 over 4 layers, two steps, a checkpoint at each, evaluated at step 2: the runs below
# resume the 1f1b run's step-1 checkpoint under other stored layouts.
PIPELINED = ("steps=2", "checkpoint.every=1", "eval.every=2", "mesh.pipe=2", "model.layers=4", "batch_size=16")


@pytest.fixture(scope="module")
def even_1f1b(tmp_path_factory, cache):
    """The 1f1b run of PIPELINED, even stages: ``(run_dir, history)``."""
    run = tmp_path_factory.mktemp("1f1b") / "run"
    return run, train(config(run, cache, *PIPELINED, "pipeline.schedule=1f1b"), progress=False)


def resumes_like_the_1f1b_run(even_1f1b, run_dir, cache, *extra) -> None:
    """Resumed from the 1f1b run's step-1 checkpoint under ``extra``, a run gives that
    run's loss and validation loss at step 2, and its step-2 checkpoint is the 1f1b run's."""
    first_dir, first = even_1f1b
    shutil.copytree(first_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "2")
    resumed = train(config(run_dir, cache, *PIPELINED, *extra), progress=False)
    assert [r["step"] for r in resumed] == [2]
    for key in ("loss", "val_loss"):
        got, want = [r[key] for r in resumed if key in r], [r[key] for r in first[1:] if key in r]
        assert len(got) == len(want) > 0 and rel_err(got, want) < 1e-5, key
    saved = [nnx.state(load_run(name)) for name in (run_dir, first_dir)]
    assert tree_rel_err(*saved) < 1e-5


def test_interleaved_runs_save_and_evaluate_the_model(tmp_path, cache, even_1f1b):
    """An interleaved run stores its layers device-major, yet checkpoints and evaluates
    the model: resumed from a 1f1b run's step-1 checkpoint it gives that run's loss and
    validation loss at step 2, and its step-2 checkpoint is the 1f1b run's."""
    resumes_like_the_1f1b_run(even_1f1b, tmp_path / "interleaved", cache, "pipeline.schedule=interleaved",
                              "pipeline.virtual_stages=2")


def test_a_run_resumes_under_uneven_stages(tmp_path, cache, even_1f1b):
    """Uneven stages (test_pipeline_uneven.py) through jaxpar-train's checkpoints: resumed
    from the even 1f1b run's step-1 checkpoint under stage_layers [3, 1] (stored padded,
    the model's order restored to save), a run gives that run's step 2 (loss and
    validation loss), and its step-2 checkpoint is the even run's. Both directions
    between a checkpoint and an uneven stored layout; from one uneven split to another
    in a train step: test_pipeline_uneven.py's test_a_state_resumes_under_another_split.
    (It was a run of its own under [3, 1] resumed under [1, 3]: two more programs.)"""
    resumes_like_the_1f1b_run(even_1f1b, tmp_path / "uneven", cache, "pipeline.schedule=1f1b",
                              "pipeline.stage_layers=[3,1]")


def test_explicit_mesh_trains_like_auto(tmp_path, cache, one_device):
    """mesh.axis_types=explicit on data=1 x fsdp=4 x tensor=2: jaxpar's model (its loss
    under jaxpar.auto_axes) gives one device's losses and validation loss (the run the
    other tests compare with: an Auto fsdp=4 x tensor=2 run, then a data=8 one, was one
    more program to compile)."""
    explicit = train(config(tmp_path / "explicit", cache, *THREE_STEPS, "mesh.fsdp=4", "mesh.tensor=2",
                            "mesh.axis_types=explicit"), progress=False)
    same_losses(explicit, one_device)
