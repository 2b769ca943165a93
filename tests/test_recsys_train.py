"""``jaxpar-train dlrm``: a run killed and resumed from a checkpoint taken with the
cache dirty continues as the uninterrupted run, the trained model learns the planted
signal, and bad input is one line with nothing written. (The cache against the whole table on the device, bit for
bit: tests/test_embedding_cache_training.py.)"""

import json
import pathlib

import numpy as np
import pytest

from conftest import finish, kill_once_saved, train_processes
from jaxpar.train.config import ConfigError, load_config
from jaxpar.train.loop import train


# The 150-step run that learns the signal, evaluated at its last step only. A run killed
# and resumed from checkpoints taken with the cache dirty: the two-process test below.
LEARNED = ["steps=150", "checkpoint.every=50"]


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """``(run_dir, history)`` of the 150-step run."""
    run = tmp_path_factory.mktemp("learned") / "run"
    return run, train(load_config("dlrm", [*LEARNED, "eval.every=150", f"run_dir={run}"]), progress=False)


def losses(history) -> list[float]:
    return [r["loss"] for r in history]


def test_trained_dlrm_learns_the_planted_signal(learned):
    run, history = learned
    assert history[-1]["val_auc"] > 0.68, history[-1]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 150 and "val_auc" in lines[-1] and 0 < lines[-1]["hit_rate"] < 1


@pytest.mark.parametrize("args,message", [
    (["embedding.cache_ratio=0"], r"embedding.cache_ratio=0.0 must be in \(0, 1\]"),
    (["embedding.cache_ratio=1.5"], r"embedding.cache_ratio=1.5 must be in \(0, 1\]"),
    (["data.format=criteo"], r"data.format=criteo needs data.path"),
    (["data.format=text"], r"task=dlrm reads data.format=criteo"),
    (["data.format=criteo", "data.path=day_0.gz"],
     r"^data.format=criteo has 26 categorical features, but the model has 8 tables: give model=dlrm_criteo_small"),
    (["mesh.fsdp=2"], r"task=dlrm trains data parallel"),
    (["task=lm"], r"task='lm' with a DLRMConfig model"),
])
def test_bad_config_is_one_line(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config("dlrm", args)


def test_the_readmes_criteo_command_trains(tmp_path):
    """README: ``jaxpar-train dlrm model=dlrm_criteo_small data.format=criteo
    data.path=day_0.gz``, on 300 random Criteo lines (gzip), shortened to 2 steps of 64
    samples with no evaluation: it trains them, to finite losses."""
    import math

    from test_recsys_data import _lines, _write

    day = _write(tmp_path / "day_0.gz", _lines(300)[0], gz=True)
    history = train(load_config("dlrm", ["model=dlrm_criteo_small", "data.format=criteo", f"data.path={day}",
                                         f"run_dir={tmp_path / 'criteo'}", "steps=2", "eval.every=0"]),
                    progress=False)
    assert [r["step"] for r in history] == [1, 2] and all(math.isfinite(r["loss"]) for r in history)


@pytest.mark.parametrize("sharding", ["replicated", "row_wise"])
def test_a_cache_too_small_for_a_batch_names_the_ratio_that_works(tmp_path, sharding):
    cfg = load_config("dlrm", [f"run_dir={tmp_path / 'run'}", "embedding.cache_ratio=0.0005",
                               f"embedding.sharding={sharding}"])
    with pytest.raises(ValueError, match=r"the smallest cache_ratio that holds it is 0\.00\d+"):
        train(cfg, progress=False)
    assert not (tmp_path / "run").exists()  # nothing written


def _metrics(run) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


@pytest.mark.slow
def test_cache_ratio_auto_sizes_the_cache_from_the_budget(tmp_path, caplog):
    """100 KiB of 68-byte rows (dim 16 and an Adagrad accumulator): 1,505 of the 200,000
    rows; without a budget on a CPU (which does not say its memory), one line."""
    import logging

    cfg = load_config("dlrm", [f"run_dir={tmp_path / 'auto'}", "steps=3", "eval.every=0",
                               "embedding.cache_ratio=auto", "embedding.device_budget=100KiB"])
    with caplog.at_level(logging.INFO, logger="jaxpar.train.recsys"):
        train(cfg, progress=False)
    assert "embedding.cache_ratio=auto: 1505 of 200000 rows" in caplog.text
    cfg = load_config("dlrm", [f"run_dir={tmp_path / 'none'}", "embedding.cache_ratio=auto"])
    with pytest.raises(ValueError, match="embedding.cache_ratio=auto needs embedding.device_budget"):
        train(cfg, progress=False)
    assert not (tmp_path / "none").exists()


def test_the_model_is_made_by_one_program_per_shape_and_seed():
    """``initial_state`` (every ``train`` and ``load_run``) reuses one jitted maker per
    model shape and seed: the same function, so its compiled program, and the same
    values each time."""
    import jax
    import numpy as np

    from jaxpar.train.recsys import _model_maker, initial_state

    cfg = load_config("dlrm")
    first = initial_state(cfg, jax.devices()[0])[2]["table"]
    maker = _model_maker(cfg.model, cfg.seed)
    second = initial_state(cfg, jax.devices()[0])[2]["table"]
    assert _model_maker(cfg.model, cfg.seed) is maker
    np.testing.assert_array_equal(first, second)
    assert first.std() > 0


@pytest.mark.parametrize("sharding, writer", [("replicated", True), ("table_wise", True), ("replicated", False)])
def test_a_save_holds_no_copy_of_the_table(tmp_path, monkeypatch, sharding, writer):
    """A checkpoint of an 8 MiB host table and its Adagrad state, its 1% cache dirty
    (table-wise: a cache per device over its own shard, the rows gathered back to the
    table's order), allocates under a quarter of the table's bytes while it saves
    (numpy reports its allocations to tracemalloc; a save that copied the table and its
    state, orbax copying them again, came to 2.1 times them), and restores to the exact
    table and state. Without the block writer (an orbax whose internals it cannot
    import: ``row_blocks.WRITER`` False) the save copies the table, as before, and
    restores the same."""
    import tracemalloc

    from jaxpar.train import row_blocks

    monkeypatch.setattr(row_blocks, "WRITER", writer)

    import jax.numpy as jnp
    import numpy as np

    from jaxpar.embedding.update import CacheArrays
    from jaxpar.train.checkpoints import Checkpoints
    from jaxpar.train.loop import build_mesh
    from jaxpar.train.recsys import build_tables, save_checkpoint
    from jaxpar.train.recsys_data import recsys_loader

    rows, dim = [16384] * 8, 16
    cfg = load_config("dlrm", [f"model.table_rows=[{','.join(map(str, rows))}]", f"model.embed_dim={dim}",
                               f"embedding.sharding={sharding}", f"mesh.data={1 if sharding == 'replicated' else 4}"])
    rng = np.random.default_rng(0)
    table = rng.standard_normal((sum(rows), dim), dtype=np.float32)
    tables = build_tables(cfg, table, build_mesh(cfg))
    ids = rng.choice(len(table), 200, replace=False)
    tables.prepare(ids)  # resident, then changed on the device alone: the save must flush them
    tables.arrays = CacheArrays(tables.arrays.rows + 1, tables.arrays.state + 1)
    table[ids] += 1
    state = np.full(len(table), tables.optimizer.initial_accumulator, np.float32)
    state[ids] += 1
    params, opt_state = {"w": jnp.arange(6.0)}, {"m": jnp.zeros(6)}
    loader = recsys_loader("synthetic", cfg.model.table_rows, 8, seed=0, eval_steps=1)[0]
    with Checkpoints(tmp_path, keep=1) as checkpoints:
        tracemalloc.start()
        try:
            save_checkpoint(checkpoints, 1, params, opt_state, tables, loader, cfg)
            checkpoints.manager.wait_until_finished()  # the copies' async write too: no thread left allocating
            allocated = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert (allocated < table.nbytes / 4) == writer, f"{allocated} bytes allocated saving a table of {table.nbytes}"
        target = {"params": params, "opt_state": opt_state, "table": np.empty_like(table),
                  "table_state": np.empty_like(state)}
        step, restored, _ = checkpoints.restore_latest(target)
    assert step == 1
    np.testing.assert_array_equal(restored["table"], table)
    np.testing.assert_array_equal(restored["table_state"], state)


@pytest.mark.slow  # two processes on jax.distributed, twice
def test_two_processes_of_two_devices_equal_four_devices_and_resume_after_sigkill(tmp_path):
    """Row-wise tables with a 1% cache on each device over its own shard, as 2
    processes x 2 devices (each process holding its own shards' host rows and caches,
    the slots of the others' computed from the gathered ids): the per-step losses and
    the evaluations of 1 process x 4 devices (1e-5: the dense gradients' all-reduce over
    gloo sums in another order). Both processes are killed (SIGKILL) once a checkpoint
    exists, before the end; started again, they resume from it (each process's rows
    of the table, written by each) and finish, every step logged once."""
    args = ["steps=16", "checkpoint.every=4", "batch_size=32", "eval.every=8", "eval.batches=2",
            "embedding.sharding=row_wise", "embedding.cache_ratio=0.01"]
    single = train(load_config("dlrm", [*args, "mesh.data=4", f"run_dir={tmp_path / 'single'}"]), progress=False)

    run, logs = tmp_path / "two", tmp_path / "two.log"
    args = [*args, f"run_dir={run}"]
    saved = kill_once_saved(train_processes("dlrm", args, logs), run, 4, timeout=300)
    assert saved and saved[-1] < 16, f"killed too late to test a resume: checkpoints {saved}"

    finish(train_processes("dlrm", args, logs), logs, timeout=300)
    assert f"resuming from step {saved[-1]}" in pathlib.Path(f"{logs}.0").read_text()
    two = _metrics(run)
    assert [r["step"] for r in two] == list(range(1, 17))
    for key in ("loss", "val_loss", "val_auc"):
        ours, theirs = ([r[key] for r in h if key in r] for h in (two, single))
        assert len(ours) == len(theirs) > 0 and np.allclose(ours, theirs, rtol=1e-5, atol=0), (key, ours, theirs)


def test_a_split_leaf_is_gathered_whole_where_orbax_has_no_block_writer():
    """``RowBlocks.whole`` of a leaf this process writes in parts (``owned``, as a table
    split over processes is): each block's rows gathered from whoever holds them (here
    one process holding every part; the two-process path is the SIGKILL test's with the
    block writer), the array exactly, across blocks (2 rows: a sixteenth) that cut the
    parts."""
    from jaxpar.train import row_blocks

    assert row_blocks.block_rows((23, 3), np.float32) == 2
    array = np.random.default_rng(0).standard_normal((23, 3)).astype(np.float32)
    leaf = row_blocks.RowBlocks(array.shape, array.dtype, lambda lo, hi: array[lo:hi],
                                owned=((0, 4), (4, 12), (12, 23)), align=4)
    np.testing.assert_array_equal(leaf.whole(), array)

