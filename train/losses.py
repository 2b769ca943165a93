"""The next-token loss a train step minimises by default, and its pieces: the
cross-entropy in float32 (vocabulary-parallel where the vocabulary is split), the
token-weighted mean under a mask, and the last layer's loss (``head_loss``, fused into
one kernel under ``execution.loss`` "pallas")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.ops import kernel_ops
from jaxpar.placement.sharding import auto_axes

Batch = dict[str, jax.Array]


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy in float32.

    Args:
      logits: ``[B, T, V]``; targets: int ``[B, T]``; mask: ``[B, T]`` (1 = counted).
    """
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    # A masked sum rather than a gather: with the vocabulary split over `tensor`, each
    # device picks from its own slice and one [B, T] all-reduce combines them (Megatron's
    # vocab-parallel cross-entropy); the full [B, T, V] logits are never gathered.
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    picked = jnp.where(vocab == targets[..., None], logits, 0.0).sum(-1)
    return masked_mean(logz - picked, mask)


def masked_mean(losses: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The mean of per-token ``losses [B, T]`` over the tokens ``mask`` counts."""
    if mask is None:
        return losses.mean()
    mask = mask.astype(jnp.float32)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)


@auto_axes  # the model is written for Auto axes: on an Explicit mesh it runs with them Auto
def loss_and_stats(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss_fn(model, batch), stats)``: ``stats`` what the train step sums over the
    batch's rows beside the gradient (``jaxpar.train.gradients``): ``{"moe": [L, 3, E]}``,
    a MoE model's statistics (``jaxpar.models.moe``), ``{}`` for a dense model."""
    x, aux = model.features_and_aux(batch["inputs"], positions=batch.get("positions"),
                                    segment_ids=batch.get("segment_ids"))
    loss = head_loss(model, x, batch["targets"], batch.get("mask"))
    return (loss, {}) if aux is None else (loss + aux.loss, {"moe": aux.stats})


def loss_fn(model: nnx.Module, batch: Batch) -> jax.Array:
    """Loss of ``model`` on a batch with ``inputs``, ``targets`` (int ``[B, T]``) and
    optionally ``positions``, ``segment_ids`` and ``mask`` (all ``[B, T]``); a MoE model's
    adds its layers' balance losses (``jaxpar.models.moe``; evaluation's too)."""
    return loss_and_stats(model, batch)[0]


def head_loss(model: nnx.Module, x: jax.Array, targets: jax.Array,
              mask: jax.Array | None = None) -> jax.Array:
    """The mean next-token loss of the last layer's output ``x [B, T, D]``: final norm,
    vocabulary projection and cross-entropy. Under ``execution.loss`` "pallas" the projection
    and the cross-entropy run as one fused kernel (``jaxpar.ops.kernel_ops.token_losses``): the
    ``[B, T, V]`` logits never exist."""
    losses = kernel_ops.token_losses(model.final_norm(x), model.head_weight(), targets)
    if losses is None:
        return cross_entropy(model.logits(x), targets, mask)
    return masked_mean(losses, mask)
