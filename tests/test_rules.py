import jax
import numpy as np
import pytest
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
