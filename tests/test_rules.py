import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.placement.rules import DEFAULT_RULES, for_mesh, logical_to_spec


def test_default_rules_are_plain_flax_data():
    assert isinstance(DEFAULT_RULES, tuple)
    for name, axes in DEFAULT_RULES:
        assert isinstance(name, str)
        assert axes is None or isinstance(axes, str) or all(isinstance(a, str) for a in axes)
    names = {name for name, _ in DEFAULT_RULES}
    assert {"batch", "length", "embed", "heads", "kv", "mlp", "vocab", "layers"} <= names
    assert {"activation_batch", "activation_length", "activation_embed"} <= names


def test_resolution():
    rules = for_mesh(jaxpar.make_mesh(fsdp=8))
    assert logical_to_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
    assert logical_to_spec(("layers", "embed", "heads", "kv"), rules) == P("pipe", "fsdp", "tensor", None)
    assert logical_to_spec(("activation_batch", None), rules) == P(("data", "fsdp"), None)


def test_for_mesh_drops_axes_a_foreign_mesh_lacks():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rules = dict(for_mesh(mesh))
    assert rules["activation_batch"] == "data"
    assert rules["embed"] is None and rules["mlp"] is None


def test_for_mesh_accepts_a_foreign_mesh_axis():
    mesh = jax.make_mesh((2, 4), ("replica", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = dict(for_mesh(mesh, [("batch", "replica"), ("mlp", "model"), ("embed", "fsdp")]))
    assert rules == {"batch": "replica", "mlp": "model", "embed": None}


def test_typo_in_a_mesh_axis():
    with pytest.raises(ValueError, match=r"names mesh axis 'fdsp'.*did you mean 'fsdp'"):
        for_mesh(jaxpar.make_mesh(fsdp=8), [("embed", "fdsp")])


def test_unknown_logical_name_lists_known_names():
    rules = for_mesh(jaxpar.make_mesh(fsdp=8))
    with pytest.raises(ValueError, match=r"'hiden' has no sharding rule.*known: \[.*'embed'.*\('hiden', None\)"):
        logical_to_spec(("hiden", "mlp"), rules)


def test_explicit_replication_rule():
    rules = for_mesh(jaxpar.make_mesh(fsdp=8), DEFAULT_RULES + (("hidden", None),))
    assert logical_to_spec(("hidden", "mlp"), rules) == P(None, "tensor")


def test_extend_adds_names_and_override_changes_them():
    mesh = jaxpar.make_mesh(fsdp=8)
    rules = jaxpar.rules.extend(DEFAULT_RULES, ("hidden", "fsdp"), ("conv", None))
    assert logical_to_spec(("hidden", "mlp", "conv"), for_mesh(mesh, rules)) == P("fsdp", "tensor", None)
    assert jaxpar.rules.override(rules, {"hidden": "tensor"})[-2] == ("hidden", "tensor")
    with pytest.raises(ValueError, match=r"'embed' has a rule already \('embed' -> 'fsdp'\); .*override"):
        jaxpar.rules.extend(DEFAULT_RULES, ("embed", "tensor"))
    with pytest.raises(ValueError, match=r"cannot override logical axis 'hidden': no rule has it; .*extend"):
        jaxpar.rules.override(DEFAULT_RULES, {"hidden": "tensor"})
    with pytest.raises(ValueError, match=r"must be a \(logical_name, mesh_axes\) pair"):
        jaxpar.rules.extend(DEFAULT_RULES, ("hidden",))
    with pytest.raises(ValueError, match=r"rule 'embed': mesh axes must be names"):
        jaxpar.rules.override(DEFAULT_RULES, {"embed": (1, 2)})


def test_a_mesh_axis_used_as_a_logical_name_is_named_as_such():
    """Models annotated with mesh axes ('tensor') get told so, not "did you mean 'norm'?";
    only real near-misses are suggested."""
    rules = for_mesh(jaxpar.make_mesh(fsdp=8))
    with pytest.raises(ValueError, match=r"'tensor' in \('embed', 'tensor'\) is a mesh axis, not a logical") as e:
        logical_to_spec(("embed", "tensor"), rules)
    assert "did you mean" not in str(e.value)
    with pytest.raises(ValueError, match=r"'mpl' has no sharding rule \(did you mean 'mlp'\?\)"):
        logical_to_spec(("mpl",), rules)
    with pytest.raises(ValueError, match=r"'hidden' has no sharding rule; known"):  # no near-miss
        logical_to_spec(("hidden",), rules)


def test_two_names_on_one_mesh_axis():
    rules = [("embed", "fsdp"), ("mlp", ("fsdp", "tensor"))]
    with pytest.raises(ValueError, match=r"'embed' and 'mlp' .* both map to mesh axis 'fsdp'"):
        logical_to_spec(("embed", "mlp"), rules)


def test_duplicate_rule_and_malformed_rule():
    with pytest.raises(ValueError, match="more than one sharding rule"):
        logical_to_spec(("embed",), [("embed", "fsdp"), ("embed", None)])
    with pytest.raises(ValueError, match="must be a .logical_name, mesh_axes. pair"):
        logical_to_spec(("embed",), [("embed",)])


def test_constrain_is_a_noop_without_mesh():
    x = np.arange(6.0).reshape(2, 3)
    assert jaxpar.constrain(x, ("activation_batch", "activation_embed")) is x


class _MLP(nnx.Module):
    """D=16, F=32, float32: up (16, 32) + (32,), down (32, 16) + (16,), a norm (16,)."""

    def __init__(self, rngs):
        init, zeros = nnx.initializers.normal(1.0), nnx.initializers.zeros_init()
        self.up = nnx.Linear(16, 32, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                             bias_init=nnx.with_partitioning(zeros, ("mlp",)))
        self.down = nnx.Linear(32, 16, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
                               bias_init=nnx.with_partitioning(zeros, ("embed",)))
        self.norm = nnx.RMSNorm(16, rngs=rngs, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)))


def test_explain_counts_bytes_per_device_and_the_replicated_share(capsys):
    """On fsdp=4 x tensor=2: kernels 2048 B / 8, up.bias 128 B / 2 (tensor), down.bias
    64 B / 4 (fsdp), the norm's 64 B on every device."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: _MLP(nnx.Rngs(0)))
    mesh = jaxpar.make_mesh(fsdp=4, tensor=2)
    report = jaxpar.rules.explain(model, mesh)
    assert capsys.readouterr().out == str(report) + "\n"
    per_param = {p.path: (p.names, p.spec, p.bytes_per_device) for p in report.params}
    assert per_param == {
        "down/bias": (("embed",), P("fsdp"), 16),
        "down/kernel": (("mlp", "embed"), P("tensor", "fsdp"), 256),
        "norm/scale": (("norm",), P(None), 64),
        "up/bias": (("mlp",), P("tensor"), 64),
        "up/kernel": (("embed", "mlp"), P("fsdp", "tensor"), 256),
    }
    total = 2048 + 128 + 2048 + 64 + 64
    assert (report.total_bytes, report.bytes_per_device) == (total, 256 + 64 + 256 + 16 + 64)
    assert report.replicated_fraction == 64 / total
    lines = str(report).splitlines()
    assert lines[0].split() == ["parameter", "logical", "axes", "mesh", "axes", "shape", "bytes/device"]
    assert "up/kernel    embed, mlp    fsdp:4, tensor:2  16x32" in str(report)
    assert lines[-2:] == ["total 4,352 bytes in 5 parameters; per device 656 bytes on fsdp=4 x tensor=2 "
                          "(ideal 1/8: 544)",
                          "replicated (every device holds them whole): 1.5% of parameter bytes"]

    # Replicating the MLP dimension: kernels split 4 ways only, up.bias held whole.
    replicated_mlp = jaxpar.rules.explain(model, mesh, jaxpar.rules.override(DEFAULT_RULES, {"mlp": None}))
    assert replicated_mlp.bytes_per_device == 512 + 128 + 512 + 16 + 64
    assert replicated_mlp.replicated_fraction == (128 + 64) / total


def test_explain_linen_variables_abstract():
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "vocab")), (16, 8))
            return x @ w

    abstract = jax.eval_shape(Dense().init, jax.random.key(0), jax.ShapeDtypeStruct((2, 16), np.float32))
    report = jaxpar.rules.explain(abstract, jaxpar.make_mesh(fsdp=4, tensor=2))
    assert [(p.path, p.spec, p.bytes_per_device) for p in report.params] == [("w", P("fsdp", "tensor"), 64)]
    assert report.replicated_fraction == 0
