"""DLRM, the deep learning recommendation model, in Flax NNX.

Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems": a bottom MLP over the dense features, one embedding row per
categorical feature, an interaction of the F + 1 resulting vectors, and a top MLP to one
click logit. Two interactions:

* ``dot``: DLRM's pairwise dot products of the F + 1 vectors (strictly lower triangle),
  concatenated with the bottom MLP's output (the reference's ``interaction_op="dot"``).
* ``dcn``: DCNv2's cross network (Wang et al. 2021, "DCN V2", eq. 1) over the
  concatenation ``x0 = [bottom, emb_1 .. emb_F]``: ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``,
  with ``W_l = U_l V_l`` of rank ``dcn_rank`` when it is non-zero (the paper's
  low-rank DCN-Mix without experts, as MLPerf's DLRM-DCNv2 benchmark uses), then the
  top MLP over ``x_L``.

The embedding tables are ONE parameter ``table [R, D]``, R = sum of ``table_rows``;
feature f's table is rows ``offsets[f] .. offsets[f] + table_rows[f] - 1``. Its logical
axes (``table_rows``, ``table_embed``) let a rule split the rows over a mesh axis
(row-wise sharding). ``__call__`` takes the looked-up embeddings as an input, so an
embedding cache (``jaxpar.embedding``) can gather rows outside the model and feed
them in; ``lookup`` / ``forward`` are the uncached path.

Parameter layout (X = (F + 1) * D, the cross network's width):
  table                      [R, D]      (table_rows, table_embed)
  bottom.layers[i].kernel    [in, out]   (dlrm_in, dlrm_out)    bias [out] (dlrm_out,)
  cross.layers[l].kernel     [X, X]      (dlrm_in, dlrm_out)    dcn_rank == 0
  cross.layers[l].down, up   [X, r], [r, X]                     dcn_rank > 0
  cross.layers[l].bias       [X]
  top.layers[i].kernel       [in, out]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar.models.config import literal_choices

INTERACTIONS = ("dot", "dcn")
DTYPES = ("float32", "bfloat16", "float16")
TABLE_AXES = ("table_rows", "table_embed")
WEIGHT_AXES = ("dlrm_in", "dlrm_out")
# The rules these names need (add them with ``jaxpar.rules.extend(rules, *RULES)``): the
# MLPs and cross layers are data parallel (replicated); row-wise sharding of the tables
# overrides ``table_rows`` with a mesh axis.
RULES = (("table_rows", None), ("table_embed", None), ("dlrm_in", None), ("dlrm_out", None))

# Criteo Terabyte's per-feature cardinalities (days 0-23, as TorchRec's DLRM example and
# MLPerf list them), C1..C26.
CRITEO_1TB_CARDINALITIES = (
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
    2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
)


def capped_rows(cardinalities: typing.Sequence[int], total: int) -> tuple[int, ...]:
    """Rows per table summing to ``total``: each table keeps its cardinality up to one
    common cap (the largest that fits; DLRM's ``--max-ind-range`` hashing), and the rows
    left over go one each to the capped tables, first ones first."""
    cards = np.asarray(cardinalities, np.int64)
    if cards.sum() <= total:
        raise ValueError(f"cardinalities sum to {int(cards.sum())}, not more than total={total}")
    lo, hi = 1, int(cards.max())
    while lo < hi:  # the largest cap with sum(min(card, cap)) <= total
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if np.minimum(cards, mid).sum() <= total else (lo, mid - 1)
    rows = np.minimum(cards, lo)
    capped = np.flatnonzero(cards > lo)
    rows[capped[: total - int(rows.sum())]] += 1
    return tuple(int(r) for r in rows)


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
    """A DLRM; the defaults are the ``dlrm`` preset (trains in seconds on a CPU)."""

    dense_features: int = 13  # Criteo's 13 integer columns
    # Rows of each categorical feature's table (F = len); ids are hashed into them.
    table_rows: tuple[int, ...] = (10000, 20000, 30000, 50000, 10000, 40000, 25000, 15000)
    embed_dim: int = 16  # D
    bottom: tuple[int, ...] = (64, 16)  # bottom MLP widths; the last is D
    top: tuple[int, ...] = (64, 32, 1)  # top MLP widths; the last is 1 (the logit)
    interaction: Literal[INTERACTIONS] = "dot"
    dcn_layers: int = 3  # cross layers, interaction="dcn"
    dcn_rank: int = 0  # 0: full-rank W_l; r > 0: W_l = U_l V_l of rank r
    dtype: Literal[DTYPES] = "float32"  # compute dtype
    param_dtype: Literal[DTYPES] = "float32"

    def __post_init__(self):
        for name in ("table_rows", "bottom", "top"):  # YAML gives lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("dense_features", "embed_dim", "dcn_layers"):
            _check_int(name, getattr(self, name), 1)
        _check_int("dcn_rank", self.dcn_rank, 0)
        for name in ("table_rows", "bottom", "top"):
            value = getattr(self, name)
            if not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
                raise ValueError(f"model.{name}={value!r} must be a non-empty tuple of positive ints")
        if sum(self.table_rows) >= 2**31:
            raise ValueError(f"model.table_rows sum to {sum(self.table_rows)}, more than int32 row ids hold")
        if self.bottom[-1] != self.embed_dim:
            raise ValueError(f"model.bottom={self.bottom!r} must end in model.embed_dim={self.embed_dim}")
        if self.top[-1] != 1:
            raise ValueError(f"model.top={self.top!r} must end in 1 (the logit)")
        for name, allowed in literal_choices(DLRMConfig).items():  # interaction, dtype, param_dtype
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be one of {allowed}")

    @property
    def features(self) -> int:
        """F, the categorical features (tables)."""
        return len(self.table_rows)

    @property
    def total_rows(self) -> int:
        """R, the rows of the concatenated table."""
        return sum(self.table_rows)

    @property
    def offsets(self) -> np.ndarray:
        """int32 ``[F]``: the first row of each table in the concatenated table."""
        return _offsets(self.table_rows)

    @property
    def interaction_width(self) -> int:
        """The top MLP's input width."""
        F, D = self.features, self.embed_dim
        return D + (F + 1) * F // 2 if self.interaction == "dot" else (F + 1) * D


@functools.lru_cache(maxsize=64)
def _offsets(table_rows: tuple[int, ...]) -> np.ndarray:
    offsets = np.concatenate([[0], np.cumsum(table_rows[:-1])]).astype(np.int32)
    offsets.flags.writeable = False  # shared by every caller
    return offsets


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"model.{name}={value!r} must be an int >= {low}")


DLRM_PRESETS: dict[str, DLRMConfig] = {
    # 8 tables of 10,000-50,000 rows (200,000 in all; 1% holds a batch of 64): trains in
    # seconds on a CPU (the CI model).
    "dlrm": DLRMConfig(),
    # Criteo's 26 features at the CPU model's size: the dlrm preset's 200,000 rows in all,
    # each table its Criteo Terabyte cardinality up to a common cap (what `jaxpar-train
    # dlrm data.format=criteo` trains).
    "dlrm_criteo_small": DLRMConfig(table_rows=capped_rows(CRITEO_1TB_CARDINALITIES, 200_000)),
    # MLPerf DLRM-DCNv2's shape on 26 tables hashed to 4,194,304 rows in all: each table
    # keeps its Criteo Terabyte cardinality up to a common cap (546,574 rows; 6 tables
    # are capped), as DLRM's --max-ind-range caps them. Low-rank cross layers, rank 512,
    # as MLPerf's benchmark has them.
    "dlrm_criteo": DLRMConfig(
        table_rows=capped_rows(CRITEO_1TB_CARDINALITIES, 4_194_304), embed_dim=128,
        bottom=(512, 256, 128), top=(1024, 1024, 512, 256, 1), interaction="dcn", dcn_rank=512,
    ),
}


def _param(rngs: nnx.Rngs, cfg: DLRMConfig, shape, names, init) -> nnx.Param:
    """A parameter annotated with logical axis names; sharding is left to shard_model."""
    annotated = nnx.with_partitioning(init, names, eager_sharding=False)
    return nnx.Param(annotated(rngs.params(), shape, jnp.dtype(cfg.param_dtype)))


def _table_init(table_rows: tuple[int, ...]):
    """DLRM's init: table t's rows uniform in +-sqrt(1 / rows_t) (dlrm_s_pytorch.py)."""

    ends = np.cumsum(table_rows)

    def init(key, shape, dtype):
        # Row r's table by comparing r with the tables' ends, r behind an optimization
        # barrier: as a constant expression (jnp.repeat's), XLA folds it at compile time,
        # seconds for a few hundred thousand rows.
        rows = jax.lax.optimization_barrier(jnp.arange(shape[0], dtype=jnp.int32))
        table = (rows[:, None] >= jnp.asarray(ends, jnp.int32)[None, :]).sum(-1)
        scale = jnp.asarray([math.sqrt(1.0 / n) for n in table_rows], jnp.float32)[table]
        return (jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0) * scale[:, None]).astype(dtype)

    return init


_GLOROT = nnx.initializers.xavier_uniform()
_ZEROS = nnx.initializers.zeros_init()


class Linear(nnx.Module):
    """``x @ kernel + bias``, Glorot-uniform kernel, zero bias. A plain matmul, not
    ``jaxpar.ops.linear.dense``: the dense part of a DLRM is data parallel."""

    def __init__(self, d_in: int, d_out: int, cfg: DLRMConfig, *, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(cfg.dtype)
        self.kernel = _param(rngs, cfg, (d_in, d_out), WEIGHT_AXES, _GLOROT)
        self.bias = _param(rngs, cfg, (d_out,), WEIGHT_AXES[1:], _ZEROS)

    def __call__(self, x):
        return x @ self.kernel[...].astype(self.dtype) + self.bias[...].astype(self.dtype)


class MLP(nnx.Module):
    """Linear layers with ReLU after each; after the last too when ``relu_last``
    (DLRM's bottom MLP ends in ReLU; the top one ends in the bare logit)."""

    def __init__(self, d_in: int, widths, cfg: DLRMConfig, *, relu_last: bool, rngs: nnx.Rngs):
        dims = (d_in, *widths)
        self.layers = nnx.List([Linear(a, b, cfg, rngs=rngs) for a, b in zip(dims[:-1], dims[1:])])
        self.relu_last = relu_last

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.relu_last or i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x


class CrossLayer(nnx.Module):
    """One DCNv2 cross layer: ``x0 * (W x + b) + x``; ``W = down @ up`` when low-rank."""

    def __init__(self, width: int, cfg: DLRMConfig, *, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(cfg.dtype)
        if cfg.dcn_rank:
            self.down = _param(rngs, cfg, (width, cfg.dcn_rank), WEIGHT_AXES, _GLOROT)
            self.up = _param(rngs, cfg, (cfg.dcn_rank, width), WEIGHT_AXES, _GLOROT)
        else:
            self.kernel = _param(rngs, cfg, (width, width), WEIGHT_AXES, _GLOROT)
        self.bias = _param(rngs, cfg, (width,), WEIGHT_AXES[1:], _ZEROS)
        self.low_rank = bool(cfg.dcn_rank)

    def __call__(self, x0, x):  # [B, X], [B, X] -> [B, X]
        if self.low_rank:
            wx = (x @ self.down[...].astype(self.dtype)) @ self.up[...].astype(self.dtype)
        else:
            wx = x @ self.kernel[...].astype(self.dtype)
        return x0 * (wx + self.bias[...].astype(self.dtype)) + x


class CrossNetwork(nnx.Module):
    def __init__(self, width: int, cfg: DLRMConfig, *, rngs: nnx.Rngs):
        self.layers = nnx.List([CrossLayer(width, cfg, rngs=rngs) for _ in range(cfg.dcn_layers)])

    def __call__(self, x0):
        x = x0
        for layer in self.layers:
            x = layer(x0, x)
        return x


def dot_interaction(vectors: jax.Array) -> jax.Array:
    """``[B, F + 1, D]`` -> ``[B, (F + 1) F / 2]``: the dot products of every pair i > j,
    row by row (``np.tril_indices(F + 1, -1)``'s order, the reference's)."""
    gram = jnp.einsum("BFD,BGD->BFG", vectors, vectors)  # [B, F+1, F+1]
    i, j = np.tril_indices(vectors.shape[1], -1)
    return gram[:, i, j]


class DLRM(nnx.Module):
    """Dense features ``[B, 13]`` and embeddings ``[B, F, D]`` -> click logits ``[B]``."""

    def __init__(self, cfg: DLRMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.table = _param(rngs, cfg, (cfg.total_rows, cfg.embed_dim), TABLE_AXES, _table_init(cfg.table_rows))
        self.bottom = MLP(cfg.dense_features, cfg.bottom, cfg, relu_last=True, rngs=rngs)
        width = cfg.interaction_width
        self.cross = CrossNetwork(width, cfg, rngs=rngs) if cfg.interaction == "dcn" else None
        self.top = MLP(width, cfg.top, cfg, relu_last=False, rngs=rngs)

    @property
    def offsets(self) -> np.ndarray:
        """int32 ``[F]``: the first row of each feature's table (static)."""
        return self.cfg.offsets

    def rows(self, ids):
        """Per-feature ids ``[B, F]`` -> rows of the concatenated table ``[B, F]``
        (numpy in, numpy out; jax in, jax out)."""
        return ids + self.offsets

    def lookup(self, ids: jax.Array) -> jax.Array:
        """Per-feature ids ``[B, F]`` -> their embeddings ``[B, F, D]`` from the model's
        own table (the uncached path; its gradient touches only these rows)."""
        return jnp.take(self.table[...], self.rows(ids), axis=0)

    def forward(self, dense: jax.Array, ids: jax.Array) -> jax.Array:
        """``self(dense, self.lookup(ids))``: logits ``[B]``."""
        return self(dense, self.lookup(ids))

    def __call__(self, dense: jax.Array, embeddings: jax.Array) -> jax.Array:
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        B = dense.shape[0]
        if dense.shape[1:] != (cfg.dense_features,) or embeddings.shape != (B, cfg.features, cfg.embed_dim):
            raise ValueError(f"DLRM: dense {dense.shape} and embeddings {embeddings.shape}, expected "
                             f"[B, {cfg.dense_features}] and [B, {cfg.features}, {cfg.embed_dim}]")
        with jax.named_scope("bottom"):
            bottom = self.bottom(dense.astype(dtype))  # [B, D]
        vectors = jnp.concatenate([bottom[:, None], embeddings.astype(dtype)], axis=1)  # [B, F+1, D]
        with jax.named_scope("interaction"):
            if cfg.interaction == "dot":
                x = jnp.concatenate([bottom, dot_interaction(vectors)], axis=1)  # [B, D + F(F+1)/2]
            else:
                x = self.cross(vectors.reshape(B, -1))  # [B, (F+1) D]
        with jax.named_scope("top"):
            return self.top(x)[:, 0].astype(jnp.float32)  # [B]


def bce_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean binary cross-entropy of click ``logits [B]`` against 0/1 ``labels [B]``,
    in float32 from the logits (stable: ``max(z, 0) - z y + log(1 + exp(-|z|))``)."""
    return optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), labels.astype(jnp.float32)).mean()
