"""The ragged paged attention kernel (``jaxpar.kernels.ragged_paged_attention``, interpret
mode) against its plain-``jnp`` reference, and the reference against a float64 loop over
each sequence's keys and values gathered by hand. One flat batch mixes a decode token over
a long context, a one-token prompt, a prompt chunk over a cached prefix spanning several
pages, a sequence using its table's whole width, a sequence whose tokens are not
contiguous, and padding tokens (zeros out); grouped-query ratios 2 and 1, head dims 64, 80
and 32, pages smaller than a tile, not a power of two, and larger than one, one to three
splits and the automatic sixteen, shuffled token orders. Every slot no token may read (slots past a sequence's
largest position, pages no table names, page 0 that the tables' unused entries point at,
the other layer) holds NaN, so a kernel that read one (even to weigh it by zero) could not
pass; the reference it is compared with reads the same pages with the NaN replaced."""

import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from conftest import rel_err
from jaxpar import use_execution
from jaxpar.kernels import KernelOptions, dispatch, ragged_paged_attention, ragged_paged_attention_reference
from jaxpar.ops import kernel_ops
from jaxpar.placement.sharding import use_mesh

LAYERS, LAYER = 2, 1


def mixed(capacity):
    """``(sequence, position)`` per token of the mixed batch, for tables of ``capacity``
    slots a sequence (at least 20): sequence 0 a decode token over 18 slots, 1 a
    one-token prompt, 2 a chunk of 9 prompt tokens over a cached prefix of 5, 3 a decode
    token in its table's last slot, 4 three tokens not contiguous; -1 padding."""
    chunk = [(2, s) for s in range(5, 14)]
    return ([(4, 6), *chunk[:4], (-1, 3), (0, 17), (4, 7), *chunk[4:], (1, 0), (-1, 0), (3, capacity - 1),
             (4, 8), (-1, 5)])


def inputs(rng, tokens, N, K, H, page_size, width, dtype=jnp.float32, sequences=None):
    """``q, pages, clean_pages, layer, seq, positions, tables`` for ``tokens`` ``[(sequence,
    position)]``: each sequence's slots ``0 .. its largest position`` random in layer
    ``LAYER`` through its shuffled, distinct pages (its table's unused entries page 0);
    every other slot NaN in ``pages`` and random in ``clean_pages``. ``sequences``: table
    rows (default one per sequence named, plus one no token reads)."""
    seq = np.asarray([s for s, _ in tokens], np.int32)
    positions = np.asarray([p for _, p in tokens], np.int32)
    S = sequences or int(seq.max()) + 2
    last = [max((p for s, p in tokens if s == i), default=-1) for i in range(S)]
    used = [-(-(n + 1) // page_size) for n in last]
    assert max(used) <= width
    P = 1 + sum(used) + 2  # the null page, each sequence's pages, two no one's
    clean = rng.standard_normal((2, LAYERS, P, page_size, K, H))
    owned = np.zeros((LAYERS, P, page_size), bool)
    ids = 1 + rng.permutation(P - 1)
    tables = np.zeros((S, width), np.int32)
    for i, count in enumerate(used):
        tables[i, :count], ids = ids[:count], ids[count:]
        for s in range(last[i] + 1):
            owned[LAYER, tables[i, s // page_size], s % page_size] = True
    pages = np.where(owned[None, ..., None, None], clean, np.nan)
    q = rng.standard_normal((len(tokens), N, H))
    # Cast by numpy and put on the device as they are: jnp.asarray would compile a
    # conversion program per shape.
    put = lambda x: jax.device_put(np.asarray(x).astype(dtype))  # noqa: E731
    return (put(q), tuple(map(put, pages)), tuple(map(put, clean)), jax.device_put(np.int32(LAYER)),
            *map(jax.device_put, (seq, positions, tables)))


def naive(q, pages, layer, seq, positions, tables):
    """float64 loops: each sequence's keys and values read slot by slot through its table
    up to its largest position (``[n, K, H]``), then per token a softmax over the first
    ``position + 1``; zeros for padding."""
    q, k, v = np.asarray(q, np.float64), *(np.asarray(x, np.float64)[layer] for x in pages)
    seq, positions, tables = np.asarray(seq), np.asarray(positions), np.asarray(tables)
    T, N, H = q.shape
    page_size, G = k.shape[1], N // k.shape[2]
    kv = {}
    for i in set(seq[seq >= 0].tolist()):
        slots = np.arange(positions[seq == i].max() + 1)
        kv[i] = tuple(x[tables[i, slots // page_size], slots % page_size] for x in (k, v))
    out = np.zeros(q.shape)
    for t in range(T):
        if seq[t] < 0:
            continue
        keys, values = (x[:positions[t] + 1] for x in kv[seq[t]])
        for n in range(N):
            s = keys[:, n // G] @ q[t, n] * H**-0.5
            p = np.exp(s - s.max())
            out[t, n] = p @ values[:, n // G] / p.sum()
    return out


def kernel(q, pages, layer, seq, positions, tables, *, block_q=None, block_k=16, num_splits=None):
    return ragged_paged_attention(q, *pages, layer, seq, positions, tables, interpret=True,
                                  block_q=block_q, block_k=block_k, num_splits=num_splits)


# The kernel and its wrapper's clipping as one program (the wrapper run eagerly compiles
# each of its few ops apart).
compiled_kernel = jax.jit(kernel, static_argnames=("block_q", "block_k", "num_splits"))


@pytest.mark.parametrize("N,K,H,page_size,width,block_q,num_splits,shuffle", [
    (4, 2, 64, 4, 5, 4, 1, False),     # G = 2, a tile spans four pages, the chunk in three blocks
    (2, 2, 80, 6, 4, 3, 3, True),      # G = 1, pages of 6 slots, head_dim 80 (128 inside), split
    (4, 2, 32, 32, 1, None, 2, True),  # a page spans two tiles, the default block (32 tokens)
])
def test_mixed_batch_matches_the_reference(rng, N, K, H, page_size, width, block_q, num_splits, shuffle):
    tokens = mixed(page_size * width)
    if shuffle:  # any order: the chunk's tokens, and everyone's, scattered
        tokens = [tokens[i] for i in rng.permutation(len(tokens))]
    q, pages, clean, layer, seq, positions, tables = inputs(rng, tokens, N, K, H, page_size, width)
    got = compiled_kernel(q, pages, layer, seq, positions, tables, block_q=block_q, num_splits=num_splits)
    want = ragged_paged_attention_reference(q, *clean, layer, seq, positions, tables)
    assert got.shape == q.shape and got.dtype == jnp.float32
    got = np.asarray(got)
    assert np.isfinite(got).all()
    assert rel_err(got, want) < 2e-5
    assert not got[np.asarray(seq) < 0].any()  # padding: zeros


def test_the_reference_matches_a_loop_over_each_sequences_gathered_slots(rng):
    """On the NaN pages: the reference masks what a token may not see, values included."""
    for N, K, page_size, width in ((4, 2, 4, 5), (3, 3, 6, 4)):
        q, pages, _, layer, seq, positions, tables = inputs(rng, mixed(page_size * width), N, K, 16,
                                                            page_size, width)
        got = ragged_paged_attention_reference(q, *pages, layer, seq, positions, tables)
        assert rel_err(got, naive(q, pages, LAYER, seq, positions, tables)) < 1e-5


def test_one_decode_token_over_a_long_context_splits(rng):
    """Batch 1: one token over 46 slots in 12 pages, one kv head: the automatic split (16
    programs) gives three a tile each and thirteen nothing (log-sum-exp -inf, weight 0)."""
    q, pages, clean, layer, seq, positions, tables = inputs(rng, [(0, 45)], 4, 1, 32, 4, 12)
    got = compiled_kernel(q, pages, layer, seq, positions, tables)
    assert rel_err(got, naive(q, clean, LAYER, seq, positions, tables)) < 2e-5


def test_bfloat16(rng):
    q, pages, clean, layer, seq, positions, tables = inputs(rng, mixed(20), 4, 2, 64, 4, 5, jnp.bfloat16)
    got = compiled_kernel(q, pages, layer, seq, positions, tables, block_q=4)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, naive(q, clean, LAYER, seq, positions, tables)) < 2e-2


def test_without_interpret_off_gpu_is_the_reference(rng):
    q, pages, _, layer, seq, positions, tables = inputs(rng, mixed(20), 4, 2, 16, 4, 5)
    got = ragged_paged_attention(q, *pages, layer, seq, positions, tables)
    assert rel_err(got, ragged_paged_attention_reference(q, *pages, layer, seq, positions, tables)) == 0


def test_more_rows_than_int32_counts_run_the_reference(rng, caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "_REPORTED", set())  # said once per process: maybe already
    monkeypatch.setattr(sys.modules["jaxpar.kernels.ragged_paged_attention"], "_MAX_ROWS", 100)
    q, pages, _, layer, seq, positions, tables = inputs(rng, mixed(20), 4, 2, 16, 4, 5)
    with caplog.at_level(logging.WARNING, logger="jaxpar.kernels"):
        got = kernel(q, pages, layer, seq, positions, tables)
    assert "L * P * S_p and T * N < 2**31" in caplog.text
    assert rel_err(got, ragged_paged_attention_reference(q, *pages, layer, seq, positions, tables)) == 0


def test_bad_shapes(rng):
    q, (k, v), _, layer, seq, positions, tables = inputs(rng, mixed(20), 4, 2, 16, 4, 5)
    # numpy's slices: no program per slice
    q, k, v, layer, seq, positions, tables = map(np.asarray, (q, k, v, layer, seq, positions, tables))
    shapes = (r"q \[T, N, H\], k_pages and v_pages \[L, P, S_p, K, H\] with N a multiple of K, layer a "
              r"scalar, seq \[T\], positions \[T\], tables \[S, W\] \(S, W >= 1\); got q \(18, 4, 16\), "
              r"k_pages \(2, \d+, 4, 3, 16\)")
    with pytest.raises(ValueError, match=shapes):
        ragged_paged_attention(q, k[:, :, :, :1].repeat(3, 3), v[:, :, :, :1].repeat(3, 3), layer, seq, positions,
                               tables)
    with pytest.raises(ValueError, match=r"layer \(1,\), seq"):
        ragged_paged_attention(q, k, v, np.zeros(1, np.int32), seq, positions, tables)
    with pytest.raises(ValueError, match=r"positions \(17,\)"):
        ragged_paged_attention(q, k, v, layer, seq, positions[1:], tables)
    with pytest.raises(ValueError, match=r"tables \(6, 0\)"):
        ragged_paged_attention(q, k, v, layer, seq, positions, tables[:, :0])
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        kernel(q, (k, v), layer, seq, positions, tables, block_k=24)
    with pytest.raises(ValueError, match="block_q must be >= 1"):
        kernel(q, (k, v), layer, seq, positions, tables, block_q=0)


@pytest.mark.parametrize("impl,tensor,K,runs", [
    ("pallas", 1, 2, True), ("xla", 1, 2, False),
    ("pallas", 2, 2, True),    # each device: 2 query heads, their kv head, all the pages and tokens
    ("pallas", 2, 1, False),   # one kv head for two head shards: the caller's XLA attention
])
def test_kernel_ops(rng, impl, tensor, K, runs):
    """``jaxpar.ops.kernel_ops.ragged_paged_attention``: the kernel under ``attention="pallas"``
    (interpret mode on CPU), heads split over ``tensor``; None where it does not run."""
    q, pages, _, layer, seq, positions, tables = inputs(rng, mixed(20), 4, K, 16, 4, 5)

    def call(q, k, v, layer, seq, positions, tables):
        out = kernel_ops.ragged_paged_attention(q, k, v, layer, seq, positions, tables)
        return q if out is None else out  # a program must return something

    args = (q, *pages, layer, seq, positions, tables)

    def run():  # traced once: the program's text, then its result
        traced = jax.jit(call).trace(*args)
        return traced.lower().compile()(*args), str(traced.jaxpr)

    with use_execution(kernels=KernelOptions(attention=impl)):
        if tensor == 1:
            got, program = run()
        else:
            with use_mesh(jaxpar.make_mesh(tensor=tensor, devices=jax.devices()[:tensor])):
                got, program = run()
    assert ("ragged_paged_attention" in program) == runs
    if runs:
        assert rel_err(got, ragged_paged_attention_reference(q, *pages, layer, seq, positions, tables)) < 2e-5
