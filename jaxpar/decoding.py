"""Autoregressive decoding with a preallocated KV cache: a jitted prefill over the
prompt, then one jitted step per new token.

The speculative-decoding work builds on this: draft models, tree verification and
KV-cache reuse plug into the same cache.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.models.transformer import KVCache, Transformer, init_cache


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """Next tokens ``[B]`` from logits ``[B, V]``: greedy when ``temperature == 0``,
    else nucleus sampling (the smallest set of tokens whose probability reaches
    ``top_p``) at ``temperature``."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token if the probability mass before it is still short of top_p.
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@nnx.jit
def _prefill(model: Transformer, tokens: jax.Array, cache: KVCache):
    logits, cache = model(tokens, cache=cache)
    return logits[:, -1], cache


@nnx.jit
def _step(model: Transformer, token: jax.Array, cache: KVCache, key, temperature, top_p):
    logits, cache = model(token[:, None], cache=cache)
    return sample(logits[:, -1], key, temperature, top_p), cache


def generate(
    model: Transformer,
    prompt: np.ndarray,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> Iterator[np.ndarray]:
    """Yields the next token of every sequence, ``[B]`` int32, up to ``max_new_tokens``.

    Args:
      prompt: int ``[B, T]`` prompt tokens (all sequences the same length).
      eos_id: stop once every sequence has produced it.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    B, T = prompt.shape
    cache = init_cache(model.cfg, B, T + max_new_tokens)
    temperature, top_p = jnp.float32(temperature), jnp.float32(top_p)
    key = jax.random.key(seed)
    logits, cache = _prefill(model, prompt, cache)
    key, sub = jax.random.split(key)
    token = sample(logits, sub, temperature, top_p)
    done = np.zeros(B, bool)
    for i in range(max_new_tokens):
        out = np.asarray(token)
        yield out
        if eos_id is not None:
            done |= out == eos_id
            if done.all():
                return
        if i + 1 < max_new_tokens:
            key, sub = jax.random.split(key)
            token, cache = _step(model, token, cache, sub, temperature, top_p)


def greedy_without_cache(model: Transformer, prompt: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """Plain greedy decoding that recomputes the whole sequence each step: the reference
    the cached path is tested against. Returns ``[B, max_new_tokens]``."""
    tokens = jnp.asarray(prompt, jnp.int32)
    forward = nnx.jit(lambda m, t: m(t)[:, -1])
    for _ in range(max_new_tokens):
        tokens = jnp.concatenate([tokens, jnp.argmax(forward(model, tokens), -1)[:, None]], axis=1)
    return np.asarray(tokens[:, prompt.shape[1]:])
