import jax
import pytest

from jaxpar.models import PRESETS
from jaxpar.train.config import ConfigError, load_config, shipped_configs
from jaxpar.train.loop import build_mesh


@pytest.mark.parametrize("name", ["tiny", "small", "1b"])
def test_every_shipped_config_parses(name):
    cfg = load_config(name)
    assert cfg.steps > 0 and cfg.model.layers > 0
    assert cfg.layout.data is None  # takes the devices the other axes leave


def test_shipped_configs_are_listed():
    assert {"tiny", "small", "1b"} <= set(shipped_configs())


def test_tiny_is_llama_style_float32_200_steps():
    cfg = load_config("tiny")
    assert cfg.steps == 200 and cfg.model.dtype == "float32" and cfg.model.position == "rope"
    assert cfg.model == PRESETS["tiny"]


def test_dotted_overrides_are_typed():
    cfg = load_config("tiny", ["mesh.fsdp=4", "model.layers=2", "steps=30", "run_dir=/tmp/x",
                               "dry_run=true", "optimizer.lr=1e-3", "model.remat_names=[query,key]"])
    assert (cfg.layout.fsdp, cfg.model.layers, cfg.steps, cfg.run_dir, cfg.dry_run) == (4, 2, 30, "/tmp/x", True)
    assert cfg.optimizer.lr == 1e-3 and cfg.layout.remat_names == ("query", "key")
    assert load_config("tiny").model.layers == 4  # the shipped file is untouched


@pytest.mark.parametrize(
    "override,message",
    [
        ("mesh.fdsp=4", r"unknown config key 'mesh.fdsp'; valid keys near it: mesh.fsdp$"),
        ("stpes=3", r"unknown config key 'stpes'; valid keys near it: steps$"),
        ("lr=1e-3", r"unknown config key 'lr'; valid keys near it: optimizer.lr, embedding.lr$"),
        ("model.lyers=2", r"unknown config key 'model.lyers'; valid keys near it: model.layers$"),
        ("mesh.zzz=2", r"unknown config key 'mesh.zzz'; valid keys near it: mesh.data, mesh.fsdp, mesh.expert, mesh.pipe, "
                       r"mesh.seq, mesh.tensor, mesh.axis_types$"),
        ("steps=many", r"steps='many' must be an integer"),
        ("dry_run=3", r"dry_run=3 must be true or false"),
        ("model.norm=batch", r"model.norm='batch' must be one of \['rms', 'layer'\]"),
        ("model.heads=3", r"model.heads=3 must be a multiple of model.kv_heads=2"),
        ("steps", r"override 'steps' must look like key=value"),
        ("mesh.axis_types=manual", r"mesh.axis_types='manual' must be one of \['auto', 'explicit'\]"),
    ],
)
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [override])


def test_yaml_path_and_missing_config(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("steps: 7\nmodel:\n  layers: 1\n")
    cfg = load_config(str(path))
    assert cfg.steps == 7 and cfg.model.layers == 1 and cfg.model.dim == PRESETS["tiny"].dim
    with pytest.raises(ConfigError, match="no config 'huge'; shipped configs: 1b, dlrm, glide, moe_tiny, small, tiny"):
        load_config("huge")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize("override,message", [
    ("steps=0", "steps=0 must be at least 1"),
    ("mesh.fsdp=0", "mesh.fsdp=0 must be at least 1"),
    ("eval.every=-1", "eval.every=-1 must not be negative"),
    ("seq_len=1", "seq_len=1 must be at least 2"),
])
def test_value_ranges(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [override])


def test_data_paths_expand_the_home_directory():
    import os

    cfg = load_config("tiny", ["data.path=~/corpus", "data.tokenizer=~/tokenizer.json"])
    assert cfg.data.path == os.path.expanduser("~/corpus")
    assert cfg.data.tokenizer == os.path.expanduser("~/tokenizer.json")


def test_presets_are_the_one_definition_of_each_model():
    """The shipped configs name jaxpar.models.PRESETS rather than repeating them."""
    import dataclasses

    assert load_config("small").model == PRESETS["small"]
    assert load_config("small").layout.remat == "dots_no_batch"  # the run's layout (small.yaml), not the model's
    assert load_config("1b").model == dataclasses.replace(PRESETS["1b"], vocab_size=32768)
    assert load_config("tiny", ["model=gpt2"]).model == PRESETS["gpt2"]
    assert load_config("tiny", ["model.preset=small", "model.layers=2"]).model == \
        dataclasses.replace(PRESETS["small"], layers=2)
    from jaxpar.models import DLRM_PRESETS  # task dlrm's model section is a DLRMConfig

    assert load_config("dlrm").model == DLRM_PRESETS["dlrm"]
    assert load_config("dlrm", ["model=dlrm_criteo"]).model == DLRM_PRESETS["dlrm_criteo"]
    assert load_config("dlrm", ["model.embed_dim=8", "model.bottom=[32,8]"]).model == \
        dataclasses.replace(DLRM_PRESETS["dlrm"], embed_dim=8, bottom=(32, 8))
    with pytest.raises(ConfigError, match=r"model.preset='huge' is not one of \['1b', 'deepseek_v3_like', 'dlrm', "
                       r"'dlrm_criteo', 'dlrm_criteo_small', 'gpt2', 'mixtral_8x7b', 'moe_tiny', 'qwen3_30b_a3b', "
                       r"'small', 'tiny'\]"):
        load_config("tiny", ["model.preset=huge"])


def test_choice_lists_come_from_the_library():
    import typing

    from jaxpar.kernels.dispatch import IMPLS
    from jaxpar.parallel.pipeline_schedule import KINDS
    from jaxpar.placement.execution import SEQUENCE_IMPLS, SEQUENCE_LAYOUTS
    from jaxpar.layout import Layout
    from jaxpar.train.config import ExecutionConfig

    hints = typing.get_type_hints(ExecutionConfig)
    assert {op: typing.get_args(hints[op]) for op in IMPLS} == IMPLS
    assert typing.get_args(typing.get_type_hints(Layout)["seq_impl"]) == SEQUENCE_IMPLS
    assert typing.get_args(hints["seq_layout"]) == SEQUENCE_LAYOUTS
    assert typing.get_args(typing.get_type_hints(Layout)["schedule"]) == KINDS
    with pytest.raises(ConfigError, match=r"execution.attention='flash' must be one of \['auto', 'xla', 'cudnn', 'pallas'\]"):
        load_config("tiny", ["execution.attention=flash"])


def test_trained_tokenizer_takes_the_model_vocabulary():
    with pytest.raises(ConfigError, match="model.vocab_size=100 must be >= 257 to train a byte-level BPE"):
        load_config("tiny", ["model.vocab_size=100"])
    with pytest.raises(ConfigError, match="unknown config key 'data.vocab_size'"):
        load_config("tiny", ["data.vocab_size=512"])


def test_mesh_axis_types_reach_the_mesh():
    assert load_config("tiny").mesh.axis_types == "auto"
    for value, axis_type in (("auto", jax.sharding.AxisType.Auto), ("explicit", jax.sharding.AxisType.Explicit)):
        mesh = build_mesh(load_config("tiny", ["mesh.fsdp=4", f"mesh.axis_types={value}"]))
        assert dict(mesh.shape)["fsdp"] == 4 and set(mesh.axis_types) == {axis_type}


def test_every_reader_refuses_with_one_input_error_type(tmp_path):
    """One YAML reader (``jaxpar.inputs.read_yaml``) for config files, JOBS.yaml and the
    hardware and device profiles, and one error type every command line exits 2 on: each
    reader's own error is an ``InputError``; invalid YAML is one line with its line."""
    from jaxpar.cluster.jobs import JobsError, load_jobs
    from jaxpar.elastic.traces import TraceError
    from jaxpar.inputs import InputError, read_yaml
    from jaxpar.offload.planner import PlanError as OffloadPlanError
    from jaxpar.planning.devices import ProfileError
    from jaxpar.planning.hardware import HardwareError
    from jaxpar.planning.search import PlanError
    from jaxpar.planning.workload import LayoutError
    from jaxpar.train.weighted import WeightsError

    for error in (ConfigError, JobsError, TraceError, OffloadPlanError, ProfileError, HardwareError, PlanError,
                  LayoutError, WeightsError):
        assert issubclass(error, InputError), error
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb: [2,\n")
    with pytest.raises(InputError, match=rf"^{bad}:3: not valid YAML: expected the node content"):
        read_yaml(bad)
    with pytest.raises(JobsError, match=rf"^{bad}:3: not valid YAML"):
        load_jobs(bad)
    with pytest.raises(ConfigError, match=rf"^{bad}:3: not valid YAML"):
        load_config(str(bad))
    with pytest.raises(InputError, match=r"^'nowhere.yaml' does not exist$"):
        read_yaml("nowhere.yaml")
