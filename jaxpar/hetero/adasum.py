"""Adasum (Maleki et al., 2021; Horovod's ``op=hvd.Adasum``): adaptive summation of the
data-parallel replicas' gradients, in place of their mean.

Two gradients ``a`` and ``b`` combine as::

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal gradients add (each replica's step counts in full) and parallel ones
average (the same direction is not taken twice); a larger global batch stays closer to
the sequential steps it replaces. As in Horovod, each tensor (pytree leaf) combines on
its own. ``n`` replicas combine as a binary tree over adjacent pairs, level by level:
``((g0 + g1) + (g2 + g3)) + ...`` with ``+`` the pairwise rule, Horovod's recursive
halving over a power of two. With ``n`` not a power of two, a level's last, unpaired
gradient passes up unchanged (the combination then depends on the order of the
replicas; Horovod requires a power of two per hierarchy level).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def combine(a, b):
    """The pairwise Adasum of two gradient pytrees, leaf by leaf (a zero leaf's
    coefficient is 1: it adds nothing either way). Float32 dot products."""
    def leaf(x, y):
        x32, y32 = x.astype(jnp.float32), y.astype(jnp.float32)
        dot, xx, yy = jnp.vdot(x32, y32), jnp.vdot(x32, x32), jnp.vdot(y32, y32)
        cx = jnp.where(xx > 0, 1 - dot / (2 * jnp.where(xx > 0, xx, 1)), 1.0)
        cy = jnp.where(yy > 0, 1 - dot / (2 * jnp.where(yy > 0, yy, 1)), 1.0)
        return (cx * x32 + cy * y32).astype(x.dtype)

    return jax.tree.map(leaf, a, b)


def reduce_stacked(grads):
    """Adasum of ``n`` gradients stacked on each leaf's leading axis (``[n, ...]``): the
    tree of pairwise combinations over adjacent replicas, level by level."""
    level = [jax.tree.map(lambda x, i=i: x[i], grads) for i in range(jax.tree.leaves(grads)[0].shape[0])]
    while len(level) > 1:
        paired = [combine(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = paired + level[len(paired) * 2:]
    return level[0]
