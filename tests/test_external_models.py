"""Models nobody here wrote, sharded by jaxpar's rules through the README's recipes.

``tests/external/`` holds unedited copies (license headers kept) of flax's
``examples/lm1b/models.py`` (Linen) and of the model and training step of Flax's NNX
GSPMD guide. On fsdp=8, data=2 x fsdp=4 and fsdp=4 x tensor=2, each parameter holds
exactly its share per device (the shares are written out by hand below, not derived
from jaxpar's rules), and three training steps equal the same steps on one device.
(lm1b on data=2 x fsdp=4 is not among them: what that mesh adds to fsdp=8, the batch
over two axes and the parameters over fsdp alone, is the guide's case on it, through the
same rules; lm1b's parameters split 8 ways and over tensor are its other two meshes.)
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import jaxpar
from conftest import rel_err
from external import flax_gspmd_guide as guide
from external import flax_lm1b_models as lm1b

MESHES = {"fsdp=8": dict(fsdp=8), "data=2,fsdp=4": dict(data=2, fsdp=4),
          "fsdp=4,tensor=2": dict(fsdp=4, tensor=2)}
# How many ways each logical name is split on each mesh, by DEFAULT_RULES' meaning:
# embed over fsdp; vocab, mlp and heads over tensor; kv (head dim) and layers whole.
WAYS = {"fsdp=8": {"embed": 8}, "data=2,fsdp=4": {"embed": 4},
        "fsdp=4,tensor=2": {"embed": 4, "vocab": 2, "mlp": 2, "hidden": 2}}
STEPS = 3
# The guide's code as written uses flax APIs that flax now deprecates.
pytestmark = [pytest.mark.filterwarnings("ignore:The 'split' argument of 'fork' is deprecated"),
              pytest.mark.filterwarnings("ignore:'sharding' is deprecated")]


def _per_device_bytes(array) -> int:
    return array.addressable_shards[0].data.nbytes


def _check_shares(named_arrays, mesh_name):
    """Each array ``(path, logical names, array)`` holds 1/ways of its bytes per device."""
    ways_of = WAYS[mesh_name]
    for path, names, array in named_arrays:
        ways = int(np.prod([ways_of.get(n, 1) for n in names if n is not None]))
        assert _per_device_bytes(array) * ways == array.nbytes, (path, names, array.sharding)


# --- flax examples/lm1b (Linen) ----------------------------------------------------

LM1B = lm1b.TransformerConfig(vocab_size=128, output_vocab_size=128, emb_dim=64, num_heads=8,
                              num_layers=2, qkv_dim=64, mlp_dim=128, max_len=16,
                              dropout_rate=0.0, attention_dropout_rate=0.0, deterministic=True)


def _lm1b_train(variables, tokens, mesh=None):
    """Three SGD steps of next-token cross-entropy; returns the losses and parameters.
    (SGD, not Adam: Adam's update is the gradient's sign where a gradient is tiny, and
    turns float32 rounding into 1e-5 differences in the parameters.)"""
    model = lm1b.TransformerLM(LM1B)
    tx = optax.sgd(1.0)

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = nn.unbox(variables)["params"]
    opt_state = tx.init(params)
    losses = []
    for tokens_t in tokens:
        if mesh is not None:
            spec = jaxpar.rules.logical_to_spec(("batch", "length"), jaxpar.rules.for_mesh(mesh))
            tokens_t = jax.device_put(tokens_t, NamedSharding(mesh, spec))
        params, opt_state, loss = step(params, opt_state, tokens_t)
        losses.append(float(loss))
    return losses, params


@pytest.fixture(scope="module")
def lm1b_reference():
    rng = np.random.default_rng(17)
    tokens = [jnp.asarray(rng.integers(1, LM1B.vocab_size, (8, 16)), jnp.int32) for _ in range(STEPS)]
    variables = jax.jit(lm1b.TransformerLM(LM1B).init)(jax.random.key(0), tokens[0])
    return tokens, _lm1b_train(variables, tokens)


@pytest.mark.parametrize("mesh_name", ["fsdp=8", "fsdp=4,tensor=2"])
@pytest.mark.slow
def test_flax_lm1b_shards_and_trains_as_one_device(mesh_name, lm1b_reference):
    """The README's Linen recipe, unedited model: strict shardings, then jit."""
    tokens, (want_losses, want_params) = lm1b_reference
    model = lm1b.TransformerLM(LM1B)
    mesh = jaxpar.make_mesh(**MESHES[mesh_name])
    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens[0])
    shardings = jaxpar.linen_shardings(abstract, mesh)
    with jaxpar.use_mesh(mesh):
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), tokens[0])
        named = [(jax.tree_util.keystr(path), box.names, box.value) for path, box in
                 jax.tree.leaves_with_path(variables, is_leaf=lambda x: isinstance(x, nn.Partitioned))]
        _check_shares(named, mesh_name)
        losses, params = _lm1b_train(variables, tokens, mesh)
    assert rel_err(np.array(losses), np.array(want_losses)) < 1e-5, (losses, want_losses)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        assert rel_err(got, want) < 1e-5


# --- Flax's NNX GSPMD guide ----------------------------------------------------------

DEPTH, LAYERS = 32, 2
GUIDE_RULES = jaxpar.rules.extend(jaxpar.rules.DEFAULT_RULES, ("hidden", "tensor"))


def _guide_train(mesh, data):
    """The guide's recipe on ``mesh``: the model is born sharded under the rules (NNX's
    eager sharding), then the guide's own jitted train_step runs three times."""
    x, y = data
    with jaxpar.use_mesh(mesh, GUIDE_RULES):
        model = guide.LogicalMultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        spec = jaxpar.rules.logical_to_spec(("batch", None), jaxpar.rules.for_mesh(mesh, GUIDE_RULES))
        x, y = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, y))
        losses = []
        for _ in range(STEPS):
            model, loss = guide.train_step(model, optimizer, x, y)
            losses.append(float(loss))
    return losses, model


@pytest.fixture(scope="module")
def guide_reference():
    rng = np.random.default_rng(23)
    data = tuple(jnp.asarray(rng.standard_normal((8, DEPTH)), jnp.float32) for _ in range(2))
    one_device = jaxpar.make_mesh(devices=jax.devices()[:1])  # the guide's constraint wants a mesh
    return data, _guide_train(one_device, data)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_flax_nnx_gspmd_guide_shards_and_trains_as_one_device(mesh_name, guide_reference):
    data, (want_losses, want_model) = guide_reference
    losses, model = _guide_train(jaxpar.make_mesh(**MESHES[mesh_name]), data)
    layers = model.layers
    _check_shares([("dot1.kernel", (None, "embed", "hidden"), layers.dot1.kernel[...]),
                   ("w2", (None, "hidden", "embed"), layers.w2[...])], mesh_name)
    assert rel_err(np.array(losses), np.array(want_losses)) < 1e-5, (losses, want_losses)
    for got, want in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(want_model))):
        assert rel_err(got, want) < 1e-5
