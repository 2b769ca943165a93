"""bench/embedding_cache.py as a newcomer runs it, at the smoke scale: the JSON has every
field with rates in [0, 1], the oracle does not get worse with more rows, warm-up helps
LFU, the tables are printed and the picture is a PNG; and the oracle's count equals a
brute-force count."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "embedding_cache.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_embedding_cache", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.bench
def test_hits_smoke(tmp_path, capsys):
    """Two Zipf streams and the Criteo-format sample (2 x 10^5 rows, 40 + 60 steps), the
    script's main in this process (as test_memory_smoke: no interpreter and JAX start)."""
    bench_module().main(["hits", "--smoke", "--json", str(tmp_path / "hits.json"), "--png", str(tmp_path / "hits.png")])
    out = capsys.readouterr()
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
    assert any(line.startswith("| 1.05 | 200,000 | 0.5% | LFU + warm-up |") for line in out.out.splitlines())
    target = [line for line in out.out.splitlines()
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


@pytest.mark.slow
@pytest.mark.bench
def test_throughput_smoke(tmp_path, capsys):
    """The cache at 1% against the device table, interleaved, on the dlrm preset: both
    sides timed, their split reported, the same losses (same weights, same batches). In
    this process."""
    bench_module().main(["throughput", "--smoke", "--json", str(tmp_path / "t.json"), "--png", str(tmp_path / "t.png")])
    out = capsys.readouterr()
    result = json.loads((tmp_path / "t.json").read_text())
    assert {"command", "date", "machine", "git", "model", "batch", "cache_ratio", "windows"} <= set(result["meta"])
    (run,) = result["runs"]
    for side in ("cache", "device"):
        s = run[side]
        assert len(s["samples_per_s_windows"]) == 2 and s["samples_per_s"] > 0 and s["steps_timed"] == 4
        assert 0 < s["prepare_s"] < s["step_time_s"] and 0 < s["device_step_s"] < s["step_time_s"]
    assert run["cache_rows"] == 2000 and run["max_unique_ids_per_batch"] <= 2000
    assert 0 <= run["cache"]["hit_rate"] <= 1 and run["cache"]["misses_per_step"] > 0
    assert run["ratio"] == pytest.approx(run["cache"]["samples_per_s"] / run["device"]["samples_per_s"])
    assert run["max_loss_difference"] < 1e-5  # the cache trains the same model as the device table
    assert any(line.startswith("| 1.05 | cache 1% (2,000 rows) |") for line in out.out.splitlines())
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow  # a peer process
@pytest.mark.bench
def test_torchrec_smoke(tmp_path, capsys):
    """jaxpar (in this process) against the plain-PyTorch peer (a subprocess stepped
    window by window); TorchRec is not tried at the smoke scale, and the JSON says so."""
    pytest.importorskip("torch")
    bench_module().main(["torchrec", "--smoke", "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr()
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["meta"]["peers"] == ["torch"] and not result["meta"]["torchrec_install"]["ok"]
    (run,) = result["runs"]
    assert run["peers"]["torch"]["ready"] and run["peers"]["torch"]["torch"]
    for side in ("jaxpar", "torch"):
        assert run[side]["samples_per_s"] > 0 and run[side]["steps_timed"] == 4
        assert all(0 < loss < 2 for loss in run[side]["losses"])  # BCE of a fresh model: near log 2
    assert run["jaxpar_over_torch"] == pytest.approx(run["jaxpar"]["samples_per_s"] / run["torch"]["samples_per_s"])
    assert any(line.startswith("| 1.05 | PyTorch nn.EmbeddingBag |") for line in out.out.splitlines())


@pytest.mark.slow
@pytest.mark.bench
def test_memory_smoke(tmp_path, capsys):
    """Compile-only bytes on abstract inputs: the cache's device state is 1% of the
    table's, the device table's step holds the whole table, the swap program compiles."""
    bench = bench_module()
    bench.main(["memory", "--smoke", "--json", str(tmp_path / "m.json")])
    shapes = json.loads((tmp_path / "m.json").read_text())["shapes"]
    assert [s["name"] for s in shapes] == ["dlrm", "dlrm, 10^6 rows"]
    for s in shapes:
        cached, whole = s["variants"]
        assert cached["cache_ratio"] == 0.01 and whole["cache_ratio"] is None
        assert cached["embedding_bytes"] == cached["rows_on_device"] * (s["embed_dim"] + 1) * 4
        assert whole["embedding_bytes"] == s["table_and_state_bytes"]
        assert whole["argument_bytes"] >= whole["embedding_bytes"] > 50 * cached["embedding_bytes"]
        assert cached["swap"]["peak_bytes"] > 0 and cached["fits_budget"] and whole["fits_budget"]
    assert "| dlrm, 10^6 rows | 1,000,000 x 16 | whole table |" in capsys.readouterr().out
