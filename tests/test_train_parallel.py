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


def test_4d_run_matches_one_device(tmp_path, cache):
    """pipe=2 x seq=2 (ring) x tensor=[2,2] on 16 devices: six steps' losses equal one
    device's (during tiny's warm-up: at full learning rate AdamW's
    g / sqrt(v) amplifies float32 reduction-order differences step after step). The
    16-device run uses the Pallas kernels (interpret mode): the ring's steps on the flash
    kernel inside the pipeline's lockstep ticks, GPU's default path. SMALL's batch of 8:
    interpret mode's steps take time in proportion to the batch."""
    common = (*SMALL, "optimizer.warmup_steps=20", f"cache_dir={cache}", "steps=6",
              "eval.every=0", "checkpoint.every=0")
    four_d = ("mesh.pipe=2", "mesh.seq=2", "mesh.tensor=[2,2]")
    pallas = ("execution.attention=pallas", "execution.norm=pallas", "execution.loss=pallas")
    out = cli("tiny", *common, f"run_dir={tmp_path / '4d'}", *four_d, *pallas, devices=16)
    assert out.returncode == 0, out.stderr[-2000:]
    # one device: the first of this process's 8 (mesh.data=1), without a process of its own
    reference = train(load_config("tiny", [*common, f"run_dir={tmp_path / 'one'}", "mesh.data=1"]), progress=False)
    got = [r["loss"] for r in metrics(tmp_path / "4d")]
    assert len(got) == len(reference) == 6 and rel_err(got, [r["loss"] for r in reference]) < 1e-5


def test_pallas_kernels_train_like_xla(tmp_path, cache):
    """execution.attention, execution.norm and execution.loss = pallas (interpret mode on CPU, each kernel
    per device under shard_map on a data=2 x fsdp=2 x tensor=2 mesh: heads and the loss's
    vocabulary split over tensor) give the losses and validation loss of the XLA
    computations on one data-parallel mesh."""
    common = ("steps=3", "eval.every=3", "checkpoint.every=0", "seq_len=32")
    reference = train(config(tmp_path / "xla", cache, *common, "execution.attention=xla", "execution.norm=xla",
                             "execution.loss=xla"), progress=False)
    history = train(config(tmp_path / "pallas", cache, *common, "mesh.fsdp=2", "mesh.tensor=2",
                           "execution.attention=pallas", "execution.norm=pallas", "execution.loss=pallas"),
                    progress=False)
    for key in ("loss", "val_loss"):
        got = [r[key] for r in history if key in r]
        want = [r[key] for r in reference if key in r]
        assert len(got) == len(want) > 0 and rel_err(got, want) < 1e-5, key


def test_interleaved_runs_save_and_evaluate_the_model(tmp_path, cache):
    """An interleaved run stores its layers device-major, yet checkpoints and evaluates
    the model: resumed from a 1f1b run's step-2 checkpoint it gives that run's losses and
    validation loss, and its step-4 checkpoint is the 1f1b run's."""
    common = ("steps=4", "checkpoint.every=2", "eval.every=4", "mesh.pipe=2", "model.layers=4",
              "batch_size=16")
    first = train(config(tmp_path / "1f1b", cache, *common, "pipeline.schedule=1f1b"), progress=False)
    shutil.copytree(tmp_path / "1f1b", tmp_path / "interleaved")
    shutil.rmtree(tmp_path / "interleaved" / "checkpoints" / "4")
    resumed = train(config(tmp_path / "interleaved", cache, *common, "pipeline.schedule=interleaved",
                           "pipeline.virtual_stages=2"), progress=False)
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "val_loss"):
        got, want = [r[key] for r in resumed if key in r], [r[key] for r in first[2:] if key in r]
        assert len(got) == len(want) > 0 and rel_err(got, want) < 1e-5, key
    saved = [nnx.state(load_run(tmp_path / name)) for name in ("interleaved", "1f1b")]
    assert tree_rel_err(*saved) < 1e-5


def test_explicit_mesh_trains_like_auto(tmp_path, cache):
    """mesh.axis_types=explicit on data=1 x fsdp=4 x tensor=2: jaxpar's model (its loss
    under jaxpar.auto_axes) gives the Auto mesh's losses and validation loss."""
    common = ("steps=3", "eval.every=3", "checkpoint.every=0", "seq_len=32", "mesh.fsdp=4", "mesh.tensor=2")
    runs = {kind: train(config(tmp_path / kind, cache, *common, f"mesh.axis_types={kind}"), progress=False)
            for kind in ("auto", "explicit")}
    for key in ("loss", "val_loss"):
        got = [r[key] for r in runs["explicit"] if key in r]
        want = [r[key] for r in runs["auto"] if key in r]
        assert len(got) == len(want) > 0 and rel_err(got, want) < 1e-5, key
