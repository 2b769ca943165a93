"""The schedule-driven SPMD pipeline (jaxpar.pipeline) against plain autodiff on one
device: loss, stage-parameter gradients and input gradients, for every schedule."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from conftest import rel_err, train_steps, tree_rel_err
from jaxpar import pipeline
from jaxpar.models import ModelConfig
from jaxpar.pipeline_schedule import build
from jaxpar.sequence_parallel import SequenceOptions


def stage_fn(w, a, side):
    """A small residual MLP block: a [mb, D] -> [mb, D], shifted by the microbatch's side input."""
    return a + jnp.tanh(a @ w["in"] + w["bias"] + side["shift"]) @ w["out"]


def head_fn(head, a, side):
    return jnp.mean((a @ head["proj"] - side["target"]) ** 2)


def reference(params, head, x, side):
    S = params["in"].shape[0]

    def one(a, side):
        for s in range(S):
            a = stage_fn(jax.tree.map(lambda w: w[s], params), a, side)
        return head_fn(head, a, side)

    return jnp.mean(jax.vmap(one)(x, side))


@pytest.mark.parametrize("kind,P,M,V", [
    ("gpipe", 2, 2, 1), ("gpipe", 4, 5, 1), ("gpipe", 4, 8, 1),
    ("1f1b", 2, 3, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 7, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2),
])
def test_every_schedule_matches_autodiff(rng, kind, P, M, V):
    S, mb, D, F = P * V, 3, 8, 16
    params = {
        "in": jnp.asarray(rng.standard_normal((S, D, F)) / np.sqrt(D), jnp.float32),
        "bias": jnp.asarray(rng.standard_normal((S, F)), jnp.float32),
        "out": jnp.asarray(rng.standard_normal((S, F, D)) / np.sqrt(F), jnp.float32),
    }
    head = {"proj": jnp.asarray(rng.standard_normal((D, 4)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((M, mb, D)), jnp.float32)
    side = {"shift": jnp.asarray(rng.standard_normal((M, 1, F)), jnp.float32),
            "target": jnp.asarray(rng.standard_normal((M, mb, 4)), jnp.float32)}
    mesh = jaxpar.make_mesh(pipe=P, devices=jax.devices()[:P])
    schedule = build(kind, P, M, V)
    run = jax.jit(lambda params, head, x, side: pipeline.value_and_grad(
        stage_fn, head_fn, params, head, x, side, schedule, mesh=mesh))
    loss, grads = run(params, head, x, side)
    ref_loss, ref_grads = jax.value_and_grad(reference, argnums=(0, 1, 2))(params, head, x, side)
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
    ("gpipe", 2, 2, 1, {}), ("gpipe", 4, 8, 1, {}), ("1f1b", 2, 4, 1, {}), ("1f1b", 4, 4, 1, {}),
    ("interleaved", 2, 4, 2, {}),
    ("1f1b", 2, 2, 1, dict(data=2, tensor=2)), ("gpipe", 2, 4, 1, dict(fsdp=2, tensor=2)),
    ("1f1b", 2, 2, 1, dict(seq=2, tensor=2)),  # pipe x seq (Ulysses) x tensor
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
    (dict(pipe=2, seq=2), ("1f1b", 2, 2), "pipeline parallelism with seq=2 needs the ulysses attention for now"),
    (dict(pipe=2, tensor=(2, 2)), ("1f1b", 2, 2), "pipeline parallelism with a 2D tensor grid is not supported yet"),
])
def test_unsupported_pipelines_are_refused(sizes, schedule, message):
    data = batches(np.random.default_rng(4), steps=1)
    count = int(np.prod([np.prod(v) for v in sizes.values()]))
    with pytest.raises(ValueError, match=re.escape(message)):
        train(data, jaxpar.make_mesh(**sizes, devices=jax.devices()[:count]), build(*schedule))
