"""Elastic runs (issue 40 item 1): a run resumed on another device count and global
batch continues its data stream sample for sample, scales its learning rate by the
stated rule, and logs the gradient noise scale."""

import json
import logging
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from conftest import random_init, rel_err, tree_rel_err
from jaxpar.models import ModelConfig, Transformer
from jaxpar.train import data as data_lib
from jaxpar.train import noise_scale as noise_lib
from jaxpar.train.config import load_config
from jaxpar.train.loader import Loader
from jaxpar.train.loop import batch_scale, make_optimizer, train
from jaxpar.train.step import loss_fn, make_train_step

SMALL = [
    "model.layers=2", "model.vocab_size=512", "data.max_files=120",
    "data.val_fraction=0.1", "seq_len=64", "eval.every=0", "checkpoint.every=3",
    "optimizer.warmup_steps=2", "optimizer.batch_scaling=sqrt", "eval.noise_scale=true",
]
# (steps run to, global batch, mesh.data) of each segment: 8 devices and batch 16, then
# 4 devices and batch 32, then back.
RESIZED = [(3, 16, 8), (6, 32, 4), (9, 16, 8)]
KEPT = [(3, 16, 8), (6, 32, 8), (9, 16, 8)]


@pytest.fixture(scope="module")
def cache():
    """The test run's shared tokenizer/packed-data cache (conftest's XDG_CACHE_HOME)."""
    return data_lib.default_cache_dir()


def rows(n=37, seq_len=4):
    return data_lib.pack([np.arange(1, n * (seq_len + 1))], seq_len=seq_len, eos_id=0)


def one_process():
    return {"process_index": 0, "process_count": 1}


# The loader's sample offset ------------------------------------------------------------


def test_a_loader_resumed_at_another_batch_continues_the_stream():
    """Batch 4 for 5 steps, then 8 for 4 steps, then 4 again: the rows read are the
    stream of one loader, sample for sample, across two epochs (R = 37 rows)."""
    stream = Loader(rows(), 4, seed=2, **one_process())
    read, state = [], None
    for batch, steps in [(4, 5), (8, 4), (4, 3)]:
        loader = Loader(rows(), batch, seed=2, **one_process())
        if state is not None:
            loader.restore(json.loads(json.dumps(state)))  # plain data: any checkpointer stores it
        for _ in range(steps):
            read.append(loader.local_rows(loader.step))
            next(loader)
        state = loader.state()
    assert state["step"] == 12 and state["offset"] == 5 * 4 + 4 * 8 + 3 * 4 == 64
    np.testing.assert_array_equal(np.concatenate(read), stream.sample_rows(0, 64))
    # every row once per epoch
    np.testing.assert_array_equal(np.sort(np.concatenate(read)[:37]), np.arange(37))


def test_old_step_only_states_and_moved_steps_read_as_step_times_batch():
    loader = Loader(rows(), 8, seed=1, **one_process())
    loader.restore({"step": 3, "seed": 1, "n_rows": 37, "global_batch": 4})  # before sample offsets
    assert loader.offset == 12 and loader.step == 3
    np.testing.assert_array_equal(loader.row_indices(3), loader.sample_rows(12, 8))
    resized = Loader(rows(), 4, seed=1, **one_process())
    resized.restore({**loader.state(), "step": 5})  # two steps of 8 past the saved one
    assert resized.offset == 12 + 2 * 8
    with pytest.raises(ValueError, match="seed=1 but this loader has seed=3"):
        Loader(rows(), 4, seed=3, **one_process()).restore(loader.state())
    with pytest.raises(ValueError, match="step 2 is before step 5"):
        resized.row_indices(2)


# The learning-rate rule ----------------------------------------------------------------


def test_batch_scaling_rules():
    assert batch_scale("none", 32, 16) == 1.0
    assert batch_scale("linear", 32, 16) == 2.0 and batch_scale("linear", 8, 16) == 0.5
    assert batch_scale("sqrt", 64, 16) == 2.0
    opt = load_config("tiny", ["optimizer.lr=1e-3", "optimizer.warmup_steps=2"]).optimizer
    _, plain = make_optimizer(opt, 10)
    _, scaled = make_optimizer(opt, 10, 2.0)
    for step in (0, 2, 5, 9):  # the step clock kept, every value scaled
        assert math.isclose(float(scaled(step)), 2 * float(plain(step)), rel_tol=1e-6)


def test_unknown_batch_scaling_is_one_line_exit_2(tmp_path, capfd):
    from jaxpar.commands.train import main

    capfd.readouterr()
    assert main(["tiny", f"run_dir={tmp_path / 'run'}", "optimizer.batch_scaling=cubic"]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "optimizer.batch_scaling='cubic' must be one of ['none', 'linear', 'sqrt', 'adascale']" in lines[0]
    assert not (tmp_path / "run").exists()


# The noise scale -----------------------------------------------------------------------


def test_the_simple_estimator_recovers_a_known_noise_scale():
    """Per-sample gradients G + noise of covariance sigma^2 I in d dimensions: the noise
    scale is tr(Sigma) / |G|^2 = d sigma^2 / |G|^2 = 64 here; 8 replicas of 4 samples."""
    rng = np.random.default_rng(0)
    d, sigma, replicas, per = 256, 1.0, 8, 4
    G = rng.normal(size=d) * math.sqrt(d * sigma**2 / 64 / d)  # |G|^2 ~ 4
    truth = d * sigma**2 / float(G @ G)
    smoothed = noise_lib.Smoothed(decay=0.99)
    for _ in range(2000):
        samples = G + sigma * rng.normal(size=(replicas, per, d))
        small = np.mean([np.sum(s.mean(0) ** 2) for s in samples])
        big = np.sum(samples.reshape(-1, d).mean(0) ** 2)
        estimate = smoothed.update(*noise_lib.simple_estimates(small, big, per, replicas * per))
    assert abs(estimate / truth - 1) < 0.1, (estimate, truth)
    with pytest.raises(ValueError, match="0 < b_small < b_big"):
        noise_lib.simple_estimates(1.0, 1.0, 4, 4)


def test_unequal_replicas_estimate_it_at_the_harmonic_mean_of_their_rows():
    """data.batch_weights: replicas of 6, 6, 2 and 2 samples (two processes' shares,
    rows 12 and 4 over 2 devices each). Each replica's mean gradient has squared norm
    |G|^2 + tr / b_r in expectation, so the small batch is the harmonic mean of the b_r
    (3), not batch / replicas (4, whose estimate is far off: its trace 44% high, its
    |G|^2 low enough to turn negative)."""
    rows = [6, 6, 2, 2]
    b_small = len(rows) / sum(1 / r for r in rows)  # what the step measures (test_combinations_train.py)
    assert math.isclose(b_small, 3.0)
    rng = np.random.default_rng(1)
    d, sigma = 256, 1.0
    G = rng.normal(size=d) * math.sqrt(sigma**2 / 64)
    truth = d * sigma**2 / float(G @ G)
    estimates = {b: noise_lib.Smoothed(decay=0.99) for b in (b_small, 4.0)}
    for _ in range(2000):
        samples = [G + sigma * rng.normal(size=(r, d)) for r in rows]
        small = np.mean([np.sum(s.mean(0) ** 2) for s in samples])
        big = np.sum(np.concatenate(samples).mean(0) ** 2)
        got = {b: e.update(*noise_lib.simple_estimates(small, big, b, 16)) for b, e in estimates.items()}
    assert abs(got[b_small] / truth - 1) < 0.1, (got, truth)
    assert abs(got[4.0] / truth - 1) > 0.3, (got, truth)


@pytest.mark.slow
def test_the_noise_scale_step_updates_as_the_plain_one_and_returns_both_norms():
    """Replicas that count different numbers of tokens: the update is the batch's
    token-weighted one all the same, ``grad_sq_big`` its gradient's squared norm and
    ``grad_sq_small`` the mean of each replica's own (computed here on one device)."""
    cfg = ModelConfig(vocab_size=128, dim=32, layers=1, heads=4, kv_heads=2, head_dim=8, mlp_dim=64)
    model = random_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), np.random.default_rng(0))
    rng = np.random.default_rng(1)
    batch = {k: jnp.asarray(rng.integers(0, 128, (8, 16)), jnp.int32) for k in ("inputs", "targets")}
    batch["mask"] = jnp.asarray(rng.random((8, 16)) < np.linspace(0.2, 1, 8)[:, None], jnp.int32)
    mesh = jaxpar.make_mesh(data=4, fsdp=2)
    plain, noisy = (make_train_step(model, optax.sgd(0.1), mesh, donate=False, noise_scale=on) for on in (False, True))
    params, opt_state = plain.init(model)
    want, got = plain(params, opt_state, batch), noisy(params, opt_state, batch)
    assert tree_rel_err(got[0], want[0]) < 1e-5 and rel_err(got[2]["loss"], want[2]["loss"]) < 1e-5
    assert rel_err(got[2]["grad_sq_big"], want[2]["grad_norm"] ** 2) < 1e-5
    graphdef, state = nnx.split(model)
    # one program for each replica's squared gradient norm, its rows cut in numpy
    grad_sq = jax.jit(lambda p, b: optax.tree.norm(jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), b))(p),
                                                   squared=True))
    host = {k: np.asarray(v) for k, v in batch.items()}
    small = np.mean([float(grad_sq(state, {k: v[2 * r:2 * r + 2] for k, v in host.items()})) for r in range(4)])
    assert rel_err(got[2]["grad_sq_small"], small) < 1e-5
    with pytest.raises(ValueError, match="eval.noise_scale needs a mesh"):
        make_train_step(model, optax.sgd(0.1), None, noise_scale=True)


def test_one_data_replica_cannot_estimate_it(caplog):
    cfg = load_config("tiny", ["eval.noise_scale=true"])
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    with caplog.at_level(logging.WARNING):
        assert not noise_lib.enabled(cfg, mesh)
    assert [r.getMessage() for r in caplog.records if "noise scale" in r.getMessage()] == [
        "eval.noise_scale: one data replica (mesh.data=1) gives one batch size per step; the noise scale "
        "needs two, so it is not estimated"]


# A resized run against one kept on 8 devices ---------------------------------------------


def run_segments(run_dir, cache, segments, seen) -> list[dict]:
    history = []
    for steps, batch, data in segments:
        cfg = load_config("tiny", SMALL + [f"run_dir={run_dir}", f"cache_dir={cache}", f"steps={steps}",
                                           f"batch_size={batch}", f"mesh.data={data}"])
        history += train(cfg, progress=False)
    return history


@pytest.fixture
def seen(monkeypatch):
    """Every global batch's row indices the loaders hand out, in order, and the loader."""
    log, original = {"rows": [], "loader": None}, Loader.__next__

    def recording(self):
        log["rows"].append(self.row_indices(self.step))
        log["loader"] = self
        return original(self)

    monkeypatch.setattr(Loader, "__next__", recording)
    return log


@pytest.mark.slow
def test_a_resized_run_sees_every_sample_once_and_matches_one_kept_on_8_devices(tmp_path, cache, seen, caplog):
    """The two runs' first segments are one config (8 devices, batch 16, steps 1-3): it
    runs once, and the kept run continues from a copy of its run dir, its records
    those steps' records."""
    assert RESIZED[0] == KEPT[0]
    with caplog.at_level(logging.INFO, logger="jaxpar.train.loop"):
        resized = run_segments(tmp_path / "resized", cache, RESIZED[:1], seen)
        shutil.copytree(tmp_path / "resized", tmp_path / "kept")
        resized += run_segments(tmp_path / "resized", cache, RESIZED[1:], seen)
    meshes = [r.getMessage().split(" on ")[-1] for r in caplog.records if " on mesh" in r.getMessage()]
    assert meshes == ["mesh data=8 (8 cpu devices)", "mesh data=4 (4 cpu devices)", "mesh data=8 (8 cpu devices)"]
    read = np.concatenate(seen["rows"])
    stream = Loader(seen["loader"].rows, 1, seed=0, **one_process())
    assert len(read) == 3 * 16 + 3 * 32 + 3 * 16
    np.testing.assert_array_equal(read, stream.sample_rows(0, len(read)))
    kept = resized[:3] + run_segments(tmp_path / "kept", cache, KEPT[1:], seen)
    assert [r["step"] for r in resized] == [r["step"] for r in kept] == list(range(1, 10))
    assert rel_err([r["loss"] for r in resized], [r["loss"] for r in kept]) < 1e-5
    # sqrt scaling against the first batch, 16: steps 4-6 at sqrt(2) times the schedule
    opt = load_config("tiny", SMALL).optimizer
    for r in resized:
        factor = math.sqrt(2) if 4 <= r["step"] <= 6 else 1.0
        steps = next(s for s, _, _ in RESIZED if r["step"] <= s)
        assert math.isclose(r["lr"], factor * float(make_optimizer(opt, steps)[1](r["step"] - 1)), rel_tol=1e-6)
    # the noise scale and its two norms, every step
    assert all(math.isfinite(r["noise_scale"]) and r["grad_sq_small"] > r["grad_sq_big"] > 0 for r in resized)
