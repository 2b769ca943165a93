import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpar
from conftest import rel_err, tree_rel_err
from jaxpar.models import PRESETS, ModelConfig, Remat, RopeScaling, Transformer
from jaxpar.models.transformer import apply_rope, rope_frequencies
from jaxpar.train.step import loss_fn

SMALL = ModelConfig(vocab_size=96, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=48)
GPT2_STYLE = dataclasses.replace(
    SMALL, norm="layer", mlp="gelu", position="learned", max_position=32, tie_embeddings=True,
    attention_bias=True, mlp_bias=True, kv_heads=4,
)


def attention_reference(q, k, v, causal, segment_ids):
    """Loops over batch and heads in float64 numpy."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for n in range(N):
            kv = n // (N // K)
            scores = q[b, :, n] @ k[b, :, kv].T / np.sqrt(H)
            allowed = np.ones((T, S), bool)
            if causal:
                allowed &= np.arange(T)[:, None] + S - T >= np.arange(S)[None]
            if segment_ids is not None:
                allowed &= segment_ids[b][:, None] == segment_ids[b][None]
            scores = np.where(allowed, scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, :, n] = (p / p.sum(-1, keepdims=True)) @ v[b, :, kv]
    return out


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_matches_reference(rng, N, K, causal, packed):
    B, T, H = 2, 10, 8
    q = rng.standard_normal((B, T, N, H), np.float32)
    k = rng.standard_normal((B, T, K, H), np.float32)
    v = rng.standard_normal((B, T, K, H), np.float32)
    seg = np.sort(rng.integers(0, 3, (B, T)), axis=1) if packed else None
    out = jaxpar.dot_product_attention(q, k, v, causal=causal, segment_ids=seg)
    assert out.shape == (B, T, N, H)
    assert rel_err(out, attention_reference(q, k, v, causal, seg)) < 1e-5


def test_attention_with_fewer_queries_than_keys(rng):
    q = rng.standard_normal((1, 3, 4, 8), np.float32)
    k = rng.standard_normal((1, 7, 2, 8), np.float32)
    v = rng.standard_normal((1, 7, 2, 8), np.float32)
    out = jaxpar.dot_product_attention(q, k, v, causal=True)
    assert rel_err(out, attention_reference(q, k, v, True, None)) < 1e-5


def test_attention_rejects_bad_head_counts(rng):
    q = rng.standard_normal((1, 4, 3, 8), np.float32)
    k = rng.standard_normal((1, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="N=3 must be a multiple of key/value heads K=2"):
        jaxpar.dot_product_attention(q, k, k)


def test_rope_is_a_rotation_of_half_pairs(rng):
    cfg = dataclasses.replace(SMALL, rope_theta=500.0)
    x = rng.standard_normal((2, 5, 3, 8), np.float32)
    positions = rng.integers(0, 100, (2, 5))
    out = apply_rope(x, positions, rope_frequencies(cfg))
    # Reference: pairs (x[i], x[i + H/2]) as complex numbers times exp(i * pos * freq).
    freqs = 1.0 / 500.0 ** (np.arange(0, 8, 2) / 8)
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * positions[:, :, None, None] * freqs)
    assert rel_err(out, np.concatenate([z.real, z.imag], -1)) < 1e-5


def test_llama3_rope_scaling_bands():
    cfg = dataclasses.replace(
        SMALL, head_dim=64, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192),
    )
    base = np.asarray(rope_frequencies(dataclasses.replace(cfg, rope_scaling=None)))
    scaled = np.asarray(rope_frequencies(cfg))
    wavelen = 2 * np.pi / base
    short, long = wavelen < 8192 / 4, wavelen > 8192
    assert short.any() and long.any()
    np.testing.assert_allclose(scaled[short], base[short], rtol=1e-6)
    np.testing.assert_allclose(scaled[long], base[long] / 8, rtol=1e-6)
    middle = ~short & ~long
    assert np.all((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8))


@pytest.mark.parametrize("cfg", [SMALL, GPT2_STYLE], ids=["llama", "gpt2"])
def test_parameters_are_stacked_and_annotated(cfg):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        names = jaxpar.placement.sharding.logical_axes(var)
        assert names is not None and len(names) == var.get_value().ndim, path
        if path[0] == "layers":
            assert names[0] == "layers" and var.get_value().shape[0] == cfg.layers
    has_head = ("lm_head",) in dict(nnx.to_flat_state(nnx.state(model)))
    assert has_head == (not cfg.tie_embeddings)


def test_model_is_causal_and_respects_documents(rng):
    model = Transformer(SMALL, rngs=nnx.Rngs(0))
    tokens = rng.integers(0, SMALL.vocab_size, (1, 12))
    logits = model(jnp.asarray(tokens))
    changed = tokens.copy()
    changed[0, 8:] = (changed[0, 8:] + 1) % SMALL.vocab_size
    logits2 = model(jnp.asarray(changed))
    np.testing.assert_allclose(logits[0, :8], logits2[0, :8], rtol=1e-5, atol=1e-6)
    assert not np.allclose(logits[0, 8:], logits2[0, 8:])
    # A packed second document gives the same logits as the document on its own.
    seg = np.array([[0] * 5 + [1] * 7])
    pos = np.array([list(range(5)) + list(range(7))])
    packed = model(jnp.asarray(tokens), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
    alone = model(jnp.asarray(tokens[:, 5:]))
    assert rel_err(packed[:, 5:], alone) < 1e-5


# One compiled gradient program per model: eagerly, every op of the forward and the
# backward (and of each remat policy's recomputation) dispatches and compiles apart.
_grads = nnx.jit(nnx.grad(loss_fn))


@pytest.fixture(scope="module")
def remat_batch_and_reference():
    """A batch and ``SMALL``'s gradients on it, without remat: each policy's reference."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, SMALL.vocab_size, (2, 9)))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return batch, _grads(Transformer(SMALL, rngs=nnx.Rngs(0)), batch)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch", "names"])
def test_remat_policies_keep_gradients(remat_batch_and_reference, remat):
    batch, want = remat_batch_and_reference
    model = Transformer(SMALL, rngs=nnx.Rngs(0), remat=Remat(remat, ("query", "key", "value")))
    assert tree_rel_err(_grads(model, batch), want) < 1e-5


def test_gpt2_style_and_bfloat16_compute(rng):
    tokens = jnp.asarray(rng.integers(0, SMALL.vocab_size, (2, 9)))
    f32 = Transformer(GPT2_STYLE, rngs=nnx.Rngs(0))(tokens)
    bf16 = Transformer(dataclasses.replace(GPT2_STYLE, dtype="bfloat16"), rngs=nnx.Rngs(0))(tokens)
    assert f32.dtype == jnp.float32 and bf16.dtype == jnp.bfloat16
    assert rel_err(bf16.astype(jnp.float32), f32) < 5e-2


@pytest.mark.slow
def test_param_dtype_is_separate_from_compute_dtype():
    model = Transformer(dataclasses.replace(SMALL, param_dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert {v.dtype for v in jax.tree.leaves(nnx.state(model))} == {jnp.dtype("bfloat16")}
    assert model(jnp.zeros((1, 4), jnp.int32)).dtype == jnp.float32


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(heads=6, kv_heads=4), "model.heads=6 must be a multiple of model.kv_heads=4"),
        (dict(layers=0), "model.layers=0 must be a positive int"),
        (dict(norm="batch"), "model.norm='batch' must be one of"),
        (dict(dtype="float64"), "model.dtype='float64' must be"),
    ],
)
def test_config_errors(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **change)


def test_remat_errors():  # remat is the model's argument (the run's layout), not its config
    with pytest.raises(ValueError, match="model.remat='sometimes' must be one of"):
        Remat("sometimes")


def test_presets_build_abstractly():
    for name, cfg in PRESETS.items():
        model = nnx.eval_shape(lambda cfg=cfg: Transformer(cfg, rngs=nnx.Rngs(0)))
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        assert n > 0, name
    one_b = nnx.eval_shape(lambda: Transformer(PRESETS["1b"], rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(one_b)))
    assert count > 1.2e9 and count < 1.3e9, count
