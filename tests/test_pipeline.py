"""The schedule-driven SPMD pipeline (jaxpar.parallel.pipeline) against plain autodiff on one
device: loss, stage-parameter and embedding/head gradients, for every schedule."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from conftest import rel_err, train_steps, tree_rel_err
from jaxpar.parallel import pipeline
from jaxpar.models import ModelConfig
from jaxpar import SequenceOptions
from jaxpar.parallel.pipeline_schedule import BACKWARD, FORWARD, IDLE, build
from jaxpar.train import pipelined


def embed_fn(outer, tokens, side):
    """A lookup table: tokens [mb] -> a [mb, D]."""
    return outer["table"][tokens]


def stage_fn(w, a, side):
    """A small residual MLP block: a [mb, D] -> [mb, D], shifted by the microbatch's side
    input; with a term of the loss of its own (a penalty on its output, as a MoE layer's
    balance loss) and a statistic (its output summed over the rows, as a MoE layer's
    routing counts)."""
    out = a + jnp.tanh(a @ w["in"] + w["bias"] + side["shift"]) @ w["out"]
    return out, 0.1 * jnp.mean(out ** 2), {"sum": out.sum(0)}


def head_fn(outer, a, side):
    return jnp.mean((a @ outer["proj"] - side["target"]) ** 2)


def reference(params, outer, tokens, side):
    """The loss summed over microbatches (each stage's term with the head's) and each
    stage's statistic summed over them, ``[S, D]``."""
    S = params["in"].shape[0]

    def one(tokens, side):
        a, terms, sums = embed_fn(outer, tokens, side), 0.0, []
        for s in range(S):
            a, term, stats = stage_fn(jax.tree.map(lambda w: w[s], params), a, side)
            terms, sums = terms + term, sums + [stats["sum"]]
        return head_fn(outer, a, side) + terms, jnp.stack(sums)

    losses, sums = jax.vmap(one)(tokens, side)
    return jnp.sum(losses), {"sum": sums.sum(0)}


# Plain autodiff on one device: one compiled program per (S, M) rather than every op of
# the forward and backward compiled eagerly for each new shape.
reference_value_and_grad = jax.jit(jax.value_and_grad(reference, argnums=(0, 1), has_aux=True))


# M = P at P = 2, then M = 2P and odd M at P = 4, V = 2 for interleaved (whose M is a
# multiple of P); then one case of each schedule in lockstep. (M = 2P and odd M at P = 2,
# P, M = (2, 4) and (2, 3), and interleaved (2, 4, 2) check what (4, 8), (4, 5) / (4, 7)
# and (4, 8, 2) check: more microbatches than stages, in whole and in ragged rounds; M = P
# at P = 4, (4, 4) and (4, 4, 2), what (2, 2) and (2, 2, 2) check, one microbatch per
# stage; each case compiles a pipeline and its reference.)
SCHEDULES = [
    ("gpipe", 2, 2, 1), ("gpipe", 4, 8, 1), ("gpipe", 4, 5, 1),
    ("1f1b", 2, 2, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 7, 1),
    ("interleaved", 2, 2, 2), ("interleaved", 4, 8, 2),
]
LOCKSTEP = [("gpipe", 4, 5, 1), ("1f1b", 4, 7, 1), ("interleaved", 4, 8, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("kind,P,M,V,lockstep", [(*case, False) for case in SCHEDULES]
                         + [(*case, True) for case in LOCKSTEP])
def test_every_schedule_matches_autodiff(rng, kind, P, M, V, lockstep):
    S, mb, D, F = P * V, 3, 8, 16
    params = {
        "in": jnp.asarray(rng.standard_normal((S, D, F)) / np.sqrt(D), jnp.float32),
        "bias": jnp.asarray(rng.standard_normal((S, F)), jnp.float32),
        "out": jnp.asarray(rng.standard_normal((S, F, D)) / np.sqrt(F), jnp.float32),
    }
    outer = {"table": jnp.asarray(rng.standard_normal((11, D)), jnp.float32),
             "proj": jnp.asarray(rng.standard_normal((D, 4)), jnp.float32)}
    tokens = jnp.asarray(rng.integers(0, 11, (M, mb)), jnp.int32)
    side = {"shift": jnp.asarray(rng.standard_normal((M, 1, F)), jnp.float32),
            "target": jnp.asarray(rng.standard_normal((M, mb, 4)), jnp.float32)}
    mesh = jaxpar.make_mesh(pipe=P, devices=jax.devices()[:P])
    schedule = build(kind, P, M, V)
    # Stage s = v P + p at [p, v]: device-major, as the pipeline takes them.
    device_major = lambda tree: jax.tree.map(lambda a: jnp.swapaxes(a.reshape(V, P, *a.shape[1:]), 0, 1), tree)
    run = jax.jit(lambda params, outer, tokens, side: pipeline.value_and_grad(
        embed_fn, stage_fn, head_fn, device_major(params), outer, tokens, side, schedule, mesh=mesh,
        lockstep=lockstep))
    loss, (stage_grads, outer_grads), stats = run(params, outer, tokens, side)
    (ref_loss, ref_stats), (ref_stage, ref_outer) = reference_value_and_grad(params, outer, tokens, side)
    assert rel_err(loss, ref_loss) < 1e-5
    assert tree_rel_err(stage_grads, device_major(ref_stage)) < 1e-5
    assert tree_rel_err(outer_grads, ref_outer) < 1e-5
    assert tree_rel_err(stats, device_major(ref_stats)) < 1e-5


# One tick on one device, against the stage computed by hand ------------------------------

TICK_CASES = {  # name: (op, microbatch, virtual, first, last, slot, read)
    "forward, first stage": (FORWARD, 1, 0, 1, 0, 1, -1),
    "forward, middle stage": (FORWARD, 2, 1, 0, 0, 0, 1),
    "forward, last stage": (FORWARD, 0, 1, 0, 1, 1, 0),
    "backward, last stage": (BACKWARD, 2, 1, 0, 1, 0, -1),
    "backward, middle stage": (BACKWARD, 0, 1, 0, 0, 1, 0),
    "backward, first stage": (BACKWARD, 1, 0, 1, 0, 1, 1),
    "idle": (IDLE, 0, 0, 0, 0, -1, -1),
}


def expected_tick(local, state, op, m, v, first, last, slot, read):
    """``(state, out_f, out_b)`` of one tick, by hand: plain jax.vjp of the stage and its
    term (and of the head on the last stage) on the buffers the op names."""
    w, side_m, zeros = jax.tree.map(lambda x: x[v], local.params), jax.tree.map(lambda x: x[m], local.side), \
        jnp.zeros_like(local.x[0])
    state = dict(state)
    if op == FORWARD:
        a = local.x[m] if first else state["recv_f"][read]
        state["stash"] = state["stash"].at[slot].set(a)
        out, term, stats = stage_fn(w, a, side_m)
        state["loss"] = state["loss"] + term + (head_fn(local.outer, out, side_m) if last else 0.0)
        state["stats"] = {"sum": state["stats"]["sum"].at[v].add(stats["sum"])}
        return state, out, zeros
    if op == BACKWARD:
        a = state["stash"][slot]
        if last:
            def total(w, h, a):
                out, term, _ = stage_fn(w, a, side_m)
                return head_fn(h, out, side_m) + term

            loss, vjp = jax.vjp(total, w, local.outer, a)
            g_w, g_outer, g_a = vjp(jnp.ones_like(loss))
            state["outer_grads"] = jax.tree.map(jnp.add, state["outer_grads"], g_outer)
        else:
            (_, term), vjp = jax.vjp(lambda w, a: stage_fn(w, a, side_m)[:2], w, a)
            g_w, g_a = vjp((state["recv_b"][read], jnp.ones_like(term)))
        state["grads"] = jax.tree.map(lambda acc, g: acc.at[v].add(g), state["grads"], g_w)
        if first:
            state["dx"] = state["dx"].at[m].set(g_a)
        return state, zeros, g_a
    return state, zeros, zeros


@pytest.fixture(scope="module")
def tick_setup():
    """A device with V = 2 stages of the MLP block, M = 3 microbatches, and a loop state
    whose every buffer and accumulator holds random values (stale data a tick must
    not keep)."""
    rng = np.random.default_rng(7)
    V, M, mb, D, F = 2, 3, 3, 8, 16
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    local = pipeline.Local(
        stage_fn, head_fn,
        params={"in": normal(V, D, F) / np.sqrt(D), "bias": normal(V, F), "out": normal(V, F, D) / np.sqrt(F)},
        outer={"table": normal(11, D), "proj": normal(D, 4)},
        x=normal(M, mb, D), side={"shift": normal(M, 1, F), "target": normal(M, mb, 4)})
    sizes = pipeline.plan(build("gpipe", 2, 2))  # buffers of 2, 1, 1 slots: made 2 each below
    one_stage = {"sum": jax.ShapeDtypeStruct((D,), jnp.float32)}  # stage_fn's statistics
    state = jax.tree.map(lambda x: normal(*x.shape), pipeline.init_state(local, sizes, one_stage))
    state.update(recv_f=normal(2, mb, D), recv_b=normal(2, mb, D))
    ticks = {name: jax.jit(lambda state, op, tick=tick: tick(local, state, op))
             for name, tick in (("branching", pipeline.branching_tick), ("lockstep", pipeline.lockstep_tick))}
    return local, state, ticks


@pytest.mark.parametrize("tick", ["branching", "lockstep"])
@pytest.mark.parametrize("case", list(TICK_CASES))
def test_one_tick_matches_the_stage_by_hand(tick_setup, tick, case):
    """What a tick stashes, sends and accumulates. The lockstep tick runs both its parts
    (as when other devices have forwards and backwards at this tick), and the head's
    where another device runs the last stage, so what is not this device's must leave
    no trace."""
    local, state, ticks = tick_setup
    op, m, v, first, last, slot, read = TICK_CASES[case]
    row = dict(op=op, microbatch=m, virtual=v, first=first, last=last, slot=slot, read=read,
               arrive_f=-1, arrive_b=-1)
    row = {k: jnp.int32(x) for k, x in row.items()}
    row.update({k: jnp.bool_(True) for k in ("any_forward", "any_backward", "sends_f", "sends_b")})
    want = expected_tick(local, state, op, m, v, first, last, slot, read)
    # Whether another device runs the last stage (and with it the head) at this tick.
    for head in [True] if last else [True, False]:
        row.update(head_forward=jnp.bool_(head), head_backward=jnp.bool_(head))
        got = ticks[tick](state, row)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_1f1b_stashes_p_inputs_where_gpipe_stashes_m():
    P, M = 4, 16
    assert pipeline.plan(build("gpipe", P, M)).stash_size == M
    assert pipeline.plan(build("1f1b", P, M)).stash_size == P


# The transformer through the pipeline ---------------------------------------------------

CFG = ModelConfig(vocab_size=128, dim=64, layers=4, heads=4, kv_heads=2, head_dim=16, mlp_dim=96)


def batches(rng, steps=3, B=8, T=16):
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
        seg = np.sort(rng.integers(0, 2, (B, T)), axis=1).astype(np.int32)
        out.append({"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
                    "segment_ids": jnp.asarray(seg)})
    return out


def train(data, mesh=None, schedule=None, sequence=SequenceOptions()):
    """``(losses, params)``, the parameters in the model's order."""
    losses, params, _ = train_steps(CFG, data, mesh, pipeline=schedule, sequence=sequence)
    order = None if schedule is None else pipelined.storage_order(schedule, CFG.layers)
    return losses, params if order is None else pipelined.to_model(params, order)


@pytest.fixture(scope="module")
def single_device_run():
    data = batches(np.random.default_rng(3))
    return data, train(data)


@pytest.mark.slow
@pytest.mark.parametrize("kind,P,M,V,others", [
    # GPipe through the transformer: ("gpipe", 2, 4, 1, fsdp=2 x tensor=2) below (a pipe-only
    # GPipe case checked the same; its schedule against autodiff: SCHEDULES). Pipe-only 1F1B
    # at P = 2, M = 4: test_microbatches_weight_the_loss_by_tokens's pipeline, its loss and
    # gradients against one device's (1F1B at P = 2 with AdamW: data=2 x tensor=2 below).
    # Middle stages (P = 4, ("1f1b", 4, 4, 1) was a case here): the P = 4 SCHEDULES against
    # autodiff, and through the transformer test_pipeline_uneven.py's pipe=4 runs (GPipe, and
    # 1F1B trained three AdamW steps). Interleaved stages through the transformer branching
    # (("interleaved", 2, 4, 2) was a pipe-only case here): test_pipeline_uneven.py's
    # interleaved pipe=2 x V=2 case, its loss and gradients against one device's; the even
    # device-major layout: test_interleaved_layers_are_stored_device_major.
    ("1f1b", 2, 2, 1, dict(data=2, tensor=2)), ("gpipe", 2, 4, 1, dict(fsdp=2, tensor=2)),
    ("1f1b", 2, 2, 1, dict(seq=2, tensor=2)),  # pipe x seq (Ulysses) x tensor
    # ring attention in lockstep: the 4D run in test_train (pipe x seq x tensor 2D)
    ("interleaved", 2, 2, 2, dict(tensor=(2, 2))),  # SUMMA: lockstep
], ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else str(x))
def test_training_through_the_pipeline_matches_one_device(single_device_run, kind, P, M, V, others):
    """Three AdamW steps: losses and parameters equal one device's."""
    data, (ref_losses, ref_params) = single_device_run
    count = P * int(np.prod(list(others.values()) or [1]))
    mesh = jaxpar.make_mesh(pipe=P, **others, devices=jax.devices()[:count])
    losses, params = train(data, mesh, build(kind, P, M, V), SequenceOptions("ulysses"))
    assert rel_err(losses, ref_losses) < 1e-5
    assert tree_rel_err(params, ref_params) < 1e-5


@pytest.mark.slow
def test_interleaved_layers_are_stored_device_major():
    """pipe=2 x V=2 over 4 layers: device 0 keeps layers 0 and 2 (stages 0 and 2), device
    1 layers 1 and 3; the step's ``in_model_order`` gives the model's state back, and
    ``model`` the model."""
    import optax
    from flax import nnx

    from jaxpar.models import Transformer
    from jaxpar.models.transformer import sharding_rules
    from jaxpar.train.step import make_train_step

    mesh = jaxpar.make_mesh(pipe=2, devices=jax.devices()[:2])
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    want = nnx.state(model)
    step = make_train_step(model, optax.adam(1e-3), mesh, sharding_rules(CFG, mesh),
                           pipeline=build("interleaved", 2, 2, 2))
    params, opt_state = step.init(model)
    q, q_model = params["layers"]["attn"]["q"][...], want["layers"]["attn"]["q"][...]
    for shard in q.addressable_shards:  # pipe device p holds [2p, 2p + 2) of the stored axis
        p = shard.index[0].start // 2
        np.testing.assert_array_equal(shard.data, q_model[np.array([p, p + 2])])
    state = step.in_model_order({"params": params, "opt_state": opt_state})
    assert tree_rel_err(state["params"], want) == 0
    assert jax.tree.map(lambda x: x.sharding, state) == jax.tree.map(lambda x: x.sharding,
                                                                     {"params": params, "opt_state": opt_state})
    restored = step.in_storage_order(state)
    assert tree_rel_err(restored["params"], params) == 0
    assert tree_rel_err(nnx.state(step.model(params)), want) == 0


def gradients_as_state():
    """An optimizer whose state after a step is that step's gradients (and which leaves
    the parameters as they are)."""
    import optax

    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    return optax.GradientTransformation(zeros, lambda grads, state, params=None: (zeros(grads), grads))


@pytest.mark.slow
def test_microbatches_weight_the_loss_by_tokens():
    """Rows whose masks count from 1 to all 16 tokens: grad_accum 1 and 4 and a pipe=2
    pipeline give the same loss and gradients, the whole batch's token-weighted ones
    (a mean of microbatch means would weight a token of a sparse microbatch more).
    (grad_accum=2 checked what grad_accum=4 checks, microbatches of unequal token
    counts weighted by their share, with one more train step to compile.)"""
    from flax import nnx

    from jaxpar.models import Transformer
    from jaxpar.models.transformer import sharding_rules
    from jaxpar.train.step import make_train_step

    rng = np.random.default_rng(5)
    batch = batches(rng, steps=1)[0]
    counts = rng.permutation([1, 2, 3, 4, 6, 9, 13, 16])  # tokens counted per row
    batch["mask"] = jnp.asarray(np.arange(16)[None, :] < counts[:, None], jnp.int32)
    mesh = jaxpar.make_mesh(pipe=2, devices=jax.devices()[:2])
    runs = {f"grad_accum={k}": dict(grad_accum=k) for k in (1, 4)}
    runs["pipe=2"] = dict(mesh=mesh, rules=sharding_rules(CFG, mesh), pipeline=build("1f1b", 2, 4))
    results = {}
    for name, options in runs.items():
        model = Transformer(CFG, rngs=nnx.Rngs(0))
        step = make_train_step(model, gradients_as_state(), **options)
        params, opt_state = step.init(model)
        _, grads, metrics = step(params, opt_state, batch)
        results[name] = float(metrics["loss"]), grads
    want_loss, want_grads = results.pop("grad_accum=1")
    for name, (loss, grads) in results.items():
        assert rel_err(loss, want_loss) < 1e-6, name
        assert tree_rel_err(grads, want_grads) < 1e-6, name


@pytest.mark.parametrize("sizes,schedule,message", [
    (dict(pipe=2), ("interleaved", 2, 4, 3), "4 layers do not split into pipe x virtual stages = 2 x 3 = 6"),
])
def test_unsupported_pipelines_are_refused(sizes, schedule, message):
    data = batches(np.random.default_rng(4), steps=1)
    count = int(np.prod([np.prod(v) for v in sizes.values()]))
    with pytest.raises(ValueError, match=re.escape(message)):
        train(data, jaxpar.make_mesh(**sizes, devices=jax.devices()[:count]), build(*schedule))
