"""Adasum's combination (jaxpar.hetero.adasum) against its formula."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.hetero import adasum


def formula(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    dot = a.ravel() @ b.ravel()
    return (1 - dot / (2 * (a.ravel() @ a.ravel()))) * a + (1 - dot / (2 * (b.ravel() @ b.ravel()))) * b


def test_pairs_follow_the_formula_leaf_by_leaf():
    rng = np.random.default_rng(0)
    a = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(5)}
    b = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(5)}
    out = adasum.combine(jax_tree(a), jax_tree(b))
    for name in a:
        np.testing.assert_allclose(out[name], formula(a[name], b[name]), rtol=1e-5)


def jax_tree(tree):
    return {k: jnp.asarray(v, jnp.float32) for k, v in tree.items()}


def test_orthogonal_add_and_parallel_average():
    a, b = jnp.array([3.0, 0.0, 0.0]), jnp.array([0.0, -2.0, 0.0])
    np.testing.assert_allclose(adasum.combine(a, b), a + b, rtol=1e-6)
    c = jnp.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(adasum.combine(c, c), c, rtol=1e-6)  # the mean of two equal gradients
    np.testing.assert_allclose(adasum.combine(c, 3 * c), 2 * c, rtol=1e-6)  # parallel: (1 - 3/2) c + (1 - 1/6) 3c
    np.testing.assert_allclose(adasum.combine(c, jnp.zeros(3)), c, rtol=1e-6)  # a zero gradient adds nothing


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_a_stack_reduces_as_a_tree_of_pairs(n):
    rng = np.random.default_rng(n)
    grads = rng.standard_normal((n, 6))
    want = [g for g in grads]
    while len(want) > 1:
        paired = [formula(want[i], want[i + 1]) for i in range(0, len(want) - 1, 2)]
        want = paired + want[len(paired) * 2:]
    np.testing.assert_allclose(adasum.reduce_stacked(jnp.asarray(grads, jnp.float32)), want[0], rtol=1e-4, atol=1e-6)
    # orthogonal replicas: the sum, whatever n
    eye = jnp.eye(8)[:n] * jnp.arange(1, n + 1)[:, None]
    np.testing.assert_allclose(adasum.reduce_stacked(eye), eye.sum(0), rtol=1e-6)
