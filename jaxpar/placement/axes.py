"""Mesh-axis arithmetic for programs that run per device (Pallas kernels under
``shard_map``, the ring): which axes the rules in force split a logical axis over, how
many devices they span, and this device's index among them."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar.placement import rules as rules_lib
from jaxpar.placement.execution import rules_for


def local_axes(mesh, logical: str, size: int, exclude: str | None = None,
               rules: rules_lib.Rules | None = None) -> tuple[str, ...]:
    """The mesh axes of size > 1 that ``rules`` (default: the rules in force, which must
    be set with a mesh) split ``logical`` over (without ``exclude``), or () when ``size``
    does not divide over them."""
    if rules is None:
        rules = rules_for(mesh, f"a per-device kernel reading {logical!r}")
    axes = rules_lib.as_tuple(dict(rules_lib.for_mesh(mesh, rules)).get(logical))
    axes = tuple(a for a in axes if a != exclude and mesh.shape[a] > 1)
    return axes if size % axes_size(mesh, axes) == 0 else ()


def axes_size(mesh, axes) -> int:
    """How many devices the mesh ``axes`` span together."""
    return math.prod(mesh.shape[a] for a in axes)


def shard_index(mesh, axes):
    """This device's row-major index among the shards over ``axes`` (inside shard_map)."""
    index = 0
    for a in axes:
        index = index * mesh.shape[a] + jax.lax.axis_index(a)
    return index


def kv_heads_for(n_local, G, head_axes, mesh, k, v):
    """The kv heads this device's ``n_local`` query heads read, when the query heads are
    split over ``head_axes`` and k/v ``[B, L, K, H]`` are whole: a slice when the query
    heads map onto whole kv groups, otherwise one kv head per query head."""
    first = shard_index(mesh, head_axes) * n_local
    if n_local % G == 0 or G % n_local == 0:
        count = max(n_local // G, 1)
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, first // G, count, axis=2)  # noqa: E731
    else:
        index = (first + jnp.arange(n_local)) // G
        take = lambda x: jnp.take(x, index, axis=2)  # noqa: E731
    return take(k), take(v)
