"""Thresholded sparsification with error feedback (jaxpar.hetero.compression)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpar.hetero.compression import sparsify, threshold_of


def test_ratio_one_is_the_plain_gradient():
    rng = np.random.default_rng(0)
    t = sparsify(1.0)
    grads = {"w": jnp.asarray(rng.standard_normal((5, 4)), jnp.float32), "b": jnp.asarray(rng.standard_normal(3))}
    state = t.init(grads)
    for _ in range(3):
        kept, state = t.update(grads, state)
        jax.tree.map(np.testing.assert_array_equal, kept, grads)
        assert all(not np.asarray(r).any() for r in jax.tree.leaves(state.residual))


def test_keeps_the_largest_and_carries_the_rest():
    g = jnp.array([0.1, -3.0, 0.5, 2.0, -0.2, 0.05, 1.0, -0.7])
    t = sparsify(0.25)  # 2 of 8
    kept, state = t.update(g, t.init(g))
    np.testing.assert_array_equal(kept, [0, -3.0, 0, 2.0, 0, 0, 0, 0])
    np.testing.assert_array_equal(state.residual, g - kept)
    assert float(threshold_of(g, 0.25)) == 2.0
    # the residual comes back: the unsent entries doubled (1.0 + 1.0 = 2.0 ties the new
    # threshold, 2.0); at most k = 2 are sent, so the tie past them waits (the lower index goes)
    kept, state = t.update(g, state)
    np.testing.assert_array_equal(kept, [0, -3.0, 0, 2.0, 0, 0, 0, 0])
    np.testing.assert_allclose(state.residual, [0.2, 0, 1.0, 0, -0.4, 0.1, 2.0, -1.4], rtol=1e-6)


@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_error_feedback_converges_on_a_quadratic(ratio):
    """SGD on 0.5 |x - target|^2 with sparsified gradients reaches the target, as the
    uncompressed run does: every dropped entry is applied later. (The learning rate is
    small enough for an entry's delayed sum: sent about every 1 / ratio steps, at 0.2
    ratio 0.1 overshoots and circles the target at 3-10% of it.)"""
    rng = np.random.default_rng(1)
    target = jnp.asarray(rng.standard_normal(50), jnp.float32)
    optimizer = optax.chain(sparsify(ratio, threshold_every=5), optax.sgd(0.05))

    @jax.jit
    def step(x, state):
        updates, state = optimizer.update(x - target, state, x)
        return optax.apply_updates(x, updates), state

    x = jnp.zeros(50)
    state = optimizer.init(x)
    for _ in range(400):
        x, state = step(x, state)
    assert float(jnp.abs(x - target).max()) < 1e-4 * float(jnp.abs(target).max())


def test_bad_settings_are_one_line():
    for kwargs, message in [(dict(ratio=0.0), r"compression_ratio=0.0 must be in \(0, 1\]"),
                            (dict(ratio=1.5), r"compression_ratio=1.5"),
                            (dict(ratio=0.5, threshold_every=0), "threshold_every=0 must be at least 1")]:
        with pytest.raises(ValueError, match=message):
            sparsify(**kwargs)


def test_every_entry_is_sent_in_time():
    """A constant gradient for 200 steps at ratio 0.1: the sent updates add up to 200
    times it, but for what is still carried (bounded), so their mean is the gradient,
    small entries included. Without the carried residual the small entries would
    never be sent."""
    g = jnp.asarray(np.random.default_rng(2).standard_normal(40), jnp.float32)
    t = sparsify(0.1)
    state, sent = t.init(g), jnp.zeros(40)
    for _ in range(200):
        kept, state = t.update(g, state)
        sent = sent + kept
    np.testing.assert_allclose(sent + state.residual, 200 * g, rtol=1e-4)
    assert float(jnp.abs(sent / 200 - g).max()) < 0.05 * float(jnp.abs(g).max())
    assert bool((sent != 0).all())
