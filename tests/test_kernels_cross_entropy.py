"""The fused linear + cross-entropy Pallas kernels (interpret mode) against the plain-jnp
reference: losses and gradients, token counts and vocabularies that are not multiples of
the tiles, float32 and bfloat16."""

import jax
import jax.numpy as jnp
import pytest

from conftest import rel_err
from jaxpar.kernels import linear_cross_entropy, linear_cross_entropy_reference


def inputs(rng, N, D, V, dtype):
    x = jnp.asarray(rng.standard_normal((N, D)), dtype)
    w = jnp.asarray(rng.standard_normal((D, V)) / D**0.5 * 3, dtype)
    targets = jnp.asarray(rng.integers(0, V, N), jnp.int32)
    g = jnp.asarray(rng.uniform(0.5, 1.5, N), jnp.float32)  # per-token weights of the loss
    return x, w, targets, g


@pytest.mark.parametrize("N,D,V,block_tokens,chunk", [
    (37, 32, 300, 16, 128),   # neither N nor V a multiple of its tile
    (32, 64, 256, 16, 64),    # exact tiles, four chunks
    (5, 16, 1000, 8, 256),    # fewer tokens than one block
])
def test_losses_and_gradients_match_the_reference(rng, N, D, V, block_tokens, chunk):
    x, w, targets, g = inputs(rng, N, D, V, jnp.float32)

    def fused(x, w):
        return linear_cross_entropy(x, w, targets, block_tokens=block_tokens, chunk=chunk, interpret=True)

    def reference(x, w):
        return linear_cross_entropy_reference(x, w, targets)

    assert rel_err(fused(x, w), reference(x, w)) < 1e-5
    got = jax.grad(lambda x, w: jnp.sum(fused(x, w) * g), (0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(reference(x, w) * g), (0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5


def test_bfloat16_inputs(rng):
    x, w, targets, g = inputs(rng, 24, 32, 200, jnp.bfloat16)
    loss = linear_cross_entropy(x, w, targets, interpret=True)
    assert loss.dtype == jnp.float32
    assert rel_err(loss, linear_cross_entropy_reference(x, w, targets)) < 2e-2
    dx, dw = jax.grad(lambda x, w: jnp.sum(linear_cross_entropy(x, w, targets, interpret=True) * g),
                      (0, 1))(x, w)
    rx, rw = jax.grad(lambda x, w: jnp.sum(linear_cross_entropy_reference(x, w, targets) * g), (0, 1))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    assert rel_err(dx, rx) < 2e-2 and rel_err(dw, rw) < 2e-2


def test_bad_shapes(rng):
    x, w, targets, _ = inputs(rng, 4, 8, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"x \[N, D\], w \[D, V\], targets \[N\]; got \(4, 8\), \(9, 16\)"):
        linear_cross_entropy(x, jnp.ones((9, 16)), targets)
