"""Speculative decoding is lossless: greedy methods return exactly the target's greedy
tokens, sampling follows the target's distribution (chi-square); the token tree's
mask, verification and cache compaction are right on their own."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lazy_module, random_init, rel_err
from flax import nnx
from jaxpar import use_execution
from jaxpar.kernels.dispatch import KernelOptions
from jaxpar.inference import drafting, verification
from jaxpar.inference.decoding import generate, probabilities, speculative_generate
from jaxpar.models import GlideDraft, ModelConfig, Transformer
from jaxpar.models.glide import DraftVocab
from jaxpar.models.cache import KVCache, init_cache
from jaxpar.inference.token_tree import TreeLayout, compact, verify_greedy

CFG = ModelConfig(vocab_size=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=48, init_std=0.3)
# The greedy round's settings most tests share (each method, draft and batch one compiled
# loop; greedy decoding's reference one program per batch): the same ones compile once.
GAMMA, TOKENS = 3, 40
stats = lazy_module("scipy.stats")  # the chi-square test's


def _propose(method, target: Transformer, draft, state, skip=None):
    """A greedy round's draft chain from ``state``: ``speculative.propose`` as the round
    runs it (its window, the draft's forward reading the target's cache); jitted (one
    program rather than one per operation)."""
    from jaxpar.inference import speculative
    from jaxpar.inference.sampling import Rows

    kind, n = drafting.as_draft(draft), state.target_cache.lengths

    def step(tokens, cache, features):
        return kind.forward(target, tokens, cache, state.target_cache, None, features)

    return speculative.propose(method, step, n, speculative.state_window(method, state), state.draft_cache,
                               Rows.uniform(n.shape[0], 0.0, 1.0, jax.random.key(1)), state.features, skip)


propose = nnx.jit(_propose, static_argnums=0)


def _draft_cache_over(target: Transformer, draft, sequence, target_cache, slots: int):
    """The draft's cache of ``slots`` slots after one pass over ``sequence [1, T]`` from
    position 0 (no rounds), reading ``target_cache``."""
    kind = drafting.as_draft(draft)
    positions = jnp.arange(sequence.shape[1])[None]
    return kind.forward(target, sequence, drafting.draft_cache(kind, 1, slots), target_cache, positions=positions)[1]


draft_cache_over = nnx.jit(_draft_cache_over, static_argnums=4)


verify_two_chains = nnx.jit(verification.verify_two_chains, static_argnums=6)
verify_with_runner_up = nnx.jit(verification.verify_with_runner_up, static_argnums=5)


@nnx.jit
def cache_after(target: Transformer, prompt, chain):
    """The target's cache after a plain pass over ``prompt [1, P]`` then ``chain [1, C]``
    (right-padded chains share one program: the slots up to a chain's end are its own)."""
    cache = target.decode(prompt, init_cache(target.cfg, 1, 16)).cache
    return target.decode(chain, cache).cache


@nnx.jit
def prefilled(target: Transformer, prompt):
    """A round's start for the verification alone: the target's cache (16 slots) after a
    plain pass over ``prompt [B, P]``, and ``last``, its greedy token after it."""
    logits, cache, _ = target.decode(prompt, init_cache(target.cfg, prompt.shape[0], 16))
    return cache, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)


def greedy_in_batch_four(target: Transformer, prompt: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """``greedy`` for up to 4 rows of ``prompt``, run padded to 4 rows and TOKENS tokens:
    the program the batch-4 tests compile rather than one of its own."""
    rows = len(prompt)
    padded = np.concatenate([prompt, np.repeat(prompt[:1], 4 - rows, axis=0)])
    return greedy(target, padded, TOKENS)[:rows, :max_new_tokens]


def perturbed(model: Transformer, scale: float, rng) -> Transformer:
    """A copy of ``model`` with every weight moved by relative noise ``scale``: a draft
    that agrees with the target often but not always (so rounds accept 0..gamma)."""
    graph, state = nnx.split(model)
    noisy = jax.tree.map(lambda x: x * (1 + scale * rng.standard_normal(x.shape)).astype(x.dtype), state)
    return nnx.merge(graph, noisy)


def greedy(model: Transformer, prompt: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """Plain greedy decoding, ``[B, max_new_tokens]`` (the cached loop, which
    test_decoding checks against recomputing the whole sequence every step)."""
    return np.stack(list(generate(model, prompt, max_new_tokens=max_new_tokens)), axis=1)


@pytest.fixture(scope="module")
def models():
    rng = np.random.default_rng(3)
    target = random_init(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), rng)
    return {"target": target, "close": perturbed(target, 0.05, rng),
            "small": random_init(lambda: Transformer(dataclasses.replace(CFG, layers=1), rngs=nnx.Rngs(0)), rng),
            "glide": random_init(lambda: GlideDraft(CFG, rngs=nnx.Rngs(0)), rng),
            "glide_vocab": random_init(lambda: GlideDraft(CFG, vocab=restricted(CFG.vocab_size, 24, rng),
                                                          rngs=nnx.Rngs(0)), rng),
            "glide_features": random_init(lambda: GlideDraft(CFG, features=True, rngs=nnx.Rngs(0)), rng)}


def restricted(vocab_size: int, n: int, rng) -> DraftVocab:
    """A draft vocabulary of ``n`` random tokens of ``vocab_size``."""
    return DraftVocab(np.sort(rng.choice(vocab_size, n, replace=False)), vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("method,draft,batch", [
    ("ar", None, 4), ("speculative", "close", 4), ("glide", "glide", 4), ("cape", "glide", 4),
    ("glide", "glide_vocab", 4), ("cape", "glide_vocab", 4), ("glide", "glide_features", 4)])
def test_greedy_methods_return_greedy_decoding(models, rng, method, draft, batch):
    """Batch 4 here; batch 1 where drafts are accepted often (a near copy):
    test_a_tied_targets_head_made_once_per_model's chain and tree, whose loops (a tied
    target's) are compiled anyway; GliDe drafts at batch 1 after training: test_glide's
    jaxpar-generate test, which also runs CaPE with a plain draft. ``glide_vocab``: a GliDe draft over 24 of the 64 tokens
    (glide.draft_vocab), whose proposals are only those; ``glide_features``: one that
    reads the target's features (glide.features; greedy tokens do not depend on what a
    draft reads, and CaPE's rounds carry the features as GliDe's do:
    test_the_state_carries_the_targets_features_of_the_last_two_tokens). GAMMA and TOKENS: the runner-up, lookup
    and CaPE-vs-chain tests run the same loops and references, compiled once."""
    target = models["target"]
    prompt = rng.integers(0, CFG.vocab_size, (batch, 6))
    reference = greedy(target, prompt, TOKENS)
    out = speculative_generate(target, prompt, draft=models.get(draft), method=method, gamma=GAMMA,
                               max_new_tokens=TOKENS)
    for b in range(batch):
        np.testing.assert_array_equal(out.tokens[b], reference[b])
    assert 1.0 <= out.accepted_per_step <= GAMMA + 1
    if draft == "close":  # the near copy is accepted often, but not always
        assert 1.5 < out.accepted_per_step < GAMMA + 1


@pytest.mark.parametrize("method", ["speculative", "cape"])
@pytest.mark.slow
def test_a_tied_targets_head_made_once_per_model(rng, method):
    """A target with tied embeddings: the verification passes multiply by its head made
    once as a ``[D, V]`` copy, kept with the model: a second generation reuses it, new
    weights (as a training step leaves) make a new one, never the stale one, and it is
    dropped once the weights it was made from are freed. The tokens are greedy
    decoding's throughout. Batch 1 with a near copy for a draft, GAMMA and TOKENS: also
    the chain's and the tree's check at batch 1 (test_greedy_methods_return_greedy_decoding
    runs batch 4), accepted often but not always."""
    import gc

    from jaxpar.inference import decoding

    cfg = dataclasses.replace(CFG, tie_embeddings=True)
    target = random_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), rng)
    draft = perturbed(target, 0.05, rng)
    prompt = rng.integers(0, cfg.vocab_size, (1, 6))
    options = dict(draft=draft, method=method, gamma=GAMMA, max_new_tokens=TOKENS)
    before = set(decoding._HEADS)
    out = speculative_generate(target, prompt, **options)
    np.testing.assert_array_equal(np.stack(out.tokens), greedy(target, prompt, TOKENS))
    assert 1.5 < out.accepted_per_step < GAMMA + 1
    [key] = set(decoding._HEADS) - before
    head = decoding._HEADS[key][1]
    np.testing.assert_array_equal(np.asarray(head), np.asarray(target.head_weight()))
    speculative_generate(target, prompt, **options)
    assert set(decoding._HEADS) - before == {key} and decoding._HEADS[key][1] is head

    target.embed.set_value(jnp.asarray(rng.standard_normal(target.embed.get_value().shape) * 0.3, jnp.float32))
    gc.collect()
    assert key not in decoding._HEADS  # its table was freed
    out = speculative_generate(target, prompt, **options)
    np.testing.assert_array_equal(np.stack(out.tokens), greedy(target, prompt, TOKENS))
    assert len(set(decoding._HEADS) - before) == 1
    del target, draft
    gc.collect()
    assert set(decoding._HEADS) <= before


@pytest.mark.slow
def test_generate_streams_the_ar_rounds(models, rng):
    """``generate`` is the ``ar`` method one round at a time: the same tokens, sampled
    ones included (same seed)."""
    target, prompt = models["target"], rng.integers(0, CFG.vocab_size, (3, 5))
    sampling = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=1)
    streamed = np.stack(list(generate(target, prompt, **sampling)), axis=1)
    looped = speculative_generate(target, prompt, method="ar", **sampling)
    np.testing.assert_array_equal(np.stack(looped.tokens), streamed)
    assert len(set(streamed.ravel().tolist())) > 3


@pytest.mark.slow
def test_streamed_rounds_are_the_loops_and_compile_once(models, rng):
    """``speculative_stream`` (what jaxpar-generate prints from) runs the loop's round:
    the same tokens and accepted tokens per round as ``speculative_generate``, and a
    second stream of the same shapes compiles nothing (issue 20: one compiled round).
    Batch 4, GAMMA and TOKENS: the loop is test_greedy_methods_return_greedy_decoding's."""
    from jaxpar.inference.decoding import speculative_stream
    from test_serving import compiles_during

    target, draft = models["target"], models["close"]
    options = dict(draft=draft, method="speculative", gamma=GAMMA, max_new_tokens=TOKENS)
    looped = speculative_generate(target, rng.integers(0, CFG.vocab_size, (4, 5)), **options)
    list(speculative_stream(target, rng.integers(0, CFG.vocab_size, (4, 5)), **options))  # warm-up
    prompt = rng.integers(0, CFG.vocab_size, (4, 5))
    steps = []
    assert compiles_during(lambda: steps.extend(speculative_stream(target, prompt, **options))) == 0
    looped = speculative_generate(target, prompt, **options)
    streamed = [np.concatenate([new[b] for new, _ in steps]) for b in range(4)]
    assert [t.tolist() for t in streamed] == [t.tolist() for t in looped.tokens]
    per_round = (steps[-1][1] * looped.rounds).sum() / looped.rounds.sum()  # per sequence -> over the batch
    np.testing.assert_allclose(per_round, looped.accepted_per_step, rtol=1e-6)


def test_the_same_settings_share_one_set_of_programs():
    """``speculative.compiled`` returns the same jitted programs for equal settings (so a
    benchmark lowering a loop ``speculative_generate`` ran traces nothing anew), other
    programs for other settings."""
    from jaxpar.inference import speculative

    programs = speculative.compiled(speculative.Method("glide", gamma=GAMMA), TOKENS, ())
    assert speculative.compiled(speculative.Method("glide", gamma=GAMMA), TOKENS, ()) is programs
    assert speculative.compiled(speculative.Method("glide", gamma=GAMMA), TOKENS, (0,)) is not programs
    assert speculative.compiled(speculative.Method("cape", gamma=GAMMA), TOKENS, ()) is not programs


def test_prompts_of_nearby_lengths_share_one_program(models, rng):
    """Prompt widths round up to ``PROMPT_BUCKET``: a prompt of another length in the
    same bucket compiles nothing, and the padding is masked: its tokens are the
    target's greedy ones recomputed over the unpadded sequence, no cache (one causal
    pass over the prompt and the tokens: each token is the argmax after its prefix,
    which by induction is greedy decoding)."""
    from jaxpar.inference.decoding import PROMPT_BUCKET
    from test_serving import compiles_during

    target, draft = models["target"], models["glide"]
    # batch 4, GAMMA and TOKENS: test_greedy_methods_return_greedy_decoding's glide loop, compiled once
    options = dict(draft=draft, method="glide", gamma=GAMMA, max_new_tokens=TOKENS)
    speculative_generate(target, rng.integers(0, CFG.vocab_size, (4, 5)), **options)  # warm-up
    prompt = rng.integers(0, CFG.vocab_size, (4, PROMPT_BUCKET - 2))
    outs = []
    assert compiles_during(lambda: outs.append(speculative_generate(target, prompt, **options))) == 0
    tokens = np.stack(outs[0].tokens)
    assert tokens.shape == (4, TOKENS)
    sequence = np.concatenate([prompt, tokens], axis=1)
    logits = np.asarray(target(jnp.asarray(sequence)))[:, prompt.shape[1] - 1:-1]
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


@pytest.mark.slow  # 4.6 and 9.4 s on 2 cores
@pytest.mark.parametrize("method", ["glide", "cape"])
def test_the_state_carries_the_targets_features_of_the_last_two_tokens(models, rng, method):
    """A draft reading the target's features (glide.features): after the prefill and
    after every round, each sequence's state holds the target's features at positions
    ``n - 2`` and ``n - 1`` of its sequence so far, as a pass over that whole sequence
    without a cache computes them (after rounds that accepted 0, some and all of their
    proposals: the draft is a random one, so most reject)."""
    from jaxpar.inference import speculative

    target, draft = models["target"], models["glide_features"]
    method_ = speculative.Method(method, gamma=2, bins=(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2))
    prefill, round_, _, _ = speculative.compiled(method_, 12, ())
    graph, params = nnx.split((target, draft))
    prompt = rng.integers(0, CFG.vocab_size, (3, 7)).astype(np.int32)
    lengths = np.array([7, 4, 2], np.int32)  # ragged: the padding is not read
    state = prefill(graph, params, prompt, lengths, jax.random.key(0))
    accepted, seen = set(), []  # seen: per round, each sequence so far and the state's features
    for round_index in range(6):
        n = np.asarray(state.target_cache.lengths)
        out, count = np.asarray(state.out), np.asarray(state.count)  # sliced in numpy, not eagerly
        sequences = [np.concatenate([prompt[b, :lengths[b]], out[b, :count[b] - 1]]) for b in range(3)]
        assert [len(sequence) for sequence in sequences] == n.tolist()
        seen.append((sequences, np.asarray(state.features)))
        before = np.asarray(state.emitted)
        state = round_(graph, params, state)
        accepted |= set((np.asarray(state.emitted) - before - 1).tolist())
    assert 0 in accepted and len(accepted) > 1
    # The whole sequences (each round's a prefix of them), right-padded to one width:
    # one causal pass without a cache gives every prefix's features (one program).
    final = seen[-1][0]
    padded = np.zeros((3, max(map(len, final))), np.int32)
    for b, sequence in enumerate(final):
        padded[b, :len(sequence)] = sequence
    features = np.asarray(final_features(target, jnp.asarray(padded)))
    for round_index, (sequences, got) in enumerate(seen):
        for b, sequence in enumerate(sequences):
            np.testing.assert_array_equal(sequence, final[b][:len(sequence)])
            n = len(sequence)
            want = np.stack([features[b, i] if i >= 0 else np.zeros(CFG.dim) for i in (n - 2, n - 1)])
            assert rel_err(got[b], want) < 1e-5, (round_index, b)


@nnx.jit
def final_features(target, tokens):
    """The target's normed features of ``tokens [B, T]``, no cache."""
    return target.final_norm(target.features(tokens))


@pytest.mark.slow
def test_a_features_draft_proposes_from_the_last_verified_tokens_feature(rng):
    """An oracle draft that only passes the target's feature through (fuse ``[0, I]``,
    its layers' outputs zero, unit norm scales in both): its logits at a position are
    the target's own at the feature's position, so reading the feature of ``n - 1``
    (which the target's greedy token there, ``last``, came from) it proposes ``last``
    at every depth, in every round."""
    from jaxpar.inference import speculative

    target = random_init(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), rng)
    draft = random_init(lambda: GlideDraft(CFG, features=True, rngs=nnx.Rngs(0)), rng)
    target.final_norm.scale[...] = jnp.ones(CFG.dim)
    draft.final_norm.scale[...] = jnp.ones(CFG.dim)
    for weight in (draft.layers.attn.o, draft.layers.cross.o, draft.layers.mlp.down):
        weight[...] = jnp.zeros_like(weight[...])
    draft.fuse[...] = jnp.stack([jnp.zeros((CFG.dim, CFG.dim)), jnp.eye(CFG.dim)])
    # the settings and shapes of test_the_state_carries_the_targets_features_of_the_last_two_tokens[glide]
    # (gamma 2, bins of 2, 12 tokens, 3 prompts of 7): its prefill and round, compiled once
    method = speculative.Method("glide", gamma=2, bins=(2,) * 11)
    prefill, round_, _, _ = speculative.compiled(method, 12, ())
    graph, params = nnx.split((target, draft))
    state = prefill(graph, params, rng.integers(0, CFG.vocab_size, (3, 7)).astype(np.int32),
                    np.array([6, 3, 7], np.int32), jax.random.key(0))
    for _ in range(3):
        drafts, _, _ = propose(method, target, draft, state)
        np.testing.assert_array_equal(drafts, np.repeat(np.asarray(state.last)[:, None], 2, axis=1))
        state = round_(graph, params, state)


@pytest.mark.slow
def test_cape_accepts_siblings_and_beats_the_chain(models, rng):
    """With a weak draft, CaPE's siblings catch target tokens the greedy chain misses
    (the loops of test_greedy_methods_return_greedy_decoding: the draft has the near
    copy's graph)."""
    target, draft = models["target"], perturbed(models["target"], 0.5, rng)
    prompt = rng.integers(0, CFG.vocab_size, (4, 6))
    options = dict(draft=draft, gamma=GAMMA, max_new_tokens=TOKENS)
    chain = speculative_generate(target, prompt, method="speculative", **options)
    tree = speculative_generate(target, prompt, method="cape", **options)
    assert tree.accepted_per_step > chain.accepted_per_step


@pytest.mark.slow
def test_pallas_decode_kernel_verifies_chains_and_trees(models, rng):
    """Under execution.attention=pallas the target's verification passes run the Pallas decode
    kernel (interpret mode here): per-sequence lengths, causal chains and tree masks."""
    # the reference: greedy decoding's first 10 tokens, from test_greedy_methods_return_greedy_decoding's
    # program (batch 4, TOKENS); 10 tokens of the interpreted kernel, whose rounds are slow
    target, prompt = models["target"], rng.integers(0, CFG.vocab_size, (4, 5))
    reference = greedy(target, prompt, TOKENS)[:, :10]
    with use_execution(kernels=KernelOptions(attention="pallas")):
        for method in ("speculative", "cape"):  # bins of 2: a 9-node tree, within the kernel's 16
            out = speculative_generate(target, prompt, draft=models["close"], method=method,
                                       bins=(2,) * 11, max_new_tokens=10)
            np.testing.assert_array_equal(np.stack(out.tokens), reference)


@pytest.mark.slow
def test_ragged_prompts_and_eos(models, rng):
    """Prompts of three lengths in one batch, two end ids; the sequences that produce
    either stop after it, the others go on."""
    target = models["target"]
    prompts = [rng.integers(0, CFG.vocab_size, n) for n in (2, 9, 5)]
    references = [greedy(target, p[None], TOKENS)[0][:12] for p in prompts]  # TOKENS: the batch-1 tests' program
    eos = (int(references[1][3]), int(references[0][2]))
    out = speculative_generate(target, prompts, draft=models["close"], max_new_tokens=12, eos_ids=eos)
    for reference, tokens in zip(references, out.tokens):
        ends = [i for i, t in enumerate(reference) if t in eos]
        stop = ends[0] + 1 if ends else len(reference)
        np.testing.assert_array_equal(tokens, reference[:stop])
    assert len(out.tokens[1]) <= 4 and len(out.tokens[0]) <= 3  # stopped at their first end id


def _exact_marginals(target: Transformer, prompt: np.ndarray, steps: int, temperature, top_p):
    """The target's exact distribution of generated tokens 1..steps (summing over every
    path through a tiny vocabulary), ``[steps, V]``."""
    V = target.cfg.vocab_size
    forward = nnx.jit(lambda m, t, i: probabilities(m(t)[:, i], temperature, top_p))
    paths, weights, out = prompt[None, :], np.ones(1), []
    for _ in range(steps):
        # every step's paths right-padded to the last step's rows and width: one program
        # (a causal pass reads nothing after the path's last token)
        padded = np.zeros((V ** (steps - 1), len(prompt) + steps - 1), np.int32)
        padded[:len(paths), :paths.shape[1]] = paths
        probs = np.asarray(forward(target, jnp.asarray(padded), paths.shape[1] - 1), np.float64)[:len(paths)]
        joint = weights[:, None] * probs
        out.append(joint.sum(0))
        paths = np.concatenate([np.repeat(paths, V, 0), np.tile(np.arange(V), len(paths))[:, None]], 1)
        weights = joint.reshape(-1)
    return np.stack(out)


@pytest.fixture(scope="module")
def sampling_target():
    """The sampling test's target (a vocabulary of 8), prompt, and the exact marginals of
    its tokens 1..3, computed once for its four drafts."""
    rng = np.random.default_rng(0)
    cfg = dataclasses.replace(CFG, vocab_size=8)
    target = random_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), rng, std=0.5)
    prompt = rng.integers(0, 8, 5)
    return cfg, target, prompt, _exact_marginals(target, prompt, 3, 1.0, 0.95)


@pytest.mark.slow
@pytest.mark.parametrize("method,draft", [("speculative", "small"), ("glide", "glide"), ("glide", "glide_vocab")])
def test_sampling_follows_the_target_distribution(method, draft, rng, sampling_target, monkeypatch):
    """Chi-square goodness of fit at significance 0.001, per generated position, for the
    tokens the round's acceptance rule produced (positions 2 and 3: the first comes
    from the prefill). 6000 samples, a vocabulary of 8; draft and target disagree (most
    rounds reject something). ``glide_vocab``: the draft proposes 4 of the 8 tokens
    (its q is zero on the others, which only the residual draws).

    The 5-token prompt is padded to 8, not to ``PROMPT_BUCKET`` (32): the padding is
    masked either way (test_prompts_of_nearby_lengths_share_one_program), and over 6000
    rows a prefill of 32 positions and rounds over its cache took most of the time (a
    draft's compiled loop ran 5.1 s of CPU padded to 32, 2.0 s padded to 8)."""
    from jaxpar.inference import decoding

    monkeypatch.setattr(decoding, "PROMPT_BUCKET", 8)
    cfg, target, prompt, exact = sampling_target
    drafts = {"small": lambda: Transformer(dataclasses.replace(cfg, layers=1), rngs=nnx.Rngs(0)),
              "glide": lambda: GlideDraft(cfg, rngs=nnx.Rngs(0)),
              "glide_vocab": lambda: GlideDraft(cfg, vocab=DraftVocab([0, 2, 3, 6], 8), rngs=nnx.Rngs(0))}
    draft = random_init(drafts[draft], rng, std=0.5)
    temperature, top_p, n = 1.0, 0.95, 6000  # the fixture's exact marginals are for these
    out = speculative_generate(target, np.tile(prompt, (n, 1)), draft=draft, method=method,
                               gamma=3, max_new_tokens=3, temperature=temperature, top_p=top_p, seed=11)
    assert out.accepted_per_step < 3.0  # rejections happened
    samples = np.stack(out.tokens)
    if draft == "glide_vocab":  # tokens the draft never proposes come, from the residual
        assert np.isin(samples[:, 1:], [1, 4, 5, 7]).mean() > 0.05
    for position in (1, 2):
        counts = np.bincount(samples[:, position], minlength=8)
        expected = exact[position] * n
        assert counts[expected == 0].sum() == 0  # top_p cuts tokens: never drawn
        rare = expected < 5  # pooled into one cell, as the test's approximation needs
        observed = np.append(counts[~rare], counts[rare].sum())
        expected = np.append(expected[~rare], expected[rare].sum())
        observed, expected = observed[expected > 0], expected[expected > 0]
        assert stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3


# ----------------------------------------------------------------------- the tree


def test_tree_mask_layout():
    layout = TreeLayout(gamma=3, width=2)  # root, then nodes (1,0) (1,1) (2,0) (2,1) (3,0) (3,1)
    expected = np.array([
        # 0  1  2  3  4  5  6
        [1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0],  # g1
        [1, 0, 1, 0, 0, 0, 0],  # sibling of g1
        [1, 1, 0, 1, 0, 0, 0],  # g2 (after g1)
        [1, 1, 0, 0, 1, 0, 0],  # sibling of g2
        [1, 1, 0, 1, 0, 1, 0],  # g3
        [1, 1, 0, 1, 0, 0, 1],  # sibling of g3
    ], bool)
    np.testing.assert_array_equal(layout.mask, expected)
    np.testing.assert_array_equal(layout.depths, [0, 1, 1, 2, 2, 3, 3])


def test_verify_greedy_walks_the_tree():
    layout = TreeLayout(gamma=3, width=2)
    #                    root g1  s1  g2  s2  g3  s3
    tokens = jnp.array([[9, 1, 2, 3, 4, 5, 6],    # target agrees with g1, then picks s2
                        [9, 1, 2, 3, 4, 5, 6],    # all greedy, bonus from g3
                        [9, 1, 2, 3, 4, 5, 6],    # target wants 2 at depth 1: the sibling
                        [9, 1, 2, 3, 4, 5, 6]])   # wants s2's token but s2 is padding
    valid = jnp.array([[1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 0, 1, 0],
                       [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 1, 1]], bool)
    # target_next[b, j]: the target's argmax after node j.
    target_next = jnp.array([[1, 4, 0, 0, 7, 0, 0], [1, 3, 0, 5, 0, 8, 0],
                             [2, 0, 6, 0, 0, 0, 0], [1, 4, 0, 0, 0, 0, 0]])
    # jitted, as a round runs it (eagerly, every operation would compile apart), checked in numpy
    walk = jax.jit(verify_greedy, static_argnums=0)(layout, tokens, valid, target_next)
    path, accepted, bonus = (np.asarray(x) for x in walk)
    np.testing.assert_array_equal(accepted, [2, 3, 1, 1])
    np.testing.assert_array_equal(bonus, [7, 8, 6, 4])
    np.testing.assert_array_equal(path[:, :3], [[0, 1, 4], [0, 1, 3], [0, 2, 2], [0, 1, 1]])
    np.testing.assert_array_equal(path[1], [0, 1, 3, 5])


def test_compact_moves_the_accepted_path_into_place(rng):
    """Jitted, as the round runs it; checked in numpy (indexing the device arrays
    eagerly compiles an operation per index)."""
    L, B, S, K, H = 2, 2, 12, 2, 3
    k = rng.standard_normal((L, B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((L, B, S, K, H)).astype(np.float32)
    starts = np.array([2, 4])
    path = np.array([[0, 2, 4, 4], [0, 1, 3, 6]])
    out = jax.jit(compact)(KVCache(jnp.asarray(k), jnp.asarray(v), jnp.asarray(starts + 7)), jnp.asarray(starts),
                           jnp.asarray(path))
    out_k, out_v = np.asarray(out.k), np.asarray(out.v)
    for b in range(B):
        s = int(starts[b])
        for i in range(4):
            np.testing.assert_array_equal(out_k[:, b, s + i], k[:, b, s + int(path[b, i])])
            np.testing.assert_array_equal(out_v[:, b, s + i], v[:, b, s + int(path[b, i])])
        untouched = [j for j in range(S) if not s <= j < s + 4]
        np.testing.assert_array_equal(out_k[:, b, untouched], k[:, b, untouched])


@nnx.jit
def logits_at(model, tokens, index):
    """``model``'s logits at position ``index`` of ``tokens [B, T]`` (right-padded
    sequences share one program: a causal pass reads nothing after ``index``)."""
    return model(tokens)[:, index]


@nnx.jit
def tree_pass(target: Transformer, prompt, tree, positions, mask):
    """The target's logits over ``tree [B, N]`` (``positions``, ``mask``) after a plain
    pass over ``prompt [B, P]``, one program (eagerly, every operation compiles apart)."""
    cache = target.decode(prompt, init_cache(target.cfg, prompt.shape[0], 16)).cache
    return target.decode(tree, cache, positions=positions, tree_mask=mask).logits


@pytest.mark.slow
def test_tree_pass_equals_each_branch_run_alone(models, rng):
    """The target over a whole tree (tree mask, depth positions, one pass over the cache)
    gives every node the logits of its root-to-node sequence run on its own."""
    target, layout = models["target"], TreeLayout(gamma=3, width=2)
    B, P = 2, 5
    prompt = rng.integers(0, CFG.vocab_size, (B, P)).astype(np.int32)
    tree = rng.integers(0, CFG.vocab_size, (B, layout.size)).astype(np.int32)
    positions = P + np.broadcast_to(layout.depths, (B, layout.size)).astype(np.int32)
    mask = np.broadcast_to(layout.mask, (B, layout.size, layout.size))
    logits = np.asarray(tree_pass(target, prompt, tree, positions, mask))
    for node in range(layout.size):
        branch = np.flatnonzero(layout.mask[node])  # its ancestors and itself, in depth order
        padding = np.zeros((B, layout.gamma + 1 - len(branch)), prompt.dtype)  # every branch one width
        alone = logits_at(target, np.concatenate([prompt, tree[:, branch], padding], axis=1), P + len(branch) - 1)
        assert rel_err(logits[:, node], alone) < 1e-5


# ------------------------------------------------------------- prompt lookup


def test_lookup_copies_what_followed_the_latest_earlier_occurrence():
    from jaxpar.inference.prompt_lookup import chain

    lookup_chain = jax.jit(chain, static_argnums=2, static_argnames="ngram")  # as the rounds run it

    history = jnp.array([[5, 1, 2, 5, 3, 4, 5, 0, 0],    # last=5 at 6: latest earlier 5 at 3 -> 3, 4, 5
                         [5, 1, 2, 5, 3, 4, 5, 0, 0],    # last=4 at 5 (n=5): never before -> nothing
                         [7, 7, 9, 9, 9, 9, 9, 9, 9],    # last=7 at 1: 7 at 0 -> 7 (at n), then unknown
                         [1, 2, 3, 1, 2, 3, 1, 8, 8]])   # last=1 at 6: 1 at 3 -> 2, 3, 1
    tokens, valid = lookup_chain(history, jnp.array([6, 5, 1, 6]), 3)
    assert valid.tolist() == [[True] * 3, [False] * 3, [True] * 3, [True] * 3]
    # row 2: 7 at 0 is followed by one known token (7, at n), which repeats: the period
    assert tokens[0].tolist() == [3, 4, 5] and tokens[2].tolist() == [7, 7, 7] and tokens[3].tolist() == [2, 3, 1]
    # a period of two: [.., 1, 2, 1, 2] continues 1, 2, 1
    assert lookup_chain(jnp.array([[3, 1, 2, 1, 2, 0]]), jnp.array([4]), 3)[0].tolist() == [[1, 2, 1]]
    # the last two tokens: [4, 5] and [3, 4] not before; [7, 7] not before 1 (no wrap to the
    # end of the row); [3, 1] at 2..3 -> 2, 3, 1
    tokens, valid = lookup_chain(history, jnp.array([6, 5, 1, 6]), 3, ngram=2)
    assert valid.tolist() == [[False] * 3, [False] * 3, [False] * 3, [True] * 3]
    assert tokens[3].tolist() == [2, 3, 1]


@pytest.mark.slow
def test_two_chains_keep_the_longer_and_its_cache(models, rng):
    """The draft's chain and a copied one in one pass: each sequence keeps the chain
    with more of the target's greedy tokens (the draft's on a tie), emits the target's
    token after it, and its cache entries are those of a plain pass over that chain."""
    target, gamma = models["target"], 3
    prompt = rng.integers(0, CFG.vocab_size, (3, 6)).astype(np.int32)
    ref = greedy_in_batch_four(target, prompt, gamma + 2)  # ref[:, 0] is `last` after the prompt
    target_cache, last = prefilled(target, prompt)
    np.testing.assert_array_equal(last, ref[:, 0])
    wrong = (ref + 1) % CFG.vocab_size
    right = ref[:, 1:gamma + 1]
    drafts = np.stack([wrong[0, 1:4], right[1], [right[2, 0], wrong[2, 2], right[2, 2]]])
    copied = np.stack([right[0], [right[1, 0], wrong[1, 2], right[1, 2]], [right[2, 0], right[2, 1], wrong[2, 3]]])
    cache, path_tokens, accepted, nxt, _, _ = jax.device_get(verify_two_chains(  # sliced in numpy, not eagerly
        target, target_cache, last, jnp.asarray(drafts), jnp.asarray(copied), jnp.ones((3, gamma), bool), False))
    assert accepted.tolist() == [3, 3, 2]  # the copy, the draft (the copy has 1), the copy (the draft has 1)
    np.testing.assert_array_equal(path_tokens, np.stack([copied[0], drafts[1], copied[2]]))
    np.testing.assert_array_equal(nxt, ref[np.arange(3), np.asarray(accepted) + 1])
    # no valid copied token: the draft's chain, whatever the copied tokens say
    assert verify_two_chains(target, target_cache, last, jnp.asarray(wrong[:, 1:4]),
                             jnp.asarray(right), jnp.zeros((3, gamma), bool), False
                             ).accepted.tolist() == [0, 0, 0]
    for b in range(3):
        a = int(accepted[b])
        chain = np.zeros((1, gamma + 1), np.int32)  # last and the accepted tokens, right-padded
        chain[0, :a + 1] = np.concatenate([[ref[b, 0]], path_tokens[b, :a]])
        alone = jax.device_get(cache_after(target, prompt[b:b + 1], chain))
        assert rel_err(cache.k[:, b, 6:7 + a], alone.k[:, 0, 6:7 + a]) < 1e-5
        assert rel_err(cache.v[:, b, 6:7 + a], alone.v[:, 0, 6:7 + a]) < 1e-5


@pytest.mark.slow  # 5 programs of their own, 3.6-9.6 s each on 2 cores
@pytest.mark.parametrize("method,draft,lookup,skip,runner_up", [
    ("glide", "glide", "select", False, False), ("glide", "glide", "select", True, False),
    ("speculative", "close", "select", False, False), ("cape", "glide", "", False, False),
    ("glide", "glide", "", False, True)])
def test_the_drafts_first_step_rewrites_its_cache_from_the_verified_tokens(models, rng, method, draft, lookup, skip,
                                                                           runner_up):
    """Whatever the last round kept (a copied chain, a tree's sibling, the runner-up:
    tokens the draft did not propose, or a round whose draft steps were skipped), a
    lookup's, CaPE's or a runner-up round's first draft step (its window of ``gamma + 1``
    tokens) leaves its cache, at every slot up to ``last``, equal to the draft's cache
    over the sequence so far without rounds: here with the slots a round may have left
    stale overwritten by noise first. With ``skip`` only that step runs."""
    from jaxpar.inference import speculative

    target, draft, gamma = models["target"], models[draft], 3
    method_ = speculative.Method(method, gamma=gamma, bins=(2,) * 11, lookup=lookup, runner_up=runner_up)
    prefill, round_, _, _ = speculative.compiled(method_, 24, ())
    graph, params = nnx.split((target, draft))
    prompt = rng.integers(0, CFG.vocab_size, (2, 7)).astype(np.int32)
    state = prefill(graph, params, prompt, np.array([7, 2], np.int32), jax.random.key(0))  # 2: the window from slot 0
    for _ in range(3):
        n = np.asarray(state.target_cache.lengths)
        slots = np.arange(state.draft_cache.k.shape[2])
        stale = jnp.asarray((slots[None, :] >= n[:, None] - gamma) & (slots[None, :] < n[:, None]))[None, :, :, None, None]
        noise = lambda x: jnp.where(stale, jnp.asarray(rng.standard_normal(x.shape), x.dtype), x)  # noqa: E731
        dcache = dataclasses.replace(state.draft_cache, k=noise(state.draft_cache.k), v=noise(state.draft_cache.v))
        drafts, _, cache = jax.device_get(propose(method_, target, draft, dataclasses.replace(state, draft_cache=dcache),
                                                  jnp.asarray(True) if skip else None))  # sliced in numpy
        history, target_cache = jax.device_get((state.history, state.target_cache))
        for b in range(2):
            # right-padded to the cache's width, one program: the slots up to n[b] are the
            # causal pass's over the sequence alone (a query reads keys up to its position)
            slots = dcache.k.shape[2]
            sequence = np.zeros((1, slots), np.int32)
            sequence[0, :n[b] + 1] = history[b, :n[b] + 1]
            alone = jax.tree.map(lambda x: x[:, b:b + 1] if x.ndim == 5 else x[b:b + 1], target_cache)
            want = jax.device_get(draft_cache_over(target, draft, sequence, alone, slots))
            assert rel_err(cache.k[:, b, :n[b] + 1], want.k[:, 0, :n[b] + 1]) < 1e-5
            assert rel_err(cache.v[:, b, :n[b] + 1], want.v[:, 0, :n[b] + 1]) < 1e-5
        if skip:  # the draft's steps after the first did not run
            assert (drafts[:, 1:] == 0).all()
        state = round_(graph, params, state)


@pytest.mark.slow
@pytest.mark.parametrize("method,draft,lookup,batch", [
    ("glide", "glide", "tree", 4), ("glide", "glide_features", "tree", 4), ("speculative", "close", "tree", 4),
    ("glide", "glide", "select", 4), ("speculative", "close", "select", 4), ("glide", "glide", "select", 1),
    ("glide", "glide_features", "select", 1)])
def test_lookup_rounds_return_greedy_decoding(models, rng, method, draft, lookup, batch):
    """With lookup, tokens equal plain greedy decoding, on prompts that repeat (so the
    copied chains are proposed) as on random ones; with one sequence (``batch`` 1) on a
    repeating prompt ``select``'s rounds take the whole copy and skip the draft's steps.
    That sequence runs as 4 equal rows (every row takes the copy where it does, so the
    rounds skip as at batch 1): the batch-4 loops of the select cases here and in
    test_runner_up_rounds_return_greedy_decoding_and_accept_more, compiled once."""
    target = models["target"]
    motif = rng.integers(0, CFG.vocab_size, (2, 4))
    prompt = np.concatenate([np.tile(motif, 3), rng.integers(0, CFG.vocab_size, (2, 12))])  # [4, 12]
    if batch == 1:
        prompt = np.repeat(prompt[:1], 4, axis=0)
    reference = greedy(target, prompt, TOKENS)
    out = speculative_generate(target, prompt, draft=models[draft], method=method, gamma=GAMMA, max_new_tokens=TOKENS,
                               lookup=lookup)
    for b in range(len(prompt)):
        np.testing.assert_array_equal(out.tokens[b], reference[b])


def test_the_runner_up_is_kept_where_the_chains_first_token_is_wrong(models, rng):
    """A chain and another first token in one pass (``verify_with_runner_up``): where the
    chain's first token is wrong and the other (the draft's best, which the chain did not
    start with) is right, the round keeps it and the target's token after it, and its
    cache entry is that of a plain pass over ``[last, other]``; elsewhere the chain's
    accepted prefix, the other its runner-up where the chain starts with the draft's best."""
    target, gamma = models["target"], 3
    prompt = rng.integers(0, CFG.vocab_size, (3, 6)).astype(np.int32)
    ref = greedy_in_batch_four(target, prompt, gamma + 2)  # ref[:, 0] is `last` after the prompt
    target_cache, last = prefilled(target, prompt)
    np.testing.assert_array_equal(last, ref[:, 0])
    wrong = (ref + 1) % CFG.vocab_size
    right = ref[:, 1:gamma + 1]
    chain = np.stack([wrong[0, 1:4], [right[1, 0], right[1, 1], wrong[1, 3]], wrong[2, 1:4]])
    logits = rng.standard_normal((3, CFG.vocab_size)).astype(np.float32)
    logits[0, right[0, 0]] = 10.0  # the draft's best, which the chain does not start with: right
    logits[1, right[1, 0]], logits[1, wrong[1, 1]] = 10.0, 9.0  # the chain's first is its best: the runner-up
    logits[2, wrong[2, 2]] = 10.0  # wrong, and not the chain's first either
    cache, path_tokens, accepted, nxt, _, _ = jax.device_get(verify_with_runner_up(  # sliced in numpy
        target, target_cache, last, jnp.asarray(chain), jnp.asarray(logits), False))
    assert accepted.tolist() == [1, 2, 0]
    np.testing.assert_array_equal(path_tokens[:, 0], [right[0, 0], right[1, 0], wrong[2, 1]])
    np.testing.assert_array_equal(nxt, ref[np.arange(3), accepted + 1])
    for b in range(2):
        a = int(accepted[b])
        kept = np.zeros((1, gamma + 1), np.int32)  # last and the kept tokens, right-padded (as in the two chains')
        kept[0, :a + 1] = np.concatenate([[ref[b, 0]], path_tokens[b, :a]])
        alone = jax.device_get(cache_after(target, prompt[b:b + 1], kept))
        assert rel_err(cache.k[:, b, 6:7 + a], alone.k[:, 0, 6:7 + a]) < 1e-5
        assert rel_err(cache.v[:, b, 6:7 + a], alone.v[:, 0, 6:7 + a]) < 1e-5


@pytest.mark.parametrize("method,draft,lookup,batch", [
    ("glide", "glide", "", 4), ("glide", "glide_vocab", "", 4), ("speculative", "small", "", 4),
    ("speculative", "close", "select", 4), ("glide", "glide", "select", 4)])
@pytest.mark.slow
def test_runner_up_rounds_return_greedy_decoding_and_accept_more(models, rng, method, draft, lookup, batch):
    """With the runner-up verified too, tokens equal plain greedy decoding, and rounds
    accept more than the chain alone: these random drafts' first tokens are often wrong,
    and their second choices sometimes right. Batch 4, GAMMA and TOKENS: the rounds
    without the runner-up are (but for the small draft's) loops test_greedy_methods_return_greedy_decoding and
    test_lookup_rounds_return_greedy_decoding compiled, the reference theirs too."""
    target = models["target"]
    motif = rng.integers(0, CFG.vocab_size, (2, 4))
    prompt = np.concatenate([np.tile(motif, 3), rng.integers(0, CFG.vocab_size, (2, 12))])[:batch]
    reference = greedy(target, prompt, TOKENS)
    runs = {runner_up: speculative_generate(target, prompt, draft=models[draft], method=method, gamma=GAMMA,
                                            max_new_tokens=TOKENS, lookup=lookup, runner_up=runner_up)
            for runner_up in (False, True)}
    for b in range(len(prompt)):
        np.testing.assert_array_equal(runs[True].tokens[b], reference[b])
    assert runs[True].accepted_per_step > runs[False].accepted_per_step


@pytest.mark.parametrize("draft", ["glide", "glide_features"])
@pytest.mark.slow
def test_select_takes_the_whole_copy_where_the_text_cycles(models, rng, draft):
    """A target with its attention's outputs zeroed: its greedy token a function of the
    last one alone, so its text falls into a cycle that a copy predicts exactly. ``select``
    with ``lookup_tokens`` past ``gamma`` then verifies the whole copy, and rounds emit more
    than the draft's ``gamma + 1``; the tokens are greedy decoding's."""
    target = perturbed(models["target"], 0.0, rng)
    target.layers.attn.o[...] = jnp.zeros_like(target.layers.attn.o[...])
    # TOKENS at batch 1: the references are the batch-1 lookup and eos tests' program
    prompt = greedy(target, rng.integers(0, CFG.vocab_size, (1, 6)), TOKENS)[:, -8:]  # in its cycle by now
    reference = greedy(target, prompt, TOKENS)
    assert len(set(reference[0].tolist())) < 12  # it cycles
    out = speculative_generate(target, prompt, draft=models[draft], method="glide", gamma=2, max_new_tokens=TOKENS,
                               lookup="select", lookup_tokens=5)
    np.testing.assert_array_equal(out.tokens[0], reference[0])
    assert out.accepted_per_step > 3

# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,message", [
    (dict(method="speculative", gamma=0), "gamma=0 must be at least 1"),
    (dict(method="cape", bins=(8, 6, 4)), "bins=[8, 6, 4] must be 11 positive integers"),
    (dict(method="beam"), "method='beam' must be one of"),
    (dict(method="speculative", draft=None), "needs a draft model"),
    (dict(method="cape", temperature=0.7), "'cape' is greedy"),
    (dict(method="glide", draft="small"), "needs a GliDe draft"),
    (dict(method="cape", lookup="tree"), "lookup goes with a greedy 'speculative' or 'glide' round, not method 'cape'"),
    (dict(method="glide", lookup="select", temperature=0.5), "not method 'glide' at temperature 0.5"),
    (dict(method="glide", lookup="ngram"), "lookup='ngram' must be one of tree, select"),
    (dict(method="glide", lookup="tree", lookup_tokens=5), "lookup_tokens=5 must be a positive length of the "
                                                           "copied chain, with lookup 'select' .got lookup='tree'.$"),
    (dict(method="glide", lookup="select", lookup_tokens=-1), "lookup_tokens=-1 must be a positive length"),
    (dict(method="cape", runner_up=True), "runner_up goes with a greedy 'speculative' or 'glide' chain .* not "
                                          "method 'cape'"),
    (dict(method="glide", runner_up=True, temperature=0.5), "runner_up .* at temperature 0.5"),
    (dict(method="glide", runner_up=True, lookup="tree"), "runner_up .* with lookup='tree'"),
    (dict(method="glide", runner_up=True, lookup="select", lookup_tokens=7), "runner_up .* lookup_tokens=7"),
])
def test_bad_settings_are_one_clear_error(models, kwargs, message):
    draft = models.get(kwargs.pop("draft", "glide"))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        speculative_generate(models["target"], np.ones((1, 3), np.int32), draft=draft,
                             max_new_tokens=4, **kwargs)


def test_mismatched_drafts_are_refused(models):
    target, prompt = models["target"], np.ones((1, 3), np.int32)
    other_vocab = nnx.eval_shape(lambda: Transformer(dataclasses.replace(CFG, vocab_size=80), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="the draft's vocabulary \\(80 tokens\\) differs"):
        speculative_generate(target, prompt, draft=other_vocab, max_new_tokens=4)
    other_heads = nnx.eval_shape(lambda: GlideDraft(dataclasses.replace(CFG, kv_heads=4), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="trained for a target with another head layout.*kv_heads 4 vs 2"):
        speculative_generate(target, prompt, draft=other_heads, method="glide", max_new_tokens=4)
