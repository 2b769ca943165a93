"""Data parallelism and FSDP (ZeRO-3) from the rules alone, checked against one device."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from conftest import rel_err, train_steps, tree_rel_err
from jaxpar.models import ModelConfig, Transformer
from jaxpar.models.transformer import sharding_rules
from jaxpar.train.step import loss_fn, make_train_step

CFG = ModelConfig(vocab_size=128, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_dim=96)
MESHES = [dict(fsdp=8), dict(data=2, fsdp=4), dict(data=8)]
# Megatron 1D tensor parallelism; CFG's 2 kv heads are replicated over tensor=4.
TENSOR_MESHES = [dict(data=2, tensor=4), dict(fsdp=2, tensor=4), dict(data=2, tensor=4, sp=True)]
# Optimus 2D: SUMMA projections on a 2 x 2 grid, composed with fsdp (D over fsdp x
# tensor_row). With data (data=2, tensor=(2, 2)), what it adds, the batch over data beside
# the grid: test_tensor_parallel_gradients_match_single_device[2d], on that mesh.
TENSOR_2D_MESHES = [dict(fsdp=2, tensor=(2, 2))]


def batches(rng, n, B=8, T=16):
    """Every key the loader gives (``BATCH_KEYS``; positions counting from 0 in each row,
    every token counted): the training steps' programs are then the ones
    ``TrainStep.compile`` lowers for the same mesh, which the compile-only tests below find
    compiled."""
    out = []
    for _ in range(n):
        tokens = rng.integers(0, CFG.vocab_size, (B, T + 1))
        seg = np.sort(rng.integers(0, 2, (B, T)), axis=1)
        out.append({
            "inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
            "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
            "segment_ids": jnp.asarray(seg, jnp.int32),
            "positions": jnp.asarray(np.broadcast_to(np.arange(T), (B, T)), jnp.int32),
            "mask": jnp.ones((B, T), jnp.int32),
        })
    return out


# The optimizer of conftest.train_steps (the training tests'): the compile-only tests
# build their steps with it too, so a step a training test compiled is found compiled.
def adamw():
    return optax.adamw(1e-3, weight_decay=0.1)


def train(mesh, data, steps=3, sequence_parallel=False):
    rules = sharding_rules(CFG, mesh, sequence_parallel=sequence_parallel) if mesh else None
    return train_steps(CFG, data[:steps], mesh, rules)


@pytest.fixture(scope="module")
def single_device_run():
    return train(None, batches(np.random.default_rng(1), 3))


@pytest.mark.slow
@pytest.mark.parametrize("sizes", MESHES + TENSOR_MESHES + TENSOR_2D_MESHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_training_matches_single_device(single_device_run, sizes):
    ref_losses, ref_params, _ = single_device_run
    sizes = dict(sizes)
    sp = sizes.pop("sp", False)
    losses, params, opt_state = train(jaxpar.make_mesh(**sizes), batches(np.random.default_rng(1), 3), sequence_parallel=sp)
    assert rel_err(losses, ref_losses) < 1e-5
    # Adam divides by the root of tiny second moments, so compare whole tensors
    # (||a - b|| / ||b||) rather than single elements.
    assert tree_rel_err(params, ref_params) < 1e-5
    q = params["layers"]["attn"]["q"][...]
    if isinstance(sizes.get("tensor"), tuple):  # D over fsdp x tensor_row, heads over tensor_col
        assert q.sharding.spec == jax.sharding.PartitionSpec("pipe", ("fsdp", "tensor_row"), "tensor_col", None)
        return
    assert q.sharding.spec == jax.sharding.PartitionSpec("pipe", "fsdp", "tensor", None)
    assert opt_state[0].mu["layers"]["attn"]["q"][...].sharding == q.sharding
    if "tensor" in sizes:  # 2 kv heads cannot split 4 ways: replicated, as Megatron does
        k = params["layers"]["attn"]["k"][...]
        assert k.sharding.spec == jax.sharding.PartitionSpec("pipe", "fsdp", None, None)


@pytest.fixture(scope="module")
def single_device_grads():
    """``(batch, grads)``: one random batch and ``Transformer(CFG)``'s gradients on it on
    one device, the reference of every gradient test below (traced and compiled once)."""
    batch = batches(np.random.default_rng(0), 1)[0]
    return batch, jax.jit(nnx.grad(loss_fn))(Transformer(CFG, rngs=nnx.Rngs(0)), batch)


@pytest.mark.slow
# fsdp=8; data=2 x fsdp=4 is not among them: the batch over data beside the parameters'
# axes is test_tensor_parallel_gradients_match_single_device's data=2 (the same shard_model
# path), data=2 x fsdp=4 trained against one device test_training_matches_single_device's.
@pytest.mark.parametrize("sizes", MESHES[:1], ids=["fsdp=8"])
def test_gradients_match_single_device(single_device_grads, sizes):
    batch, ref = single_device_grads
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    grad_fn = jax.jit(nnx.grad(loss_fn))
    mesh = jaxpar.make_mesh(**sizes)
    jaxpar.shard_model(model, mesh)
    with jaxpar.use_mesh(mesh):
        grads = grad_fn(model, batch)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)):
        assert rel_err(g, r) < 1e-5, jax.tree_util.keystr(path)


def _shard_bytes(tree) -> int:
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


@pytest.mark.slow
def test_zero3_memory_is_exactly_the_shards():
    """The compiled step's per-device arguments are exactly the param + Adam shards."""
    model = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    sizes = {}
    for fsdp in (1, 8):
        mesh = jaxpar.make_mesh(data=8 // fsdp, fsdp=fsdp)
        step = make_train_step(model, adamw(), mesh, sharding_rules(CFG, mesh))
        compiled = step.compile(model, batch_size=8, seq_len=16)
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            nnx.state(model), step.params_sharding,
        )
        opt = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(step.tx.init, params), step.opt_sharding,
        )
        state_bytes = _shard_bytes(params) + _shard_bytes(opt)
        batch_bytes = 5 * 16 * 4  # one sequence of each of the 5 batch arrays per device
        assert compiled.memory_analysis().argument_size_in_bytes == state_bytes + batch_bytes
        sizes[fsdp] = state_bytes
    total = sizes[1]
    # Only norm scales and Adam's step count stay replicated.
    replicated = (2 * CFG.layers + 1) * CFG.dim * 4 * 3 + 4
    assert sizes[8] == (total - replicated) // 8 + replicated


@pytest.mark.slow
def test_shard_model_inside_jit_creates_sharded_model():
    mesh = jaxpar.make_mesh(fsdp=4, data=2)

    @nnx.jit
    def create():
        return jaxpar.shard_model(Transformer(CFG, rngs=nnx.Rngs(0)), mesh)

    model = create()
    ref = Transformer(CFG, rngs=nnx.Rngs(0))
    embed = model.embed[...]
    expected = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor", "fsdp"))
    assert embed.sharding.is_equivalent_to(expected, embed.ndim)
    assert embed.addressable_shards[0].data.shape == (CFG.vocab_size, CFG.dim // 4)
    assert tree_rel_err(nnx.state(model), nnx.state(ref)) < 1e-6  # same draws, jit vs eager


class Annotated(nnx.Module):
    def __init__(self, names, shape=(16, 8)):
        init = nnx.with_partitioning(nnx.initializers.normal(), names, eager_sharding=False)
        self.w = nnx.Param(init(jax.random.key(0), shape))


@pytest.mark.parametrize(
    "module,message",
    [
        (Annotated(("embed", "hidden")), r"parameter w .*'hidden' has no sharding rule.*known: \["),
        (Annotated(("embed", "embed")), r"'embed' and 'embed' .* both map to mesh axis 'fsdp'"),
        (Annotated(("embed", "mlp"), shape=(12, 8)), r"dimension 12 does not divide over mesh axes fsdp"),
        (Annotated(("embed",)), r"annotation \('embed',\) does not match its shape \(16, 8\)"),
    ],
)
def test_shard_model_errors(module, message):
    with pytest.raises(ValueError, match=message) as info:
        jaxpar.shard_model(module, jaxpar.make_mesh(fsdp=8))
    assert "\n" not in str(info.value)


def test_unannotated_parameter_is_an_error():
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"parameter (bias|kernel) \(4,?4?\) has no logical axis annotation"):
        jaxpar.shard_model(model, jaxpar.make_mesh(fsdp=8))


@pytest.mark.slow
def test_custom_rules_move_fsdp_to_the_mlp_dimension():
    rules = dict(jaxpar.rules.DEFAULT_RULES) | {"embed": None, "mlp": ("fsdp", "tensor")}
    model = jaxpar.shard_model(Transformer(CFG, rngs=nnx.Rngs(0)), jaxpar.make_mesh(fsdp=8), tuple(rules.items()))
    assert model.layers.mlp.up[...].sharding.spec == jax.sharding.PartitionSpec("pipe", None, ("fsdp", "tensor"))


@pytest.mark.slow
def test_gradient_accumulation_on_a_mesh_matches_one_big_batch():
    """grad_accum=4 on data=2 x fsdp=4 (uneven token counts per microbatch on one device:
    tests/test_pipeline.py::test_microbatches_weight_the_loss_by_tokens)."""
    data = batches(np.random.default_rng(2), 1, B=16)
    results = []
    for k in (1, 4):
        mesh = jaxpar.make_mesh(data=2, fsdp=4)
        model = Transformer(CFG, rngs=nnx.Rngs(0))
        step = make_train_step(model, optax.sgd(0.1), mesh, grad_accum=k)
        params, opt_state = step.init(model)
        params, _, out = step(params, opt_state, data[0])
        results.append((float(out["loss"]), params))
    assert rel_err(results[1][0], results[0][0]) < 1e-5
    assert tree_rel_err(results[1][1], results[0][1]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("tensor,sequence_parallel", [(4, False), (4, True), ((2, 2), False)],
                         ids=["1d", "1d+sp", "2d"])
def test_tensor_parallel_gradients_match_single_device(single_device_grads, tensor, sequence_parallel):
    batch, ref = single_device_grads
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    grad_fn = jax.jit(nnx.grad(loss_fn))
    mesh = jaxpar.make_mesh(data=2, tensor=tensor)
    rules = sharding_rules(CFG, mesh, sequence_parallel=sequence_parallel)
    jaxpar.shard_model(model, mesh, rules)
    with jaxpar.use_mesh(mesh, rules):
        grads = grad_fn(model, batch)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)):
        assert rel_err(g, r) < 1e-5, jax.tree_util.keystr(path)


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_never_gathers_the_logits():
    """With the vocabulary over tensor=4, no collective returns [B, T, V] logits."""
    model = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    mesh = jaxpar.make_mesh(data=2, tensor=4)
    step = make_train_step(model, adamw(), mesh, sharding_rules(CFG, mesh))
    compiled = step.compile(model, batch_size=8, seq_len=16)
    hlo = compiled.as_text()
    gathers = [line for line in hlo.splitlines() if "all-gather(" in line or "all-gather-start(" in line]
    assert not [g for g in gathers if f",16,{CFG.vocab_size}]" in g.split("=")[1].split("all-gather")[0]]
    profile = jaxpar.profiler.profile(compiled)
    full_logits = 8 // 2 * 16 * CFG.vocab_size * 4  # one data shard's f32 logits
    assert profile["collectives"]["all-gather"] < full_logits
