"""The next-token distribution every decoding method samples from, and one draw of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def probabilities(logits: jax.Array, temperature, top_p) -> jax.Array:
    """The sampling distribution ``[..., V]`` (float32) of ``logits [..., V]``:
    ``softmax(logits / temperature)`` restricted to the nucleus (the smallest set of most
    likely tokens whose probability reaches ``top_p``) and renormalised. Speculative
    sampling is lossless with respect to exactly this distribution of the target."""
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    # Keep a token if the probability mass before it is still short of top_p.
    keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    kept = jnp.where(keep, jax.nn.softmax(scaled, axis=-1), 0.0)
    return kept / kept.sum(-1, keepdims=True)


def draw(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per row of ``probs [..., V]`` (rows need not be normalised), int32."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, temperature, top_p) -> jax.Array:
    """Next tokens ``[B]`` from logits ``[B, V]``: greedy when ``temperature == 0``,
    else a draw from ``probabilities(logits, temperature, top_p)``."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = draw(key, probabilities(logits, temperature, top_p))
    return jnp.where(jnp.asarray(temperature) > 0, sampled, greedy)
