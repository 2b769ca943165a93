import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import greedy_without_cache, rel_err
from flax import nnx
from jaxpar import use_execution
from jaxpar.kernels.dispatch import KernelOptions
from jaxpar.models import ModelConfig, Transformer
from jaxpar.models.cache import init_cache

from jaxpar.inference.decoding import generate, sample

CFG = ModelConfig(vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=48, init_std=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(
    CFG, norm="layer", mlp="gelu", position="learned", max_position=64, tie_embeddings=True,
    attention_bias=True, mlp_bias=True)], ids=["llama", "gpt2"])
def test_greedy_with_cache_equals_greedy_recomputed(rng, cfg):
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    prompt = rng.integers(0, cfg.vocab_size, (2, 7))
    cached = np.stack(list(generate(model, prompt, max_new_tokens=12)), axis=1)
    reference = greedy_without_cache(model, prompt, 12)
    assert len(set(reference.ravel().tolist())) > 3  # not a degenerate repeat of one token
    np.testing.assert_array_equal(cached, reference)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_cached_logits_equal_full_forward(rng, impl):
    """Prefill then steps over the cache; with execution.attention=pallas the steps run the
    Pallas decode kernel (interpret mode) and the full forward the flash kernel. Jitted
    (new jits per case, traced under its execution): three programs, where eagerly each
    operation compiles its own."""
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 10)))
    forward = nnx.jit(lambda m, t: m(t))
    decode = nnx.jit(lambda m, t, c: m.decode(t, c)[:2])
    with use_execution(kernels=KernelOptions(attention=impl)):
        full = forward(model, tokens)
        cache = init_cache(CFG, 2, 16)
        first, cache = decode(model, tokens[:, :6], cache)
        stepped = [first]
        for i in range(6, 10):
            logits, cache = decode(model, tokens[:, i : i + 1], cache)
            stepped.append(logits)
    np.testing.assert_array_equal(cache.lengths, [10, 10])
    assert rel_err(jnp.concatenate(stepped, axis=1), full) < 1e-5


def test_sampling_rules(rng):
    """``sample`` jitted, as the decoders run it: called eagerly, its nucleus's
    ``fori_loop`` is traced and compiled again at every call (200 draws: 225 compiles,
    9 s of CPU). The 200 draws (keys 0..199) in one vmapped call."""
    import jax

    logits = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    key = jax.random.key(0)
    jitted = jax.jit(sample)
    np.testing.assert_array_equal(jitted(logits, key, 0.0, 1.0), np.argmax(logits, -1))
    # top_p tiny keeps only the most likely token, whatever the temperature.
    np.testing.assert_array_equal(jitted(logits, key, 5.0, 1e-6), np.argmax(logits, -1))
    keys = jax.vmap(jax.random.key)(jnp.arange(200))
    draws = np.asarray(jax.jit(jax.vmap(sample, in_axes=(None, 0, None, None)))(logits, keys, 1.0, 1.0))
    assert draws.shape == (200, 4)
    assert len(np.unique(draws[:, 0])) > 3


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.9, 0.999])
def test_nucleus_equals_sorted_reference(rng, top_p):
    """``probabilities``' nucleus (a bisection, no sort) against the sorted rule in
    numpy (float64): a token is kept when the tokens more likely than it fall short of
    ``top_p``. Rows of logits at different scales, so the nuclei's sizes spread."""
    from jaxpar.inference.sampling import probabilities

    logits = rng.standard_normal((6, 512)) * rng.uniform(0.5, 4, (6, 1))
    for temperature in (0.7, 1.3):
        got = np.asarray(probabilities(jnp.asarray(logits, jnp.float32), temperature, top_p))
        scaled = logits / temperature
        probs = np.exp(scaled - scaled.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        order = np.argsort(-probs, axis=-1)
        ranked = np.take_along_axis(probs, order, -1)
        keep = np.zeros_like(probs, bool)
        np.put_along_axis(keep, order, np.cumsum(ranked, -1) - ranked < top_p, -1)
        want = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum(-1, keepdims=True)
        np.testing.assert_array_equal(got > 0, keep)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        sizes = keep.sum(-1)  # the rows' nuclei differ (top_p tiny: the argmax alone)
        assert (sizes == 1).all() if top_p < 1e-3 else len(set(sizes)) > 2


@pytest.mark.slow
def test_stops_at_any_eos_id_per_sequence(rng):
    """Several end-of-sequence ids: each sequence stops at its first (then repeats it),
    generation once every sequence has. Batch 2 and 12 tokens: without end ids, the
    programs test_greedy_with_cache_equals_greedy_recomputed[llama] compiled."""
    model = Transformer(CFG, rngs=nnx.Rngs(3))
    prompt = rng.integers(0, CFG.vocab_size, (2, 5))
    free = np.stack(list(generate(model, prompt, max_new_tokens=12)), axis=1)
    eos = (int(free[0, 1]), int(free[1, 3]))
    out = np.stack(list(generate(model, prompt, max_new_tokens=12, eos_ids=eos)), axis=1)
    stops = [next(i for i, t in enumerate(row) if t in eos) for row in free]
    assert out.shape == (2, max(stops) + 1)
    for row, got, stop in zip(free, out, stops):
        np.testing.assert_array_equal(got[: stop + 1], row[: stop + 1])
        assert (got[stop:] == row[stop]).all()
    with pytest.raises(ValueError, match="eos_ids=3 must be a sequence of token ids"):
        next(generate(model, prompt, max_new_tokens=12, eos_ids=3))
