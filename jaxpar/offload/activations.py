"""Activation offload (``offload.activations``): residuals a layer saves for its backward
pass, named by ``jax.ad_checkpoint.checkpoint_name``, kept in host memory (JAX's
``pinned_host``) between the forward and the backward pass instead of on the device.

A remat policy of the ``save_and_offload_only_these_names`` family does it: the forward
copies each named value to the host as it is computed, the backward copies it back
where it reads it. Under a ``jax.lax.scan`` over layers the per-layer copies land in a
stacked ``[L, ...]`` buffer that XLA keeps on the host (the scan case of jax#23869,
which JAX and XLA handle since the residuals' avals carry their memory space).

On CPU both copies lower to nothing (``jax/_src/dispatch.py`` registers the
``annotate_device_placement`` lowering for GPU and TPU only): the math runs unchanged,
and a CUDA lowering shows the transfers (tests/test_offload_activations.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.ad_checkpoint import Recompute

HOST = "pinned_host"


def check_names(names: Sequence[str], defined: Sequence[str]) -> None:
    """Raises one line naming the first of ``names`` that is not in ``defined`` (the
    model's checkpoint names) and listing those."""
    for name in names:
        if name not in defined:
            raise ValueError(f"offload.activations: {name!r} is not a checkpoint name of the model; "
                             f"it defines {list(defined)}")


def policy(offloaded: Sequence[str], *, saved: Sequence[str] = (),
           otherwise: Callable | None = None) -> Callable:
    """A ``jax.checkpoint`` policy: the values named in ``offloaded`` are saved in host
    memory; those named in ``saved`` (and not offloaded) on the device; every other value
    as ``otherwise`` decides (a ``jax.checkpoint_policies`` policy; None: recomputed).

    A name in both ``offloaded`` and ``saved`` goes to the host: it is still kept rather
    than recomputed, as the model asks, but where the offload plan puts it.
    """
    offloaded = tuple(dict.fromkeys(offloaded))
    named = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[n for n in saved if n not in offloaded],
        names_which_can_be_offloaded=offloaded, offload_src="device", offload_dst=HOST)
    if otherwise is None:
        return named

    def decide(prim, *avals, **params):
        decision = named(prim, *avals, **params)
        return otherwise(prim, *avals, **params) if decision is Recompute else decision

    return decide
