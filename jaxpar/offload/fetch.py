"""Moving host-resident parameters to the device inside a jitted step.

An array whose sharding has memory kind ``pinned_host`` enters a jitted function with
``jax.typeof(x).memory_space == jax.memory.Space.Host``; nothing may compute on it there
(on a GPU a dot of a host operand does not compile), so every use goes through
``to_device``, a ``jax.device_put(x, jax.memory.Space.Device)``: on GPU and TPU it lowers
to an ``annotate_device_placement`` custom call that XLA's host offloader turns into an
asynchronous host-to-device copy; on CPU it lowers to nothing (``jax/_src/dispatch.py``
registers that lowering for tpu and gpu only), so CPU runs check the arithmetic and the
placement between steps, and a CUDA lowering checks that the copies exist.

Stacked layers (leaves ``[L, ...]``) are the chunks: ``scan_layers`` runs them with
``jax.lax.scan`` and, when they live on the host, fetches layer ``i + prefetch`` before
layer ``i`` computes. Its gradient is written by hand (``jax.custom_vjp``): the forward
saves only each layer's input ``x [L, B, T, D]`` (what remat "full" saves), and the
backward fetches each layer again, ``prefetch`` layers ahead in reverse order, recomputes
its forward and sends its parameter gradient straight back to the host, one layer at a
time, into a ``[L, ...]`` gradient that lives in host memory (the transpose of
``device_put`` gives the same placement: a cotangent goes back to the memory its primal
came from). Left to JAX's own scan autodiff, the fetched copies carried through the scan
for the prefetch would be saved for the backward, all ``L`` layers of them on the
device, which is what offloading is there to avoid. Host-resident layers therefore run
as if ``model.remat`` were ``full`` (one more forward per layer in the backward); the
layer's own remat policy still decides what that recomputation keeps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.placement.execution import current

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Split:
    """A stacked parameter (or a copy of one, such as its Adam moment) kept in two parts:
    ``resident [R, ...]`` in device memory, the model's first ``R`` layers, and
    ``offloaded [L - R, ...]`` in host memory, the rest (``jaxpar.offload.state``)."""

    resident: object
    offloaded: object


def is_split(x) -> bool:
    return isinstance(x, Split)


def on_host(x) -> bool:
    """Whether ``x`` (an array or a tracer) lives in host memory."""
    return jax.typeof(x).memory_space == HOST


def to_device(x):
    """``x`` in device memory (itself when it is there already)."""
    return jax.device_put(x, DEVICE) if on_host(x) else x


def to_host(x):
    """``x`` in host memory (itself when it is there already)."""
    return x if on_host(x) else jax.device_put(x, HOST)


def tree_to_device(tree):
    return jax.tree.map(to_device, tree)


def tree_to_host(tree):
    return jax.tree.map(to_host, tree)


def scan_layers(fn: Callable, x, stacked, *args):
    """``fn(x, layer, *args) -> x`` over stacked layers: ``stacked``'s leaves ``[L, ...]``
    (or ``Split``s: the resident layers run first, then the offloaded ones), ``x`` the
    carry (``[B, T, D]``), ``args`` passed to every layer unchanged (positions, segment
    ids). Layers in host memory are fetched ``current().offload.prefetch`` layers ahead."""
    if any(is_split(leaf) for leaf in jax.tree.leaves(stacked, is_leaf=is_split)):
        part = lambda name: jax.tree.map(lambda s: getattr(s, name), stacked, is_leaf=is_split)  # noqa: E731
        x = scan_layers(fn, x, part("resident"), *args)
        return scan_layers(fn, x, part("offloaded"), *args)
    leaves = jax.tree.leaves(stacked)
    if not any(on_host(leaf) for leaf in leaves):
        return jax.lax.scan(lambda x, layer: (fn(x, layer, *args), None), x, stacked)[0]
    if not all(on_host(leaf) for leaf in leaves):
        raise ValueError("a stack of layers lies partly in host and partly in device memory: "
                         "keep each layer's parameters in one memory (jaxpar.offload.state)")
    prefetch = min(current().offload.prefetch, leaves[0].shape[0])
    return _streamed(fn, prefetch, x, stacked, args)


def _layer(stacked, i):
    """Layer ``i`` (a traced index) of host-resident ``stacked``, fetched to the device."""
    return jax.tree.map(lambda a: to_device(jax.lax.dynamic_index_in_dim(a, i, keepdims=False)), stacked)


def _prefetched(fn, prefetch: int, carry, stacked, xs, *, reverse: bool):
    """A scan over the ``L`` host-resident layers of ``stacked`` (in reverse with
    ``reverse``) that carries a window of ``prefetch`` layers already fetched to the
    device: step ``i`` issues the fetch of layer ``i + prefetch`` (``i - prefetch`` in
    reverse; clamped at the end, where the last steps fetch the last layer again, an idle
    copy rather than a ``lax.cond``) before ``fn(carry, layer_i, x_i) -> (carry, y_i)``
    computes with layer ``i``, so the copy can overlap the layer's compute. ``xs``:
    ``[L, ...]`` per-layer inputs or None. Returns ``(carry, ys)``."""
    L = jax.tree.leaves(stacked)[0].shape[0]
    step = -1 if reverse else 1
    first = L - 1 if reverse else 0
    window = tuple(_layer(stacked, first + step * k) for k in range(prefetch))

    def body(state, scanned):
        carry, window = state
        i, x_i = scanned
        ahead = _layer(stacked, jnp.clip(i + step * prefetch, 0, L - 1))
        carry, y = fn(carry, window[0], x_i)
        return (carry, window[1:] + (ahead,)), y

    (carry, _), ys = jax.lax.scan(body, (carry, window), (jnp.arange(L), xs), reverse=reverse)
    return carry, ys


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _streamed(fn, prefetch, x, stacked, args):
    forward = lambda x, layer, _: (fn(x, layer, *args), None)  # noqa: E731
    return _prefetched(forward, prefetch, x, stacked, None, reverse=False)[0]


def _streamed_fwd(fn, prefetch, x, stacked, args):
    forward = lambda x, layer, _: (fn(x, layer, *args), x)  # noqa: E731
    out, inputs = _prefetched(forward, prefetch, x, stacked, None, reverse=False)
    return out, (stacked, inputs, args)


def _streamed_bwd(fn, prefetch, residuals, g):
    """Layers in reverse, each fetched again ``prefetch`` ahead, its forward recomputed
    from its saved input; its parameter gradient goes to the host at once, so the
    ``[L, ...]`` gradient builds up in host memory one layer at a time."""
    stacked, inputs, args = residuals

    def backward(g, layer, x_i):
        _, vjp = jax.vjp(lambda x, layer: fn(x, layer, *args), x_i, layer)
        g_x, g_layer = vjp(g)
        return g_x, jax.tree.map(to_host, g_layer)

    g_x, g_stacked = _prefetched(backward, prefetch, g, stacked, inputs, reverse=True)
    return g_x, g_stacked, jax.tree.map(_zero_cotangent, args)


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)


_streamed.defvjp(_streamed_fwd, _streamed_bwd)
