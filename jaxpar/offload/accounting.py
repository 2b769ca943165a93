"""A train state's bytes per device, as the offload plan counts them: stacked layers
apart (one layer's share of each stacked array's shard), the other parameters split into
the chunks ``jaxpar.models.Transformer`` fetches (``NON_LAYER_USES``), and what a step
with ``params=host`` fetches and sends of them. ``jaxpar.offload.planner`` prices a
placement from these figures (its docstring: the accounting in full)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax

# How jaxpar.models.Transformer reads each non-layer parameter under params=host (its
# fetch.to_device calls): (chunk, fetches per step) for each use. "in": the lookup at
# the forward's start, whose gradient does not need the table (fetched once); "out":
# the final norm and the head, fetched in the forward and again in the backward. A tied
# embedding (no lm_head) is also the head. Each use sends one gradient to the host.
NON_LAYER_USES = {
    "embed": (("in", 1),),
    "positions": (("in", 1),),
    "final_norm": (("out", 2),),
    "lm_head": (("out", 2),),
}
TIED_EMBED_USES = (("in", 1), ("out", 2))
UNKNOWN_USES = (("in", 2), ("out", 2))  # a parameter the table does not name: both, twice


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Per-device bytes of a train state, split into stacked layers and the rest.

    layers: ``L``, the stacked layer count (0 without stacked layers).
    layer_params / layer_optimizer: one layer's share of the stacked arrays' shards.
    other_params / other_optimizer: every array without a ``layers`` axis (``E``).
    chunk_in / chunk_out: the non-layer parameters' input and output chunks (``C_in``,
      ``C_out``; ``NON_LAYER_USES``), what one fetch of each brings to the device.
    other_fetched / other_sent: per forward and backward, bytes of non-layer parameters
      fetched (``F_E``) and of their gradients sent to the host (``S_E``) with
      ``params=host``.
    """

    layers: int
    layer_params: int
    layer_optimizer: int
    other_params: int
    other_optimizer: int
    chunk_in: int = 0
    chunk_out: int = 0
    other_fetched: int = 0
    other_sent: int = 0

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.other_params

    @property
    def optimizer(self) -> int:
        return self.layers * self.layer_optimizer + self.other_optimizer

    @property
    def total(self) -> int:
        return self.params + self.optimizer


def shard_bytes(leaf) -> int:
    """Bytes of the largest shard of ``leaf`` (a ``ShapeDtypeStruct`` or array) on one
    device; the whole array without a sharding."""
    sharding = getattr(leaf, "sharding", None)
    itemsize = jax.numpy.dtype(leaf.dtype).itemsize
    if sharding is None:
        return math.prod(leaf.shape) * itemsize
    try:
        shape = sharding.shard_shape(leaf.shape)
    except ValueError:  # uneven split: the largest shard is what a device must hold
        shape = max((tuple(len(range(*s.indices(n))) for s, n in zip(index, leaf.shape))
                     for index in sharding.devices_indices_map(leaf.shape).values()),
                    key=math.prod)
    return math.prod(shape) * itemsize


def _key_name(key) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


def state_bytes(abstract_state: Mapping, *, layers_key: str = "layers") -> StateBytes:
    """Per-device bytes of ``abstract_state`` (``{"params", "opt_state"}``), stacked
    layers apart.

    ``layers`` is the stacked layers each device holds: its pipeline stage's where the
    ``layers`` axis is split over a ``pipe`` axis (each stage fetches its own).

    Raises:
      ValueError: stacked arrays disagree on ``L``.
    """
    layers = None
    sums = {"layer_params": 0, "layer_optimizer": 0, "other_params": 0, "other_optimizer": 0}
    others = []  # (top-level name, bytes) of each non-layer parameter
    for part, kind in (("params", "params"), ("opt_state", "optimizer")):
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state[part])[0]:
            nbytes = shard_bytes(leaf)
            names = [_key_name(k) for k in path]
            if layers_key not in names or not leaf.shape:
                sums[f"other_{kind}"] += nbytes
                if kind == "params":
                    others.append((names[0] if names else None, nbytes))
                continue
            sharding = getattr(leaf, "sharding", None)
            local = leaf.shape[0] if sharding is None else sharding.shard_shape(leaf.shape)[0]
            if layers is None:
                layers = local
            elif local != layers:
                raise ValueError(f"plan: {part}{jax.tree_util.keystr(path)} stacks {local} layers a device, "
                                 f"others {layers}")
            sums[f"layer_{kind}"] += nbytes
    layers = layers or 0
    if layers:
        sums["layer_params"] //= layers
        sums["layer_optimizer"] //= layers
    return StateBytes(layers, **sums, **_non_layer_chunks(others))


def _non_layer_chunks(others: list) -> dict[str, int]:
    """``chunk_in``, ``chunk_out``, ``other_fetched``, ``other_sent`` of the non-layer
    parameters ``[(name, bytes)]``, each used as ``NON_LAYER_USES`` says."""
    tied = "lm_head" not in {name for name, _ in others}
    out = {"chunk_in": 0, "chunk_out": 0, "other_fetched": 0, "other_sent": 0}
    for name, nbytes in others:
        uses = TIED_EMBED_USES if tied and name == "embed" else NON_LAYER_USES.get(name, UNKNOWN_USES)
        for chunk, fetches in uses:
            out[f"chunk_{chunk}"] += nbytes
            out["other_fetched"] += fetches * nbytes
            out["other_sent"] += nbytes
    return out
