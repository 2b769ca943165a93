"""The GliDe draft model (jaxpar.models.glide) and its training (jaxpar-train glide)."""

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import re
import runpy
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

import jaxpar
from conftest import lowerings, random_init, rel_err
from jaxpar.models import GlideDraft, ModelConfig, Transformer
from jaxpar.models.glide import CrossAttention, DraftVocab, cross_block_mask, feature_sources, inference_cross_mask
from jaxpar.models.cache import DenseCross, init_cache
from jaxpar.train import data, glide, teacher_cache
from jaxpar.train.config import ConfigError, load_config
from jaxpar.commands.train import main
from jaxpar.train.loop import train
from jaxpar.train.step import make_train_step
from test_train import SMALL

CFG = ModelConfig(vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=48, init_std=0.3)
GPT2_STYLE = dataclasses.replace(CFG, norm="layer", mlp="gelu", position="learned", max_position=64,
                                 tie_embeddings=True, attention_bias=True, mlp_bias=True)


def models(cfg, layers, rng, features=False):
    target = random_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), rng)
    return target, random_init(lambda: GlideDraft(cfg, layers, features=features, rngs=nnx.Rngs(0)), rng)


@nnx.jit
def target_cache(target, tokens):
    """The target's keys/values of ``tokens [B, S]``: ``[L, B, S, K, H]`` each."""
    B, S = tokens.shape
    cache = target.decode(tokens, init_cache(target.cfg, B, S)).cache
    return cache.k, cache.v


@nnx.jit
def forward(draft, target, tokens, k, v, mask, positions, cache=None, features=None):
    """The draft's call, jitted: one program per shape rather than one per operation."""
    if cache is None:
        return draft(tokens, target, k, v, mask, positions=positions, features=features)
    return draft.decode(tokens, target, DenseCross(k, v, mask), cache, positions=positions, features=features)[:2]


# The model ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("cfg,layers,features", [(CFG, 1, False), (GPT2_STYLE, 2, False), (CFG, 1, True)],
                         ids=["llama-1", "gpt2-2", "llama-1-features"])
def test_cached_draft_steps_equal_the_uncached_forward(rng, cfg, layers, features):
    target, draft = models(cfg, layers, rng, features)
    B, S, T = 2, 9, 8
    k, v = target_cache(target, jnp.asarray(rng.integers(0, cfg.vocab_size, (B, S))))
    k, v = k[draft.target_layers().start:], v[draft.target_layers().start:]
    assert list(draft.target_layers()) == list(range(cfg.layers - layers, cfg.layers))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)))
    positions = jnp.asarray([[5 + t for t in range(T)], [7 + t for t in range(T)]], jnp.int32)
    target_lengths = jnp.asarray([5, 7])  # each sequence has verified a different prefix
    feats = jnp.asarray(rng.standard_normal((B, T, cfg.dim)), jnp.float32) if features else None
    at = lambda lo, hi: None if feats is None else feats[:, lo:hi]  # noqa: E731

    full = forward(draft, target, tokens, k, v, inference_cross_mask(target_lengths, T, S), positions,
                   features=feats)
    cache = draft.init_cache(B, 12)
    logits, cache = forward(draft, target, tokens[:, :5], k, v, inference_cross_mask(target_lengths, 5, S),
                            positions[:, :5], cache, at(0, 5))
    stepped = [logits]
    for t in range(5, T):
        logits, cache = forward(draft, target, tokens[:, t : t + 1], k, v,
                                inference_cross_mask(target_lengths, 1, S), positions[:, t : t + 1], cache,
                                at(t, t + 1))
        stepped.append(logits)
    np.testing.assert_array_equal(cache.lengths, [T, T])
    assert full.shape == (B, T, cfg.vocab_size) and np.std(np.asarray(full)) > 0.1
    assert rel_err(jnp.concatenate(stepped, axis=1), full) < 1e-5
    if features:  # they are read: other features, other logits; [I, 0] (start_from_target) ignores them
        other = forward(draft, target, tokens, k, v, inference_cross_mask(target_lengths, T, S), positions,
                        features=feats + 1)
        assert rel_err(other, full) > 1e-2
        draft.start_from_target(target)
        plain = forward(draft, target, tokens, k, v, inference_cross_mask(target_lengths, T, S), positions,
                        features=feats)
        assert rel_err(forward(draft, target, tokens, k, v, inference_cross_mask(target_lengths, T, S), positions,
                               features=feats + 1), plain) == 0


def test_feature_sources_of_two_packed_documents():
    """A query reads the target's feature at ``t - 1`` in its document's first block, at
    the position before its block's start in later ones; a document's first token none."""
    positions = jnp.asarray([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])  # two documents, block size 3
    source, has = feature_sources(positions, 3)
    assert has.tolist() == [[False, True, True, True, True, True, True, False, True, True, True]]
    # first document: block 0 is t - 1; block [3, 4, 5] reads 2; block [6] reads 5; then the second's
    assert source[0, 1:7].tolist() == [0, 1, 2, 2, 2, 5] and source[0, 8:].tolist() == [7, 8, 9]


def cross_attention_reference(layer, cfg, x, positions, k, v, mask):
    """Einsums and a softmax in float64 numpy; kv heads repeated for the query heads,
    the query rotated as complex pairs (x[i], x[i + H/2]) times exp(i pos freq)."""
    f64 = lambda a: np.asarray(a, np.float64)
    N, K, H = cfg.heads, cfg.kv_heads, cfg.head_dim
    q = np.einsum("BTD,DNH->BTNH", f64(x), f64(layer.q[...]))
    if cfg.attention_bias:
        q = q + f64(layer.q_bias[...])
    if cfg.position == "rope":
        freqs = 1.0 / cfg.rope_theta ** (np.arange(0, H, 2) / H)
        z = (q[..., : H // 2] + 1j * q[..., H // 2 :]) * np.exp(1j * f64(positions)[:, :, None, None] * freqs)
        q = np.concatenate([z.real, z.imag], -1)
    k, v = np.repeat(f64(k), N // K, axis=2), np.repeat(f64(v), N // K, axis=2)
    scores = np.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(H)
    scores = np.where(np.asarray(mask)[:, None], scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    probs = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    probs = probs / np.maximum(probs.sum(-1, keepdims=True), 1e-300)  # a row that sees nothing: 0
    out = np.einsum("BNTS,BSNH->BTNH", probs, v)
    y = np.einsum("BTNH,NHD->BTD", out, f64(layer.o[...]))
    return y + f64(layer.o_bias[...]) if cfg.attention_bias else y


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, kv_heads=1, rope_theta=500.0), GPT2_STYLE],
                         ids=["gqa-rope", "mqa-rope", "mha-learned-bias"])
def test_cross_attention_matches_a_reference(rng, cfg):
    layer = random_init(lambda: CrossAttention(cfg, rngs=nnx.Rngs(0)), rng)
    B, T, S = 2, 5, 7
    x = rng.standard_normal((B, T, cfg.dim), np.float32)
    positions = rng.integers(0, 50, (B, T))
    k = rng.standard_normal((B, S, cfg.kv_heads, cfg.head_dim), np.float32)
    v = rng.standard_normal((B, S, cfg.kv_heads, cfg.head_dim), np.float32)
    mask = rng.random((B, T, S)) < 0.6
    mask[0, 1] = False  # a query that sees no key reads nothing (not an average of all)
    mask[1, 2] = True
    out = layer(jnp.asarray(x), jnp.asarray(positions), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    assert out.shape == (B, T, cfg.dim)
    assert rel_err(out, cross_attention_reference(layer, cfg, x, positions, k, v, mask)) < 1e-5


def test_cross_block_mask_of_two_packed_documents():
    # Documents of 7 and 4 tokens, blocks of 3: [0 1 2][3 4 5][6] and [0 1 2][3].
    positions = jnp.asarray([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])
    segment_ids = jnp.asarray([[1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]])
    expected = np.array([
        # 0  1  2  3  4  5  6  0  1  2  3   <- key positions
        [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # doc 1, block 0: causal
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # block 1: block 0 only
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0],  # block 2: blocks 0 and 1
        [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],  # doc 2, block 0: causal, its own document
        [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0],  # block 1
    ], bool)
    np.testing.assert_array_equal(cross_block_mask(positions, segment_ids, 3)[0], expected)
    np.testing.assert_array_equal(inference_cross_mask(jnp.asarray([2, 4]), 2, 5),
                                  [[[1, 1, 0, 0, 0]] * 2, [[1, 1, 1, 1, 0]] * 2])


def test_training_mask_hides_the_targets_own_block_and_later(rng):
    """Under cross_block_mask a draft token's logits do not move when the target's
    keys/values of its own block or later change (the target has not verified them)."""
    target, draft = models(CFG, 1, rng)
    T = 9
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (1, T)))
    positions = jnp.arange(T)[None]
    k, v = (x[1:] for x in target_cache(target, tokens))
    mask = cross_block_mask(positions, None, 3)
    logits = forward(draft, target, tokens, k, v, mask, positions)
    moved = forward(draft, target, tokens, k.at[:, :, 4].add(1.0), v.at[:, :, 4].add(1.0), mask, positions)
    changed = np.abs(np.asarray(moved - logits)).max(-1)[0] > 1e-6
    np.testing.assert_array_equal(changed, [False] * 6 + [True] * 3)  # slot 4 is in block 1


def test_draft_parameters_are_stacked_and_annotated():
    draft = nnx.eval_shape(lambda: GlideDraft(GPT2_STYLE, 2, rngs=nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(nnx.state(draft)))
    for path, var in flat.items():
        names = jaxpar.placement.sharding.logical_axes(var)
        assert names is not None and len(names) == var.get_value().ndim, path
        if path[0] == "layers":
            assert names[0] == "layers" and var.get_value().shape[0] == 2
    assert {("layers", "cross", n) for n in ("q", "o", "q_bias", "o_bias")} <= set(flat)
    assert not any(p[0] in ("embed", "lm_head", "positions") for p in flat)  # the target's
    with pytest.raises(ValueError, match="GliDe draft layers=3 must be between 1 and the target's model.layers=2"):
        nnx.eval_shape(lambda: GlideDraft(CFG, 3, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("cfg,features", [(CFG, False), (GPT2_STYLE, False), (CFG, True)],
                         ids=["llama", "gpt2", "llama-features"])
def test_a_draft_starts_from_the_target_layers_it_reads(rng, cfg, features):
    """start_from_target: draft layer i is target layer target_layers()[i] (its
    cross-attention that layer's attention's q, o and norm), the final norm the target's;
    with features, the fuse [I, 0] and the features' norm at the embeddings' scale."""
    target, draft = models(dataclasses.replace(cfg, layers=3), 2, rng, features)
    draft.start_from_target(target)
    mine, theirs = nnx.to_flat_state(nnx.state(draft)), dict(nnx.to_flat_state(nnx.state(target)))
    source = {"cross_norm": "attn_norm", "cross": "attn"}
    embed = np.asarray(target.embed[...], np.float64)
    own = {("fuse",): np.stack([np.eye(cfg.dim), np.zeros((cfg.dim, cfg.dim))]),
           ("feature_norm", "scale"): np.full(cfg.dim, np.sqrt(np.mean(embed ** 2)))}
    for path, var in mine:
        if path in own:
            np.testing.assert_allclose(var.get_value(), own.pop(path), rtol=1e-6, err_msg=str(path))
        elif path[0] == "layers":
            their = theirs[("layers", source.get(path[1], path[1]), *path[2:])].get_value()
            np.testing.assert_array_equal(var.get_value(), their[1:], err_msg=str(path))
        else:
            np.testing.assert_array_equal(var.get_value(), theirs[path].get_value(), err_msg=str(path))
    assert len(own) == (0 if features else 2), own  # with features, both were checked
    with pytest.raises(ValueError, match="the draft is for a target of 3 x 32, not 2 x 32"):
        draft.start_from_target(models(cfg, 1, rng)[0])


@pytest.mark.slow
def test_the_target_is_an_argument_of_the_step_not_a_constant(rng):
    """The train step and the teacher take the target's state as an argument: its
    weights are not in their programs, and they are not trained."""
    cfg = dataclasses.replace(load_config("glide", ["target_run_dir=t", "glide.kl_weight=0.5"]), model=CFG)
    target, draft = models(CFG, 1, rng)
    state = nnx.state(target)
    B, T = 2, 10
    tokens = rng.integers(0, CFG.vocab_size, (B, T + 1))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.tile(np.arange(T), (B, 1)),
             "segment_ids": np.ones((B, T), np.int32), "mask": np.ones((B, T), np.int32)}
    teach = glide.teacher(target, cfg)
    batch = teach(state, {k: jnp.asarray(x, jnp.int32) for k, x in batch.items()})
    assert batch["target_k"].shape == (B, T, 1, CFG.kv_heads, CFG.head_dim)
    assert batch["target_logprobs"].shape == (B, T, CFG.vocab_size)
    step = make_train_step(draft, optax.adam(1e-2), loss=glide.make_loss(cfg, target), frozen=state)
    params, opt_state = step.init(draft)
    for program in (teach.lower(state, batch), step.step.lower(params, opt_state, batch, state)):
        assert not re.search(r"dense<[^>]{200}", program.as_text())  # no large constant
    before = jax.tree.map(np.array, state)
    losses = []
    for _ in range(5):
        params, opt_state, metrics = step(params, opt_state, batch, state)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] and all(map(math.isfinite, losses))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, state), before)


# Training -------------------------------------------------------------------------------

# The data settings of test_train's runs; model.* of a glide run comes from its target.
DATA = [o for o in SMALL if not o.startswith("model.")] + ["data.max_files=40"]


@pytest.fixture(scope="module")
def target_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("glide")
    run = root / "target"
    train(load_config("tiny", SMALL + ["data.max_files=40", "steps=3", "eval.every=0",
                                        f"run_dir={run}", f"cache_dir={root / 'cache'}"]), progress=False)
    return run


@pytest.fixture(scope="module")
def glide_run(target_run):
    run = target_run.parent / "draft"
    # The CLI's main in this process (its 8 devices): a subprocess would compile afresh.
    code = main(["glide", f"target_run_dir={target_run}", f"run_dir={run}", f"cache_dir={target_run.parent / 'cache'}",
                 *DATA, "steps=6", "eval.every=3", "checkpoint.every=3", "glide.kl_weight=0.5", "glide.init=random",
                 "--no-progress"])
    assert code == 0
    return run


def correlation_with_the_last_layer(draft, target) -> float:
    """The least correlation of a one-layer draft's MLP and cross-attention query weights
    with the target's last layer's MLP and attention query."""
    pairs = ((draft.layers.mlp.down, target.layers.mlp.down), (draft.layers.cross.q, target.layers.attn.q))
    return min(np.corrcoef(np.ravel(mine[...]), np.ravel(theirs[...][-1]))[0, 1] for mine, theirs in pairs)


@pytest.mark.slow
def test_glide_training_end_to_end(target_run, glide_run):
    from jaxpar.train.runs import load_glide_draft, load_model

    run = glide_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    losses = [r["loss"] for r in rows] + [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(losses) == 8 and all(map(math.isfinite, losses))
    assert min(r["loss"] for r in rows[3:]) < rows[0]["loss"]
    assert sorted(os.listdir(run / "checkpoints")) == ["3", "6"]

    saved = yaml.safe_load((run / "config.yaml").read_text())
    target_cfg = yaml.safe_load((target_run / "config.yaml").read_text())
    assert saved["task"] == "glide" and saved["target_run_dir"] == str(target_run)
    assert saved["model"] == target_cfg["model"] and saved["glide"]["kl_weight"] == 0.5
    assert saved["glide"]["init"] == "random"
    assert saved["data"]["tokenizer"] == str(target_run / "tokenizer.json")
    assert (run / "tokenizer.json").read_text() == (target_run / "tokenizer.json").read_text()

    draft, target = load_glide_draft(run), load_model(target_run)
    assert isinstance(draft, GlideDraft) and draft.cfg == target.cfg and draft.num_layers == 1
    tokens = jnp.arange(12)[None] + 3
    k, v = (x[draft.target_layers().start:] for x in target_cache(target, tokens))
    logits = draft(tokens, target, k, v, cross_block_mask(jnp.arange(12)[None], None, 5), positions=jnp.arange(12)[None])
    assert logits.shape == (1, 12, target.cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()
    assert abs(correlation_with_the_last_layer(draft, target)) < 0.5  # glide.init=random
    step3 = load_glide_draft(run, step=3)  # an earlier checkpoint (bench/glide_curve.py)
    assert not np.array_equal(step3.layers.mlp.down[...], draft.layers.mlp.down[...])
    with pytest.raises(ValueError, match=r"no checkpoint of step 4 in .* \(steps there: \[3, 6\]\)"):
        load_glide_draft(run, step=4)
    with pytest.raises(ValueError, match="is not a GliDe draft run"):
        load_glide_draft(target_run)


def test_glide_without_a_target_is_one_line_and_writes_nothing(tmp_path, capsys):
    assert main(["glide", f"run_dir={tmp_path / 'draft'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "target_run_dir" in lines[0], lines
    assert not (tmp_path / "draft").exists()


@pytest.mark.slow
@pytest.mark.parametrize("override,message", [
    ("glide.layers=3", "glide.layers=3 exceeds the target's model.layers=2"),
    ("model.layers=3", "model.* of a glide run is its target's"),
    ("dry_run=true", "dry_run=true is not supported with task=glide"),
    ("glide.draft_vocab=512", "glide.draft_vocab=512 must be below the target's vocabulary of 512 tokens"),
    ("glide.self_distill=true glide.prompt_tokens=128",
     "glide.prompt_tokens=128 must be below seq_len=128: a self-distilled row is a prompt and the target's"),
])
def test_glide_settings_the_target_refuses(target_run, override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        glide.prepare(load_config("glide", [f"target_run_dir={target_run}", *override.split()]))


@pytest.mark.parametrize("override,message", [
    ("glide.layers=0", "glide.layers=0 must be at least 1"),
    ("glide.block_size=1", "glide.block_size=1 must be at least 2"),
    ("glide.kl_weight=-1", "glide.kl_weight=-1.0 must not be negative"),
    ("glide.teacher_topk=0", "glide.teacher_topk=0 must be at least 1"),
    ("glide.draft_vocab=0", "glide.draft_vocab=0 must be at least 1"),
    ("glide.prompt_tokens=0", "glide.prompt_tokens=0 must be at least 1"),
    ("glide.generate_batch=0", "glide.generate_batch=0 must be at least 1"),
    ("glide.distill=full glide.teacher_cache=/c", "glide.distill='full' reads the live target's whole distribution"),
])
def test_glide_config(override, message):
    cfg = load_config("glide", ["target_run_dir=runs/tiny"])
    assert cfg.task == "glide" and cfg.glide.layers == 1 and cfg.glide.block_size == 5
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("glide", ["target_run_dir=runs/tiny", *override.split()])


def test_distillation_defaults_follow_the_vocabulary():
    """Unset, distillation is on and reads the top-k for a large vocabulary (32,000 or
    more), off (and whole) below; a teacher cache reads the top-k; set values stay."""
    unset = load_config("glide", ["target_run_dir=t"]).glide
    assert (unset.kl_weight, unset.distill, unset.teacher_topk) == (None, "auto", 64)
    decided = lambda g, V: (glide.resolve(g, V).kl_weight, glide.resolve(g, V).distill)  # noqa: E731
    assert decided(unset, 49_152) == decided(unset, 32_000) == (1.0, "topk")
    assert decided(unset, 31_999) == (0.0, "full")
    assert decided(dataclasses.replace(unset, teacher_cache="/c"), 512) == (0.0, "topk")
    explicit = load_config("glide", ["target_run_dir=t", "glide.kl_weight=0.25", "glide.distill=full"]).glide
    assert decided(explicit, 49_152) == (0.25, "full")


def generate_cli(capsys, *args):
    """``jaxpar-generate ARGS --json`` in this process: ``(exit code, JSON or None, stderr)``."""
    from jaxpar.commands.generate import main as generate

    try:
        code = generate([*map(str, args), "--json"])
    except SystemExit as e:  # bad input: parser.error's exit 2
        code = e.code
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_ar_is_one_program_whatever_a_drafts_settings_say():
    """ar reads none of a draft's settings, so it decodes with one program whatever gamma,
    bins, lookup or runner-up a caller passes (jaxpar-generate times its ar baseline with
    the drafted method's, bench/glide_curve.py its reference at its gamma); sampling
    settings are ar's own."""
    from jaxpar.inference import decoding

    target = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    method = lambda *settings: decoding._setup(target, [[1, 2, 3]], None, "ar", *settings)[0]  # noqa: E731
    plain = method(1, decoding.DEFAULT_BINS, 0.0, 1.0, 4)
    assert method(3, (2,) * 11, 0.0, 1.0, 4, "tree") == plain
    assert method(4, decoding.DEFAULT_BINS, 0.0, 1.0, 4, "select", 2, True) == plain
    assert method(1, decoding.DEFAULT_BINS, 0.8, 0.9, 4) != plain


@pytest.fixture(scope="module")
def vanilla_run(target_run):
    """An independent one-layer draft with the target's tokenizer (the same data cache)."""
    run = target_run.parent / "vanilla"
    train(load_config("tiny", SMALL + ["data.max_files=40", "steps=3", "eval.every=0", "model.layers=1",
                                        f"run_dir={run}", f"cache_dir={target_run.parent / 'cache'}"]),
          progress=False)
    return run


@pytest.mark.slow
def test_generate_with_trained_drafts_gives_the_targets_tokens(target_run, glide_run, vanilla_run, capsys,
                                                              tmp_path):
    """jaxpar-generate on trained runs: every method prints ar's greedy tokens and its
    accepted tokens per step; mismatched drafts and settings are one line, exit 1."""
    vanilla = vanilla_run
    common = [target_run, "--prompt", "def main(", "--max-new-tokens", "20", "--gamma", "3"]
    code, ar, err = generate_cli(capsys, *common)
    assert code == 0, err
    assert "accepted_per_step" not in ar and len(ar["tokens"]) > 0
    # Each method and each of --lookup's kinds and --runner-up once through the command
    # line: test_speculative_benchmark's rows check more of their combinations lossless
    # on these runs (plain speculative and glide, each with select; each row here is a
    # decoding loop more to compile).
    for draft, method, *lookup in [(vanilla, "speculative", "--lookup", "select", "--runner-up"),
                                   (glide_run, "cape"), (vanilla, "cape"), (glide_run, "glide", "--lookup", "tree")]:
        code, out, err = generate_cli(capsys, *common, "--draft", draft, "--method", method, *lookup)
        assert code == 0, err
        assert out["tokens"] == ar["tokens"] and out["text"] == ar["text"]
        assert 1.0 <= out["accepted_per_step"] <= 4.0 and out["method"] == method and out["speedup"] > 0

    # A Hugging Face target (the same weights, exported) pairs with the same GliDe draft.
    from jaxpar.models import to_hf
    from jaxpar.train.data import EOS
    from jaxpar.train.runs import load_run, load_tokenizer

    hf_dir = tmp_path / "hf"
    to_hf(load_run(target_run), hf_dir)
    (hf_dir / "tokenizer.json").write_text((target_run / "tokenizer.json").read_text())
    eos = load_tokenizer(target_run).token_to_id(EOS)  # where the run stops, as HF names it
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    code, out, err = generate_cli(capsys, hf_dir, *common[1:], "--draft", glide_run, "--method", "cape")
    assert code == 0, err
    assert out["tokens"] == ar["tokens"]
    prepared, target = glide.prepare(load_config("glide", [f"target_run_dir={hf_dir}"]))
    assert target.cfg == prepared.model and prepared.data.tokenizer == str(hf_dir / "tokenizer.json")

    other = tmp_path / "other-tokenizer"
    other.mkdir()
    (other / "config.yaml").write_text((vanilla / "config.yaml").read_text())
    (other / "checkpoints").symlink_to(vanilla / "checkpoints")
    vocab = json.loads((vanilla / "tokenizer.json").read_text())
    first, second = list(vocab["model"]["vocab"])[300:302]  # two tokens swap ids
    vocab["model"]["vocab"][first], vocab["model"]["vocab"][second] = (
        vocab["model"]["vocab"][second], vocab["model"]["vocab"][first])
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    for args, message in [
        (["--draft", other], "the draft's tokenizer"),
        (["--draft", glide_run, "--gamma", "0"], "gamma=0 must be at least 1"),
        (["--draft", glide_run, "--method", "cape", "--bins", "4", "2"], "bins=[4, 2] must be 11 positive integers"),
        (["--draft", glide_run, "--method", "cape", "--temperature", "0.8"], "'cape' is greedy"),
        (["--draft", vanilla, "--method", "glide"], "needs a GliDe draft"),
        (["--draft", glide_run, "--method", "cape", "--lookup", "tree"], "lookup goes with a greedy 'speculative' or 'glide'"),
    ]:
        code, _, err = generate_cli(capsys, *common, *args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], err


@pytest.mark.slow
def test_speculative_benchmark(target_run, glide_run, vanilla_run, capsys, monkeypatch, tmp_path):
    """bench/speculative.py as a newcomer runs it (in this process, small): code, chat and
    prose prompts, its table with each draft's training cost, every method lossless (the
    GliDe draft restricted at decoding to 100 tokens too, and the drafts with prompt
    lookup), the picture and the JSON, with two GliDe runs in one loop rows of each
    run's name; then bench/glide_curve.py, bench/round_cost.py, bench/round_profile.py and
    bench/speculative_runs.py.

    Prompt lookup ``select`` alone: a ``--lookup`` kind's rows are made by one loop over the
    kinds; ``tree``'s rounds on these trained runs are lossless in
    test_generate_with_trained_drafts_gives_the_targets_tokens (and on random drafts in
    test_speculative), two loops fewer to compile here. Without ``--runner-up``: its rows
    are each row above with one flag more (``runner_up_of``), four programs more to
    compile (6 CPU-s); its rounds are lossless on these runs through jaxpar-generate (that
    test) and on random drafts, with and without prompt lookup, in test_speculative.

    Every decoding here is one prompt of 32 tokens (the code and prose prompts cut to the
    chat prompt's length in this tokenizer) with 12 new tokens at gamma 4, so the table's
    programs serve glide_curve's decodings and (through the persistent cache) round_profile's."""
    script = pathlib.Path(__file__).resolve().parents[1] / "bench" / "speculative.py"
    png = ["--png", str(tmp_path / "s.png")] if importlib.util.find_spec("matplotlib") else []  # the bench extra
    again = tmp_path / "again"  # a second GliDe run: the same one by another name
    again.symlink_to(glide_run, target_is_directory=True)
    monkeypatch.setattr(sys, "argv", [str(script), "--target", str(target_run), "--draft", str(vanilla_run),
                                      "--glide", str(glide_run), str(again), "--prompts", "1", "--prompt-tokens", "32",
                                      "--max-new-tokens", "12", "--batch", "1", "--repeats", "1",
                                      "--draft-vocab", "100", "--lookup", "select",
                                      "--json", str(tmp_path / "s.json"), *png])
    runpy.run_path(str(script), run_name="__main__")
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| method | batch | accepted/round (code / chat / prose) | all |")
    assert {r.count("|") for r in rows} == {rows[0].count("|")}  # a markdown table: every row as wide as its header
    name = glide_run.name
    assert [r.split("|")[1].strip() for r in rows[1:]] == [
        "ar", "speculative", f"glide:{name}", f"cape:{name}", f"glide:{name}@100", "glide:again", "cape:again",
        "glide:again@100", "speculative+lookup-select", f"glide+lookup-select:{name}", "glide+lookup-select:again"]
    assert all("| yes |" in r for r in rows[1:]) and "6 steps" in rows[3]  # the GliDe run's 6 steps
    results = json.loads((tmp_path / "s.json").read_text())["results"]
    by_name = {r["method"]: r for r in results}
    assert set(by_name[f"glide:{name}"]["by_kind"]) == {"code", "chat", "prose"}
    assert by_name[f"cape:{name}"]["accepted_per_step"] == by_name["cape:again"]["accepted_per_step"]
    assert [r["gamma"] for r in results] == [None] + [4] * 10
    for r in results:  # a round's time in ar steps: accepted tokens a round over the speedup
        assert math.isclose(r["round_in_ar_steps"], r["accepted_per_step"] / r["speedup"])
        assert len(r["speedup_by_repeat"]) == 1 and math.isclose(r["speedup_by_repeat"][0], r["speedup"])
    assert not png or (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")

    # bench/glide_curve.py: the draft's acceptance at each checkpoint (the table's code prompt).
    curve = runpy.run_path(str(script.with_name("glide_curve.py")), run_name="glide_curve")
    png = ["--png", str(tmp_path / "c.png")] if png else []
    curve["main"](["--target", str(target_run), "--runs", f"draft={glide_run}", "--kinds", "code", "--prompts", "1",
                   "--prompt-tokens", "32", "--max-new-tokens", "12", "--json", str(tmp_path / "c.json"), *png])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| draft |")]
    assert [r.split("|")[2].strip() for r in rows] == ["3", "6"] and all(r.endswith("| yes |") for r in rows)
    points = json.loads((tmp_path / "c.json").read_text())["curves"]["draft"]
    val_losses = {r["step"]: r["val_loss"] for r in map(json.loads, (glide_run / "metrics.jsonl").read_text().splitlines())
                  if "val_loss" in r}
    assert [p["val_loss"] for p in points] == [val_losses[3], val_losses[6]]
    assert all(1 <= p["accepted_per_round"] <= 5 for p in points)
    assert not png or (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")

    # bench/round_cost.py: what a round's passes cost, and the round they predict.
    costs = runpy.run_path(str(script.with_name("round_cost.py")), run_name="round_cost")
    costs["main"](["--target", str(target_run), "--glide", str(glide_run), "--context", "8", "--tokens", "1", "3",
                   "--gamma", "2", "--repeats", "2", "--json", str(tmp_path / "r.json")])
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r for r in rows if "over" in r] == ["target over 1 token", "target over 3 tokens", "draft over 1 token",
                                                "draft over 2 tokens"]
    measured = json.loads((tmp_path / "r.json").read_text())
    seconds, predicted = measured["seconds"], measured["predicted_round_in_ar_steps"]["2"]
    assert math.isclose(predicted, (seconds["target"]["3"] + seconds["draft"]["2"] + seconds["draft"]["1"])
                        / seconds["target"]["1"])

    # bench/round_profile.py: a round's time split by the name scopes of its parts.
    profile = runpy.run_path(str(script.with_name("round_profile.py")), run_name="round_profile")
    profile["main"](["--target", str(target_run), "--glide", str(glide_run), "--gamma", "4", "--prompt-tokens", "32",
                     "--max-new-tokens", "12", "--repeats", "1", "--json", str(tmp_path / "p.json")])  # one trace each
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["ar", "glide, gamma 4", "cape, gamma 4"]
    split = {name: r["ms"] for name, r in json.loads((tmp_path / "p.json").read_text()).items()}
    assert split["ar"]["draft"] == 0 and split["glide, gamma 4"]["draft"] > 0
    assert all(ms["target head"] > 0 and ms["target layers: matmuls"] > 0 for ms in split.values())

    # bench/speculative_runs.py: the same rows across runs (here the run above, and a copy of
    # it with one row dropped and its speedups halved), their median, low and high.
    first = json.loads((tmp_path / "s.json").read_text())
    second = {"meta": first["meta"], "results": [{**r, "speedup": r["speedup"] / 2} for r in first["results"][:-1]]}
    (tmp_path / "s2.json").write_text(json.dumps(second))
    across = runpy.run_path(str(script.with_name("speculative_runs.py")), run_name="speculative_runs")
    png = ["--png", str(tmp_path / "runs.png")] if png else []
    across["main"]([str(tmp_path / "s.json"), str(tmp_path / "s2.json"), "--labels", "one", "two", *png])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [c.strip() for c in rows[0]] == ["method", "gamma", "batch", "one", "two", "median", "low-high"]
    by_row = {(r[0].strip(), r[1].strip()): [c.strip() for c in r[3:]] for r in rows[2:]}
    glide = first["results"][2]
    assert glide["method"] == f"glide:{name}" and by_row[(glide["method"], "4")] == [
        f"{glide['speedup']:.2f}x", f"{glide['speedup'] / 2:.2f}x", f"{0.75 * glide['speedup']:.2f}x",
        f"{glide['speedup'] / 2:.2f}-{glide['speedup']:.2f}x"]
    last = first["results"][-1]  # in the first run only
    assert by_row[(last["method"], "4")][1] == "" and by_row[(last["method"], "4")][2] == f"{last['speedup']:.2f}x"
    assert not png or (tmp_path / "runs.png").read_bytes().startswith(b"\x89PNG")
    other = {**first, "meta": {**first["meta"], "max_new_tokens": 99}}
    (tmp_path / "s3.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="measured other work: max_new_tokens 99 against 12"):
        across["main"]([str(tmp_path / "s.json"), str(tmp_path / "s3.json")])
    with pytest.raises(SystemExit, match="p.json: not a bench/speculative.py --json file"):  # round_profile's
        across["main"]([str(tmp_path / "s.json"), str(tmp_path / "p.json")])


# The teacher cache ----------------------------------------------------------------------

def random_rows(rng, docs=14, seq_len=10):
    """Packed rows of random documents over CFG's vocabulary (EOS 0)."""
    return data.pack([rng.integers(1, CFG.vocab_size, rng.integers(3, 20)) for _ in range(docs)], seq_len, 0)


class Teaching:
    """A random target, its live teacher with top-k outputs, and what ``open_cache``
    takes: ``compute`` counts its calls and raises KeyboardInterrupt at call
    ``interrupt_at`` (an interrupted build)."""

    def __init__(self, rng, topk=8, batch_size=4):
        self.target = random_init(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), rng)
        self.cfg = dataclasses.replace(load_config("glide", ["target_run_dir=t", f"glide.teacher_topk={topk}",
                                                              f"batch_size={batch_size}"]), model=CFG)
        self.live = glide.teacher(self.target, self.cfg, outputs="topk")
        self.state = nnx.state(self.target)
        self.calls, self.interrupt_at = 0, None

    def teach(self, batch):
        return self.live(self.state, {k: jnp.asarray(x) for k, x in batch.items()})

    def compute(self, batch):
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        out = self.teach(batch)
        return {name: np.asarray(out[key]) for name, key in teacher_cache.BATCH_KEYS.items() if key in out}

    def spec(self, rows, target=None, tokenizer="tokenizer", topk=8):
        target = target or self.target
        return teacher_cache.spec(target, teacher_cache.params_fingerprint(target), tokenizer,
                                  {"path": "corpus"}, rows, range(1, 2), topk)

    def open(self, directory, rows, **spec):
        return teacher_cache.open_cache(directory, self.spec(rows, **spec), rows, self.compute,
                                        self.cfg.batch_size)


def test_an_interrupted_teacher_cache_is_completed_not_used(rng, tmp_path, monkeypatch):
    """A build stopped after its first shard leaves a manifest marked incomplete; the
    next open computes only the missing shards, and then reads what the live teacher
    gives. A complete cache missing a shard file has it recomputed."""
    teaching = Teaching(rng)
    rows = {"train": random_rows(rng), "validation": random_rows(rng, docs=4)}
    per_row = teaching.spec(rows).bytes_per_token * rows["train"].seq_len
    monkeypatch.setattr(teacher_cache, "SHARD_BYTES", 4 * per_row)  # 4 rows a shard: several
    R = len(rows["train"])
    assert R > 8 and len(rows["validation"]) >= 1
    shards = -(-R // 4) + -(-len(rows["validation"]) // 4)
    teaching.interrupt_at = 2
    with pytest.raises(KeyboardInterrupt):
        teaching.open(tmp_path, rows)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["shard_rows"] == 4
    assert sorted(p.name for p in tmp_path.glob("train-*.npy")) == [f"train-00000.{a}.npy" for a in sorted(teacher_cache.ARRAYS)]

    teaching.calls, teaching.interrupt_at = 0, None
    cache = teaching.open(tmp_path, rows)
    assert teaching.calls == shards - 1  # every shard but the one written before the interruption
    assert json.loads((tmp_path / "manifest.json").read_text())["complete"] is True
    index = np.array([R - 1, 0, 5, 2])
    cached = cache.rows("train", index)
    live = teaching.teach(data.batch_of_rows(rows["train"], index))
    assert set(cached) == {teacher_cache.BATCH_KEYS[name] for name in teacher_cache.ARRAYS}
    for key, array in cached.items():
        np.testing.assert_array_equal(array, np.asarray(live[key]), err_msg=key)
    assert cached["target_k"].shape == (4, 10, 1, CFG.kv_heads, CFG.head_dim)
    assert cached["target_topk_ids"].dtype == np.int32 and cached["target_topk_logprobs"].shape == (4, 10, 8)

    (tmp_path / "train-00001.v.npy").unlink()
    teaching.calls = 0
    cache = teaching.open(tmp_path, rows)
    assert teaching.calls == 1
    np.testing.assert_array_equal(cache.rows("train", [5])["target_v"], np.asarray(live["target_v"])[2:3])
    teaching.calls = 0
    teaching.open(tmp_path, rows)
    assert teaching.calls == 0  # complete: the target is not run


def test_the_teacher_cache_refuses_another_target_or_corpus(rng, tmp_path):
    """(And the teacher of another target of the same config is the program the first
    compiled: its weights are an argument, so running it lowers nothing.)"""
    teaching = Teaching(rng)
    rows = {"train": random_rows(rng)}
    teaching.open(tmp_path, rows)
    again = Teaching(rng)  # other random weights
    assert again.live is teaching.live
    batch = data.batch_of_rows(rows["train"], np.arange(4))
    with lowerings() as lowered:
        out = again.teach(batch)
    assert lowered == [] and not np.array_equal(out["target_k"], teaching.teach(batch)["target_k"])  # its weights'
    other = random_init(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), rng)
    wider = nnx.eval_shape(lambda: Transformer(dataclasses.replace(CFG, mlp_dim=64), rngs=nnx.Rngs(0)))
    shuffled = data.PackedRows(*(a[::-1].copy() for a in dataclasses.astuple(rows["train"])))
    fewer = data.PackedRows(*(a[:-1] for a in dataclasses.astuple(rows["train"])))
    for kwargs, message in [
        (dict(target=other), "another target (its parameters differ: sha256"),
        (dict(tokenizer="another"), "another corpus (another tokenizer)"),
        (dict(rows={"train": shuffled}), "another corpus (its train rows differ)"),
        (dict(rows={"train": fewer}), f"another corpus (train rows, glide.train_rows: {len(shuffled)} there, "
                                      f"{len(fewer)} here)"),
        (dict(rows={"train": random_rows(rng, seq_len=12)}), "another corpus (seq_len: 10 there, 12 here)"),
        (dict(topk=4), "another topk (glide.teacher_topk: 8 there, 4 here)"),
    ]:
        spec_rows = kwargs.pop("rows", rows)
        target = kwargs.pop("target", teaching.target)
        spec = teaching.spec(spec_rows, target, **kwargs)
        with pytest.raises(teacher_cache.TeacherCacheMismatch) as error:
            teacher_cache.open_cache(tmp_path, spec, spec_rows, teaching.compute, 4)
        assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    spec = teacher_cache.spec(wider, "not-read", "tokenizer", {}, rows, range(1, 2), 8)
    with pytest.raises(teacher_cache.TeacherCacheMismatch, match=re.escape("another target (model.mlp_dim: 48 there, 64 here)")):
        teacher_cache.open_cache(tmp_path, spec, rows, teaching.compute, 4)
    (tmp_path.parent / "stray").mkdir()
    (tmp_path.parent / "stray" / "notes.txt").write_text("mine")
    with pytest.raises(teacher_cache.TeacherCacheMismatch, match="is not empty and holds no manifest.json"):
        teaching.open(tmp_path.parent / "stray", rows)


# Distillation and the draft's vocabulary --------------------------------------------------


def kl_reference(target_logp, ids, logits, vocab_ids=None):
    """Top-k KL in float64 numpy, one position at a time."""
    out = np.zeros(target_logp.shape[:-1])
    for pos in np.ndindex(*out.shape):
        keep = [j for j, t in enumerate(ids[pos]) if vocab_ids is None or t in vocab_ids]
        if not keep:
            continue
        column = [int(ids[pos][j]) if vocab_ids is None else int(np.searchsorted(vocab_ids, ids[pos][j]))
                  for j in keep]
        p = np.exp(np.float64(target_logp[pos][keep]))
        p /= p.sum()
        q = np.exp(np.float64(logits[pos][column]) - np.float64(logits[pos][column]).max())
        q /= q.sum()
        out[pos] = (p * np.log(p / q)).sum()
    return out


def test_topk_kl_matches_a_reference(rng):
    B, T, V, k = 2, 5, 40, 6
    topk_kl = jax.jit(glide.topk_kl, static_argnums=3)
    full = rng.standard_normal((B, T, V)).astype(np.float32) * 2
    logp = np.asarray(jax.nn.log_softmax(full, -1))
    order = np.argsort(-logp, -1)
    top, ids = np.take_along_axis(logp, order[..., :k], -1), order[..., :k].astype(np.int32)
    logits = rng.standard_normal((B, T, V)).astype(np.float32)
    assert rel_err(topk_kl(top, ids, logits, None), kl_reference(top, ids, logits)) < 1e-5
    # With k = V it is the whole distributions' KL.
    whole = np.take_along_axis(logp, order, -1)
    assert rel_err(topk_kl(whole, order.astype(np.int32), logits, None),
                   glide.full_kl(jnp.asarray(logp), jnp.asarray(logits), None)) < 1e-5
    # Over a draft vocabulary: the teacher's tokens in it, renormalised; none in it, 0.
    vocab_ids = np.sort(rng.choice(V, 15, replace=False))
    vocab = DraftVocab(vocab_ids, V)
    ids[0, 0] = [t for t in range(V) if t not in vocab_ids][:k]
    sub = logits[..., vocab_ids]
    kl = topk_kl(top, ids, sub, vocab)
    assert float(kl[0, 0]) == 0.0
    assert rel_err(kl, kl_reference(top, ids, sub, vocab_ids)) < 1e-5
    grads = jax.jit(jax.grad(lambda l: glide.topk_kl(top, ids, l, vocab).sum()))(sub)
    assert np.isfinite(np.asarray(grads)).all() and np.abs(np.asarray(grads)).max() > 0


@nnx.jit
def head(draft, target, x):
    """The draft's head over ``x [B, T, D]``: its logits (and with a vocabulary, also
    over the whole vocabulary)."""
    logits = draft.logits(x, target)
    return logits if draft.vocab is None else (logits, draft.vocab.full_logits(logits))


@pytest.mark.slow
def test_a_draft_vocabulary_slices_the_shared_head(rng):
    """A draft over N tokens gives the whole-vocabulary draft's logits of those tokens
    (its head: those columns of the target's; tied and untied), -inf elsewhere in
    full_logits."""
    for cfg in (CFG, GPT2_STYLE):
        target, draft = models(cfg, 1, rng)
        ids = np.sort(rng.choice(cfg.vocab_size, 20, replace=False))
        graphdef = nnx.graphdef(GlideDraft(cfg, 1, vocab=DraftVocab(ids, cfg.vocab_size), rngs=nnx.Rngs(0)))
        restricted = nnx.merge(graphdef, nnx.state(draft))  # the same layers, a sliced head
        x = jnp.asarray(rng.standard_normal((2, 3, cfg.dim)), jnp.float32)
        logits, spread = head(restricted, target, x)
        assert logits.shape == (2, 3, 20)
        assert rel_err(logits, np.asarray(head(draft, target, x))[..., ids]) < 1e-5
        spread = np.asarray(spread)
        np.testing.assert_array_equal(spread[..., ids], np.asarray(logits))
        assert np.isneginf(np.delete(spread, ids, axis=-1)).all()
    with pytest.raises(ValueError, match="sorted, distinct and below the target's vocabulary of 64 tokens"):
        DraftVocab([3, 3, 5], 64)


# Top-k distillation on the run's rows, from a cache the first run builds.
CACHED_RUN = ["glide.train_rows=16", "glide.distill=topk", "glide.kl_weight=0.5", "glide.teacher_topk=8",
              "steps=3", "eval.every=3", "eval.batches=1", "checkpoint.every=0", "--no-progress"]


@pytest.mark.slow
def test_drafts_from_the_teacher_cache_equal_drafts_from_the_live_target(target_run, tmp_path, monkeypatch,
                                                                         capsys):
    """jaxpar-train glide with glide.teacher_cache: the run that builds the cache and a
    later one that only reads it (the target never run) log the live run's losses; a
    cache of another corpus is refused in one line (exit 2); a draft_vocab run reuses
    the cache and keeps the training split's most frequent tokens, which its loaded
    draft predicts over (decoding with such drafts: test_speculative)."""
    from jaxpar.train.runs import load_glide_draft, load_model

    common = ["glide", f"target_run_dir={target_run}", f"cache_dir={target_run.parent / 'cache'}", *DATA,
              *CACHED_RUN]

    def run(name, *overrides):
        assert main([*common, f"run_dir={tmp_path / name}", *overrides]) == 0, capsys.readouterr().err
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    cache = tmp_path / "teacher"
    live = run("live")
    built = run("built", f"glide.teacher_cache={cache}")
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["complete"] and manifest["identity"]["layout"]["rows"] == {"train": 16, "validation": 8}

    # bench/glide_step.py on this cache, as BENCHMARKS.md runs it on SmolLM2 (in this process, small).
    script = pathlib.Path(__file__).resolve().parents[1] / "bench" / "glide_step.py"
    # steps=3 too: the optimizer's schedule, so the bench's step is the runs' program (a persistent-cache hit)
    overrides = [o for o in common[2:] if "=" in o and not o.startswith(("eval.", "checkpoint."))]
    monkeypatch.setattr(sys, "argv", [str(script), "--target", str(target_run), "--cache", str(cache),
                                      "--steps", "1", *overrides])
    runpy.run_path(str(script), run_name="__main__")
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| draft step") and [r.split("|")[1].strip() for r in table[1:]] == ["live", "cache"]

    def target_runs(*args, **kwargs):
        raise AssertionError("the target ran")

    monkeypatch.setattr(glide, "teacher", target_runs)
    reused = run("reused", f"glide.teacher_cache={cache}")
    for other in (built, reused):
        assert [r["step"] for r in other] == [1, 2, 3]
        for a, b in zip(live, other):
            for key in ("loss", "val_loss"):
                if key in a:
                    assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a, b)

    capsys.readouterr()
    code = main([*common, f"run_dir={tmp_path / 'refused'}", f"glide.teacher_cache={cache}", "data.max_files=30"])
    # one error line, after the lines saying what the run did first: it packed the new
    # corpus, which is what the cache's rows are compared with
    *done, error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and all(line.startswith(("jaxpar-train: tokeniz", "jaxpar-train: train")) for line in done), done
    assert "was built for another corpus (its train rows differ; data.max_files: 40 there, 30 here)" in error
    assert not (tmp_path / "refused").exists()

    run("vocab", f"glide.teacher_cache={cache}", "glide.draft_vocab=100")
    draft = load_glide_draft(tmp_path / "vocab")
    # It started as the target's last layer (glide.init: target, the default): 3 steps later still alike.
    assert correlation_with_the_last_layer(draft, load_model(target_run)) > 0.9
    stored = np.load(tmp_path / "vocab" / glide.VOCAB_FILE)
    assert len(draft.vocab) == 100 and np.array_equal(draft.vocab.ids, stored)
    data_cfg = load_config("tiny", SMALL + ["data.max_files=40", f"data.tokenizer={target_run / 'tokenizer.json'}"]).data
    cache_dir = target_run.parent / "cache"
    rows = data.packed_rows(data_cfg, data.load_tokenizer(data_cfg, 512, cache_dir), 64, "train", cache_dir)
    counts = np.bincount(rows.tokens.ravel(), minlength=512)
    assert counts[stored].min() >= np.delete(counts, stored).max()  # the most frequent tokens

    # glide.features: the cache holds the target's features too, and the losses are the live run's.
    monkeypatch.undo()  # the target runs again
    live_features = run("live-features", "glide.features=true")
    # The draft starts as the one without (fuse [I, 0]); after a step the features count.
    assert live_features[0]["loss"] == live[0]["loss"] and live_features[-1]["loss"] != live[-1]["loss"]
    capsys.readouterr()
    code = main([*common, f"run_dir={tmp_path / 'refused-features'}", f"glide.teacher_cache={cache}",
                 "glide.features=true"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "was built for other arrays (glide.features: False there, True here)" in lines[0]
    built = run("built-features", f"glide.teacher_cache={tmp_path / 'teacher-features'}", "glide.features=true")
    for a, b in zip(live_features, built):
        for key in ("loss", "val_loss"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a, b)


@pytest.mark.slow
def test_a_self_distilled_draft_trains_on_the_targets_continuations(target_run, tmp_path, monkeypatch, capsys):
    """jaxpar-train glide with glide.self_distill: the rows are the target's greedy
    continuations of each training document's first glide.prompt_tokens tokens (those
    rows: test_self_distill), its teacher cache holds them, its draft vocabulary is
    counted on them, and a second run reads both caches, never decoding or running the
    target."""
    from jaxpar.train import self_distill
    from jaxpar.train.loop import load_data
    from jaxpar.train.runs import load_glide_draft, load_model

    cache_dir = target_run.parent / "cache"
    common = ["glide", f"target_run_dir={target_run}", f"cache_dir={cache_dir}", *DATA, "data.max_files=120", *CACHED_RUN,
              "glide.self_distill=true", "glide.prompt_tokens=16", "glide.generate_batch=8",
              f"glide.teacher_cache={tmp_path / 'teacher'}", "glide.draft_vocab=100"]

    def run(name):
        assert main([*common, f"run_dir={tmp_path / name}"]) == 0, capsys.readouterr().err
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    first = run("first")
    assert [r["step"] for r in first] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in first)
    manifest = json.loads((tmp_path / "teacher" / "manifest.json").read_text())
    assert manifest["identity"]["layout"]["rows"] == {"train": 16, "validation": 8}

    cfg = glide.prepare(load_config("glide", [o for o in common[1:] if "=" in o] + [f"run_dir={tmp_path / 'first'}"]))[0]
    target = load_model(target_run)
    _, train_rows, val_rows = load_data(cfg, target)
    assert train_rows.tokens.shape == (16, 65) and val_rows.tokens.shape == (8, 65)
    corpus_rows = data.packed_rows(cfg.data, data.load_tokenizer(cfg.data, 512, cache_dir), 64, "train", cache_dir)
    assert not any(np.array_equal(row, corpus_rows.tokens[0]) for row in train_rows.tokens)
    prompt = self_distill.prompts(cfg, data.load_tokenizer(cfg.data, 512, cache_dir), "train", 16)[0]
    assert np.array_equal(train_rows.tokens[0, :16], prompt)  # the first document's first tokens, then the target's
    stored = np.load(tmp_path / "first" / glide.VOCAB_FILE)
    counts = np.bincount(train_rows.tokens.ravel(), minlength=512)
    assert counts[stored].min() >= np.delete(counts, stored).max()
    assert len(load_glide_draft(tmp_path / "first").vocab) == 100

    def target_runs(*args, **kwargs):
        raise AssertionError("the target ran")

    monkeypatch.setattr(self_distill, "speculative_generate", target_runs)
    monkeypatch.setattr(glide, "teacher", target_runs)
    again = run("again")
    for a, b in zip(first, again):
        assert a["loss"] == b["loss"] and a.get("val_loss") == b.get("val_loss")
