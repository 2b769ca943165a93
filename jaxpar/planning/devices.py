"""Device profiles: the relative speed and the memory of each pipeline rank, for
``pipeline.stage_layers=auto`` on unequal hardware (issue 39; ``jaxpar.planning.stages``).

A small YAML file (``pipeline.device_profile=devices.yaml``; ``jaxpar-plan
--profile-devices`` measures and writes one)::

    ranks:
      - {speed: 1.0, memory: 80GiB}
      - {speed: 0.5, memory: 40GiB}

``ranks`` lists the pipeline ranks in order (rank ``r`` holds stage ``r``), or maps
each rank's index to its entry (``ranks: {0: {...}, 1: {...}}``); there must be one
entry per rank of ``mesh.pipe``, no more, no fewer. An entry's fields:

``speed``
    a positive number, relative: a rank of speed 0.5 takes twice as long over a layer
    as one of speed 1, which is the device of the planner's hardware profile
    (``plan.hardware``). A rank of several devices (data or tensor parallel within the
    stage) is as fast as its slowest.
``memory``
    bytes per device (an integer or ``80GiB``, ``jaxpar.offload.budget.parse_bytes``);
    absent or null: unbounded (what ``--profile-devices`` writes where the backend
    does not say, as on CPUs).
``device``
    a label, free text (what was measured).

This module lives in ``jaxpar.planning`` rather than beside ``jaxpar.hetero.allocation``
because it reads byte counts with ``jaxpar.offload``'s parser and measures the model's
layer, which the ``hetero`` layer may not import (pyproject's import-linter contract).
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import yaml

from jaxpar.inputs import InputError, read_yaml
from jaxpar.offload.budget import format_bytes, parse_bytes

FIELDS = ("speed", "memory", "device")


class ProfileError(InputError):
    """A device profile that cannot be read, or a ``stage_layers=auto`` that it cannot
    resolve (one line, naming the offending value)."""


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    speeds: tuple[float, ...]
    memories: tuple[int | None, ...]  # bytes per device; None: unbounded
    labels: tuple[str | None, ...] = ()
    source: str = "device profile"

    @property
    def ranks(self) -> int:
        return len(self.speeds)

    def check_ranks(self, pipe: int) -> DeviceProfile:
        """``self`` when it lists exactly ``pipe`` ranks; else ``ProfileError``."""
        if self.ranks != pipe:
            raise ProfileError(f"{self.source}: lists {self.ranks} rank{'s' * (self.ranks != 1)} for "
                               f"mesh.pipe={pipe}: give one entry per pipeline rank")
        return self

    def to_dict(self) -> dict[str, Any]:
        ranks = []
        for r in range(self.ranks):
            entry: dict[str, Any] = {"speed": self.speeds[r], "memory": _memory_text(self.memories[r])}
            if self.labels and self.labels[r] is not None:
                entry["device"] = self.labels[r]
            ranks.append(entry)
        return {"ranks": ranks}


def _memory_text(n: int | None) -> str | int | None:
    """``80GiB`` where that is exact, else the byte count."""
    if n is None:
        return None
    text = format_bytes(n)
    return text if parse_bytes(text) == n else int(n)


def _speed(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ProfileError(f"{where}.speed={value!r} must be a positive number")
    return float(value)


def _entries(ranks, source: str) -> list:
    """The entries in rank order, from a list or an index -> entry mapping."""
    if isinstance(ranks, list):
        return ranks
    if not isinstance(ranks, dict) or not ranks:
        raise ProfileError(f"{source}: ranks must list one {{speed, memory}} entry per pipeline rank")
    bad = [k for k in ranks if isinstance(k, bool) or not isinstance(k, int) or k < 0]
    if bad:
        raise ProfileError(f"{source}: rank index {bad[0]!r} is not a non-negative integer")
    missing = [r for r in range(max(ranks) + 1) if r not in ranks]
    if missing:
        raise ProfileError(f"{source}: rank {missing[0]} is missing (ranks listed: "
                           f"{', '.join(map(str, sorted(ranks)))})")
    return [ranks[r] for r in range(len(ranks))]


def from_dict(values: Any, source: str = "device profile") -> DeviceProfile:
    """A ``DeviceProfile`` from a profile's mapping; ``ProfileError`` on anything else."""
    if not isinstance(values, dict) or "ranks" not in values:
        raise ProfileError(f"{source}: a device profile is a mapping with ranks: [{{speed: 1.0, memory: 80GiB}}, ...]")
    unknown = sorted(set(values) - {"ranks", "notes"})
    if unknown:
        raise ProfileError(f"{source}: unknown device profile key(s) {', '.join(map(str, unknown))}; "
                           "keys are ranks, notes")
    speeds, memories, labels = [], [], []
    for r, entry in enumerate(_entries(values["ranks"], source)):
        where = f"{source}: ranks[{r}]"
        if not isinstance(entry, dict):
            raise ProfileError(f"{where}={entry!r} must be a mapping of {', '.join(FIELDS)}")
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise ProfileError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}; "
                               f"fields are {', '.join(FIELDS)}")
        if "speed" not in entry:
            raise ProfileError(f"{where} gives no speed")
        speeds.append(_speed(entry["speed"], where))
        memory = entry.get("memory")
        try:
            memories.append(None if memory is None else parse_bytes(memory, name=f"ranks[{r}].memory"))
        except ValueError as e:
            raise ProfileError(f"{source}: {e}") from None
        if memories[-1] == 0:
            raise ProfileError(f"{where}.memory={memory!r} must be positive (or null: unbounded)")
        labels.append(None if entry.get("device") is None else str(entry["device"]))
    if not speeds:
        raise ProfileError(f"{source}: lists no ranks")
    return DeviceProfile(tuple(speeds), tuple(memories), tuple(labels), source)


def load(path: str | pathlib.Path, pipe: int | None = None) -> DeviceProfile:
    """The profile in the YAML file ``path``, checked to list ``pipe`` ranks if given."""
    path = pathlib.Path(path).expanduser()
    values = read_yaml(path, named=f"pipeline.device_profile={str(path)!r}", error=ProfileError)
    profile = from_dict(values, str(path))
    return profile if pipe is None else profile.check_ranks(pipe)


def save(profile: DeviceProfile, path: pathlib.Path, header: str = "") -> str:
    """Writes ``profile`` as YAML (atomically), ``header`` as ``#`` comments; returns
    the text written."""
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    text = comments + yaml.safe_dump(profile.to_dict(), sort_keys=False, default_flow_style=None)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return text


# ----------------------------------------------------------------------------- measuring


def layer_seconds(model_cfg, rows: int, seq_len: int, devices: Sequence, *, repeats: int = 7) -> list[float]:
    """Each device's median seconds of one ``DecoderLayer``'s forward and backward
    (jitted: the gradient of its output's sum with respect to its parameters and input)
    over ``[rows, seq_len, D]``. Every device runs once untimed (it compiles), then the
    devices take turns, ``repeats`` rounds, so that a passing load on the host slows
    them alike rather than whichever was being timed."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpar.models.transformer import DecoderLayer

    graphdef, params = nnx.split(DecoderLayer(model_cfg, rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(0), (rows, seq_len, model_cfg.dim), model_cfg.compute_dtype)
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (rows, seq_len))
    segments = jnp.ones((rows, seq_len), jnp.int32)

    @jax.jit
    def forward_backward(params, x, positions, segments):
        def loss(p, x):
            return nnx.merge(graphdef, p)(x, positions, segments).astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1))(params, x)

    inputs = [jax.device_put((params, x, positions, segments), d) for d in devices]
    for args in inputs:
        jax.block_until_ready(forward_backward(*args))
    times: list[list[float]] = [[] for _ in devices]
    for _ in range(repeats):
        for i, args in enumerate(inputs):
            began = time.perf_counter()
            jax.block_until_ready(forward_backward(*args))
            times[i].append(time.perf_counter() - began)
    return [statistics.median(t) for t in times]


def measure(model_cfg, rows: int, seq_len: int, devices: Sequence, *,
            repeats: int = 7) -> tuple[DeviceProfile, list[float]]:
    """A profile of ``devices`` as pipeline ranks in order: each one's speed the fastest
    one's layer time over its own (``layer_seconds``; the fastest is 1.0, to three
    decimals), its memory the backend's ``bytes_limit`` (None where it does not say);
    and the layer seconds measured."""
    from jaxpar.offload.budget import device_memory

    seconds = layer_seconds(model_cfg, rows, seq_len, devices, repeats=repeats)
    fastest = min(seconds)
    return DeviceProfile(tuple(max(round(fastest / s, 3), 0.001) for s in seconds),
                         tuple(device_memory(d) for d in devices),
                         tuple(f"{d.platform}:{d.id} ({d.device_kind})" for d in devices)), seconds
