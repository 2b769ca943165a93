"""Model-parallel embedding tables (jaxpar.embedding.sharded) on 4 simulated devices:
row-wise and table-wise lookups equal ``table[ids]``, training through the all-to-all
exchange equals one device's ``sparse_update`` over the whole batch, the placement owns
every row once and keeps tables whole and balanced, and bad input fails naming the value."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxpar.embedding import (CacheArrays, ShardingPlan, SparseOptimizer, shard_arrays, sharded_lookup,
                              sharded_update, sparse_update, unshard_arrays)

TABLE_ROWS = (300, 1000, 70, 500, 20, 650, 130)  # R = 2670, not a multiple of 4
R, F, D, B, N = sum(TABLE_ROWS), len(TABLE_ROWS), 8, 16, 4  # N devices, B/N = 4 samples each
OFFSETS = np.concatenate([[0], np.cumsum(TABLE_ROWS[:-1])])
LR = 0.01


def mesh_of(axis_type=AxisType.Auto):
    return jax.make_mesh((N,), ("data",), axis_types=(axis_type,), devices=jax.devices()[:N])


def zipf_ids(seed, steps):
    """``steps`` batches ``[B, F]`` of global row ids: feature f's ids Zipf-distributed
    (alpha 1.2) over a random permutation of its table's rows (FBGEMM's generator)."""
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(r) for r in TABLE_ROWS]
    return [np.stack([OFFSETS[f] + perms[f][(rng.zipf(1.2, B) - 1) % TABLE_ROWS[f]] for f in range(F)],
                     axis=1).astype(np.int32) for _ in range(steps)]


def problem(seed):
    rng = np.random.default_rng(seed)
    table = (0.1 * rng.normal(size=(R, D))).astype(np.float32)  # small: the tanh must not saturate
    w = rng.normal(size=(D,)).astype(np.float32)
    ys = [rng.uniform(-0.5, 0.5, size=(B,)).astype(np.float32) for _ in range(10)]
    return table, w, ys, zipf_ids(seed, 10)


def loss_fn(emb, w, y):  # emb [B, F, D]; a per-sample loss, nonlinear in the rows
    return jnp.sum((jnp.tanh(jnp.einsum("BFD,D->B", emb, w)) - y) ** 2)


@functools.partial(jax.jit, static_argnames=("plan", "optimizer", "mesh"), donate_argnums=0)
def sharded_step(arrays, ids, y, w, lr, *, plan, optimizer, mesh):
    emb = sharded_lookup(arrays, ids, plan=plan, mesh=mesh)
    g = jax.grad(loss_fn)(emb, w, y)
    return sharded_update(arrays, ids, g, lr, plan=plan, optimizer=optimizer, mesh=mesh)


@jax.jit
def data_parallel_grads(rows, ids, y, w):  # rows replicated, ids and y split over "data"
    return jax.grad(loss_fn)(rows[ids], w, y)


one_device_update = jax.jit(sparse_update, static_argnames="optimizer", donate_argnums=0)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("kind", ["row", "table"])
def test_the_lookup_equals_the_unsharded_table(kind, axis_type):
    mesh = mesh_of(axis_type)
    plan = ShardingPlan(TABLE_ROWS, N, kind)
    table = np.random.default_rng(1).normal(size=(R, D)).astype(np.float32)
    arrays = shard_arrays(table, plan=plan, mesh=mesh)
    S = plan.shard_rows
    device, local = plan.placement()
    for k, shard in enumerate(sorted(arrays.rows.addressable_shards, key=lambda s: s.index[0].start)):
        assert shard.data.shape == (S, D)  # each device holds its block, nothing more
        np.testing.assert_array_equal(np.asarray(shard.data)[local[device == k]], table[device == k])
    ids = zipf_ids(1, 1)[0]
    emb = jax.jit(functools.partial(sharded_lookup, plan=plan, mesh=mesh))(
        arrays, jax.device_put(ids, NamedSharding(mesh, P("data"))))
    assert emb.shape == (B, F, D) and emb.sharding.spec[0] == "data"
    np.testing.assert_array_equal(np.asarray(emb), table[ids])


# Each kind with each optimizer, each under both axis types, each optimizer under both (a
# Latin square: the optimizer's update, the kind's exchange and the axis type's lookup are
# separate parts; all 8 products checked what these 4 check).
@pytest.mark.parametrize("kind,optimizer,axis_type", [
    ("row", "sgd", AxisType.Explicit), ("row", "adagrad", AxisType.Auto),
    ("table", "sgd", AxisType.Auto), ("table", "adagrad", AxisType.Explicit),
], ids=["row-sgd-explicit", "row-adagrad-auto", "table-sgd-auto", "table-adagrad-explicit"])
def test_training_equals_one_device_over_the_whole_batch(kind, optimizer, axis_type):
    """10 steps against one device running ``sparse_update`` over the whole batch on the
    whole table. Both sides take their row gradients from the same data-parallel program
    (table replicated, batch split over the 4 devices): on one device XLA:CPU reduces each
    sample's 56 products in another order for a [16, 7, 8] block than for [4, 7, 8]
    (gradients 2e-6 apart), which is the dense part's arithmetic, not the table's; the
    dense ``w`` stays fixed for the same reason. The update side is then bit-identical
    with SGD: each owner sums a row's gradients in the global batch's order, as one
    device does. Adagrad comes out bit-identical too (with the suite's XLA:CPU emitters
    and the default ones) but is asserted within 1e-6: its elementwise arithmetic is
    compiled into two different programs, which XLA may fuse and contract into FMAs
    differently. (Today's data-parallel update under Auto axes is not bit-identical to
    one device: the partitioner splits its segment sum by device and adds the partial
    sums, another order.)"""
    mesh = mesh_of(axis_type)
    plan, opt = ShardingPlan(TABLE_ROWS, N, kind), SparseOptimizer(optimizer)
    table, w, ys, batches = problem(seed=7)
    touched = np.unique(np.concatenate(batches))
    # The case the exchange must get right: an id read by several devices' batch shards,
    # and twice within one shard.
    shards = [set(b[k * B // N:(k + 1) * B // N].ravel().tolist()) for b in batches for k in range(N)]
    assert any(len(shards[i] & shards[i + 1]) for i in range(0, len(shards), N))
    assert any(len(s) < B // N * F for s in shards)

    state = np.full(R, opt.initial_accumulator, np.float32) if opt.has_state else None
    dp = mesh_of(AxisType.Auto)  # the reference's gradients: Auto axes let rows[ids] follow the ids
    replicated, split = NamedSharding(dp, P()), NamedSharding(dp, P("data"))
    by_batch = NamedSharding(mesh, P("data"))
    # Copies: a CPU device_put may alias the numpy array, which the donated update would overwrite.
    one = jax.device_put(CacheArrays(table.copy(), None if state is None else state.copy()), jax.devices()[0])
    sharded = shard_arrays(table, state, plan=plan, mesh=mesh)
    for ids, y in zip(batches, ys):
        g = data_parallel_grads(jax.device_put(one.rows, replicated), *jax.device_put((ids, y), split), w)
        one = one_device_update(one, ids, np.asarray(g), LR, optimizer=opt)
        sharded = sharded_step(sharded, *jax.device_put((ids, y), by_batch), w, LR, plan=plan, optimizer=opt,
                               mesh=mesh)
    assert sharded.rows.sharding.spec[0] == "data"
    got, got_state = unshard_arrays(sharded, plan=plan)
    want = np.asarray(one.rows)
    if optimizer == "sgd":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        np.testing.assert_allclose(got_state, np.asarray(one.state), rtol=1e-6)
        assert got_state[touched].min() > 0
    changed = np.flatnonzero((got != table).any(axis=1))
    np.testing.assert_array_equal(changed, touched)  # every touched row moved, no other did
    pad = np.setdiff1d(np.arange(plan.padded_rows), plan.positions(np.arange(R)))
    assert not np.asarray(sharded.rows)[pad].any()  # nothing reaches the padding


@pytest.mark.parametrize("table_rows, n", [(TABLE_ROWS, 4), ((7, 3, 9), 4), ((5,) * 9, 3), ((1, 2, 3, 1000), 2),
                                           ((13,), 8)])
def test_the_placement_owns_every_row_once(table_rows, n):
    for kind in ("row", "table"):
        plan = ShardingPlan(table_rows, n, kind)
        R, S = plan.num_rows, plan.shard_rows
        device, local = plan.placement()
        assert ((0 <= device) & (device < n)).all() and ((0 <= local) & (local < S)).all()
        assert len(np.unique(device.astype(np.int64) * S + local)) == R  # one owner, one place per row
        assert np.bincount(device, minlength=n).tolist() == list(plan.device_rows)
        x = np.random.default_rng(0).normal(size=(R, 3)).astype(np.float32)
        np.testing.assert_array_equal(plan.from_shards(plan.to_shards(x)), x)
        if kind == "row":  # contiguous blocks of ceil(R / n) rows
            assert S == -(-R // n)
            np.testing.assert_array_equal(device, np.arange(R) // S)
            continue
        offsets = np.concatenate([[0], np.cumsum(table_rows[:-1])]).astype(int)
        for f, rows in enumerate(table_rows):  # each table whole on one device, in order
            here = slice(offsets[f], offsets[f] + rows)
            assert (device[here] == plan.table_device[f]).all()
            np.testing.assert_array_equal(np.diff(local[here]), 1)
        # LPT's bound: the fullest device ends at most one table above the emptiest.
        assert max(plan.device_rows) - min(plan.device_rows) <= max(table_rows)


@pytest.mark.parametrize("kind", ["row", "table"])
@pytest.mark.parametrize("table_rows, n", [((7, 3, 9), 4), ((5,) * 9, 3), ((1, 2, 3, 100), 2), ((13,), 8)])
def test_rows_read_from_the_shards_are_the_tables(table_rows, n, kind):
    """``rows_from_shards`` (the blocks a checkpoint reads of a split host table, never
    joining the shards): ``from_shards``'s rows for every block, across tables and
    shards, of every size up to the whole; out of range, one line."""
    plan = ShardingPlan(table_rows, n, kind)
    R, S = plan.num_rows, plan.shard_rows
    x = np.random.default_rng(0).normal(size=(R, 3)).astype(np.float32)
    joined = plan.to_shards(x)
    shards = [joined[k * S:(k + 1) * S] for k in range(n)]
    for size in sorted({0, 1, 2, S - 1, S, S + 1, R} & set(range(R + 1))):
        for lo in range(R - size + 1):
            np.testing.assert_array_equal(plan.rows_from_shards(shards, lo, lo + size), x[lo:lo + size])
    with pytest.raises(ValueError, match=rf"rows 2\.\.{R + 1}: expected 0 <= lo <= hi <= {R}"):
        plan.rows_from_shards(shards, 2, R + 1)
    with pytest.raises(ValueError, match=rf"expected {n} of {S} rows"):
        plan.rows_from_shards(shards[1:], 0, 1)


def test_table_wise_places_largest_first_on_the_emptiest_device():
    plan = ShardingPlan(TABLE_ROWS, N, "table")
    # 1000 -> 0, 650 -> 1, 500 -> 2, 300 -> 3, 130 -> 3 (430), 70 -> 3 (500), 20 -> 2 (500, lower index)
    assert plan.table_device == (3, 0, 3, 2, 2, 1, 3)
    assert plan.device_rows == (1000, 650, 520, 500) and plan.shard_rows == 1000


def test_out_of_range_ids_inside_jit_read_zeros_and_update_nothing():
    mesh = mesh_of()
    plan, opt = ShardingPlan(TABLE_ROWS, N, "row"), SparseOptimizer("sgd")
    table = np.random.default_rng(2).normal(size=(R, D)).astype(np.float32)
    ids = zipf_ids(2, 1)[0]
    ids[0, 0], ids[5, 1] = R, -1
    arrays = shard_arrays(table, plan=plan, mesh=mesh)
    emb = jax.jit(functools.partial(sharded_lookup, plan=plan, mesh=mesh))(arrays, ids)
    want = table[np.clip(ids, 0, R - 1)]
    want[0, 0] = want[5, 1] = 0
    np.testing.assert_array_equal(np.asarray(emb), want)
    new = jax.jit(functools.partial(sharded_update, plan=plan, optimizer=opt, mesh=mesh))(
        arrays, ids, np.ones((B, F, D), np.float32), LR)
    changed = np.flatnonzero((unshard_arrays(new, plan=plan)[0] != table).any(axis=1))
    np.testing.assert_array_equal(changed, np.unique(ids[(ids >= 0) & (ids < R)]))


@pytest.mark.parametrize("args, message", [
    (((), 4), r"table_rows=\(\): expected a non-empty tuple"),
    (((10, 0), 4), r"table_rows=\(10, 0\)"),
    (((10,), 0), r"num_shards=0"),
    (((10,), 2, "column"), r"kind='column'"),
    (((2**30, 2**30), 4), r"table_rows sum to 2147483648"),
])
def test_a_bad_plan_fails_naming_the_value(args, message):
    with pytest.raises(ValueError, match=message):
        ShardingPlan(*args)


def test_bad_lookups_fail_naming_the_value():
    mesh = mesh_of()
    plan = ShardingPlan(TABLE_ROWS, N, "table")
    table = np.zeros((R, D), np.float32)
    arrays = shard_arrays(table, plan=plan, mesh=mesh)
    ids = zipf_ids(3, 1)[0]
    lookup = functools.partial(sharded_lookup, plan=plan, mesh=mesh)
    with pytest.raises(ValueError, match=r"axis='model' is not an axis of the mesh \(its axes: \('data',\)\)"):
        sharded_lookup(arrays, ids, plan=plan, mesh=mesh, axis="model")
    with pytest.raises(ValueError, match=r"mesh axis 'data' has 4 devices but the plan has num_shards=2"):
        sharded_lookup(arrays, ids, plan=ShardingPlan(TABLE_ROWS, 2, "table"), mesh=mesh)
    for bad in (R, -1):
        wrong = ids.copy()
        wrong[3, 2] = bad
        with pytest.raises(ValueError, match=rf"row id {bad} outside \[0, num_rows=2670\)"):
            lookup(arrays, wrong)
    with pytest.raises(ValueError, match=r"arrays.rows.shape=\(2670, 8\): expected \(4000, D\)"):
        lookup(CacheArrays(jnp.asarray(table), None), ids)
    with pytest.raises(ValueError, match=r"ids.shape=\(6, 7\): the batch \(dim 0\) must split evenly"):
        lookup(arrays, ids[:6])
    with pytest.raises(ValueError, match=r"x.shape=\(100, 8\): expected 2670 rows"):
        plan.to_shards(table[:100])
    with pytest.raises(ValueError, match=r"grads.shape=\(16, 7\)"):
        sharded_update(arrays, ids, np.zeros((B, F), np.float32), LR, plan=plan, optimizer=SparseOptimizer("sgd"),
                       mesh=mesh)


@pytest.mark.parametrize("kind", ["row", "table"])
@pytest.mark.slow
def test_a_cache_per_device_trains_the_split_table(kind):
    """``ShardedCache`` (each device caching 5% of its own shard, evicting every step once
    full) against the uncached split table (``DeviceTable`` with the plan): the same
    rows looked up, and the same table after 10 SGD steps, bit for bit."""
    from jaxpar.embedding import DeviceTable, ShardedCache

    mesh = mesh_of()
    table, w, ys, batches = problem(3)
    plan = ShardingPlan(TABLE_ROWS, N, kind)
    sgd = SparseOptimizer("sgd")
    cache = ShardedCache(table, 40, plan=plan, mesh=mesh, optimizer=sgd)
    whole = DeviceTable(table, optimizer=sgd, plan=plan, mesh=mesh)

    def program(tables):
        """One jitted step per table, traced once (a function made afresh each step would
        be traced and lowered again at every step)."""
        @jax.jit
        def run(arrays, slots, y):
            emb = tables.lookup(arrays, slots)
            loss, g = jax.value_and_grad(loss_fn)(emb, w, y)
            return loss, tables.update(arrays, slots, g, LR)

        return run

    programs = {id(tables): program(tables) for tables in (cache, whole)}

    def step(tables, ids, y):
        slots = tables.prepare(ids)
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
        loss, tables.arrays = programs[id(tables)](tables.arrays, put(slots), put(y))
        return float(loss)

    evictions = []
    for ids, y in zip(batches, ys):
        assert step(cache, ids, y) == step(whole, ids, y)
        evictions.append(cache.last_step.evictions)
        np.testing.assert_array_equal(cache.rows_of(ids), whole.rows_of(ids))
    assert sum(evictions[3:]) > 0, evictions
    np.testing.assert_array_equal(cache.table(), whole.table())
    cache.close()
