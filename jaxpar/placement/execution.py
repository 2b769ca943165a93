"""What changes a compiled program besides its arguments: the rules activations follow,
who computes attention, norms and the loss, and how attention runs over a split length.

All of it is one frozen, hashable value, ``Execution``. It is in force inside
``use_execution(...)`` (``jaxpar.use_mesh(mesh, rules)`` sets its rules), and the
library reads it while tracing. Reading context while tracing is what ``jax.jit``'s
cache cannot see: a function traced under one setting and called again under another
would silently rerun the first program. So every jitted entry point of jaxpar either
binds its ``Execution`` when it is built (``make_train_step``) or is a ``jaxpar.jit``,
which passes the ``Execution`` in force at call time as a static argument, so each
setting gets its own program. Jit your own functions that call jaxpar's layers with
``jaxpar.jit`` for the same guarantee.

A mesh without rules is an error where rules decide something (``rules_for``): jaxpar
never guesses that the activations follow ``DEFAULT_RULES`` while the parameters follow
other ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from flax.core import spmd as flax_spmd

from jaxpar.kernels.dispatch import KernelOptions
from jaxpar.placement import rules as rules_lib

# Sequence-parallel attention algorithms and token layouts (SequenceOptions).
SEQUENCE_IMPLS = ("ring", "rsa", "ulysses")
SEQUENCE_LAYOUTS = ("natural", "zigzag")


@dataclasses.dataclass(frozen=True)
class SequenceOptions:
    """How the model's attention runs when the rules split ``activation_length`` over a
    mesh axis of size > 1: ``impl`` in ``SEQUENCE_IMPLS``, ``layout`` in
    ``SEQUENCE_LAYOUTS`` (the order the model's tokens are in; the caller permutes its
    batch with ``jaxpar.parallel.zigzag.to_zigzag``). ``always``: use ``impl`` even
    when that axis has size 1 (the ring is then single-device blockwise attention,
    O(T) memory: the benchmarks' N = 1 rows).

    ``layout`` defaults to ``natural``: the model computes the right thing for tokens in
    their own order, whoever calls it. ``jaxpar-train`` defaults to ``zigzag`` (the
    causal load balance the ring is built for) because it permutes every batch itself."""

    impl: str = "ring"
    layout: str = "natural"
    always: bool = False

    def __post_init__(self):
        if self.impl not in SEQUENCE_IMPLS:
            raise ValueError(f"sequence-parallel impl={self.impl!r} is not one of {SEQUENCE_IMPLS}")
        if self.layout not in SEQUENCE_LAYOUTS:
            raise ValueError(f"sequence-parallel layout={self.layout!r} is not one of {SEQUENCE_LAYOUTS}")


# Where train state may live (OffloadOptions).
OFFLOAD_PLACES = ("device", "host")


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """A resolved offload plan (no ``auto``: the planner resolves that).

    params: ``device`` or ``host``: where the parameters that are not resident live
      between steps (host: JAX's ``pinned_host`` memory kind); each stacked layer is
      fetched to the device for its use, ``prefetch`` layers ahead.
    resident_layers: how many of the stacked layers keep their parameters on the device
      (Gemini's static placement ratio, as a count): the model's first ones, which the
      forward pass runs while the first host layer is fetched; None: all with
      ``params=device``, none with ``params=host``. With ``params=host`` the embedding,
      positions, final norm and head live on the host whatever this count.
    optimizer: ``device`` or ``host``: where the optimizer state (Adam's moments) lives.
    activations: ``checkpoint_name``s whose saved residuals go to host memory between
      the forward and the backward pass.
    prefetch: how many layers ahead a host-resident layer's fetch is issued (>= 1).
    """

    params: str = "device"
    resident_layers: int | None = None
    optimizer: str = "device"
    activations: tuple[str, ...] = ()
    prefetch: int = 1

    def __post_init__(self):
        for key in ("params", "optimizer"):
            if getattr(self, key) not in OFFLOAD_PLACES:
                raise ValueError(f"offload.{key}={getattr(self, key)!r} must be one of {list(OFFLOAD_PLACES)}")
        if self.resident_layers is not None and (
                isinstance(self.resident_layers, bool) or not isinstance(self.resident_layers, int)
                or self.resident_layers < 0):
            raise ValueError(f"offload.resident_layers={self.resident_layers!r} must be an int >= 0")
        if self.resident_layers is not None and self.params == "device":
            raise ValueError(f"offload.resident_layers={self.resident_layers} applies to offload.params=host "
                             "(with params=device every layer is resident)")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ValueError(f"offload.prefetch={self.prefetch!r} must be an int >= 1")
        object.__setattr__(self, "activations", tuple(self.activations))

    @property
    def state_on_host(self) -> bool:
        """Whether parameters or optimizer state live in host memory between steps."""
        return self.params == "host" or self.optimizer == "host"

    @property
    def any(self) -> bool:
        """Whether anything lives on, or goes to, the host."""
        return self.state_on_host or bool(self.activations)


@dataclasses.dataclass(frozen=True)
class Execution:
    """Everything besides the arguments that decides what jaxpar traces.

    rules: the logical-axis rules activations follow, as ``(name, mesh_axes)`` pairs
      (``jaxpar.rules.for_mesh`` gives them for a mesh); None: none set.
    kernels: who computes attention, norms and the loss (XLA, Pallas, cuDNN).
    sequence: how attention runs over a length split across devices.
    offload: which train state lives in host memory and how a step moves it
      (``jaxpar.offload``).
    """

    rules: tuple[tuple[str, Any], ...] | None = None
    kernels: KernelOptions = KernelOptions()
    sequence: SequenceOptions = SequenceOptions()
    offload: OffloadOptions = OffloadOptions()

    def __post_init__(self):
        if self.rules is not None:  # validated and hashable, whatever sequence was given
            object.__setattr__(self, "rules", rules_lib.freeze(self.rules))


_EXECUTION = contextvars.ContextVar("jaxpar_execution", default=Execution())


def current() -> Execution:
    """The ``Execution`` in force. Rules set only through Flax
    (``flax.linen.logical_axis_rules``, as a Linen project does) count as its rules."""
    execution = _EXECUTION.get()
    if execution.rules is None and flax_spmd.get_logical_axis_rules():
        execution = dataclasses.replace(execution, rules=tuple(flax_spmd.get_logical_axis_rules()))
    return execution


@contextlib.contextmanager
def use_execution(execution: Execution | None = None, **changes):
    """Puts ``execution`` (default: the one in force) with ``changes`` (any of its fields:
    ``rules=``, ``kernels=``, ``sequence=``, ``offload=``) in force; trace inside."""
    new = dataclasses.replace(current() if execution is None else execution, **changes)
    token = _EXECUTION.set(new)
    try:
        yield new
    finally:
        _EXECUTION.reset(token)


def rules_for(mesh, user: str) -> tuple:
    """The rules in force restricted to ``mesh``; an error naming ``user`` when a mesh
    is set but no rules are."""
    rules = current().rules
    if rules is None:
        raise ValueError(
            f"{user}: a mesh {dict(mesh.shape)} is set but no sharding rules are: enter "
            "jaxpar.use_mesh(mesh, rules) (rules=None means jaxpar.rules.DEFAULT_RULES), or "
            "flax.linen.logical_axis_rules(...), rather than jax.set_mesh alone")
    return rules_lib.for_mesh(mesh, rules)


def implementation(op: str) -> str:
    """``"xla"``, ``"pallas"`` or ``"cudnn"``: what runs ``op`` (``"attention"``,
    ``"norm"``, ``"loss"``) here."""
    return current().kernels.resolve(op)


def jit(fn: Callable | None = None, *, transform: Callable = jax.jit, **jit_kwargs):
    """``jax.jit`` whose cache key includes the ``Execution`` in force at each call.

    ``fn`` is traced under the ``Execution`` in force when it is called, and a call under
    another one compiles anew instead of silently reusing a program built for other
    rules or kernels. ``jit_kwargs`` go to ``transform`` (``jax.jit``, or ``nnx.jit`` for
    functions of NNX modules); ``static_argnums`` and ``donate_argnums`` count ``fn``'s
    own arguments. ``.lower(...)`` and ``.trace(...)`` work as on a jitted function.
    """
    if fn is None:
        return functools.partial(jit, transform=transform, **jit_kwargs)

    def traced(execution, *args, **kwargs):
        with use_execution(execution):
            return fn(*args, **kwargs)

    shift = lambda nums: tuple(n + 1 for n in ((nums,) if isinstance(nums, int) else nums))  # noqa: E731
    for key in ("static_argnums", "donate_argnums"):
        if key in jit_kwargs:
            jit_kwargs[key] = shift(jit_kwargs[key])
    static = (0, *jit_kwargs.pop("static_argnums", ()))
    jitted = transform(traced, static_argnums=static, **jit_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return jitted(current(), *args, **kwargs)

    call.lower = lambda *args, **kwargs: jitted.lower(current(), *args, **kwargs)
    call.trace = lambda *args, **kwargs: jitted.trace(current(), *args, **kwargs)
    return call
