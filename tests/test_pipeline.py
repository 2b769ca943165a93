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
from jaxpar.parallel.pipeline_schedule import build
from jaxpar import SequenceOptions


def embed_fn(outer, tokens, side):
    """A lookup table: tokens [mb] -> a [mb, D]."""
    return outer["table"][tokens]


def stage_fn(w, a, side):
    """A small residual MLP block: a [mb, D] -> [mb, D], shifted by the microbatch's side input."""
    return a + jnp.tanh(a @ w["in"] + w["bias"] + side["shift"]) @ w["out"]


def head_fn(outer, a, side):
    return jnp.mean((a @ outer["proj"] - side["target"]) ** 2)


def reference(params, outer, tokens, side):
    S = params["in"].shape[0]

    def one(tokens, side):
        a = embed_fn(outer, tokens, side)
        for s in range(S):
            a = stage_fn(jax.tree.map(lambda w: w[s], params), a, side)
        return head_fn(outer, a, side)

    return jnp.mean(jax.vmap(one)(tokens, side))


# P = 2 and 4, M = P, 2P and odd, V = 2 for interleaved (whose M is a multiple of P);
# then one case of each schedule in lockstep.
SCHEDULES = [
    ("gpipe", 2, 2, 1), ("gpipe", 2, 4, 1), ("gpipe", 2, 3, 1),
    ("gpipe", 4, 4, 1), ("gpipe", 4, 8, 1), ("gpipe", 4, 5, 1),
    ("1f1b", 2, 2, 1), ("1f1b", 2, 4, 1), ("1f1b", 2, 3, 1),
    ("1f1b", 4, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 7, 1),
    ("interleaved", 2, 2, 2), ("interleaved", 2, 4, 2), ("interleaved", 4, 4, 2), ("interleaved", 4, 8, 2),
]
LOCKSTEP = [("gpipe", 4, 5, 1), ("1f1b", 4, 7, 1), ("interleaved", 4, 8, 2)]


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
    run = jax.jit(lambda params, outer, tokens, side: pipeline.value_and_grad(
        embed_fn, stage_fn, head_fn, params, outer, tokens, side, schedule, mesh=mesh, lockstep=lockstep))
    loss, grads = run(params, outer, tokens, side)
    ref_loss, ref_grads = jax.value_and_grad(reference, argnums=(0, 1))(params, outer, tokens, side)
    assert rel_err(loss, ref_loss) < 1e-5
    for got, want in zip(grads, ref_grads):
        assert tree_rel_err(got, want) < 1e-5


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
    return train_steps(CFG, data, mesh, pipeline=schedule, sequence=sequence)[:2]


@pytest.fixture(scope="module")
def single_device_run():
    data = batches(np.random.default_rng(3))
    return data, train(data)


@pytest.mark.parametrize("kind,P,M,V,others", [
    ("gpipe", 2, 2, 1, {}), ("1f1b", 2, 4, 1, {}), ("1f1b", 4, 4, 1, {}),
    ("interleaved", 2, 4, 2, {}),
    ("1f1b", 2, 2, 1, dict(data=2, tensor=2)), ("gpipe", 2, 4, 1, dict(fsdp=2, tensor=2)),
    ("1f1b", 2, 2, 1, dict(seq=2, tensor=2)),  # pipe x seq (Ulysses) x tensor
    # ring attention in lockstep: the 4D run in test_train (pipe x seq x tensor 2D)
    ("interleaved", 2, 2, 2, dict(tensor=(2, 2))),  # SUMMA: lockstep
], ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else str(x))
def test_training_through_the_pipeline_matches_one_device(single_device_run, kind, P, M, V, others):
    """Three AdamW steps: losses and parameters equal one device's (mean of microbatch
    losses = the batch mean here: every microbatch has the same number of tokens)."""
    data, (ref_losses, ref_params) = single_device_run
    count = P * int(np.prod(list(others.values()) or [1]))
    mesh = jaxpar.make_mesh(pipe=P, **others, devices=jax.devices()[:count])
    losses, params = train(data, mesh, build(kind, P, M, V), SequenceOptions("ulysses"))
    assert rel_err(losses, ref_losses) < 1e-5
    assert tree_rel_err(params, ref_params) < 1e-5


@pytest.mark.parametrize("sizes,schedule,message", [
    (dict(pipe=2), ("interleaved", 2, 4, 3), "4 layers do not split into pipe x virtual stages = 2 x 3 = 6"),
])
def test_unsupported_pipelines_are_refused(sizes, schedule, message):
    data = batches(np.random.default_rng(4), steps=1)
    count = int(np.prod([np.prod(v) for v in sizes.values()]))
    with pytest.raises(ValueError, match=re.escape(message)):
        train(data, jaxpar.make_mesh(**sizes, devices=jax.devices()[:count]), build(*schedule))
