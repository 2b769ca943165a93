"""The flash attention Pallas kernels (interpret mode) against the plain-jnp reference,
and the reference against the model's own attention: outputs and gradients; causal or
not, sliding windows, packed documents, grouped-query ratios 1/4/8, lengths that are not
multiples of the blocks, head_dim 64/72/80/96/128/256, float32, bfloat16 and float16. Then the
ring attention's step (block_update / block_grads) against jaxpar.parallel.sequence's
plain-XLA step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxpar.parallel import sequence as sequence_parallel
from jaxpar.parallel.zigzag import zigzag_order
from jaxpar.ops.attention import dot_product_attention
from jaxpar.kernels import flash_attention
from jaxpar.kernels.flash_attention import (block_grads, block_update, flash_attention_reference)


def normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def documents(rng, B, T, count=3):
    """Sorted random segment ids ``[B, T]``: ``count`` packed documents of random lengths."""
    return jnp.asarray(np.sort(rng.integers(0, count, (B, T)), axis=1), jnp.int32)


def inputs(rng, B, T, N, K, H, dtype=jnp.float32):
    return (normal(rng, (B, T, N, H), dtype), normal(rng, (B, T, K, H), dtype),
            normal(rng, (B, T, K, H), dtype), normal(rng, (B, T, N, H), dtype))


CASES = [  # causal, window, packed, T, N, K, H
    (True, None, False, 37, 4, 4, 32),   # odd length, MHA
    (True, None, True, 40, 8, 2, 32),    # packed documents, GQA 4
    (False, None, True, 33, 8, 1, 32),   # not causal, MQA (8)
    (True, 7, False, 45, 4, 2, 32),      # sliding window
    (False, 6, True, 29, 2, 2, 32),      # window both ways, packed
]


@pytest.mark.slow
@pytest.mark.parametrize("causal,window,packed,T,N,K,H", CASES)
def test_outputs_and_gradients_match_the_reference(rng, causal, window, packed, T, N, K, H):
    q, k, v, g = inputs(rng, 2, T, N, K, H)
    segment_ids = documents(rng, 2, T) if packed else None
    options = dict(causal=causal, segment_ids=segment_ids, window=window)

    def kernel(q, k, v):
        return flash_attention(q, k, v, **options, block_q=16, block_k=16, interpret=True)

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, **options)

    assert rel_err(jax.jit(kernel)(q, k, v), reference(q, k, v)) < 1e-5
    got = jax.jit(jax.grad(lambda *a: jnp.sum(kernel(*a) * g), (0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * g), (0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("H", [72, 80, 96, 128, 256])  # 64: test_half_precision_inputs
def test_head_dims(rng, H):
    """Powers of two, and GPT-2's / SmolLM2's / Qwen's 72, 80, 96 (padded to 128 inside)."""
    q, k, v, g = inputs(rng, 1, 24, 2, 1, H)

    def kernel(q, k, v):
        return flash_attention(q, k, v, causal=True, block_q=16, block_k=16, interpret=True)

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, causal=True)

    assert rel_err(jax.jit(kernel)(q, k, v), reference(q, k, v)) < 1e-5
    got = jax.jit(jax.grad(lambda *a: jnp.sum(kernel(*a) * g), (0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * g), (0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(rng, dtype):
    q, k, v, g = inputs(rng, 2, 35, 4, 1, 64, dtype)
    segment_ids = documents(rng, 2, 35)

    def kernel(q, k, v):
        return flash_attention(q, k, v, causal=True, segment_ids=segment_ids, block_q=16,
                               block_k=32, interpret=True)

    def reference(*args):  # the float32 computation on the same (rounded) inputs
        args = [a.astype(jnp.float32) for a in args]
        return flash_attention_reference(*args, causal=True, segment_ids=segment_ids)

    out = jax.jit(kernel)(q, k, v)
    assert out.dtype == dtype and rel_err(out, reference(q, k, v)) < 2e-2
    got = jax.jit(jax.grad(lambda *a: jnp.sum(kernel(*a).astype(jnp.float32) * g), (0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * g.astype(jnp.float32)), (0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == dtype and rel_err(a, b) < 2e-2


@pytest.mark.slow
def test_reference_is_the_models_attention(rng):
    """The reference against an independent implementation: jaxpar.dot_product_attention
    (causal, packed documents, grouped-query heads)."""
    q, k, v, _ = inputs(rng, 2, 30, 8, 2, 16)
    segment_ids = documents(rng, 2, 30)
    want = dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids)
    assert rel_err(flash_attention_reference(q, k, v, causal=True, segment_ids=segment_ids), want) < 1e-5
    assert rel_err(flash_attention(q, k, v, causal=True, segment_ids=segment_ids, block_q=16,
                                   block_k=16, interpret=True), want) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("T,S,window", [(20, 45, None), (45, 20, 6)])
def test_causal_mask_is_aligned_bottom_right(rng, T, S, window):
    """T != S: query t sees keys s <= t + S - T (the queries are the last T tokens, as
    jaxpar.dot_product_attention has it); with T > S the first T - S queries see nothing
    and give zeros. Kernel against the reference, outputs and gradients; the reference
    against dot_product_attention (T < S) and an explicit bottom-right mask."""
    q, _, _, g = inputs(rng, 2, T, 4, 2, 16)
    k, v = normal(rng, (2, S, 2, 16)), normal(rng, (2, S, 2, 16))
    options = dict(causal=True, window=window)

    def kernel(q, k, v):
        return flash_attention(q, k, v, **options, block_q=16, block_k=16, interpret=True)

    def reference(q, k, v):
        return flash_attention_reference(q, k, v, **options)

    want = reference(q, k, v)
    distance = jnp.arange(T)[:, None] + S - T - jnp.arange(S)[None, :]
    mask = (distance >= 0) & (distance < (window or S + T))
    explicit = dot_product_attention(q, k, v, causal=False, mask=jnp.broadcast_to(mask, (2, T, S)))
    assert rel_err(want, explicit) < 1e-5
    if T < S:
        assert rel_err(want, dot_product_attention(q, k, v, causal=True)) < 1e-5
    else:
        assert not want[:, :T - S].any() and want[:, T - S:].all()
    assert rel_err(jax.jit(kernel)(q, k, v), want) < 1e-5
    got = jax.jit(jax.grad(lambda *a: jnp.sum(kernel(*a) * g), (0, 1, 2)))(q, k, v)
    grads = jax.grad(lambda *a: jnp.sum(reference(*a) * g), (0, 1, 2))(q, k, v)
    for a, b in zip(got, grads, strict=True):
        assert rel_err(a, b) < 1e-5


def test_the_default_runs_the_reference_on_cpu(rng):
    q, k, v, _ = inputs(rng, 1, 20, 2, 2, 16)
    assert rel_err(flash_attention(q, k, v, causal=False),
                   flash_attention_reference(q, k, v, causal=False)) < 1e-6


# ------------------------------------------------------------ the ring's inner step


def grouped(x, K):
    """``[B, T, N, H]`` -> the ring's ``[B, T, K, G, H]``."""
    return x.reshape(*x.shape[:2], K, x.shape[2] // K, x.shape[3])


@pytest.mark.slow
def test_block_steps_match_the_ring_step(rng):
    """Two ring steps over the two halves of a zigzag-ordered sequence, from a random
    running state (forward), and block_grads (backward), against sequence_parallel's XLA
    step; the kernels get explicit, non-contiguous positions."""
    B, T, N, K, H = 2, 24, 4, 2, 16
    q, k, v, do = inputs(rng, B, T, N, K, H)
    q_pos = jnp.asarray(zigzag_order(T, 2), jnp.int32)
    seg = documents(rng, B, T)
    o = normal(rng, (B, T, N, H))
    lse = normal(rng, (B, N, T)).at[:, :, :3].set(-jnp.inf)  # three rows have seen nothing
    as_ring_lse = lambda x: x.reshape(B, K, N // K, T)  # noqa: E731
    got, want = (o, lse), (grouped(o, K), as_ring_lse(lse))
    for half in (slice(0, T // 2), slice(T // 2, T)):
        k_pos, k_seg = q_pos[half], seg[:, half]
        got = block_update(q, k[:, half], v[:, half], *got, q_pos, k_pos, seg, k_seg, causal=True,
                           block_q=8, block_k=8, interpret=True)
        want = sequence_parallel.block_update(grouped(q, K), k[:, half], v[:, half], *want, q_pos,
                                              k_pos, seg, k_seg, causal=True)
    assert rel_err(got[0], want[0].reshape(B, T, N, H)) < 1e-5
    assert rel_err(got[1], want[1].reshape(B, N, T)) < 1e-5

    lse, delta = got[1], normal(rng, (B, N, T))
    half = slice(T // 2, T)
    dq, dk, dv = block_grads(q, k[:, half], v[:, half], do, lse, delta, q_pos, q_pos[half], seg,
                             seg[:, half], causal=True, block_q=8, block_k=8, interpret=True)
    rq, rk, rv = sequence_parallel.block_grads(
        grouped(q, K), k[:, half], v[:, half], grouped(do, K), as_ring_lse(lse), as_ring_lse(delta),
        q_pos, q_pos[half], seg, seg[:, half], causal=True)
    assert rel_err(dq, rq.reshape(B, T, N, H)) < 1e-5
    assert rel_err(dk, rk) < 1e-5 and rel_err(dv, rv) < 1e-5


def test_a_block_nobody_sees_changes_nothing(rng):
    B, T, N, H = 1, 16, 2, 16
    q, k, v, _ = inputs(rng, B, T, N, N, H)
    o, lse = normal(rng, (B, T, N, H)), normal(rng, (B, N, T))
    later = jnp.arange(T, 2 * T, dtype=jnp.int32)  # every key after every query
    new_o, new_lse = block_update(q, k, v, o, lse, jnp.arange(T, dtype=jnp.int32), later,
                                  causal=True, interpret=True)
    np.testing.assert_array_equal(new_o, o)
    np.testing.assert_array_equal(new_lse, lse)


def test_bad_inputs(rng):
    q, k, v, _ = inputs(rng, 1, 8, 3, 2, 16)
    with pytest.raises(ValueError, match="query heads N=3 must be a multiple of key/value heads K=2"):
        flash_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"q \[B, T, N, H\], k and v \[B, S, K, H\]; got q=\(8, 3, 16\)"):
        flash_attention(q[0], k, v, causal=True)
    with pytest.raises(ValueError, match="window=0 must be at least 1"):
        flash_attention(q, k[:, :, :1], v[:, :, :1], causal=True, window=0)
