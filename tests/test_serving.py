"""The serving engine (jaxpar.serving): continuous batching over a paged KV cache gives
each request the tokens it gets decoded alone (jaxpar.inference.decoding.generate),
whatever it is batched with; pages all come back; no compiles after warm-up."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import dense_logits, rel_err
from jaxpar.inference import speculative
from jaxpar.inference.decoding import generate, speculative_generate
from jaxpar.kernels import KernelOptions
from jaxpar.models import ModelConfig, Transformer
from jaxpar.models.glide import DraftVocab, GlideDraft
from jaxpar.placement.execution import use_execution
from jaxpar.serving import Engine, SamplingParams
from jaxpar.serving.pages import PagesView, attention

CFG = ModelConfig(vocab_size=96, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=64)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def engine(model, **kw) -> Engine:
    """4 running at most, pages of 8 tokens, steps of up to 64 tokens: long prompts take
    several steps, and requests wait for room."""
    return Engine(model, **{"max_batch": 4, "max_context": 256, "page_size": 8, "max_num_batched_tokens": 64,
                            **kw})


# The dense references decode every prompt list as one ragged batch of REF_ROWS rows (each row decodes as alone:
# test_speculative), REF_TOKENS new tokens each, the rows past the prompts FILLER, so every prompt width pads to
# 160 (a multiple of decoding.PROMPT_BUCKET): ``generate`` compiles a prefill and a round per batch size, padded
# width and max_new_tokens, and this way the module's references share one of each. Greedy tokens do not depend
# on how many follow them.
REF_ROWS, REF_TOKENS = 11, 32
FILLER = np.random.default_rng(99).integers(0, CFG.vocab_size, 160).tolist()


def greedy(model, prompts, max_new_tokens: int) -> list[list[int]]:
    """Each of ``prompts``' first ``max_new_tokens`` greedy tokens, decoded with a dense
    cache as by itself (a row of a ragged batch)."""
    assert len(prompts) < REF_ROWS and max_new_tokens <= REF_TOKENS and max(map(len, prompts)) <= len(FILLER)
    rows = [*prompts, *[FILLER] * (REF_ROWS - len(prompts))]
    steps = np.stack(list(generate(model, rows, max_new_tokens=REF_TOKENS)), axis=1)
    return [row[:max_new_tokens].tolist() for row in steps[:len(prompts)]]


def alone(model, prompt, params: SamplingParams) -> list[int]:
    """``prompt``'s greedy tokens decoded by itself with a dense cache."""
    assert params.temperature == 0
    return greedy(model, [prompt], params.max_tokens)[0]


def requests(seed: int, count: int):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 150, count)
    lengths[:2] = (1, 149)  # the shortest prompt, and one over two prefill rows
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]
    return prompts, [SamplingParams(max_tokens=int(m)) for m in rng.integers(1, 30, count)]


def compiles_during(fn) -> int:
    """Backend compiles while ``fn()`` runs (jax.monitoring's compile-duration event),
    but those of a warm-up compiling in the background (``Engine.warm_up``'s thread)."""
    count = [0]

    def listen(event, duration, **_):
        count[0] += (event == "/jax/core/compile/backend_compile_duration"
                     and threading.current_thread().name != "jaxpar-warm-up")

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return count[0]


@pytest.mark.slow
def test_continuous_batching_gives_each_request_its_tokens_alone(model):
    """10 requests of 1 to 149 prompt tokens and 1 to 29 new ones through 4 slots: each
    request's greedy tokens are those it gets decoded alone; every page is free after;
    a second, different mix on an engine warming up in the background compiles nothing
    outside its warm-up and each gets its tokens alone."""
    served = engine(model)
    prompts, params = requests(0, 10)
    outputs = served.generate(prompts, params)
    # each of a ragged batch decodes as alone (one compile; test_speculative checks ragged batches)
    steps = greedy(model, prompts, max(p.max_tokens for p in params))
    for prompt, p, out, reference in zip(prompts, params, outputs, steps, strict=True):
        assert out.token_ids == reference[:p.max_tokens], (len(prompt), p.max_tokens)
        assert out.finish_reason == "length"
    assert served.pool.free == served.pool.total and not served.has_unfinished()
    # one program per step, of the shapes the scheduler lists
    shapes = served.scheduler.shapes()
    assert served.compiled_programs <= set(shapes)

    # what a server does before it listens: the smallest bucket compiled, then the others
    # while it serves, each step within the ones compiled so far
    served = engine(model)
    served.warm_up(background=True)
    assert ("step", 8) in served.compiled_programs
    prompts, params = requests(1, 10)
    outputs = []
    assert compiles_during(lambda: outputs.extend(served.generate(prompts, params))) == 0
    steps = greedy(model, prompts, max(p.max_tokens for p in params))
    assert [o.token_ids for o in outputs] == [ref[:p.max_tokens] for p, ref in zip(params, steps)]
    assert served.wait_warm_up() and served.scheduler.ready is None
    # a program per token bucket (8, 16, 32, 64), whatever the context: the flat batch's shape alone
    assert shapes == [("step", t) for t in (8, 16, 32, 64)] and served.compiled_programs == set(shapes)


@pytest.mark.slow
def test_static_batching_admits_only_into_an_empty_batch(model):
    """The baseline the benchmark compares with: 6 requests through 4 slots, the last 2
    admitted only once the first 4 have all ended; the same tokens as continuous."""
    prompts, params = requests(7, 6)
    served = engine(model, batching="static")
    ids = [served.add_request(p, s) for p, s in zip(prompts, params)]
    admitted, finished = [], {}
    while served.has_unfinished():
        finished.update((o.request_id, o.token_ids) for o in served.step() if o.finished)
        admitted.append((served.running, served.waiting))
    first = admitted.index(next(a for a in admitted if a[1] == 0))
    assert all(waiting == 2 for _, waiting in admitted[:first]) and admitted[0][0] == 4
    assert all(running == 0 for running, _ in admitted[first - 1:first])
    outputs = [finished[i] for i in ids]
    assert outputs == [o.token_ids for o in engine(model).generate(prompts, params)]
    with pytest.raises(ValueError, match="batching='dynamic' must be 'continuous' or 'static'"):
        engine(model, batching="dynamic")


def test_a_seeded_request_samples_the_same_alone_and_in_a_full_batch(model):
    """temperature 0.9, top_p 0.95, seed 7: the same tokens alone in the engine, beside
    7 other sampling requests (other seeds), and from the dense-cache decoder."""
    prompt = np.random.default_rng(3).integers(0, CFG.vocab_size, 12).tolist()
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    by_itself = engine(model).generate([prompt], params)[0].token_ids
    others, _ = requests(4, 7)
    crowd = [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in range(7)]
    batched = engine(model).generate([*others[:3], prompt, *others[3:]], [*crowd[:3], params, *crowd[3:]])
    assert batched[3].token_ids == by_itself
    assert len(set(by_itself)) > 1  # sampled, not a constant


def test_end_tokens_abort_and_bad_requests(model):
    prompt = np.random.default_rng(5).integers(0, CFG.vocab_size, 20).tolist()
    reference = alone(model, prompt, SamplingParams(max_tokens=10))
    served = engine(model, eos_ids=[reference[3]])
    out = served.generate([prompt], SamplingParams(max_tokens=10))[0]
    assert out.token_ids == reference[:reference.index(reference[3]) + 1] and out.finish_reason == "stop"

    served = engine(model)
    request = served.add_request(prompt, SamplingParams(max_tokens=50))
    served.step()
    served.step()
    assert served.pool.free < served.pool.total
    served.abort(request)
    assert served.pool.free == served.pool.total and not served.has_unfinished()
    assert not served._requests  # a server's finished requests are not kept

    # the pool from a byte budget: 10 pages' bytes (one of them the null page)
    one_page = 2 * CFG.layers * 8 * CFG.kv_heads * CFG.head_dim * 4
    small = engine(model, kv_memory=10 * one_page)
    assert small.pool.total == 9
    with pytest.raises(ValueError, match=r"needs more pages than the cache has \(9\)"):
        small.add_request([1] * 70, SamplingParams(max_tokens=10))  # 79 positions: 10 pages

    for prompt, params, message in [
        ([], SamplingParams(), "the prompt is empty"),
        ([1, 96], SamplingParams(), "token id 96 is outside the model's vocabulary of 96"),
        ([1], SamplingParams(max_tokens=0), "max_tokens=0 must be an int >= 1"),
        ([1], SamplingParams(temperature=-1.0), "temperature=-1.0 must be >= 0"),
        ([1], SamplingParams(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        ([1] * 250, SamplingParams(max_tokens=7), "prompt of 250 tokens \\+ max_tokens=7 is past the context of 256"),
    ]:
        with pytest.raises(ValueError, match=message):
            served.add_request(prompt, params)


def ragged_reference(q, k_pages, v_pages, layer, seq, last, tables, visible=None):
    """Each token's attention over its sequence's slots ``0..last[t]`` (``visible [T,
    S]``: of those, the ones it says), float64 numpy, one token at a time over its
    sequence's keys laid out contiguously."""
    T, N, H = q.shape
    S_p, K = k_pages.shape[2:4]
    out = np.zeros((T, N, H))
    for t in range(T):
        if seq[t] < 0 or last[t] < 0:
            continue
        slots = np.arange(last[t] + 1)
        if visible is not None:
            slots = slots[visible[t, slots]]
        pages = tables[seq[t], slots // S_p]
        keys = np.asarray(k_pages[layer, pages, slots % S_p], np.float64)  # [s, K, H]
        values = np.asarray(v_pages[layer, pages, slots % S_p], np.float64)
        for n in range(N):
            scores = keys[:, n // (N // K)] @ np.asarray(q[t, n], np.float64) / np.sqrt(H)
            weights = np.exp(scores - scores.max())
            out[t, n] = weights / weights.sum() @ values[:, n // (N // K)]
    return out


@pytest.mark.parametrize("block_slots,chunk,elements", [(None, None, None), (None, 2, 8), (4, 4, None),
                                                         (8, 3, None), (16, 2, None), (4, 12, None)])
def test_ragged_attention_reads_each_tokens_own_pages(rng, monkeypatch, block_slots, chunk, elements):
    """A flat batch mixing a decode token over a long context, a prompt chunk spanning
    pages after a cached prefix, a one-token prompt, a sequence at the table's full
    width, tokens of one sequence apart, padding, and a query that reads nothing: each
    token's attention over its own sequence's slots up to its last (float64 reference);
    every slot it may not read holds NaN and none leaks; a tree's visibility too.
    ``elements``: ``BLOCK_ELEMENTS``, so the default blocks are several (8 with chunks
    of 2: blocks of 1 page)."""
    if elements:
        monkeypatch.setattr("jaxpar.serving.pages.BLOCK_ELEMENTS", elements)
    L, P, S_p, N, K, H = 2, 12, 4, 4, 2, 8
    pages = rng.standard_normal((2, L, P, S_p, K, H)).astype(np.float32)
    tables = np.array([[3, 7, 1, 0], [5, 0, 0, 0], [2, 4, 6, 8], [9, 10, 0, 0]], np.int32)
    seq = np.array([0, 1, 1, 1, 1, 1, 2, -1, 3, 1, 0, -1], np.int32)
    last = np.array([9, 0, 1, 2, 3, 4, 15, 0, 5, 5, -1, 3], np.int32)
    readable = np.zeros((L, P, S_p), bool)
    for s, l in zip(seq, last):
        if s >= 0:
            slots = np.arange(l + 1)
            readable[:, tables[s, slots // S_p], slots % S_p] = True
    poisoned = np.where(readable[None, ..., None, None], pages, np.nan)
    q = rng.standard_normal((len(seq), N, H)).astype(np.float32)
    run = lambda pk, pv, **kw: np.asarray(jax.jit(lambda *a: attention(*a, **kw))(  # noqa: E731
        jnp.asarray(q), jnp.asarray(pk), jnp.asarray(pv), jnp.int32(1), jnp.asarray(seq), jnp.asarray(last),
        jnp.asarray(tables)))
    out = run(*poisoned, block_slots=block_slots, chunk=chunk)
    want = ragged_reference(q, *pages, 1, seq, last, tables)
    assert np.isfinite(out).all() and np.abs(out - want).max() < 1e-5 * np.abs(want).max()
    assert not out[[7, 10, 11]].any()  # padding, and a query with nothing to read
    # a tree over sequence 1's slots 1..4 (tokens 2..5; slot 0 cached): each reads the nodes its row says
    rows = rng.random((len(seq), 4)) < 0.5
    rows[np.arange(len(seq)), np.clip(last - 1, 0, 3)] = True  # itself
    visible = np.ones((len(seq), 16), bool)
    visible[1:6, 1:5] = rows[1:6]
    tree = (jnp.full(len(seq), 1, jnp.int32), jnp.asarray(rows))
    out = run(*pages, block_slots=block_slots, chunk=chunk, tree=tree)
    want = ragged_reference(q, *pages, 1, seq, last, tables, visible)
    assert np.abs(out[1:6] - want[1:6]).max() < 1e-5 * np.abs(want).max()


def test_pages_view_reads_the_pages_in_place_under_pallas_attention(rng):
    """Three new tokens per row over ragged cached lengths (a row with nothing cached):
    with ``attention="pallas"`` the view runs the ragged kernel (interpret mode here) on
    the pages and gives XLA's attention and the same pages."""
    L, P, S_p, B, T, N, K, H = 2, 7, 4, 2, 3, 4, 2, 8
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    lengths = jnp.asarray([6, 0], jnp.int32)
    seq = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    view = PagesView(normal(L, P, S_p, K, H), normal(L, P, S_p, K, H), jnp.int32(1), seq,
                     lengths[:, None] + jnp.arange(T, dtype=jnp.int32), jnp.asarray([[2, 5, 1], [3, 0, 0]], jnp.int32))
    q, k, v = normal(B, T, N, H), normal(B, T, K, H), normal(B, T, K, H)
    runs = {}
    for impl in ("pallas", "xla"):
        with use_execution(kernels=KernelOptions(attention=impl)):
            runs[impl] = jax.jit(view.attend)(q, k, v)
            program = str(jax.make_jaxpr(view.attend)(q, k, v))
        assert ("ragged_paged_attention" in program) == (impl == "pallas")
    (out, pages), (want, want_pages) = runs["pallas"], runs["xla"]
    assert rel_err(out, want) < 1e-5
    assert all(bool((a == b).all()) for a, b in zip(pages, want_pages))


@pytest.mark.slow  # end to end, as the engine's other tests (the view's test above is fast)
def test_pallas_attention_serves_the_tokens_of_xla(model):
    """The engine with ``attention="pallas"`` (the paged kernel, interpret mode) gives the
    greedy tokens of the XLA gather path in speculative rounds (the model its own draft,
    gamma 2: two and three new tokens per slot); one token per slot: the tensor-parallel
    test."""
    prompts, _ = requests(9, 3)
    params = [SamplingParams(max_tokens=4)] * 3
    want = [o.token_ids for o in engine(model).generate(prompts, params)]
    got = engine(model, kernels=KernelOptions(attention="pallas"), draft=model, gamma=2).generate(prompts, params)
    assert [o.token_ids for o in got] == want


@pytest.mark.slow
@pytest.mark.parametrize("tensor", [2, 4])
def test_tensor_parallel_serving_gives_one_devices_tokens(model, tensor):
    """mesh.tensor=2 splits the 4 query and 2 kv heads; tensor=4 outnumbers the kv heads,
    which are then replicated (as training does) rather than failing: the tokens of one
    device, the pages split by kv head (tensor=2) or replicated (tensor=4). The same
    with Pallas attention (interpret mode): each device's paged kernel on its batch rows
    and kv head (tensor=2)."""
    import jaxpar

    prompts, params = requests(6, 4)
    reference = engine(model).generate(prompts, params)
    mesh = jaxpar.make_mesh(data=8 // tensor, tensor=tensor, axis_types="auto")
    # steps of up to 16 tokens: 2 programs per mesh (8, 16) rather than 4 (how the steps are cut changes no token)
    served = engine(model, mesh=mesh, max_num_batched_tokens=16)
    assert served.kv.k.sharding.spec[3] == ("tensor" if tensor == 2 else None)
    outputs = served.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    if tensor == 2:  # (tensor=4: the kv heads whole on every device, the gather path as above)
        outputs = engine(model, mesh=mesh, kernels=KernelOptions(attention="pallas"),
                         max_num_batched_tokens=16).generate(prompts, params)
        assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]


def test_a_draft_whose_kv_heads_split_otherwise_is_refused_on_a_mesh(model):
    """On a mesh the draft is split as its model is (replicas on tensor-parallel meshes
    with GliDe drafts: test_serve); a draft whose kv heads split otherwise: one line."""
    import jaxpar

    mesh = jaxpar.make_mesh(tensor=2, devices=jax.devices()[:2], axis_types="auto")
    one_kv_head = Transformer(ModelConfig(vocab_size=CFG.vocab_size, dim=16, layers=1, heads=2, kv_heads=1,
                                          head_dim=8, mlp_dim=32), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"the draft's kv heads \(1\) do not split over the mesh as the model's"):
        engine(model, mesh=mesh, draft=one_kv_head)


@pytest.mark.slow
def test_speculative_rounds_are_lossless_per_sequence(model):
    """A draft in the engine: every decode step is one round for the running batch, each
    sequence accepting its own prefix. Greedy: the tokens without a draft, with the model
    itself as its draft (every proposal accepted: the draft's cache must catch up on the
    last one; rejections: the GliDe and CaPE tests); pages all back. A request with
    penalties beside a plain one: its tokens without a draft (one a round). (Seeded
    sampling with a draft, alone and in a crowd: the GliDe test below, whose rounds sample
    as a plain draft's do; nothing compiled after warm_up with a draft:
    test_serve's tensor-parallel GliDe crowd. An unrelated small draft here, on pages of 16,
    was two engines more to compile: 9 CPU-s.)"""
    prompts, params = requests(8, 6)
    reference = [o.token_ids for o in engine(model).generate(prompts[:4], params[:4])]
    served = engine(model, draft=model, gamma=3)
    assert [o.token_ids for o in served.generate(prompts[:4], params[:4])] == reference
    assert served.pool.free == served.pool.total and served.accepted == 3 * served.rounds
    # penalties (a bias that changes with every token): one token a round, the tokens without a draft
    penalized = SamplingParams(max_tokens=8, presence_penalty=1.5, frequency_penalty=0.7)
    alone_penalized = engine(model).generate([prompts[4]], penalized)[0].token_ids
    mixed = served.generate([prompts[4], prompts[5]], [penalized, params[5]])
    assert mixed[0].token_ids == alone_penalized and mixed[1].token_ids == alone(model, prompts[5], params[5])
    assert alone_penalized != alone(model, prompts[4], SamplingParams(max_tokens=8))  # the penalties count


def rounds_as_the_dense_decoders(served: Engine, model, draft, method: str, prompts) -> list:
    """Runs ``prompts`` greedily for 24 tokens through ``served`` (a speculative engine)
    and checks each sequence's tokens against plain greedy decoding and
    ``speculative_generate(method=...)`` (a ragged batch: each sequence decoded as
    alone, jaxpar.inference's own tests), and the engine's rounds and accepted drafts
    against the dense decoder's (one round: ``speculate``); the second request's
    logprobs (from the round's verification pass) against the model's ``log_softmax``;
    every page back after. Returns the outputs."""
    asked = [SamplingParams(max_tokens=24, logprobs=3 if b == 1 else None) for b in range(len(prompts))]
    outputs = served.generate(prompts, asked)
    dense = speculative_generate(model, prompts, draft=draft, method=method, gamma=3, max_new_tokens=24)
    plain = greedy(model, prompts, 24)
    for b, out in enumerate(outputs):
        assert out.token_ids == [int(t) for t in dense.tokens[b]] == plain[b]
    rounds = int(dense.rounds.sum())  # accepted drafts: every round's tokens but the target's own
    assert (served.rounds, served.accepted) == (rounds, int(dense.emitted.sum()) - rounds)
    assert served.pool.free == served.pool.total
    check_logprobs(model, prompts[1], outputs[1], 3)
    return outputs


def check_logprobs(model, prompt, out, k: int) -> None:
    """``out``'s logprobs and top ``k`` are ``log_softmax`` of the model's dense logits
    over the prompt and the tokens before each (float32, 1e-5)."""
    logits = dense_logits(model, list(prompt) + out.token_ids, LOGITS_WIDTH)
    logp = np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:-1], axis=-1))
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    np.testing.assert_allclose([lp.logprob for lp in out.logprobs], logp[np.arange(len(out.token_ids)), out.token_ids],
                               rtol=1e-5, atol=1e-5)
    for row, lp in zip(logp, out.logprobs):
        top = np.argsort(-row)[:k]
        assert [i for i, _ in lp.top] == top.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], row[top], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_glide_rounds_read_the_models_pages_as_the_dense_decoder_does(model):
    """A GliDe draft in the engine (its layers cross-attending to the model's pages): its
    pages after a chunked prefill are its dense cache's; each sequence's greedy tokens
    are the model's alone, and the rounds and accepted drafts over 3 requests batched
    together are those of ``speculative_generate(method="glide")`` with the dense cache
    (which a cross-attention reading a wrong or stale page changes); seeded sampling
    gives the same tokens alone and in a crowd. A method without a draft, or glide
    without a GliDe draft: one line."""
    draft = GlideDraft(CFG, 2, rngs=nnx.Rngs(5))  # 2 layers: the second's pages depend on cross-attention
    prompts, _ = requests(9, 3)
    params = [SamplingParams(max_tokens=24)] * 3
    # The draft's pages after its chunked prefill (149 tokens, rows of 64): its dense cache's.
    served = engine(model, draft=draft, gamma=3)
    request = served._requests[served.add_request(prompts[1], params[1])]
    while not request.output.token_ids:
        served.step()
    P = len(prompts[1])
    # jitted: one program, where an eager prefill compiles each of its ops (some 90 programs)
    prefill = nnx.jit(speculative.prefill, static_argnums=(0, 5, 7))
    dense = prefill(speculative.Method("glide", 3), model, draft, jnp.array([prompts[1]]), jnp.array([P]), 24,
                    jax.random.key(0), ()).draft_cache
    for pages, cached in ((served.draft_kv.k, dense.k), (served.draft_kv.v, dense.v)):
        # sliced in numpy: indexing the device arrays eagerly compiles an operation per index
        paged = np.asarray(pages)[:, request.seq.pages].reshape(2, -1, *pages.shape[3:])[:, :P]
        np.testing.assert_allclose(paged, np.asarray(cached)[:, 0, :P], rtol=1e-5, atol=1e-6)

    served = engine(model, draft=draft, gamma=3)
    assert served.method.name == "glide"
    outputs = rounds_as_the_dense_decoders(served, model, draft, "glide", prompts)
    assert served.accepted > served.rounds // 2

    # over a restricted vocabulary (glide.draft_vocab: its logits -inf elsewhere): a seeded
    # request samples the same alone and in a crowd, a greedy one gets its tokens alone
    draft = GlideDraft(CFG, 2, vocab=DraftVocab(np.arange(0, CFG.vocab_size, 3), CFG.vocab_size),
                       rngs=nnx.Rngs(5))
    sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=3)
    by_itself = engine(model, draft=draft, gamma=3).generate([prompts[2]], sampled)[0].token_ids
    crowd = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(2)]
    served = engine(model, draft=draft, gamma=3)
    together = served.generate(prompts, [crowd[0], params[1], sampled])
    assert together[2].token_ids == by_itself and len(set(by_itself)) > 1
    assert together[1].token_ids == outputs[1].token_ids and served.accepted > 0
    for kw, message in [(dict(method="glide"), "method='glide' needs a draft model"),
                        (dict(draft=model, method="glide"), "method 'glide' needs a GliDe draft"),
                        (dict(draft=nnx.eval_shape(lambda: GlideDraft(CFG, 1, features=True, rngs=nnx.Rngs(5)))),
                         "does not yet run a GliDe draft that reads the target's features")]:
        with pytest.raises(ValueError, match=message):
            engine(model, **kw)


@pytest.mark.slow
def test_cape_trees_over_pages_accept_as_the_dense_decoder_does(model):
    """CaPE in the engine (a random GliDe draft: unsure, so its trees are wide): greedy
    requests batched together get their tokens alone, with the rounds and accepted
    drafts of ``speculative_generate(method="cape")`` (the tree walk, and the accepted
    path's entries moved into place in the pages: a wrong move changes the next
    rounds); a seeded sampling request (verifying the chain) gets the same tokens alone
    and beside greedy ones; pages all back."""
    # the GliDe test's draft layout (2 layers) and a context of 240 tokens: its tables (33 pages of 8 for a
    # context and a round's 25 verified tokens) and pool, so the prompt chunks run its step programs (a step
    # depends on the draft's graph, not the method), compiled once
    draft = GlideDraft(CFG, 2, rngs=nnx.Rngs(7))
    prompts, _ = requests(10, 3)
    greedy = SamplingParams(max_tokens=24)
    cape = dict(draft=draft, method="cape", gamma=3, max_context=240)
    served = engine(model, **cape)
    assert served.tokens_per_row == served.method.tree.size and served.max_pages == 33
    outputs = rounds_as_the_dense_decoders(served, model, draft, "cape", prompts)
    assert served.accepted > 0

    sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=3)
    by_itself = engine(model, **cape).generate([prompts[2]], sampled)[0].token_ids
    together = engine(model, **cape).generate(prompts, [greedy, greedy, sampled])
    assert together[2].token_ids == by_itself and len(set(by_itself)) > 1
    assert [o.token_ids for o in together[:2]] == [o.token_ids for o in outputs[:2]]


# dense_logits' one width: the longest sequence a test reads (149 prompt tokens and 24 new ones), rounded up
LOGITS_WIDTH = 192


@pytest.mark.slow
def test_pages_on_demand_preempt_the_newest_and_it_resumes_with_its_own_tokens(model):
    """A pool of 23 pages (184 tokens) for 8 requests that would reserve 74 pages whole
    (up to 23 each): pages come as sequences grow, the newest running sequence is preempted when
    they run out and recomputed when readmitted; every greedy request gets its tokens
    alone and a seeded sampling one the tokens it samples alone; every page is free
    after, and the prefix cache's pages were reused by the readmissions."""
    prompts, params = requests(11, 8)
    params[3] = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=5)
    by_itself = engine(model).generate([prompts[3]], params[3])[0].token_ids
    served = engine(model, kv_pages=24)
    outputs = served.generate(prompts, params)
    steps = greedy(model, prompts, 30)
    for i, (p, out, reference) in enumerate(zip(params, outputs, steps, strict=True)):
        assert out.token_ids == (by_itself if i == 3 else reference[:p.max_tokens]), i
    assert served.preemptions > 0 and served.pool.free == served.pool.total and not served.has_unfinished()
    assert len(set(by_itself)) > 1


def test_a_cached_prefix_is_reused_and_gives_the_tokens_of_no_cache(model):
    """Three requests sharing a 40-token prefix (5 pages of 8), after a first one: each
    reuses the prefix's pages (``cached_tokens`` 40, the full pages of the shared part),
    prefills only the rest and gets the tokens it gets with caching off; two copies of
    one prompt added together (``n=2``'s shape) share its pages: the second waits for
    the first's, then reads all its full pages. The hit rate counts prompt tokens."""
    rng = np.random.default_rng(12)
    prefix = rng.integers(0, CFG.vocab_size, 43).tolist()  # 5 full pages and 3 tokens
    prompts = [prefix + rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 30, 1, 60)]
    params = SamplingParams(max_tokens=8)
    reference = [o.token_ids for o in engine(model, prefix_caching=False).generate(prompts, params)]
    served = engine(model)
    first = served.generate(prompts[:1], params)[0]
    rest = served.generate(prompts[1:], params)
    assert [o.token_ids for o in [first, *rest]] == reference
    assert first.cached_tokens == 0 and [o.cached_tokens for o in rest] == [40, 40, 40]
    assert (served.prefix_queries, served.prefix_hits) == (sum(map(len, prompts)), 120)

    served = engine(model)
    twins = served.generate([prompts[3], prompts[3]], params)
    assert [o.token_ids for o in twins] == [reference[3]] * 2
    assert [o.cached_tokens for o in twins] == [0, 96]  # 103 tokens: 12 full pages, the last token left
    off = engine(model, prefix_caching=False)
    assert [o.cached_tokens for o in off.generate([prompts[3]] * 2, params)] == [0, 0]


def test_logprobs_are_the_models_log_softmax_and_penalties_lower_repeats(model):
    """``logprobs=5``: each token's logprob and the top 5 equal ``log_softmax`` of the
    model's logits (a dense forward over the prompt and the tokens before it; float32,
    1e-5), alone and beside requests that ask none. Penalties: greedy decoding of the
    logits lowered by ``presence + frequency * count`` of each generated token, computed
    densely step by step, gives the engine's tokens."""
    prompt = np.random.default_rng(13).integers(0, CFG.vocab_size, 21).tolist()
    others, _ = requests(14, 3)
    asked = SamplingParams(max_tokens=6, logprobs=5)
    out = engine(model).generate([others[0], prompt, *others[1:]], [SamplingParams(max_tokens=9), asked,
                                                                    SamplingParams(max_tokens=4)] + [asked])[1]
    assert len(out.token_ids) == 6
    check_logprobs(model, prompt, out, 5)

    penalized = SamplingParams(max_tokens=10, presence_penalty=1.5, frequency_penalty=0.7)
    tokens = []
    for _ in range(10):
        row = dense_logits(model, prompt + tokens, LOGITS_WIDTH)[-1]
        for t in set(tokens):
            row[t] -= 1.5 + 0.7 * tokens.count(t)
        tokens.append(int(np.argmax(row)))
    assert engine(model).generate([prompt], penalized)[0].token_ids == tokens
    assert tokens != alone(model, prompt, SamplingParams(max_tokens=10))  # the penalties changed something
    for params, message in [(SamplingParams(logprobs=21), r"logprobs=21 must be None or an int in \[0, 20\]"),
                            (SamplingParams(presence_penalty=2.5), r"presence_penalty=2.5 must be in \[-2, 2\]")]:
        with pytest.raises(ValueError, match=message):
            engine(model).add_request(prompt, params)
