"""bench/moe.py without running it (its runs take minutes): the whole-model extrapolation
on a hand case, and BENCHMARKS.md's compile-only tables are what the script renders from
the committed JSON (``--from-json``), the CPU picture redrawn from its JSON."""

import importlib.util
import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_moe_benchmark_tables_are_its_results(tmp_path, capsys):
    bench = runpy.run_path(str(ROOT / "bench" / "moe.py"), run_name="bench_moe")
    one = {"argument_bytes": 10, "collective_bytes": 5, "collectives": {"all-to-all": 1}}
    two = {"argument_bytes": 13, "collective_bytes": 9, "collectives": {"all-to-all": 3, "all-gather": 1}}
    assert bench["whole"]({1: one, 2: two}, 32) == {
        "layers": 32, "argument_bytes": 10 + 31 * 3, "collective_bytes": 5 + 31 * 4,
        "collectives": {"all-to-all": 1 + 31 * 2, "all-gather": 31}, "per_layer_collective_bytes": 4}
    assert bench["whole"]({2: two}, 32) is None

    documented = (ROOT / "BENCHMARKS.md").read_text()
    for devices in (64, 256):
        out = tmp_path / f"{devices}.md"
        bench["main"](["compile", "--from-json", str(ROOT / f"bench/results/moe_compile_{devices}.json"),
                       "--markdown", str(out)])
        table = out.read_text().strip()
        assert table.count("\n") >= 3 and table in documented
    png = ["--png", str(tmp_path / "moe.png")] if importlib.util.find_spec("matplotlib") else []
    bench["main"](["cpu", "--from-json", str(ROOT / "bench/results/moe_cpu.json"), *png])
    printed = capsys.readouterr().out
    assert all(name in printed for name in bench["RUNS"])
    assert not png or (tmp_path / "moe.png").read_bytes()[:4] == b"\x89PNG"
