"""The paged decode-attention kernel (``jaxpar.kernels.paged_decode_attention``, interpret
mode) against a float64 loop over each sequence's pages gathered by hand, and against
JAX's own: ``jax.experimental.pallas.ops.gpu.paged_attention`` (one new token) and the
TPU ops' ``ref_ragged_paged_attention`` (several, causal). Ragged lengths (one token, a
length ending on a page boundary), pages smaller than a tile, larger than one and not a
power of two, grouped-query ratios 1, 2 and 4, head dims 64 and 80, one and five new
tokens, float32 and bfloat16. Every slot no sequence owns (page 0, which the tables'
unused rows point at, pages no table names, slots past a length, the other layer) holds
NaN, so a kernel that read one (even to weigh it by zero) could not pass."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxpar.kernels import dispatch, paged_decode_attention, paged_decode_attention_reference

LAYERS, LAYER = 2, 1


def inputs(rng, lengths, T, N, K, H, page_size, max_pages, dtype=jnp.float32, garbage=np.nan):
    """Random ``q, k_pages, v_pages, tables, lengths`` for ``LAYERS`` layers: each sequence's
    pages distinct, shuffled, its table's unused rows page 0; every slot no sequence owns
    in layer ``LAYER`` (and all of the others) holds ``garbage``."""
    B = len(lengths)
    used = [-(-length // page_size) for length in lengths]
    P = 1 + sum(used) + 2  # the null page, each sequence's pages, two no one's
    k, v = np.full((2, LAYERS, P, page_size, K, H), garbage)
    ids = 1 + rng.permutation(P - 1)
    tables = np.zeros((B, max_pages), np.int32)
    for b, (length, count) in enumerate(zip(lengths, used)):
        tables[b, :count], ids = ids[:count], ids[count:]
        for s in range(length):
            page, at = tables[b, s // page_size], s % page_size
            k[LAYER, page, at], v[LAYER, page, at] = rng.standard_normal((2, K, H))
    q = rng.standard_normal((B, T, N, H))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables),
            jnp.asarray(lengths, jnp.int32))


def naive(q, k_pages, v_pages, tables, lengths):
    """float64 loops: each sequence's slots read through its table up to its length, a
    causal softmax over them."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k_pages[LAYER], v_pages[LAYER]))
    _, T, N, H = q.shape
    page_size, G = k.shape[1], N // k.shape[2]
    out = np.zeros(q.shape)
    for b, length in enumerate(np.asarray(lengths)):
        slots = np.arange(length)
        keys = k[np.asarray(tables)[b, slots // page_size], slots % page_size]  # [length, K, H]
        values = v[np.asarray(tables)[b, slots // page_size], slots % page_size]
        for t in range(T):
            seen = length - T + t + 1
            for n in range(N):
                s = keys[:seen, n // G] @ q[b, t, n] * H**-0.5
                p = np.exp(s - s.max())
                out[b, t, n] = p @ values[:seen, n // G] / p.sum()
    return out


def kernel(q, k, v, tables, lengths, **kw):
    return paged_decode_attention(q, k, v, jnp.int32(LAYER), tables, lengths, block_k=16,
                                  interpret=True, **kw)


@pytest.mark.parametrize("T,N,K,H,page_size,num_splits", [
    (1, 4, 2, 64, 4, 2),    # G = 2, a tile spans four pages, split
    (5, 4, 4, 80, 6, 1),    # G = 1, pages of 6 slots, head_dim padded to 128 inside
    (5, 8, 2, 64, 32, 3),   # G = 4, a page spans two tiles, split
])
def test_kernel_matches_a_loop_over_the_gathered_pages(rng, T, N, K, H, page_size, num_splits):
    lengths = [T, 2 * page_size, 3 * page_size - 1]  # the fewest, a page boundary, ragged
    if T == 1:
        lengths[0] = 1  # a sequence of one token
    q, k, v, tables, lengths = inputs(rng, lengths, T, N, K, H, page_size, max_pages=4)
    want = naive(q, k, v, tables, lengths)
    got = kernel(q, k, v, tables, lengths, num_splits=num_splits)
    assert got.shape == q.shape and got.dtype == jnp.float32
    assert rel_err(got, want) < 1e-5
    reference = paged_decode_attention_reference(q, k, v, jnp.int32(LAYER), tables, lengths)
    assert rel_err(reference, want) < 1e-5


def test_one_new_token_matches_jax_gpu_paged_attention(rng):
    """JAX's Pallas GPU paged attention (interpret mode): ``q [B, N, H]``, pages ``[K, P,
    S_p, H]`` (one layer), the same tables and lengths (the new token's slot counted).
    It reads whole pages and weighs the slots past a length by zero, so the garbage
    there is finite here."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    q, k, v, tables, lengths = inputs(rng, [1, 8, 13], 1, 8, 2, 64, page_size=4, max_pages=4, garbage=1e4)
    layer = lambda pages: pages[LAYER].transpose(2, 0, 1, 3)  # noqa: E731
    want = paged_attention(q[:, 0] * 64**-0.5, layer(k), layer(v), tables, lengths, k_splits=1,
                           pages_per_compute_block=2, interpret=True)  # it does not scale q.k
    assert rel_err(kernel(q, k, v, tables, lengths, num_splits=2)[:, 0], want) < 1e-5


@pytest.mark.slow
def test_new_tokens_match_jax_ragged_paged_attention_reference(rng):
    """The TPU ops' plain-``jnp`` ``ref_ragged_paged_attention``: the batch's queries
    packed into ``[B * T, N, H]``, one layer's keys and values interleaved along the
    heads (``[P, S_p, 2K, H]``), ``kv_lens`` our lengths (the new tokens counted),
    causal among the new tokens."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    T, N, K, H = 5, 4, 2, 80
    q, k, v, tables, lengths = inputs(rng, [5, 8, 11], T, N, K, H, page_size=4, max_pages=3)
    B, P, page_size = q.shape[0], k.shape[1], k.shape[2]
    kv = jnp.stack([k[LAYER], v[LAYER]], axis=3).reshape(P, page_size, 2 * K, H)
    want = ref_ragged_paged_attention(q.reshape(B * T, N, H), kv, lengths, tables,
                                      jnp.arange(0, B * T + 1, T, dtype=jnp.int32), jnp.asarray([B]),
                                      sm_scale=H**-0.5)
    assert rel_err(kernel(q, k, v, tables, lengths).reshape(B * T, N, H), want) < 1e-5


def test_bfloat16(rng):
    q, k, v, tables, lengths = inputs(rng, [5, 8, 13], 5, 4, 2, 64, 4, 4, jnp.bfloat16)
    got = kernel(q, k, v, tables, lengths, num_splits=2)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, naive(q, k, v, tables, lengths)) < 2e-2


def test_without_interpret_off_gpu_is_the_reference(rng):
    q, k, v, tables, lengths = inputs(rng, [1, 6], 1, 4, 2, 16, 4, 2)
    got = paged_decode_attention(q, k, v, LAYER, tables, lengths)
    assert rel_err(got, paged_decode_attention_reference(q, k, v, LAYER, tables, lengths)) == 0


def test_more_new_tokens_than_the_bitmask_holds_run_the_reference(rng, caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "_REPORTED", set())  # said once per process: maybe already
    T = 33
    q, k, v, tables, lengths = inputs(rng, [T, 40], T, 2, 1, 16, 16, 3)
    with caplog.at_level(logging.WARNING, logger="jaxpar.kernels"):
        got = kernel(q, k, v, tables, lengths)
    assert "T <= 32 new tokens, got T=33" in caplog.text
    assert rel_err(got, naive(q, k, v, tables, lengths)) < 1e-5


def test_bad_shapes(rng):
    q, k, v, tables, lengths = inputs(rng, [4, 6], 4, 4, 2, 16, 4, 2)
    shapes = (r"q \[B, T, N, H\], k_pages and v_pages \[L, P, S_p, K, H\] with N a multiple of K, "
              r"layer a scalar, tables \[B, max_pages\], lengths \[B\]; got q \(2, 4, 4, 16\), "
              r"k_pages \(2, 6, 4, 3, 16\)")
    with pytest.raises(ValueError, match=shapes):
        paged_decode_attention(q, jnp.ones((2, 6, 4, 3, 16)), jnp.ones((2, 6, 4, 3, 16)), 0, tables, lengths)
    with pytest.raises(ValueError, match=r"layer \(1,\), tables"):
        paged_decode_attention(q, k, v, jnp.zeros(1, jnp.int32), tables, lengths)
    with pytest.raises(ValueError, match=r"tables \(3, 2\)"):
        paged_decode_attention(q, k, v, 0, jnp.zeros((3, 2), jnp.int32), lengths)
    with pytest.raises(ValueError, match="T=4 new tokens do not fit 1 pages of 3 slots"):
        paged_decode_attention(q, k[:, :, :3], v[:, :, :3], 0, tables[:, :1], lengths)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        paged_decode_attention(q, k, v, 0, tables, lengths, block_k=24, interpret=True)
