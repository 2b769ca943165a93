"""bench/plan_memory.py, bench/plan_memory_explain.py, bench/plan_published.py and
bench/moe_published.py as a newcomer runs them, at the smoke scale: the JSON has every
field with finite numbers, the table is printed and the picture is a PNG."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def run_here(capsys, script: str, *args: str) -> str:
    """``script``'s ``main(args)`` in this process (no interpreter and JAX start), bench/
    first on ``sys.path`` as for the script: its standard output."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{pathlib.Path(script).stem}", ROOT / "bench" / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        capsys.readouterr()
        module.main(list(args))
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return capsys.readouterr().out


def finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


@pytest.mark.slow  # three candidates compiled in a subprocess: about 25 s on 2 cores
@pytest.mark.bench
def test_plan_memory_smoke(tmp_path, capsys):
    """Three sampled candidates of tiny (2 layers) on 8 simulated devices are compiled and
    compared with the analytic estimate; the parameters, optimizer state and batch (the
    compiled arguments) are exact."""
    png = tmp_path / "plan_memory.png"
    out = run("plan_memory.py", "--smoke", "--json", str(tmp_path / "plan_memory.json"),
              *(["--png", str(png)] if importlib.util.find_spec("matplotlib") else []))
    result = json.loads((tmp_path / "plan_memory.json").read_text())
    assert {"command", "date", "machine", "jax", "planner_sources_sha256"} <= set(result["meta"])
    rows = result["rows"]
    assert len(rows) == 3 and all("error" not in r for r in rows)
    assert len({r["mesh_kind"] for r in rows}) == 3 and len({r["remat"] for r in rows}) == 3  # stratified
    for r in rows:
        assert {"config", "devices", "overrides", "describe", "compiled", "estimated", "compiled_peak",
                "estimated_device", "relative_error", "argument_error"} <= set(r)
        assert r["config"] == "tiny" and r["devices"] == 8 and r["overrides"]["mesh.data"] >= 1
        c = r["compiled"]
        assert r["compiled_peak"] == c["argument_bytes"] + c["output_bytes"] - c["alias_bytes"] + c["temp_bytes"]
        assert finite(r["compiled_peak"], r["estimated_device"], r["relative_error"], *r["estimated"].values())
        assert abs(r["argument_error"]) < 1e-3  # params + optimizer + batch: exact up to the step counter
        assert abs(r["relative_error"]) < 1  # within a factor of two
    (summary,) = result["summary"]
    assert summary["compiled"] == 3 and summary["candidates"] > 100
    assert finite(summary["median_abs_error"], summary["p90_abs_error"], summary["within_5pct"],
                  summary["max_abs_argument_error"], summary["worst"]["relative_error"])
    assert summary["worst"]["largest_temporary_part"] in ("gradients", "activations", "workspace")
    lines = [line for line in out.stdout.splitlines() if line.startswith("| tiny | 8 |")]
    assert len(lines) == 1
    assert not importlib.util.find_spec("matplotlib") or png.read_bytes().startswith(b"\x89PNG")

    # --from: the same compiled figures re-estimated (nothing compiled): the same errors.
    run_here(capsys, "plan_memory.py", "--from", str(tmp_path / "plan_memory.json"), "--json",
             str(tmp_path / "again.json"))
    again = json.loads((tmp_path / "again.json").read_text())
    assert [r["relative_error"] for r in again["rows"]] == [r["relative_error"] for r in rows]
    assert again["meta"]["compiled_in"].startswith("python ")


@pytest.mark.slow
def test_plan_published_no_rank(tmp_path, capsys):
    """Every usable published run is predicted (finite step time, MFU and split); the FP8
    rows and the 175B estimate without a layout are skipped with a reason."""
    out = run_here(capsys, "plan_published.py", "--no-rank", "--json", str(tmp_path / "plan_published.json"))
    result = json.loads((tmp_path / "plan_published.json").read_text())
    assert {"command", "date", "machine", "jax", "mfu_convention"} <= set(result["meta"])
    names = {r["name"] for r in result["runs"]}
    assert {"megatron-gpt-1t-table1-3072gpu", "megatron-gpt3-175b-ptdp-1536gpu", "llama3-405b-8k-8192gpu",
            "llama3-405b-8k-16384gpu", "llama3-405b-128k-16384gpu", "llama3-70b-automodel-fsdp2-bf16-64gpu"} <= names
    skipped = {s["name"]: s["reason"] for s in result["skipped"]}
    assert "megatron-gpt3-175b-1024gpu-estimate" in skipped
    assert all("FP8" in why for name, why in skipped.items() if "fp8" in name) and len(skipped) == 4
    for r in result["runs"]:
        rep, pred = r["reported"], r["predicted"]
        assert finite(rep["step_s"], rep["mfu_jaxpar"], pred["step_s"], pred["mfu"], r["mfu_relative_error"],
                      *pred["split_s"].values())
        assert 0 < rep["mfu_jaxpar"] < 1 and 0 < pred["mfu"] < 1
        assert math.isclose(pred["step_s"], sum(pred["split_s"].values()), rel_tol=1e-9)
        assert "rank" not in r
    one_t = next(r for r in result["runs"] if r["name"] == "megatron-gpt-1t-table1-3072gpu")
    assert math.isclose(one_t["reported"]["step_s"], 102.63, rel_tol=2e-3)  # Eq. 3, as the YAML derives it
    assert one_t["layout"]["overrides"]["mesh.data"] == 6 and one_t["layout"]["overrides"]["mesh.fsdp"] == 1
    llama = next(r for r in result["runs"] if r["name"] == "llama3-405b-8k-8192gpu")
    assert llama["layout"]["overrides"]["mesh.fsdp"] == 64 and llama["assumptions"]
    assert math.isclose(llama["reported"]["mfu_jaxpar"], 430 / 989, rel_tol=1e-3)  # PaLM's count is jaxpar's
    assert [line for line in out.splitlines() if line.startswith("| megatron-gpt-1t-table1-3072gpu |")]
    # Megatron-LM 2021's stack: one compute rate fitted on its 1.7B run, the gradient
    # all-reduce exposed; the twelve other runs (Table 1's and Table 2's layouts, with
    # their pipelines, interleaving and tensor traffic) within 15%, where the shipped
    # profile (today's kernels) is 15% optimistic or more on every one.
    megatron = [r for r in result["runs"] if r.get("stack", {}).get("name") == "megatron-lm-2021"]
    assert len(megatron) == 13 and 0.5 < megatron[0]["stack"]["rate"] < 1
    fit = [r for r in megatron if r["name"] == r["stack"]["fit_run"]]
    assert len(fit) == 1 and abs(fit[0]["mfu_relative_error"]) < 1e-6
    for r in megatron:
        assert r["mfu_relative_error_shipped"] > 0.15, r["name"]
        assert abs(r["mfu_relative_error"]) < 0.15, (r["name"], r["mfu_relative_error"])


@pytest.mark.slow
def test_plan_published_rank(tmp_path, capsys):
    """The planner's search places the published layout (found among its candidates, or
    inserted where the bounds leave it out) and names its top choice (two analytic
    searches, on 32 and 64 devices: about 5 s)."""
    run_here(capsys, "plan_published.py", "--runs", "megatron-gpt-1.7b-table1-32gpu",
             "llama3-70b-automodel-fsdp2-bf16-64gpu", "--json", str(tmp_path / "p.json"))
    result = json.loads((tmp_path / "p.json").read_text())
    assert len(result["runs"]) == 2
    for r in result["runs"]:
        k = r["rank"]
        assert k["kept"] > 1000 and 1 <= k["published"]["rank"] <= k["kept"] + 1
        assert finite(k["top"]["step_s"], k["top"]["mfu"], *k["top"]["split_s"].values())
        assert k["top"]["step_s"] <= r["predicted"]["step_s"] or not r["predicted"]["fits_80gib"]
        assert r["why_top_faster"]


def test_moe_published_mixtral_within_15_percent(tmp_path, capsys):
    """bench/moe_published.py (analytic, about a second without its ranking): Megatron-Core's
    Mixtral 8x7B layout on 64 H100s is predicted within 15% of its published 468 TFLOP/s
    (BENCHMARKS.md: +8%), each run's assumptions and differences listed; the DeepSeek-V3
    row's miss (FP8, node-limited routing, the worst-case receive buffer) is the table's
    to state, not held here."""
    out = run_here(capsys, "moe_published.py", "--no-rank", "--json", str(tmp_path / "moe.json"))
    runs = {r["name"]: r for r in json.loads((tmp_path / "moe.json").read_text())["runs"]}
    mixtral = runs["Mixtral 8x7B, Megatron-Core"]
    assert abs(mixtral["mfu_relative_error"]) < 0.15 and mixtral["predicted"]["fits_80gib"]
    assert all(r["assumptions"] and r["differs"] for r in runs.values())
    assert all(finite(r["predicted"]["step_s"], r["reported"]["step_s"]) for r in runs.values())
    assert out.count("| ") >= 2


@pytest.mark.bench
def test_plan_memory_explain_names_the_peaks_buffers(tmp_path):
    """bench/plan_memory_explain.py on one tiny layout: the estimate's parts, the compiled
    peak and XLA's live values at the peak by operation, largest first."""
    out = run("plan_memory_explain.py", "tiny", "8", "data=2 seq=2 tensor=2 rsa sp remat=full ga=2",
              "--json", str(tmp_path / "explain.json")).stdout
    row = json.loads((tmp_path / "explain.json").read_text())["rows"][0]
    assert row["layout"] == "data=2 seq=2 tensor=2 rsa sp remat=full ga=2" and finite(row["error"])
    sizes = [n for _, n in row["peak_by_operation"]]
    assert sizes and sizes == sorted(sizes, reverse=True) and "MiB" in out
