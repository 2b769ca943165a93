"""A disk cache of compiled figures, keyed by what decides them: the model's shape, the
batch, the sequence length, the layout, the compiling backend and device count, and
the JAX/jaxlib versions, XLA flags and the figures' own ``VERSION``. One small JSON file per entry in
``CACHE_DIR/plan/``, written to a temporary name and moved into place (a reader never
sees half an entry; racing writers write the same bytes)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib

# Bumped whenever what the figures mean changes (the profiler's counting, the compiled
# step), so an older entry is never read.
# 5: MoE within an expert over tensor (jaxpar.models.moe), Megatron SP with seq gathers
# the residual stream over tensor before and after each projection (models.transformer);
# 4: collective_kinds_by_axes (a compile with data cut is rescaled by kind); 3: 2D + FSDP
# gathers one layer at a time (jaxpar.ops.linear)
VERSION = 5
# The profiler's figures the planner reads; the cache keeps only these.
FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes", "flops",
          "collective_bytes", "collectives", "collectives_by_axes", "collective_counts_by_axes",
          "collective_kinds_by_axes", "pipeline_bubble")


def key(work, layout, backend: str) -> str:
    what = {"model": dataclasses.asdict(work.model), "batch_size": work.batch_size, "seq_len": work.seq_len,
            "layout": layout.overrides(), "backend": backend, "version": VERSION,
            "jax": importlib.metadata.version("jax"), "jaxlib": importlib.metadata.version("jaxlib"),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


class FigureCache:
    def __init__(self, directory: pathlib.Path | str | None):
        self.directory = None if directory is None else pathlib.Path(directory) / "plan"
        self.hits = self.misses = 0

    def get(self, k: str) -> dict | None:
        if self.directory is None:
            return None
        path = self.directory / f"{k}.json"
        try:
            figures = json.loads(path.read_text())
        except (OSError, ValueError):
            self.misses += 1
            return None
        self.hits += 1
        return figures

    def put(self, k: str, figures: dict) -> dict:
        kept = {f: figures[f] for f in FIELDS if f in figures}
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{k}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(kept, sort_keys=True))
            tmp.replace(self.directory / f"{k}.json")
        return kept
