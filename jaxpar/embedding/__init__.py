"""Embedding tables larger than device memory: a frequency-aware software cache of rows.

Colossal-AI's freq-aware embedding cache (``CachedEmbeddingBag``; its DLRM work trains a
91 GB Criteo table with 1.5% of the rows on the GPU) in JAX, with TorchRec/FBGEMM's UVM
cache as what users compare it with. The whole table, one concatenated ``[R, D]`` table
for every feature (callers add each feature's row offset), and its optimizer state live
in host memory (``store``); ``cache_rows`` rows of it live on the device (``cache``).
Before each step the host makes the batch's rows resident and returns their slots; the
jitted step reads ``arrays.rows[slots]`` and updates only those rows (``update``); rows
evicted to make room go back to the host with their optimizer state.

- Eviction (``policy``): LFU by default, counts per id over the whole table (FBGEMM's
  LFU), or LRU (FBGEMM's LRU); never an id of the current batch, and the ids of the
  next batches only when nothing else frees enough room.
- Warm-up (``EmbeddingCache.warmup``): the hottest ids of a sample of the training data
  preloaded, their counts seeding LFU's (Colossal-AI's dataset strategy).
- Prefetch (``prefetch``): a host thread stages the next batches' missing rows while the
  device step runs; one job in flight and one staging buffer, so memory is bounded, and
  a staged row is bit-identical to a synchronous read, so results do not depend on timing.
- Exactness: duplicate ids are summed before the update, so training through the cache
  gives the same table as a dense table with the same sparse optimizer (bit-identical
  with SGD); ``flush``/``table()`` give the exact table for a checkpoint, ``load``
  restores one.
- Statistics (``stats``): hits, misses, evictions and bytes each way, per step and total.
- Model-parallel tables (``sharded``): the table's rows split over a mesh axis,
  row-wise or whole tables per device (TorchRec's row-wise and table-wise sharding,
  ``ShardingPlan``), looked up and updated by an all-to-all exchange with a batch that
  is data parallel over the same axis (``sharded_lookup``, ``sharded_update``), exactly
  as one device's ``sparse_update`` over the whole batch; with a cache on each device
  over its own shard (``ShardedCache``).
- No cache (``DeviceTable``): the whole table on the device(s) behind the same
  interface (replicated, or split by a ``ShardingPlan``), a row's slot its id; what the
  cache is checked against.

A step, with ``loss_fn(params, emb, batch)`` differentiable in the gathered rows
``emb [B, F, D]``::

    cache = EmbeddingCache.from_ratio(R, D, 0.01, optimizer=SparseOptimizer("adagrad"))
    cache.warmup(sample_ids, ratio=0.5)

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, arrays, slots, batch, lr):
        emb = arrays.rows[slots]
        loss, (g_params, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, emb, batch)
        arrays = sparse_update(arrays, slots, g_emb, lr, optimizer=cache.optimizer)
        return loss, ..., arrays

    slots = cache.prepare(ids)                # ids [B, F], global row ids
    loss, ..., cache.arrays = step(params, cache.arrays, slots, batch, lr)
"""

from jaxpar.embedding.cache import EmbeddingCache, cache_rows_for
from jaxpar.embedding.device_table import DeviceTable
from jaxpar.embedding.sharded import ShardingPlan, shard_arrays, sharded_lookup, sharded_update, unshard_arrays
from jaxpar.embedding.sharded_cache import ShardedCache
from jaxpar.embedding.stats import CacheStats
from jaxpar.embedding.update import CacheArrays, SparseOptimizer, sparse_update

__all__ = ["CacheArrays", "CacheStats", "DeviceTable", "EmbeddingCache", "ShardedCache", "ShardingPlan",
           "SparseOptimizer", "cache_rows_for", "shard_arrays", "sharded_lookup", "sharded_update", "sparse_update", "unshard_arrays"]
