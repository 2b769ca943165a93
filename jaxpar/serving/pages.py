"""A paged KV cache: fixed-size pages of keys/values shared by every sequence, a page
table per sequence, pages freed and reused (vLLM's PagedAttention layout, in JAX).

Device side: ``KVPages`` holds ``k``, ``v`` ``[L, P, page_size, K, H]`` for ``P`` pages
(keys rotated at their positions). Page 0 is the null page: rows of a page table past a
sequence's pages, and batch slots with no sequence, point at it, so their writes land
there and are never read as anyone's context. A sequence's token at position ``p`` lives
in page ``table[p // page_size]`` at offset ``p % page_size``.

Two views run inside a model's attention (``Attention.__call__`` calls ``attend``), each
holding every layer's pages and the index of the layer it serves (the layer scan carries
the pages whole and each layer scatters into them in place):

* ``DecodeView``: ``T`` new tokens per batch slot (``q [B, T, N, H]``: one when
  decoding, ``gamma + 1`` when verifying a draft), their keys/values written at the
  slot's next positions, then attention over the slot's pages, causal among the new
  tokens. Where the ``Execution``'s attention resolves to Pallas (a GPU, or
  ``attention="pallas"``: interpret mode elsewhere) the paged decode kernel
  (``jaxpar.kernels.paged_decode_attention``) reads the pages in place through the
  page tables; otherwise (the CPU path) XLA gathers each slot's pages into one
  ``[B, pages * page_size, K, H]`` row for ``dot_product_attention``. The choice is the
  one ``dot_product_attention`` makes, so it is part of the compiled program's key.
* ``PrefillView``: one packed row of new tokens from up to ``G`` sequences (``q [1, C,
  N, H]``), each token with its sequence's index in the row and its position; written
  to their pages, then each token attends over its own sequence's pages up to its
  position (an explicit ``[1, C, G * S]`` mask over the row's ``G`` gathered page
  ranges): a chunk continues a prefix already in the cache, so a prompt prefills in
  pieces. No padding between prompts; the row's tail past its tokens (to the compiled
  bucket) writes to the null page and is masked out. Always XLA's gather (an explicit
  mask, which ``dot_product_attention`` computes itself whatever the kernels).

* ``StepView``: one engine step's row, both at once: ``B`` decode rows of one token
  each (a ``DecodeView``) followed by a packed row of prompt chunks (a ``PrefillView``),
  so one forward of the model serves the whole step (Sarathi-Serve's mixed batch).

The host side (page ids, reference counts, the prefix cache) is
``jaxpar.serving.page_pool``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models.transformer import cross_mask
from jaxpar.ops import kernel_ops
from jaxpar.ops.attention import dot_product_attention

NULL_PAGE = 0
PACKED_SEQUENCES = (1, 2)  # a packed row's attention reads the pages of this many of its sequences, or all


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


def _write(pages: jax.Array, layer, tables: jax.Array, positions: jax.Array, new: jax.Array) -> jax.Array:
    """Every layer's ``pages [L, P, S_p, K, H]`` with ``new [..., K, H]`` written into
    layer ``layer``'s at ``positions [...]`` of the sequences whose page tables are
    ``tables [..., max_pages]``: a scatter into the whole array, which XLA does in place
    (a layer's pages sliced out and put back would copy them every step)."""
    size = pages.shape[2]
    page = jnp.take_along_axis(tables, (positions // size)[..., None], axis=-1)[..., 0]
    return pages.at[layer, page, positions % size].set(new.astype(pages.dtype))


def gather(pages: jax.Array, layer, tables: jax.Array) -> jax.Array:
    """Layer ``layer``'s pages read through ``tables [R, max_pages]``: ``[R, max_pages *
    S_p, K, H]``, each row one sequence's positions in order (one gather)."""
    rows = pages[layer, tables]  # [R, max_pages, S_p, K, H]
    return rows.reshape(rows.shape[0], -1, *rows.shape[3:])


def _store(view, token_tables, positions, k, v):
    """What both views do first: ``(pages_k, pages_v)``, ``view``'s pages with the new
    ``k``, ``v [..., K, H]`` written into its layer at ``positions [...]``
    (``token_tables [..., max_pages]``)."""
    return (_write(view.k, view.layer, token_tables, positions, k),
            _write(view.v, view.layer, token_tables, positions, v))


def _read(view, pages):
    """``(keys, values)`` ``[R, max_pages * S_p, K, H]``: ``view``'s layer of ``pages``
    gathered for every row of ``view.tables``."""
    return tuple(gather(p, view.layer, view.tables) for p in pages)


def side_by_side(rows: jax.Array) -> jax.Array:
    """``[G, S, K, H]`` (``G`` sequences' gathered pages) -> one row ``[1, G * S, K, H]``."""
    return rows.reshape(1, -1, *rows.shape[2:])


def packed_mask(index: jax.Array, positions: jax.Array, G: int, S: int) -> jax.Array:
    """bool ``[C, G * S]``: which of ``G`` sequences' gathered positions (``S`` each, side
    by side) the packed row's tokens see: token ``c`` sees its own sequence's
    (``index[c]``; -1 sees nothing) positions up to its own (``positions[c]``)."""
    owner, slot = jnp.arange(G * S) // S, jnp.arange(G * S) % S
    return (owner[None, :] == index[:, None]) & (slot[None, :] <= positions[:, None])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeView:
    """One layer's pages seen by ``B`` batch slots each extending its sequence by ``T``
    tokens (one when decoding, ``gamma + 1`` when verifying a speculative draft).

    ``k``, ``v`` ``[L, P, page_size, K, H]``, every layer's, read and written at
    ``layer``; ``tables`` int32 ``[B, max_pages]``; ``lengths`` int32 ``[B]``: tokens
    already cached per slot, so the new tokens sit at positions ``lengths[b] + 0..T-1``
    and attend causally, or with ``tree_mask`` (bool ``[B, T, T]``, CaPE's token tree:
    new token ``t`` sees new token ``j`` iff ``tree_mask[b, t, j]``) as it says."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array
    tables: jax.Array
    lengths: jax.Array
    tree_mask: jax.Array | None = None

    def attend(self, q, k, v):
        """``q [B, T, N, H]``, the new ``k``, ``v [B, T, K, H]`` -> (``[B, T, N, H]``,
        the updated pages ``(k, v)``)."""
        pages = self.store(k, v)
        return self.read(q, pages), pages

    def store(self, k, v):
        """The pages ``(k, v)`` with the new ``k``, ``v [B, T, K, H]`` written."""
        B, T = k.shape[:2]
        positions = self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)
        tables = jnp.broadcast_to(self.tables[:, None], (B, T, self.tables.shape[1]))
        return _store(self, tables, positions, k, v)

    def read(self, q, pages):
        """Attention of ``q [B, T, N, H]`` over ``pages`` (the new tokens already in)."""
        T = q.shape[1]
        out = None
        if self.tree_mask is None:  # (a tree's mask is not handed to the paged kernel yet)
            out = kernel_ops.paged_decode_attention(q, *pages, self.layer, self.tables, self.lengths + T)
        if out is None:  # not the Pallas attention: XLA gathers the pages
            keys, values = _read(self, pages)
            out = dot_product_attention(q, keys, values, causal=True, q_start=self.lengths,
                                        tree_mask=self.tree_mask)
        return out


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
class PrefillView:
    """One layer's pages seen by a packed row of ``C`` new tokens from up to ``G``
    sequences.

    ``tables`` int32 ``[G, max_pages]`` (the row's sequences); ``index`` int32 ``[C]``:
    each token's sequence in ``tables`` (``-1``: padding past the row's tokens);
    ``positions`` int32 ``[C]``: each token's position in its sequence."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array
    tables: jax.Array
    index: jax.Array
    positions: jax.Array

    def attend(self, q, k, v):
        """``q [1, C, N, H]``, the new ``k``, ``v [1, C, K, H]`` -> (``[1, C, N, H]``,
        the updated pages ``(k, v)``)."""
        pages = self.store(k, v)
        return self.read(q, pages), pages

    def store(self, k, v):
        """The pages ``(k, v)`` with the row's ``k``, ``v [1, C, K, H]`` written (its
        padding to the null page)."""
        valid = self.index >= 0
        token_tables = jnp.where(valid[:, None], self.tables[jnp.maximum(self.index, 0)], NULL_PAGE)
        return _store(self, token_tables, jnp.where(valid, self.positions, 0), k[0], v[0])

    def read(self, q, pages):
        """Attention of the row's ``q [1, C, N, H]`` over its sequences' ``pages``: over
        the first ``g`` sequences' only, ``g`` the least of ``PACKED_SEQUENCES`` (and
        ``G``) that holds the row's (``lax.switch``: one branch runs), since a step
        usually packs one or two prompts and the attention over ``G`` sequences' pages
        side by side costs ``G`` times one's (SmolLM2, a 128-token prompt at ``G`` = 8:
        230 ms a step against 144 ms over one sequence's pages, 2-core CPU)."""
        G = self.tables.shape[0]
        positions = jnp.where(self.index >= 0, self.positions, 0)

        def over(g):
            def attend(q, k, v):
                keys, values = (gather(p, self.layer, self.tables[:g]) for p in (k, v))
                mask = packed_mask(self.index, positions, g, keys.shape[1])
                return dot_product_attention(q, side_by_side(keys), side_by_side(values), causal=False,
                                             mask=mask[None])
            return attend

        sizes = [g for g in PACKED_SEQUENCES if g < G] + [G]
        if len(sizes) == 1:
            return over(G)(q, *pages)
        used = jnp.max(self.index) + 1  # the row's sequences are its first ones
        branch = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), used)
        return jax.lax.switch(branch, [over(g) for g in sizes], q, *pages)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepView:
    """One layer's pages seen by one engine step's row ``q [1, B + C, N, H]``: first
    ``B`` decode rows of one token each (``decode_tables [B, max_pages]``,
    ``decode_lengths [B]``, as ``DecodeView``'s; None when ``B`` is 0), then ``C``
    packed prompt tokens (``tables``, ``index``, ``positions``, as ``PrefillView``'s;
    None when ``C`` is 0). Each part writes its tokens and attends as its view does."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array
    decode_tables: jax.Array | None
    decode_lengths: jax.Array | None
    tables: jax.Array | None
    index: jax.Array | None
    positions: jax.Array | None

    def attend(self, q, k, v):
        """``q [1, B + C, N, H]``, the new ``k``, ``v [1, B + C, K, H]`` -> (``[1, B + C,
        N, H]``, the updated pages ``(k, v)``). Both parts write before either reads:
        a read between two writes of the pages would make XLA copy them whole."""
        B = 0 if self.decode_tables is None else self.decode_tables.shape[0]
        pages, parts = (self.k, self.v), []
        if B:
            view = DecodeView(*pages, self.layer, self.decode_tables, self.decode_lengths)
            pages = view.store(k[0, :B, None], v[0, :B, None])
            parts.append((view, q[0, :B, None], lambda out: out[:, 0][None]))
        if self.tables is not None:
            view = PrefillView(*pages, self.layer, self.tables, self.index, self.positions)
            pages = view.store(k[:, B:], v[:, B:])
            parts.append((view, q[:, B:], lambda out: out))
        return jnp.concatenate([shape(view.read(q, pages)) for view, q, shape in parts], axis=1), pages


# ------------------------------------------------------------------ the model's caches


def _run(pages: KVPages, layers, x, call, view, xs):
    """``Cache.run`` over pages: ``layers`` scanned over ``x``, layer ``i`` through
    ``view(k, v, i)``; the pages ride in the scan's carry, whole, so each layer's writes
    land in place. ``(x, pages)``."""
    graphdef, layer_state = nnx.split(layers)

    def layer(carry, inputs):
        x, k, v = carry
        state, i, extra = inputs
        x, (k, v) = call(nnx.merge(graphdef, state), x, view(k, v, i), extra)
        return (x, k, v), None

    count = jax.tree.leaves(layer_state)[0].shape[0]
    (x, k, v), _ = jax.lax.scan(layer, (x, pages.k, pages.v), (layer_state, jnp.arange(count), xs))
    return x, KVPages(k, v)


def _gathered(pages: KVPages, layers: range, tables: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Layers ``layers`` of ``pages`` read through ``tables [R, max_pages]``: ``(k, v)``
    ``[L', R, max_pages * S_p, K, H]``."""
    return tuple(jnp.stack([gather(p, i, tables) for i in layers]) for p in (pages.k, pages.v))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """``pages`` as ``B`` rows continue them (``jaxpar.models.transformer.Cache``): row
    ``b`` reads and writes through ``tables[b]`` (``[B, max_pages]``) and has
    ``lengths[b]`` tokens cached. Two models' pages (a draft's beside the target's) share
    the tables."""

    pages: KVPages
    tables: jax.Array
    lengths: jax.Array

    def run(self, layers, x, call, tree_mask=None, xs=None):
        view = lambda k, v, i: DecodeView(k, v, i, self.tables, self.lengths, tree_mask)  # noqa: E731
        x, pages = _run(self.pages, layers, x, call, view, xs)
        return x, PagedCache(pages, self.tables, self.lengths + x.shape[1])

    def with_lengths(self, lengths):
        return dataclasses.replace(self, lengths=lengths)

    def move(self, sources, targets):
        return dataclasses.replace(self, pages=KVPages(*(move(p, self.tables, sources, targets)
                                                         for p in (self.pages.k, self.pages.v))))

    def cross(self, layers, positions):
        k, v = _gathered(self.pages, layers, self.tables)
        return k, v, cross_mask(positions, self.lengths, k.shape[2])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepCache:
    """``pages`` as one engine step's row continues them (``Cache``'s ``run`` and
    ``cross``: a step's row is never rolled back; ``StepView``'s fields): ``decode_tables [B, max_pages]`` and ``decode_lengths [B]`` for its ``B``
    decode rows of one token (None for none), then a packed row of prompt chunks,
    ``tables [G, max_pages]``, each token's sequence ``index [C]`` and ``positions [C]``
    (None for none). The model runs it as one row ``[1, B + C]``, positions given. A
    packed row alone (no decode rows) is also a GliDe draft's prefill, whose
    ``cross`` reads the row's ``G`` sequences' target pages side by side."""

    pages: KVPages
    decode_tables: jax.Array | None
    decode_lengths: jax.Array | None
    tables: jax.Array | None
    index: jax.Array | None
    positions: jax.Array | None

    def run(self, layers, x, call, tree_mask=None, xs=None):
        fields = (self.decode_tables, self.decode_lengths, self.tables, self.index, self.positions)
        x, pages = _run(self.pages, layers, x, call, lambda k, v, i: StepView(k, v, i, *fields), xs)
        return x, dataclasses.replace(self, pages=pages)

    def cross(self, layers, positions):
        """The packed row's (no decode rows): its sequences' pages side by side, ``[L',
        1, G * S, K, H]``, each token reading its own sequence's up to its position."""
        k, v = _gathered(self.pages, layers, self.tables)
        G, S = k.shape[1:3]
        flat = lambda x: x.reshape(x.shape[0], 1, G * S, *x.shape[3:])  # noqa: E731
        return flat(k), flat(v), packed_mask(self.index, self.positions, G, S)[None]
