"""The schedule-driven SPMD pipeline (jaxpar.pipeline) against plain autodiff on one
device: loss, stage-parameter gradients and input gradients, for every schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from conftest import rel_err, tree_rel_err
from jaxpar import pipeline
from jaxpar.pipeline_schedule import build


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
