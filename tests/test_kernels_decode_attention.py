"""The decode-attention Pallas kernel (interpret mode) against the plain-jnp reference, and
the reference against independent computations (``jaxpar.ops.attention.dot_product_attention``
per sequence; a float64 loop over the visible slots): grouped-query ratios 1, 4 and 8, one
and four new tokens (and 40: the reference), head dims 16, 32, 72, 80, 96, token trees and
the causal default, per-sequence lengths from ``T`` (no context) to ``S``, ``S`` not a
multiple of ``block_k``, split and unsplit cache, float32, bfloat16 and float16. Every slot past a sequence's length holds huge random garbage, so a
kernel that read one could not pass."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxpar.ops.attention import dot_product_attention
from jaxpar.kernels import decode_attention, decode_attention_reference, dispatch


def inputs(rng, lengths, T, N, K, H, S, dtype=jnp.float32, tree=False):
    """Random ``q, k_cache, v_cache, lengths, tree_mask`` (``None`` unless ``tree``), the
    cache past each length poisoned with values up to 1e4. (Cast by numpy and put on the
    device as they are: jnp.asarray would compile a conversion program per shape.)"""
    B = len(lengths)
    q = rng.standard_normal((B, T, N, H))
    k, v = rng.standard_normal((2, B, S, K, H))
    for b, length in enumerate(lengths):
        k[b, length:] = rng.uniform(-1e4, 1e4, k[b, length:].shape)
        v[b, length:] = rng.uniform(-1e4, 1e4, v[b, length:].shape)
    tree_mask = jax.device_put(random_trees(rng, B, T)) if tree else None
    return (*(jax.device_put(x.astype(dtype)) for x in (q, k, v)),
            jax.device_put(np.asarray(lengths, np.int32)), tree_mask)


def random_trees(rng, B, T):
    """``[B, T, T]`` ancestors-or-self masks of random token trees (token 0 the root, each
    later token's parent an earlier one), not all chains."""
    mask = np.zeros((B, T, T), bool)
    for b in range(B):
        parent = [-1] + [int(rng.integers(0, j)) for j in range(1, T)]
        if b == 0 and T > 2:
            parent[1] = parent[2] = 0  # tokens 1 and 2 siblings: not a chain
        for t in range(T):
            a = t
            while a >= 0:
                mask[b, t, a], a = True, parent[a]
    return mask


def naive(q, k, v, lengths, tree_mask):
    """float64 loops: softmax over exactly the slots each query sees."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _, T, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros(q.shape)
    for b, length in enumerate(np.asarray(lengths)):
        context = length - T
        for t in range(T):
            seen = list(range(context)) + [context + j for j in range(T) if tree_mask[b, t, j]]
            for n in range(N):
                s = k[b, seen, n // G] @ q[b, t, n] * H**-0.5
                p = np.exp(s - s.max())
                out[b, t, n] = p @ v[b, seen, n // G] / p.sum()
    return out


# H: GPT-2's, SmolLM2's and Qwen's head dims too, which the kernel computes on pow2(H)
# columns of q (zeros past H), masking the cache's columns past H.
@pytest.mark.parametrize("T,N,K,S,block_k,num_splits,tree,H", [
    (1, 4, 4, 77, 16, 1, False, 72),   # G = 1, one new token
    (4, 8, 2, 77, 16, 1, True, 80),    # G = 4, a token tree
    (4, 16, 2, 50, 16, 3, True, 96),   # G = 8, split
    (4, 8, 1, 100, 32, 4, False, 32),  # G = 8, causal, split
    (1, 8, 2, 64, 16, 2, False, 32),   # S a multiple of block_k, a length of S
])
def test_kernel_matches_the_reference(rng, T, N, K, S, block_k, num_splits, tree, H):
    lengths = [T, int(rng.integers(T + 1, S - 1)), S - (S % block_k != 0)]
    q, k, v, lengths, tree_mask = inputs(rng, lengths, T, N, K, H, S, tree=tree)
    got = decode_attention(q, k, v, lengths, tree_mask=tree_mask, block_k=block_k,
                           num_splits=num_splits, interpret=True)
    want = decode_attention_reference(q, k, v, lengths, tree_mask=tree_mask)
    assert got.shape == q.shape and got.dtype == jnp.float32
    assert rel_err(got, want) < 1e-5


def test_more_new_tokens_than_the_bitmask_holds_run_the_reference(rng, caplog, monkeypatch):
    """T = 40 > 32 new tokens: the tree mask no longer fits the kernel's int32 bitmask, so
    the call runs the XLA reference (and says so) instead of failing."""
    monkeypatch.setattr(dispatch, "_REPORTED", set())  # said once per process: maybe already
    T = 40
    q, k, v, lengths, tree_mask = inputs(rng, [T, 50], T, 2, 1, 16, 56, tree=True)
    with caplog.at_level(logging.WARNING, logger="jaxpar.kernels"):
        got = decode_attention(q, k, v, lengths, tree_mask=tree_mask, block_k=16, interpret=True)
    assert "T <= 32 new tokens, got T=40" in caplog.text
    assert rel_err(got, naive(q, k, v, lengths, np.asarray(tree_mask))) < 1e-5


@pytest.mark.slow
def test_splits_do_not_change_the_result(rng):
    """Batch 1, as when one sequence is served: 2 and 5 splits, and the automatic count
    (16 here), where most splits of the short sequence get no block at all."""
    q, k, v, lengths, tree_mask = inputs(rng, [70], 4, 8, 2, 32, 90, tree=True)
    run = lambda splits: decode_attention(q, k, v, lengths, tree_mask=tree_mask, block_k=16,  # noqa: E731
                                          num_splits=splits, interpret=True)
    one = run(1)
    assert rel_err(one, decode_attention_reference(q, k, v, lengths, tree_mask=tree_mask)) < 1e-5
    for splits in (2, 5, None):
        assert rel_err(run(splits), one) < 1e-5


@pytest.mark.parametrize("T,N,K", [(1, 4, 4), (4, 8, 2)])
def test_reference_matches_dot_product_attention(rng, T, N, K):
    """Causal, per sequence: the cache cut at its length, the queries at its end."""
    S = 40
    q, k, v, lengths, _ = inputs(rng, [T, 17, S], T, N, K, 16, S)
    got = decode_attention_reference(q, k, v, lengths)
    attention = jax.jit(dot_product_attention)
    q, k, v, got = (np.asarray(x) for x in (q, k, v, got))  # sliced by numpy: no program per slice
    for b, length in enumerate(np.asarray(lengths)):
        want = attention(q[b:b + 1], k[b:b + 1, :length], v[b:b + 1, :length], q_start=length - T)
        assert rel_err(got[b:b + 1], want) < 1e-5


@pytest.mark.parametrize("tree", [False, True])
def test_reference_and_kernel_match_a_loop_over_the_visible_slots(rng, tree):
    T, S = 4, 45
    q, k, v, lengths, tree_mask = inputs(rng, [T, 9, 30, S], T, 8, 2, 16, S, tree=tree)
    mask = np.asarray(tree_mask) if tree else np.broadcast_to(np.tril(np.ones((T, T), bool)), (4, T, T))
    assert not tree or (mask != np.tril(np.ones((T, T), bool))).any()
    want = naive(q, k, v, lengths, mask)
    assert rel_err(decode_attention_reference(q, k, v, lengths, tree_mask=tree_mask), want) < 1e-5
    assert rel_err(decode_attention(q, k, v, lengths, tree_mask=tree_mask, block_k=16, num_splits=2,
                                    interpret=True), want) < 1e-5


def test_causal_default_is_the_lower_triangular_tree(rng):
    """(The shapes and tiles of test_reference_and_kernel_match_a_loop_over_the_visible_slots,
    whose four compiled programs this reuses.)"""
    T, S = 4, 45
    q, k, v, lengths, _ = inputs(rng, [T, 9, 30, S], T, 8, 2, 16, S)
    causal = jax.device_put(np.broadcast_to(np.tril(np.ones((T, T), bool)), (4, T, T)))
    for fn in (decode_attention_reference,
               lambda *a, **kw: decode_attention(*a, block_k=16, num_splits=2, interpret=True, **kw)):
        assert rel_err(fn(q, k, v, lengths), fn(q, k, v, lengths, tree_mask=causal)) == 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(rng, dtype):
    q, k, v, lengths, tree_mask = inputs(rng, [4, 31, 60], 4, 8, 2, 32, 60, dtype, tree=True)
    got = decode_attention(q, k, v, lengths, tree_mask=tree_mask, block_k=16, num_splits=2, interpret=True)
    assert got.dtype == dtype
    assert rel_err(got, decode_attention_reference(q, k, v, lengths, tree_mask=tree_mask)) < 2e-2


def test_without_interpret_off_gpu_is_the_reference(rng):
    q, k, v, lengths, _ = inputs(rng, [1, 5], 1, 4, 2, 16, 8)
    assert rel_err(decode_attention(q, k, v, lengths), decode_attention_reference(q, k, v, lengths)) == 0


def test_bad_shapes(rng):
    q, k, v, lengths = map(np.asarray, inputs(rng, [4, 6], 4, 8, 2, 16, 8)[:4])
    shapes = r"q \[B, T, N, H\], k_cache and v_cache \[B, S, K, H\] with N a multiple of K, lengths \[B\]"
    with pytest.raises(ValueError, match=shapes + r"; got q \(2, 4, 8, 16\), k_cache \(2, 8, 3, 16\)"):
        decode_attention(q, np.ones((2, 8, 3, 16), np.float32), np.ones((2, 8, 3, 16), np.float32), lengths)
    with pytest.raises(ValueError, match=r"v_cache \(2, 8, 2, 8\)"):
        decode_attention(q, k, v[..., :8], lengths)
    with pytest.raises(ValueError, match=r"lengths \(3,\)"):
        decode_attention(q, k, v, np.ones(3, np.int32))
    with pytest.raises(ValueError, match=r"T=4 new tokens do not fit a cache of S=2 slots"):
        decode_attention(q, k[:, :2], v[:, :2], lengths)
    with pytest.raises(ValueError, match=r"tree_mask \[B, T, T\] = \(2, 4, 4\), got \(2, 4\)"):
        decode_attention(q, k, v, lengths, tree_mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        decode_attention(q, k, v, lengths, block_k=24, interpret=True)
