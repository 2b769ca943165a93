"""The mixture-of-experts layer (jaxpar.models.moe): routing, capacity, the balance loss
and the router bias against plain references; the presets' parameter counts against the
published ones; moe_tiny through jaxpar-train."""

import dataclasses
import functools
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import random_init, rel_err, tree_rel_err
from jaxpar.models import moe as moe_lib
from jaxpar.models.config import PRESETS, ModelConfig, MoEConfig
from jaxpar.models.transformer import MLP, Transformer
from jaxpar.placement import rules as rules_lib
from jaxpar.train.config import ConfigError, load_config

SMALL = ModelConfig(vocab_size=64, dim=16, layers=1, heads=2, kv_heads=1, head_dim=8, mlp_dim=32)


def _reference(x, routed, shared, moe: MoEConfig):
    """The routed experts plus the shared MLP of ``x [B, T, D]``, a token and an expert at
    a time in float64: the router's choice, the gates, and (with a capacity) each
    sequence's assignments counted per expert in token order, those past the capacity
    skipped. Returns ``(y [B, T, D], dropped, chosen)``: the (token, expert) pairs
    skipped, and each expert's assignments chosen."""
    B, T, D = x.shape
    p = {k: np.asarray(v, np.float64) for k, v in routed.items()}
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    cap = math.inf if moe.capacity_factor is None else math.ceil(
        moe.capacity_factor * T * moe.experts_per_token / moe.experts)
    y, dropped, chosen = np.zeros((B, T, D)), set(), np.zeros(moe.experts)
    for b in range(B):
        count = [0] * moe.experts
        for t in range(T):
            h = np.asarray(x[b, t], np.float64)
            logits = h @ p["router"]
            if moe.router == "softmax":
                scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
                choice = scores
            else:
                scores = 1 / (1 + np.exp(-logits))
                choice = scores + p["router_bias"]
            top = np.argsort(-choice)[:moe.experts_per_token]
            gates = scores[top] / (scores[top].sum() if moe.normalize else 1.0)
            for e, g in zip(top, gates):
                count[e] += 1
                chosen[e] += 1
                if count[e] > cap:
                    dropped.add((b * T + t, int(e)))
                    continue
                y[b, t] += g * ((silu(h @ p["gate"][e]) * (h @ p["up"][e])) @ p["down"][e])
            if shared is not None:
                s = {k: np.asarray(v, np.float64) for k, v in shared.items()}
                y[b, t] += (silu(h @ s["gate"]) * (h @ s["up"])) @ s["down"]
    return y, dropped, chosen


CASES = {
    "softmax": MoEConfig(experts=4, experts_per_token=2, expert_width=8),
    "softmax-unnormalised-shared-capacity": MoEConfig(experts=4, experts_per_token=2, expert_width=8,
                                                      normalize=False, shared_experts=2, capacity_factor=0.75),
    "sigmoid_bias": MoEConfig(experts=6, experts_per_token=3, expert_width=8, router="sigmoid_bias"),
    "sigmoid_bias-unnormalised": MoEConfig(experts=4, experts_per_token=1, expert_width=8,
                                           router="sigmoid_bias", normalize=False),
}


@pytest.mark.parametrize("name", CASES)
def test_moe_block_matches_a_token_by_token_reference(name, rng):
    moe = CASES[name]
    cfg = dataclasses.replace(SMALL, moe=moe)
    routed = random_init(lambda: moe_lib.MoE(cfg, rngs=nnx.Rngs(0)), rng)
    width = moe.shared_experts * moe.expert_width
    shared = random_init(lambda: MLP(dataclasses.replace(cfg, mlp_dim=width), rngs=nnx.Rngs(0)), rng) if width else None
    x = jnp.asarray(rng.standard_normal((2, 8, cfg.dim)), jnp.float32)

    @nnx.jit
    def block(routed, shared, x):
        y, aux = routed(x)
        return (y if shared is None else y + shared(x)), aux

    y, aux = block(routed, shared, x)
    weights = lambda m: {k: v[...] for k, v in nnx.state(m, nnx.Param).items()}  # noqa: E731
    expected, dropped, chosen = _reference(np.asarray(x), weights(routed), None if shared is None else weights(shared),
                                           moe)
    assert rel_err(y, expected) < 1e-5
    bias = routed.router_bias[...] if moe.router == "sigmoid_bias" else None
    routing = moe_lib.route(x.reshape(16, -1) @ routed.router[...], moe, bias, rows=2)
    assert abs(float(aux.loss) - moe.balance_loss * float(moe_lib.balance_loss(routing, moe.experts))) < 1e-6
    # the statistics: chosen, probabilities summed, kept (chosen less the reference's drops)
    kept = chosen - np.bincount([e for _, e in dropped], minlength=moe.experts)
    assert np.array_equal(aux.stats[0], chosen) and np.array_equal(aux.stats[2], kept)
    assert rel_err(aux.stats[1], routing.probs.sum(0)) < 1e-6
    if moe.capacity_factor is not None:  # the rule really drops some, and route drops exactly those
        assert 0 < len(dropped) < 2 * 8 * moe.experts_per_token // 2
        got = {(n, int(e)) for n, j in zip(*np.nonzero(~np.asarray(routing.kept)))
               for e in [routing.experts[n, j]]}
        assert got == dropped


def test_capacity_keeps_the_first_assignments_of_each_sequence_in_token_order():
    # one expert per token, 2 experts, 4 tokens: capacity ceil(1.0 * 4 * 1 / 2) = 2
    experts = jnp.array([[0], [0], [0], [1]] * 2, jnp.int32)
    kept = moe_lib.capacity_mask(experts, 2, rows=2, factor=1.0)
    assert np.asarray(kept).ravel().tolist() == [True, True, False, True] * 2  # each sequence alike
    # two per token, 3 tokens: ceil(0.5 * 3 * 2 / 2) = 2 each; the third token's both dropped
    experts = jnp.array([[0, 1], [1, 0], [0, 1]], jnp.int32)
    kept = moe_lib.capacity_mask(experts, 2, rows=1, factor=0.5)
    assert np.asarray(kept).tolist() == [[True, True], [True, True], [False, False]]


def test_balance_loss_is_switch_formula():
    # f = (3/4, 1/4), P = mean of the rows = (0.65, 0.35): 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15
    probs = jnp.array([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    experts = jnp.array([[0], [0], [0], [1]], jnp.int32)
    routing = moe_lib.Routing(experts, jnp.ones((4, 1)), jnp.ones((4, 1), bool), probs)
    assert abs(float(moe_lib.balance_loss(routing, 2)) - 1.15) < 1e-6


def test_router_bias_steps_by_the_sign_of_its_load_deviation_and_the_metrics_are_exact(rng):
    """A 2-layer sigmoid_bias model whose router weights are zero: every token's scores
    are 0.5 (probabilities 1/4 each), so the biases send every token of layer 0 to
    experts 0 and 1 (biases 0.3, 0.2, 0.1, 0; k=2) and of layer 1 to experts 3 and 2:
    loads (1/2, 1/2, 0, 0) and (0, 0, 1/2, 1/2). One train step moves each layer's bias
    by -rate * sign(load - 1/4), untouched by AdamW's weight decay; its metrics, by
    hand: balance 4 * (1/2 * 1/4 + 1/2 * 1/4) = 1 a layer, times 0.01, 2 layers: 0.02;
    load max 1/2 over 1/4 = 2; capacity ceil(1.0 * 8 * 2 / 4) = 4 of each sequence's 8
    assignments to each chosen expert kept: dropped 0.5."""
    moe = MoEConfig(experts=4, experts_per_token=2, expert_width=8, router="sigmoid_bias", bias_rate=0.01,
                    balance_loss=0.01, capacity_factor=1.0)
    cfg = dataclasses.replace(SMALL, layers=2, moe=moe)
    bias = np.array([[0.3, 0.2, 0.1, 0.0], [0.0, 0.1, 0.2, 0.3]], np.float32)
    from jaxpar.train.step import make_train_step

    model = random_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), rng)
    model.layers.moe.router[...] = jnp.zeros_like(model.layers.moe.router[...])
    model.layers.moe.router_bias[...] = jnp.asarray(bias)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32)
    step = make_train_step(model, optax.adamw(1e-2, weight_decay=0.5))
    params, opt_state = step.init(model)
    params, _, metrics = step(params, opt_state, {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)})
    signs = np.array([[1, 1, -1, -1], [-1, -1, 1, 1]])
    assert np.allclose(params["layers"]["moe"]["router_bias"][...], bias - 0.01 * signs, rtol=0, atol=1e-7)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    assert abs(float(metrics["moe_balance_loss"]) - 0.02) < 1e-7
    assert float(metrics["moe_load_max"]) == 2.0 and float(metrics["moe_dropped"]) == 0.5


def test_step_metrics_from_statistics():
    """``step_metrics`` on hand-written statistics: 2 layers, 3 experts, k=1, 6 tokens.
    Layer 0 chose (3, 2, 1), probabilities summed (2.4, 2.1, 1.5), kept (2, 2, 1); layer 1
    (2, 2, 2), (2, 2, 2), all kept. Balance: 3 * (3/6 * 0.4 + 2/6 * 0.35 + 1/6 * 0.25) =
    1.075, and 3 * 3 * (1/3 * 1/3) = 1: 2.075 times 0.5. Load max 3 over 2: 1.5. Dropped
    1 of 12."""
    stats = jnp.array([[[3, 2, 1], [2.4, 2.1, 1.5], [2, 2, 1]], [[2, 2, 2], [2, 2, 2], [2, 2, 2]]], jnp.float32)
    moe = MoEConfig(experts=3, experts_per_token=1, expert_width=8, balance_loss=0.5)
    got = {k: float(v) for k, v in moe_lib.step_metrics(stats, moe).items()}
    assert got == pytest.approx({"moe_balance_loss": 0.5 * 2.075, "moe_load_max": 1.5, "moe_dropped": 1 / 12},
                                rel=1e-6)


MESH_CASES = {  # model.moe, the mesh: with `expert`, the tokens travel to their experts (moe.exchange)
    "sigmoid_bias-capacity-data2xfsdp2xtensor2": (
        MoEConfig(experts=4, experts_per_token=2, expert_width=8, router="sigmoid_bias", capacity_factor=1.0),
        {"data": 2, "fsdp": 2, "tensor": 2}),
    "softmax-expert4xfsdp2": (MoEConfig(experts=4, experts_per_token=2, expert_width=8), {"expert": 4, "fsdp": 2}),
    "softmax-unnormalised-capacity-expert2xfsdp2xseq2": (
        MoEConfig(experts=8, experts_per_token=2, expert_width=8, normalize=False, capacity_factor=1.25),
        {"expert": 2, "fsdp": 2, "seq": 2}),
    "sigmoid_bias-expert8": (MoEConfig(experts=8, experts_per_token=3, expert_width=8, router="sigmoid_bias"),
                             {"expert": 8}),
    # serving's rules (EXPERTS_OWNED): the rows whole on each expert device, its own experts run over all of them
    "owned-softmax-capacity-expert2xtensor2": (
        MoEConfig(experts=4, experts_per_token=2, expert_width=8, capacity_factor=1.0),
        {"data": 2, "expert": 2, "tensor": 2}),
}


@pytest.mark.parametrize("name", MESH_CASES)
def test_each_device_routes_its_rows_and_the_balance_statistics_are_the_batchs(name, rng):
    """The MoE block on a mesh (each device dispatches its own rows under shard_map; with
    ``expert``, the experts split and each assignment sent to its expert's device and
    back, fewer local experts than ``k`` included; with serving's ``EXPERTS_OWNED``
    rules each device's own experts over every row, summed over ``expert``; the
    statistics summed over devices after) against one device: the output, the balance loss, the statistics and the
    gradients of every weight (1e-5). Training on meshes: test_combinations_train.py's model.moe cells,
    test_expert_parallel_training_steps_equal_one_device."""
    import jaxpar
    from jaxpar.models.transformer import sharding_rules
    from jaxpar.placement.sharding import use_mesh

    moe, axes = MESH_CASES[name]
    cfg = dataclasses.replace(SMALL, moe=moe)
    block = random_init(lambda: moe_lib.MoE(cfg, rngs=nnx.Rngs(0)), rng)
    x = jnp.asarray(rng.standard_normal((8, 8, cfg.dim)), jnp.float32)
    probe = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    @nnx.jit
    def run(block, x):
        def loss(block):
            y, aux = block(x)
            return jnp.sum(y * probe) + aux.loss, (y, aux)
        return nnx.grad(loss, has_aux=True)(block)

    grads_one, (y_one, aux_one) = run(block, x)
    mesh = jaxpar.make_mesh(**axes)
    owned = name.startswith("owned")
    rules = rules_lib.override(rules_lib.DEFAULT_RULES, rules_lib.EXPERTS_OWNED) if owned else None
    with use_mesh(mesh, sharding_rules(cfg, mesh, rules)):
        if owned:  # the experts neither travel nor gathered: each device's outputs summed over expert
            program = str(jax.make_jaxpr(run)(block, x)).replace("\n", " ")
            assert "all_to_all" not in program and not re.search(r"all_gather\[[^\]]*'expert'", program)
            assert re.search(r"psum\[[^\]]*'expert'", program)
        grads, (y, aux) = run(block, x)
    assert rel_err(y, y_one) < 1e-5 and abs(float(aux.loss) - float(aux_one.loss)) < 1e-6
    assert rel_err(aux.stats, aux_one.stats) < 1e-6 and float(aux.stats[0].sum()) == 64 * moe.experts_per_token
    assert tree_rel_err(_no_bias(grads), _no_bias(grads_one)) < 1e-5


def _bias(tree):
    """The router bias (stacked) of a model's state or a tree shaped like it."""
    (bias,) = [leaf for path, leaf in jax.tree.leaves_with_path(tree) if moe_lib._is_bias(path)]
    return bias


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s semantics written plainly (XLA:CPU cannot run it):
    every device's operand and offsets gathered, each source's slice for this device
    written at the offset the source gives."""
    operands = jax.lax.all_gather(operand, axis_name)
    starts, sizes, lands = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    me, rows = jax.lax.axis_index(axis_name), jnp.arange(operand.shape[0])
    for source in range(operands.shape[0]):
        taken = operands[source][jnp.clip(starts[source, me] + rows, 0, operand.shape[0] - 1)]
        at = jnp.where(rows < sizes[source, me], lands[source, me] + rows, output.shape[0])
        output = output.at[at].set(taken, mode="drop")
    return output


def test_the_ragged_exchange_equals_the_padded_one_and_lowers_for_cuda(rng):
    """``execution.moe_exchange=ragged`` (``moe.exchange_ragged``: the real rows only,
    packed by offsets the devices tell each other) against the padded buffers, 8 experts
    on ``expert=4`` (2 local experts, k=2), random routing: with ``_ragged_all_to_all``
    standing in for the collective XLA:CPU lacks, the same outputs and gradients of every
    weight and the input; with the real ``jax.lax.ragged_all_to_all`` the step's forward
    and backward lower for CUDA with it (two forward, two in the transpose)."""
    from jax.sharding import PartitionSpec as P

    moe, D = MoEConfig(experts=8, experts_per_token=2, expert_width=8), 16
    x = jnp.asarray(rng.standard_normal((8, 4, D)), jnp.float32)
    weights = (jnp.asarray(rng.standard_normal((D, 8)), jnp.float32),
               *(jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32) for shape in ((8, D, 8), (8, D, 8),
                                                                                         (8, 8, D))))
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])

    def block(send):
        local = functools.partial(moe_lib.dispatch, moe=moe, expert_axes=("expert",), ragged=send)
        split = P("expert")
        run = jax.shard_map(lambda x, r, g, u, d: local(x, r, None, g, u, d)[0], mesh=mesh,
                            in_specs=(split, P(), split, split, split), out_specs=split, check_vma=False)
        return jax.value_and_grad(lambda args: jnp.sum(jnp.sin(run(*args))))

    with jax.set_mesh(mesh):
        padded, ragged = (jax.jit(block(send))((x, *weights)) for send in (None, _ragged_all_to_all))
        program = jax.jit(block(jax.lax.ragged_all_to_all)).trace((x, *weights)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert abs(float(padded[0]) - float(ragged[0])) < 1e-5 * abs(float(padded[0]))
    assert tree_rel_err(ragged[1], padded[1]) < 1e-6
    assert program.count("ragged_all_to_all") == 4


def _no_bias(tree):
    """``tree`` without the router bias (no gradient parameter: its gradient is zero)."""
    return jax.tree.map_with_path(lambda path, g: None if moe_lib._is_bias(path) else g, tree)


def _counts(name):
    cfg = PRESETS[name]
    total = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))))
    return total, moe_lib.active_parameters(cfg, total)


def test_presets_have_the_published_parameter_counts():
    """From shapes alone (nnx.eval_shape). Mixtral 8x7B: 46,702,792,704 parameters, 12.9B
    active; Qwen3-30B-A3B: 30,532,122,624 (its safetensors, the 48 x 2 q/k norms of 128
    included: model.qk_norm), 3.3B active."""
    total, active = _counts("mixtral_8x7b")
    assert total == 46_702_792_704 and round(active / 1e8) == 129
    total, active = _counts("qwen3_30b_a3b")
    assert total == 30_532_122_624 and round(active / 1e9, 1) in (3.3, 3.4)
    total, active = _counts("deepseek_v3_like")  # "like": see the preset's comment
    assert round(total / 1e9) == 708 and round(active / 1e9) == 41
    # the MFU's count: 6 per active matmul parameter (not the input embedding, the norms,
    # the router biases)
    from jaxpar.train.loop import flops_per_token

    for name in ("mixtral_8x7b", "deepseek_v3_like"):
        m, (_, active) = PRESETS[name], _counts(name)
        biases = m.layers * m.moe.experts if m.moe.router == "sigmoid_bias" else 0
        matmul = active - m.vocab_size * m.dim - (2 * m.layers + 1) * m.dim - biases
        expected = 6 * matmul + 12 * m.layers * m.heads * m.head_dim * 4096
        assert flops_per_token(types.SimpleNamespace(model=m, seq_len=4096)) == expected


def test_moe_config_bad_input_is_one_line():
    for override, message in [
        ("model.moe.experts_per_token=9", "model.moe.experts_per_token=9 is more than model.moe.experts=8"),
        ("model.moe.capacity_factor=0", "model.moe.capacity_factor=0.0 must be positive"),
        ("model.moe.every=3", "model.layers=4 must be a multiple of model.moe.every=3"),
        ("model.moe.router=top1", "model.moe.router='top1' must be one of"),
        ("mesh.expert=3", r"^mesh.expert=3 must divide model.moe.experts=8$"),
        ("mesh.expert=0", r"^mesh.expert=0 must be at least 1$"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config("moe_tiny", [override])
    with pytest.raises(ConfigError, match=r"^pipeline.stage_layers with model.moe.every=2 is not supported yet: "):
        load_config("moe_tiny", ["model.layers=4", "model.moe.every=2", "mesh.pipe=2", "pipeline.stage_layers=[3,1]"])
    with pytest.raises(ConfigError, match=r"^mesh.expert=2 splits a MoE model's experts: give model.moe"):
        load_config("tiny", ["mesh.expert=2"])
    # a MoE key on a dense preset is refused; model.moe.experts turns MoE on
    with pytest.raises(ConfigError, match=r"^model.moe.router='softmax': model 'tiny' has no model.moe; use a MoE"):
        load_config("tiny", ["model.moe.router=softmax"])
    assert load_config("tiny", ["model.moe.experts=4"]).model.moe == MoEConfig(experts=4)
    # a key set over the preset keeps its other moe keys
    assert load_config("moe_tiny", ["model.moe.experts=4"]).model.moe == dataclasses.replace(
        PRESETS["moe_tiny"].moe, experts=4)


def test_moe_tiny_trains_and_resumes_to_the_same_losses(tmp_path):
    """jaxpar-train's loop on moe_tiny (2 layers, the second MoE: ``every=2``; narrower
    experts, a small vocabulary; mesh.expert=2 x data=2): the loss is finite and falls;
    stopped after its step-3 checkpoint and resumed on mesh.expert=4 with the parameters
    and optimizer state in host memory (the orbax checkpoint's expert weights read onto 4
    shards of pinned_host memory; the update on the host), steps 4-6 repeat the
    uninterrupted run's losses."""
    import shutil

    from jaxpar.train.loop import train

    args = ["model.layers=2", "model.moe.every=2", "model.vocab_size=512", "model.moe.expert_width=64",
            "data.max_files=120",
            "data.val_fraction=0.1", "seq_len=32", "batch_size=8", "optimizer.warmup_steps=2", "steps=6",
            "checkpoint.every=3", "eval.every=0"]
    run = tmp_path / "run"
    history = train(load_config("moe_tiny", [*args, "mesh.expert=2", "mesh.data=2", f"run_dir={run}"]), progress=False)
    losses = [r["loss"] for r in history]
    assert len(losses) == 6 and np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3
    shutil.rmtree(run / "checkpoints" / "6")
    resumed = train(load_config("moe_tiny", [*args, "mesh.expert=4", "mesh.data=1", "offload.params=host",
                                             "offload.optimizer=host", f"run_dir={run}"]), progress=False)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert rel_err([r["loss"] for r in resumed], losses[3:]) < 1e-5



def _two_steps_equal_one_device(model, one: dict, other: dict) -> list:
    """Two train steps of ``model`` (each step's gradient recorded, then SGD 0.5) under
    ``make_train_step(**one)`` and ``make_train_step(**other)`` on the same fresh random
    tokens: each step's loss, MoE metrics and gradient equal (1e-5; the router bias's,
    zeroed for the optimizer, aside), and so do the parameters after, the router bias's
    two sign steps of ``bias_rate`` (0.01) included. Returns ``other``'s metrics of each
    step."""
    from jaxpar.train.step import make_train_step

    record = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (g, g))
    runs = {}
    for key, kwargs in (("one", one), ("other", other)):
        step = make_train_step(model, optax.chain(record, optax.sgd(0.5)), donate=False, **kwargs)
        params, opt_state = step.init(model)
        for seed in range(2):
            tokens = np.random.default_rng(seed).integers(0, 64, (8, 17)).astype(np.int32)
            params, opt_state, metrics = step(params, opt_state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
            runs.setdefault(key, []).append((metrics, _no_bias(step.in_model_order(opt_state)[0])))
        runs[key].append(step.in_model_order(params))
    for (metrics_one, grads_one), (metrics, grads) in zip(runs["one"][:2], runs["other"][:2]):
        assert tree_rel_err(grads, grads_one) < 1e-5 and set(metrics) == set(metrics_one)
        for key in metrics:  # the loss, and moe_balance_loss, moe_load_max, moe_dropped
            np.testing.assert_allclose(metrics[key], metrics_one[key], rtol=1e-5, err_msg=key)
    assert tree_rel_err(runs["other"][2], runs["one"][2]) < 1e-5
    moved = np.asarray(_bias(runs["other"][2]) - _bias(nnx.state(model)))
    assert np.abs(moved).max() == pytest.approx(0.02)  # two sign steps of bias_rate
    return [metrics for metrics, _ in runs["other"][:2]]


def test_expert_parallel_training_steps_equal_one_device(rng):
    """Two train steps of a MoE model (the sigmoid_bias router, a capacity, a shared
    expert, the balance loss) with its experts split over ``expert=2`` beside data=2 and
    tensor=2 (each device's tokens sent to their experts' devices and back by
    all-to-all: moe.exchange) equal one device's: each step's loss, MoE metrics and
    gradient (1e-5), the parameters after (the router bias's sign step included), on
    fresh random tokens.
    The block alone on other meshes and routers: test_each_device_routes_its_rows..."""
    import jaxpar

    moe = MoEConfig(experts=4, experts_per_token=2, expert_width=8, router="sigmoid_bias", capacity_factor=1.0,
                    bias_rate=0.01, shared_experts=1)
    model = random_init(lambda: Transformer(dataclasses.replace(SMALL, kv_heads=2, moe=moe), rngs=nnx.Rngs(0)), rng)
    for metrics in _two_steps_equal_one_device(model, {}, dict(mesh=jaxpar.make_mesh(expert=2, data=2, tensor=2))):
        assert 0 < float(metrics["moe_dropped"]) < 1 and float(metrics["moe_load_max"]) > 1


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 2])
def test_pipelined_moe_steps_equal_one_device_accumulating_the_same_microbatches(rng, every):
    """A 4-layer MoE model (the sigmoid_bias router, the balance loss, a capacity) on
    data=2 x expert=2 x pipe=2 (the experts split within each stage, their all-to-alls
    inside the schedule's ticks), 1F1B over 2 microbatches, stages of 3 and 1 layers (the
    second stage's two padding layers see no token), or with ``every=2`` even stages of
    one group each (a dense and a MoE layer): two train steps equal one device's
    with grad_accum=2, the same microbatches of 4 rows (each microbatch's balance loss is
    its own, over its rows on both replicas, weighted by its tokens, as under
    grad_accum): each step's loss, MoE metrics and gradient (1e-5), and the parameters
    after, the router bias's sign steps (from the stages' statistics, in the stored
    layers' order) included."""
    import jaxpar
    from jaxpar.models.transformer import sharding_rules
    from jaxpar.parallel.pipeline_schedule import build

    moe = MoEConfig(experts=4, experts_per_token=2, expert_width=8, router="sigmoid_bias", capacity_factor=1.0,
                    bias_rate=0.01, balance_loss=0.1, every=every)
    cfg = dataclasses.replace(SMALL, kv_heads=2, layers=4, moe=moe)
    model = random_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), rng)
    mesh = jaxpar.make_mesh(data=2, expert=2, pipe=2)
    pipelined = dict(mesh=mesh, rules=sharding_rules(cfg, mesh), pipeline=build("1f1b", 2, 2),
                     stage_layers=(3, 1) if every == 1 else None)
    for metrics in _two_steps_equal_one_device(model, dict(grad_accum=2), pipelined):
        assert float(metrics["moe_balance_loss"]) > 0 and float(metrics["moe_load_max"]) > 1


def test_decoding_with_moe_every_2_equals_the_full_forward(rng):
    """A 4-layer model with MoE in layers 1 and 3 (``every=2``: two stacked groups of a
    dense and a MoE layer): a 6-token prompt, then 3 tokens one at a time, through the
    contiguous KV cache (each group's view holds its 2 layers) and through jaxpar-serve's
    paged cache (each group's view the pages at its first layer, each layer writing in
    turn), give the full forward's logits (1e-5) on random weights and tokens, and fill
    every layer's cache."""
    from jaxpar.models.cache import init_cache
    from jaxpar.serving.pages import PagedCache, init_pages

    moe = MoEConfig(experts=4, experts_per_token=2, expert_width=8, every=2)
    cfg = dataclasses.replace(SMALL, layers=4, moe=moe)
    model = random_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), rng)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    decode = nnx.jit(lambda m, t, c: m.decode(t, c)[:2])
    full = nnx.jit(lambda m, t: m(t))(model, tokens)
    first, cache = decode(model, tokens[:, :6], init_cache(cfg, 2, 12))
    stepped = [first]
    for i in range(6, 9):
        logits, cache = decode(model, tokens[:, i:i + 1], cache)
        stepped.append(logits)
    assert rel_err(jnp.concatenate(stepped, axis=1), full) < 1e-5
    assert np.asarray(cache.lengths).tolist() == [9, 9] and np.all(np.abs(np.asarray(cache.k[:, :, :9])).sum(-1) > 0)
    # pages of 4 slots, page 0 the null page: sequence b's 9 tokens in pages 1 + 3b .. 3 + 3b
    tables = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    paged = PagedCache(init_pages(4, 7, 4, cfg.kv_heads, cfg.head_dim, jnp.float32), tables, jnp.zeros(2, jnp.int32))
    first, paged = decode(model, tokens[:, :6], paged)
    stepped = [first]
    for i in range(6, 9):
        logits, paged = decode(model, tokens[:, i:i + 1], paged)
        stepped.append(logits)
    assert rel_err(jnp.concatenate(stepped, axis=1), full) < 1e-5
    written = np.asarray(paged.pages.k[:, 1:7]).reshape(4, 2, 12, -1)[:, :, :9]  # [L, B, slots, K H]
    assert np.all(np.abs(written).sum(-1) > 0) and not np.any(np.asarray(paged.pages.k[:, 0]))
