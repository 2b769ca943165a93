"""Flax projects that are not jaxpar's import its rules, exactly as the README shows."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


@pytest.mark.slow
def test_linen_project_uses_the_rules(rng):
    x = jnp.asarray(rng.standard_normal((8, 16), np.float32))
    model = LinenMLP()
    reference = model.apply(nn.unbox(model.init(jax.random.key(0), x)), x)

    mesh = jaxpar.make_mesh(data=2, fsdp=4)
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    shardings = jaxpar.linen_shardings(abstract, mesh)
    with jaxpar.use_mesh(mesh):
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
        y = jax.jit(model.apply)(variables, x)

    assert _is(variables["params"]["w_in"].value, mesh, "fsdp", "tensor")
    assert _is(variables["params"]["w_out"].value, mesh, "tensor", "fsdp")
    assert rel_err(y, reference) < 1e-5


def test_linen_name_without_rule_is_an_error():
    """nn.logical_to_mesh_sharding would silently replicate the MLP dimension."""
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    abstract = jax.eval_shape(LinenMLP().init, jax.random.key(0), x)
    rules = tuple(rule for rule in jaxpar.rules.DEFAULT_RULES if rule[0] != "mlp")
    with pytest.raises(ValueError, match=r"parameter params/w_in \(16, 32\): logical axis 'mlp' has no "
                                         r"sharding rule.*jaxpar.rules.extend\(rules, \('mlp', MESH_AXES\)\)"):
        jaxpar.linen_shardings(abstract, jaxpar.make_mesh(fsdp=8), rules)


def test_linen_parameter_without_annotation_is_an_error():
    class Bare(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, use_bias=False)(x)

    abstract = jax.eval_shape(Bare().init, jax.random.key(0), jax.ShapeDtypeStruct((2, 8), jnp.float32))
    with pytest.raises(ValueError, match=r"parameter params/Dense_0/kernel \(8, 4\) has no logical axis "
                                         r"annotation; .*nn.with_logical_partitioning"):
        jaxpar.linen_shardings(abstract, jaxpar.make_mesh(fsdp=8))


def test_linen_mesh_axis_annotations():
    """nn.with_partitioning names mesh axes, which the mesh must have."""
    def abstract(names):
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x):
                return x @ self.param("w", nn.with_partitioning(nn.initializers.ones, names), (16, 8))

        return jax.eval_shape(Model().init, jax.random.key(0), jax.ShapeDtypeStruct((2, 16), jnp.float32))

    mesh = jaxpar.make_mesh(fsdp=8)
    assert jaxpar.linen_shardings(abstract(("fsdp", None)), mesh)["params"]["w"].spec == P("fsdp", None)
    with pytest.raises(ValueError, match=r"parameter params/w: nn.with_partitioning names mesh axis 'embed'"):
        jaxpar.linen_shardings(abstract(("embed", None)), mesh)


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
    with jaxpar.use_mesh(mesh):
        model = NNXMLP(nnx.Rngs(0))
        y = nnx.jit(lambda m, x: m(x))(model, x)
    assert _is(model.up.kernel[...], mesh, "fsdp", "tensor")
    assert rel_err(y, reference) < 1e-5


class DotReluDot(nnx.Module):
    """The model of Flax's NNX GSPMD guide, in its logical names ``embed`` and ``hidden``."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init, ("embed", "hidden")))
        self.w2 = nnx.Param(init(rngs.params(), (depth, depth)), out_sharding=("hidden", "embed"))

    def __call__(self, x):
        return jax.nn.relu(self.dot1(x)) @ self.w2


def test_nnx_eager_name_without_rule_is_jaxpars_error():
    """Not JAX's "Resource axis: hidden ... is not found in mesh": the parameter, the
    name and the fix; with the rule added, the model is born sharded by it."""
    mesh = jaxpar.make_mesh(fsdp=4, tensor=2)
    with pytest.raises(ValueError, match=r"parameter dot1/kernel \[test_external_rules.py:\d+\] \(16, 16\): "
                                         r"logical axis 'hidden' has no sharding rule; known: .*"
                                         r"jaxpar.rules.extend\(rules, \('hidden', MESH_AXES\)\)"):
        with jaxpar.use_mesh(mesh):
            DotReluDot(16, nnx.Rngs(0))
    with jaxpar.use_mesh(mesh, jaxpar.rules.extend(jaxpar.rules.DEFAULT_RULES, ("hidden", "tensor"))):
        model = DotReluDot(16, nnx.Rngs(0))
    assert _is(model.dot1.kernel[...], mesh, "fsdp", "tensor")
    assert _is(model.w2[...], mesh, "tensor", "fsdp")


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
