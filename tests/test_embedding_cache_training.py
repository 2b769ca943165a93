"""``jaxpar-train dlrm`` through the embedding cache against the whole table on the
device (issue 37: bit for bit with SGD, within 1e-6 with row-wise Adagrad), end to end
through ``train()``: the cached and uncached steps are two programs (a [C, D] cache,
a [R, D] table) that must round alike (tests/conftest.py on the emitters)."""

import shutil

import jax
import numpy as np
import pytest

from jaxpar.train.config import load_config
from jaxpar.train.loop import train
from jaxpar.train.recsys import load_run

pytestmark = pytest.mark.slow  # end-to-end runs, as tests/test_train.py


# The dlrm preset's tables at a fifth of their rows (40,000 in all), and 8 samples a
# step (two a device): the table's init, updates and checkpoints cost a fifth, fewer
# misses a step need fewer of the cache's padded transfer programs (sizes), and 1% of
# the rows (400) still fills within a few steps of the warm-up and then evicts every
# step. On 4 of the 8 simulated devices (build_mesh takes the first 4), as the split
# tables of test_tables_split_over_four_devices: a save of replicated arrays has orbax
# slice each into one piece per replica, a program per piece and device (32 on these 4
# devices, 64 on all 8), which every run here then shares.
SHAPE = ["model.table_rows=[2000,4000,6000,10000,2000,8000,5000,3000]", "batch_size=8", "mesh.data=4"]
STEPS, EVERY = 12, 4  # cached_sgd saves at 4, 8 and 12; the resumed run starts from 8


def run(tmp_path, name, *overrides, steps=STEPS, every=0):
    """A ``dlrm`` run on 4 devices (unless ``overrides`` set ``mesh.data``): ``(losses,
    checkpointed state, history)``. It saves at its last step (what ``load_run``
    reads), and every ``every`` steps."""
    cfg = load_config("dlrm", [*SHAPE, f"run_dir={tmp_path / name}", f"steps={steps}", "eval.every=0",
                               f"checkpoint.every={every}", *overrides])
    history = train(cfg, progress=False)
    return [r["loss"] for r in history], load_run(tmp_path / name)[2], history


@pytest.fixture(scope="module")
def uncached(tmp_path_factory):
    """The reference: the whole table on the device, one run per sparse optimizer."""
    tmp = tmp_path_factory.mktemp("uncached")
    return {kind: run(tmp, kind, "embedding.cache_ratio=null", f"embedding.optimizer={kind}")
            for kind in ("sgd", "adagrad")}


@pytest.fixture(scope="module")
def cached_sgd(tmp_path_factory):
    """1% of the rows cached, SGD: ``(run(...), its run dir)``, for the two tests that
    check it (one run, not one each)."""
    tmp = tmp_path_factory.mktemp("cached_sgd")
    return run(tmp, "cached", "embedding.optimizer=sgd", every=EVERY), tmp / "cached"


def leaves(state) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def assert_same(state, reference, *, exact: bool, rtol: float = 1e-6):
    got, want = leaves(state), leaves(reference)
    assert got.keys() == want.keys()
    for key in want:
        if exact:
            assert np.array_equal(got[key], want[key]), key
        else:
            scale = max(float(np.abs(want[key]).max()), 1e-30)
            assert float(np.abs(got[key] - want[key]).max()) <= rtol * scale, key


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_the_cache_trains_the_uncached_model(tmp_path, request, uncached, kind):
    """1% of the rows cached: once the warmed-up cache is full, every step evicts. The
    same losses, dense weights and their optimizer state, table and table state."""
    if kind == "sgd":
        losses, state, history = request.getfixturevalue("cached_sgd")[0]
    else:
        losses, state, history = run(tmp_path, "cached", f"embedding.optimizer={kind}")
    evicting = [r["evictions"] > 0 for r in history]
    assert any(evicting) and all(evicting[evicting.index(True):]), evicting
    ref_losses, ref_state, _ = uncached[kind]
    if kind == "sgd":
        assert losses == ref_losses
    else:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_same(state, ref_state, exact=kind == "sgd")


def test_everything_cached_is_the_uncached_model(tmp_path, uncached):
    losses, state, history = run(tmp_path, "all", "embedding.cache_ratio=1", "embedding.optimizer=sgd")
    assert not any(r["evictions"] for r in history)  # room for every row: only first-use misses
    assert losses == uncached["sgd"][0]
    assert_same(state, uncached["sgd"][1], exact=True)


def test_resumed_on_another_cache_continues_exactly(tmp_path, uncached, cached_sgd):
    """Step 8's checkpoint of a run with 1% cached under LFU, resumed on a fresh cache
    of 1% under LRU, which its warm-up fills otherwise and whose misses load rows: the
    uninterrupted run's next losses and final state. (The cache shape of the run it
    resumes: its step program, compiled once. A cache of 5% held every row of these 4
    steps from its warm-up on, and never missed.)"""
    start = STEPS - EVERY
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(cached_sgd[1] / "checkpoints" / str(start), tmp_path / "resumed" / "checkpoints" / str(start))
    rest, state, history = run(tmp_path, "resumed", "embedding.optimizer=sgd", "embedding.eviction=lru")
    assert any(r["h2d_bytes"] for r in history), history
    assert len(rest) == EVERY and rest == uncached["sgd"][0][start:]
    assert_same(state, uncached["sgd"][1], exact=True)


def test_tables_split_over_four_devices(tmp_path):
    """The table split row-wise and table-wise over 4 devices (lookups and updates by
    all-to-all), without a cache and with one per device over its own shard (100 rows
    each, evicting every step once full): the same losses and table all four ways, bit
    for bit with SGD (each owner sums a row's gradients in the global batch's order),
    and one device's within float32 rounding (the MLPs' gradients are summed over 4
    devices there)."""
    uncached = ["embedding.cache_ratio=null"]
    # 100 rows a device both ways (1% of a row-wise shard of 10,000 rows, 0.9% of the
    # largest table-wise one, 11,000): the two cached steps are one program (the joined
    # caches [4 * 100, D]), compiled once, where cache_ratio=0.01 would make them 100
    # and 110 rows, two programs. 6400 bytes: 100 rows of 16 float32s (SGD: no state).
    cached = ["embedding.cache_ratio=auto", "embedding.device_budget=6400B"]
    runs = {}
    for name, devices, extra in (("row", 4, ["embedding.sharding=row_wise", *uncached]),
                                 ("table", 4, ["embedding.sharding=table_wise", *uncached]),
                                 ("row cached", 4, ["embedding.sharding=row_wise", *cached]),
                                 ("table cached", 4, ["embedding.sharding=table_wise", *cached]),
                                 ("one", 1, uncached)):
        # in this process: mesh.data=N takes the first N of its 8 devices (build_mesh), as
        # a process of N devices would, without a process start and import per run
        runs[name] = run(tmp_path, name.replace(" ", "_"), f"mesh.data={devices}", "embedding.optimizer=sgd", *extra)
    for name in ("row cached", "table cached"):
        evicting = [r["evictions"] > 0 for r in runs[name][2]]
        assert any(evicting) and all(evicting[evicting.index(True):]), (name, evicting)
    for name in ("table", "row cached", "table cached"):
        assert runs[name][0] == runs["row"][0], name
        assert_same(runs[name][1], runs["row"][1], exact=True)
    np.testing.assert_allclose(runs["row"][0], runs["one"][0], rtol=1e-5)
    assert_same(runs["row"][1], runs["one"][1], exact=False, rtol=1e-5)
