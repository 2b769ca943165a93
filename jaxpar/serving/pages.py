"""A paged KV cache: fixed-size pages of keys/values shared by every sequence, a page
table per sequence, pages freed and reused (vLLM's PagedAttention layout, in JAX).

Device side: ``KVPages`` holds ``k``, ``v`` ``[L, P, page_size, K, H]`` for ``P`` pages
(keys rotated at their positions). Page 0 is the null page: rows of a page table past a
sequence's pages, and padding tokens, point at it, so their writes land there and are
never read as anyone's context. A sequence's token at slot ``s`` lives in page
``table[s // page_size]`` at offset ``s % page_size``.

**One attention over pages** (``attention``), vLLM V1's and tpu-inference's ragged
design: every query token carries its sequence (a row of the page tables ``[S, W]``,
``W`` pages wide whatever the context: the tables are metadata, never gathered whole)
and the last slot of that sequence it may read; it reads only its own sequence's pages,
up to that slot. Compiled shapes then depend on the token count alone, not on how long
the sequences are: XLA loops over blocks of pages with a trip count read from the
step's longest sequence (``lax.fori_loop``, an online softmax across blocks), each block
gathered for every token from its own sequence's table. A decode token costs its own
context; a prompt chunk's tokens each read their sequence's pages (the gather is per
token: for SmolLM2's 3 kv heads of 64 that is 1.5 KB per (token, slot) pair against
4.6 kFLOP of scores and values, the same order of cost on a CPU). Where the
``Execution``'s attention is Pallas (a GPU), the ragged kernel
(``jaxpar.kernels.ragged_paged_attention``) reads the pages in place instead (not yet
for a token tree's rows, nor a GliDe draft's cross-attention: XLA's loop runs those).

Two caches run the model over pages (``jaxpar.models.cache.Cache``):

* ``RaggedCache``: one engine step's flat row of tokens (decode tokens and prompt
  chunks of any sequences, in any mix: Sarathi-Serve's mixed batch as one ragged batch),
  each with its sequence and position.
* ``PagedCache``: ``B`` rows continuing ``B`` sequences by ``T`` tokens each (a
  speculative round's draft steps and verification, causal or by a token tree).

Both write the new keys/values into the pages before reading (a scatter XLA does in
place), and both give a GliDe draft's cross-attention the target's pages the same way
(``PagedCross``). The host side (page ids, reference counts, the prefix cache) is
``jaxpar.serving.page_pool``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.ops import kernel_ops

NULL_PAGE = 0
# Token-slots one step of attention's inner loop reads (a chunk of tokens, each a block
# of its own sequence's slots): the gathered block is chunk x slots x K x H.
BLOCK_ELEMENTS = 1024


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPages:
    """Every layer's pages: ``k``, ``v`` ``[L, P, page_size, K, H]``."""

    k: jax.Array
    v: jax.Array


def init_pages(layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int, dtype) -> KVPages:
    """``pages`` empty pages (page 0, the null page, among them)."""
    shape = (layers, pages, page_size, kv_heads, head_dim)
    return KVPages(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))  # two buffers: both are donated


def page_bytes(layers: int, page_size: int, kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of one page over every layer, keys and values."""
    return 2 * layers * page_size * kv_heads * head_dim * jnp.dtype(dtype).itemsize


def _write(pages: jax.Array, layer, tables: jax.Array, seq: jax.Array, slots: jax.Array,
           new: jax.Array) -> jax.Array:
    """Every layer's ``pages [L, P, S_p, K, H]`` with ``new [T, K, H]`` written into layer
    ``layer``'s at slots ``slots [T]`` of sequences ``seq [T]`` (``tables [S, W]``; a
    padding token's to the null page): a scatter into the whole array, which XLA does in
    place (a layer's pages sliced out and put back would copy them every step)."""
    size = pages.shape[2]
    valid = seq >= 0
    slots = jnp.where(valid, slots, 0)
    page = jnp.where(valid, tables[jnp.maximum(seq, 0), slots // size], NULL_PAGE)
    return pages.at[layer, page, slots % size].set(new.astype(pages.dtype))


def attention(q, k_pages, v_pages, layer, seq, last, tables, *, tree=None, block_slots: int | None = None,
              chunk: int | None = None):
    """Each query token over its own sequence's pages (module docstring): ``q [T, N, H]``
    reads layer ``layer`` of ``k_pages``, ``v_pages [L, P, S_p, K, H]`` at the slots
    ``0..last[t]`` of sequence ``seq[t]`` (``tables [S, W]``); ``last[t] < 0`` reads
    nothing and gives zeros, as does a padding token (``seq[t] < 0``). ``tree = (start
    [T], visible [T, n])``: slots ``start[t] + j`` (``j < n``) are read only where
    ``visible[t, j]`` (a token tree's new tokens). ``[T, N, H]`` in ``q``'s dtype.

    Two loops with trip counts read from the data: over chunks of ``chunk`` tokens up to
    the last token of a sequence (padding, at the end of a step's batch, costs nothing),
    and in each over blocks of ``block_slots`` slots (whole pages) up to the chunk's
    furthest ``last`` (an online softmax across blocks, in float32), so a chunk of a
    prompt reads no further than its own tokens and a short sequence beside a long one
    reads its own length. A chunk whose tokens are all of one sequence (most of a
    prompt's) reads each block once for them all; a mixed one (decode tokens) gathers
    each token's own (XLA:CPU's gather moves about an element a nanosecond, so reading
    a prompt's pages once per token cost a 128-token prompt 120 ms a step). Defaults:
    chunks of ``T // 16`` tokens (4 to 16), blocks of ``BLOCK_ELEMENTS // chunk`` slots."""
    T, N, H = q.shape
    S_p, K = k_pages.shape[2], k_pages.shape[3]
    G = N // K
    chunk = math.gcd(T, chunk or min(max(T // 16, 4), 16))
    W = tables.shape[1]
    per_block = min(max(1, (block_slots or max(BLOCK_ELEMENTS // chunk, S_p)) // S_p), W)  # pages a block reads
    tables = jnp.pad(tables, ((0, 0), (0, -W % per_block)))  # whole blocks (the null page past W)
    last = jnp.where(seq >= 0, last, -1)
    qf = q.reshape(T, K, G, H).astype(jnp.float32) * H ** -0.5
    span = per_block * S_p
    start, visible = (None, None) if tree is None else tree

    def tokens(i, out):
        at = lambda x: jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk)  # noqa: E731
        q_c, last_c, seq_c = at(qf), at(last), at(seq)
        tree_c = None if tree is None else (at(start), at(visible))

        def block(one, j, carry):
            """Block ``j`` of the chunk's slots; ``one``: every token of the chunk is of
            one sequence (a prompt's chunk), so the block is read once for them all,
            not once per token."""
            m, l, acc = carry  # running max, sum [c, K, G]; output [c, K, G, H]
            # each token's pages of the block, looked up here: [c, per_block] ints, not
            # every token's whole table once per layer
            columns = jax.lax.dynamic_slice_in_dim(tables, j * per_block, per_block, axis=1)  # [S, per_block]
            pages = jnp.where(seq_c[:, None] >= 0, columns[jnp.maximum(seq_c, 0)], NULL_PAGE)
            slots = j * span + jnp.arange(span, dtype=jnp.int32)
            seen = slots[None, :] <= last_c[:, None]  # [c, span]
            if tree_c is not None:
                offset = slots[None, :] - tree_c[0][:, None]
                inside = (offset >= 0) & (offset < tree_c[1].shape[1])
                picked = jnp.take_along_axis(tree_c[1], jnp.clip(offset, 0, tree_c[1].shape[1] - 1), axis=1)
                seen &= ~inside | picked
            if one:
                read = lambda p: p[layer, pages[0]].reshape(span, K, H).astype(jnp.float32)  # noqa: E731
                keys, values = read(k_pages), jnp.where(seen.any(0)[:, None, None], read(v_pages), 0.0)
                s = jnp.einsum("tkgh,skh->tkgs", q_c, keys)
            else:
                read = lambda p: p[layer, pages].reshape(chunk, span, K, H).astype(jnp.float32)  # noqa: E731
                keys, values = read(k_pages), jnp.where(seen[:, :, None, None], read(v_pages), 0.0)
                s = jnp.einsum("tkgh,tskh->tkgs", q_c, keys)
            s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
            new_m = jnp.maximum(m, s.max(-1))
            safe = jnp.where(jnp.isfinite(new_m), new_m, 0.0)
            p = jnp.where(seen[:, None, None, :], jnp.exp(s - safe[..., None]), 0.0)
            scale = jnp.exp(m - safe)
            pv = jnp.einsum("tkgs,skh->tkgh", p, values) if one else jnp.einsum("tkgs,tskh->tkgh", p, values)
            return new_m, l * scale + p.sum(-1), acc * scale[..., None] + pv

        blocks = jnp.maximum(jnp.max(last_c), -1) // span + 1
        init = (jnp.full((chunk, K, G), -jnp.inf), jnp.zeros((chunk, K, G)), jnp.zeros((chunk, K, G, H)))
        one = jnp.all((seq_c == seq_c[0]) | (seq_c < 0)) & (seq_c[0] >= 0)
        _, l, acc = jax.lax.cond(one, lambda: jax.lax.fori_loop(0, blocks, functools.partial(block, True), init),
                                 lambda: jax.lax.fori_loop(0, blocks, functools.partial(block, False), init))
        got = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(chunk, N, H).astype(q.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, got, i * chunk, 0)

    used = jnp.max(jnp.where(seq >= 0, jnp.arange(1, T + 1), 0))  # through the last token of a sequence
    return jax.lax.fori_loop(0, (used + chunk - 1) // chunk, tokens, jnp.zeros_like(q))


def move(pages: jax.Array, tables: jax.Array, sources: jax.Array, targets: jax.Array) -> jax.Array:
    """Every layer's ``pages [L, P, S_p, K, H]`` with the entries at positions ``sources
    [B, n]`` of the sequences whose page tables are ``tables [B, max_pages]`` copied to
    their positions ``targets [B, n]`` (all read before any is written)."""
    size = pages.shape[2]
    at = lambda positions: (jnp.take_along_axis(tables, positions // size, axis=1), positions % size)  # noqa: E731
    page, slot = at(sources)
    moved = pages[:, page, slot]  # [L, B, n, K, H]
    page, slot = at(targets)
    return pages.at[:, page, slot].set(moved)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagesView:
    """One layer's pages as ``B`` rows of ``T`` new tokens see them (the model's
    attention calls ``attend``): ``k``, ``v`` ``[L, P, S_p, K, H]`` every layer's, read
    and written at ``layer``; token ``(b, t)`` belongs to sequence ``seq[b, t]`` (a row
    of ``tables [S, W]``; ``-1``: padding) at slot ``slots[b, t]``, and reads its
    sequence's slots up to its own, or with ``tree_mask [B, T, T]`` (a token tree; the
    row's ``T`` tokens at consecutive slots of one sequence) the new tokens
    ``tree_mask[b, t]`` says."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array
    seq: jax.Array
    slots: jax.Array
    tables: jax.Array
    tree_mask: jax.Array | None = None

    def member(self, j: int, pages) -> PagesView:
        """Layer ``j`` of a group of layers whose first is ``layer``
        (``jaxpar.models.transformer.LayerGroup``), over ``pages`` ``(k, v)``: those the
        layer before it returned."""
        return dataclasses.replace(self, k=pages[0], v=pages[1], layer=self.layer + j)

    def joined(self, outputs) -> tuple:
        """The group's pages: its last layer's (each wrote into the one before's)."""
        return outputs[-1]

    def attend(self, q, k, v):
        """``q [B, T, N, H]``, the new ``k``, ``v [B, T, K, H]`` -> (``[B, T, N, H]``,
        the updated pages ``(k, v)``)."""
        B, T = q.shape[:2]
        seq, slots = self.seq.reshape(-1), self.slots.reshape(-1)
        pages = tuple(_write(p, self.layer, self.tables, seq, slots, new.reshape(B * T, *new.shape[2:]))
                      for p, new in ((self.k, k), (self.v, v)))
        return self.read(q, pages).reshape(q.shape), pages

    def read(self, q, pages):
        B, T = q.shape[:2]
        flat = q.reshape(B * T, *q.shape[2:])
        seq, slots = self.seq.reshape(-1), self.slots.reshape(-1)
        if self.tree_mask is None:
            out = kernel_ops.ragged_paged_attention(flat, *pages, self.layer, seq, slots, self.tables)
            if out is not None:
                return out
            return attention(flat, *pages, self.layer, seq, slots, self.tables)
        start = jnp.repeat(self.slots[:, 0], T)
        return attention(flat, *pages, self.layer, seq, slots, self.tables,
                         tree=(start, self.tree_mask.reshape(B * T, T)))


def _run(pages: KVPages, layers, x, call, view, xs):
    """``Cache.run`` over pages: ``layers`` scanned over ``x``, stacked unit ``i`` through
    ``view(k, v, first)``, ``first`` its first layer (``i n`` where a unit holds ``n``
    layers: a MoE model's ``model.moe.every = n`` groups); the pages ride in the scan's
    carry, whole, so each layer's writes land in place. ``(x, pages)``."""
    graphdef, layer_state = nnx.split(layers)

    def layer(carry, inputs):
        x, k, v = carry
        state, i, extra = inputs
        x, (k, v) = call(nnx.merge(graphdef, state), x, view(k, v, i), extra)
        return (x, k, v), None

    count = jax.tree.leaves(layer_state)[0].shape[0]
    firsts = jnp.arange(count) * (pages.k.shape[0] // count)
    (x, k, v), _ = jax.lax.scan(layer, (x, pages.k, pages.v), (layer_state, firsts, xs))
    return x, KVPages(k, v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCross:
    """A GliDe draft's cross-attention source over the target's pages
    (``jaxpar.models.glide``'s ``CrossSource``): draft layer ``i`` reads target layer
    ``first + i``; query token ``(b, t)`` of sequence ``seq[b, t]`` reads its slots up to
    ``last[b, t]`` (its position, and no further than what the target has verified)."""

    pages: KVPages
    first: int = dataclasses.field(metadata=dict(static=True))
    seq: jax.Array
    last: jax.Array
    tables: jax.Array

    def layer(self, i):
        return _PagedCrossLayer(self, self.first + i)


@dataclasses.dataclass(frozen=True)
class _PagedCrossLayer:
    source: PagedCross
    layer: jax.Array

    def attend(self, q):
        """``q [B, T, N, H]`` -> ``[B, T, N, H]`` (zeros for a query with nothing to read)."""
        s = self.source
        flat = q.reshape(-1, *q.shape[2:])
        out = attention(flat, s.pages.k, s.pages.v, self.layer, s.seq.reshape(-1), s.last.reshape(-1), s.tables)
        return out.reshape(q.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """``pages`` as ``B`` rows continue them (``jaxpar.models.cache.Cache``): row
    ``b`` reads and writes through ``tables[b]`` (``[B, W]``) and has ``lengths[b]``
    tokens cached. Two models' pages (a draft's beside the target's) share the tables."""

    pages: KVPages
    tables: jax.Array
    lengths: jax.Array

    def _rows(self, T):
        B = self.tables.shape[0]
        seq = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
        return seq, self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)

    def run(self, layers, x, call, tree_mask=None, xs=None):
        seq, slots = self._rows(x.shape[1])
        view = lambda k, v, i: PagesView(k, v, i, seq, slots, self.tables, tree_mask)  # noqa: E731
        x, pages = _run(self.pages, layers, x, call, view, xs)
        return x, PagedCache(pages, self.tables, self.lengths + x.shape[1])

    def with_lengths(self, lengths):
        return dataclasses.replace(self, lengths=lengths)

    def move(self, sources, targets):
        return dataclasses.replace(self, pages=KVPages(*(move(p, self.tables, sources, targets)
                                                         for p in (self.pages.k, self.pages.v))))

    def cross(self, layers, positions):
        """Each query at ``positions [B, T]`` reads the verified slots (``< lengths``) up
        to its position."""
        seq, _ = self._rows(positions.shape[1])
        last = jnp.minimum(positions, self.lengths[:, None] - 1)
        return PagedCross(self.pages, layers.start, seq, last, self.tables)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedCache:
    """``pages`` as one engine step's flat row continues them (``Cache``'s ``run`` and
    ``cross``; a step's row is never rolled back): ``T`` tokens, token ``t`` of sequence
    ``seq[t]`` (a row of ``tables [S, W]``; ``-1``: padding, written to the null page)
    at position ``positions[t]``. The model runs it as one row ``[1, T]``, positions
    given. A GliDe draft's prefill reads the target's pages of the same tokens through
    ``cross``."""

    pages: KVPages
    seq: jax.Array
    positions: jax.Array
    tables: jax.Array

    def run(self, layers, x, call, tree_mask=None, xs=None):
        view = lambda k, v, i: PagesView(k, v, i, self.seq[None], self.positions[None], self.tables)  # noqa: E731
        x, pages = _run(self.pages, layers, x, call, view, xs)
        return x, dataclasses.replace(self, pages=pages)

    def cross(self, layers, positions):
        """Each token reads its own sequence's target slots up to its position."""
        return PagedCross(self.pages, layers.start, self.seq[None], positions, self.tables)
