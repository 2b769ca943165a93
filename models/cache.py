"""What a model's forward continues: the ``Cache`` interface, the contiguous ``KVCache``
(one preallocated row per sequence: the dense decoder's), and the sources a GliDe
draft's cross-attention reads the target's keys through (``CrossSource``,
``DenseCross``). The paged caches of ``jaxpar.serving.pages`` implement the same
interface, so one model, one draft and one speculative round serve both."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models.config import ModelConfig
from jaxpar.ops.attention import dot_product_attention


class Cache(Protocol):
    """What a model's forward continues: ``KVCache`` (contiguous, per sequence) here, and
    the paged caches of ``jaxpar.serving.pages``. One interface, so one model, one
    draft and one speculative round (``jaxpar.inference.speculative``) serve both.

    ``run(layers, x, call, tree_mask=None, xs=None) -> (x, cache)``: the stacked
    ``layers`` scanned over the residual stream ``x [B, T, D]``, layer ``i`` called as
    ``call(layer, x, view, xs_i)`` with ``view`` this cache's view of layer ``i`` (its
    ``attend(q, k, v) -> (out, updated)`` writes the new keys/values and attends over the
    cached ones, causally among the new tokens or by ``tree_mask [B, T, T]``) and
    ``xs_i`` layer ``i``'s slice of ``xs`` (a GliDe draft's cross-attention inputs);
    returns the cache with every length advanced by ``T``.
    ``lengths``: int32 ``[B]``, the tokens each row has cached (where a new token's
    position defaults from). ``with_lengths(n)``: the same entries, lengths ``n`` (a
    rollback). ``move(sources, targets)``: the entries at positions ``sources [B, n]``
    copied to ``targets [B, n]``, all read before any is written (a token tree's
    accepted path put in place). ``cross(layers, positions)``: a GliDe draft's
    cross-attention source (``DenseCross``'s interface) over target layers ``layers`` (a
    ``range``), where a query at ``positions [B, T]`` reads its own sequence's keys up
    to its position, of those cached.
    """

    lengths: jax.Array

    def run(self, layers, x, call, tree_mask=None, xs=None) -> tuple[jax.Array, "Cache"]: ...

    def with_lengths(self, lengths: jax.Array) -> "Cache": ...

    def move(self, sources: jax.Array, targets: jax.Array) -> "Cache": ...

    def cross(self, layers: range, positions: jax.Array) -> CrossSource: ...


def cross_mask(positions: jax.Array, lengths: jax.Array, S: int) -> jax.Array:
    """bool ``[B, T, S]``: a query at ``positions [B, T]`` sees cached keys ``<=`` its
    position among each row's first ``lengths [B]`` (those verified)."""
    keys = jnp.arange(S, dtype=jnp.int32)[None, None, :]
    return (keys <= positions[:, :, None]) & (keys < lengths[:, None, None])


class CrossSource(Protocol):
    """What a GliDe draft's cross-attention reads: ``layer(i)``, draft layer ``i``'s view
    of the target's keys and values, whose ``attend(q [B, T, N, H]) -> [B, T, N, H]``
    reads what each query may see (zeros where nothing). ``DenseCross`` holds them;
    ``jaxpar.serving.pages.PagedCross`` reads them from the pages."""

    def layer(self, i: jax.Array): ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseCross:
    """A ``CrossSource`` held whole: the target's keys and values of the draft's layers
    ``k``, ``v`` ``[L', B, S, K, H]`` and which of them each query reads, ``mask`` bool
    ``[B, T, S]``. A source's ``layer(i)`` is what draft layer ``i`` attends over
    (``attend(q [B, T, N, H]) -> [B, T, N, H]``); the paged caches' source
    (``jaxpar.serving.pages.PagedCross``) reads the pages instead of holding them."""

    k: jax.Array
    v: jax.Array
    mask: jax.Array

    def layer(self, i):
        return DenseCrossLayer(self.k[i], self.v[i], self.mask)


@dataclasses.dataclass(frozen=True)
class DenseCrossLayer:
    """One layer of a ``DenseCross``: ``k``, ``v`` ``[B, S, K, H]``, ``mask [B, T, S]``."""

    k: jax.Array
    v: jax.Array
    mask: jax.Array

    def attend(self, q):
        # A query the mask leaves no key reads nothing (zeros), not an average of all.
        return dot_product_attention(q, self.k.astype(q.dtype), self.v.astype(q.dtype), causal=False,
                                     mask=self.mask)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys/values of every layer, preallocated: ``k``, ``v`` ``[L, B, S_max, K, H]``
    (keys rotated at their positions); sequence ``b`` has filled slots
    ``0..lengths[b]-1`` (``lengths`` int32 ``[B]``). Slots past a length are never read,
    so rolling a sequence back is setting its length. A ``Cache``."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    def run(self, layers, x, call, tree_mask=None, xs=None):
        """``Cache.run``. Where the stack holds ``U`` units of ``n = L / U`` layers each (a
        MoE model's ``model.moe.every = n`` groups), unit ``u``'s view holds layers ``u n
        .. u n + n - 1``: ``k``, ``v`` ``[n, B, S_max, K, H]``, and it returns theirs."""
        B, T = x.shape[:2]
        lengths = jnp.broadcast_to(self.lengths, (B,))
        graphdef, layer_state = nnx.split(layers)
        units = jax.tree.leaves(layer_state)[0].shape[0]
        grouped = lambda a: a if units == a.shape[0] else a.reshape(units, -1, *a.shape[1:])  # noqa: E731

        def layer(x, inputs):
            state, k, v, extra = inputs
            return call(nnx.merge(graphdef, state), x, CacheView(k, v, lengths, tree_mask), extra)

        x, (k, v) = jax.lax.scan(layer, x, (layer_state, grouped(self.k), grouped(self.v), xs))
        return x, KVCache(k.reshape(self.k.shape), v.reshape(self.v.shape), lengths + T)

    def with_lengths(self, lengths):
        return dataclasses.replace(self, lengths=lengths)

    def move(self, sources, targets):
        def move(x):  # [L, B, S, K, H]
            moved = jnp.take_along_axis(x, sources[None, :, :, None, None], axis=2)
            return x.at[:, jnp.arange(x.shape[1])[:, None], targets].set(moved)

        return KVCache(move(self.k), move(self.v), self.lengths)

    def cross(self, layers, positions):
        k, v = self.k[layers.start:layers.stop], self.v[layers.start:layers.stop]
        return DenseCross(k, v, cross_mask(positions, self.lengths, k.shape[2]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheView:
    """One layer of a ``KVCache`` as attention sees it: ``k``, ``v`` ``[B, S_max, K, H]``
    and ``lengths [B]``. ``attend`` writes the new keys/values at slots ``lengths[b] +
    0..T-1`` and attends over the slots filled, causally among the new tokens or by
    ``tree_mask [B, T, T]`` (a token tree's: new token ``t`` sees new token ``j`` iff
    ``tree_mask[b, t, j]``). The paged views of ``jaxpar.serving.pages`` keep the same
    interface, so one model serves both caches."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    tree_mask: jax.Array | None = None

    def member(self, j: int, state) -> CacheView:
        """Layer ``j``'s view where this one holds a group's layers (``k``, ``v`` ``[n, B,
        S_max, K, H]``; ``jaxpar.models.transformer.LayerGroup``); ``state``, what the
        layer before returned, is not read: each layer has its own slots."""
        return dataclasses.replace(self, k=self.k[j], v=self.v[j])

    def joined(self, outputs) -> tuple:
        """The group's new ``(k, v)``: its layers' stacked."""
        return tuple(jnp.stack(parts) for parts in zip(*outputs))

    def attend(self, q, k, v):
        """``q [B, T, N, H]``, the new ``k``, ``v [B, T, K, H]`` -> (``[B, T, N, H]``, the
        layer's updated ``(k, v)``)."""
        k, v = write_cache(self.k, k, self.lengths), write_cache(self.v, v, self.lengths)
        out = dot_product_attention(q, k, v, causal=True, q_start=self.lengths, tree_mask=self.tree_mask)
        return out, (k, v)


def init_cache(cfg: ModelConfig, batch: int, max_length: int) -> KVCache:
    """An empty cache for ``batch`` sequences of up to ``max_length`` tokens."""
    shape = (cfg.layers, batch, max_length, cfg.kv_heads, cfg.head_dim)
    zeros = jnp.zeros(shape, cfg.compute_dtype)
    return KVCache(zeros, zeros, jnp.zeros((batch,), jnp.int32))


def write_cache(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes ``new [B, T, ...]`` into ``cache [B, S_max, ...]`` at slots
    ``starts[b] + 0..T-1`` of each sequence (``starts`` int ``[B]``, or a scalar for
    all). The caller keeps ``starts + T <= S_max``: a write past the end is clamped."""
    starts = jnp.broadcast_to(starts, cache.shape[:1])
    write = lambda c, x, s: jax.lax.dynamic_update_slice_in_dim(c, x, s, axis=0)
    return jax.vmap(write)(cache, new.astype(cache.dtype), starts)
