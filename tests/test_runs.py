"""Reading runs back (jaxpar.train.runs): a run's parameters, never its optimizer state."""

import logging
import warnings

import jax
import numpy as np
import pytest
import yaml
from conftest import random_init
from flax import nnx

from jaxpar.models import Transformer
from jaxpar.train.checkpoints import CheckpointError, Checkpoints
from jaxpar.train.config import load_config, to_dict
from jaxpar.train.loop import make_optimizer
from jaxpar.train.runs import load_run

SMALL = ["model.vocab_size=300", "model.dim=32", "model.layers=1",
         "model.heads=2", "model.kv_heads=1", "model.head_dim=16", "model.mlp_dim=48"]


def write_run(run_dir, rng, *overrides, opt_state: bool) -> nnx.State:
    """A run dir (config.yaml, one checkpoint at step 3) of a random small model (SMALL,
    then ``overrides``), its checkpoint holding the optimizer state beside the
    parameters or not; returns the parameters."""
    cfg = load_config("tiny", [*SMALL, *overrides, f"run_dir={run_dir}"])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    params = nnx.state(random_init(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)), rng))
    state = {"params": params}
    if opt_state:
        state["opt_state"] = make_optimizer(cfg.optimizer, cfg.steps)[0].init(params)
    with Checkpoints(run_dir, keep=1) as checkpoints:
        checkpoints.save(3, state, {"step": 3})
    return params


def test_a_run_loads_its_parameters_alone(tmp_path, rng, caplog):
    """load_run restores the checkpoint's parameters only (orbax's partial restore), so
    a checkpoint whose optimizer state is gone loads as well as a whole one, silently."""
    for opt_state in (True, False):
        run = tmp_path / f"opt_state_{opt_state}"
        params = write_run(run, rng, opt_state=opt_state)
        with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
            warnings.simplefilter("error")
            loaded = nnx.state(load_run(run))
        assert not [r for r in caplog.records if "cannot be restored" in r.getMessage()]  # none skipped
        for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_save_that_does_not_happen_raises(tmp_path):
    """Orbax skips a step at or before its latest (returning False); a Checkpoints save
    says so rather than losing the step silently."""
    with Checkpoints(tmp_path / "run", keep=2) as checkpoints:
        checkpoints.save(3, {"x": jax.numpy.arange(4.0)}, {"step": 3})
        with pytest.raises(CheckpointError, match=r"checkpoint at step 3 was not saved to .*/run/checkpoints "
                                                  r"\(its latest step is 3\)"):
            checkpoints.save(3, {"x": jax.numpy.arange(4.0) + 1}, {"step": 3})


def test_checkpoints_close_on_an_error_but_not_on_a_second_ctrl_c(tmp_path):
    """A manager left open races interpreter shutdown: its cleanup thread printed
    "cannot schedule new futures after interpreter shutdown" after a one-line error."""
    with pytest.raises(ValueError):
        with Checkpoints(tmp_path / "run", keep=2) as checkpoints:
            raise ValueError("no files matched")
    assert checkpoints._closed
    with pytest.raises(KeyboardInterrupt):
        with Checkpoints(tmp_path / "run", keep=2) as interrupted:
            raise KeyboardInterrupt
    assert not interrupted._closed  # jaxpar-train's handler exits at once
    interrupted.close()


@pytest.mark.slow
def test_training_runs_without_tensorboardx(tmp_path, monkeypatch):
    """tensorboardX is optional (the GPU image lacks it): a run without it writes no
    events and everything else. (In this process: ``train.tensorboard`` imports it on
    each run's first use, and a ``None`` in ``sys.modules`` fails that import as if it
    were not installed; a fresh interpreter for this cost 5 CPU-s.)"""
    import sys

    from jaxpar.train.loop import train

    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    train(load_config("tiny", SMALL + ["steps=2", "eval.every=0", "data.max_files=20", "batch_size=8", "seq_len=32",
                                       f"run_dir={tmp_path / 'run'}"]), progress=False)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2
    assert not (tmp_path / "run" / "tensorboard").exists()
