"""The embedding cache (jaxpar.embedding): training through it equals a dense table, its
maps and eviction obey their invariants against a brute-force replay, LFU and LRU evict
what a hand count says, warm-up loads the hottest ids, prefetch changes nothing but
timing and keeps memory bounded, and bad sizes fail with one clear line."""

import functools
import gc
import random
import threading
import time
import tracemalloc
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxpar.embedding import EmbeddingCache, SparseOptimizer, sparse_update
from jaxpar.embedding.policy import choose_victims

R, D, B, F = 4000, 8, 8, 3  # rows, dim, batch, features per sample
LR = 0.05


def zipf_ids(seed, steps, shape, num_rows=R, alpha=1.05):
    """Zipf-distributed ids over a random permutation of the rows (FBGEMM's generator)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_rows)
    return [perm[(rng.zipf(alpha, shape) - 1) % num_rows] for _ in range(steps)]


def model_loss(w, emb, y):  # emb [B, F, D]
    return jnp.sum((emb.mean(axis=1) @ w - y) ** 2)


@functools.partial(jax.jit, static_argnames="optimizer", donate_argnums=1)
def cached_step(w, arrays, slots, y, lr, optimizer):
    emb = arrays.rows[slots]
    loss, (g_w, g_emb) = jax.value_and_grad(model_loss, argnums=(0, 1))(w, emb, y)
    return loss, w - lr * g_w, sparse_update(arrays, slots, g_emb, lr, optimizer=optimizer)


@jax.jit
def dense_grads(w, table, ids, y):
    """The reference: the gradient of the whole table, as if there were no cache."""
    return jax.value_and_grad(lambda w, t: model_loss(w, t[ids], y), argnums=(0, 1))(w, table)


def problem(seed=0, steps=30):
    rng = np.random.default_rng(seed)
    table = rng.normal(0, 0.5, (R, D)).astype(np.float32)
    w = rng.normal(0, 1, (D,)).astype(np.float32)
    ys = [rng.normal(0, 1, (B,)).astype(np.float32) for _ in range(steps)]
    return table, w, ys, zipf_ids(seed + 1, steps + 3, (B, F))


def run_dense(kind, table, w, ys, batches):
    """A dense table and the same sparse optimizer on touched rows, in numpy."""
    table, acc, w = table.copy(), np.zeros(R, np.float32), jnp.asarray(w)
    losses = []
    for ids, y in zip(batches, ys):
        loss, (g_w, g_t) = dense_grads(w, table, ids, y)
        touched, g = np.unique(ids), np.asarray(g_t)[np.unique(ids)]
        if kind == "sgd":
            table[touched] = table[touched] - np.float32(LR) * g
        else:
            acc[touched] += np.mean(g * g, axis=-1)
            table[touched] = table[touched] - np.float32(LR) * g / (np.sqrt(acc[touched])[:, None] + np.float32(1e-8))
        w = w - LR * g_w
        losses.append(float(loss))
    return table, np.asarray(w), losses


def run_cached(cache, w, ys, batches, prefetch=0, warm=None):
    """Train through ``cache``; returns (table, w, losses, per-step stats)."""
    if warm is not None:
        cache.warmup(warm, ratio=1.0)
    w, losses, stats = jnp.asarray(w), [], []
    for t, y in enumerate(ys):
        slots = cache.prepare(batches[t], upcoming=batches[t + 1: t + 1 + prefetch])
        stats.append(cache.last_step)
        loss, w, cache.arrays = cached_step(w, cache.arrays, slots, y, LR, cache.optimizer)
        losses.append(float(loss))
    return np.array(cache.table()), np.asarray(w), losses, stats


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
@pytest.mark.parametrize("ratio", [0.01, 1.0])
def test_training_through_the_cache_equals_a_dense_table(kind, ratio):
    table, w, ys, batches = problem()
    cache = EmbeddingCache.from_ratio(R, D, ratio, optimizer=SparseOptimizer(kind), table=table)
    # The warm-up fills the 1% cache, so every step below has to evict.
    got_table, got_w, got_losses, stats = run_cached(cache, w, ys, batches, warm=np.concatenate(zipf_ids(9, 20, 16)))
    want_table, want_w, want_losses = run_dense(kind, table, w, ys, batches[: len(ys)])
    assert not np.array_equal(want_table, table)
    if ratio < 1:
        assert cache.cache_rows == 40 and all(s.evictions > 0 for s in stats), [s.evictions for s in stats]
    else:
        assert sum(s.evictions for s in stats) == 0
    if kind == "sgd":
        np.testing.assert_array_equal(got_losses, want_losses)
        np.testing.assert_array_equal(got_table, want_table)
        np.testing.assert_array_equal(got_w, want_w)
    else:
        # numpy's float32 mean and XLA's sum in different orders: relative to each
        # array's scale, so an entry that cancels to near zero is not held to 1e-6 of itself.
        for got, want in [(got_losses, want_losses), (got_table, want_table), (got_w, want_w)]:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_a_checkpoint_of_a_dirty_cache_resumes_exactly():
    table, w, ys, batches = problem(seed=3, steps=16)
    whole = EmbeddingCache.from_ratio(R, D, 0.01, optimizer=SparseOptimizer("adagrad"), table=table)
    want = run_cached(whole, w, ys, batches)
    first = EmbeddingCache.from_ratio(R, D, 0.01, optimizer=SparseOptimizer("adagrad"), table=table)
    _, w_mid, _, _ = run_cached(first, w, ys[:8], batches)
    saved = np.array(first.table()), np.array(first.optimizer_state())
    assert saved[1].max() > 0
    resumed = EmbeddingCache.from_ratio(R, D, 0.01, optimizer=SparseOptimizer("adagrad"), eviction="lru")
    resumed.load(*saved)
    got = run_cached(resumed, w_mid, ys[8:], batches[8:])
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[2], want[2][8:])


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_the_update_under_a_data_parallel_mesh_equals_one_device(axis_type):
    """The batch sharded over 4 devices and the cache replicated, as a data-parallel
    DLRM step has them: the same rows as on one device, bit for bit."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:4])
    rng = np.random.default_rng(17)
    ids = zipf_ids(17, 1, (8, 5), num_rows=1000)[0]
    grads = rng.normal(size=(8, 5, D)).astype(np.float32)
    want = None
    for place in [False, True]:
        cache = EmbeddingCache.from_ratio(1000, D, 0.05, optimizer=SparseOptimizer("adagrad"),
                                          device=NamedSharding(mesh, P()) if place else None)
        slots = cache.prepare(ids)
        args = slots, grads
        if place:
            args = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in args]
        update = jax.jit(functools.partial(sparse_update, optimizer=cache.optimizer), donate_argnums=0)
        cache.arrays = update(cache.arrays, *args, 0.1)
        got = np.array(cache.table()), np.array(cache.optimizer_state())
        want = got if want is None else want
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert cache.arrays.rows.sharding.is_fully_replicated and want[1].max() > 0


class Replay:
    """The cache's policy, written plainly: dicts and a sort."""

    def __init__(self, cache_rows, policy):
        self.cache_rows, self.policy = cache_rows, policy
        self.last_used, self.count, self.step = {}, defaultdict(int), 0

    def __call__(self, ids, soon):
        self.step += 1
        batch = sorted(set(ids.ravel().tolist()))
        for i in ids.ravel().tolist():
            self.count[i] += 1
        hits = [i for i in batch if i in self.last_used]
        need = len(self.last_used) + len(batch) - len(hits) - self.cache_rows
        rank = {"lfu": lambda i: (i in soon, self.count[i], self.last_used[i], i),
                "lru": lambda i: (i in soon, self.last_used[i], i)}[self.policy]
        evicted = sorted((i for i in self.last_used if i not in batch), key=rank)[: max(need, 0)]
        for i in evicted:
            del self.last_used[i]
        for i in batch:
            self.last_used[i] = self.step
        return len(hits), len(batch) - len(hits), set(evicted)


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_invariants_and_a_brute_force_replay(policy):
    batches = zipf_ids(5, 60, (4, 3))
    table = np.random.default_rng(5).normal(size=(R, D)).astype(np.float32)
    cache = EmbeddingCache.from_ratio(R, D, 0.01, eviction=policy, prefetch=2, table=table,
                                      optimizer=SparseOptimizer("sgd"))
    replay = Replay(cache.cache_rows, policy)
    evictions = 0
    for t in range(len(batches) - 2):
        ids, upcoming = batches[t], batches[t + 1: t + 3]
        soon = set(np.concatenate(upcoming).ravel().tolist())
        before = set(cache.slot_to_id[cache.slot_to_id >= 0].tolist())
        slots = cache.prepare(ids, upcoming=upcoming)
        s2i, i2s = cache.slot_to_id, cache.id_to_slot
        resident = s2i[s2i >= 0]
        after = set(resident.tolist())
        assert slots.shape == ids.shape and slots.dtype == np.int32
        np.testing.assert_array_equal(s2i[slots], ids)  # every id of the batch is resident
        assert len(after) == len(resident)  # no id in two slots
        np.testing.assert_array_equal(i2s[resident], np.flatnonzero(s2i >= 0))  # the maps agree
        assert (i2s >= 0).sum() == len(resident)
        # The rows went out and came back unchanged (nothing trains here).
        np.testing.assert_array_equal(np.asarray(cache.arrays.rows)[slots], table[ids])
        evicted = before - after
        assert not evicted & set(ids.ravel().tolist()) and not evicted & soon
        hits, misses, want_evicted = replay(ids, soon)
        assert (cache.last_step.hits, cache.last_step.misses) == (hits, misses)
        assert evicted == want_evicted and cache.last_step.evictions == len(evicted)
        assert cache.last_step.h2d_bytes == misses * D * 4 and cache.last_step.d2h_bytes == len(evicted) * D * 4
        evictions += len(evicted)
    assert evictions > 100 and 0 < cache.total.hit_rate < 1
    cache.close()


def test_upcoming_ids_are_evicted_last_and_the_batch_never():
    keys = (np.array([0, 1, 2, 3, 4]), np.arange(5))
    protected = np.array([True, False, False, False, False])
    soft = np.array([False, True, False, False, False])
    assert sorted(choose_victims(keys, 2, protected, soft)) == [2, 3]
    assert sorted(choose_victims(keys, 4, protected, soft)) == [1, 2, 3, 4]


@pytest.mark.parametrize("policy, evicted", [("lfu", 3), ("lru", 1)])
def test_lfu_and_lru_evict_what_a_hand_count_says(policy, evicted):
    cache = EmbeddingCache(10, 4, 3, eviction=policy)
    # Id 1 read three times at step 1, id 2 at steps 1 and 3, id 3 once at step 2: the
    # least frequent is 3, the least recently used is 1.
    for ids in ([1, 1, 1, 2], [3], [2]):
        cache.prepare(np.array(ids))
    cache.prepare(np.array([4]))
    assert set(cache.slot_to_id.tolist()) == {1, 2, 3, 4} - {evicted}


def test_warmup_loads_the_hottest_ids():
    sample = np.concatenate(zipf_ids(7, 50, 40, num_rows=1000))
    counts = np.bincount(sample, minlength=1000)
    hottest = sorted(range(1000), key=lambda i: (-counts[i], i))[:100]
    warm = EmbeddingCache.from_ratio(1000, D, 0.1)
    assert warm.warmup(sample, ratio=1.0) == 100
    assert set(warm.slot_to_id.tolist()) == set(hottest)
    half = EmbeddingCache.from_ratio(1000, D, 0.1)
    assert half.warmup(counts=counts, ratio=0.5) == 50
    assert set(half.slot_to_id[half.slot_to_id >= 0].tolist()) == set(hottest[:50])
    cold = EmbeddingCache.from_ratio(1000, D, 0.1)
    batch = zipf_ids(7, 51, 40, num_rows=1000)[-1]  # same distribution, not in the sample
    warm.prepare(batch)
    cold.prepare(batch)
    assert warm.last_step.hits == len(set(batch.tolist()) & set(hottest)) > 0 == cold.last_step.hits
    assert warm.last_step.hit_rate > cold.last_step.hit_rate


def test_prefetch_changes_nothing_but_timing():
    table, w, ys, batches = problem(seed=11)
    runs = {}
    for name, prefetch in [("off", 0), ("on", 2), ("slow", 2)]:
        cache = EmbeddingCache.from_ratio(R, D, 0.01, optimizer=SparseOptimizer("sgd"), table=table, prefetch=prefetch)
        if name == "slow":  # the thread finishes late, at random: the results must not care
            gather, jitter = cache.store.gather, random.Random(0)
            def slow_gather(ids):
                time.sleep(jitter.uniform(0, 0.004))
                return gather(ids)
            cache.store.gather = slow_gather
        runs[name] = run_cached(cache, w, ys, batches, prefetch=prefetch)
        cache.close()
    for name in ("on", "slow"):
        np.testing.assert_array_equal(runs[name][0], runs["off"][0])
        np.testing.assert_array_equal(runs[name][2], runs["off"][2])
    assert runs["on"][3] == runs["slow"][3]
    assert sum(s.prefetched for s in runs["on"][3]) > 0 == sum(s.prefetched for s in runs["off"][3])


@pytest.mark.slow
def test_prefetch_memory_stays_bounded_over_1000_steps():
    batches = zipf_ids(13, 1003, (4, 2), num_rows=2000)
    cache = EmbeddingCache.from_ratio(2000, D, 0.02, prefetch=3)

    def steps(lo, hi):
        for t in range(lo, hi):
            cache.prepare(batches[t], upcoming=batches[t + 1: t + 4])
            assert cache._prefetcher.pending <= 1 and cache.staged_rows <= 3 * 8

    steps(0, 100)
    threads = threading.active_count()
    gc.collect()
    objects = len(gc.get_objects())
    tracemalloc.start()
    steps(100, 1000)
    gc.collect()
    grown, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(gc.get_objects()) - objects < 100
    assert grown < 64 * 1024, grown
    assert threading.active_count() <= threads  # (an earlier test's thread may end meanwhile)
    assert cache.total.prefetched > 0 and cache.total.evictions > 0
    cache.close()


@pytest.mark.parametrize("ratio", [0, 1.5, -0.1])
def test_a_cache_ratio_outside_0_1_is_refused(ratio):
    with pytest.raises(ValueError, match=rf"cache_ratio={ratio}\b.*\(0, 1\]"):
        EmbeddingCache.from_ratio(1000, D, ratio)


def test_a_batch_larger_than_the_cache_names_the_ratio_that_fits():
    cache = EmbeddingCache.from_ratio(1000, D, 0.01)  # 10 rows
    ids = np.arange(50).reshape(5, 10) % 25  # 25 unique ids
    with pytest.raises(ValueError) as error:
        cache.prepare(ids)
    message = str(error.value)
    assert "\n" not in message and "25 unique ids" in message
    assert "cache_ratio that holds this batch is 0.025" in message
    assert EmbeddingCache.from_ratio(1000, D, 0.025).prepare(ids).shape == ids.shape


def test_other_bad_input_is_refused():
    cache = EmbeddingCache.from_ratio(1000, D, 0.1, prefetch=1)
    with pytest.raises(ValueError, match="row id 1000 outside"):
        cache.prepare(np.array([3, 1000]))
    with pytest.raises(ValueError, match="row id -2 outside"):
        cache.prepare(np.array([3]), upcoming=[np.array([-2])])
    with pytest.raises(ValueError, match="2 upcoming batches given, but prefetch=1"):
        cache.prepare(np.array([3]), upcoming=[np.array([1]), np.array([2])])
    with pytest.raises(ValueError, match="eviction='fifo'"):
        EmbeddingCache(1000, D, 10, eviction="fifo")
    cache.close()
