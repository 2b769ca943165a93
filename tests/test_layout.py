"""One description of a parallel layout (``jaxpar.layout.Layout``): a config's layout
keys read into it and written back under the same keys (``to_dict``, ``jaxpar-plan
--out``), the planner's candidates are the same type, and the step's ``Execution``
takes its sequence options from it."""

import dataclasses
import typing

import yaml

from jaxpar.commands.plan import overlay
from jaxpar.layout import KEYS, PLANNED, Layout, from_overrides
from jaxpar.planning.layout import Space, enumerate_layouts
from jaxpar.train import config_load
from jaxpar.train.config import Config, load_config, to_dict

# Every layout key set, most off their defaults (mesh: 2 x 2 x 2 = the 8 simulated devices).
EVERY_KEY = {"mesh.data": 1, "mesh.fsdp": 2, "mesh.expert": 1, "mesh.pipe": 2, "mesh.seq": 1, "mesh.tensor": 2,
             "pipeline.schedule": "gpipe", "pipeline.microbatches": 4, "pipeline.virtual_stages": 2,
             "execution.seq_impl": "ulysses", "execution.sequence_parallel": True,
             "model.remat": "names", "model.remat_names": ["query", "key"], "optimizer.grad_accum": 1,
             "optimizer.reduction": "adasum", "optimizer.compression": "dct_topk",
             "offload.params": "auto", "offload.optimizer": "host"}


def every_key_config(**extra):
    return load_config("tiny", [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"
                                for k, v in {**EVERY_KEY, **extra}.items()])


def test_the_table_names_every_field_once_and_the_config_reads_each():
    assert list(KEYS) == [f.name for f in dataclasses.fields(Layout)]
    assert len(set(KEYS.values())) == len(KEYS) and set(PLANNED) <= set(KEYS)
    assert set(KEYS.values()) <= set(config_load._keys(Config))  # what an unknown key's message offers
    cfg = every_key_config()
    assert set(cfg.layout.settings()) == set(EVERY_KEY), "a layout key this test does not set: add it to EVERY_KEY"
    assert cfg.layout.settings() == EVERY_KEY
    assert from_overrides(cfg.layout.settings()) == cfg.layout
    hints = typing.get_type_hints(Layout)  # and a bad value is named by its public key
    assert typing.get_args(hints["remat"]) == ("none", "full", "dots", "dots_no_batch", "names")


def test_a_config_round_trips_through_to_dict(tmp_path):
    cfg = every_key_config()
    saved = to_dict(cfg)
    for key, value in EVERY_KEY.items():  # a run's config.yaml keeps the public sections
        section, leaf = key.split(".")
        assert saved[section][leaf] == (tuple(value) if isinstance(value, list) else value), key
    assert "layout" not in saved
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved, sort_keys=False))  # as the trainer writes config.yaml
    assert load_config(str(path)) == cfg
    auto = load_config("tiny", ["mesh=auto", "model.remat=full"])
    path.write_text(yaml.safe_dump(to_dict(auto), sort_keys=False))
    assert load_config(str(path)) == auto


def test_a_plan_overlay_reloads_the_layout_the_planner_chose(tmp_path):
    """What ``jaxpar-plan --out`` writes (``overlay``) over the config it planned for
    reloads to that config with the candidate's layout: the candidates start from the
    config's own layout, so what the planner does not choose (the reduction) carries."""
    # What the config sets beyond the planner's choices, and choices it makes otherwise
    # (a pipeline's microbatches, Ulysses): the overlay must write those back too.
    sets = ["optimizer.reduction=adasum", "model.remat_names=[key]", "mesh.fsdp=4", "pipeline.microbatches=4",
            "execution.seq_impl=ulysses", "offload.params=auto"]
    base = load_config("tiny", sets)
    layouts, _ = enumerate_layouts(8, base.model, base.batch_size, base.seq_len, space=Space(base=base.layout))
    picked = [layouts[0], layouts[len(layouts) // 2], layouts[-1],
              next(l for l in layouts if l.pipe > 1), next(l for l in layouts if l.seq > 1)]
    for layout in picked:
        assert (layout.reduction, layout.remat_names) == ("adasum", ("key",))
        path = tmp_path / "plan.yaml"
        path.write_text(yaml.safe_dump(overlay(layout), sort_keys=False))
        assert load_config("tiny", [*sets, str(path)]) == dataclasses.replace(base, layout=layout), layout.describe()


def test_the_step_execution_comes_from_the_layout():
    from jaxpar.train.plan import _built_step

    cfg = load_config("tiny", ["model.layers=2", "execution.seq_layout=natural"])
    for layout in (Layout(data=2, seq=2, tensor=2, seq_impl="ulysses", sequence_parallel=True),
                   Layout(data=4, seq=2, seq_impl="rsa")):
        run, mesh, rules, step, _, _ = _built_step(cfg, layout, None)
        assert run.layout == layout and dict(mesh.shape) == layout.mesh_sizes
        assert step.execution.sequence == layout.sequence("natural")
        assert (step.execution.sequence.impl, step.execution.sequence.layout) == (layout.seq_impl, "natural")
        norms = dict(rules)["activation_norm_length"]  # Megatron sequence parallelism splits them over tensor
        assert ("tensor" in (norms if isinstance(norms, tuple) else (norms,))) == layout.sequence_parallel


def test_the_model_a_run_builds_takes_the_layouts_remat():
    """Remat is the model's argument (it changes the program, not the weights), and a run
    passes its layout's: the model config holds none (one copy)."""
    from flax import nnx

    from jaxpar.models import Remat
    from jaxpar.train.tasks import build_model

    cfg = load_config("tiny", ["model.remat=names", "model.remat_names=[key,value]", "model.layers=1"])
    assert not hasattr(cfg.model, "remat") and not hasattr(cfg.model, "remat_names")
    assert nnx.eval_shape(lambda: build_model(cfg)).remat == Remat("names", ("key", "value"))
    assert nnx.eval_shape(lambda: build_model(load_config("small", ["model.layers=1"]))).remat == Remat("dots_no_batch")


def test_the_planner_keeps_a_configs_expert_axis_and_plans_the_devices_it_leaves():
    """``mesh.expert`` is not enumerated: every candidate keeps the config's, and the other
    axes share the 8 devices it leaves (4 each), the batch split over it too."""
    cfg = load_config("moe_tiny", ["mesh.expert=2"])
    layouts, _ = enumerate_layouts(8, cfg.model, cfg.batch_size, cfg.seq_len,
                                   space=Space(base=cfg.layout, remats=("none",), offload=False))
    assert layouts and all(layout.expert == 2 and layout.devices == 8 for layout in layouts)
    assert {layout.data_ways for layout in layouts if layout.fsdp == 2 and layout.data == 2} == {8}
    assert Layout(data=2, fsdp=2, expert=2).mesh_sizes == {"data": 2, "fsdp": 2, "expert": 2, "pipe": 1, "seq": 1,
                                                             "tensor": 1}
