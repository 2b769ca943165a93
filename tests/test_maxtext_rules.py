"""MaxText's vocabulary in jaxpar's rules: DEFAULT_RULES names all of MaxText's base.yml,
and ``jaxpar.rules.from_maxtext`` loads MaxText's table and shards as MaxText does.

MaxText's answer is computed as MaxText computes it (maxtext/utils/sharding.py,
``logical_to_mesh_axes``): flax's ``logical_to_mesh_axes`` over its table, then the mesh
axes of size 1 removed, on a mesh with MaxText's axis names. Abstract arrays only.
"""

import os

import flax.linen as nn
import jax
import pytest
import yaml
from jax.sharding import AbstractMesh, PartitionSpec as P

import jaxpar
from jaxpar.placement.rules import (
    BATCH_AXES, DEFAULT_RULES, MAXTEXT_MESH_AXES, for_mesh, from_maxtext, logical_to_spec, override,
)

with open(os.path.join(os.path.dirname(__file__), "external", "maxtext_base_rules.yml")) as f:
    MAXTEXT = yaml.safe_load(f)
TABLE = MAXTEXT["logical_axis_rules"]  # as YAML reads it: lists
NAMES = list(dict.fromkeys(name for name, _ in TABLE))


def _lists_to_tuples(x):
    """What MaxText's config loader (pyconfig.py) does to the table before flax sees it."""
    return tuple(_lists_to_tuples(y) for y in x) if isinstance(x, list) else x


def test_default_rules_name_all_of_maxtexts_vocabulary_and_keep_jaxpars_own():
    missing = [name for name in NAMES if name not in dict(DEFAULT_RULES)]
    assert not missing, missing
    assert len(NAMES) == 70
    # jaxpar's rules as they were before MaxText's names joined them, first and unchanged
    # (but for `expert` in the batches, MaxText's, since mesh.expert).
    assert DEFAULT_RULES[:20] == (
        ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"),
        ("kv", None), ("mlp", "tensor"), ("layers", "pipe"), ("norm", None), ("positions", None),
        ("batch", ("data", "fsdp", "expert")), ("length", "seq"), ("activation_batch", ("data", "fsdp", "expert")),
        ("activation_length", "seq"), ("activation_norm_length", "seq"), ("activation_embed", None),
        ("activation_heads", "tensor"), ("activation_kv_heads", "tensor"), ("activation_kv", None),
        ("activation_mlp", "tensor"), ("activation_vocab", "tensor"),
    )
    rules = for_mesh(jaxpar.make_mesh(data=2, fsdp=4))  # `expert` dropped: experts replicated
    assert logical_to_spec(("exp", "embed_moe", "mlp_moe"), rules) == P(None, "fsdp", "tensor")


def test_default_rules_differ_from_maxtexts_only_where_documented():
    """The module docstring's list: jaxpar's own rules, and the variants that follow them."""
    maxtext, default = dict(from_maxtext(TABLE)), dict(DEFAULT_RULES)
    differ = {name for name in NAMES if default[name] != maxtext[name]}
    assert differ == {
        # `tensor` in MaxText: jaxpar replicates the residual stream's width and norm scales.
        "norm", "activation_embed", "activation_embed_attn", "activation_embed_moe",
        # `tensor` in MaxText, which flax never applies beside heads: None in jaxpar.
        "activation_kv", "activation_kv_head_dim",
        # Weights' model dimension: MaxText adds `context` and `expert`.
        "embed", "embed_vocab", "embed_moe", "q_lora", "kv_lora",
        # Batches: MaxText adds `stage` around the embedding and logits.
        "activation_embed_and_logits_batch", "activation_embed_and_logits_batch_sequence",
    }
    assert maxtext["embed"] == ("fsdp", "seq", "expert") and default["embed"] == "fsdp"
    assert maxtext["activation_embed_and_logits_batch"] == ("data", "pipe", "fsdp", "expert")
    assert default["activation_embed_and_logits_batch"] == BATCH_AXES


def test_maxtexts_table_loads():
    rules = jaxpar.rules.from_maxtext(TABLE)
    assert [name for name, _ in rules] == NAMES  # one rule per name, MaxText's order
    assert jaxpar.rules.freeze(rules) == rules
    table = dict(rules)
    assert table["activation_vocab"] == "tensor"  # the first of its three rules
    assert table["layers"] == "pipe" and table["activation_stage"] == "pipe"
    assert table["activation_length"] == "seq" and table["exp"] == "expert"
    assert table["mlp"] == "tensor"  # fsdp_transpose, tensor_sequence, autoregressive dropped
    assert table["circular_repeats"] is None and table["diloco"] is None
    for mesh in (jaxpar.make_mesh(data=2, fsdp=4), jaxpar.make_mesh(data=2, tensor=(2, 2))):
        assert dict(for_mesh(mesh, rules))["embed"] == ("fsdp", "seq")  # no `expert` on jaxpar's meshes
    # A MaxText mesh axis the mapping does not know is an error, not dropped unseen.
    with pytest.raises(ValueError, match=r"MaxText rule 'embed' names mesh axis 'fdsp', .*did you mean 'fsdp'"):
        from_maxtext([["embed", ["fdsp", "context"]]])
    with pytest.raises(ValueError, match=r"must be a \[logical_name, mesh_axes\] pair, got \['embed'\]"):
        from_maxtext([["embed"]])


class MaxTextNamedModel(nn.Module):
    """Parameters annotated as MaxText's layers annotate theirs (embeddings.py,
    attentions.py, attention_mla.py, linears.py, moe.py, normalizations.py, decoders.py)."""

    @nn.compact
    def __call__(self):
        def param(name, names, shape):
            return self.param(name, nn.with_logical_partitioning(nn.initializers.zeros, names), shape)

        return [
            param("embedding", ("vocab", "embed_vocab"), (64, 16)),
            param("query", ("embed", "q_heads", "kv"), (16, 4, 8)),
            param("key", ("embed", "kv_heads", "kv_head_dim"), (16, 2, 8)),
            param("out", ("heads", "kv", "embed"), (4, 8, 16)),
            param("wq_b", ("q_lora", "q_heads", "kv"), (8, 4, 8)),
            param("wq_a", ("embed", "q_lora_up_proj"), (16, 8)),
            param("wi", ("embed", "mlp"), (16, 32)),
            param("wo", ("mlp", "embed"), (32, 16)),
            param("moe_wi", ("exp", "embed_moe", "mlp_moe"), (4, 16, 32)),
            param("moe_wo", ("exp", "mlp_moe", "embed_moe"), (4, 32, 16)),
            param("scale", ("norm",), (16,)),
            param("stacked_wi", ("embed", "layers", "mlp"), (16, 2, 32)),
            param("logits", ("embed_vocab", "vocab"), (16, 64)),
        ]


# Activations as MaxText constrains them (decoders.py, attentions.py, moe.py, pipeline.py).
ACTIVATIONS = (
    ("activation_batch", "activation_norm_length", "activation_embed"),
    ("activation_batch_attn", "activation_input_length_attn", "activation_embed_attn"),
    ("activation_embed_and_logits_batch", "activation_length", "activation_vocab"),
    ("activation_batch_moe", "activation_length_moe", None),
    ("activation_stage", "activation_batch", "activation_length", "activation_embed"),
    ("cache_batch", "cache_sequence", "cache_heads", "cache_kv"),
)
# Attention's [B, T, N, H]: flax gives `tensor` to the heads, whose rule comes first.
ATTENTION_OUT = ("activation_batch_attn", "activation_length_attn", "activation_heads", "activation_kv")

# (MaxText's mesh, the jaxpar mesh with the same parallelism): the sizes of MaxText's
# axes > 1; a jaxpar mesh, or a user's with an `expert` axis.
LAYOUTS = (
    ({"data": 2, "fsdp": 2, "tensor": 2}, lambda: jaxpar.make_mesh(data=2, fsdp=2, tensor=2)),
    ({"stage": 2, "fsdp": 2, "context": 2}, lambda: jaxpar.make_mesh(fsdp=2, pipe=2, seq=2)),
    ({"fsdp": 2, "expert": 2, "tensor": 2},
     lambda: AbstractMesh((2, 2, 2), ("fsdp", "expert", "tensor"))),
)


def maxtext_spec(names, mesh):
    """MaxText's ``logical_to_mesh_axes``: flax's resolution, then size-1 axes removed."""
    spec = nn.logical_to_mesh_axes(names, rules=_lists_to_tuples(TABLE))
    return P(*(None if d is None else tuple(a for a in jaxpar.rules.as_tuple(d) if mesh.shape[a] > 1)
               for d in spec))


def comparable(spec, mesh, rename=lambda a: a):
    """Each dimension's mesh axes of size > 1, renamed, as a tuple (``()``: whole)."""
    return tuple(tuple(rename(a) for a in jaxpar.rules.as_tuple(d) if mesh.shape[a] > 1) for d in spec)


@pytest.mark.parametrize("sizes, jaxpar_mesh", LAYOUTS, ids=["data_fsdp_tensor", "stage_fsdp_context", "fsdp_expert_tensor"])
def test_a_model_in_maxtexts_names_shards_as_maxtext_does(sizes, jaxpar_mesh):
    maxtext_mesh = AbstractMesh(tuple(sizes.get(a, 1) for a in MAXTEXT["mesh_axes"]), tuple(MAXTEXT["mesh_axes"]))
    mesh = jaxpar_mesh()
    rules = for_mesh(mesh, from_maxtext(TABLE))
    abstract = jax.eval_shape(MaxTextNamedModel().init, jax.random.key(0))
    params = nn.get_partition_spec(abstract)["params"]
    arrays = [tuple(spec) for spec in params.values()] + list(ACTIVATIONS)
    for names in arrays:
        want = comparable(maxtext_spec(names, maxtext_mesh), maxtext_mesh, MAXTEXT_MESH_AXES.get)
        assert comparable(logical_to_spec(names, rules), mesh) == want, names

    # Where MaxText leaves two names of one array on one axis to rule order, jaxpar says
    # so; overriding the later name (as DEFAULT_RULES does) gives MaxText's answer.
    with pytest.raises(ValueError, match=r"'activation_heads' and 'activation_kv' .* both map to mesh axis 'tensor'"):
        logical_to_spec(ATTENTION_OUT, rules)
    fixed = for_mesh(mesh, override(from_maxtext(TABLE), {"activation_kv": None}))
    want = comparable(maxtext_spec(ATTENTION_OUT, maxtext_mesh), maxtext_mesh, MAXTEXT_MESH_AXES.get)
    assert comparable(logical_to_spec(ATTENTION_OUT, fixed), mesh) == want
    assert want[2] == (("tensor",) if sizes.get("tensor") else ()) and want[3] == ()
