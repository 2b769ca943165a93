"""Placing NNX models and activations on a mesh through logical-axis rules.

Everything here is a no-op without a mesh, so single-device code needs no setup.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence

import jax
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.placement import rules as rules_lib
from jaxpar.placement.execution import rules_for, use_execution

# Metadata keys NNX has used for `nnx.with_partitioning` annotations across versions.
_ANNOTATION_KEYS = ("out_sharding", "sharding_names", "sharding")


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a variable was annotated with, or None."""
    metadata = variable.get_metadata()
    for key in _ANNOTATION_KEYS:
        names = metadata.get(key)
        if names:
            return tuple(names)
    return None


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def model_shardings(model_or_state, mesh: jax.sharding.Mesh, rules: rules_lib.Rules | None = None):
    """``NamedSharding``s for every variable of an NNX model (or of its ``nnx.State``).

    Each annotated variable is placed by its logical axes through ``rules`` (default
    ``DEFAULT_RULES``, restricted to ``mesh``); unannotated non-parameter variables (RNG
    state, counters) are replicated.

    Returns:
      An ``nnx.State`` of the same structure whose variables hold ``NamedSharding``s
      (as ``nnx.get_named_sharding`` returns), usable as ``jit`` in/out shardings.

    Raises:
      ValueError: an annotation names an unknown logical axis, a parameter has no
        annotation, or a dimension does not divide by its mesh axes.
    """
    rules = rules_lib.for_mesh(mesh, rules_lib.DEFAULT_RULES if rules is None else rules)
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)

    def sharding_of(path, variable):
        names = logical_axes(variable)
        shape = getattr(variable.get_value(), "shape", ())
        where = _path_str(path)
        if names is None:
            if isinstance(variable, nnx.Param) and shape:
                raise ValueError(
                    f"parameter {where} {shape} has no logical axis annotation; wrap its "
                    "initializer in nnx.with_partitioning(init, names) (None entries replicate)"
                )
            return variable.replace(NamedSharding(mesh, PartitionSpec()))
        if len(names) != len(shape):
            raise ValueError(f"parameter {where}: annotation {names} does not match its shape {shape}")
        try:
            spec = rules_lib.logical_to_spec(names, rules)
        except ValueError as e:
            raise ValueError(f"parameter {where} {shape}: {e}") from None
        for dim, axes in zip(shape, spec):
            ways = math.prod(mesh.shape[a] for a in rules_lib.as_tuple(axes))
            if dim % ways:
                raise ValueError(
                    f"parameter {where} {shape}: dimension {dim} does not divide over "
                    f"mesh axes {axes} of total size {ways}"
                )
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree.map_with_path(
        sharding_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def _place(x, sharding):
    if not isinstance(x, jax.core.Tracer):
        return jax.device_put(x, sharding)
    if sharding.mesh.explicit_axes:  # a sharding of Explicit axes is the array's type
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh, rules: rules_lib.Rules | None = None):
    """Places an NNX model's variables on ``mesh`` by their logical annotations, in place.

    Outside ``jit`` the arrays are moved with ``jax.device_put``; inside (``nnx.jit`` of
    a function that builds the model) they get sharding constraints, so a large model is
    created already sharded and never whole on one device::

        @nnx.jit
        def create():
            return jaxpar.shard_model(Transformer(config, rngs=nnx.Rngs(0)), mesh)

    On a mesh with Explicit axes the placement is the arrays' type (``reshard``), and
    JAX traces it only in a mesh context: call ``create()`` under ``jax.set_mesh(mesh)``.

    Data parallelism and FSDP/ZeRO-3 need nothing else: the rules decide.

    Returns:
      ``model``, for chaining.
    """
    shardings = model_shardings(model, mesh, rules)
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(_place, state, shardings))
    return model


def like_params(tree, params, param_shardings, default):
    """Shardings for a tree (e.g. an optax state) that holds copies of ``params``' structure.

    Every subtree with the same structure as ``params`` (Adam's moments, say) takes
    ``param_shardings``; every other leaf (step counters) takes ``default``. This is how
    optimizer state follows the parameters' FSDP sharding (ZeRO-3).
    """
    structure = jax.tree.structure(params)

    def matches(node):
        return jax.tree.structure(node) == structure

    return jax.tree.map(
        lambda node: param_shardings if matches(node) else default, tree, is_leaf=matches
    )


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains an activation's sharding by its logical axis names.

    Uses the mesh and rules set by ``jaxpar.use_mesh`` (or ``jax.set_mesh`` with
    ``flax.linen.logical_axis_rules``); a mesh without rules is an error. Without a
    mesh, returns ``x`` unchanged. On a mesh whose axes are all Explicit the sharding is
    part of ``x``'s type and a constraint cannot change it: ``x`` is resharded
    (``jax.sharding.reshard``) instead.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = rules_lib.logical_to_spec(names, rules_for(mesh, "jaxpar.constrain"))
    if mesh.are_all_axes_explicit:
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def auto_axes(fn: Callable | None = None, *, out_sharding=PartitionSpec()) -> Callable:
    """``fn``, run with the context mesh's Explicit axes made Auto, for code written for
    Auto axes (jaxpar's models): its ``constrain`` calls stay constraints and XLA
    propagates shardings to everything between them, as on an Auto mesh.

    On an Explicit mesh the arguments enter with their Explicit shardings and the
    results leave with ``out_sharding`` (``jax.sharding.auto_axes``; a prefix of the
    results' tree): by default every result replicated, which suits scalars such as
    losses (``jax.grad`` through it gives gradients with the parameters' Explicit
    shardings). Without a mesh, or on one with no Explicit axis, ``fn`` runs as it is.
    Keyword arguments pass through untouched (bind non-array arguments there).
    """
    if fn is None:
        return functools.partial(auto_axes, out_sharding=out_sharding)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or not mesh.explicit_axes:
            return fn(*args, **kwargs)
        auto = jax.sharding.auto_axes(fn, axes=mesh.explicit_axes, out_sharding=out_sharding)
        return auto(*args, **kwargs)

    return run


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh, rules: rules_lib.Rules | None = None):
    """Sets ``mesh`` (``jax.set_mesh``) and its rules (``rules=None``: ``DEFAULT_RULES``)
    as the ``Execution``'s rules and as ``flax.linen.logical_axis_rules`` (for Linen
    modules' own constraints).

    Inside, the model's activation constraints resolve against this mesh; trace inside
    it (``jaxpar.jit`` keys its programs by the rules in force).
    """
    resolved = rules_lib.for_mesh(mesh, rules_lib.DEFAULT_RULES if rules is None else rules)
    with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(resolved), use_execution(rules=resolved):
        yield mesh
