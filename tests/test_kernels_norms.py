"""The fused RMSNorm / LayerNorm Pallas kernels (interpret mode) against the plain-jnp
reference: outputs and gradients, row counts that are not a multiple of the block, widths
D that are not powers of two (576, 768),
float32 and bfloat16, and the dispatch rule."""

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
    so an element the kernel failed to write cannot pass for a right one."""
    D = shape[-1]
    x = jnp.asarray(rng.standard_normal(shape) * 2 + 0.5, dtype)
    scale = jnp.asarray(1 + rng.standard_normal(D) * 0.1, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(D), jnp.float32) if kind == "layer" else None
    return x, scale, bias


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("shape,block_rows", [((37, 64), 8), ((2, 5, 128), 4), ((3, 256), 8),
                                              ((5, 576), 4), ((3, 768), 2)])  # D not a power of 2
def test_forward_and_gradients_match_the_reference(rng, kind, shape, block_rows):
    x, scale, bias = inputs(rng, shape, jnp.float32, kind)
    g = jnp.asarray(rng.standard_normal(shape), jnp.float32)

    def loss(fn):
        return lambda *args: jnp.sum(fn(*args) * g)

    kernel = lambda x, s, b: norm(x, s, b, kind=kind, block_rows=block_rows, interpret=True)  # noqa: E731
    reference = lambda x, s, b: norm_reference(x, s, b, kind=kind)  # noqa: E731
    assert rel_err(kernel(x, scale, bias), reference(x, scale, bias)) < 1e-5
    argnums = (0, 1, 2) if kind == "layer" else (0, 1)
    got = jax.grad(loss(kernel), argnums)(x, scale, bias)
    want = jax.grad(loss(reference), argnums)(x, scale, bias)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_bfloat16_inputs(rng, kind):
    x, scale, bias = inputs(rng, (19, 128), jnp.bfloat16, kind)
    got = norm(x, scale, bias, kind=kind, interpret=True)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, norm_reference(x, scale, bias, kind=kind)) < 2e-2
    dx = jax.grad(lambda x: jnp.sum(norm(x, scale, bias, kind=kind, interpret=True).astype(jnp.float32)))(x)
    ref = jax.grad(lambda x: jnp.sum(norm_reference(x, scale, bias, kind=kind).astype(jnp.float32)))(x)
    assert dx.dtype == jnp.bfloat16 and rel_err(dx, ref) < 2e-2


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_the_reference_is_the_models_norm(rng, kind):
    from flax import nnx

    cfg = ModelConfig(vocab_size=16, dim=32, layers=1, heads=2, kv_heads=2, head_dim=16, mlp_dim=64,
                      norm=kind)
    layer = Norm(cfg, rngs=nnx.Rngs(0))
    x, scale, bias = inputs(rng, (3, 7, 32), jnp.float32, kind)
    layer.scale[...] = scale
    if bias is not None:
        layer.bias[...] = bias
    assert rel_err(norm(x, scale, bias, kind=kind, eps=cfg.norm_eps, interpret=True), layer(x)) < 1e-5


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
