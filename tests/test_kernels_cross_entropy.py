"""The fused linear + cross-entropy Pallas kernels (interpret mode) against the plain-jnp
reference: losses and gradients, token counts and vocabularies that are not multiples of
the tiles, widths D 576 and 768 (not powers of two), float32 and bfloat16; and the
vocab-parallel loss built on them."""

import functools

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
    """Cast by numpy and put on the device as they are (jnp.asarray would compile a
    conversion program per shape)."""
    x = jax.device_put(rng.standard_normal((N, D)).astype(dtype))
    w = jax.device_put((rng.standard_normal((D, V)) / D**0.5 * 3).astype(dtype))
    targets = jax.device_put(rng.integers(0, V, N).astype(np.int32))
    g = jax.device_put(rng.uniform(0.5, 1.5, N).astype(np.float32))  # per-token weights of the loss
    return x, w, targets, g


# Each side is one jitted program returning the losses and the gradients of sum(losses *
# g) in x and w (the forward traced once, for both): interpret mode is costly to trace
# and compile, and the reference run eagerly compiles each of its ops apart.


def _losses_and_grads(losses, x, w, targets, g):
    def loss(x, w):
        out = losses(x, w, targets)
        return jnp.sum(out * g), out

    grads, out = jax.grad(loss, (0, 1), has_aux=True)(x, w)
    return out, grads


@functools.partial(jax.jit, static_argnames=("block_tokens", "chunk"))
def kernel_and_grads(x, w, targets, g, *, block_tokens, chunk):
    fused = functools.partial(linear_cross_entropy, block_tokens=block_tokens, chunk=chunk, interpret=True)
    return _losses_and_grads(fused, x, w, targets, g)


@jax.jit
def reference_and_grads(x, w, targets, g):
    return _losses_and_grads(linear_cross_entropy_reference, x, w, targets, g)


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
    got, got_grads = kernel_and_grads(x, w, targets, g, block_tokens=block_tokens, chunk=chunk)
    want, want_grads = reference_and_grads(x, w, targets, g)
    assert rel_err(got, want) < 1e-5
    for a, b in zip(got_grads, want_grads, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.slow
def test_bfloat16_inputs(rng):
    x, w, targets, g = inputs(rng, 24, 32, 200, jnp.bfloat16)
    loss, (dx, dw) = kernel_and_grads(x, w, targets, g, block_tokens=16, chunk=128)  # the defaults
    want, (rx, rw) = reference_and_grads(x, w, targets, g)
    assert loss.dtype == jnp.float32
    assert rel_err(loss, want) < 2e-2
    assert dx.dtype == dw.dtype == jnp.bfloat16
    assert rel_err(dx, rx) < 2e-2 and rel_err(dw, rw) < 2e-2


def test_bad_shapes(rng):
    x, w, targets, _ = inputs(rng, 4, 8, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"x \[N, D\], w \[D, V\], targets \[N\]; got \(4, 8\), \(9, 16\)"):
        linear_cross_entropy(x, np.ones((9, 16), np.float32), targets)
    with pytest.raises(ValueError, match="chunk=48 must be a power of two >= 16"):
        linear_cross_entropy(x, w, targets, chunk=48)


def test_targets_outside_the_vocabulary_pick_nothing(rng):
    """A vocabulary slice's statistics: targets beyond its end (inside the last, partial
    chunk too) or before its start pick 0; the log-sum-exp is the slice's."""
    x, w, _, _ = inputs(rng, 20, 16, 100, jnp.float32)  # V=100: chunk 64's second tile is partial
    targets = rng.choice([-5, 3, 99, 100, 120, 500], 20).astype(np.int32)
    kernel = functools.partial(log_sum_exp_and_target_logit, chunk=64, interpret=True)
    lse, picked = jax.jit(kernel)(x, w, targets)
    want_lse, want_picked = jax.jit(log_sum_exp_and_target_logit_reference)(x, w, targets)
    assert rel_err(lse, want_lse) < 1e-5 and rel_err(picked, want_picked) < 1e-5
    outside = (targets < 0) | (targets >= 100)
    assert bool(outside.any()) and not np.asarray(picked)[outside].any()


@jax.jit
def one_device_loss_and_grads(x, w, targets, g):
    """The reference's weighted loss over ``x [B, T, D]`` and its gradients in x and w;
    one program for both meshes."""
    def loss(x, w):
        losses = linear_cross_entropy_reference(x.reshape(-1, x.shape[-1]), w, targets.reshape(-1))
        return jnp.sum(losses * g.reshape(-1))

    return jax.value_and_grad(loss, (0, 1))(x, w)


@pytest.mark.parametrize("sizes", [dict(tensor=2), dict(data=2, tensor=4)],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_vocab_parallel_loss_matches_one_device(rng, sizes):
    """jaxpar.ops.kernel_ops.token_losses with the vocabulary split over tensor (each device's slice
    through the kernel, the statistics combined across slices) equals the one-device loss,
    and so do its gradients."""
    B, T, D, V = 4, 8, 32, 200
    x = jax.device_put(rng.standard_normal((B, T, D)).astype(np.float32))
    w = jax.device_put((rng.standard_normal((D, V)) / 4).astype(np.float32))
    targets = jax.device_put(rng.integers(0, V, (B, T)).astype(np.int32))
    g = jax.device_put(rng.uniform(0.5, 1.5, (B, T)).astype(np.float32))

    def parallel(x, w):
        return jnp.sum(kernel_ops.token_losses(x, w, targets) * g)

    mesh = jaxpar.make_mesh(**sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
    with use_mesh(mesh), use_execution(kernels=KernelOptions(loss="pallas")):
        got = jax.jit(jax.value_and_grad(parallel, (0, 1)))(x, w)
    want = one_device_loss_and_grads(x, w, targets, g)
    assert rel_err(got[0], want[0]) < 1e-5
    for a, b in zip(got[1], want[1], strict=True):
        assert rel_err(a, b) < 1e-5
