"""Placing a Linen model's variables by jaxpar's rules, as strictly as NNX models are."""

from __future__ import annotations

import flax.linen as nn
import jax
from flax.core import meta
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.placement import rules as rules_lib
from jaxpar.placement.sharding import check_divides, path_str, spec_for


def is_box(x) -> bool:
    """Whether ``x`` is a Flax metadata box (``nn.LogicallyPartitioned``, ``nn.Partitioned``)."""
    return isinstance(x, meta.AxisMetadata)


def linen_shardings(variables, mesh: jax.sharding.Mesh, rules: rules_lib.Rules | None = None):
    """``NamedSharding``s for a Linen model's variables, to create them sharded::

        abstract = jax.eval_shape(model.init, key, x)
        shardings = jaxpar.linen_shardings(abstract, mesh)
        with jaxpar.use_mesh(mesh):
            variables = jax.jit(model.init, out_shardings=shardings)(key, x)

    ``variables``: what ``model.init`` returns (collections at the top, ``"params"``
    among them), concrete or abstract, boxed as ``nn.with_logical_partitioning`` boxes
    them. An ``nn.LogicallyPartitioned`` box is placed by its logical names through
    ``rules`` (default ``DEFAULT_RULES``; the box's own ``rules`` if it has some),
    restricted to ``mesh``, checked as ``jaxpar.model_shardings`` checks NNX models:
    unlike ``nn.logical_to_mesh_sharding``, a name without a rule is an error, not a
    replicated dimension. An ``nn.Partitioned`` box (``nn.with_partitioning``) names
    mesh axes, which ``mesh`` must have. A parameter (under ``"params"``) with a shape
    and no box is an error, as in ``model_shardings``; unboxed variables of other
    collections (``batch_stats``, ``cache``) and scalars are replicated.

    Returns:
      ``variables``' tree with a ``NamedSharding`` in place of every box and every
      unboxed leaf: a prefix of ``model.init``'s output, as ``jit``'s ``out_shardings``
      takes it.

    Raises:
      ValueError: naming the parameter's path, for the cases above, or a dimension that
        does not divide by its mesh axes.
    """
    rules = rules_lib.for_mesh(mesh, rules_lib.DEFAULT_RULES if rules is None else rules)

    def sharding_of(path, leaf):
        return NamedSharding(mesh, _spec(path, leaf, mesh, rules))

    return jax.tree.map_with_path(sharding_of, variables, is_leaf=is_box)


def _spec(path, leaf, mesh, rules) -> PartitionSpec:
    """The ``PartitionSpec`` of one leaf (box or array) of Linen variables at ``path``."""
    where = path_str(path)
    if isinstance(leaf, meta.Partitioned):
        shape = tuple(leaf.value.shape)
        if len(leaf.names) > len(shape):
            raise ValueError(f"parameter {where}: annotation {tuple(leaf.names)} has more names than "
                             f"its shape {shape} has dimensions")
        # Linen's DenseGeneral keeps the names of the flat kernel it initialises (lm1b's
        # attention: ('embed', 'kv') on [D, N, H]): like a PartitionSpec, an annotation
        # shorter than the rank leaves the trailing dimensions whole.
        names = tuple(leaf.names) + (None,) * (len(shape) - len(leaf.names))
    if isinstance(leaf, nn.LogicallyPartitioned):
        box_rules = rules if leaf.rules is None else rules_lib.for_mesh(mesh, leaf.rules)
        return spec_for(where, names, shape, mesh, box_rules)
    if isinstance(leaf, meta.Partitioned):
        for name in (a for axes in names for a in rules_lib.as_tuple(axes)):
            if name not in mesh.axis_names:
                raise ValueError(
                    f"parameter {where}: nn.with_partitioning names mesh axis {name!r}, which the "
                    f"mesh {tuple(mesh.axis_names)} lacks (logical names go in "
                    "nn.with_logical_partitioning)")
        spec = PartitionSpec(*names)
        check_divides(where, shape, spec, mesh)
        return spec
    shape = getattr(leaf, "shape", ())
    if shape and path and getattr(path[0], "key", None) == "params":
        raise ValueError(
            f"parameter {where} {tuple(shape)} has no logical axis annotation; wrap its "
            "initializer in nn.with_logical_partitioning(init, names) (None entries replicate)")
    return PartitionSpec()
