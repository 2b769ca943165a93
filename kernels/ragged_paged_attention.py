"""Ragged paged attention, as a Pallas kernel: one flat batch of query tokens (decode
tokens, speculative tokens, prompt chunks, mixed; vLLM V1's and tpu-inference's step),
each token described by metadata, attends to its own sequence's slots in a pool of pages.

``ragged_paged_attention(q, k_pages, v_pages, layer, seq, positions, tables)`` with

* ``q [T, N, H]``: ``T`` query tokens, ``N`` query heads, a multiple of the ``K`` kv heads
  (query head ``n`` reads kv head ``n // G``, ``G = N // K``);
* ``k_pages``, ``v_pages [L, P, S_p, K, H]``: every layer's ``P`` pages of ``S_p`` slots
  (``jaxpar.serving.pages``' layout, ``paged_decode_attention``'s), ``layer`` an int scalar
  (traced: the model's layer scan passes it);
* ``seq [T]`` int: the sequence of each token, a row of ``tables``; ``seq[t] < 0`` is a
  padding token, whose output is zeros;
* ``positions [T]`` int: the token's slot in its own sequence, its key and value already
  written there;
* ``tables [S, W]`` int: slot ``s`` of sequence ``i`` lives at offset ``s % S_p`` of page
  ``tables[i, s // S_p]`` of layer ``layer``;

returns ``[T, N, H]`` in ``q``'s dtype: token ``t`` attends to its sequence's slots ``0 ..
positions[t]`` inclusive, so a prompt chunk is causal within itself and over its cached
prefix, and a decode token sees its whole context. Nothing else is read: table entries
past a sequence's pages (the serving engine points them at page 0, the null page) and
slots past the largest position of a sequence's tokens may hold anything, NaN included.
Table entries are clipped to ``[0, P)``, ``layer`` to ``[0, L)``, ``seq`` to ``[-1, S)``
and ``positions`` to ``[-1, W * S_p)`` (a position below 0 sees nothing: zeros), so no
load leaves the buffers. Softmax statistics and accumulation are float32 whatever the
input dtype; ``scale`` defaults to ``H ** -0.5``. Tokens may come in any order; tokens of
one sequence usually sit together (a prompt chunk), and the kernel is fastest then.

Kernel. The wrapper sorts the tokens by sequence (a stable ``argsort`` of ``T`` ints, in
XLA) and cuts each sequence's run into *query blocks* of at most ``block_q`` tokens; a
query block is one sequence's tokens, so all its rows read the same pages. The grid is
one program per (query block, kv head, split): its ``G * block_q`` query rows (every query
head of the kv head, for every token; padded to a power of two, as Triton wants) attend
together, one ``[R, H] x [H, block_k]`` matmul per tile of ``block_k`` slots, with an
online softmax over the tiles (``lax.fori_loop`` whose trip count is read from the
block's largest position, so it stops at the last tile any of its rows sees; each row's
own position masks the rest). A tile's slots are read through the page table as
``paged_decode_attention`` reads them: the kernel sees every page of every layer as one
array of rows ``[L * P * S_p, K, H]`` (a reshape, no copy) and each sequence's table as
each page's first row, ``(layer * P + tables) * S_p`` (``S * W`` ints, XLA), so the layer
is an offset into the rows, never ``pages[layer]`` (which would copy a layer's pages every
call), and a page may be any size. Queries are read, and outputs written, by row number
(``token * N + head``) straight from and into ``[T * N, H]`` arrays: no copy of ``q`` is
permuted or padded, and a padding token is never touched (its rows are zeroed after).
At batch 1 a long context's decode token would be ``K`` programs, too few for a GPU, so
each query block's slots are cut into ``num_splits`` tile-aligned partitions, one program
each (flash-decoding, as ``decode_attention``); each writes its normalised partial output
and log-sum-exp, and XLA combines the splits (weights ``softmax`` of the log-sum-exps).

Why this grid. A program must share its kv tiles among its rows to use a matmul, so its
rows must be one sequence's: a block of arbitrary tokens would need a gather per row and
no tensor core. One program per sequence walking all of its queries (tpu-inference's
order, natural on a TPU's sequential grid) would leave a GPU with one busy program per
long prompt; query blocks give a prompt chunk ``ceil(n / block_q)`` programs running in
parallel, and a decode token one. The number of query blocks is at most ``min(T, S +
T // block_q)`` (each sequence present adds at most one partial block), a bound of the
shapes alone, so the grid is static: one compiled program per ``T``, whatever the mix of
decode and prefill (no bucket per decode rows x prompt tokens x pages; blocks past the
batch's own count do nothing). Sorting makes every sequence one run, so its query blocks
are as few as they can be whatever order the tokens come in.

HBM traffic: a query block reads its sequence's slots ``0 .. max position`` of its kv
head once, ``2 * H * itemsize`` bytes a slot and kv head; slots past the largest position
are never loaded (masked loads; their page-table entries neither). So a decode token
reads its context once, the least there is, and a chunk of ``n`` prompt tokens over a
context ``c`` reads it ``ceil(n / block_q)`` times, as a flash-attention prefill reads its
keys once per query block. Beside it: ``q`` once per split, the float32 partial outputs
and log-sum-exps ``num_splits * T * N * (H + 1)`` floats written and read back, ``block_k``
page-table ints per tile, and the ``O(T)`` sort and block metadata.

Triton wants power-of-two tiles: rows ``R = pow2(G * block_q)`` (at least 16), columns
``pow2(H)`` (loads mask the columns past ``H``, so ``q.k`` is unchanged and no copy is
padded), ``block_k`` a power of two >= 16. Any ``T``, ``S``, ``W``, ``S_p`` and ``H``.
Row numbers are int32: more than ``2**31 - 1`` slots over all layers' pages (or ``T * N``
query rows) run the reference, logged once (``dispatch.fall_back``). Inference only: no
backward pass.

Not measured: there is no GPU here. The kernel has run only in Pallas interpret mode on
CPU (tests/test_kernels_ragged_paged_attention.py) and been lowered for CUDA without one
(tests/test_kernels_lower_for_gpu.py); its speed, its HBM bandwidth against the traffic
above, and the block sizes (``block_q`` defaults to ``64 // G`` tokens, 64 query rows;
``block_k`` to 64) are not yet measured on a GPU, and its compiled correctness waits for
bench/gpu_check.sh's ``correctness`` part.

``ragged_paged_attention_reference`` is plain ``jnp``: each token's sequence's whole table
width of pages gathered (``[T, W * S_p, K, H]``), slots past its position masked, softmax.

Dispatch (``interpret``) as in ``jaxpar.kernels``: ``None`` is the compiled kernel on a
GPU that runs it and the reference elsewhere; ``True`` the kernel in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.kernels.dispatch import fall_back, triton, use_pallas
from jaxpar.kernels.masks import masked_softmax
from jaxpar.kernels.tiles import load, online_softmax, pow2

# Query rows a program aims for (block_q's default: 64 // G tokens).
_ROWS = 64
# Programs the automatic split aims for (an H100 has 132 SMs), as decode_attention's.
_TARGET_PROGRAMS = 128
_MAX_SPLITS = 16
# Rows the kernel addresses (int32 row numbers): slots of every layer's pages, q's rows.
_MAX_ROWS = 2**31 - 1


def ragged_paged_attention(q, k_pages, v_pages, layer, seq, positions, tables, *, scale=None,
                           block_q: int | None = None, block_k: int = 64, num_splits: int | None = None,
                           interpret: bool | None = None):
    """Attention of a flat batch of tokens to their sequences' pages (module docstring):
    ``q [T, N, H]``, ``k_pages``/``v_pages [L, P, S_p, K, H]``, ``layer`` int scalar,
    ``seq [T]``, ``positions [T]`` int, ``tables [S, W]`` int -> ``[T, N, H]`` in ``q``'s
    dtype.

    ``block_q``: tokens per query block (``None``: ``max(1, 64 // G)``, 64 query rows);
    ``block_k``: slots per tile, a power of two >= 16; ``num_splits``: partitions of each
    query block's slots, one program each (``None``: ``min(16, ceil(128 / (blocks *
    K)))`` with ``blocks`` the grid's query blocks, enough programs to fill a GPU)."""
    _check(q, k_pages, v_pages, layer, seq, positions, tables, block_q, block_k, num_splits)
    T, N, H = q.shape
    L, P, page_size, K = k_pages.shape[:4]
    S, W = tables.shape
    scale = float(H**-0.5 if scale is None else scale)
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, L - 1)
    seq = jnp.clip(seq.astype(jnp.int32), -1, S - 1)
    positions = jnp.clip(positions.astype(jnp.int32), -1, W * page_size - 1)
    tables = jnp.clip(tables.astype(jnp.int32), 0, P - 1)
    reference = functools.partial(ragged_paged_attention_reference, q, k_pages, v_pages, layer, seq,
                                  positions, tables, scale=scale)
    if T == 0:
        return jnp.zeros(q.shape, q.dtype)
    if not use_pallas(interpret):
        return reference()
    if L * P * page_size > _MAX_ROWS or T * N > _MAX_ROWS:
        fall_back(f"ragged_paged_attention addresses rows in int32, so the kernel takes L * P * S_p and "
                  f"T * N < 2**31, got {L * P * page_size} and {T * N}")
        return reference()
    block_q = block_q or max(1, _ROWS // (N // K))
    blocks = min(T, S + T // block_q)
    splits = num_splits or max(1, min(_MAX_SPLITS, -(-_TARGET_PROGRAMS // (blocks * K))))
    starts = (layer * P + tables) * page_size  # each page's first row among the rows
    rows = lambda pages: pages.reshape(L * P * page_size, K, H)  # noqa: E731  (a bitcast: no copy)
    return _ragged(q, rows(k_pages), rows(v_pages), starts, seq, positions, scale=scale, block_q=block_q,
                   block_k=block_k, blocks=blocks, num_splits=splits, page_size=page_size,
                   interpret=bool(interpret))


def _check(q, k_pages, v_pages, layer, seq, positions, tables, block_q, block_k, num_splits):
    """Shapes the kernel takes: any ``T, N, H, L, P, S_p, S, W`` (``W, S >= 1``), ``N`` a
    multiple of ``K``; tiles as the module docstring says."""
    if (q.ndim != 3 or k_pages.ndim != 5 or v_pages.shape != k_pages.shape or q.shape[2] != k_pages.shape[4]
            or q.shape[1] % k_pages.shape[3] or jnp.ndim(layer) != 0 or seq.shape != q.shape[:1]
            or positions.shape != q.shape[:1] or tables.ndim != 2 or 0 in tables.shape):
        raise ValueError(f"ragged_paged_attention wants q [T, N, H], k_pages and v_pages [L, P, S_p, K, H] "
                         f"with N a multiple of K, layer a scalar, seq [T], positions [T], tables [S, W] "
                         f"(S, W >= 1); got q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}, "
                         f"layer {jnp.shape(layer)}, seq {seq.shape}, positions {positions.shape}, "
                         f"tables {tables.shape}")
    if block_q is not None and block_q < 1:
        raise ValueError(f"block_q must be >= 1 tokens, got {block_q=}")
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16 (Triton tiles), got {block_k=}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits=}")


def _kernel(first_ref, count_ref, seq_ref, order_ref, pos_ref, starts_ref, q_ref, k_ref, v_ref, o_ref,
            lse_ref, *, scale, groups, heads, block_q, block_k, num_splits, page_size, width):
    """One (query block, kv head ``h``, split): the block's ``count`` tokens, sorted
    tokens ``first .. first + count - 1`` (token ids ``order_ref``, positions
    ``pos_ref``), all of sequence ``seq``, whose pages' first rows are ``starts_ref[seq
    * width ...]``. ``q_ref [T * N, H]`` every query row, ``k_ref``/``v_ref [L * P * S_p,
    H]`` kv head ``h`` of every page's rows; writes this split's normalised output rows
    into ``o_ref [T * N, H]`` and their log-sum-exps into ``lse_ref [T * N, 1]`` (``-inf``
    where the split saw nothing)."""
    h = pl.program_id(1)
    first, count, seq = first_ref[()], count_ref[()], seq_ref[()]
    head_dim = k_ref.shape[1]
    R, Hp = pow2(groups * block_q), pow2(head_dim)
    # Row r: token i = r // G of the block, query head h * G + r % G.
    r = jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (1, Hp), 1)
    live = r // groups < count  # count <= block_q, so also r < G * block_q
    token = plgpu.load(order_ref.at[first + r // groups], mask=live, other=0)
    pos = plgpu.load(pos_ref.at[first + r // groups], mask=live, other=-1)  # [R, 1]; -1 sees nothing
    # A dead row points past the end: masked, never touched (interpret mode drops it too).
    rows = jnp.where(live, token * heads + h * groups + r % groups, q_ref.shape[0])
    q = plgpu.load(q_ref.at[rows, c], mask=live & (c < head_dim), other=0)
    length = jnp.max(pos) + 1  # the block's slots: 0 .. its largest position

    per_split = pl.cdiv(pl.cdiv(length, num_splits), block_k) * block_k
    start = pl.program_id(2) * per_split
    end = jnp.minimum(start + per_split, length)

    def body(i, carry):
        acc, m, total = carry
        first_slot = start + i * block_k
        slot = first_slot + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        # Slot s of the sequence: row starts[seq, s // S_p] + s % S_p; slots past the
        # block's length are not looked up, their loads masked (zeros).
        page_row = plgpu.load(starts_ref.at[seq * width + slot // page_size], mask=slot < length, other=0)
        at = page_row + slot % page_size
        k = load(k_ref, slot, c, (length, head_dim), at)
        v = load(v_ref, slot, c, (length, head_dim), at)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        visible = first_slot + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1) <= pos  # [R, block_k]
        s = jnp.where(visible, s * scale, -jnp.inf)
        return online_softmax(acc, m, total, s, v)

    f32 = jnp.float32
    init = (jnp.zeros((R, Hp), f32), jnp.full((R, 1), -jnp.inf, f32), jnp.zeros((R, 1), f32))
    acc, m, total = jax.lax.fori_loop(0, jnp.maximum(pl.cdiv(end - start, block_k), 0), body, init)
    empty = total == 0
    plgpu.store(o_ref.at[rows, c], acc / jnp.where(empty, 1.0, total), mask=live & (c < head_dim))
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, total)))
    plgpu.store(lse_ref.at[rows, jnp.zeros((1, 1), jnp.int32)], lse, mask=live)


def _query_blocks(seq, positions, S, block_q, blocks):
    """The grid's query blocks, in XLA: the tokens sorted by sequence (padding last),
    each sequence's run cut every ``block_q`` tokens. ``(order [T], sorted positions
    [T], first [blocks], count [blocks], block_seq [blocks])``: block ``j`` is sorted
    tokens ``first[j] .. first[j] + count[j] - 1`` of sequence ``block_seq[j]``; the
    blocks past the batch's own have ``count`` 0."""
    T = seq.shape[0]
    key = jnp.where(seq >= 0, seq, S)  # padding sorts last and starts no block
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    key = key[order]
    index = jnp.arange(T, dtype=jnp.int32)
    run_start = jax.lax.cummax(jnp.where(jnp.concatenate([jnp.ones(1, bool), key[1:] != key[:-1]]), index, 0))
    real = key < S
    opens = real & ((index - run_start) % block_q == 0)
    block = jnp.cumsum(opens) - 1  # < blocks: each sequence adds at most one partial block
    opened = jnp.where(opens, block, blocks)  # out of range: dropped
    first = jnp.zeros(blocks, jnp.int32).at[opened].set(index, mode="drop")
    block_seq = jnp.zeros(blocks, jnp.int32).at[opened].set(key, mode="drop")
    count = jnp.zeros(blocks, jnp.int32).at[jnp.where(real, block, blocks)].add(1, mode="drop")
    return order, positions[order], first, count, block_seq


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "blocks", "num_splits",
                                             "page_size", "interpret"))
def _ragged(q, k, v, starts, seq, positions, *, scale, block_q, block_k, blocks, num_splits, page_size,
            interpret):
    """The kernel over every page's rows ``k``, ``v [L * P * S_p, K, H]``, read through
    ``starts [S, W]`` (each page's first row), ``seq`` and ``positions`` clipped."""
    T, N, H = q.shape
    K = k.shape[1]
    S, W = starts.shape
    order, sorted_pos, first, count, block_seq = _query_blocks(seq, positions, S, block_q, blocks)
    grid = (blocks, K, num_splits)
    scalar = pl.BlockSpec((None,), lambda j, h, p: (j,))
    whole = lambda x: pl.BlockSpec(x.shape, lambda j, h, p: (0,) * x.ndim)  # noqa: E731
    pages = pl.BlockSpec((k.shape[0], None, H), lambda j, h, p: (0, h, 0))
    q_rows, starts = q.reshape(T * N, H), starts.reshape(S * W)  # bitcasts: no copy
    o, lse = pl.pallas_call(
        functools.partial(_kernel, scale=scale, groups=N // K, heads=N, block_q=block_q, block_k=block_k,
                          num_splits=num_splits, page_size=page_size, width=W),
        grid=grid,
        in_specs=[scalar, scalar, scalar, whole(order), whole(sorted_pos), whole(starts), whole(q_rows),
                  pages, pages],
        out_specs=[pl.BlockSpec((None, T * N, H), lambda j, h, p: (p, 0, 0)),
                   pl.BlockSpec((None, T * N, 1), lambda j, h, p: (p, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_splits, T * N, H), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, T * N, 1), jnp.float32)],
        interpret=interpret, compiler_params=triton(), name="ragged_paged_attention",
    )(first, count, block_seq, order, sorted_pos, starts, q_rows, k, v)

    # Combine the splits: weights exp(lse_p - max lse), a split that saw nothing weighs 0.
    top = lse.max(0)
    w = jnp.exp(lse - jnp.where(top == -jnp.inf, 0.0, top))
    total = w.sum(0)
    out = (o * w).sum(0) / jnp.where(total == 0, 1.0, total)  # [T * N, H]
    # A padding token's rows were never written (they hold whatever the buffer held).
    out = jnp.where((seq >= 0)[:, None, None], out.reshape(T, N, H), 0)
    return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames="scale")
def ragged_paged_attention_reference(q, k_pages, v_pages, layer, seq, positions, tables, *, scale=None):
    """Plain ``jnp``: each token's sequence's ``W`` pages of layer ``layer`` gathered
    (``[T, W * S_p, K, H]``, XLA's gather), the slots past the token's position masked
    (scores to ``-inf``, values to zero: an unwritten slot may hold NaN), softmax; zeros
    for a padding token (``seq < 0``) and one that sees nothing."""
    T, N, H = q.shape
    K = k_pages.shape[3]
    scale = H**-0.5 if scale is None else scale
    seq, positions = seq.astype(jnp.int32), positions.astype(jnp.int32)
    pages = tables[jnp.maximum(seq, 0)]  # [T, W]

    def gather(pages_):
        rows = pages_[layer, pages]  # [T, W, S_p, K, H]
        return rows.reshape(T, -1, K, H)

    k, v = gather(k_pages), gather(v_pages)
    visible = (jnp.arange(k.shape[1])[None] <= positions[:, None]) & (seq >= 0)[:, None]  # [T, S]
    scores = jnp.einsum("TKGH,TSKH->TKGS", q.reshape(T, K, N // K, H), k,
                        preferred_element_type=jnp.float32) * scale
    p = masked_softmax(scores, visible[:, None, None])
    v = jnp.where(visible[:, :, None, None], v, 0)  # 0 * NaN is NaN
    out = jnp.einsum("TKGS,TSKH->TKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(T, N, H).astype(q.dtype)
