"""Where train state lives between steps, and the optimizer update of host-resident state.

Placement (``OffloadOptions``, ``R`` = the resident layer count, ``L`` the stacked layers):

  parameters   ``params=device``: all in device memory. ``params=host``: the embedding,
               positions, final norm and head in ``pinned_host`` memory (chunks of their
               own, fetched where the model uses them), and of each stacked leaf
               ``[L, ...]`` the model's first ``R`` layers in device memory and the last
               ``L - R`` in host memory. With ``0 < R < L`` such a leaf is stored as a
               ``Split(resident [R, ...], offloaded [L - R, ...])``: an array lives in one
               memory. The first layers stay because the forward pass starts with them,
               hiding the fetch of the first host layer behind their compute.
  optimizer    ``optimizer=host``: every leaf of the optimizer state (Adam's moments,
               its step count) in host memory; ``device``: in device memory. It mirrors
               the parameters' structure, ``Split``s included.

``split_layers`` / ``join_layers`` convert between that storage form and the model's
(one ``[L, ...]`` array per stacked leaf, which checkpoints hold, in host memory where
any of it was); ``storage_shardings`` gives the shardings, memory kinds included, that
the train step's ``jit`` takes and returns its state with.

The update of host-resident optimizer state runs on the host (ZeRO-Offload's choice),
``update`` below: the whole ``optax`` update, ``compute_on2("device_host")``, reads the
gradients (sent to the host: those of host-resident parameters are there already, see
``jaxpar.offload.fetch``), the moments and the parameters where they live and writes the
new ones there; the moments never cross PCIe, the gradients cross once (device to host)
and device-resident parameters cross twice (to the host for the update and back). The
alternative, streaming the moments through the device layer by layer (ZeRO-Infinity's),
moves 2x the moments' bytes each way every step and must apply the transformation one
layer at a time, which is wrong for any ``optax`` chain that is not elementwise: a
global-norm clip, or the step count, would be taken per layer. Running the update on the
host keeps any ``optax`` transformation exact. Its known costs: XLA:CPU runs the update
on the host's cores, reported 2-3x slower than expected (axlearn PR#867: keep the host
update fused and in float32, which the whole-tree update here is), and ``lax.cond``
inside ``compute_on`` fails to compile (jax#23887), so a transformation that branches
(``optax.MultiSteps``, ``optax.apply_if_finite``) is refused with one line here rather
than by XLA. On CPU ``compute_on`` runs the same arithmetic where it always runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jax_core

from jaxpar.offload.fetch import HOST, Split, is_split, on_host, to_device, to_host
from jaxpar.placement.execution import OffloadOptions

DEVICE_KIND = "device"
HOST_KIND = "pinned_host"


def is_layers(path) -> bool:
    """Whether a pytree path is under the model's stacked ``layers``."""
    return any(getattr(k, "key", None) == "layers" for k in path)


def resident_count(options: OffloadOptions, layers: int) -> int:
    """How many of the ``layers`` stacked layers keep their parameters on the device."""
    if options.params == "device":
        return layers
    if options.resident_layers is None:
        return 0
    if options.resident_layers > layers:
        raise ValueError(f"offload.resident_layers={options.resident_layers} is above the model's "
                         f"{layers} layers")
    return options.resident_layers


def storage_shardings(shardings, *, resident: int, layers: int, resident_kind: str,
                      offloaded_kind: str, rest_kind: str):
    """``shardings`` (a model-order tree of ``Sharding``s, of parameters or of state that
    copies them) in storage form: a stacked leaf's resident layers take ``resident_kind``,
    its offloaded ones ``offloaded_kind`` (a ``Split`` of the two when ``0 < resident <
    layers``); every other leaf takes ``rest_kind``."""
    def place(path, s):
        if not is_layers(path):
            return s.with_memory_kind(rest_kind)
        if resident == layers:
            return s.with_memory_kind(resident_kind)
        if resident == 0:
            return s.with_memory_kind(offloaded_kind)
        return Split(s.with_memory_kind(resident_kind), s.with_memory_kind(offloaded_kind))

    return jax.tree.map_with_path(place, shardings)


def split_layers(tree, resident: int, layers: int):
    """A model-order tree (traced arrays or ``ShapeDtypeStruct``s under ``jax.eval_shape``)
    in storage form: each stacked leaf ``[L, ...]`` becomes ``Split(x[:R], x[R:])`` when
    ``0 < R < L``. Host-resident leaves are cut on the host (``compute_on``)."""
    if not 0 < resident < layers:
        return tree

    def split(path, x):
        if not is_layers(path):
            return x
        cut = lambda x: (x[:resident], x[resident:])  # noqa: E731
        if on_host(x):
            cut = run_on_host(cut)
        return Split(*cut(x))

    return jax.tree.map_with_path(split, tree)


def join_layers(tree):
    """The inverse of ``split_layers``: each ``Split`` joined into one ``[L, ...]`` array in
    host memory (concatenated there, so the host part never visits the device)."""
    def join(s):
        if not is_split(s):
            return s
        return run_on_host(lambda a, b: jnp.concatenate([a, b]))(to_host(s.resident), to_host(s.offloaded))

    return jax.tree.map(join, tree, is_leaf=is_split)


def run_on_host(fn):
    """``fn`` run as host computation, its results left in host memory."""
    from jax.experimental.compute_on import compute_on2

    return compute_on2(fn, compute_type="device_host", out_memory_spaces=HOST)


def accumulate(total, part, share):
    """``total + share * part``, leaf by leaf, each sum made where its leaves live: the
    gradient of a host-resident parameter arrives in host memory (``jaxpar.offload.fetch``)
    and is added there, so gradient accumulation never holds the host layers' gradients
    on the device (the accumulator of a host layer lives on the host, as its moments do)."""
    on_the_host = to_host(share) if any(map(on_host, jax.tree.leaves(part))) else None  # once: 4 bytes

    def add(acc, x):
        if on_host(x):
            return run_on_host(lambda acc, x, share: acc + share * x)(acc, x, on_the_host)
        return acc + share * x

    return jax.tree.map(add, total, part)


def scaled(tree, factor):
    """``factor * tree``, leaf by leaf, each product made where its leaf lives (a host
    leaf's on the host, as ``accumulate`` adds)."""
    return accumulate(zeros_like(tree), tree, factor)


def zeros_like(tree):
    """Zeros shaped as ``tree``'s leaves (arrays or tracers), each in its leaf's memory:
    a host leaf's made on the host, never passing through the device."""
    def zeros(x):
        if on_host(x):
            return run_on_host(creating_on_host(jnp.zeros_like))(x)
        return jnp.zeros(x.shape, x.dtype)

    return jax.tree.map(zeros, tree)


def squared_norm(tree) -> jax.Array:
    """The squared L2 norm of ``tree`` on the device: each host leaf's sum of squares
    made on the host (4 bytes cross), each device leaf's on the device."""
    def leaf(x):
        if on_host(x):
            return to_device(run_on_host(lambda x: jnp.sum(jnp.square(x)))(x))
        return jnp.sum(jnp.square(x))

    return sum((leaf(x) for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))


def update(tx: optax.GradientTransformation, options: OffloadOptions, grads, opt_state, params, extra=None):
    """One optimizer update of the stored state: ``(new_params, new_opt_state, grad_norm)``,
    each leaf in the memory its input was in. ``grads`` mirror ``params``; those of
    host-resident parameters are in host memory. ``extra``: scalars a transformation
    reads as extra arguments (``optax.with_extra_args_support``: the noise scale's norms,
    which AdaScale reads)."""
    kinds = jax.tree.map(on_host, params)
    extra = extra or {}
    tx = optax.with_extra_args_support(tx)
    if options.optimizer == "host":
        _refuse_branches(tx, grads, opt_state, params, extra)
        grads, params = jax.tree.map(to_host, grads), jax.tree.map(to_host, params)

        def host_update(grads, opt_state, params, extra):
            updates, opt_state = creating_on_host(lambda *a: tx.update(*a[:3], **a[3]))(grads, opt_state, params,
                                                                                          extra)
            # optax.tree.norm adds a zero imaginary part made in device memory: not here
            norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
            return optax.apply_updates(params, updates), opt_state, norm

        params, opt_state, norm = run_on_host(host_update)(grads, opt_state, params, extra)
        norm = to_device(norm)
    else:
        grads, params = jax.tree.map(to_device, grads), jax.tree.map(to_device, params)
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        params = optax.apply_updates(params, updates)
        norm = optax.tree.norm(grads)
    params = jax.tree.map(lambda x, host: to_host(x) if host else to_device(x), params, kinds)
    return params, opt_state, norm


def creating_on_host(fn):
    """``fn`` for host computation on host-resident operands: traced as written, then
    run with every array it creates from scalars (``jnp.zeros``, a ``broadcast_in_dim``)
    placed in host memory. JAX types such an array in device memory wherever it is made,
    and inside host computation an op refuses operands of two memory spaces, as it would
    where ``optax.clip_by_global_norm`` (``optax.tree.norm``) adds a zero imaginary part to
    each host-resident gradient."""
    def wrapped(*args):
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
        closed, out_shapes = jax.make_jaxpr(fn, return_shape=True)(*shapes)
        outs = _eval_creating_on_host(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shapes), outs)

    return wrapped


def _eval_creating_on_host(jaxpr, consts, *args) -> list:
    """``jax.core.eval_jaxpr`` with each non-scalar result in device memory moved to
    the host: only an array the jaxpr creates is in device memory when its operands are
    all on the host (a scalar, of either memory, combines with anything)."""
    env = {}
    read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]  # noqa: E731
    env.update(zip(jaxpr.constvars, [to_host(c) if jnp.ndim(c) else c for c in consts]))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, [to_host(x) if jnp.ndim(x) else x for x in outs]))
    return [read(v) for v in jaxpr.outvars]


def _refuse_branches(tx, grads, opt_state, params, extra) -> None:
    """One line when ``tx.update`` branches (``lax.cond``): XLA cannot compile a branch
    inside host computation (jax#23887)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (grads, opt_state, params, extra))
    if _has_cond(jax.make_jaxpr(lambda g, s, p, e: tx.update(g, s, p, **e))(*shapes).jaxpr):
        raise ValueError("offload.optimizer=host runs the optimizer update on the host, where a lax.cond "
                         "does not compile (jax#23887), and this optax transformation branches (as "
                         "optax.MultiSteps and optax.apply_if_finite do): use offload.optimizer=device")


def _has_cond(jaxpr) -> bool:
    return (any(eqn.primitive.name == "cond" for eqn in jaxpr.eqns)
            or any(_has_cond(sub) for sub in jax_core.subjaxprs(jaxpr)))
