"""Flax projects that are not jaxpar's import its rules, exactly as the README shows."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from conftest import rel_err


def _is(array, mesh, *spec):
    return array.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), array.ndim)


class LinenMLP(nn.Module):
    """Someone else's Linen model, annotated in MaxText's logical names."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(1.0)
        w_in = self.param("w_in", nn.with_logical_partitioning(init, ("embed", "mlp")), (16, 32))
        w_out = self.param("w_out", nn.with_logical_partitioning(init, ("mlp", "embed")), (32, 16))
        h = nn.with_logical_constraint(jax.nn.gelu(x @ w_in), ("activation_batch", "activation_mlp"))
        return nn.with_logical_constraint(h @ w_out, ("activation_batch", "activation_embed"))


def test_linen_project_uses_the_rules(rng):
    x = jnp.asarray(rng.standard_normal((8, 16), np.float32))
    model = LinenMLP()
    reference = model.apply(nn.unbox(model.init(jax.random.key(0), x)), x)

    mesh = jaxpar.make_mesh(data=2, fsdp=4)
    rules = jaxpar.rules.for_mesh(mesh)
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
        y = jax.jit(model.apply)(variables, x)

    assert _is(variables["params"]["w_in"].value, mesh, "fsdp", "tensor")
    assert _is(variables["params"]["w_out"].value, mesh, "tensor", "fsdp")
    assert rel_err(y, reference) < 1e-5


class NNXMLP(nnx.Module):
    """Someone else's NNX model, annotated in MaxText's logical names."""

    def __init__(self, rngs: nnx.Rngs):
        init, zeros = nnx.initializers.normal(1.0), nnx.initializers.zeros_init()
        self.up = nnx.Linear(
            16, 32, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(zeros, ("mlp",)),
        )
        self.down = nnx.Linear(
            32, 16, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
            bias_init=nnx.with_partitioning(zeros, ("embed",)),
        )

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def test_nnx_project_uses_the_rules_eagerly(rng):
    """NNX's eager sharding reads Flax's rule context: the model is born sharded."""
    x = jnp.asarray(rng.standard_normal((8, 16), np.float32))
    mesh = jaxpar.make_mesh(fsdp=8)
    with nnx.use_eager_sharding(False):
        reference = NNXMLP(nnx.Rngs(0))(x)
    with jax.set_mesh(mesh), nn.logical_axis_rules(jaxpar.rules.for_mesh(mesh)):
        model = NNXMLP(nnx.Rngs(0))
        y = nnx.jit(lambda m, x: m(x))(model, x)
    assert _is(model.up.kernel[...], mesh, "fsdp", "tensor")
    assert rel_err(y, reference) < 1e-5


def test_nnx_project_through_shard_model(rng):
    """Or build it unsharded and let jaxpar place it, with strict checking of names."""
    x = jnp.asarray(rng.standard_normal((8, 16), np.float32))
    mesh = jaxpar.make_mesh(data=2, fsdp=4)
    with nnx.use_eager_sharding(False):
        model = NNXMLP(nnx.Rngs(0))
    reference = model(x)
    jaxpar.shard_model(model, mesh)
    assert _is(model.down.kernel[...], mesh, "tensor", "fsdp")
    assert _is(model.down.bias[...], mesh, "fsdp")
    with jaxpar.use_mesh(mesh):
        y = nnx.jit(lambda m, x: m(x))(model, x)
    assert rel_err(y, reference) < 1e-5
