"""Uneven pipeline stages (``pipeline.stage_layers``, jaxpar.train.pipelined): stored
padded to the most loaded stage, the padding skipped. Loss and gradients equal one
device's for every schedule, the padding's gradients are exactly zero, the stored
layout maps to and from the model's, a state saved under one split resumes under
another, and bad splits are one line, exit 2, nothing written."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from conftest import random_init, rel_err, train_steps, tree_rel_err
from jaxpar.models import ModelConfig, Transformer
from jaxpar.models.transformer import run_layers, sharding_rules
from jaxpar.parallel.pipeline_schedule import build
from jaxpar.train import pipelined
from jaxpar.train.step import loss_fn, make_train_step

# 8 layers: pipe=4 with a stage of one layer (3, 1, 2, 2), and pipe=2 x V=2 interleaved.
CFG = ModelConfig(vocab_size=64, dim=32, layers=8, heads=2, kv_heads=1, head_dim=16, mlp_dim=32)
# 1F1B on pipe=4 with (3, 1, 2, 2): test_a_state_resumes_under_another_split's first step,
# its loss and gradients against one device's (the train step's padding holds zeros; the
# padding filled with ones is gpipe's and 1f1b-lockstep's check, the same masked layers).
CASES = {  # name: (schedule kind, P, M, V, stage_layers, other mesh axes)
    "gpipe": ("gpipe", 4, 4, 1, (3, 1, 2, 2), {}),
    "interleaved": ("interleaved", 2, 2, 2, (1, 3, 2, 2), {}),
    # ring attention over seq: the pipeline in lockstep, a padded layer run and discarded
    "1f1b-lockstep": ("1f1b", 2, 2, 1, (5, 3), {"seq": 2}),
}


def a_batch(seed=0, B=4, T=8) -> dict:
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


@pytest.fixture(scope="module")
def model_and_reference():
    """The model's state, and its loss and gradients on ``a_batch()`` on one device."""
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    loss, grads = jax.jit(jax.value_and_grad(lambda s, b: loss_fn(nnx.merge(graphdef, s), b)))(state, a_batch())
    return graphdef, state, loss, grads


def pipelined_loss_and_grads(graphdef, state, kind, P, M, V, stage_layers, others):
    """``(loss, stored grads, order)`` through the pipeline on a ``pipe=P`` (x ``others``)
    mesh, the padded positions of the stored layers filled with ones: never read."""
    count = P * int(np.prod(list(others.values()) or [1]))
    mesh = jaxpar.make_mesh(pipe=P, **others, devices=jax.devices()[:count])
    schedule = build(kind, P, M, V)
    order = pipelined.storage_order(schedule, CFG.layers, stage_layers)
    padding = np.asarray(order) < 0

    @jax.jit  # one program, where eagerly each leaf's gather and scatter compile apart
    def stored_with_padding(state):
        stored = pipelined.to_storage(state, order)
        stored["layers"] = jax.tree.map(lambda w: w.at[padding].set(1.0), stored["layers"])
        return stored

    stored = stored_with_padding(state)
    assert padding.any() and pipelined.needs_lockstep(mesh) == ("seq" in others)
    with jaxpar.use_mesh(mesh, sharding_rules(CFG, mesh)):
        loss, grads, stats = jax.jit(
            lambda s, b: pipelined.loss_and_grads(graphdef, s, b, schedule, mesh, stage_layers))(stored, a_batch())
    assert stats == {}  # a dense model's
    return loss, grads, order


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_uneven_stages_match_one_device(model_and_reference, case):
    """Loss and gradients equal one device's (float32, 1e-5), whatever the padding
    holds; the padded layers' gradients are exactly zero."""
    graphdef, state, want_loss, want_grads = model_and_reference
    loss, grads, order = pipelined_loss_and_grads(graphdef, state, *CASES[case])
    assert rel_err(loss, want_loss) < 1e-5
    assert tree_rel_err(jax.jit(lambda g: pipelined.to_model(g, order))(grads), want_grads) < 1e-5
    padding = np.asarray(order) < 0
    for leaf in jax.tree.leaves(grads["layers"]):
        assert np.all(np.asarray(leaf)[padding] == 0)


def test_the_stored_layout_is_device_major_and_padded():
    """pipe=2 x V=2 with (1, 3, 2, 2): device 0 holds stages 0 and 2 (layers 0; 4, 5),
    device 1 stages 1 and 3 (layers 1, 2, 3; 6, 7), each stage padded to 3; zeros
    there, and ``to_model`` gives the model's order back."""
    order = pipelined.storage_order(build("interleaved", 2, 2, 2), 8, (1, 3, 2, 2))
    np.testing.assert_array_equal(order, [0, -1, -1, 4, 5, -1, 1, 2, 3, 6, 7, -1])
    tree = {"layers": {"w": np.arange(8, dtype=np.float32)[:, None] + 1}, "embed": np.ones(3, np.float32)}
    stored = pipelined.to_storage(tree, order)
    np.testing.assert_array_equal(stored["layers"]["w"][:, 0], [1, 0, 0, 5, 6, 0, 2, 3, 4, 7, 8, 0])
    assert tree_rel_err(pipelined.to_model(stored, order), tree) == 0
    assert pipelined.storage_order(build("1f1b", 2, 2), 8, (4, 4)) is None  # even: the model's order


@pytest.mark.parametrize("lockstep", [False, True])
def test_masked_layers_run_the_first_count(lockstep):
    """A stage of 3 stored layers told to run 2: the first two layers' output; the
    third's gradients zero, by cond (branching) or where (lockstep)."""
    # numpy's draws (conftest.random_init): no random-number program per stacked shape
    model = random_init(lambda: Transformer(dataclasses.replace(CFG, layers=3), rngs=nnx.Rngs(1)),
                        np.random.default_rng(1))
    layers_def, layer_state = nnx.split(model.layers)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, CFG.dim)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))

    def masked(w, x):
        out, term, stats = pipelined.masked_layers(CFG, layers_def, w, x, positions, None, jnp.int32(2),
                                                   lockstep=lockstep)
        assert stats == () and term.shape == ()  # a dense model's: nothing beside the output
        return out

    @jax.jit  # the output and its VJP in one program (eagerly, every op compiles apart)
    def output_and_grads(w, x):
        out, vjp = jax.vjp(masked, w, x)
        return out, vjp(jnp.ones_like(out))[0]

    first_two = jax.tree.map(lambda w: w[:2], layer_state)
    want = jax.jit(lambda w, x: run_layers(CFG, layers_def, w, x, positions, None))(first_two, x)
    got, g_w = output_and_grads(layer_state, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for leaf in jax.tree.leaves(g_w):
        assert np.all(np.asarray(leaf)[2] == 0) and np.any(np.asarray(leaf)[:2] != 0)


def keeping_gradients(tx):
    """``tx`` with the gradient it is given kept in its state (first): the step's
    gradients, as the pipeline computed them, read back after the step."""
    keep = optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                        lambda grads, state, params=None: (grads, grads))
    return optax.chain(keep, tx)


@pytest.mark.slow
def test_a_state_resumes_under_another_split(model_and_reference):
    """Two AdamW steps under (3, 1, 2, 2) (1F1B on pipe=4), the state put in model order
    (what a checkpoint keeps), then a third under (2, 2, 1, 3): the losses of one device's
    run. The first step's loss and gradients are one device's (float32, 1e-5), the
    padded layers' gradients exactly zero."""
    _, _, want_loss, want_grads = model_and_reference
    mesh = jaxpar.make_mesh(pipe=4, devices=jax.devices()[:4])
    rules = sharding_rules(CFG, mesh)
    data = [a_batch(seed) for seed in range(3)]  # a_batch(0): model_and_reference's batch

    def step_for(stage_layers):
        model = Transformer(CFG, rngs=nnx.Rngs(0))
        return model, make_train_step(model, keeping_gradients(optax.adamw(1e-3, weight_decay=0.1)), mesh,
                                      rules, pipeline=build("1f1b", 4, 4), stage_layers=stage_layers, donate=False)

    want, _, _ = train_steps(CFG, data)  # one device: cheaper to compile than an even pipeline

    model, first = step_for((3, 1, 2, 2))
    params, opt_state = first.init(model)
    got = []
    for batch in data[:2]:
        params, opt_state, metrics = first(params, opt_state, batch)
        got.append(float(metrics["loss"]))
        if len(got) == 1:
            grads, order = opt_state[0], first.layer_order
            assert rel_err(got[0], want_loss) < 1e-5
            assert tree_rel_err(jax.jit(lambda g: pipelined.to_model(g, order))(grads), want_grads) < 1e-5
            for leaf in jax.tree.leaves(grads["layers"]):
                assert np.all(np.asarray(leaf)[np.asarray(order) < 0] == 0)
    padding = np.asarray(first.layer_order) < 0  # zero gradients: AdamW leaves the padding zero
    assert all(np.all(np.asarray(w)[padding] == 0) for w in jax.tree.leaves(params["layers"]))
    saved = first.in_model_order({"params": params, "opt_state": opt_state})
    _, second = step_for((2, 2, 1, 3))
    state = second.in_storage_order(saved)
    _, _, metrics = second(state["params"], state["opt_state"], data[2])
    got.append(float(metrics["loss"]))
    assert rel_err(got, want) < 1e-5


# Bad splits: one line naming the value, exit 2, nothing written --------------------------------


@pytest.mark.parametrize("overrides,message", [
    (["pipeline.stage_layers=[2,1,2]"], "pipeline.stage_layers=[2, 1, 2] sums to 5 layers, but model.layers=4"),
    (["pipeline.stage_layers=[2,0,1,1]"],
     "pipeline.stage_layers=[2, 0, 1, 1] has an entry of 0: every stage needs at least one layer"),
    (["pipeline.stage_layers=[3,-1,1,1]"],
     "pipeline.stage_layers=[3, -1, 1, 1] has an entry of -1: every stage needs at least one layer"),
    (["mesh.pipe=2", "pipeline.stage_layers=[1,1,2]"],
     "pipeline.stage_layers=[1, 1, 2] has 3 entries for mesh.pipe x pipeline.virtual_stages = 2 x 1 = 2 stages"),
    (["mesh.pipe=2", "pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "pipeline.stage_layers=[3,1]"],
     "pipeline.stage_layers=[3, 1] has 2 entries for mesh.pipe x pipeline.virtual_stages = 2 x 2 = 4 stages"),
    (["model.layers=5", "mesh.pipe=2", "pipeline.stage_layers=[3,2]"],
     "pipeline.stage_layers=[3, 2]: model.layers=5 does not divide over mesh.pipe=2"),
    (["pipeline.stage_layers=auto"], "pipeline.stage_layers='auto' needs pipeline.device_profile=FILE"),
])
def test_bad_stage_layers_are_one_line_exit_2(tmp_path, capfd, overrides, message):
    from jaxpar.commands.train import main

    run_dir = tmp_path / "run"
    code = main(["tiny", f"run_dir={run_dir}", "--no-progress", *overrides])
    err = capfd.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and re.match(re.escape(f"jaxpar-train: error: {message}"), err[0]), err
    assert not run_dir.exists()


def test_the_profile_prices_the_padding():
    """(3, 1, 2, 2) on pipe=4: every device holds 3 layers, 4 of the 12 padding (0, 2,
    1, 1 per device), each a layer's parameters and Adam's two moments."""
    mesh = jaxpar.make_mesh(pipe=4, devices=jax.devices()[:4])
    rules = sharding_rules(CFG, mesh)
    model = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    schedule = build("1f1b", 4, 4)
    step = make_train_step(model, optax.adam(1e-3), mesh, rules, pipeline=schedule, stage_layers=(3, 1, 2, 2))
    fields = pipelined.profile_fields(schedule, step.abstract_state(model), CFG, mesh, rules, 8, 8,
                                      step.stage_layers)
    layer = sum(x.size // CFG.layers * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)["layers"]))
    assert fields["pipeline_stage_layers"] == [3, 1, 2, 2]
    assert fields["pipeline_padding_bytes"] == 4 * 3 * layer
    stages = fields["pipeline_stages"]
    assert [s["padding_layers"] for s in stages] == [0, 2, 1, 1]
    assert [s["padding_bytes"] for s in stages] == [0, 6 * layer, 3 * layer, 3 * layer]
    assert all(s["layer_parameter_bytes"] == 3 * layer for s in stages)


# jaxpar-train resuming a checkpoint under uneven stages: test_train_parallel.py
# (test_a_run_resumes_under_uneven_stages, beside the even run it resumes).


@pytest.mark.slow
def test_auto_stage_layers_follow_the_device_profile(tmp_path, capsys):
    """``pipeline.stage_layers=auto`` with rank 1 at half speed: the run's step is
    compiled with more layers on rank 0 (the planner's split, jaxpar.planning.stages),
    and the profile shows it. The config and split (4 layers: [3, 1]) of
    test_train_parallel.py's test_a_run_resumes_under_uneven_stages, whose train step is
    this dry run's program: one compile in a test run for both (the persistent cache)."""
    import json

    from jaxpar.train.data import default_cache_dir
    from jaxpar.train.loop import train
    from jaxpar.train.plan import auto_stage_layers
    from test_train import config

    profile = tmp_path / "devices.yaml"
    profile.write_text("ranks: [{speed: 1.0}, {speed: 0.5}]\n")
    cfg = config(tmp_path / "run", default_cache_dir(), "dry_run=true", "steps=2", "mesh.pipe=2", "model.layers=4",
                 "batch_size=16", "pipeline.schedule=1f1b", "pipeline.stage_layers=auto",
                 f"pipeline.device_profile={profile}")
    split = auto_stage_layers(cfg)
    assert sum(split) == 4 and split[0] > split[1], split
    train(cfg, progress=False)
    fields = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert fields["pipeline_stage_layers"] == list(split)
