"""The flash attention Pallas kernels (interpret mode) against the plain-jnp reference,
and the reference against the model's own attention: outputs and gradients; causal or
not, sliding windows, packed documents, grouped-query ratios 1/4/8, lengths that are not
multiples of the blocks, head_dim 64/72/80/96/128/256, float32, bfloat16 and float16. Then the
ring attention's step (block_update / block_grads) against jaxpar.parallel.sequence's
plain-XLA step."""

import functools

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


# Inputs are cast by numpy and put on the device as they are: jnp.asarray compiles a
# program per shape to convert or stage them (and eager slicing one per slice), which in
# this file cost more than some of the checks.


def normal(rng, shape, dtype=jnp.float32):
    return jax.device_put(rng.standard_normal(shape).astype(dtype))


def documents(rng, B, T, count=3):
    """Sorted random segment ids ``[B, T]``: ``count`` packed documents of random lengths."""
    return jax.device_put(np.sort(rng.integers(0, count, (B, T)), axis=1).astype(np.int32))


def inputs(rng, B, T, N, K, H, dtype=jnp.float32):
    return (normal(rng, (B, T, N, H), dtype), normal(rng, (B, T, K, H), dtype),
            normal(rng, (B, T, K, H), dtype), normal(rng, (B, T, N, H), dtype))


# Interpret mode is costly to trace and compile, and the reference run eagerly compiles
# each of its ops apart: so each side is one jitted program that returns the output and
# the gradients of sum(out * g) in q, k, v (the forward traced once, for both), shared by
# every test that calls it with the same shapes and options (all passed explicitly: jit
# keys its cache on the arguments as given).


def _output_and_grads(attend, q, k, v, g):
    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)), out

    grads, out = jax.grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


@functools.partial(jax.jit, static_argnames=("causal", "window", "block_q", "block_k"))
def kernel_and_grads(q, k, v, g, segment_ids, *, causal, window, block_q, block_k):
    """The kernel's output (interpret mode) and its gradients of ``sum(out * g)``."""
    return _output_and_grads(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window,
                                        block_q=block_q, block_k=block_k, interpret=True), q, k, v, g)


@functools.partial(jax.jit, static_argnames=("causal", "window"))
def reference_and_grads(q, k, v, g, segment_ids, *, causal, window):
    """The reference's output and gradients, computed in float32 on (a float32 copy of)
    the same inputs; the gradients come back in the inputs' dtype."""
    def reference(*args):
        args = [a.astype(jnp.float32) for a in args]
        return flash_attention_reference(*args, causal=causal, segment_ids=segment_ids, window=window)

    return _output_and_grads(reference, q, k, v, g)


def assert_kernel_matches_reference(q, k, v, g, segment_ids=None, *, tol=1e-5, causal, window=None,
                                    block_q=16, block_k=16):
    """Kernel against reference, output and gradients, each in q's dtype and within
    ``tol``; returns the reference's output."""
    out, grads = kernel_and_grads(q, k, v, g, segment_ids, causal=causal, window=window,
                                   block_q=block_q, block_k=block_k)
    want, want_grads = reference_and_grads(q, k, v, g, segment_ids, causal=causal, window=window)
    assert out.dtype == q.dtype and rel_err(out, want) < tol
    for a, b in zip(grads, want_grads, strict=True):
        assert a.dtype == q.dtype and rel_err(a, b) < tol
    return want


attention = jax.jit(dot_product_attention, static_argnames="causal")


CASES = [  # causal, window, packed, T, N, K, H: each mask with another head dim, powers of
    # two and GPT-2's / SmolLM2's / Qwen's 72, 80, 96 (padded to 128 inside); 64:
    # test_half_precision_inputs, 16: the bottom-right and ring tests
    (True, None, False, 37, 4, 4, 72),    # odd length, MHA
    (True, None, True, 40, 8, 2, 80),     # packed documents, GQA 4 (test_reference_is_the_models_attention's)
    (False, None, True, 33, 8, 1, 96),    # not causal, MQA (8)
    (True, 7, False, 45, 4, 2, 128),      # sliding window
    (False, 6, True, 29, 2, 2, 256),      # window both ways, packed
]


@pytest.mark.slow
@pytest.mark.parametrize("causal,window,packed,T,N,K,H", CASES)
def test_outputs_and_gradients_match_the_reference(rng, causal, window, packed, T, N, K, H):
    q, k, v, g = inputs(rng, 2, T, N, K, H)
    segment_ids = documents(rng, 2, T) if packed else None
    assert_kernel_matches_reference(q, k, v, g, segment_ids, causal=causal, window=window)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(rng, dtype):
    """The kernel on half-precision inputs against the float32 reference computation on
    the same (rounded) inputs."""
    q, k, v, g = inputs(rng, 2, 35, 4, 1, 64, dtype)
    segment_ids = documents(rng, 2, 35)
    assert_kernel_matches_reference(q, k, v, g, segment_ids, tol=2e-2, causal=True, block_q=16, block_k=32)


@pytest.mark.slow
def test_reference_is_the_models_attention(rng):
    """The reference against an independent implementation: jaxpar.dot_product_attention
    (causal, packed documents, grouped-query heads); and the kernel too. (The shapes of
    CASES' GQA case, whose compiled programs this reuses.)"""
    q, k, v, g = inputs(rng, 2, 40, 8, 2, 80)
    segment_ids = documents(rng, 2, 40)
    want = attention(q, k, v, causal=True, segment_ids=segment_ids)
    assert rel_err(reference_and_grads(q, k, v, g, segment_ids, causal=True, window=None)[0], want) < 1e-5
    out = kernel_and_grads(q, k, v, g, segment_ids, causal=True, window=None, block_q=16, block_k=16)[0]
    assert rel_err(out, want) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("T,S,window", [(20, 45, None), (45, 20, 6)])
def test_causal_mask_is_aligned_bottom_right(rng, T, S, window):
    """T != S: query t sees keys s <= t + S - T (the queries are the last T tokens, as
    jaxpar.dot_product_attention has it); with T > S the first T - S queries see nothing
    and give zeros. Kernel against the reference, outputs and gradients; the reference
    against dot_product_attention (T < S) and an explicit bottom-right mask."""
    q, _, _, g = inputs(rng, 2, T, 4, 2, 16)
    k, v = normal(rng, (2, S, 2, 16)), normal(rng, (2, S, 2, 16))
    want = np.asarray(assert_kernel_matches_reference(q, k, v, g, causal=True, window=window))
    distance = np.arange(T)[:, None] + S - T - np.arange(S)[None, :]
    mask = (distance >= 0) & (distance < (window or S + T))
    explicit = attention(q, k, v, causal=False, mask=np.broadcast_to(mask, (2, T, S)))
    assert rel_err(want, explicit) < 1e-5
    if T < S:
        assert rel_err(want, attention(q, k, v, causal=True)) < 1e-5
    else:
        assert not want[:, :T - S].any() and want[:, T - S:].all()


def test_the_default_runs_the_reference_on_cpu(rng):
    q, k, v, _ = inputs(rng, 1, 20, 2, 2, 16)
    assert rel_err(jax.jit(functools.partial(flash_attention, causal=False))(q, k, v),
                   jax.jit(functools.partial(flash_attention_reference, causal=False))(q, k, v)) < 1e-6


# ------------------------------------------------------------ the ring's inner step


def grouped(x, K):
    """``[B, T, N, H]`` -> the ring's ``[B, T, K, G, H]``."""
    return x.reshape(*x.shape[:2], K, x.shape[2] // K, x.shape[3])


@jax.jit
def ring_step(q, k, v, o, lse, q_pos, k_pos, q_seg, k_seg):
    """sequence_parallel's XLA step on the kernels' layout: ``[B, T, N, H]``, ``[B, N, T]``."""
    K = k.shape[2]
    B, N, T = lse.shape
    o, lse = sequence_parallel.block_update(grouped(q, K), k, v, grouped(o, K), lse.reshape(B, K, N // K, T),
                                            q_pos, k_pos, q_seg, k_seg, causal=True)
    return o.reshape(q.shape), lse.reshape(B, N, T)


@jax.jit
def ring_grads(q, k, v, do, lse, delta, q_pos, k_pos, q_seg, k_seg):
    """sequence_parallel's XLA backward step on the kernels' layout."""
    K = k.shape[2]
    B, N, T = lse.shape
    as_ring_lse = lambda x: x.reshape(B, K, N // K, T)  # noqa: E731
    dq, dk, dv = sequence_parallel.block_grads(grouped(q, K), k, v, grouped(do, K), as_ring_lse(lse),
                                               as_ring_lse(delta), q_pos, k_pos, q_seg, k_seg, causal=True)
    return dq.reshape(q.shape), dk, dv


@pytest.mark.slow
def test_block_steps_match_the_ring_step(rng):
    """Two ring steps over the two halves of a zigzag-ordered sequence, from a random
    running state (forward), and block_grads (backward), against sequence_parallel's XLA
    step; the kernels get explicit, non-contiguous positions."""
    B, T, N, K, H = 2, 24, 4, 2, 16
    q, k, v, do = (np.asarray(x) for x in inputs(rng, B, T, N, K, H))
    q_pos = zigzag_order(T, 2).astype(np.int32)
    seg = np.asarray(documents(rng, B, T))
    o = rng.standard_normal((B, T, N, H)).astype(np.float32)
    lse = rng.standard_normal((B, N, T)).astype(np.float32)
    lse[:, :, :3] = -np.inf  # three rows have seen nothing
    kernel_step = jax.jit(functools.partial(block_update, causal=True, block_q=8, block_k=8, interpret=True))
    got = want = (o, lse)
    for half in (slice(0, T // 2), slice(T // 2, T)):  # one program per side, both halves
        args = (q, k[:, half], v[:, half])
        positions = (q_pos, q_pos[half], seg, seg[:, half])
        got, want = kernel_step(*args, *got, *positions), ring_step(*args, *want, *positions)
    assert rel_err(got[0], want[0]) < 1e-5
    assert rel_err(got[1], want[1]) < 1e-5

    lse, delta = got[1], normal(rng, (B, N, T))
    half = slice(T // 2, T)
    args = (q, k[:, half], v[:, half], do, lse, delta, q_pos, q_pos[half], seg, seg[:, half])
    kernel_grads = jax.jit(functools.partial(block_grads, causal=True, block_q=8, block_k=8, interpret=True))
    dq, dk, dv = kernel_grads(*args)
    rq, rk, rv = ring_grads(*args)
    assert rel_err(dq, rq) < 1e-5
    assert rel_err(dk, rk) < 1e-5 and rel_err(dv, rv) < 1e-5


def test_a_block_nobody_sees_changes_nothing(rng):
    B, T, N, H = 1, 16, 2, 16
    q, k, v, _ = inputs(rng, B, T, N, N, H)
    o, lse = normal(rng, (B, T, N, H)), normal(rng, (B, N, T))
    later = np.arange(T, 2 * T, dtype=np.int32)  # every key after every query
    step = jax.jit(functools.partial(block_update, causal=True, interpret=True))
    new_o, new_lse = step(q, k, v, o, lse, np.arange(T, dtype=np.int32), later)
    np.testing.assert_array_equal(new_o, o)
    np.testing.assert_array_equal(new_lse, lse)


def test_bad_inputs(rng):
    q, k, v, _ = (np.asarray(x) for x in inputs(rng, 1, 8, 3, 2, 16))
    with pytest.raises(ValueError, match="query heads N=3 must be a multiple of key/value heads K=2"):
        flash_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"q \[B, T, N, H\], k and v \[B, S, K, H\]; got q=\(8, 3, 16\)"):
        flash_attention(q[0], k, v, causal=True)
    with pytest.raises(ValueError, match="window=0 must be at least 1"):
        flash_attention(q, k[:, :, :1], v[:, :, :1], causal=True, window=0)
