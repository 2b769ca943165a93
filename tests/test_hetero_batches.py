"""Speed-proportional batches across unequal processes (``data.batch_weights``,
``jaxpar.train.weighted``): the split itself, and two processes on jax.distributed
(gloo) with local batches of 12 and 4 rows against one process with 16, through a
SIGKILL and a resume."""

import json
import pathlib

import numpy as np
import pytest

from conftest import adasum_reference, finish, kill_once_saved, train_processes
from jaxpar.train import weighted
from jaxpar.train.data import default_cache_dir
from jaxpar.train.config import load_config
from jaxpar.train.loop import train

SMALL = ["model.layers=2", "model.vocab_size=512", "data.max_files=120", "data.val_fraction=0.1", "seq_len=64",
         "batch_size=16", "eval.batches=2", "optimizer.warmup_steps=2", "eval.every=2", "checkpoint.every=2"]


@pytest.fixture(scope="module")
def cache():
    """The test run's shared tokenizer/packed-data cache (conftest's XDG_CACHE_HOME)."""
    return default_cache_dir()


def metrics(run_dir) -> list[dict]:
    return [json.loads(l) for l in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.mark.parametrize("weights, processes, devices, within, batch, rows", [
    ((3, 1), 2, 1, 1, 16, (12, 4)),
    ((1, 1), 2, 4, 1, 16, (8, 8)),
    ((2.0, 1.0, 1.0), 3, 1, 1, 24, (12, 6, 6)),
    ((100, 1), 2, 2, 1, 16, (14, 2)),  # the slow process keeps one quantum per device
    ((3, 1), 2, 1, 2, 8, (6, 2)),      # the equality test's split: quanta of 2 rows, one per FSDP device
    ((1, 1, 2), 3, 1, 1, 27, (7, 7, 13)),  # 9 rows each: quanta of 1 (a divisor of 9; 9 // 4 = 2 lost a row)
    ((1, 1, 2), 3, 2, 2, 48, (12, 12, 24)),  # 8 rows a replica, quanta of 2
])
def test_row_counts_follow_the_weights_in_quanta(weights, processes, devices, within, batch, rows):
    layout = weighted.row_counts(batch, weights, processes, devices, within)
    assert sum(layout.rows) == batch
    assert all(r % (devices * layout.unit) == 0 and r > 0 for r in layout.rows) and layout.unit % within == 0
    assert layout.rows == rows
    assert layout.slot == max(layout.rows) // devices


def test_a_replicas_rows_that_its_microbatches_cannot_split_are_one_line():
    with pytest.raises(weighted.WeightsError, match="gives each of the 2 data replicas 3 rows, which microbatches of a multiple of 2 rows"):
        weighted.row_counts(6, (1, 1), 2, 1, within=2)


def test_padded_puts_each_devices_rows_first():
    layout = weighted.row_counts(16, (3, 1), 2, 2)  # rows (12, 4): 6 and 2 per device, slot 6
    local = {"mask": np.arange(1, 5)[:, None] * np.ones((1, 3), int)}
    padded = layout.padded(local, 1)["mask"]
    assert padded.shape == (12, 3)
    assert padded[:, 0].tolist() == [1, 2, 0, 0, 0, 0, 3, 4, 0, 0, 0, 0]


@pytest.mark.parametrize("weights, message", [
    ((1, 1, 1), "has 3 entries for 2 processes"),
    ((1, -1), "every weight must be positive"),
])
def test_bad_weights_are_one_line(weights, message):
    with pytest.raises(weighted.WeightsError, match=message):
        weighted.row_counts(16, weights, 2, 1)


@pytest.mark.parametrize("arg, message", [
    ("data.batch_weights=[1,2]", "has 2 entries for 1 processes"),
    ("data.batch_weights=[0]", "every weight must be positive"),
    ("data.rebalance_every=5", "re-measures data.batch_weights=auto"),
    ("data.batch_weights=[1] mesh.pipe=2", "data.batch_weights=[1.0] with mesh.pipe=2 is not supported yet"),
])
def test_bad_batch_weights_exit_2_and_write_nothing(tmp_path, capfd, arg, message):
    from jaxpar.commands.train import main

    run = tmp_path / "run"
    code = main(["tiny", *SMALL, *arg.split(), f"run_dir={run}", "steps=1", "--no-progress"])
    lines = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not run.exists()


@pytest.mark.slow  # two processes on jax.distributed
def test_twelve_and_four_rows_equal_sixteen_and_resume_after_sigkill(tmp_path, cache):
    """Two processes of two devices each, one data replica each split over its two FSDP
    devices (mesh.fsdp=2): process 0 reads 6 rows of each batch and process 1 reads 2
    (in microbatches of 2 rows, one per FSDP device); the losses equal one process
    reading all 8 (1e-5). Both are killed (SIGKILL) once a checkpoint exists; started
    again, they resume from it and finish with the same losses.

    The suite's language-model run over several processes with more than one device
    each, evaluations included (test_cluster_ray's job b runs as two processes of one
    device with plain batches, and resumes their checkpoint in one process)."""
    args = SMALL + ["steps=6", f"cache_dir={cache}"]
    single = train(load_config("tiny", args + [f"run_dir={tmp_path / 'single'}"]), progress=False)
    args = args + ["mesh.fsdp=2"]

    run, logs = tmp_path / "two", tmp_path / "two.log"
    args = [*args, f"run_dir={run}", "data.batch_weights=[3,1]"]
    saved = kill_once_saved(train_processes("tiny", args, logs), run, 2)
    assert saved and saved[-1] < 6, f"killed too late to test a resume: checkpoints {saved}"
    config = json.loads(json.dumps(__import__("yaml").safe_load((run / "config.yaml").read_text())))
    assert config["data"]["batch_weights"] == [3.0, 1.0]

    finish(train_processes("tiny", args, logs), logs)
    two = metrics(run)
    assert [r["step"] for r in two] == list(range(1, 7))
    assert rel_err([r["loss"] for r in two], [r["loss"] for r in single]) < 1e-5
    assert rel_err([r["val_loss"] for r in two if "val_loss" in r],
                   [r["val_loss"] for r in single if "val_loss" in r]) < 1e-5


@pytest.mark.slow
def test_unequal_device_rows_with_random_masks_equal_the_whole_batch():
    """4 data devices with 6, 2, 4 and 4 real rows (slot 6, microbatches of 2) and random
    masks: the loss and gradients equal the token-weighted mean over all 16 rows; with
    Adasum, the Adasum of each device's token-weighted mean over its own real rows, and
    with DCT top-k at ratio 1 (everything sent), their mean (each against one device)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxpar.hetero import reduction as reduction_lib
    from jaxpar.hetero.reduction import Reduction
    from jaxpar.models import Transformer
    from jaxpar.placement.sharding import use_mesh
    from jaxpar.train import gradients
    from jaxpar.train.step import loss_fn

    cfg = load_config("tiny", ["model.layers=2", "model.dim=64", "model.heads=2", "model.kv_heads=2",
                               "model.mlp_dim=128", "model.vocab_size=512", "seq_len=16"])
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Explicit,))
    graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    T, device_rows, slot = 16, [6, 2, 4, 4], 6
    tokens = rng.integers(0, 512, (16, T + 1))
    mask = (rng.random((16, T)) < 0.6).astype(np.int32)  # a different count in every row
    whole = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
             "positions": np.broadcast_to(np.arange(T), (16, T)).copy(), "segment_ids": np.ones((16, T), int)}
    starts = np.cumsum([0] + device_rows)
    slots = {k: np.concatenate([np.pad(v[a:b], [(0, slot - (b - a)), (0, 0)]) for a, b in zip(starts, starts[1:])])
             for k, v in whole.items()}
    batch = jax.device_put({k: v.astype(np.int32) for k, v in slots.items()}, NamedSharding(mesh, PartitionSpec("data")))
    replicated = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    per_replica = gradients.over_replicas(gradients.plain(loss_fn, graphdef), gradients.Replicas(rows=2), mesh,
                                          PartitionSpec())
    with use_mesh(mesh):
        value, grads, *_ = jax.jit(lambda p, b: per_replica(p, None, b))(replicated, batch)
    # The references on one device from one program: each row's loss and gradient (the
    # mean over its counted tokens), combined in numpy weighted by the rows' counted
    # tokens: the token-weighted mean over any set of rows (one program, not one per
    # row count: 16, 6, 4 and 2 rows were four).
    one = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(nnx.merge(graphdef, p), b)))
    rows = [one(params, {k: jnp.asarray(v[r:r + 1], jnp.int32) for k, v in whole.items()}) for r in range(16)]
    counts = mask.sum(axis=1).astype(np.float64)
    row_grads = jax.tree.map(lambda *g: np.stack([np.asarray(x, np.float64) for x in g]), *[g for _, g in rows])

    def token_mean(a, b):  # rows a..b-1: their loss and gradients, token-weighted
        w = counts[a:b] / counts[a:b].sum()
        return (float(np.dot(w, [float(v) for v, _ in rows[a:b]])),
                jax.tree.map(lambda g: np.tensordot(w, g[a:b], axes=1), row_grads))

    ref_value, ref_grads = token_mean(0, 16)
    assert rel_err(value, ref_value) < 1e-5
    close(grads, ref_grads)

    # Each device's own rows, then the replicas combined by hand.
    own = [token_mean(a, b) for a, b in zip(starts, starts[1:])]
    losses = np.mean([v for v, _ in own])
    stacked = jax.tree.map(lambda *g: np.stack([np.asarray(x, np.float32) for x in g]), *[g for _, g in own])
    split = NamedSharding(mesh, PartitionSpec("data"))
    for reduction, want in ((Reduction("adasum"), adasum_reference(stacked)),
                            (Reduction("mean", "dct_topk", ratio=1.0), jax.tree.map(lambda g: g.mean(0), stacked))):
        state, state_spec = None, None
        if reduction.compressed:
            state_spec = reduction_lib.ResidualState(PartitionSpec("data"), PartitionSpec("data"), PartitionSpec())
            state = jax.jit(reduction_lib.carried(4).init)(params)
            state = reduction_lib.ResidualState(jax.device_put(state.residual, split),
                                                jax.device_put(state.threshold, split),
                                                jax.device_put(state.count, NamedSharding(mesh, PartitionSpec())))
        per_replica = gradients.over_replicas(gradients.plain(loss_fn, graphdef), gradients.Replicas(reduction, rows=2),
                                              mesh, PartitionSpec(), state_spec)
        with use_mesh(mesh):
            value, grads, *_ = jax.jit(per_replica)(replicated, state, batch)
        assert rel_err(value, losses) < 1e-5, reduction
        close(grads, want)


def close(got, want):
    """Every leaf of ``got`` within 1e-5 of ``want``'s largest entry."""
    import jax

    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, r = np.asarray(g), np.asarray(r)
        assert np.max(np.abs(g - r)) <= 1e-5 * np.max(np.abs(r)), np.max(np.abs(g - r)) / np.max(np.abs(r))
