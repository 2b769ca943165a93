"""Placing NNX models and activations on a mesh through logical-axis rules.

Everything here is a no-op without a mesh, so single-device code needs no setup.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import math
import os
import re
from collections.abc import Callable, Sequence

import jax
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.placement import rules as rules_lib
from jaxpar.placement.execution import rules_for, use_execution

# Metadata keys NNX has used for `nnx.with_partitioning` annotations across versions.
_ANNOTATION_KEYS = ("out_sharding", "sharding_names", "sharding")

_FLAX_DIR = os.path.dirname(os.path.dirname(nnx.__file__))


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a variable was annotated with, or None."""
    metadata = variable.get_metadata()
    for key in _ANNOTATION_KEYS:
        names = metadata.get(key)
        if names:
            return tuple(names)
    return None


def path_str(path) -> str:
    """A pytree path as ``layers/0/mlp/kernel``."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def spec_for(where: str, names, shape: tuple[int, ...], mesh, rules: rules_lib.Rules) -> PartitionSpec:
    """The ``PartitionSpec`` of the array at ``where`` (a parameter path, for errors),
    of ``shape``, annotated with logical ``names``, under ``rules`` (already restricted
    to ``mesh``).

    Raises:
      ValueError: naming ``where``: the annotation's length is not the array's rank, a
        name has no rule (``logical_to_spec``'s checks), or a dimension does not divide
        by its mesh axes.
    """
    if len(names) != len(shape):
        raise ValueError(f"parameter {where}: annotation {tuple(names)} does not match its shape {shape}")
    try:
        spec = rules_lib.logical_to_spec(names, rules)
    except ValueError as e:
        raise ValueError(f"parameter {where} {shape}: {e}") from None
    check_divides(where, shape, spec, mesh)
    return spec


def check_divides(where: str, shape: tuple[int, ...], spec: PartitionSpec, mesh) -> None:
    """Raises a ``ValueError`` naming ``where`` if a dimension of ``shape`` does not
    divide by the mesh axes ``spec`` puts it on."""
    for dim, axes in zip(shape, spec):
        ways = math.prod(mesh.shape[a] for a in rules_lib.as_tuple(axes))
        if dim % ways:
            raise ValueError(
                f"parameter {where} {shape}: dimension {dim} does not divide over "
                f"mesh axes {axes} of total size {ways}"
            )


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
        if names is None:
            if isinstance(variable, nnx.Param) and shape:
                raise ValueError(
                    f"parameter {path_str(path)} {shape} has no logical axis annotation; wrap its "
                    "initializer in nnx.with_partitioning(init, names) (None entries replicate)"
                )
            return variable.replace(NamedSharding(mesh, PartitionSpec()))
        return variable.replace(NamedSharding(mesh, spec_for(path_str(path), names, shape, mesh, rules)))

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
    modules' own constraints and NNX's eager sharding).

    Inside, the model's activation constraints resolve against this mesh; trace inside
    it (``jaxpar.jit`` keys its programs by the rules in force).

    An NNX model created inside is born sharded (NNX's eager sharding places each
    variable made with ``nnx.with_partitioning`` by these rules), strictly: a name
    without a rule, an annotation that does not match the array's rank, or a dimension
    that does not divide by its mesh axes raises jaxpar's error, naming the parameter,
    the name and the fix. Flax offers no hook where it resolves the names (it leaves a
    name without a rule as it is, and JAX then fails with "Resource axis: hidden ... is
    not found in mesh"), so this catches the ``ValueError`` raised while Flax shards a
    new variable (only those: raised inside ``flax.core.spmd.shard_value``), checks
    that variable's names as ``shard_model`` does and raises jaxpar's error instead.
    The parameter's path is read from its constructors' source lines (``self.dot1 =
    nnx.Linear(...)``; a segment written otherwise shows as ``<ClassName>``), with the
    line that created it. A mesh axis used as a name (``'tensor'``) is taken by Flax as
    that mesh axis without an error, so it is not caught here; ``shard_model`` and
    ``model_shardings`` reject it.
    """
    resolved = rules_lib.for_mesh(mesh, rules_lib.DEFAULT_RULES if rules is None else rules)
    with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(resolved), use_execution(rules=resolved):
        try:
            yield mesh
        except ValueError as error:
            strict = _eager_sharding_error(error, mesh, resolved)
            if strict is None:
                raise
            raise strict from None


def _eager_sharding_error(error: ValueError, mesh, rules) -> ValueError | None:
    """jaxpar's error for ``error`` if Flax raised it while eagerly sharding a new NNX
    variable by logical names and jaxpar's checks of those names fail; else None."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    codes = [frame.f_code for frame, _ in frames]
    if flax_spmd.shard_value.__code__ not in codes:
        return None
    at = codes.index(flax_spmd.shard_value.__code__)
    metadata = frames[at - 1][0].f_locals.get("metadata") if at else None  # Variable.__init__'s
    value = frames[at][0].f_locals.get("value")
    names = metadata.get("out_sharding") if isinstance(metadata, dict) else None
    if (not isinstance(names, (tuple, list)) or not all(n is None or isinstance(n, str) for n in names)
            or metadata.get("sharding_rules") or not hasattr(value, "shape")):
        return None  # not logical names under our rules: Flax's error stands
    try:
        spec_for(_creation_path(frames[: at - 1]), tuple(names), tuple(value.shape), mesh, rules)
    except ValueError as strict:
        return strict
    return None


_ASSIGNMENT = re.compile(r"\s*self\.(\w+)\s*(?::[^=]*)?=")


def _creation_path(frames) -> str:
    """``dot1/kernel [model.py:12]``: the attribute path of a variable being created,
    from the ``self.NAME = ...`` source lines of the NNX constructors on the stack
    (outermost first), and the innermost of those lines outside Flax."""
    segments, where = [], ""
    for frame, line in frames:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name != "__init__" or not isinstance(owner, nnx.Pytree):
            continue
        filename = frame.f_code.co_filename
        assigned = _ASSIGNMENT.match(linecache.getline(filename, line))
        segments.append(assigned[1] if assigned else f"<{type(owner).__name__}>")
        if not filename.startswith(_FLAX_DIR):
            where = f" [{os.path.basename(filename)}:{line}]"
    return "/".join(segments) + where
