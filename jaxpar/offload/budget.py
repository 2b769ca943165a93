"""Byte counts as people write them: ``offload.device_budget`` and ``offload.host_bandwidth``.

``parse_bytes`` takes a non-negative whole number (``4096``, ``1e9``), or a number
(decimals allowed) followed by a unit: binary ``KiB MiB GiB TiB`` (powers of 1024) or
decimal ``KB MB GB TB`` (powers of 1000), and ``B``. Units are case-sensitive as written
(``GiB``, ``GB``), the space between number and unit optional. Anything else (``6G``,
``6gib``, ``6 gigs``, ``-1GiB``, ``1.5`` bytes) is one ``ValueError`` naming the value:
a budget that silently means a thousand times less than intended is worse than a
refusal.
"""

from __future__ import annotations

import math
import re

UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_BYTES = re.compile(r"((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)")


def parse_bytes(value: int | float | str, *, name: str = "bytes") -> int:
    """``"6GiB"`` -> 6442450944, ``"512MiB"``, ``"1.5GB"`` -> 1500000000, ``4096`` and
    ``"4096"`` -> 4096, ``"1e9"`` -> 1000000000.

    A fractional count of bytes rounds down (``"1.5KiB"`` is 1536, ``"0.5B"`` is 0); a
    float is taken only when it is whole (YAML reads ``1.5e9`` as one).

    Raises:
      ValueError: ``"{name}={value!r} is not a byte count: ..."``, one line.
    """
    units = "/".join(UNITS)
    bad = ValueError(f"{name}={value!r} is not a byte count: give an integer or a number with "
                     f"one of the units {units} (e.g. 6GiB, 512MiB, 1.5GB)")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise bad
        return value
    if not isinstance(value, str):
        raise bad
    match = _BYTES.fullmatch(value.strip())
    if match is None or match.group(2) not in ("", *UNITS):
        raise bad
    number, unit = match.groups()
    if not unit:
        if not float(number).is_integer():
            raise bad
        return int(number) if number.isdigit() else int(float(number))
    return math.floor(float(number) * UNITS[unit])


def format_bytes(n: float) -> str:
    """A byte count for people, binary units: 1536 -> ``'1.5KiB'``, 6442450944 -> ``'6GiB'``."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if abs(n) >= UNITS[unit]:
            return f"{n / UNITS[unit]:.3g}{unit}"
    return f"{int(n)}B"


def _memory_stats(device) -> dict:
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics raise or return None
        return {}


def device_memory(device) -> int | None:
    """The bytes ``device`` lets a process allocate (XLA's ``bytes_limit``: on a GPU the
    client's memory fraction of the card), or None where the backend does not say (CPU)."""
    limit = _memory_stats(device).get("bytes_limit")
    return int(limit) if limit else None


def free_memory(devices) -> int | None:
    """The least memory free over ``devices`` now (``bytes_limit - bytes_in_use``), or
    None where the backend does not say (CPU)."""
    free = []
    for device in devices:
        stats = _memory_stats(device)
        if not stats.get("bytes_limit"):
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free, default=None)
