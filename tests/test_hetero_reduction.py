"""Adasum and DCT's top-k exchange as collectives over the data axis inside the train step
(jaxpar.hetero.reduction), against per-replica gradients computed on one device.

The steps' optimizer records the reduced gradient it is given (its state) and updates
nothing, so the parameters stay put and each step's gradient can be checked exactly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from conftest import adasum_reference, random_init, tree_rel_err
from jaxpar.hetero.reduction import Reduction
from jaxpar.models import ModelConfig, Transformer
from jaxpar.placement.execution import OffloadOptions
from jaxpar.profiler import profile
from jaxpar.train.config import ConfigError, load_config
from jaxpar.train.step import loss_fn, make_train_step

CFG = ModelConfig(vocab_size=128, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=64)
B, T = 8, 16


def recorder() -> optax.GradientTransformation:
    """Keeps the gradient it is given as its state; updates nothing."""
    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


@pytest.fixture(scope="module")
def model():
    return random_init(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), np.random.default_rng(0))


@pytest.fixture(scope="module")
def steps(model):
    """``steps(reduction, grad_accum=1, axis_types="auto", **mesh)``: the recording step,
    built and compiled once per module."""
    cache = {}

    def get(reduction, grad_accum=1, axis_types="auto", **axes):
        key = (reduction, grad_accum, axis_types, tuple(sorted(axes.items())))
        if key not in cache:
            devices = jax.devices()[:int(np.prod(list(axes.values())))]
            mesh = jaxpar.make_mesh(**axes, devices=devices, axis_types=axis_types)
            cache[key] = make_train_step(model, recorder(), mesh, donate=False, grad_accum=grad_accum,
                                         reduction=reduction)
        return cache[key]

    return get


def batch_of(seed):
    """Every key the loader gives (``BATCH_KEYS``, one document a row): the steps' programs
    are then the ones ``TrainStep.compile`` lowers, which the profiler test finds compiled."""
    rng = np.random.default_rng(seed)
    batch = {k: jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32) for k in ("inputs", "targets")}
    return {**batch, "mask": jnp.ones((B, T), jnp.int32), "segment_ids": jnp.ones((B, T), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))}


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grad(graphdef, params, batch):
    return jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)


# The references below are computed in numpy (Adasum's: conftest.adasum_reference), or
# jitted once: eager jnp ops on a model's gradients compile one small program per op and
# leaf shape (dozens a test).


def replica_grads(model, batch, n):
    """Each of ``n`` replicas' ``(loss, grads)`` on its rows (replica ``r``: rows
    ``r B / n ..``, as the batch is split over ``data``), on one device, stacked ``[n, ...]``
    (numpy arrays)."""
    graphdef, params = nnx.split(model)
    rows = B // n
    host = {k: np.asarray(v) for k, v in batch.items()}
    out = [_value_and_grad(graphdef, params, {k: v[r * rows:(r + 1) * rows] for k, v in host.items()})
           for r in range(n)]
    return jax.tree.map(lambda *x: np.stack([np.asarray(a) for a in x]), *out)


def run(step, model, batches):
    """The recorded gradients of one step per batch, the last metrics and optimizer state."""
    params, opt_state = step.init(model)
    recorded = []
    for batch in batches:
        params, opt_state, metrics = step(params, opt_state, batch)
        # with dct_topk the state is (carried, the recorder's); the recorder's alone otherwise
        recorded.append(opt_state[1] if isinstance(opt_state, tuple) else opt_state)
    return recorded, metrics, opt_state


@pytest.mark.slow
def test_adasum_is_the_tree_of_the_replicas_gradients(steps, model, n=4):
    """Four replicas: two levels of the recursive doubling (two replicas, one level, in
    every Adasum cell of tests/test_combinations_train.py)."""
    batch = batch_of(n)
    (got,), metrics, _ = run(steps(Reduction("adasum"), data=n), model, [batch])
    losses, grads = replica_grads(model, batch, n)
    assert tree_rel_err(got, adasum_reference(grads)) < 1e-5
    assert tree_rel_err(got, jax.tree.map(lambda g: g.mean(0), grads)) > 0.1  # not the mean
    np.testing.assert_allclose(metrics["loss"], losses.mean(), rtol=1e-5)


DCT = Reduction("mean", "dct_topk", ratio=0.1, threshold_every=2)


def test_dct_sends_few_and_carries_the_rest(steps, model, n=4):
    """Three steps (a fresh threshold, a stale one, a fresh one) with the parameters held
    still, on data=4 (test_profiler_counts_the_sparse_exchange's step): what was sent
    plus what the replicas still carry is the sum of their raw gradients' means; each
    step sends at most ``k`` entries per replica and leaf."""
    batches = [batch_of(20 + i) for i in range(3)]
    step = steps(DCT, data=n)
    recorded, _, state = run(step, model, batches)
    raw = [replica_grads(model, b, n)[1] for b in batches]
    sent_and_carried = jax.tree.map(lambda *x: sum(np.asarray(a) for a in x[:-1]) + np.asarray(x[-1]).mean(0),
                                    *recorded, state[0].residual)
    assert tree_rel_err(sent_and_carried, jax.tree.map(lambda *g: sum(x.mean(0) for x in g), *raw)) < 1e-5
    for g, r in zip(jax.tree.leaves(recorded[1]), jax.tree.leaves(state[0].residual)):
        assert np.count_nonzero(np.asarray(g)) <= n * int(np.ceil(0.1 * g.size))
        assert r.shape == (n, *g.shape)
    assert sum(np.count_nonzero(np.asarray(r)) for r in jax.tree.leaves(state[0].residual)) > 0
    assert int(state[0].count) == 3
    # the carried state is the optimizer state's, split over data (a checkpoint holds it)
    spec = jax.tree.leaves(step.opt_sharding[0].residual)[0].spec
    assert spec[0] == "data"


@pytest.mark.slow
def test_adasum_composes_with_fsdp_and_grad_accum_on_an_explicit_mesh(steps, model, axis_types="explicit"):
    """data=2 x fsdp=2 on Explicit axes (Auto: tests/test_combinations_train.py), two
    microbatches per replica: each replica accumulates its rows'
    gradient, then the two reduce once; FSDP's devices within a replica take the mean."""
    batch = batch_of(30)
    (got,), _, _ = run(steps(Reduction("adasum"), grad_accum=2, axis_types=axis_types, data=2, fsdp=2),
                       model, [batch])
    assert tree_rel_err(got, adasum_reference(replica_grads(model, batch, 2)[1])) < 1e-5


@pytest.mark.slow
def test_profiler_counts_the_sparse_exchange(steps, model):
    """data=4: the mean all-reduces every gradient; dct_topk at 0.1 all-gathers 8 bytes
    (f32 value, int32 index) per kept entry from each of the 3 others, and all-reduces
    the loss; Adasum sends the whole gradient at each of its log2(4) levels. The
    module's recording steps: the optimizer, elementwise on replicated state, adds no
    collective (the profile counts the gradients' exchange alone)."""
    sizes = [x.size for x in jax.tree.leaves(nnx.state(model))]

    def collectives(reduction):
        return profile(steps(reduction, data=4).compile(model, B, T))

    mean, dct = collectives(None), collectives(DCT)  # DCT: test_dct_sends_few_and_carries_the_rest's step
    assert dct["collectives"]["all-gather"] == 3 * 8 * sum(int(np.ceil(0.1 * s)) for s in sizes)
    assert dct["collectives"]["all-reduce"] == 2 * 3 / 4 * 4  # the loss
    assert dct["collective_bytes"] < 0.5 * mean["collective_bytes"]
    ada = collectives(Reduction("adasum"))
    assert ada["collectives"]["collective-permute"] == 2 * 4 * sum(sizes)


def test_what_it_refuses(model):
    with pytest.raises(ValueError, match="adasum needs a power-of-two mesh.data, not 3"):
        make_train_step(model, optax.sgd(1.0), jaxpar.make_mesh(data=3, devices=jax.devices()[:3]),
                        reduction=Reduction("adasum"))
    with pytest.raises(ValueError, match="give the step a mesh"):
        make_train_step(model, optax.sgd(1.0), reduction=DCT)
    with pytest.raises(ValueError, match="reduction=adasum with noise_scale is not supported yet: the noise scale"):
        make_train_step(model, optax.sgd(1.0), jaxpar.make_mesh(data=2, devices=jax.devices()[:2]),
                        reduction=Reduction("adasum"), noise_scale=True)


def test_config_fields():
    cfg = load_config("tiny", ["optimizer.reduction=adasum", "optimizer.compression=dct_topk",
                               "optimizer.compression_ratio=1"])
    assert cfg.gradient_reduction == Reduction("adasum", "dct_topk", 1.0, 10)
    assert load_config("tiny").gradient_reduction.is_mean
    for override, message in [("optimizer.compression_ratio=0", r"compression_ratio=0.0 must be in \(0, 1\]"),
                              ("optimizer.compression_ratio=1.5", r"compression_ratio=1.5 must be in"),
                              ("optimizer.threshold_every=0", "threshold_every=0 must be at least 1"),
                              ("optimizer.reduction=sum", r"optimizer.reduction='sum' must be one of"),
                              ("optimizer.compression=topk", r"optimizer.compression='topk' must be one of")]:
        with pytest.raises(ConfigError, match=message) as error:
            load_config("tiny", [override])
        assert "\n" not in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("offload", [OffloadOptions(optimizer="host"), OffloadOptions(params="host")], ids=str)
def test_adasum_composes_with_offload(model, offload):
    """Adasum on data=2 with parameters or optimizer state in host memory (both:
    tests/test_combinations_train.py): one SGD
    step (rate 1) moves the parameters by minus the Adasum of the replicas' gradients
    (against one device, 1e-5), wherever they are stored."""
    mesh = jaxpar.make_mesh(data=2, devices=jax.devices()[:2])
    batch = batch_of(31)
    _, grads = replica_grads(model, batch, 2)
    step = make_train_step(model, optax.sgd(1.0), mesh, donate=False, offload=offload, reduction=Reduction("adasum"))
    params, opt_state = step.init(model)
    params, _, _ = step(params, opt_state, batch)
    moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), nnx.state(model), step.in_model_order(params))
    assert tree_rel_err(moved, adasum_reference(grads)) < 1e-5
