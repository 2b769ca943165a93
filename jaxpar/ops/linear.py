"""The one entry point for projecting activations by a weight matrix.

Without a 2D tensor grid this is a plain matmul and XLA partitions it by the rules
(data, FSDP, Megatron 1D). On a mesh with a ``tensor_row x tensor_col`` grid (q >= 2)
it runs Optimus's SUMMA (``jaxpar.summa_matmul``): weights blocked ``[D over
tensor_row, X over tensor_col]`` by ``jaxpar.rules.TENSOR_2D``, activations with their
tokens over ``tensor_row`` (and the data-parallel axes) and features over
``tensor_col``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxpar.placement import rules as rules_lib
from jaxpar.placement.execution import rules_for
from jaxpar.parallel.summa import summa_matmul

ROW, COL = "tensor_row", "tensor_col"


def dense(x: jax.Array, w: jax.Array, names: Sequence[str]) -> jax.Array:
    """``x [..., K] @ w [K, N] -> [..., N]``; ``names`` are ``w``'s two logical axes.

    On a 2D grid the weight dimension the rules put on ``tensor_row`` decides the SUMMA
    form: ``[K on row, N on col]`` is ``a @ b``; ``[K on col, N on row]`` (an output or
    down projection, stored ``(heads|mlp, embed)``) is ``a @ (wᵀ)ᵀ`` on the transposed,
    row-major blocking, which costs no communication.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or ROW not in mesh.axis_names or mesh.shape[ROW] < 2:
        return jnp.einsum("...K,KN->...N", x, w)
    rules = rules_for(mesh, "jaxpar.ops.linear.dense")
    spec = rules_lib.logical_to_spec(tuple(names), rules)
    batch = rules_lib.logical_to_spec(("activation_batch",), rules)[0]
    batch_axes = tuple(a for a in rules_lib.as_tuple(batch) if a != ROW and mesh.shape[a] > 1)
    lead, (K, N) = x.shape[:-1], w.shape
    rows = x.reshape(-1, K)
    if not mesh.are_all_axes_explicit:
        # Pin the weight to its stored sharding (FSDP's shard of each block) where it is
        # used: otherwise XLA propagates SUMMA's (row, col) blocking back through the
        # layer scan and gathers every layer's weights over fsdp at once, before it.
        w = jax.lax.with_sharding_constraint(w, spec)
    if ROW in rules_lib.as_tuple(spec[0]):
        out = summa_matmul(rows, w, mesh=mesh, batch_axes=batch_axes)
    elif ROW in rules_lib.as_tuple(spec[1]):
        out = summa_matmul(rows, w.T, mesh=mesh, transpose_b=True, batch_axes=batch_axes)
    else:
        raise ValueError(f"weight {tuple(names)} has no dimension on {ROW} under the 2D rules")
    return out.reshape(*lead, N)
