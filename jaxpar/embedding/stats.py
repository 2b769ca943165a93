"""What the cache did: per step and in total.

Hits and misses count a batch's unique ids, not its lookups: a missing row is fetched
once however many times the batch reads it, so unique counts are what transfers follow
(Colossal-AI reports the same). Bytes are the rows' values plus their optimizer state;
the device copies are padded to a size bucket (at most a quarter more, zeros) so that a
handful of programs serve every step, and the padding is not counted.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CacheStats:
    hits: int = 0  # unique ids of the batch that were resident
    misses: int = 0  # unique ids fetched from the host
    prefetched: int = 0  # of the misses, those the prefetch thread had staged
    evictions: int = 0  # rows written back to the host to make room
    h2d_bytes: int = 0  # host -> device, rows and optimizer state
    d2h_bytes: int = 0  # device -> host, written-back rows and state

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def __iadd__(self, other: CacheStats) -> CacheStats:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))
        return self
