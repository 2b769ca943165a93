"""The fused RMSNorm / LayerNorm Pallas kernels (interpret mode) against the plain-jnp
reference: outputs and gradients, row counts that are not a multiple of the block, widths
D that are not powers of two (576, 768),
float32 and bfloat16, and the dispatch rule."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxpar.kernels import norm, norm_reference, use_pallas
from jaxpar.models import ModelConfig
from jaxpar.models.transformer import Norm


def inputs(rng, shape, dtype, kind):
    """Fresh random inputs, off-centre so LayerNorm's mean matters; every output nonzero,
    so an element the kernel failed to write cannot pass for a right one. (Cast by numpy
    and put on the device as they are: jnp.asarray would compile a conversion program
    per shape.)"""
    D = shape[-1]
    x = jax.device_put((rng.standard_normal(shape) * 2 + 0.5).astype(dtype))
    scale = jax.device_put((1 + rng.standard_normal(D) * 0.1).astype(np.float32))
    bias = jax.device_put(rng.standard_normal(D).astype(np.float32)) if kind == "layer" else None
    return x, scale, bias


# Each side is one jitted program returning the output and the gradients of
# sum(out * g) in x, scale (and bias): interpret mode is costly to trace and compile, and
# the reference run eagerly compiles each of its ops apart.


def _output_and_grads(fn, x, scale, bias, g):
    def loss(*args):
        out = fn(*args)
        return jnp.sum(out.astype(jnp.float32) * g), out

    argnums = (0, 1) if bias is None else (0, 1, 2)
    grads, out = jax.grad(loss, argnums, has_aux=True)(x, scale, bias)
    return out, grads


@functools.partial(jax.jit, static_argnames=("kind", "block_rows"))
def kernel_and_grads(x, scale, bias, g, *, kind, block_rows):
    kernel = functools.partial(norm, kind=kind, block_rows=block_rows, interpret=True)
    return _output_and_grads(kernel, x, scale, bias, g)


@functools.partial(jax.jit, static_argnames="kind")
def reference_and_grads(x, scale, bias, g, *, kind):
    return _output_and_grads(functools.partial(norm_reference, kind=kind), x, scale, bias, g)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("shape,block_rows", [((37, 64), 8), ((2, 5, 128), 4), ((3, 256), 8),
                                              ((5, 576), 4), ((3, 768), 2)])  # D not a power of 2
def test_forward_and_gradients_match_the_reference(rng, kind, shape, block_rows):
    x, scale, bias = inputs(rng, shape, jnp.float32, kind)
    g = jax.device_put(rng.standard_normal(shape).astype(np.float32))
    got, got_grads = kernel_and_grads(x, scale, bias, g, kind=kind, block_rows=block_rows)
    want, want_grads = reference_and_grads(x, scale, bias, g, kind=kind)
    assert rel_err(got, want) < 1e-5
    for a, b in zip(got_grads, want_grads, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_bfloat16_inputs(rng, kind):
    """Output, and the gradient in x of sum(out) (g = 1), against the reference's."""
    x, scale, bias = inputs(rng, (19, 128), jnp.bfloat16, kind)
    ones = np.ones(x.shape, np.float32)
    got, (dx, *_) = kernel_and_grads(x, scale, bias, ones, kind=kind, block_rows=8)  # the default rows
    want, (ref, *_) = reference_and_grads(x, scale, bias, ones, kind=kind)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, want) < 2e-2
    assert dx.dtype == jnp.bfloat16 and rel_err(dx, ref) < 2e-2


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_the_reference_is_the_models_norm(rng, kind):
    from flax import nnx

    cfg = ModelConfig(vocab_size=16, dim=32, layers=1, heads=2, kv_heads=2, head_dim=16, mlp_dim=64,
                      norm=kind)
    layer = nnx.eval_shape(lambda: Norm(cfg, rngs=nnx.Rngs(0)))  # no initialiser to compile: set below
    x, scale, bias = inputs(rng, (3, 7, 32), jnp.float32, kind)
    layer.scale.set_value(scale)
    if bias is not None:
        layer.bias.set_value(bias)
    kernel = jax.jit(functools.partial(norm, kind=kind, eps=cfg.norm_eps, interpret=True))
    assert rel_err(kernel(x, scale, bias), nnx.jit(lambda layer, x: layer(x))(layer, x)) < 1e-5


def test_dispatch_and_bad_arguments(rng):
    assert use_pallas(True) and use_pallas(False)
    assert use_pallas(None) == (jax.default_backend() == "gpu")
    x, scale, _ = inputs(rng, (4, 16), jnp.float32, "rms")
    np.testing.assert_array_equal(norm(x, scale), norm_reference(x, scale))  # CPU: the reference
    with pytest.raises(ValueError, match="norm kind must be one of .*not 'batch'"):
        norm(x, scale, kind="batch")
    with pytest.raises(ValueError, match="kind='layer' takes a bias"):
        norm(x, scale, kind="layer")
    with pytest.raises(ValueError, match="block_rows=6 must be a power of two"):
        norm(x, scale, block_rows=6, interpret=True)
    with pytest.raises(ValueError, match=r"scale and bias \[D\]; got x \(4, 16\), scale \(8,\)"):
        norm(x, scale[:8])
