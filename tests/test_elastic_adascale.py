"""AdaScale's gain (``optimizer.batch_scaling=adascale``, issue 40 item 1): the formula,
the optax transformation against a hand computation, and a resized run's records."""

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpar.elastic import adascale
from jaxpar.train import data as data_lib
from jaxpar.train.config import load_config
from jaxpar.train.loop import make_optimizer, train

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=10, end_value=1e-3)


def test_the_gain_lies_between_one_and_the_scale():
    # sigma^2 = trace / base = 4, |mu|^2 = 1, scale 4: (4 + 1) / (1 + 1)
    assert math.isclose(float(adascale.gain(1.0, 64.0, 16, 64)), 2.5, rel_tol=1e-6)
    assert math.isclose(float(adascale.gain(1.0, 1e-9, 16, 64)), 1.0, rel_tol=1e-5)  # no noise: nothing gained
    assert math.isclose(float(adascale.gain(0.0, 64.0, 16, 64)), 4.0, rel_tol=1e-6)  # all noise: the whole scale
    assert math.isclose(float(adascale.gain(-3.0, 64.0, 16, 8)), 0.5, rel_tol=1e-6)  # shrunk, clamped |mu|^2
    assert float(adascale.gain(1.0, 64.0, 16, 16)) == 1.0


def reference(norms, updates, *, base, batch, replicas, decay=adascale.DECAY, power=adascale.POWER):
    """The transformation's updates step by step, in float64 from the formulas."""
    g2 = trace = progress = 0.0
    out = []
    for (small, big), u in zip(norms, updates):
        step_g2 = (batch * big - batch / replicas * small) / (batch - batch / replicas)
        step_trace = (small - big) / (replicas / batch - 1 / batch)
        g2, trace = decay * g2 + (1 - decay) * step_g2, decay * trace + (1 - decay) * step_trace
        var, sqr = max(trace / base, 1e-6), max(g2, 0.0)
        r = 1.0 if batch == base else (var + sqr) / (var * base / batch + sqr)
        out.append((-float(SCHEDULE(progress)) * r ** power * u, r, progress + r))
        progress += r
    return out


@pytest.mark.parametrize("batch", [16, 48])
def test_the_transformation_against_a_hand_computation(batch):
    rng = np.random.default_rng(batch)
    norms = [(small, small * rng.uniform(0.2, 0.6)) for small in rng.uniform(1, 3, 6)]
    updates = [rng.normal(size=5).astype(np.float32) for _ in norms]
    tx = adascale.scale_by_adascale(SCHEDULE, base=16, batch=batch, replicas=4)
    state = tx.init(jnp.zeros(5))
    plain = optax.scale_by_learning_rate(SCHEDULE)
    plain_state = plain.init(jnp.zeros(5))
    update = jax.jit(tx.update)  # one program for the six steps (eagerly, each op compiles apart)
    for (small, big), u, (want, r, progress) in zip(norms, updates, reference(norms, updates, base=16, batch=batch,
                                                                              replicas=4)):
        got, state = update(jnp.asarray(u), state, grad_sq_small=jnp.float32(small), grad_sq_big=jnp.float32(big))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
        assert math.isclose(float(state.gain), r, rel_tol=1e-5) and math.isclose(float(state.progress), progress,
                                                                                   rel_tol=1e-5)
        if batch == 16:  # at the base batch: exactly the schedule on the step clock
            expected, plain_state = plain.update(jnp.asarray(u), plain_state)
            np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert batch == 16 or 1 < float(state.gain) < batch / 16
    # a step without the norms (one replica) keeps the averages
    kept, after = tx.update(jnp.asarray(updates[0]), state)
    assert float(after.g2) == float(state.g2) and float(after.trace) == float(state.trace)


def test_adascale_without_the_noise_scale_is_one_line_exit_2(tmp_path, capfd):
    from jaxpar.commands.train import main

    capfd.readouterr()
    assert main(["tiny", f"run_dir={tmp_path / 'run'}", "optimizer.batch_scaling=adascale"]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "optimizer.batch_scaling=adascale reads the gradient noise scale" in lines[0]
    assert main(["tiny", f"run_dir={tmp_path / 'run'}", "optimizer.base_batch_size=8"]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "optimizer.base_batch_size=8 scales nothing with optimizer.batch_scaling=none" in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_run_ends_where_its_progress_reaches_steps(tmp_path):
    """``run_steps`` against hand-written records: without AdaScale's progress a run of
    3 steps ends at step 3; with it, at the first step whose progress reaches 3 (here the
    3rd of gains 1.5, 1.2, 0.4: 3.1), saved there, whatever the step count."""
    from jaxpar.train.stepping import Recorder, finished, run_steps

    assert finished({"step": 3}, 3) and not finished({"step": 2}, 3)
    assert finished({"step": 2, "adascale_progress": 3.0}, 3) and not finished({"step": 5, "adascale_progress": 2.9}, 3)
    for gains, ends in [(None, 3), ([1.5, 1.2, 0.4, 2.0, 2.0], 3), ([0.5] * 7, 6)]:
        progress, saved = [0.0], []

        def one_step(step):
            record = {"step": step, "loss": 1.0}
            if gains is not None:
                progress[0] += gains[step - 1]
                record |= {"adascale_gain": gains[step - 1], "adascale_progress": progress[0]}
            return record, {}

        recorder = Recorder(tmp_path, 0, 3, lead=False, progress=False)
        history = run_steps(0, 3, 2, one_step=one_step, save=saved.append, recorder=recorder, where="here")
        assert [r["step"] for r in history] == list(range(1, ends + 1))
        assert saved == [s for s in range(1, ends + 1) if s % 2 == 0 or s == ends]


@pytest.mark.slow
def test_a_resized_run_follows_the_gain_and_carries_its_averages(tmp_path):
    """Batch 16 on data=8 for 2 steps, then 32 on data=4 to progress 4: at the base batch
    the gain is 1 and the rate the schedule's on the step clock; after the resize the
    gain is measured (between 1 and 2), the progress resumes from the checkpoint and
    advances by it, the logged rate is the schedule at that progress times the gain's
    square root, and the run ends at the first step whose progress reaches 4 (fewer
    steps than 4 at the larger batch); run again, it has nothing to do."""
    base = ["model.layers=1", "model.vocab_size=512", "data.max_files=60", "data.val_fraction=0.1", "seq_len=32",
            "eval.every=0", "checkpoint.every=2", "optimizer.warmup_steps=2", "optimizer.batch_scaling=adascale",
            "eval.noise_scale=true", f"run_dir={tmp_path}", f"cache_dir={data_lib.default_cache_dir()}"]
    history = []
    for steps, batch, data in [(2, 16, 8), (4, 32, 4)]:
        cfg = load_config("tiny", base + [f"steps={steps}", f"batch_size={batch}", f"mesh.data={data}"])
        history += train(cfg, progress=False)
    schedule = make_optimizer(cfg.optimizer, 4)[1]
    assert [r["step"] for r in history] == list(range(1, len(history) + 1)) and 3 <= len(history) <= 4
    progress = 0.0
    for r in history:
        resized = r["step"] > 2
        assert (1 < r["adascale_gain"] <= 2) if resized else r["adascale_gain"] == 1.0
        assert math.isclose(r["lr"], float(schedule(progress)) * r["adascale_gain"] ** 0.5, rel_tol=1e-5)
        progress += r["adascale_gain"]
        assert math.isclose(r["adascale_progress"], progress, rel_tol=1e-5)
        assert (r["adascale_progress"] >= 4) == (r is history[-1])
    assert train(cfg, progress=False) == []  # already at progress 4

    # bench/adascale.py's figure and table, as a smoke: the first segment's run again
    import runpy

    bench = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "bench" / "adascale.py"), run_name="bench_adascale")
    done = bench["main"](["--steps", "2", "--scales", "1", "--eval-every", "0", "--json", str(tmp_path / "a.json"),
                          "--png", str(tmp_path / "a.png"), "--overrides", *base[:5], *base[7:8], base[-1],
                          "mesh.data=8"])
    assert [r["steps_run"] for r in done["runs"]] == [2] and (tmp_path / "a.png").stat().st_size > 0


@pytest.mark.slow
def test_adascale_with_offloaded_state_steps_as_on_the_device():
    """AdaScale's noise-scale norms reach its transformation when the parameters and
    the optimizer state live in host memory (the update then runs on the host): two
    steps on data=2 give the parameters, gain, progress and rate of the same steps
    with everything on the device (1e-5)."""
    from flax import nnx

    import jaxpar
    from conftest import random_init, tree_rel_err
    from jaxpar.models import ModelConfig, Transformer
    from jaxpar.placement.execution import OffloadOptions
    from jaxpar.train.step import make_train_step

    cfg = ModelConfig(vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=48)
    model = random_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), np.random.default_rng(0))
    mesh = jaxpar.make_mesh(data=2, devices=jax.devices()[:2], axis_types="auto")
    tx, _ = make_optimizer(load_config("tiny", ["optimizer.warmup_steps=1"]).optimizer, 10, adascale=(4, 8, 2))
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(2):
        tokens = rng.integers(0, 64, (8, 17)).astype(np.int32)
        batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((8, 16), np.int32),
                        "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1)),
                        "segment_ids": np.ones((8, 16), np.int32)})
    runs = []
    for offload in (None, OffloadOptions(params="host", optimizer="host")):
        step = make_train_step(model, tx, mesh, donate=False, noise_scale=True, offload=offload)
        params, opt_state = step.init(model)
        records = []
        for batch in batches:
            params, opt_state, metrics = step(params, opt_state, batch)
            records.append([float(metrics[k]) for k in ("loss", "lr", "adascale_gain", "adascale_progress")])
        runs.append((jax.tree.map(np.asarray, step.in_model_order(params)), np.array(records)))
    (want_params, want), (got_params, got) = runs
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want[1, 2] > 1  # a gain above one: the norms were read
    assert tree_rel_err(got_params, want_params) < 1e-5
