"""bench/layouts.py as a newcomer runs it, at the smoke scale (tiny, 2 layers, 3 layouts)."""

import importlib.util
import json
import pathlib
import runpy

import pytest

# Four jaxpar-train dry runs in subprocesses: about 10 s on 2 cores.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.bench
def test_layouts_benchmark(tmp_path, capsys):
    """Every layout is profiled and printed; FSDP holds about an eighth of data
    parallelism's parameter and optimizer bytes; data parallelism only all-reduces
    (gradients) and FSDP also all-gathers (parameters); the picture is a PNG where
    matplotlib, the bench extra, is installed; a layout that cannot compile is one error
    naming it and why."""
    bench = runpy.run_path(str(ROOT / "bench" / "layouts.py"), run_name="bench_layouts")
    png = ["--png", str(tmp_path / "layouts.png")] if importlib.util.find_spec("matplotlib") else []
    bench["main"](["--smoke", "--json", str(tmp_path / "layouts.json"), *png])
    result = json.loads((tmp_path / "layouts.json").read_text())
    assert {"command", "date", "machine", "jax", "devices"} <= set(result["meta"])
    by = {row["layout"]: row["profile"] for row in result["layouts"]}
    assert list(by) == ["data=8", "fsdp=8", "data=2 tensor=4"]
    assert result["layouts"][2]["overrides"] == ["mesh.data=2", "mesh.tensor=4"]

    data, fsdp, tensor = by["data=8"], by["fsdp=8"], by["data=2 tensor=4"]
    assert 0.12 < fsdp["argument_bytes"] / data["argument_bytes"] < 0.14  # 1/8, less the replicated norms + batch
    assert data["collective_bytes"] > 0 and data["collectives"]["all-reduce"] == data["collective_bytes"]
    assert fsdp["collectives"]["all-gather"] > 0 and fsdp["collective_bytes"] > data["collective_bytes"]
    assert fsdp["argument_bytes"] < tensor["argument_bytes"] < data["argument_bytes"]
    for p in by.values():
        assert p["peak_bytes"] >= p["argument_bytes"] + p["temp_bytes"] > 0
        assert p["collective_bytes"] == sum(p["collectives"].values())

    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| layout | argument bytes | temp bytes | peak bytes | collective bytes sent |")
    assert [r.split("|")[1].strip() for r in rows[1:]] == list(by)
    assert rows[1].split("|")[2].strip() == f"{data['argument_bytes']:,}"
    assert not png or (tmp_path / "layouts.png").read_bytes().startswith(b"\x89PNG")

    with pytest.raises(SystemExit, match=r"layout 'tensor=3': the dry run failed \(exit 2\):\n.*does not divide 8"):
        bench["main"](["--config", "tiny", "--set", "model.layers=2", "--layouts", "tensor=3"])
