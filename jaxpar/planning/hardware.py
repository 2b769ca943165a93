"""Hardware profiles: what a device computes and moves per second, for the planner's
step-time model (``jaxpar.planning.cost``).

A profile is a small YAML file (``jaxpar/planning/hardware/*.yaml`` ships ``h100``,
``h200`` and ``a100`` from vendor figures; ``cpu`` is measured on the machine that runs
``jaxpar-plan --calibrate`` and written to ``CACHE_DIR/hardware/cpu.yaml``). Fields,
every one required:

``peak_flops``
    dense matmul FLOP/s per device by compute dtype (``bfloat16``, ``float32``).
``efficiency``
    the fraction of that peak each op class reaches in a training step: ``matmul``
    (the projections and the vocabulary head) and ``attention`` (scores and values).
``hbm_bandwidth``
    device memory bytes/s (what elementwise work runs at).
``memory``
    device memory (bytes, or ``80GiB``).
``intra_node_bandwidth`` / ``inter_node_bandwidth``
    bytes/s one device SENDS through a collective over an axis whose devices share a
    node (NVLink) / that crosses nodes (InfiniBand, per GPU).
``collective_latency``
    seconds each collective costs whatever its size.
``host_bandwidth``
    host<->device bytes/s per direction (offload transfers).
``comm_overlap``
    the fraction (0 to 1) of the collectives XLA's scheduler can run under compute:
    1 on GPUs (async collectives, the latency-hiding scheduler), 0 on XLA:CPU.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import yaml

from jaxpar.inputs import InputError, read_yaml
from jaxpar.offload.budget import parse_bytes

PROFILE_DIR = pathlib.Path(__file__).parent / "hardware"
SHIPPED = ("h100", "h200", "a100")
# The shipped profile of a device, by a word of its ``device_kind`` ("NVIDIA H100 80GB HBM3").
DEVICE_KINDS = {"H100": "h100", "H200": "h200", "A100": "a100"}
OP_CLASSES = ("matmul", "attention")


class HardwareError(InputError):
    """A hardware profile that cannot be read or lacks fields (one line)."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]
    efficiency: dict[str, float]
    hbm_bandwidth: float
    memory: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    collective_latency: float
    host_bandwidth: float
    comm_overlap: float

    def peak(self, dtype: str) -> float:
        """Peak matmul FLOP/s for compute ``dtype`` (float16 as bfloat16)."""
        dtype = "bfloat16" if dtype == "float16" else dtype
        if dtype not in self.peak_flops:
            raise HardwareError(f"hardware profile {self.name!r} gives no peak_flops for {dtype}; "
                                f"it has {sorted(self.peak_flops)}")
        return self.peak_flops[dtype]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Every field a profile file must give: the dataclass's, but its name.
FIELDS = tuple(f.name for f in dataclasses.fields(Hardware) if f.name != "name")


def shipped_for(device_kind: str) -> str | None:
    """The shipped profile's name for a device of ``device_kind``, None when none fits."""
    return next((name for word, name in DEVICE_KINDS.items() if word in device_kind), None)


def _number(value, key: str, source: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise HardwareError(f"{source}: {key}={value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise HardwareError(f"{source}: {key}={value!r} must be a non-negative number")
    return float(value)


def from_dict(values: Any, name: str, source: str) -> Hardware:
    """A ``Hardware`` from a profile's mapping; ``HardwareError`` naming every missing field."""
    if not isinstance(values, dict):
        raise HardwareError(f"{source}: a hardware profile must be a mapping of {', '.join(FIELDS)}")
    missing = [f for f in FIELDS if f not in values]
    if missing:
        raise HardwareError(f"{source}: hardware profile lacks {', '.join(missing)}")
    unknown = sorted(set(values) - set(FIELDS) - {"name", "notes"})
    if unknown:
        raise HardwareError(f"{source}: unknown hardware profile field(s) {', '.join(unknown)}; "
                            f"fields are {', '.join(FIELDS)}")
    peaks, eff = values["peak_flops"], values["efficiency"]
    if not isinstance(peaks, dict) or not peaks:
        raise HardwareError(f"{source}: peak_flops must map compute dtypes to FLOP/s, e.g. {{bfloat16: 989e12}}")
    if not isinstance(eff, dict) or set(OP_CLASSES) - set(eff):
        raise HardwareError(f"{source}: efficiency must give {', '.join(OP_CLASSES)} (fractions of peak)")
    try:
        memory = parse_bytes(values["memory"], name="memory")
    except ValueError as e:
        raise HardwareError(f"{source}: {e}") from None
    overlap = _number(values["comm_overlap"], "comm_overlap", source)
    if overlap > 1:
        raise HardwareError(f"{source}: comm_overlap={overlap} must be between 0 and 1")
    hw = Hardware(
        name=str(values.get("name", name)),
        peak_flops={str(k): _number(v, f"peak_flops.{k}", source) for k, v in peaks.items()},
        efficiency={k: _number(eff[k], f"efficiency.{k}", source) for k in OP_CLASSES},
        hbm_bandwidth=_number(values["hbm_bandwidth"], "hbm_bandwidth", source),
        memory=memory,
        intra_node_bandwidth=_number(values["intra_node_bandwidth"], "intra_node_bandwidth", source),
        inter_node_bandwidth=_number(values["inter_node_bandwidth"], "inter_node_bandwidth", source),
        collective_latency=_number(values["collective_latency"], "collective_latency", source),
        host_bandwidth=_number(values["host_bandwidth"], "host_bandwidth", source),
        comm_overlap=overlap,
    )
    for key in ("hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth"):
        if getattr(hw, key) <= 0:
            raise HardwareError(f"{source}: {key} must be positive")
    return hw


def load(name_or_path: str, cache_dir: pathlib.Path | str | None = None) -> Hardware:
    """A shipped profile (``h100``, ``h200``, ``a100``), ``cpu`` (the calibrated one in
    ``cache_dir/hardware/cpu.yaml``; it needs ``cache_dir``), or a YAML file's path."""
    path = pathlib.Path(name_or_path).expanduser()
    if name_or_path in SHIPPED:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    elif name_or_path == "cpu":
        if cache_dir is None:
            raise HardwareError("hardware=cpu: the calibrated profile lives in a cache_dir; none was given")
        path = calibrated_path(cache_dir)
        if not path.is_file():
            raise HardwareError(f"hardware=cpu: no calibrated profile at {path}; run "
                                "`jaxpar-plan --calibrate` (or plan with hardware=cpu: it calibrates on first use)")
    elif not path.suffix:
        raise HardwareError(f"hardware={name_or_path!r} is not one of {', '.join(SHIPPED + ('cpu',))} "
                            "nor a path to a YAML profile")
    values = read_yaml(path, named=f"hardware profile {str(path)!r}", error=HardwareError)
    return from_dict(values, path.stem, str(path))


def calibrated_path(cache_dir: pathlib.Path | str) -> pathlib.Path:
    """Where ``--calibrate`` writes the ``cpu`` profile: ``cache_dir/hardware/cpu.yaml``."""
    return pathlib.Path(cache_dir) / "hardware" / "cpu.yaml"


def save(hw: Hardware, path: pathlib.Path, notes: str = "") -> None:
    """Writes ``hw`` as a profile YAML (atomically: a half-written profile is never read)."""
    values = {"name": hw.name, **{k: v for k, v in hw.to_dict().items() if k != "name"}}
    if notes:
        values["notes"] = notes
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(values, sort_keys=False))
    tmp.replace(path)
