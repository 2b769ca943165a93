"""The fused linear + cross-entropy Pallas kernels (interpret mode) against the plain-jnp
reference: losses and gradients, token counts and vocabularies that are not multiples of
the tiles, widths D 576 and 768 (not powers of two), float32 and bfloat16; and the
vocab-parallel loss built on them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from conftest import rel_err
from jaxpar.ops import kernel_ops
from jaxpar import use_execution
from jaxpar.kernels import (KernelOptions, linear_cross_entropy,
                            linear_cross_entropy_reference, log_sum_exp_and_target_logit)
from jaxpar.kernels.cross_entropy import log_sum_exp_and_target_logit_reference
from jaxpar.placement.sharding import use_mesh


def inputs(rng, N, D, V, dtype):
    x = jnp.asarray(rng.standard_normal((N, D)), dtype)
    w = jnp.asarray(rng.standard_normal((D, V)) / D**0.5 * 3, dtype)
    targets = jnp.asarray(rng.integers(0, V, N), jnp.int32)
    g = jnp.asarray(rng.uniform(0.5, 1.5, N), jnp.float32)  # per-token weights of the loss
    return x, w, targets, g


@pytest.mark.slow
@pytest.mark.parametrize("N,D,V,block_tokens,chunk", [
    (37, 32, 300, 16, 128),   # neither N nor V a multiple of its tile
    (32, 64, 256, 16, 64),    # exact tiles, four chunks
    (5, 16, 1000, 16, 256),   # fewer tokens than one block
    (9, 576, 100, 16, 64),    # D not a power of two (SmolLM2), partial chunk
    (3, 768, 40, 16, 32),     # D not a power of two (GPT-2)
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


@pytest.mark.slow
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
    with pytest.raises(ValueError, match="chunk=48 must be a power of two >= 16"):
        linear_cross_entropy(x, w, targets, chunk=48)


def test_targets_outside_the_vocabulary_pick_nothing(rng):
    """A vocabulary slice's statistics: targets beyond its end (inside the last, partial
    chunk too) or before its start pick 0; the log-sum-exp is the slice's."""
    x, w, _, _ = inputs(rng, 20, 16, 100, jnp.float32)  # V=100: chunk 64's second tile is partial
    targets = jnp.asarray(rng.choice([-5, 3, 99, 100, 120, 500], 20), jnp.int32)
    lse, picked = log_sum_exp_and_target_logit(x, w, targets, chunk=64, interpret=True)
    want_lse, want_picked = log_sum_exp_and_target_logit_reference(x, w, targets)
    assert rel_err(lse, want_lse) < 1e-5 and rel_err(picked, want_picked) < 1e-5
    outside = (targets < 0) | (targets >= 100)
    assert bool(outside.any()) and not bool(picked[outside].any())


@pytest.mark.parametrize("sizes", [dict(tensor=2), dict(data=2, tensor=4)],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_vocab_parallel_loss_matches_one_device(rng, sizes):
    """jaxpar.ops.kernel_ops.token_losses with the vocabulary split over tensor (each device's slice
    through the kernel, the statistics combined across slices) equals the one-device loss,
    and so do its gradients."""
    B, T, D, V = 4, 8, 32, 200
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((D, V)) / 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    g = jnp.asarray(rng.uniform(0.5, 1.5, (B, T)), jnp.float32)

    def reference(x, w):
        return jnp.sum(linear_cross_entropy_reference(x.reshape(-1, D), w, targets.reshape(-1)) * g.reshape(-1))

    def parallel(x, w):
        return jnp.sum(kernel_ops.token_losses(x, w, targets) * g)

    mesh = jaxpar.make_mesh(**sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
    with use_mesh(mesh), use_execution(kernels=KernelOptions(loss="pallas")):
        got = jax.jit(jax.value_and_grad(parallel, (0, 1)))(x, w)
    want = jax.value_and_grad(reference, (0, 1))(x, w)
    assert rel_err(got[0], want[0]) < 1e-5
    for a, b in zip(got[1], want[1], strict=True):
        assert rel_err(a, b) < 1e-5
