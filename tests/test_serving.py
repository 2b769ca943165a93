"""The serving engine (jaxpar.serving): continuous batching over a paged KV cache gives
each request the tokens it gets decoded alone (jaxpar.inference.decoding.generate),
whatever it is batched with; pages all come back; no compiles after warm-up."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.inference.decoding import generate
from jaxpar.models import ModelConfig, Transformer
from jaxpar.serving import Engine, SamplingParams

CFG = ModelConfig(vocab_size=97, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=64)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def engine(model, **kw) -> Engine:
    """4 slots, pages of 8 tokens, prefill rows of up to 64 tokens: long prompts take
    several steps' rows, and requests wait for slots."""
    return Engine(model, **{"max_batch": 4, "max_context": 256, "page_size": 8, "prefill_chunk": 64, **kw})


def alone(model, prompt, params: SamplingParams) -> list[int]:
    """``prompt``'s tokens decoded by itself with a dense cache."""
    stream = generate(model, np.array([prompt]), max_new_tokens=params.max_tokens,
                      temperature=params.temperature, top_p=params.top_p, seed=params.seed)
    return [int(t[0]) for t in stream]


def requests(seed: int, count: int):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 150, count)
    lengths[:2] = (1, 149)  # the shortest prompt, and one over two prefill rows
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]
    return prompts, [SamplingParams(max_tokens=int(m)) for m in rng.integers(1, 30, count)]


def compiles_during(fn) -> int:
    """Backend compiles while ``fn()`` runs (jax.monitoring's compile-duration event)."""
    count = [0]

    def listen(event, duration, **_):
        count[0] += event == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return count[0]


def test_continuous_batching_gives_each_request_its_tokens_alone(model):
    """10 requests of 1 to 149 prompt tokens and 1 to 29 new ones through 4 slots: each
    request's greedy tokens are those it gets decoded alone; every page is free after;
    a second, different mix after this warm-up compiles nothing."""
    served = engine(model)
    prompts, params = requests(0, 10)
    outputs = served.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        assert out.token_ids == alone(model, prompt, p), (len(prompt), p.max_tokens)
        assert out.finish_reason == "length"
    assert served.pool.free == served.pool.total and not served.has_unfinished()
    # one decode program, one prefill program per row bucket used
    assert {shape[0] for shape in served.compiled_programs} == {"decode", "prefill"}
    assert len(served.compiled_programs) <= 1 + len(served.buckets)

    served.warm_up()  # what a server does before it listens: every bucket compiled
    prompts, params = requests(1, 10)
    assert compiles_during(lambda: served.generate(prompts, params)) == 0
    assert len(served.compiled_programs) == 1 + len(served.buckets) == 4


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
    assert not served._by_id  # a server's finished requests are not kept

    for prompt, params, message in [
        ([], SamplingParams(), "the prompt is empty"),
        ([1, 97], SamplingParams(), "token id 97 is outside the model's vocabulary of 97"),
        ([1], SamplingParams(max_tokens=0), "max_tokens=0 must be an int >= 1"),
        ([1], SamplingParams(temperature=-1.0), "temperature=-1.0 must be >= 0"),
        ([1], SamplingParams(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        ([1] * 250, SamplingParams(max_tokens=7), "prompt of 250 tokens \\+ max_tokens=7 is past the context of 256"),
    ]:
        with pytest.raises(ValueError, match=message):
            served.add_request(prompt, params)
