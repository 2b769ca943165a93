"""Decode attention over a preallocated KV cache (flash-decoding), as a Pallas kernel:
``T`` new query tokens per sequence attend to the filled part of the cache.

``decode_attention(q, k_cache, v_cache, lengths, *, tree_mask=None)`` with ``q [B, T, N, H]``,
``k_cache``/``v_cache [B, S, K, H]`` (``N`` a multiple of ``K``: query head ``n`` reads kv
head ``n // G``, ``G = N // K``) and ``lengths [B]`` int returns ``[B, T, N, H]`` in
``q``'s dtype. ``lengths[b]`` counts the filled slots *including* the ``T`` new tokens,
whose keys and values are already written at slots ``lengths[b] - T .. lengths[b] - 1``;
query ``t`` sits at position ``lengths[b] - T + t`` and sees

* every context slot ``s < lengths[b] - T``;
* new-token slot ``lengths[b] - T + j`` iff ``tree_mask[b, t, j]`` (``[B, T, T]`` bool, the
  token tree of speculative decoding: ancestors-or-self); ``None`` is causal, ``j <= t``;
* never a slot ``>= lengths[b]`` (whatever it holds).

Softmax statistics and accumulation are float32 whatever the input dtype.

Kernel: one program per (sequence ``b``, kv head ``h``, split ``p``). Its ``G * T`` query
rows (all the query heads reading kv head ``h``, for every new token) attend together:
one ``[G*T, H] x [H, block_k]`` matmul per cache block, an online softmax over the blocks
(``lax.fori_loop`` with a trip count read from ``lengths``, so it stops at the last block
holding a filled slot). At batch 1 a program per kv head would leave most of a GPU idle,
so each sequence's filled length is cut into ``num_splits`` block-aligned partitions, one
program each; a split writes its normalised partial output and log-sum-exp, and XLA
combines the splits afterwards (weights ``softmax`` of the log-sum-exps). The splits
divide ``lengths[b]``, not ``S``, so a cache filled to a tenth still keeps every split busy.
``lengths`` reaches each program as a scalar block (``BlockSpec((None,), (b,))``) and the
tree mask as one int32 bitmask per query row (bit ``j``: sees new token ``j``; hence
``T <= 32``; more run the reference), so the mask is shifts and ands, no gather.

HBM traffic: the filled part of the cache is read once per kv head, i.e. once in total,
``2 * sum(lengths) * K * H * itemsize`` bytes; slots past a length are never loaded (the
loads are masked), and ``q`` and the float32 partial outputs, ``B*K*num_splits*G*T*(H+1)``
floats, are small beside it. That figure over the time is the benchmark's GB/s.

Backend: ``pl.pallas_call`` with block specs (Triton on GPU): portable, and the same
kernel body runs in interpret mode on CPU. Triton wants power-of-two tiles, so query rows
are padded to a power of two >= 16 and ``q``'s head_dim with zeros to ``pow2(H)`` (``q``
is tiny); the cache is never copied or padded: its tiles are loaded as ``[block_k,
pow2(H)]`` with the slots past the length and the columns past ``H`` masked to zeros
(``q.k`` unchanged; the output's extra columns are sliced off). ``block_k`` must be a
power of two >= 16. ``T > 32`` new tokens (more than the bitmask holds) run the XLA
reference, logged once. Not yet
measured on a GPU. Inference only: no backward pass.

Paged cache: ``paged_decode_attention(q, k_pages, v_pages, layer, tables, lengths)`` reads
the same slots from a pool of pages (``jaxpar.serving.pages``' layout): ``k_pages``,
``v_pages [L, P, S_p, K, H]`` every layer's ``P`` pages of ``S_p`` slots, ``layer`` an int
scalar (traced: the model's layer scan passes it), ``tables [B, max_pages]`` int: slot
``s`` of sequence ``b`` lives at offset ``s % S_p`` of page ``tables[b, s // S_p]`` of
layer ``layer``. ``lengths`` and the masks are as above (the ``T`` new tokens already
written into their pages; causal among them), ``lengths[b] <= max_pages * S_p``. Table
entries past a sequence's pages are never read (the serving engine points them at page
0, the null page); entries are clipped to ``[0, P)`` and ``layer`` to ``[0, L)``, so no
load leaves the pages. It is this module's kernel with only the cache loads changed,
hence here rather than in a module of its own: the kernel sees every page of every layer
as one array of rows ``[L * P * S_p, K, H]`` (a reshape, no copy) and each sequence's
table as the first row of each of its pages, ``(layer * P + tables[b]) * S_p`` (``B *
max_pages`` ints computed in XLA), and reads a tile's slot ``s`` from row
``start[s // S_p] + s % S_p``. So the layer is an offset into the rows, not a slice of
the pages (``pages[layer]`` outside the kernel would copy a layer's pages every call),
and a page may be any size (a tile spans several pages or part of one; each slot's
``H`` values are contiguous either way, as in a contiguous cache: the same coalesced
loads, plus ``block_k`` table reads per tile). HBM traffic is the contiguous kernel's.
Row numbers are int32: more than ``2**31 - 1`` slots over all layers' pages run the
reference, logged once. ``paged_decode_attention_reference`` gathers the pages into one
row per sequence (XLA) and runs ``decode_attention_reference``.

Dispatch (``interpret``) as in ``jaxpar.kernels``: ``None`` is the compiled kernel on GPU
and the ``*_reference`` elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.kernels.dispatch import fall_back, triton, use_pallas
from jaxpar.kernels.masks import masked_softmax, tree_visible
from jaxpar.kernels.tiles import load, online_softmax, pow2, tile_index

# Programs the automatic split aims for: an H100 has 132 SMs.
_TARGET_PROGRAMS = 128
_MAX_SPLITS = 16
# New tokens per sequence the kernel takes: the tree mask is one int32 bitmask per row.
_MAX_QUERIES = 32
# Slots of every layer's pages the paged kernel addresses (int32 row numbers).
_MAX_ROWS = 2**31 - 1


@functools.partial(jax.jit, static_argnames="scale")
def decode_attention_reference(q, k_cache, v_cache, lengths, *, tree_mask=None, scale=None):
    """Plain ``jnp`` (materialises the ``[B, K, G, T, S]`` float32 scores)."""
    B, T, N, H = q.shape
    S, K = k_cache.shape[1:3]
    scale = H**-0.5 if scale is None else scale
    visible = _visible(lengths, T, S, tree_mask)  # [B, T, S]
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q.reshape(B, T, K, N // K, H), k_cache,
                        preferred_element_type=jnp.float32) * scale
    p = masked_softmax(scores, visible[:, None, None])
    filled = jnp.arange(S)[None, :, None, None] < lengths[:, None, None, None]
    v = jnp.where(filled, v_cache, 0)  # unwritten slots may hold inf/NaN: 0 * NaN is NaN
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, H).astype(q.dtype)


def _visible(lengths, T, S, tree_mask):
    """``[B, T, S]`` bool: which cache slots each new query sees."""
    if tree_mask is None:
        tree_mask = jnp.tril(jnp.ones((T, T), bool))[None]
    return tree_visible(lengths - T, T, S, tree_mask)


def decode_attention(q, k_cache, v_cache, lengths, *, tree_mask=None, scale=None,
                     block_k: int = 128, num_splits: int | None = None,
                     interpret: bool | None = None):
    """Attention of ``T`` new tokens to the filled cache (module docstring).

    ``num_splits``: partitions of each sequence's filled length, one program each;
    ``None`` picks ``min(16, ceil(128 / (B * K)))``, enough programs to fill a GPU at
    small batch. ``lengths`` must satisfy ``T <= lengths[b] <= S`` (values outside are
    clipped to ``[0, S]``, so no load ever leaves the cache)."""
    _check(q, k_cache, v_cache, lengths, tree_mask, block_k, num_splits)
    B, T, _, H = q.shape
    S, K = k_cache.shape[1:3]
    scale = float(H**-0.5 if scale is None else scale)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, S)
    if tree_mask is not None:
        tree_mask = tree_mask.astype(bool)
    if not use_pallas(interpret):
        return decode_attention_reference(q, k_cache, v_cache, lengths, tree_mask=tree_mask, scale=scale)
    if T > _MAX_QUERIES:
        fall_back(f"decode_attention packs the tree mask in int32 bits, so the kernel takes "
                  f"T <= {_MAX_QUERIES} new tokens, got T={T}")
        return decode_attention_reference(q, k_cache, v_cache, lengths, tree_mask=tree_mask, scale=scale)
    return _decode(q, k_cache, v_cache, lengths, tree_mask, None, scale, block_k,
                   _splits(B, K, num_splits), bool(interpret), None)


def _splits(B: int, K: int, num_splits: int | None) -> int:
    """``num_splits``, or enough programs to fill a GPU at small batch."""
    return num_splits or max(1, min(_MAX_SPLITS, -(-_TARGET_PROGRAMS // (B * K))))


@functools.partial(jax.jit, static_argnames="scale")
def paged_decode_attention_reference(q, k_pages, v_pages, layer, tables, lengths, *, scale=None):
    """Layer ``layer``'s pages gathered through ``tables`` into ``[B, max_pages * S_p, K,
    H]`` (XLA's gather), then ``decode_attention_reference``."""
    def gather(pages):
        rows = pages[layer, tables]  # [B, max_pages, S_p, K, H]
        return rows.reshape(rows.shape[0], -1, *rows.shape[3:])

    return decode_attention_reference(q, gather(k_pages), gather(v_pages), lengths, scale=scale)


def paged_decode_attention(q, k_pages, v_pages, layer, tables, lengths, *, scale=None,
                           block_k: int = 128, num_splits: int | None = None,
                           interpret: bool | None = None):
    """``decode_attention`` over a paged cache, causal among the ``T`` new tokens (module
    docstring): ``q [B, T, N, H]``, ``k_pages``/``v_pages [L, P, S_p, K, H]``, ``layer``
    int scalar, ``tables [B, max_pages]`` int, ``lengths [B]`` int (the filled slots,
    the new tokens included: ``T <= lengths[b] <= max_pages * S_p``; values outside
    are clipped) -> ``[B, T, N, H]`` in ``q``'s dtype."""
    _check_paged(q, k_pages, v_pages, layer, tables, lengths, block_k, num_splits)
    B, T, _, H = q.shape
    L, P, page_size, K = k_pages.shape[:4]
    scale = float(H**-0.5 if scale is None else scale)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, tables.shape[1] * page_size)
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, L - 1)
    tables = jnp.clip(tables.astype(jnp.int32), 0, P - 1)
    if not use_pallas(interpret):
        return paged_decode_attention_reference(q, k_pages, v_pages, layer, tables, lengths, scale=scale)
    if T > _MAX_QUERIES:
        fall_back(f"paged_decode_attention packs the causal mask in int32 bits, so the kernel takes "
                  f"T <= {_MAX_QUERIES} new tokens, got T={T}")
        return paged_decode_attention_reference(q, k_pages, v_pages, layer, tables, lengths, scale=scale)
    if L * P * page_size > _MAX_ROWS:
        fall_back(f"paged_decode_attention addresses the pages' rows in int32, so the kernel takes "
                  f"L * P * S_p < 2**31 slots, got {L * P * page_size}")
        return paged_decode_attention_reference(q, k_pages, v_pages, layer, tables, lengths, scale=scale)
    starts = (layer * P + tables) * page_size  # each page's first row among the rows
    rows = lambda pages: pages.reshape(L * P * page_size, K, H)  # noqa: E731  (a bitcast: no copy)
    return _decode(q, rows(k_pages), rows(v_pages), lengths, None, starts, scale, block_k,
                   _splits(B, K, num_splits), bool(interpret), page_size)


def _check_paged(q, k_pages, v_pages, layer, tables, lengths, block_k, num_splits):
    """Shapes ``paged_decode_attention`` takes: as ``_check``'s, the cache ``max_pages *
    S_p`` slots per sequence."""
    if (q.ndim != 4 or k_pages.ndim != 5 or v_pages.shape != k_pages.shape
            or q.shape[3] != k_pages.shape[4] or q.shape[2] % k_pages.shape[3] or jnp.ndim(layer) != 0
            or tables.shape[:1] != q.shape[:1] or tables.ndim != 2 or lengths.shape != q.shape[:1]):
        raise ValueError(f"paged_decode_attention wants q [B, T, N, H], k_pages and v_pages [L, P, S_p, "
                         f"K, H] with N a multiple of K, layer a scalar, tables [B, max_pages], lengths "
                         f"[B]; got q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}, layer "
                         f"{jnp.shape(layer)}, tables {tables.shape}, lengths {lengths.shape}")
    T, slots = q.shape[1], tables.shape[1] * k_pages.shape[2]
    if T > slots:
        raise ValueError(f"paged_decode_attention: T={T} new tokens do not fit {tables.shape[1]} pages "
                         f"of {k_pages.shape[2]} slots")
    _check_tiles(block_k, num_splits)


def _check(q, k_cache, v_cache, lengths, tree_mask, block_k, num_splits):
    """Shapes the kernel takes: any ``B, S, K``, ``N`` a multiple of ``K``, any ``H``
    (tiles padded to ``pow2(H)``), ``T <= S`` new tokens (``T > 32`` runs the reference);
    ``block_k`` a power of two >= 16 (Triton tiles)."""
    if (q.ndim != 4 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape
            or q.shape[0] != k_cache.shape[0] or q.shape[3] != k_cache.shape[3]
            or q.shape[2] % k_cache.shape[2] or lengths.shape != q.shape[:1]):
        raise ValueError(f"decode_attention wants q [B, T, N, H], k_cache and v_cache [B, S, K, H] "
                         f"with N a multiple of K, lengths [B]; got q {q.shape}, k_cache "
                         f"{k_cache.shape}, v_cache {v_cache.shape}, lengths {lengths.shape}")
    B, T = q.shape[:2]
    S = k_cache.shape[1]
    if T > S:
        raise ValueError(f"decode_attention: T={T} new tokens do not fit a cache of S={S} slots")
    if tree_mask is not None and tree_mask.shape != (B, T, T):
        raise ValueError(f"decode_attention wants tree_mask [B, T, T] = {(B, T, T)}, got {tree_mask.shape}")
    _check_tiles(block_k, num_splits)


def _check_tiles(block_k, num_splits):
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16 (Triton tiles), got {block_k}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def _kernel(len_ref, bits_ref, *refs, T, scale, block_k, num_splits, page_size):
    """One (sequence, kv head, split): ``q_ref [R, Hp]`` (``R`` padded query rows, ``Hp =
    pow2(H)`` columns, zeros past H), ``k_ref``/``v_ref [S, H]`` (the sequence's cache) or,
    with ``page_size``, ``[L * P * S_p, H]`` (every page's rows) read through
    ``starts_ref [max_pages]`` (the first row of each of the sequence's pages),
    ``bits_ref [R, 1]``; writes this split's normalised output ``[R, Hp]`` and
    log-sum-exp ``[R, 1]`` (``-inf`` where the split saw nothing)."""
    starts_ref, (q_ref, k_ref, v_ref, o_ref, lse_ref) = (refs[0], refs[1:]) if page_size else (None, refs)
    head_dim = k_ref.shape[1]
    length = len_ref[()]
    context = length - T  # slots [context, length) hold the new tokens
    per_split = pl.cdiv(pl.cdiv(length, num_splits), block_k) * block_k
    start = pl.program_id(2) * per_split
    end = jnp.minimum(start + per_split, length)
    q, bits = q_ref[...], bits_ref[...]
    R, H = q.shape

    def body(i, carry):
        acc, m, total = carry
        first = start + i * block_k
        slot = first + jnp.arange(block_k, dtype=jnp.int32)
        filled = slot < length
        # Masked loads: never read past the length (nor past S when S % block_k != 0),
        # nor past the true head_dim (the tile is [block_k, pow2(H)], zeros beyond).
        r, c = tile_index(first, block_k, q.shape[1])
        rows = None if starts_ref is None else _page_rows(starts_ref, r, length, page_size)
        k = load(k_ref, r, c, (length, head_dim), rows)
        v = load(v_ref, r, c, (length, head_dim), rows)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        j = (slot - context)[None, :]  # index among the new tokens
        tree = (jnp.right_shift(bits, jnp.clip(j, 0, 31)) & 1) == 1
        visible = (j < 0) | (filled[None, :] & tree)
        s = jnp.where(visible, s * scale, -jnp.inf)
        return online_softmax(acc, m, total, s, v)

    f32 = jnp.float32
    init = (jnp.zeros((R, H), f32), jnp.full((R, 1), -jnp.inf, f32), jnp.zeros((R, 1), f32))
    blocks = jnp.maximum(pl.cdiv(end - start, block_k), 0)
    acc, m, total = jax.lax.fori_loop(0, blocks, body, init)
    empty = total == 0
    o_ref[...] = acc / jnp.where(empty, 1.0, total)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, total)))


def _page_rows(starts_ref, slot, length, page_size):
    """``[R, 1]``: the rows holding a sequence's slots ``slot [R, 1]``, its page's first
    row plus the offset in the page (slots past ``length`` are not looked up: their
    loads are masked)."""
    start = plgpu.load(starts_ref.at[slot // page_size], mask=slot < length, other=0)
    return start + slot % page_size


@functools.partial(jax.jit, static_argnums=(6, 7, 8, 9, 10))
def _decode(q, k, v, lengths, tree_mask, starts, scale, block_k, num_splits, interpret, page_size):
    """The kernel over ``k``, ``v``: the cache ``[B, S, K, H]`` (``starts`` None), or
    every page's rows ``[L * P * S_p, K, H]`` read through ``starts [B, max_pages]``
    (each of a sequence's pages' first row; ``page_size`` ``S_p``)."""
    B, T, N, H = q.shape
    K = k.shape[-2]
    G = N // K
    R = pow2(G * T)  # Triton: power-of-two tiles, dot M >= 16
    Hp = pow2(H)  # zero columns: q.k unchanged, the output's extra columns sliced off
    # Rows of kv head h: r = g * T + t for query head h * G + g, token t.
    rows = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, R - G * T), (0, Hp - H)))
    if tree_mask is None:
        tree_mask = jnp.tril(jnp.ones((B, T, T), bool))
    bits = (tree_mask.astype(jnp.int32) << jnp.arange(T, dtype=jnp.int32)).sum(-1, dtype=jnp.int32)
    bits = jnp.pad(jnp.tile(bits, (1, G)), ((0, 0), (0, R - G * T)))[..., None]  # [B, R, 1]

    grid = (B, K, num_splits)
    if starts is None:
        cache = pl.BlockSpec((None, k.shape[1], None, H), lambda b, h, p: (b, 0, h, 0))
        tables, table_specs = (), []
    else:  # every program sees all the rows of its kv head; its sequence's starts pick its pages
        cache = pl.BlockSpec((k.shape[0], None, H), lambda b, h, p: (0, h, 0))
        tables, table_specs = (starts,), [pl.BlockSpec((None, starts.shape[1]), lambda b, h, p: (b, 0))]
    o, lse = pl.pallas_call(
        functools.partial(_kernel, T=T, scale=scale, block_k=block_k, num_splits=num_splits,
                          page_size=page_size),
        grid=grid,
        in_specs=[pl.BlockSpec((None,), lambda b, h, p: (b,)),
                  pl.BlockSpec((None, R, 1), lambda b, h, p: (b, 0, 0)),
                  *table_specs,
                  pl.BlockSpec((None, None, R, Hp), lambda b, h, p: (b, h, 0, 0)),
                  cache, cache],
        out_specs=[pl.BlockSpec((None, None, None, R, Hp), lambda b, h, p: (b, h, p, 0, 0)),
                   pl.BlockSpec((None, None, None, R, 1), lambda b, h, p: (b, h, p, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((*grid, R, Hp), jnp.float32),
                   jax.ShapeDtypeStruct((*grid, R, 1), jnp.float32)],
        interpret=interpret, compiler_params=triton(),
        name="decode_attention" if starts is None else "paged_decode_attention",
    )(lengths, bits, *tables, rows, k, v)

    # Combine the splits: weights exp(lse_p - max lse), a split that saw nothing weighs 0.
    top = lse.max(2, keepdims=True)
    w = jnp.exp(lse - jnp.where(top == -jnp.inf, 0.0, top))
    total = w.sum(2)
    out = (o * w).sum(2) / jnp.where(total == 0, 1.0, total)  # [B, K, R, Hp]
    out = out[:, :, :G * T, :H].reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4)
    return out.reshape(B, T, N, H).astype(q.dtype)
