"""The next-token distribution every decoding method samples from, one draw of it, the
speculative-sampling rule, and ``Rows``: how each row of a speculative round samples."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def probabilities(logits: jax.Array, temperature, top_p) -> jax.Array:
    """The sampling distribution ``[..., V]`` (float32) of ``logits [..., V]``:
    ``softmax(logits / temperature)`` restricted to the nucleus (the smallest set of most
    likely tokens whose probability reaches ``top_p``; tokens tied with its least likely
    one are kept too) and renormalised. Speculative sampling is lossless with respect to
    exactly this distribution of the target."""
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    probs = jax.nn.softmax(scaled, axis=-1)
    kept = jnp.where(probs >= nucleus_floor(probs, top_p), probs, 0.0)
    return kept / kept.sum(-1, keepdims=True)


def nucleus_floor(probs: jax.Array, top_p) -> jax.Array:
    """The least probability of a token in the nucleus of ``probs [..., V]``, ``[..., 1]``:
    the least ``t`` with ``mass(t) = sum(probs[probs > t]) < top_p`` (a token is in the
    nucleus when the tokens more likely than it still fall short of ``top_p``).

    A bisection over the bits of non-negative float32s, whose integer order is their
    order: 31 masked sums of the vocabulary, exact, where sorting it costs XLA:CPU about
    80 ms a row of 49,152 tokens (a sampled serving step of 8 rows spent most of its
    time there) and compiles a comparator per sort."""
    as_float = lambda b: jax.lax.bitcast_convert_type(b, jnp.float32)  # noqa: E731
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (*probs.shape[:-1], 1))
    lo = jnp.zeros((*probs.shape[:-1], 1), jnp.int32)  # t = 0, or mass(lo) >= top_p
    hi = jax.lax.bitcast_convert_type(probs.max(-1, keepdims=True), jnp.int32)  # mass(hi) = 0 < top_p

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        short = jnp.where(probs > as_float(mid), probs, 0.0).sum(-1, keepdims=True) < top_p
        return jnp.where(short, lo, mid), jnp.where(short, mid, hi)

    return as_float(jax.lax.fori_loop(0, 31, halve, (lo, hi))[1])


def draw(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per row of ``probs [..., V]`` (rows need not be normalised), int32."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, temperature, top_p) -> jax.Array:
    """Next tokens ``[B]`` from logits ``[B, V]``: greedy when ``temperature == 0``,
    else a draw from ``probabilities(logits, temperature, top_p)``."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = draw(key, probabilities(logits, temperature, top_p))
    return jnp.where(jnp.asarray(temperature) > 0, sampled, greedy)


def accept_sampled(drafts: jax.Array, draft_probs: jax.Array, target_probs: jax.Array, key):
    """The speculative-sampling rule: ``(accepted [B], next [B])``.

    drafts ``[B, gamma]`` drawn from ``draft_probs [B, gamma, V]``; ``target_probs
    [B, gamma + 1, V]`` after ``[last, d_1..d_gamma]``. ``d_i`` is kept with probability
    ``min(1, p(d_i) / q(d_i))``; the first rejection draws from ``norm(max(0, p - q))``
    at that depth, and when all are kept the bonus token is drawn from ``p`` after
    ``d_gamma``.
    """
    B, gamma = drafts.shape
    key_accept, key_next = jax.random.split(key)
    p = jnp.take_along_axis(target_probs[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    keep = jax.random.uniform(key_accept, (B, gamma)) * q < p
    accepted = jnp.cumprod(keep, axis=1).sum(axis=1).astype(jnp.int32)
    q_padded = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    at = accepted[:, None, None]
    p_at = jnp.take_along_axis(target_probs, at, axis=1)[:, 0]
    residual = jnp.maximum(p_at - jnp.take_along_axis(q_padded, at, axis=1)[:, 0], 0.0)
    # p == q leaves no residual mass, but then a rejection has probability 0 too.
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_at)
    return accepted, draw(key_next, residual)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """How each of a round's ``B`` rows samples: ``temperature``, ``top_p`` float32
    ``[B]`` and ``keys`` ``[B]`` (a PRNG key per row; draft step ``i`` draws with
    ``fold_in(key, i)``, the acceptance of ``gamma`` proposals with ``fold_in(key,
    gamma)``). ``greedy`` (static): every row is greedy, known when compiling, so no
    sampling code is traced (the dense decoder at temperature 0); otherwise greedy rows
    take the argmax and exact match, sampling rows draw, in one program (the serving
    engine's batch)."""

    temperature: jax.Array
    top_p: jax.Array
    keys: jax.Array
    greedy: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def uniform(cls, batch: int, temperature: float, top_p: float, key: jax.Array) -> "Rows":
        """``batch`` rows with one ``temperature`` and ``top_p``, their keys split from ``key``."""
        full = lambda x: jnp.full((batch,), x, jnp.float32)  # noqa: E731
        return cls(full(temperature), full(top_p), jax.random.split(key, batch), greedy=temperature == 0)

    def key_at(self, i) -> jax.Array:
        return jax.vmap(lambda k: jax.random.fold_in(k, i))(self.keys)

    def sampling(self) -> jax.Array:
        """bool ``[B]``: the rows that sample."""
        return jnp.zeros(self.temperature.shape, bool) if self.greedy else self.temperature > 0

    def choose(self, logits: jax.Array, i) -> jax.Array:
        """A token per row of ``logits [B, V]``, draw ``i``. When no row samples, the
        nucleus (``nucleus_floor``) is not computed."""
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if self.greedy:
            return greedy
        sampled = lambda: jax.vmap(lambda l, k, t, p: sample(l[None], k, t, p)[0])(  # noqa: E731
            logits, self.key_at(i), self.temperature, self.top_p)
        return jax.lax.cond(jnp.any(self.temperature > 0), sampled, lambda: greedy)

    def accept(self, drafts: jax.Array, draft_logits: jax.Array, target_logits: jax.Array, greedy):
        """``(accepted [B], next [B])``: ``greedy`` (exact match's, or a tree walk's)
        where a row is greedy, the speculative-sampling rule (``accept_sampled``) over
        the chain ``drafts [B, gamma]``, drawn from ``draft_logits [B, gamma, V]``, and
        the target's ``target_logits [B, gamma + 1, V]`` where it samples."""
        if self.greedy:
            return greedy
        gamma = drafts.shape[1]

        def sampled():
            t, p = self.temperature[:, None, None], self.top_p[:, None, None]
            draft_probs, target_probs = probabilities(draft_logits, t, p), probabilities(target_logits, t, p)
            one = lambda d, q, p, k: jax.tree.map(lambda x: x[0], accept_sampled(d[None], q[None], p[None], k))  # noqa: E731
            drawn = jax.vmap(one)(drafts, draft_probs, target_probs, self.key_at(gamma))
            return tuple(jnp.where(self.temperature > 0, s, g) for s, g in zip(drawn, greedy))

        return jax.lax.cond(jnp.any(self.temperature > 0), sampled, lambda: greedy)
