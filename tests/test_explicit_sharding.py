"""Meshes with Explicit axes (``jaxpar.make_mesh(axis_types="explicit")``): a model written
for Explicit sharding trains on one as it is written, and jaxpar's own model, written for
Auto axes, trains on both kinds of mesh alike."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

import jaxpar
import test_parallel
from conftest import rel_err, train_steps
from jaxpar.models import ModelConfig, Transformer
from jaxpar.models.transformer import sharding_rules
from jaxpar.parallel import pipeline_schedule
from jaxpar.train.step import make_train_step

B, T, D, F, V = 8, 4, 16, 32, 16
BATCH = ("data", "fsdp")  # the mesh axes make_train_step splits the batch over
# jaxpar's model, tiny: every dimension the fsdp=4 x tensor=2 mesh splits divides.
TINY = ModelConfig(vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=64)
SHARED = test_parallel.CFG  # the training tests' (below)


class ExplicitMLP(nnx.Module):
    """A model in the style of JAX's explicit-sharding tutorial, not jaxpar's: parameters
    annotated with mesh axes, each weight's FSDP shards gathered by ``reshard`` before
    use and each einsum's output sharding stated. ``[B, T, D]`` -> logits ``[B, T, V]``."""

    def __init__(self, rngs: nnx.Rngs):
        def param(shape, axes):
            init = nnx.with_partitioning(nnx.initializers.normal(0.5), axes)
            return nnx.Param(init(rngs.params(), shape))

        self.w_in = param((D, F), ("fsdp", "tensor"))
        self.w_out = param((F, D), ("tensor", "fsdp"))
        self.head = param((D, V), ("fsdp", "tensor"))

    def __call__(self, x):
        w_in = reshard(self.w_in[...], P(None, "tensor"))
        h = jax.nn.gelu(jnp.einsum("btd,df->btf", x, w_in, out_sharding=P(BATCH, "seq", "tensor")))
        w_out = reshard(self.w_out[...], P("tensor", None))
        y = x + jnp.einsum("btf,fd->btd", h, w_out, out_sharding=P(BATCH, "seq", None))
        head = reshard(self.head[...], P(None, "tensor"))
        logits = jnp.einsum("btd,dv->btv", y, head, out_sharding=P(BATCH, "seq", "tensor"))
        return reshard(logits, P(BATCH, "seq", None))


def explicit_loss(model, batch):
    logp = jax.nn.log_softmax(model(batch["inputs"]), axis=-1)
    return -(logp * jax.nn.one_hot(batch["targets"], V)).sum(-1).mean()


def _batches(rng, n):
    return [{"inputs": rng.standard_normal((B, T, D), np.float32),
             "targets": rng.integers(0, V, (B, T)).astype(np.int32)} for _ in range(n)]


def _mesh_rules(mesh):
    """The default rules, for the batch, plus the mesh axes the model is annotated with."""
    return jaxpar.rules.extend(jaxpar.rules.DEFAULT_RULES, *jaxpar.rules.identity(mesh))


def _train_explicit_mlp(mesh, data):
    with jax.set_mesh(mesh):  # NNX places each parameter as it is made (eager sharding)
        model = ExplicitMLP(nnx.Rngs(0))
    step = make_train_step(model, optax.adamw(1e-2), mesh, _mesh_rules(mesh), loss=explicit_loss)
    params, opt_state = step.init(model)
    losses = []
    for batch in data:
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return losses, params


@pytest.mark.slow
def test_model_written_for_explicit_sharding_trains_like_one_device(rng):
    """On jaxpar's fsdp=4 x tensor=2 Explicit mesh, with the mesh-axis annotations
    resolved by ``jaxpar.rules.identity``, through jaxpar's own train step: the losses
    of 3 steps equal the same model's on one device."""
    data = _batches(rng, 3)
    one = jaxpar.make_mesh(devices=jax.devices()[:1], axis_types="explicit")
    reference, _ = _train_explicit_mlp(one, data)
    losses, params = _train_explicit_mlp(jaxpar.make_mesh(fsdp=4, tensor=2, axis_types="explicit"), data)
    assert rel_err(losses, reference) < 1e-5
    assert jax.typeof(params["w_in"][...]).sharding.spec == P("fsdp", "tensor")


def test_mesh_axis_annotations_need_identity_rules():
    mesh = jaxpar.make_mesh(fsdp=8, axis_types="explicit")
    with jax.set_mesh(mesh):
        model = ExplicitMLP(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"'fsdp' .* is a mesh axis.*jaxpar\.rules\.identity\(mesh\)"):
        jaxpar.shard_model(model, mesh)


@pytest.mark.slow
def test_shard_model_inside_jit_on_an_explicit_mesh():
    """jaxpar's model, created under ``nnx.jit`` and placed there as ``jaxpar-train``
    creates it: the parameters' Explicit types are their shardings, and their values
    are the eagerly made model's."""
    mesh = jaxpar.make_mesh(fsdp=4, tensor=2, axis_types="explicit")

    @nnx.jit
    def create():
        return jaxpar.shard_model(Transformer(TINY, rngs=nnx.Rngs(0)), mesh, sharding_rules(TINY, mesh))

    with jax.set_mesh(mesh):  # JAX traces Explicit shardings only inside a mesh context
        up = create().layers.mlp.up[...]
    assert jax.typeof(up).sharding.spec == P("pipe", "fsdp", "tensor")
    assert up.addressable_shards[0].data.shape == (TINY.layers, TINY.dim // 4, TINY.mlp_dim // 2)
    assert rel_err(up, Transformer(TINY, rngs=nnx.Rngs(0)).layers.mlp.up[...]) < 1e-6


def test_constrain_reshards_on_an_explicit_mesh(rng):
    """Under Explicit axes a sharding is the array's type: ``constrain`` changes it."""
    mesh = jaxpar.make_mesh(data=2, fsdp=2, tensor=2, axis_types="explicit")
    x = jax.device_put(rng.standard_normal((8, 16), np.float32), jax.NamedSharding(mesh, P()))
    with jaxpar.use_mesh(mesh):
        y = jax.jit(lambda x: jaxpar.constrain(2 * x, ("activation_batch", "activation_mlp")))(x)
    assert jax.typeof(y).sharding.spec == P(("data", "fsdp"), "tensor")
    assert rel_err(y, 2 * np.asarray(x)) == 0


# The training tests below train test_parallel.py's model on its batches' shapes and keys
# (fresh draws): their one-device and Auto fsdp=2 x tensor=4 steps are the programs it
# compiles (test_training_matches_single_device), one compile in a test run for both.
@pytest.fixture(scope="module")
def tiny_data():
    return test_parallel.batches(np.random.default_rng(2), 3)


@pytest.fixture(scope="module")
def tiny_one_device(tiny_data):
    return train_steps(SHARED, tiny_data)[0]


@pytest.mark.slow
def test_jaxpar_model_trains_alike_on_auto_and_explicit_meshes(tiny_data, tiny_one_device):
    """jaxpar's Transformer (written for Auto axes; its loss runs under
    ``jaxpar.auto_axes``) on fsdp=2 x tensor=4 (its 2 kv heads whole on each device): 3
    steps' losses on the Explicit mesh equal the Auto mesh's and one device's; its
    parameters keep their Explicit types."""
    auto, _, _ = train_steps(SHARED, tiny_data, jaxpar.make_mesh(fsdp=2, tensor=4))
    explicit, params, _ = train_steps(SHARED, tiny_data, jaxpar.make_mesh(fsdp=2, tensor=4, axis_types="explicit"))
    assert rel_err(auto, tiny_one_device) < 1e-5 and rel_err(explicit, tiny_one_device) < 1e-5
    assert rel_err(explicit, auto) < 1e-5
    q = jax.typeof(params["layers"]["attn"]["q"][...]).sharding
    assert q.spec == P("pipe", "fsdp", "tensor", None)
    assert set(q.mesh.axis_types) == {jax.sharding.AxisType.Explicit}


@pytest.mark.slow
def test_jaxpar_pipeline_trains_on_an_explicit_mesh(tiny_data, tiny_one_device):
    """The pipelined step (data=2 x pipe=2 x tensor=2, 1F1B over 4 microbatches) on an
    Explicit mesh: one device's losses."""
    schedule = pipeline_schedule.build("1f1b", 2, 4, 1)
    mesh = jaxpar.make_mesh(data=2, pipe=2, tensor=2, axis_types="explicit")
    losses, _, _ = train_steps(SHARED, tiny_data, mesh, pipeline=schedule)
    assert rel_err(losses, tiny_one_device) < 1e-5
