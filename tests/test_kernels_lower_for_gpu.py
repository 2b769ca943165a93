"""Every kernel, forward and backward, lowers for CUDA through Pallas' Triton lowering,
without a GPU (``lower(lowering_platforms=("cuda",))``): a primitive, block shape or
indexing the Triton lowering does not support fails here, in CI, rather than on the first
GPU. (Compiling the Triton IR to PTX and running it needs the GPU: bench/kernels.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import kernels
from jaxpar.kernels.flash_attention import block_grads, block_update


def lowers_for_cuda(fn, *args):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @__gpu$xla.gpu.triton" in text  # the kernels became Triton calls


def normal(rng, shape, dtype=jnp.bfloat16):
    """Cast by numpy: nothing here runs, and jnp.asarray would compile a conversion
    program per shape (most of this file's CPU time once)."""
    return rng.standard_normal(shape).astype(dtype)


def ints(rng, low, high, shape):
    return rng.integers(low, high, shape).astype(np.int32)


@pytest.mark.parametrize("T,N,K,H,causal,window,packed,dtype", [
    (200, 8, 2, 64, True, None, True, jnp.bfloat16),   # odd length, GQA, documents
    (128, 4, 4, 128, False, 32, False, jnp.float16),
    (96, 8, 1, 256, True, 16, False, jnp.float32),     # head_dim 256, MQA, window
    (40, 6, 2, 72, True, None, False, jnp.bfloat16),    # head dims padded to 128 inside
    (40, 9, 3, 80, False, None, True, jnp.bfloat16),    # ... G = 3 (SmolLM2)
    (40, 4, 4, 96, True, 8, False, jnp.bfloat16),
])
def test_flash_attention(rng, T, N, K, H, causal, window, packed, dtype):
    q, k, v = normal(rng, (2, T, N, H), dtype), normal(rng, (2, T, K, H), dtype), normal(rng, (2, T, K, H), dtype)
    seg = np.sort(ints(rng, 0, 3, (2, T)), axis=1) if packed else None

    def loss(q, k, v):
        out = kernels.flash_attention(q, k, v, causal=causal, segment_ids=seg, window=window,
                                      interpret=False)
        return out.astype(jnp.float32).sum()

    lowers_for_cuda(jax.grad(loss, (0, 1, 2)), q, k, v)


@pytest.mark.parametrize("H", [64, 80])
def test_ring_steps(rng, H):
    B, T, N, K = 2, 96, 4, 2
    q, k, v, do = (normal(rng, (B, T, N, H)), normal(rng, (B, T, K, H)), normal(rng, (B, T, K, H)),
                   normal(rng, (B, T, N, H)))
    o, lse = normal(rng, (B, T, N, H), jnp.float32), normal(rng, (B, N, T), jnp.float32)
    pos = np.arange(T, dtype=np.int32)
    lowers_for_cuda(lambda *a: block_update(*a, pos, pos, causal=True, interpret=False), q, k, v, o, lse)
    lowers_for_cuda(lambda *a: block_grads(*a, pos, pos, causal=True, interpret=False),
                    q, k, v, do, lse, lse)


@pytest.mark.parametrize("T,tree,H", [(1, False, 64), (5, True, 64), (3, True, 72), (1, False, 80),
                                      (4, False, 96)])
def test_decode_attention(rng, T, tree, H):
    B, S, N, K = 2, 77, 8, 2
    q, k, v = normal(rng, (B, T, N, H)), normal(rng, (B, S, K, H)), normal(rng, (B, S, K, H))
    lengths = np.asarray([T + 3, S], np.int32)
    mask = np.tril(np.ones((B, T, T), bool)) if tree else None
    lowers_for_cuda(lambda q, k, v: kernels.decode_attention(q, k, v, lengths, tree_mask=mask,
                                                             interpret=False), q, k, v)


def test_decode_attention_with_more_new_tokens_than_the_kernel_takes(rng):
    """T = 40 > 32: the XLA reference runs (no Triton call), rather than a failure."""
    B, T, S, N, K, H = 1, 40, 64, 2, 1, 64
    q, k, v = normal(rng, (B, T, N, H)), normal(rng, (B, S, K, H)), normal(rng, (B, S, K, H))
    lengths = np.asarray([50], np.int32)
    text = jax.jit(lambda q, k, v: kernels.decode_attention(q, k, v, lengths, interpret=False)) \
        .trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" not in text


@pytest.mark.parametrize("T,H,page_size", [(1, 64, 16), (5, 80, 16), (3, 72, 6)])
def test_paged_decode_attention(rng, T, H, page_size):
    """Pages of every layer, a traced layer index, tables and lengths: the page table's
    reads and the rows they pick lower too (pages of 6 slots: any size)."""
    L, P, B, N, K, max_pages = 2, 9, 3, 8, 2, 4
    q, k, v = normal(rng, (B, T, N, H)), normal(rng, (L, P, page_size, K, H)), normal(rng, (L, P, page_size, K, H))
    tables = ints(rng, 0, P, (B, max_pages))
    lengths = np.asarray([T, page_size, max_pages * page_size], np.int32)
    lowers_for_cuda(lambda q, k, v, layer: kernels.paged_decode_attention(q, k, v, layer, tables, lengths,
                                                                          interpret=False),
                    q, k, v, np.int32(1))


def test_paged_decode_attention_over_more_rows_than_int32_counts(rng):
    """2 layers of 2**26 pages of 16 slots, 2**31 rows (shapes only, nothing allocated):
    the kernel's int32 row numbers would overflow, so the XLA reference runs instead."""
    pages = jax.ShapeDtypeStruct((2, 2**26, 16, 1, 16), jnp.bfloat16)
    q = normal(rng, (1, 1, 2, 16))
    tables, lengths = np.ones((1, 2), np.int32), np.asarray([20], np.int32)
    text = jax.jit(lambda q, k, v: kernels.paged_decode_attention(q, k, v, 1, tables, lengths, interpret=False)) \
        .trace(q, pages, pages).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" not in text


@pytest.mark.parametrize("H,page_size,block_q,num_splits", [(64, 16, None, None), (80, 6, 4, 3), (72, 32, 1, 1)])
def test_ragged_paged_attention(rng, H, page_size, block_q, num_splits):
    """A flat batch of tokens of several sequences (padding among them) over every layer's
    pages, a traced layer index: the sorted tokens' rows read and written by number, the
    page table's reads, the splits; pages of 6 slots (any size), head dims padded inside."""
    L, P, S, W, T, N, K = 2, 9, 3, 4, 13, 8, 2
    q, k, v = normal(rng, (T, N, H)), normal(rng, (L, P, page_size, K, H)), normal(rng, (L, P, page_size, K, H))
    tables = ints(rng, 0, P, (S, W))
    seq = ints(rng, -1, S, T)
    positions = ints(rng, 0, W * page_size, T)
    lowers_for_cuda(lambda q, k, v, layer: kernels.ragged_paged_attention(
        q, k, v, layer, seq, positions, tables, block_q=block_q, num_splits=num_splits, interpret=False),
        q, k, v, np.int32(1))


def test_ragged_paged_attention_over_more_rows_than_int32_counts(rng):
    """Pages of 2**31 rows (shapes only, nothing allocated): the XLA reference runs instead."""
    pages = jax.ShapeDtypeStruct((2, 2**26, 16, 1, 16), jnp.bfloat16)
    q = normal(rng, (3, 2, 16))
    seq, positions = np.asarray([0, 0, -1], np.int32), np.asarray([3, 4, 0], np.int32)
    tables = np.ones((1, 2), np.int32)
    text = jax.jit(lambda q, k, v: kernels.ragged_paged_attention(q, k, v, 1, seq, positions, tables,
                                                                  interpret=False)) \
        .trace(q, pages, pages).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" not in text


@pytest.mark.parametrize("kind,D", [("rms", 256), ("layer", 256), ("rms", 576), ("layer", 768)])
def test_norm(rng, kind, D):
    x, scale = normal(rng, (37, D)), normal(rng, (D,), jnp.float32)
    bias = normal(rng, (D,), jnp.float32) if kind == "layer" else None

    def loss(x, scale, bias):
        return kernels.norm(x, scale, bias, kind=kind, interpret=False).astype(jnp.float32).sum()

    lowers_for_cuda(jax.grad(loss, (0, 1, 2) if bias is not None else (0, 1)), x, scale, bias)


@pytest.mark.parametrize("D", [128, 576, 768])
def test_linear_cross_entropy(rng, D):
    x, w = normal(rng, (100, D)), normal(rng, (D, 1000))
    targets = ints(rng, 0, 1000, 100)

    def loss(x, w):
        return kernels.linear_cross_entropy(x, w, targets, interpret=False).sum()

    lowers_for_cuda(jax.grad(loss, (0, 1)), x, w)


@pytest.mark.parametrize("M,K,N,dtype", [(200, 96, 72, jnp.bfloat16), (37, 256, 512, jnp.float32)])
def test_grouped_matmul(rng, M, K, N, dtype):
    """Forward, input gradient (the transposed kernel) and weight gradient: K and N not
    powers of two, an empty group, rows past the groups' total."""
    lhs, rhs = normal(rng, (M, K), dtype), normal(rng, (5, K, N), dtype)
    sizes = np.asarray([M // 3, 0, M // 4, 7, M // 5], np.int32)

    def loss(lhs, rhs):
        return kernels.grouped_matmul(lhs, rhs, sizes, interpret=False).astype(jnp.float32).sum()

    lowers_for_cuda(jax.grad(loss, (0, 1)), lhs, rhs)


def test_grouped_matmul_over_more_rows_than_int32_counts(rng):
    """Weights of 2**31 rows (shapes only): the XLA reference runs instead."""
    rhs = jax.ShapeDtypeStruct((2**16, 2**15, 16), jnp.bfloat16)
    lhs, sizes = normal(rng, (4, 2**15)), np.full(2**16, 0, np.int32)
    text = jax.jit(lambda lhs, rhs: kernels.grouped_matmul(lhs, rhs, sizes, interpret=False)) \
        .trace(lhs, rhs).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" not in text
