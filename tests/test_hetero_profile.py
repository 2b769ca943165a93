"""``pipeline.stage_layers=auto`` (issue 39): the device profile (jaxpar.planning.devices),
the layers per rank and the predicted step time of any split (jaxpar.planning.stages),
and their commands (``jaxpar-plan --profile-devices``, ``pipeline.stage_layers=auto``)."""

import json

import numpy as np
import pytest
import yaml

from jaxpar.hetero import even_split
from jaxpar.planning import devices, hardware, stages
from jaxpar.planning.devices import DeviceProfile, ProfileError
from jaxpar.planning.layout import Layout
from jaxpar.planning.workload import Workload
from jaxpar.train.config import ConfigError, load_config

GIB = 2 ** 30


@pytest.fixture(scope="module")
def h100(tmp_path_factory):
    return hardware.load("h100", tmp_path_factory.mktemp("hw"))


def write(tmp_path, values, name="devices.yaml"):
    path = tmp_path / name
    path.write_text(values if isinstance(values, str) else yaml.safe_dump(values))
    return path


def test_profile_reads_lists_and_indexed_ranks(tmp_path):
    listed = devices.load(write(tmp_path, "ranks: [{speed: 1.0, memory: 80GiB}, {speed: 0.5, memory: 40GiB}]"), 2)
    assert listed.speeds == (1.0, 0.5) and listed.memories == (80 * GIB, 40 * GIB)
    indexed = devices.load(write(tmp_path, {"ranks": {1: {"speed": 2}, 0: {"speed": 1, "memory": 1000}}}))
    assert indexed.speeds == (1.0, 2.0) and indexed.memories == (1000, None)  # absent memory: unbounded
    saved = tmp_path / "again.yaml"
    devices.save(listed, saved, header="a comment")
    assert saved.read_text().startswith("# a comment\n")
    assert devices.load(saved).speeds == listed.speeds and devices.load(saved).memories == listed.memories


@pytest.mark.parametrize("text, pipe, message", [
    ("ranks: [{speed: 1.0}]", 2, "lists 1 rank for mesh.pipe=2: give one entry per pipeline rank"),
    ("ranks: [{speed: 1}, {speed: 1}, {speed: 1}]", 2, "lists 3 ranks for mesh.pipe=2"),
    ("ranks: {0: {speed: 1}, 2: {speed: 1}}", None, "rank 1 is missing (ranks listed: 0, 2)"),
    ("ranks: [{speed: 1}, {speed: 0}]", None, "ranks[1].speed=0 must be a positive number"),
    ("ranks: [{speed: -0.5}]", None, "ranks[0].speed=-0.5 must be a positive number"),
    ("ranks: [{speed: fast}]", None, "ranks[0].speed='fast' must be a positive number"),
    ("ranks: [{speed: 1, memory: 16G}]", None, "ranks[0].memory='16G' is not a byte count"),
    ("ranks: [{speed: 1, memory: 0}]", None, "ranks[0].memory=0 must be positive"),
    ("ranks: [{memory: 16GiB}]", None, "ranks[0] gives no speed"),
    ("ranks: [{speed: 1, sped: 2}]", None, "unknown field(s) sped"),
    ("ranks: [1.0, 0.5]", None, "ranks[0]=1.0 must be a mapping of speed, memory, device"),
    ("devices: []", None, "a device profile is a mapping with ranks"),
    ("ranks: [{speed: 1}\n", None, "not valid YAML"),
])
def test_bad_profile_is_one_line(tmp_path, text, pipe, message):
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as error:
        devices.load(path, pipe)
    assert message in str(error.value) and str(path) in str(error.value) and "\n" not in str(error.value)
    assert isinstance(error.value, ValueError)


def test_missing_profile_file(tmp_path):
    with pytest.raises(ProfileError, match="pipeline.device_profile=.*nowhere.yaml' does not exist"):
        devices.load(tmp_path / "nowhere.yaml")


def test_schedule_simulation_by_hand():
    # 2 stages, 2 microbatches, forwards 1 and 2, backwards 2 and 4: both schedules run
    # F0 F0 | F1 F1 B1 B1 | B0 B0 on the critical path: 15, (M - 1) max + sum = 1 x 6 + 9.
    for kind in ("gpipe", "1f1b"):
        assert stages.simulate(kind, 2, [1, 2], [2, 4]) == 15
    # GPipe with sends of 0.5: four of the six ticks send (the last stage's forwards and
    # the first stage's backwards send nothing): 15 + 4 x 0.5.
    assert stages.simulate("gpipe", 2, [1, 2], [2, 4], send=0.5) == 17
    # equal stages: GPipe (M + P - 1)(f + b), 1F1B 2 (M + P - 1) ticks of 1 where f = b = 1
    assert stages.simulate("gpipe", 8, [1] * 4, [2] * 4) == 11 * 3
    assert stages.simulate("1f1b", 8, [1] * 4, [1] * 4) == 2 * 11


def tiny_model(h100, **layout):
    cfg = load_config("tiny", ["model.layers=8"])
    work = Workload(cfg.model, cfg.batch_size, cfg.seq_len)
    return work, Layout(**{"pipe": 2, "microbatches": 4, **layout})


def test_auto_beats_even_on_a_2x_slower_rank(h100):
    work, layout = tiny_model(h100)
    model = stages.stage_model(work, layout, h100, devices_per_node=8)
    assert model.head_time > model.layer_time > 0 and model.layer_saved > 0 and model.layer_state > 0
    for speeds in ((1.0, 0.5), (1.0, 1.0)):  # with equal ranks the head on the last one moves layers off it
        result = stages.compare(DeviceProfile(speeds, (None, None)), model)
        best = min(((k, 8 - k) for k in range(1, 8)), key=lambda split: model.step_time(split, speeds))
        assert result["stage_layers"] == list(best) and result["even_stage_layers"] == [4, 4]
        assert result["auto_step_s"] == model.step_time(best, speeds) < result["even_step_s"]
    slow_last = stages.compare(DeviceProfile((1.0, 0.5), (None, None)), model)
    assert slow_last["stage_layers"] == [7, 1] and slow_last["speedup"] > 1.5
    assert stages.resolve_stage_layers(DeviceProfile((1.0, 0.5), (None, None)), work, layout, h100,
                                       devices_per_node=8) == (7, 1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_even_split_memory_is_the_memory_model(h100, schedule):
    """The per-rank bytes of the even split are the memory model's own figure (its
    busiest rank: the one with the most stage inputs in flight)."""
    from jaxpar.planning import memory

    work, layout = tiny_model(h100, data=2, schedule=schedule)
    model = stages.stage_model(work, layout, h100, devices_per_node=8)
    assert model.memory(even_split(8, 2)).max() == pytest.approx(memory.estimate(work, layout)["device"], rel=1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_auto_is_never_predicted_slower_than_even(seed):
    """Random figures, speeds and memories (some binding): auto's predicted step is at
    most even's wherever even fits, and auto always fits."""
    rng = np.random.default_rng(seed)
    P = int(rng.integers(2, 6))
    L = P * int(rng.integers(1, 6))
    fixed = tuple(rng.uniform(1.0, 2.0, P))
    model = stages.StageModel(str(rng.choice(["gpipe", "1f1b"])), P, int(P * rng.integers(1, 4)), L,
                              layer_time=1.0, head_time=float(rng.uniform(0, 3)), send_time=float(rng.uniform(0, 0.2)),
                              layer_state=float(rng.uniform(0.1, 1.0)), layer_saved=float(rng.uniform(0.1, 1.0)),
                              fixed=fixed)
    speeds = tuple(float(s) for s in rng.choice([0.25, 0.5, 1.0, 2.0], P))
    even = even_split(L, P)
    memories = tuple(None if rng.uniform() < 0.3 else float(m)
                     for m in model.memory(even) * rng.uniform(0.8, 1.6, P))
    try:
        auto = stages.allocate_stages(model, speeds, memories)
    except ProfileError:
        assert not model.fits(even, memories)
        return
    assert sum(auto) == L and min(auto) >= 1 and model.fits(auto, memories)
    if model.fits(even, memories):
        assert model.step_time(auto, speeds) <= model.step_time(even, speeds)


def test_memory_refusals_are_one_line(h100):
    work, layout = tiny_model(h100)
    model = stages.stage_model(work, layout, h100, devices_per_node=8)
    one = model.fixed[1] + model.layer_state + model.layer_saved
    with pytest.raises(ProfileError, match=r"devices.yaml: rank 1's memory \(.*\) holds no stage: one layer needs"):
        stages.allocate_stages(model, (1.0, 1.0), (None, int(one * 0.99)), "devices.yaml")
    tight = model.memory(even_split(8, 2)) * 0.95  # each rank holds a layer, the 8 fit nowhere
    with pytest.raises(ProfileError, match="no split of 8 layers over 2 pipeline ranks fits their memory") as error:
        stages.allocate_stages(model, (1.0, 1.0), tuple(tight))
    assert "\n" not in str(error.value)
    with pytest.raises(ProfileError, match="needs pipeline.virtual_stages=1, got 2"):
        stages.stage_model(work, Layout(pipe=2, microbatches=4, schedule="interleaved", virtual_stages=2), h100,
                           devices_per_node=8)


def plan_cli(capsys, *args):
    from jaxpar.commands.plan import main

    try:
        code = main([*map(str, args)])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_jaxpar_plan_shows_even_and_auto(capsys, tmp_path):
    profile = write(tmp_path, "ranks: [{speed: 1.0, memory: 80GiB}, {speed: 0.5, memory: 40GiB}]")
    common = ("tiny", "devices=8", "mesh.pipe=2", "plan.compile_top=0", "pipeline.stage_layers=auto",
              "--cache-dir", tmp_path)
    code, out, err = plan_cli(capsys, *common, f"pipeline.device_profile={profile}", "--json")
    assert code == 0, err
    split = json.loads(out)["pipeline_stages"]
    assert split["stage_layers"] == [3, 1] and split["even_stage_layers"] == [2, 2]
    assert split["auto_step_s"] < split["even_step_s"]
    code, out, err = plan_cli(capsys, *common, f"pipeline.device_profile={profile}", "--top", "1")
    assert code == 0 and "pipeline.stage_layers=auto from" in out and "auto 1." in out
    bad = write(tmp_path, "ranks: [{speed: 1.0}, {speed: -1}]", "bad.yaml")
    code, out, err = plan_cli(capsys, *common, f"pipeline.device_profile={bad}")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "ranks[1].speed=-1 must be a positive number" in err


def test_the_run_resolves_auto(tmp_path):
    """What the trainer calls for ``pipeline.stage_layers=auto`` (8 simulated devices: data 4 x pipe 2)."""
    from jaxpar.train.plan import auto_stage_layers

    profile = write(tmp_path, "ranks: [{speed: 1.0}, {speed: 0.5}]")
    cfg = load_config("tiny", ["mesh.pipe=2", "pipeline.stage_layers=auto", f"pipeline.device_profile={profile}",
                               f"cache_dir={tmp_path}"])
    assert auto_stage_layers(cfg) == (3, 1)
    cfg = load_config("tiny", ["mesh.pipe=4", "pipeline.stage_layers=auto", f"pipeline.device_profile={profile}",
                               f"cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="lists 2 ranks for mesh.pipe=4"):
        auto_stage_layers(cfg)


def test_profile_devices_writes_a_loadable_profile(capsys, tmp_path):
    out_file = tmp_path / "devices.yaml"
    code, out, err = plan_cli(capsys, "--profile-devices", "model.layers=1", "batch_size=2", "seq_len=16",
                              "--out", out_file, "--cache-dir", tmp_path)
    assert code == 0, err
    profile = devices.load(out_file, 8)  # conftest's 8 simulated CPU devices, one rank each
    assert max(profile.speeds) == 1.0 and min(profile.speeds) > 0
    assert profile.memories == (None,) * 8  # XLA:CPU does not say
    assert out.endswith(out_file.read_text().split("ranks:")[1])


@pytest.mark.slow
def test_bench_table_and_picture(monkeypatch, tmp_path, h100):
    """bench/hetero_allocation.py on one of its clusters: a row per schedule and M, auto
    never predicted slower, and the picture drawn."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "hetero_allocation.py"
    spec = importlib.util.spec_from_file_location("hetero_allocation_bench", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclass looks its module up
    spec.loader.exec_module(bench)
    cluster = next(c for c in bench.CLUSTERS if c.name == "8 ranks, half slow")
    monkeypatch.setattr(bench, "CLUSTERS", (cluster,))
    monkeypatch.setattr(bench, "PICTURED", (cluster.name,))
    rows = bench.run(h100)
    assert len(rows) == len(bench.SCHEDULES) * len(bench.MICROBATCHES)
    assert all(r["speedup"] >= 1.0 and sum(r["stage_layers"]) == 160 for r in rows)
    assert "| 8 ranks, half slow | BERT-160 | gpipe | 16 |" in bench.table(rows)
    bench.draw(rows, tmp_path / "allocation.png")
    assert (tmp_path / "allocation.png").stat().st_size > 10_000
