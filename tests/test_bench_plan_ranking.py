"""bench/plan_ranking.py: its statistics and choice of layouts on their own, the whole
script on a made-up plan (no subprocesses), and as a newcomer runs it at the smoke scale
(jaxpar-plan, then three short jaxpar-train runs)."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None

# A calibrated cpu profile (jaxpar-plan --calibrate's fields, a 2-core machine's
# figures): the test run's cache has none, and calibrating takes a minute.
PROFILE = """name: cpu
peak_flops: {float32: 46.1e9, bfloat16: 41.0e9}
efficiency: {matmul: 1.0, attention: 0.33}
hbm_bandwidth: 7.2e9
memory: 3159563776
intra_node_bandwidth: 2.7e9
inter_node_bandwidth: 2.7e9
collective_latency: 1.4e-4
host_bandwidth: 2.26e9
comm_overlap: 0.0
"""


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_plan_ranking", ROOT / "bench" / "plan_ranking.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ranks_average_ties(bench):
    np.testing.assert_array_equal(bench.ranks([3.0, 1.0, 2.0]), [3, 1, 2])
    np.testing.assert_array_equal(bench.ranks([2.0, 1.0, 2.0, 5.0, 2.0]), [3, 1, 3, 5, 3])
    np.testing.assert_array_equal(bench.ranks([0.4, 0.4]), [1.5, 1.5])


def test_spearman(bench):
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [9, 3, 2, 1]) == pytest.approx(-1.0)
    # Monotone, not linear: still 1.
    assert bench.spearman([1, 2, 3, 4, 5], [1, 4, 9, 100, 1e4]) == pytest.approx(1.0)
    # With ties: Pearson's r of the average ranks [1.5, 1.5, 3, 4] and [1, 3, 2, 4].
    a, b = np.array([1.5, 1.5, 3, 4]), np.array([1, 3, 2, 4.0])
    assert bench.spearman([1, 1, 2, 3], [10, 30, 20, 40]) == pytest.approx(np.corrcoef(a, b)[0, 1])
    assert bench.spearman([1, 2], [2, 1]) is None  # too few
    assert bench.spearman([1, 1, 1], [1, 2, 3]) is None  # one side constant


def _candidate(i, fits=True, params="device", optimizer="device", time=None):
    return {"layout": f"layout{i}", "fits": fits, "step_time_s": time or 0.1 + 0.01 * i,
            "memory_bytes": 1000 + i, "memory_source": "compiled" if i < 3 else "analytic",
            "split": {"compute": 0.1, "communication": 0.0, "bubble": 0.0, "offload": 0.0},
            "overrides": {"mesh.data": 8, "mesh.tensor": 1, "execution.sequence_parallel": False,
                          "offload.params": params, "offload.optimizer": optimizer}}


def test_choose_top_then_one_per_slice(bench):
    """The best ``top`` that fit and stay on the device, then one from each of
    ``sample`` equal slices of the rest, the same for the same seed."""
    candidates = [_candidate(i) for i in range(40)]
    candidates[1] = _candidate(1, params="host")
    candidates[2] = _candidate(2, optimizer="host")
    candidates[3] = _candidate(3, fits=False)
    chosen = bench.choose(candidates, 3, 4, seed=0)
    assert [c["rank"] for c in chosen[:3]] == [1, 5, 6]  # ranks among all candidates, 1-based
    assert [c["pick"] for c in chosen] == ["top"] * 3 + ["sample"] * 4
    rest = [r for r in range(7, 41)]  # 34 eligible left: slices of 9, 9, 8, 8
    slices = [rest[:9], rest[9:18], rest[18:26], rest[26:]]
    assert all(c["rank"] in part for c, part in zip(chosen[3:], slices))
    assert chosen == bench.choose(candidates, 3, 4, seed=0)
    assert all(bench.on_device(c) and c["fits"] for c in chosen)
    assert len(bench.choose(candidates[:6], 3, 10)) == 3  # nothing left to sample


def test_setting(bench):
    assert bench.setting("mesh.tensor", [2, 2]) == "mesh.tensor=[2,2]"
    assert bench.setting("execution.sequence_parallel", False) == "execution.sequence_parallel=false"
    assert bench.setting("model.remat", "dots") == "model.remat=dots"
    assert bench.setting("mesh.fsdp", 8) == "mesh.fsdp=8"


@pytest.mark.slow
@pytest.mark.bench
def test_smoke(bench, tmp_path, capsys):
    """The smoke scale for real (64 tokens x 8 rows a step): jaxpar-plan ranks tiny's
    layouts, the top two and one sampled time three steps each; a layout that cannot
    run is one error line, and the run goes on."""
    profile = tmp_path / "cpu.yaml"
    profile.write_text(PROFILE)
    png = ["--png", str(tmp_path / "ranking.png")] if HAS_MPL else []
    # --seed: the sample lands on the plan's third eligible layout, one of those it compiled
    # (tiny's ranking today), so its run reads its program from the compilation cache;
    # seed 0 drew a 16-microbatch pipeline whose steps took a third of the test's time.
    out = bench.main(["--smoke", "--seed", "5945", "--hardware", str(profile), "--json", str(tmp_path / "r.json"),
                      *png])
    rows = out["rows"]
    assert [r["pick"] for r in rows] == ["top", "top", "sample"]
    assert rows[0]["rank"] < rows[1]["rank"] < rows[2]["rank"]
    for r in rows:
        assert r["error"] is None, r
        assert r["overrides"]["offload.params"] == r["overrides"]["offload.optimizer"] == "device"
        assert len(r["step_times_s"]) == 3 and r["measured_s"] == pytest.approx(np.median(r["step_times_s"]))
        assert r["predicted_s"] > 0 and r["layout"]
    s = out["summary"]
    assert s["measured"] == 3 and -1 <= s["spearman"] <= 1 and s["top_choice_ratio"] >= 1
    assert out["meta"]["seq_len"] == 64 and out["meta"]["batch_size"] == 8 and out["meta"]["steps"] == 3
    assert out["meta"]["hardware_profile"]["path"] == str(profile)
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split("|")[3].strip() for line in table[1:]] == [r["layout"] for r in rows]
    assert not png or (tmp_path / "ranking.png").read_bytes().startswith(b"\x89PNG")

    bad = bench.measure("tiny", ["model.layers=2"], {"mesh.tensor": 3}, 3, 8)
    assert bad["measured_s"] is None and bad["error"].startswith("exit 1: ") and "divide" in bad["error"], bad


def test_repeated_passes_combine_and_agree(bench):
    """``--repeat``: a layout's passes become one row (their median; a failed pass
    fails the row), and each later pass is ranked against the first."""
    ok = lambda s: {"measured_s": s, "step_times_s": [s, s], "seconds": 2.0, "error": None}  # noqa: E731
    row = bench.combined([ok(3.0), ok(1.0), ok(2.0)])
    assert row["measured_s"] == 2.0 and row["passes_s"] == [3.0, 1.0, 2.0] and row["seconds"] == 6.0
    failed = bench.combined([ok(1.0), {"measured_s": None, "step_times_s": [], "seconds": 1.0, "error": "exit 1: x"}])
    assert failed["measured_s"] is None and failed["error"] == "exit 1: x"
    rows = [{"passes_s": [1.0, 1.1, 3.0]}, {"passes_s": [2.0, 2.2, 2.0]}, {"passes_s": [3.0, 3.3, 1.0]},
            {"passes_s": [4.0, None, 4.0]}]  # the last is left out: a pass failed
    assert bench.repeatability(rows) == [pytest.approx(1.0), pytest.approx(-1.0)]
    assert bench.repeatability([{"passes_s": [1.0]}]) == []
