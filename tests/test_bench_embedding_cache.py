"""bench/embedding_cache.py as a newcomer runs it, at the smoke scale: the JSON has every
field with rates in [0, 1], the oracle does not get worse with more rows, warm-up helps
LFU, the tables are printed and the picture is a PNG; and the oracle's count equals a
brute-force count."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "embedding_cache.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_embedding_cache", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a subprocess: about 6 s on 2 cores
def test_hits_smoke(tmp_path):
    """Two Zipf streams and the Criteo-format sample (2 x 10^5 rows, 40 + 60 steps)."""
    out = subprocess.run([sys.executable, str(SCRIPT), "hits", "--smoke", "--json", str(tmp_path / "hits.json"),
                          "--png", str(tmp_path / "hits.png")], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "hits.json").read_text())
    assert {"command", "date", "machine", "jax", "git", "steps", "warmup_steps", "row_bytes"} <= set(result["meta"])
    streams = result["streams"]
    assert [s["kind"] for s in streams] == ["zipf", "zipf", "criteo-format"]
    assert streams[-1]["round_trip_exact"] and streams[-1]["tsv_lines"] == 100 * streams[-1]["batch"]
    for s in streams:
        assert s["unique_ids_per_batch"]["max"] <= s["runs"][0]["cache_rows"]  # a 0.5% cache holds a batch
        runs = {(r["ratio"], r["policy"]): r for r in s["runs"]}
        assert set(runs) == {(ratio, p) for ratio in (0.005, 0.01, 0.02, 0.05)
                             for p in ("lfu+warmup", "lfu", "lru", "oracle")}
        for r in s["runs"] + s["static_sample"]:
            assert 0 <= r["hit_rate"] <= 1 and 0 <= r["hit_rate_second_half"] <= 1
            assert len(r["per_step_hit_rate"]) == 60 and all(0 <= x <= 1 for x in r["per_step_hit_rate"])
            assert r["h2d_bytes_per_step"] >= 0 and r["d2h_bytes_per_step"] >= 0 and r["evictions_per_step"] >= 0
            assert r["h2d_bytes_per_step"] == r["misses"] / 60 * 516  # dim 128 + the Adagrad accumulator
        oracle = [runs[ratio, "oracle"]["hit_rate"] for ratio in (0.005, 0.01, 0.02, 0.05)]
        assert oracle == sorted(oracle)  # top-k sets are nested: more rows never hit less
        for ratio in (0.005, 0.01, 0.02, 0.05):
            warm, cold = runs[ratio, "lfu+warmup"], runs[ratio, "lfu"]
            assert warm["hit_rate"] >= cold["hit_rate"]  # the cold cache misses everything at first
            assert warm["warmup_rows_loaded"] == warm["cache_rows"] and cold["warmup_rows_loaded"] == 0
            assert cold["per_step_hit_rate"][0] == 0 and runs[ratio, "lru"]["per_step_hit_rate"][0] == 0
            assert runs[ratio, "oracle"]["evictions_per_step"] == 0
    assert any(line.startswith("| 1.05 | 200,000 | 0.5% | LFU + warm-up |") for line in out.stdout.splitlines())
    target = [line for line in out.stdout.splitlines()
              if line.startswith("| 1.2 | 200,000 | 5.0% | ") and ("| no |" in line or "| yes |" in line)]
    assert len(target) == 1  # the summary against the oracle, one line per point
    assert (tmp_path / "hits.png").read_bytes().startswith(b"\x89PNG")


def test_oracle_counts_brute_force():
    """The oracle's top-k (ids in the most batches, ties to the lower id) and its per-step
    hits and misses equal a count with Python sets."""
    bench = bench_module()
    rng = np.random.default_rng(0)
    num_rows, k = 60, 9
    batches = (rng.zipf(1.3, (6, 5, 4)) - 1) % num_rows  # 6 batches [B=5, F=4]
    presence = {i: sum(i in set(b.ravel().tolist()) for b in batches) for i in range(num_rows)}
    top = sorted(range(num_rows), key=lambda i: (-presence[i], i))[:k]
    order = bench.top_by_batches(batches, num_rows)
    assert order[:k].tolist() == top
    counts = bench.static_counts(bench.batch_uniques(batches), order[:k], num_rows)
    for b, h, m in zip(batches, counts["hits"], counts["misses"]):
        unique = set(b.ravel().tolist())
        assert h == len(unique & set(top)) and m == len(unique - set(top))
    assert counts["hits"].sum() == sum(presence[i] for i in top)  # a static set's hits: its ids' batch counts
