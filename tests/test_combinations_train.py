"""Every "works" cell of the table of combinations (``jaxpar.train.combinations``, the
README's table) trains: two steps of ``make_train_step`` with both features on, each
step's reduced gradient, loss and noise-scale norms equal to one device's (1e-5) on
fresh random tokens. ``tests/test_combinations.py`` holds the other half: every
refused cell exits 2 at config time.

The 59 working pairs are trained in 13 runs (``RUNS``) of three to five features each,
every pair of a run one that works, every working pair in some run
(``test_every_working_pair_is_trained_in_a_run``): a run's features also meet each
other three and four at a time, and each compiled step (about 3 CPU seconds on this
machine, most of a cell's cost) serves up to six cells. Adasum and the top-k exchange
together make one reduction (Adasum of the densified gradients), so a run that holds both
counts for their own pair only, not for either's pairs with the rest.

Each feature is what it adds to the step (``ON``): options of ``make_train_step``,
mesh axes beside ``data=2`` (two replicas, so Adasum, the top-k exchange and the noise
scale have something to combine; every cell fits 8 devices), a task. The optimizer
records the gradient it is given in its state, then takes an SGD step, so the second
step's gradient is taken at moved parameters (and the top-k exchange's carried state is
used once). The references run on one device at the step's own parameters: each
replica's rows through one jitted ``value_and_grad`` (one program for the whole walk,
two more for the unequal rows of ``data.batch_weights``, one for GliDe's loss),
combined in numpy as the cell's reduction says (``conftest.adasum_reference`` for
Adasum; DCT at ratio 1, which sends every entry, is the replicas' mean); the parameters
then moved by the SGD step of that gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from conftest import adasum_reference, random_init, tree_rel_err
from jaxpar.hetero.reduction import Reduction
from jaxpar.models import GlideDraft, ModelConfig, Transformer
from jaxpar.models.config import MoEConfig
from jaxpar.models.transformer import sharding_rules
from jaxpar.parallel.pipeline_schedule import build
from jaxpar.placement.execution import OffloadOptions, SequenceOptions
from jaxpar.train import combinations, glide
from jaxpar.train.config import load_config
from jaxpar.models import moe as moe_lib
from jaxpar.train.losses import loss_and_stats
from jaxpar.train.step import make_train_step

pytestmark = pytest.mark.slow

CFG = ModelConfig(vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=48)
B, T, LR = 8, 16, 0.5
EQUAL_ROWS, WEIGHTED_ROWS = (4, 4), (6, 2)  # each replica's rows; batch weights 3:1 (slot 6)

# What each feature adds to the step: make_train_step's options and mesh axes ("rows":
# data.batch_weights' unequal rows per replica; "task": GliDe's draft and loss).
ON = {
    "model.moe": {"task": "moe"},
    "offload": {"offload": OffloadOptions(params="host", optimizer="host", activations=("query",))},
    "data.batch_weights": {"weighted": 2, "rows": WEIGHTED_ROWS},
    "optimizer.reduction=adasum": {"reduction": Reduction("adasum")},
    "optimizer.compression=dct_topk": {"reduction": Reduction("mean", "dct_topk", ratio=1.0)},
    "eval.noise_scale": {"noise_scale": True},
    "task=glide": {"task": "glide"},
    "optimizer.grad_accum": {"grad_accum": 2},
    "mesh.fsdp": {"axes": {"fsdp": 2}},
    "mesh.tensor": {"axes": {"tensor": 2}},
    "mesh.pipe": {"axes": {"pipe": 2}, "pipeline": build("1f1b", 2, 2)},
    "mesh.seq": {"axes": {"seq": 2}, "sequence": SequenceOptions("ring")},
}
WORKS = [pair for pair in itertools.combinations(combinations.KEYS, 2) if frozenset(pair) not in combinations.REFUSED]
ADASUM, DCT = "optimizer.reduction=adasum", "optimizer.compression=dct_topk"
# A greedy cover of WORKS by runs of at most four features, at most two mesh axes beside
# data=2 (8 devices), and offload added to the first; that one also splits the experts
# (mesh.expert=2, not a feature of the table: it takes model.moe's refusals), so
# host-resident experts split over expert train as one device.
RUNS = (
    ("model.moe", "offload", "data.batch_weights", ADASUM, "optimizer.grad_accum"),
    ("offload", DCT, "task=glide", "optimizer.grad_accum"),
    ("offload", "data.batch_weights", "eval.noise_scale", "mesh.fsdp"),
    ("model.moe", DCT, "mesh.fsdp", "mesh.tensor"),
    ("offload", ADASUM, "mesh.tensor", "mesh.pipe"),
    (ADASUM, "task=glide", "mesh.fsdp", "mesh.seq"),
    ("eval.noise_scale", "optimizer.grad_accum", "mesh.tensor", "mesh.seq"),
    ("offload", DCT, "mesh.pipe", "mesh.seq"),
    ("eval.noise_scale", "optimizer.grad_accum", "mesh.fsdp", "mesh.pipe"),
    ("model.moe", "eval.noise_scale", "mesh.seq", "mesh.pipe"),
    ("data.batch_weights", DCT, "mesh.tensor"),
    ("eval.noise_scale", "task=glide", "mesh.tensor"),
    (ADASUM, DCT),
)


def pairs_of(run: tuple[str, ...]) -> set[frozenset]:
    """The cells a run trains (with Adasum and the top-k exchange both on, neither's
    pairs with the others: the reduction is then a third one)."""
    both = {ADASUM, DCT} <= set(run)
    return {frozenset(p) for p in itertools.combinations(run, 2) if not (both and len({ADASUM, DCT} & set(p)) == 1)}


def options_of(*keys: str) -> dict:
    """The features' settings merged (two reductions make one: Adasum of the top-k
    exchange's densified gradients)."""
    out = {"axes": {"data": 2}, "rows": EQUAL_ROWS, "task": "lm"}
    for key in keys:
        for name, value in ON[key].items():
            if name == "axes":
                out["axes"] = {**out["axes"], **value}
            elif name == "reduction" and "reduction" in out:
                out["reduction"] = Reduction("adasum", "dct_topk", ratio=1.0)
            else:
                out[name] = value
    return out


def record_then_sgd() -> optax.GradientTransformation:
    """Keeps the gradient it is given as its state, then an SGD step."""
    record = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (g, g))
    return optax.chain(record, optax.sgd(LR))


@dataclasses.dataclass(frozen=True)
class Task:
    """The model a cell trains, its loss ``(model, batch, *frozen)`` and frozen state."""

    model: nnx.Module
    loss: object
    frozen: tuple
    prepare: object  # (batch) -> the step's batch (GliDe's: the target's keys and values added)


@pytest.fixture(scope="module")
def tasks() -> dict[str, Task]:
    rng = np.random.default_rng(0)
    target = random_init(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), rng)
    lm = Task(target, loss_and_stats, (), lambda batch: batch)  # numpy: the references slice it without programs
    cfg = dataclasses.replace(load_config("glide", ["target_run_dir=t", "glide.kl_weight=0.5"]), model=CFG)
    draft = random_init(lambda: GlideDraft(CFG, 1, rngs=nnx.Rngs(0)), rng)
    state = nnx.state(target)
    teach = glide.teacher(target, cfg)
    # The MoE cells: two MoE layers (a stage each under mesh.pipe) with DeepSeek-V3's router bias, a capacity and a shared
    # expert; no balance loss (a function of the batch's statistics, not a mean over rows:
    # test_moe.py checks it across devices)
    moe = MoEConfig(experts=4, experts_per_token=2, expert_width=16, shared_experts=1, capacity_factor=1.0,
                    balance_loss=0.0, router="sigmoid_bias", bias_rate=0.05)
    model = random_init(lambda: Transformer(dataclasses.replace(CFG, layers=2, moe=moe), rngs=nnx.Rngs(0)), rng)
    return {"lm": lm, "moe": Task(model, loss_and_stats, (), lambda batch: batch), "glide": Task(draft, glide.make_loss(cfg, target), (state,),
                                    lambda batch: jax.tree.map(np.asarray, teach(state, batch)))}


def random_batch(seed: int, rows: int) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (rows, T + 1))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((rows, T)),
             "positions": np.tile(np.arange(T), (rows, 1)), "segment_ids": np.ones((rows, T))}
    return {k: v.astype(np.int32) for k, v in batch.items()}


@functools.cache
def _value_and_grad(loss, graphdef):
    def with_stats(p, b, frozen):
        out = loss(nnx.merge(graphdef, p), b, *frozen)
        return out if isinstance(out, tuple) else (out, {})

    return jax.jit(jax.value_and_grad(with_stats, has_aux=True))


def reference_step(task: Task, params, batch: dict, options: dict) -> tuple[float, dict, dict, dict]:
    """One device: ``(loss, reduced gradient, noise-scale norms, statistics)`` at
    ``params`` (numpy) of the cell's replicas, each ``options["rows"]`` consecutive rows
    of ``batch``; the statistics (a MoE model's) summed over the replicas."""
    grad_of = _value_and_grad(task.loss, nnx.graphdef(task.model))
    rows = options["rows"]
    starts = np.cumsum((0, *rows))
    out = [grad_of(params, {k: jnp.asarray(v[a:b]) for k, v in batch.items()}, task.frozen)
           for a, b in zip(starts, starts[1:])]
    losses = np.array([float(loss) for (loss, _), _ in out])
    stats = jax.tree.map(lambda *s: np.sum([np.asarray(x, np.float64) for x in s], axis=0), *[s for (_, s), _ in out])
    stacked = jax.tree.map(lambda *g: np.stack([np.asarray(x, np.float64) for x in g]), *[g for _, g in out])
    reduction = options.get("reduction")
    if reduction is None:  # the whole batch's token-weighted mean: every token counts
        weights = np.asarray(rows, np.float64) / sum(rows)
        loss, grads = float(weights @ losses), jax.tree.map(lambda g: np.tensordot(weights, g, axes=1), stacked)
    elif reduction.kind == "adasum":
        loss, grads = losses.mean(), adasum_reference(stacked)
    else:  # the top-k exchange at ratio 1: the replicas' mean
        loss, grads = losses.mean(), jax.tree.map(lambda g: g.mean(0), stacked)
    norms = {"grad_sq_small": np.mean([sum(np.sum(np.square(g[r])) for g in jax.tree.leaves(stacked))
                                       for r in range(len(rows))]),
             "grad_sq_big": sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads))}
    return loss, grads, norms, stats


def step_batch(batch: dict, rows: tuple[int, ...]) -> dict:
    """``batch`` as the step takes it: with unequal rows each replica's slot of
    ``max(rows)`` rows, its own first, then padding (mask 0)."""
    slot = max(rows)
    if rows == EQUAL_ROWS:
        return batch
    starts = np.cumsum((0, *rows))
    return {k: np.concatenate([np.pad(v[a:b], [(0, slot - (b - a))] + [(0, 0)] * (v.ndim - 1))
                               for a, b in zip(starts, starts[1:])]) for k, v in batch.items()}


def test_every_working_pair_is_trained_in_a_run():
    covered = set().union(*map(pairs_of, RUNS))
    assert covered == set(map(frozenset, WORKS)), sorted(map(sorted, set(map(frozenset, WORKS)) - covered))
    for run in RUNS:
        assert combinations.refusal(dict.fromkeys(run, "")) is None, run
        assert np.prod(list(options_of(*run)["axes"].values())) <= 8, run


@pytest.mark.parametrize("run", RUNS, ids=["+".join(k.split(".")[-1] for k in run) for run in RUNS])
def test_a_run_of_features_that_work_trains_as_one_device(tasks, run):
    options = options_of(*run)
    if run == RUNS[0]:  # the experts split over expert, the batch over data x expert
        options["axes"] = {**options["axes"], "expert": 2}
    if {"mesh.tensor", "mesh.seq"} <= set(run):  # Megatron SP too: the residual stream over seq x tensor
        options["sequence_parallel"] = True
    train_cell(tasks, options)


def train_cell(tasks, options: dict) -> None:
    """Two steps of the cell ``options`` (``options_of``'s) against one device's."""
    task = tasks[options.pop("task")]
    axes, rows = options.pop("axes"), options.pop("rows")
    mesh = jaxpar.make_mesh(**axes, devices=jax.devices()[:int(np.prod(list(axes.values())))], axis_types="auto")
    sp = options.pop("sequence_parallel", False)
    rules = sharding_rules(task.model.cfg, mesh, sequence_parallel=True) if sp else None
    step = make_train_step(task.model, record_then_sgd(), mesh, rules, donate=False,
                           **({"loss": task.loss, "frozen": task.frozen[0]} if task.frozen else {}), **options)
    params, opt_state = step.init(task.model)
    for seed in range(2):
        before = jax.tree.map(np.asarray, step.in_model_order(params))
        batch = task.prepare(random_batch(seed, sum(rows)))
        params, opt_state, metrics = step(params, opt_state, step_batch(batch, rows), *task.frozen)
        loss, grads, norms, stats = reference_step(task, before, batch, {**options, "rows": rows})
        got = step.in_model_order(opt_state)
        compressed = options.get("reduction") is not None and options["reduction"].compressed
        assert tree_rel_err(got[1][0] if compressed else got[0], grads) < 1e-5, seed
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
        if options.get("noise_scale"):
            for key, value in norms.items():
                np.testing.assert_allclose(metrics[key], value, rtol=1e-5, err_msg=key)
            np.testing.assert_allclose(metrics["batch_small"], len(rows) / sum(1 / r for r in rows), rtol=1e-6)
        moved = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, step.in_model_order(params), before)
        if "moe" in stats:
            check_moe(task.model.cfg.moe, metrics, moved, grads, stats["moe"])
        assert tree_rel_err(moved, jax.tree.map(lambda g: -LR * g, grads)) < 1e-4, seed  # float32 parameters


def check_moe(moe: MoEConfig, metrics: dict, moved, grads, stats: np.ndarray) -> None:
    """A MoE cell's metrics are those of the whole batch's statistics, and its router
    bias moved by ``-bias_rate * sign`` of the whole batch's load deviation (its
    gradient, zero, taken out of ``moved`` and ``grads`` for the SGD check after)."""
    assert float(stats[0, 2].sum()) < float(stats[0, 0].sum())  # the capacity drops some
    for key, value in moe_lib.step_metrics(jnp.asarray(stats, jnp.float32), moe).items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-5, err_msg=key)
    counts = stats[:, 0]
    want = -moe.bias_rate * np.sign(counts / counts.sum(-1, keepdims=True) - 1 / moe.experts)
    assert np.any(want) and np.allclose(moved["layers"]["moe"]["router_bias"][...], want, rtol=0, atol=1e-6)
    moved["layers"]["moe"]["router_bias"][...] = grads["layers"]["moe"]["router_bias"][...] = np.zeros_like(want)
