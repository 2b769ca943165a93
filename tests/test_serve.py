"""jaxpar-serve (issue 19's server): a real server on 127.0.0.1 answering the official
``openai`` client. Concurrent requests get the tokens they get decoded alone, streamed
or not; stop strings and the end token cut where they should; bad requests get
OpenAI's error shape and the server goes on; a full queue answers 429; a client gone
mid-stream has its pages back; no compiles after warm-up; SIGTERM finishes the running
request and exits 0. OpenAI's fields: n choices seeded seed + i, logprobs equal to the
model's log-softmax, penalties as a greedy reference applies them, cached prompt tokens;
an API key guards /v1 (not /health, /metrics); a body over the limit is a 413."""

import asyncio
import json
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import uvicorn
from conftest import dense_logits, lazy_module, random_init
from flax import nnx
from test_serving import compiles_during

from jaxpar.inference.decoding import generate
from jaxpar.models import ModelConfig, Transformer, to_hf
from jaxpar.models.glide import GlideDraft
from jaxpar.serving import Engine, SamplingParams
from jaxpar.serving import code_maps
from jaxpar.serving.async_engine import AsyncEngine
from jaxpar.serving.replicas import Replicas
from jaxpar.serving.server import create_app
from jaxpar.commands import serve
from jaxpar.train.runs import eos_ids, load_model, load_tokenizer

openai = lazy_module("openai")  # the official client

CFG = ModelConfig(vocab_size=128, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp_dim=64,
                  max_position=512)
NAME = "tiny-served"
# transformers' variables: the tokenizer's bos_token, the messages, add_generation_prompt
TEMPLATE = ("{{ bos_token }} {% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}t9{% endif %}")
LONGEST = 100  # the most new tokens a test asks for
# 48 prompts of 1 to 300 tokens (the first two: the one whose greedy tokens reach the end
# token, and the longest)
PROMPTS = [np.random.default_rng(n).integers(2, 128, n).tolist() for n in (6, 300)] + [
    np.random.default_rng(100 + i).integers(2, 128, n).tolist()
    for i, n in enumerate(np.random.default_rng(0).integers(1, 301, 46))]
EOS_PROMPT = PROMPTS[0]
REFERENCES: dict[tuple[int, ...], list[int]] = {}  # prompt -> its LONGEST greedy tokens alone
# 24 pages of 32 tokens (a page: 2 layers x keys and values x 32 x 2 kv heads x 8 x 4 bytes):
# the longest request (300 + 100 tokens) needs 13, the 48 at once far more, so they preempt
PAGE_BYTES = 2 * 2 * 32 * 2 * 8 * 4
KV_MEMORY = 25 * PAGE_BYTES
# two prompts sharing the longest one's first 200 tokens (6 full pages of 32)
SHARING = [PROMPTS[1][:200] + np.random.default_rng(7 + i).integers(2, 128, 20 + 30 * i).tolist() for i in range(2)]


def text_of(ids) -> str:
    """The word-level tokenizer's text of ``ids``."""
    return " ".join(f"t{i}" for i in ids)


def decode_alone(model, prompts) -> list[list[int]]:
    """Each of ``prompts``' first LONGEST greedy tokens, decoded with a dense cache as by
    itself (a ragged batch: each sequence its own length; one compiled program)."""
    steps = np.stack(list(generate(model, prompts, max_new_tokens=LONGEST)), axis=1)
    return [row.tolist() for row in steps]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Llama as a Hugging Face directory: a word-level tokenizer (``t0`` ...
    ``t127``), a chat template, and an end token that EOS_PROMPT's greedy tokens reach
    (first seen at their 4th token or later)."""
    path = tmp_path_factory.mktemp("served")
    model = random_init(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), np.random.default_rng(1))
    to_hf(model, path)
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(128)}, "t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "chat_template": TEMPLATE}))
    free = decode_alone(model, [EOS_PROMPT])[0]
    end = next(free[i] for i in range(3, LONGEST) if free[i] not in free[:i])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end]}))
    return path


class Served:
    """The module's server: its URL, clients, engine and the references."""

    def __init__(self, url, async_engine, engine, model, eos):
        self.url, self.async_engine, self.engine, self.model, self.eos = url, async_engine, engine, model, eos
        self._references = REFERENCES  # every server of the module serves the same model

    def client(self) -> "openai.AsyncOpenAI":
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def reference(self, prompt, max_tokens) -> list[int]:
        """What the request should get: its tokens alone, up to ``max_tokens``, cut after
        the end token."""
        key = tuple(prompt)
        if key not in self._references:
            self._references[key] = decode_alone(self.model, [prompt])[0]
        tokens = self._references[key][:max_tokens]
        ends = [i for i, t in enumerate(tokens) if t in self.eos]
        return tokens[:ends[0] + 1] if ends else tokens

    def know(self, prompts) -> None:
        """Computes the references of ``prompts`` in one batch."""
        unknown = [p for p in prompts if tuple(p) not in self._references]
        if unknown:
            self._references.update(zip(map(tuple, unknown), decode_alone(self.model, unknown)))

    def metrics(self) -> dict[str, float]:
        """``/metrics``' samples without labels, by name."""
        text = httpx.get(f"{self.url}/metrics").text
        return {name: float(value) for name, value in re.findall(r"^(\w+) (\S+)$", text, re.M)} | {"_text": text}


def start(app, **config) -> tuple[uvicorn.Server, threading.Thread, str]:
    """``app`` served by uvicorn (``config``: more of its options) on a thread, on a free
    port of 127.0.0.1."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def served(hf_dir):
    """jaxpar-serve's own build (flags as on its command line: 4 batch slots, pages of 32
    tokens, prefill rows of up to 32: one page bucket, 2 row buckets) under uvicorn in
    this process."""
    yield from serving(hf_dir)


def serving(hf_dir, *extra, engine=None):
    """A server of ``hf_dir`` built by ``serve.build`` from its flags (and ``extra``), or
    of ``engine``; the Served while it runs."""
    args = serve._parser().parse_args([str(hf_dir), "--max-batch", "8", "--page-size", "32",
                                       "--max-num-batched-tokens", "32", "--kv-memory", str(KV_MEMORY),
                                       "--model-name", NAME, *extra])
    if engine is None:
        async_engine, app, engine = serve.build(args)
    else:
        engine.warm_up()
        async_engine = AsyncEngine(engine)
        app = create_app(async_engine, NAME, engine.tokenizer)
    server, thread, url = start(app)
    first = getattr(engine, "engines", [engine])[0]  # of Replicas, the first
    model = nnx.merge(first.graphdef, first.params)
    served = Served(url, async_engine, engine, model, engine.eos_ids)
    served.know(PROMPTS + SHARING)
    yield served
    server.should_exit = True
    thread.join(60)
    assert not thread.is_alive() and not async_engine._thread.is_alive()  # the app's shutdown stopped it


async def complete(client, prompt, max_tokens, *, stream=False, **kw) -> tuple[str, str, dict]:
    """``(text, finish_reason, usage)`` of one completion; streamed, the text is its
    deltas joined and the usage its last chunk's."""
    if not stream:
        out = await client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, **kw)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.model_dump(exclude_none=True)
    chunks = await client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, stream=True,
                                             stream_options={"include_usage": True}, **kw)
    deltas, reason, usage = [], None, None
    async for chunk in chunks:
        if chunk.choices:
            deltas.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            usage = chunk.usage.model_dump(exclude_none=True)
    return "".join(deltas), reason, usage


def cases(seed: int) -> list[tuple[list[int], int, bool]]:
    """The 48 PROMPTS, each with 1 to 100 new tokens, streamed or not: ``(prompt,
    max_tokens, stream)``; the end token's prompt asks for enough tokens to reach it."""
    rng = np.random.default_rng(seed)
    cases = [(p, int(m), bool(s)) for p, m, s in zip(PROMPTS, rng.integers(1, LONGEST + 1, len(PROMPTS)),
                                                    rng.integers(0, 2, len(PROMPTS)))]
    cases[0] = (EOS_PROMPT, LONGEST, True)
    return cases


def check_completions(served, cases, results) -> None:
    """Each completion's text, finish reason and usage are its tokens decoded alone."""
    for i, ((prompt, max_tokens, stream), (text, reason, usage)) in enumerate(zip(cases, results, strict=True)):
        tokens = served.reference(prompt, max_tokens)
        assert text == text_of([t for t in tokens if t not in served.eos]), (i, len(prompt), max_tokens, stream)
        assert reason == ("stop" if tokens[-1] in served.eos else "length"), i
        cached = usage.pop("prompt_tokens_details")["cached_tokens"]  # what earlier requests left
        assert usage == {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                         "total_tokens": len(prompt) + len(tokens)} and 0 <= cached <= len(prompt)


def requests_at_once(served, cases, *extra):
    """``cases`` (every fourth prompt as text, the rest as token ids), greedy, sent at once
    with the coroutines ``extra(client)`` beside them, counting the compiles they cause:
    ``(results, compiles)``."""
    async def burst():
        client = served.client()
        plain = [complete(client, p if i % 4 else text_of(p), m, stream=s, temperature=0)
                 for i, (p, m, s) in enumerate(cases)]
        return await asyncio.gather(*plain, *(make(client) for make in extra))

    results = []
    compiles = compiles_during(lambda: results.extend(asyncio.run(burst())))
    return results, compiles


def pages_all_free(served) -> None:
    metrics = served.metrics()
    assert metrics["jaxpar_kv_pages_free"] == metrics["jaxpar_kv_pages_total"] == served.engine.pool.total
    for engine in getattr(served.engine, "engines", [served.engine]):  # Replicas' too
        assert not engine.has_unfinished()  # finished requests are not kept
    assert not getattr(served.engine, "_where", None)


@pytest.mark.slow
def test_concurrent_requests_get_their_tokens_alone(served):
    """48 requests at once, at most 8 running, in a pool of 24 pages that forces
    preemptions: prompts of 1 to 300 tokens (one reaching the end token), 1 to 100 new
    tokens, greedy, streamed or not, as token ids or text, two sharing a 200-token prefix,
    plus three with stop strings, one with ``n=2`` and one with logprobs: each request's
    text and usage are those of its tokens decoded alone, streamed deltas join to that
    text, stop strings cut before their first appearance, both choices of ``n=2`` are
    the greedy tokens; nothing compiles; every page is free after. A seeded sampling
    request gives the same text alone as in the crowd. (JSON-schema requests need a
    tokenizer with JSON's characters: tests/test_serve_structured.py.)"""
    mixed = cases(0) + [(p, 40, i == 0) for i, p in enumerate(SHARING)]
    before = served.metrics()
    # stop strings: two words of a reference, and one that never appears beside one that does
    first, second = [p for p in PROMPTS if len(served.reference(p, 24)) == 24][:2]  # no end token in 24
    words = text_of(served.reference(first, 24)).split(" ")
    stops = [(first, [f"{words[5]} {words[6]}"], False), (first, [f"{words[5]} {words[6]}"], True),
             (second, ["t999", text_of(served.reference(second, 9)[7:9])], True)]
    sampled = dict(prompt=PROMPTS[3], max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    cut = [lambda client, p=p, stop=stop, s=s: complete(client, p, 24, stream=s, stop=stop, temperature=0)
           for p, stop, s in stops]
    twins = dict(model=NAME, prompt=PROMPTS[9], max_tokens=30, n=2, temperature=0)
    logprobs = dict(model=NAME, prompt=PROMPTS[10], max_tokens=30, logprobs=2, temperature=0)
    results, compiles = requests_at_once(served, mixed, *cut,
                                         lambda client: client.completions.create(model=NAME, **sampled),
                                         lambda client: client.completions.create(**twins),
                                         lambda client: client.completions.create(**logprobs))
    assert compiles == 0
    check_completions(served, mixed, results[:len(mixed)])
    twins_out, logprobs_out = results[-2:]
    results = results[:-2]
    for choice in (*twins_out.choices, *logprobs_out.choices):
        prompt = PROMPTS[9] if choice in twins_out.choices else PROMPTS[10]
        assert choice.text == text_of(t for t in served.reference(prompt, 30) if t not in served.eos)
    assert len(logprobs_out.choices[0].logprobs.token_logprobs) == logprobs_out.usage.completion_tokens
    after = served.metrics()
    assert after["jaxpar_preemptions_total"] > before["jaxpar_preemptions_total"]
    assert after["jaxpar_prefix_cache_hits_total"] > before["jaxpar_prefix_cache_hits_total"]
    assert results[0][1] == "stop"  # the end token reached, and left out of the text
    for (prompt, stop, _), (text, reason, usage) in zip(stops, results[len(mixed):]):
        whole = text_of(t for t in served.reference(prompt, 24) if t not in served.eos)
        at, first = min((whole.index(s), s) for s in stop if s in whole)
        assert text == whole[:at] and reason == "stop", stop
        # the tokens up to the one that completes the stop string
        assert usage["completion_tokens"] == len(whole[:at + len(first)].split(" ")), stop

    async def alone():
        return await served.client().completions.create(model=NAME, **sampled)

    crowd = results[-1].choices[0].text
    assert crowd == asyncio.run(alone()).choices[0].text and len(set(crowd.split())) > 1
    pages_all_free(served)


@pytest.fixture(scope="module")
def long_dir(hf_dir, tmp_path_factory):
    """The served model's directory with an 8,192-token context (its positions are
    rotary, so only the config's context differs)."""
    path = tmp_path_factory.mktemp("long")
    shutil.copytree(hf_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 8192}))
    return path


@pytest.mark.slow
def test_default_flags_on_an_8192_token_context(long_dir):
    """``jaxpar-serve PATH`` with no engine flag on a model whose context is 8,192 tokens
    (the served model's weights; its positions are rotary, so only the config's context
    differs): one program per token bucket of the default 256-token step budget, exactly
    6 (8 ... 256), whatever the context, well inside the memory-map guard (which would
    have refused the start). It listens once the 8-token step is compiled and compiles
    the others while serving: a mixed load at once (the 48 prompts of 1 to 300 tokens, 1
    to 100 new tokens) compiles nothing beside that warm-up and each request gets its
    tokens alone."""
    async_engine, app, engine = serve.build(serve._parser().parse_args([str(long_dir), "--model-name", NAME]))
    assert engine.max_context == 8192 and engine.max_batch == 256 and ("step", 8) in engine.compiled_programs
    assert 6 * code_maps.MAPS_PER_PROGRAM < 0.1 * 65530
    server, thread, url = start(app)
    try:
        served = Served(url, async_engine, engine, nnx.merge(engine.graphdef, engine.params), engine.eos_ids)
        mixed = cases(2)
        served.know([p for p, _, _ in mixed])
        results, compiles = requests_at_once(served, mixed)
        assert compiles == 0
        check_completions(served, mixed, results)
        pages_all_free(served)
        assert engine.wait_warm_up() and engine.compiled_programs == {("step", t) for t in (8, 16, 32, 64, 128, 256)}
    finally:
        server.should_exit = True
        thread.join(60)


def test_a_map_limit_too_small_for_the_programs_is_one_line_and_exit_2(hf_dir, monkeypatch, capsys):
    """A machine whose vm.max_map_count cannot hold even the default programs: after the
    start-up's progress lines, one line naming the limit and what to change, exit 2,
    before anything compiles."""
    monkeypatch.setattr(code_maps, "map_limit", lambda: 2000)
    assert serve.main([str(hf_dir), "--port", "0", "--no-progress"]) == 2
    *progress, error = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" ")[1] for line in progress] == ["loading", "compiling"]
    assert error.startswith("jaxpar-serve: error: compiling 6 programs") and "vm.max_map_count=2,000" in error
    assert "--max-num-batched-tokens" in error and "sysctl -w vm.max_map_count=" in error


@pytest.mark.slow
def test_concurrent_requests_on_a_tensor_parallel_replica_with_a_glide_draft(hf_dir):
    """Half the 48 requests again (other lengths; still a crowd for 4 batch slots, and all
    48 cost 7 CPU-s more), one with ``n=2`` and one with logprobs, on a tensor-parallel
    replica (mesh.tensor=2: model and draft split, behind ``Replicas``) with a GliDe
    draft (random: some of its proposals accepted, most not, which is what tests the
    rounds): each request its tokens decoded alone, no compiles, every page free;
    /metrics counts the rounds. Prefill rows of 16 tokens, one bucket (the served
    fixture's two are tested above): the bucket's warm-up compiles are much of this
    test's time, so one replica: two (mesh.data=2) compiled each program twice, on
    their own devices (speculative decoding on two replicas:
    test_command_line_serves_speculatively_on_replicas)."""
    tokenizer = load_tokenizer(hf_dir)
    replicas = Replicas([Engine(load_model(hf_dir), tokenizer=tokenizer, eos_ids=eos_ids(hf_dir, tokenizer),
                                max_batch=4, page_size=32, max_num_batched_tokens=16, kv_memory=KV_MEMORY,
                                mesh=mesh, gamma=3,
                                draft=GlideDraft(CFG, 1, rngs=nnx.Rngs(3))) for mesh in serve.meshes(1, 2)])
    for served in serving(hf_dir, engine=replicas):
        mixed = cases(1)[:24]
        twins = dict(model=NAME, prompt=PROMPTS[9], max_tokens=30, n=2, temperature=0)
        logprobs = dict(model=NAME, prompt=PROMPTS[10], max_tokens=30, logprobs=2, temperature=0)
        results, compiles = requests_at_once(served, mixed, lambda client: client.completions.create(**twins),
                                             lambda client: client.completions.create(**logprobs))
        assert compiles == 0
        check_completions(served, mixed, results[:len(mixed)])
        twins_out, logprobs_out = results[-2:]
        for choice in (*twins_out.choices, *logprobs_out.choices):  # n=2 and logprobs through the rounds
            prompt = PROMPTS[9] if choice in twins_out.choices else PROMPTS[10]
            assert choice.text == text_of(t for t in served.reference(prompt, 30) if t not in served.eos)
        assert len(logprobs_out.choices[0].logprobs.token_logprobs) == logprobs_out.usage.completion_tokens
        pages_all_free(served)
        metrics = served.metrics()
    assert [e.mesh.shape for e in replicas.engines] == [{"tensor": 2}]
    assert all(0 < e.accepted < e.rounds for e in replicas.engines)  # some proposals accepted, most not
    assert (metrics["jaxpar_speculative_rounds_total"], metrics["jaxpar_speculative_accepted_drafts_total"]) \
        == (replicas.rounds, replicas.accepted)
    assert metrics["jaxpar_speculative_accepted_per_round"] == pytest.approx(1 + replicas.accepted / replicas.rounds)


def test_chat_completions_render_the_template(served):
    """/v1/chat/completions renders the directory's template (bos_token, the messages,
    the generation prompt) and completes it as /v1/completions completes the rendered
    text; streamed, the deltas join to the message. A server without a template says so
    in a 400, and so does one whose template refuses the messages (its
    ``raise_exception``)."""
    messages = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"},
                {"role": "user", "content": [{"type": "text", "text": "t8"}]}]

    async def run():
        client = served.client()
        chat = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
        plain = await client.completions.create(model=NAME, prompt="t1 t5 t6 t7 t8 t9", max_tokens=6,
                                                temperature=0)
        chunks = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                                      temperature=0, stream=True)
        deltas = [c.choices[0].delta async for c in chunks]
        no_template = create_app(served.async_engine, NAME, served.engine.tokenizer)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(no_template), base_url="http://x") as raw:
            refused = await raw.post("/v1/chat/completions", json={"model": NAME, "messages": messages})
        strict = create_app(served.async_engine, NAME, served.engine.tokenizer,
                            chat_template="{{ raise_exception('only one turn, got ' ~ messages|length) }}")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(strict), base_url="http://x") as raw:
            rejected = await raw.post("/v1/chat/completions", json={"model": NAME, "messages": messages})
        return chat, plain, deltas, refused, rejected

    chat, plain, deltas, refused, rejected = asyncio.run(run())
    assert chat.choices[0].message.content == plain.choices[0].text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens == 6
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == plain.choices[0].text
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "no_chat_template"
    assert rejected.status_code == 400 and rejected.json()["error"]["message"] \
        == "the chat template refused the messages: only one turn, got 3"


BAD = [  # (body, status, param, words in the message)
    (b"{not json", 400, None, "not valid JSON"),
    ({"model": NAME}, 400, "prompt", "no prompt"),
    ({"model": NAME, "prompt": ""}, 400, "prompt", "the prompt is empty"),
    ({"model": NAME, "prompt": []}, 400, "prompt", "non-empty string"),
    ({"model": NAME, "prompt": "t5", "max_tokens": 0}, 400, "max_tokens", "max_tokens=0 must be at least 1"),
    ({"model": NAME, "prompt": "t5", "max_tokens": 600}, 400, "max_tokens", "past the model's context of 512"),
    ({"model": NAME, "prompt": "t5", "temperature": -0.5}, 400, "temperature", "temperature=-0.5 must be >= 0"),
    ({"model": NAME, "prompt": "t5", "top_p": 0}, 400, "top_p", "top_p=0 must be in (0, 1]"),
    ({"model": NAME, "prompt": "t5", "top_p": 1.5}, 400, "top_p", "top_p=1.5 must be in (0, 1]"),
    ({"model": NAME, "prompt": "t5", "n": 0}, 400, "n", "n=0 must be in [1, 16]"),
    ({"model": NAME, "prompt": "t5", "n": 17}, 400, "n", "n=17 must be in [1, 16]"),
    ({"model": NAME, "prompt": "t5", "seed": -1}, 400, "seed", "seed=-1 must be in [0, 2**32)"),
    ({"model": NAME, "prompt": "t5", "logprobs": 6}, 400, "logprobs", "logprobs=6 must be in [0, 5]"),
    ({"model": NAME, "prompt": "t5", "logprobs": -1}, 400, "logprobs", "logprobs=-1 must be in [0, 5]"),
    ({"model": NAME, "prompt": "t5", "logprobs": True}, 400, "logprobs", "logprobs=True must be an integer"),
    ({"model": NAME, "prompt": "t5", "presence_penalty": 2.5}, 400, "presence_penalty",
     "presence_penalty=2.5 must be in [-2, 2]"),
    ({"model": NAME, "prompt": "t5", "frequency_penalty": -3}, 400, "frequency_penalty",
     "frequency_penalty=-3 must be in [-2, 2]"),
    ({"model": NAME, "prompt": "t5", "frequency_penalty": "high"}, 400, "frequency_penalty",
     "frequency_penalty='high' must be a number"),
    ({"model": NAME, "prompt": "t5", "best_of": 2}, 400, "best_of", "best_of=2 is not supported"),
    ({"model": NAME, "prompt": "t5", "suffix": "t6"}, 400, "suffix", "not supported"),
    ({"model": NAME, "prompt": "t5", "logit_bias": {"5": 10}}, 400, "logit_bias", "not supported"),
    ({"model": NAME, "prompt": "t5", "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    ({"model": "gpt-4", "prompt": "t5"}, 400, "model", "model 'gpt-4' is not served here"),
    ({"prompt": "t5"}, 400, "model", "the request names no model (model=None); this server serves 'tiny-served'"),
    ({"model": NAME, "prompt": [3] * 512}, 400, "prompt", "the prompt is 512 tokens"),
    ({"model": NAME, "prompt": [3, 500]}, 400, None, "token id 500 is outside the model's vocabulary of 128"),
    ({"model": NAME, "prompt": "t5", "echo": True}, 400, "echo", "not supported"),
]


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "t5 t6"}]}
CHAT_BAD = [  # (body, status, param, words in the message) of /v1/chat/completions
    ({**CHAT, "logprobs": 2}, 400, "logprobs", "logprobs=2 must be true or false"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "top_logprobs=21 must be in [0, 20]"),
    ({**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs=2 needs logprobs=true"),
    ({**CHAT, "logprobs": False, "top_logprobs": 0}, 400, "top_logprobs", "top_logprobs=0 needs logprobs=true"),
    ({**CHAT, "n": 17}, 400, "n", "n=17 must be in [1, 16]"),
    ({**CHAT, "presence_penalty": -2.01}, 400, "presence_penalty", "presence_penalty=-2.01 must be in [-2, 2]"),
    ({**CHAT, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(served):
    """Each bad request: its status and OpenAI's error object naming the bad value; a
    valid request after all of them succeeds."""
    with httpx.Client(base_url=served.url) as raw:
        for path, body, status, param, words in [("/v1/completions", *bad) for bad in BAD] + [
                ("/v1/chat/completions", *bad) for bad in CHAT_BAD]:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            response = raw.post(path, **kw)
            error = response.json()["error"]
            assert response.status_code == status and error["param"] == param, (body, error)
            assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error"
        assert raw.get("/health").json() == {"status": "ok"}
        models = raw.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [NAME] and models[0]["max_model_len"] == 512
    prompts = [[3, 4], PROMPTS[3]]  # a list of texts: one choice each, in order
    out = asyncio.run(served.client().completions.create(model=NAME, prompt=[text_of(p) for p in prompts],
                                                         max_tokens=3, temperature=0))
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [text_of(served.reference(p, 3)) for p in prompts]
    assert out.usage.prompt_tokens == 2 + len(PROMPTS[3]) and out.usage.completion_tokens == 6


def test_full_queue_429_and_disconnected_streams_free_their_pages(served):
    """With no queue allowed, 8 streams fill the batch (at most 8 running) and a ninth
    request gets 429 (the official client's RateLimitError). The streams' clients then disconnect
    mid-stream: every page comes back (/metrics) within a moment. /metrics holds every
    series issue 19 names."""
    served.async_engine.max_queue = 0

    async def run():
        client = served.client()
        # 90 tokens: 3 pages each, so the 8 fit the pool's 24 pages at once (none preempted)
        whole = await client.completions.create(model=NAME, prompt="t16", max_tokens=90, temperature=0)
        assert whole.choices[0].finish_reason == "length"  # so these streams would run 90 tokens
        streams = [await client.completions.create(model=NAME, prompt="t16", max_tokens=90, temperature=0,
                                                   stream=True) for _ in range(8)]
        for stream in streams:  # each running: a first chunk
            await stream.__anext__()
        with pytest.raises(openai.RateLimitError) as refused:
            await client.completions.create(model=NAME, prompt="t3", max_tokens=2)
        busy = served.metrics()
        for stream in streams:
            await stream.close()  # the client hangs up mid-stream
        return refused.value, busy

    try:
        refused, busy = asyncio.run(run())
    finally:
        served.async_engine.max_queue = 256
    assert refused.status_code == 429 and refused.body["code"] == "queue_full"
    assert busy["jaxpar_requests_running"] == 8 and busy["jaxpar_kv_pages_free"] < busy["jaxpar_kv_pages_total"]
    deadline = time.monotonic() + 10
    while (m := served.metrics())["jaxpar_kv_pages_free"] != m["jaxpar_kv_pages_total"]:
        assert time.monotonic() < deadline, "the disconnected streams' pages never came back"
        time.sleep(0.05)
    assert m["jaxpar_requests_running"] == m["jaxpar_requests_waiting"] == 0
    # aborted: not run on to their 8 x 90 tokens
    assert m["jaxpar_generated_tokens_total"] - busy["jaxpar_generated_tokens_total"] < 360
    assert m["jaxpar_generated_tokens_total"] > 0 and m["jaxpar_time_to_first_token_seconds_count"] > 0
    for series in ["jaxpar_time_to_first_token_seconds_bucket{le=\"+Inf\"}",
                   "jaxpar_time_per_output_token_seconds_bucket{le=\"+Inf\"}",
                   "# TYPE jaxpar_time_per_output_token_seconds histogram",
                   "# TYPE jaxpar_generated_tokens_total counter", "# TYPE jaxpar_preemptions_total counter",
                   "# TYPE jaxpar_prefix_cache_queries_total counter", "# TYPE jaxpar_prefix_cache_hits_total counter",
                   "# TYPE jaxpar_prefix_cache_hit_rate gauge"]:
        assert series in m["_text"]
    assert m["jaxpar_time_per_output_token_seconds_count"] > 0
    ended = [{reason: float(count) for reason, count in re.findall(
        r'^jaxpar_requests_finished_total\{finish_reason="(\w+)"\} (\S+)$', metrics["_text"], re.M)}
        for metrics in (busy, m)]
    assert ended[0]["length"] >= 1  # the whole completion
    assert ended[1].get("abort", 0) - ended[0].get("abort", 0) == 8  # the streams whose clients hung up


def test_response_format_goes_through_the_structured_module(served):
    """``response_format`` is read by ``jaxpar.serving.structured``: one it refuses is a
    400 naming the field, ``{"type": "text"}`` is free text."""
    with httpx.Client(base_url=served.url) as raw:
        refused = raw.post("/v1/completions", json={"model": NAME, "prompt": "t5", "response_format": {"type": "x"}})
        text = raw.post("/v1/completions", json={"model": NAME, "prompt": "t5", "max_tokens": 3, "temperature": 0,
                                                 "response_format": {"type": "text"}})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "response_format" and "type='x'" in error["message"]
    assert text.status_code == 200 and text.json()["choices"][0]["text"] == text_of(served.reference([5], 3))


def test_n_choices_sample_with_seed_plus_i(served):
    """n=2 with seed 11: choice i of each prompt is the single request seeded 11 + i
    (completions: two prompts, index prompt_index * 2 + i; chat streamed, each index's
    deltas); usage counts each prompt once and every choice's tokens. Without a seed
    the choices differ."""
    prompts, sampling = [PROMPTS[3], PROMPTS[4]], dict(max_tokens=6, temperature=0.9)
    messages = CHAT["messages"]

    async def run():
        client = served.client()
        both = await client.completions.create(model=NAME, prompt=prompts, n=2, seed=11, **sampling)
        singles = await asyncio.gather(*(client.completions.create(model=NAME, prompt=p, seed=11 + i, **sampling)
                                         for p in prompts for i in range(2)))
        chunks = await client.chat.completions.create(model=NAME, messages=messages, n=2, seed=11, stream=True,
                                                      stream_options={"include_usage": True}, **sampling)
        streamed, usage = ["", ""], None
        async for chunk in chunks:
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
            usage = chunk.usage or usage
        chats = await asyncio.gather(*(client.chat.completions.create(model=NAME, messages=messages, seed=11 + i,
                                                                      **sampling) for i in range(2)))
        unseeded = await client.completions.create(model=NAME, prompt=prompts[0], n=2, **sampling)
        return both, singles, streamed, usage, chats, unseeded

    both, singles, streamed, usage, chats, unseeded = asyncio.run(run())
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [s.choices[0].text for s in singles]
    assert both.choices[0].text != both.choices[1].text  # the seeds differ
    assert both.usage.prompt_tokens == len(prompts[0]) + len(prompts[1])
    assert both.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert streamed == [c.choices[0].message.content for c in chats] and streamed[0] != streamed[1]
    assert usage.prompt_tokens == chats[0].usage.prompt_tokens
    assert usage.completion_tokens == sum(c.usage.completion_tokens for c in chats)
    assert unseeded.choices[0].text != unseeded.choices[1].text


def log_softmax_reference(model, prompt, ids) -> np.ndarray:
    """``[len(ids), V]``: the log-softmax of the model's logits (one dense forward over
    ``prompt + ids``, float32) at the positions that chose each of ``ids``."""
    logits = dense_logits(model, list(prompt) + list(ids[:-1]), LOGITS_WIDTH)[len(prompt) - 1:]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def check_logprobs(served, prompt, ids, chosen, tops, k) -> None:
    """Greedy ``ids`` are the reference's; ``chosen[j]`` is the reference log-softmax
    at ``ids[j]``; ``tops[j]``, ``k`` ``(id, logprob)``, is sorted, the reference's top
    ``k`` with their values, and (greedy: the argmax) starts with ``ids[j]``."""
    assert ids == served.reference(prompt, len(ids))
    reference = log_softmax_reference(served.model, prompt, ids)
    assert chosen == pytest.approx(reference[np.arange(len(ids)), ids].tolist(), rel=1e-5, abs=1e-5)
    for j, top in enumerate(tops):
        assert len(top) == k and [p for _, p in top] == sorted((p for _, p in top), reverse=True)
        assert not k or top[0][0] == ids[j]
        assert [t for t, _ in top] == np.argsort(-reference[j], kind="stable")[:k].tolist()
        assert [p for _, p in top] == pytest.approx(reference[j, [t for t, _ in top]].tolist(), rel=1e-5, abs=1e-5)


def token_id(text: str) -> int:
    """The word-level tokenizer's id of ``tN``."""
    assert re.fullmatch(r"t\d+", text), text
    return int(text[1:])


def test_completion_logprobs_are_the_models_log_softmax(served):
    """/v1/completions with ``logprobs=3``, greedy, streamed and not: per token its
    string, its logprob (the model's log-softmax at it), the top 3 as a dict and its
    text offset (the token strings' lengths before it); the stream's chunks join to
    the same lists. Without logprobs a choice's is null."""
    prompt, k = PROMPTS[3], 3

    async def run():
        client = served.client()
        whole = await client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=k)
        chunks = await client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                 logprobs=k, stream=True)
        parts = [c.choices[0].logprobs async for c in chunks if c.choices and c.choices[0].logprobs]
        plain = await client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
        return whole, parts, plain

    whole, parts, plain = asyncio.run(run())
    logprobs = whole.choices[0].logprobs
    ids = [token_id(t) for t in logprobs.tokens]
    tops = [[(token_id(t), p) for t, p in top.items()] for top in logprobs.top_logprobs]
    check_logprobs(served, prompt, ids, logprobs.token_logprobs, tops, k)
    assert logprobs.text_offset == np.cumsum([0] + [len(t) for t in logprobs.tokens[:-1]]).tolist()
    joined = {field: [x for part in parts for x in getattr(part, field)]
              for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined["tokens"] == logprobs.tokens and joined["text_offset"] == logprobs.text_offset
    assert joined["token_logprobs"] == pytest.approx(logprobs.token_logprobs, rel=1e-5, abs=1e-5)
    for top, want in zip(joined["top_logprobs"], logprobs.top_logprobs, strict=True):
        assert top == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_are_the_models_log_softmax(served):
    """/v1/chat/completions with ``logprobs: true, top_logprobs: 2``, greedy, streamed
    and not: ``logprobs.content`` per token its string, UTF-8 bytes, logprob (the
    model's log-softmax) and the top 2; the stream's chunks join to the same list;
    ``top_logprobs`` absent: none but the chosen token's."""
    prompt = served.engine.tokenizer.encode("t1 t5 t6 t9").ids  # the template's rendering of CHAT

    async def run():
        client = served.client()
        kw = dict(model=NAME, messages=CHAT["messages"], max_tokens=6, temperature=0, logprobs=True)
        whole = await client.chat.completions.create(top_logprobs=2, **kw)
        chunks = await client.chat.completions.create(top_logprobs=2, stream=True, **kw)
        parts = [c.choices[0].logprobs async for c in chunks if c.choices and c.choices[0].logprobs]
        bare = await client.chat.completions.create(**kw)
        return whole, parts, bare

    whole, parts, bare = asyncio.run(run())
    content = whole.choices[0].logprobs.content
    for entry in content + [top for entry in content for top in entry.top_logprobs]:
        assert entry.bytes == list(entry.token.encode())
    ids = [token_id(e.token) for e in content]
    check_logprobs(served, prompt, ids, [e.logprob for e in content],
                   [[(token_id(t.token), t.logprob) for t in e.top_logprobs] for e in content], 2)
    joined = [entry for part in parts for entry in part.content]
    assert [e.token for e in joined] == [e.token for e in content]
    assert [e.logprob for e in joined] == pytest.approx([e.logprob for e in content], rel=1e-5, abs=1e-5)
    assert [e.token for e in bare.choices[0].logprobs.content] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)


# dense_logits' one width: the longest sequence a test reads (PROMPTS[2], 256 tokens, and 12 new ones), rounded up
LOGITS_WIDTH = 288


def penalized_greedy(model, prompt, steps, presence, frequency, eos) -> list[int]:
    """Greedy tokens with OpenAI's penalties over the tokens generated so far: a
    token's logit less ``presence`` if it appeared, less ``frequency`` times its count
    (dense forwards over one padded length: causal, so the padding is unseen); cut
    after an end token."""
    tokens, ids = np.zeros(len(prompt) + steps, np.int32), []
    tokens[:len(prompt)] = prompt
    while len(ids) < steps and not (ids and ids[-1] in eos):
        logits = dense_logits(model, tokens, LOGITS_WIDTH)[len(prompt) + len(ids) - 1]
        counts = np.bincount(ids, minlength=logits.size)
        ids.append(int(np.argmax(logits - presence * (counts > 0) - frequency * counts)))
        tokens[len(prompt) + len(ids) - 1] = ids[-1]
    return ids


def test_penalties_steer_greedy_tokens_as_openai_defines_them(served):
    """Greedy with presence_penalty 1.5 and frequency_penalty 0.5 gives the penalized
    reference's tokens (which differ from plain greedy's: that repeats a token)."""
    prompt, steps = PROMPTS[2], 12
    want = penalized_greedy(served.model, prompt, steps, 1.5, 0.5, served.eos)
    assert want != served.reference(prompt, steps)
    out = asyncio.run(served.client().completions.create(model=NAME, prompt=prompt, max_tokens=steps, temperature=0,
                                                         presence_penalty=1.5, frequency_penalty=0.5))
    assert out.choices[0].text == text_of(t for t in want if t not in served.eos)
    assert out.usage.completion_tokens == len(want)


def test_prompt_tokens_read_from_the_prefix_cache_are_reported(served):
    """A 300-token prompt sent twice: the second reads at least 8 of its 9 whole pages of
    32 tokens from the prefix cache, in ``usage.prompt_tokens_details.cached_tokens``
    (streamed: the usage chunk's); /metrics counts the queries and hits (tokens) and
    their rate."""
    prompt = np.random.default_rng(999).integers(2, 128, 300).tolist()  # no other test's
    before = served.metrics()

    async def run():
        client = served.client()
        first = await client.completions.create(model=NAME, prompt=prompt, max_tokens=1)
        return first.usage, (await complete(client, prompt, 1, stream=True))[2]

    first, second = asyncio.run(run())
    after = served.metrics()
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 256 <= cached < 300, second
    hits = after["jaxpar_prefix_cache_hits_total"] - before["jaxpar_prefix_cache_hits_total"]
    queries = after["jaxpar_prefix_cache_queries_total"] - before["jaxpar_prefix_cache_queries_total"]
    assert cached <= hits <= queries and queries >= 300
    assert after["jaxpar_prefix_cache_hit_rate"] == pytest.approx(
        after["jaxpar_prefix_cache_hits_total"] / after["jaxpar_prefix_cache_queries_total"])


KEY = "s3cret-key"


@pytest.fixture(scope="module")
def guarded(served):
    """A second app over the module's engine, with an API key and a 1,000-byte body
    limit, under uvicorn without its lifespan (whose shutdown would stop the shared
    engine): its URL."""
    app = create_app(served.async_engine, NAME, served.engine.tokenizer, api_key=KEY, max_request_bytes=1000)
    server, thread, url = start(app, lifespan="off")
    yield url
    server.should_exit = True
    thread.join(60)
    assert not thread.is_alive() and served.async_engine._thread.is_alive()


def test_api_key_guards_v1_but_not_health_or_metrics(served, guarded):
    """With a key: /v1 requests without the Authorization header, or with another key,
    get 401 in OpenAI's shape (the official client's AuthenticationError), not naming
    the key; the right key is served; /health and /metrics need none."""
    def client(key):
        return openai.AsyncOpenAI(base_url=f"{guarded}/v1", api_key=key, max_retries=0)

    async def run():
        with pytest.raises(openai.AuthenticationError) as wrong:
            await client("not-the-key").completions.create(model=NAME, prompt="t5", max_tokens=2)
        right = await client(KEY).completions.create(model=NAME, prompt="t5", max_tokens=2, temperature=0)
        listed = await client(KEY).models.list()
        return wrong.value, right, listed

    wrong, right, listed = asyncio.run(run())
    assert wrong.status_code == 401 and wrong.body["code"] == "invalid_api_key" and KEY not in str(wrong.body)
    assert right.choices[0].text == text_of(served.reference([5], 2)) and [m.id for m in listed.data] == [NAME]
    with httpx.Client(base_url=guarded) as raw:
        for method, path in [("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/v1/nowhere")]:
            response = raw.request(method, path)
            error = response.json()["error"]
            assert response.status_code == 401 and set(error) == {"message", "type", "param", "code"}, path
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert "Authorization: Bearer" in error["message"]
        assert raw.get("/health").json() == {"status": "ok"}
        assert "jaxpar_generated_tokens_total" in raw.get("/metrics").text


def test_a_body_over_the_limit_is_413_before_it_is_read(served, guarded):
    """Over the 1,000-byte limit: 413 in OpenAI's shape, at once from Content-Length
    (naming both sizes), and for a chunked body (no Content-Length) once 1,000 bytes
    came; the server then serves a request. The module's server (jaxpar-serve's
    default) refuses a body of 1 MiB + 1 byte and serves the next."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = json.dumps({"model": NAME, "prompt": "t5 " * 2000, "max_tokens": 1}).encode()

    def pieces():
        for start in range(0, len(body), 300):
            yield body[start:start + 300]

    with httpx.Client(base_url=guarded, headers=auth) as raw:
        sized = raw.post("/v1/completions", content=body)
        chunked = raw.post("/v1/completions", content=pieces())
        after = raw.post("/v1/completions", json={"model": NAME, "prompt": "t5", "max_tokens": 2, "temperature": 0})
    assert sized.status_code == 413 and sized.json()["error"]["message"].startswith(
        f"the request body is {len(body)} bytes, over the server's limit of 1000 bytes")
    assert "content-length" not in chunked.request.headers and chunked.status_code == 413
    assert "over the server's limit of 1000 bytes" in chunked.json()["error"]["message"]
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == text_of(served.reference([5], 2))
    with httpx.Client(base_url=served.url) as raw:
        huge = raw.post("/v1/completions", content=b" " * ((1 << 20) + 1))
        assert huge.status_code == 413 and "limit of 1048576 bytes" in huge.json()["error"]["message"]
        assert raw.post("/v1/completions", json={"model": NAME, "prompt": "t5", "max_tokens": 1}).status_code == 200


def test_command_line_refuses_what_is_not_supported_yet(hf_dir, capsys):
    """Bad CaPE bins and mesh sizes, overrides other than mesh.tensor, mesh.expert and
    mesh.data: one line, exit 2, before loading; mesh.expert on a model without experts:
    one line, exit 2, once it is loaded."""
    for argv, words in [([str(hf_dir), "--draft", str(hf_dir), "--method", "cape", "--bins", "3"],
                         "--bins: bins=[3] must be 11 positive integers"),
                        ([str(hf_dir), "mesh.seq=2"], "mesh.seq=2: only mesh.tensor=K, mesh.expert=E and mesh.data=R are"),
                        ([str(hf_dir), "mesh.data=0"], "mesh.data=0: mesh.data must be a positive integer"),
                        ([str(hf_dir), "mesh.tensor=x"], "mesh.tensor=x: mesh.tensor must be a positive integer"),
                        ([str(hf_dir), "--method", "speculative"], "--method speculative needs --draft"),
                        ([str(hf_dir), "--max-batch", "0"], "--max-batch 0 must be an integer >= 1"),
                        ([str(hf_dir), "--max-request-bytes", "0"], "--max-request-bytes 0 must be at least 1")]:
        with pytest.raises(SystemExit) as exit_:
            serve.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert serve.main([str(hf_dir), "mesh.expert=2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "jaxpar-serve: error: mesh.expert=2 splits a MoE model's experts: this model has none"


def test_command_line_reads_the_api_key_from_the_environment(hf_dir, monkeypatch, capsys):
    """--api-key defaults to $JAXPAR_API_KEY (a flag overrides it; empty is refused in
    one line) and --help never shows it; --max-request-bytes defaults to 1 MiB."""
    monkeypatch.setenv("JAXPAR_API_KEY", KEY)
    parser = serve._parser()
    args = parser.parse_args([str(hf_dir)])
    assert args.api_key == KEY and args.max_request_bytes == 1 << 20
    assert parser.parse_args([str(hf_dir), "--api-key", "other"]).api_key == "other"
    assert KEY not in parser.format_help() and "1048576" in parser.format_help()
    monkeypatch.setenv("JAXPAR_API_KEY", "")
    with pytest.raises(SystemExit) as exit_:
        serve.main([str(hf_dir)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--api-key (or JAXPAR_API_KEY) is empty" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_command_line_serves_speculatively_on_replicas(hf_dir):
    """``--draft`` (the model as its own draft: every proposal accepted) and
    ``mesh.data=2`` build two replicas that give the tokens decoded alone."""
    prompts = [[5, 9, 2, 7], [8, 3]]
    # one request per replica: --max-batch 1, a round program of 1 row per replica (the default, 5, also compiles
    # rounds of 4 and 5 rows, which two requests over two replicas never run)
    engine = serve.build(serve._parser().parse_args([str(hf_dir), "--max-num-batched-tokens", "16", "--max-context", "64",
                                                     "--max-batch", "1", "--draft", str(hf_dir), "--gamma", "2",
                                                     "mesh.data=2"]))[2]
    got = [o.token_ids for o in engine.generate([text_of(p) for p in prompts], SamplingParams(max_tokens=8))]
    first = engine.engines[0]
    want = decode_alone(nnx.merge(first.graphdef, first.params), prompts)
    for tokens, reference in zip(got, want):
        assert tokens == reference[:len(tokens)] and (len(tokens) == 8 or tokens[-1] in first.eos_ids)
    assert all(e.method.name == "speculative" and e.accepted == 2 * e.rounds > 0 for e in engine.engines)


@pytest.mark.slow
def test_the_readmes_run_dir_command_serves_the_run(tmp_path):
    """README: ``jaxpar-serve runs/tiny --port 8000`` on a jaxpar run dir (a random small
    model's, tests/test_runs.py's, with a 300-word tokenizer; flags that make one program
    of 8 tokens), served on a free port: a greedy completion over HTTP, under the run
    dir's name, is the run's tokens decoded alone."""
    from test_runs import write_run

    run = tmp_path / "try"
    write_run(run, np.random.default_rng(3), opt_state=False)
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(300)}, "t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.save(str(run / "tokenizer.json"))
    _, app, _ = serve.build(serve._parser().parse_args([str(run), "--port", "0", "--max-batch", "1",
                                                        "--max-num-batched-tokens", "8", "--max-context", "32",
                                                        "--no-progress"]))
    server, thread, url = start(app)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="try", prompt="t5 t9 t2", max_tokens=8, temperature=0)
    finally:
        server.should_exit = True
        thread.join(60)
    want = np.stack(list(generate(load_model(run), [[5, 9, 2]], max_new_tokens=8)), axis=1)[0].tolist()
    assert len(set(want)) > 1 and out.choices[0].text == text_of(want)
    assert out.usage.completion_tokens == 8 and out.model == "try"


@pytest.mark.slow
def test_sigterm_finishes_the_running_request_and_exits_0(hf_dir):
    """``python -m jaxpar.commands.serve PATH --port 0``: a line saying what it loads, one
    saying how many programs it compiles, then one with the URL; SIGTERM during a
    streamed request stops the listener, the stream still ends with all its tokens, and
    the process exits 0 with a line saying how many requests it finished."""
    process = subprocess.Popen([sys.executable, "-m", "jaxpar.commands.serve", str(hf_dir), "--port", "0",
                                "--max-batch", "2", "--max-num-batched-tokens", "16", "--max-context", "256",
                                "--model-name", NAME],
                               stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not (match := re.search(r"^jaxpar-serve: .* on (http://127\.0\.0\.1:\d+)/v1 \((\d) of (\d+) "
                                      r"programs compiled", lines[-1] if lines else "")):
            lines.append(process.stderr.readline())
            assert lines[-1], "".join(lines)  # the process ended without its line
        # flat batches of 8 and 16 tokens: it listens once the first is compiled
        assert int(match[2]) in (1, 2) and int(match[3]) == 2, lines[-1]
        done = "jaxpar-serve: all 2 programs compiled, "
        assert [line.split(":", 2)[:2] for line in lines[:-1] if not line.startswith(done)] == [
            ["jaxpar-serve", f" loading {hf_dir}\n"], ["jaxpar-serve", " compiling 2 programs"]], lines
        client = openai.OpenAI(base_url=f"{match[1]}/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(model=NAME, prompt="t16", max_tokens=200, temperature=0, stream=True,
                                           stream_options={"include_usage": True})  # no end token in 200
        text = next(chunks).choices[0].text
        process.send_signal(signal.SIGTERM)
        rest = list(chunks)
        text += "".join(c.choices[0].text for c in rest if c.choices)
        reason = [c.choices[0].finish_reason for c in rest if c.choices][-1]
        assert process.wait(60) == 0, process.stderr.read()
        last = process.stderr.read().splitlines(keepends=True)
        assert [line for line in last if not line.startswith(done)] == [
            "jaxpar-serve: stopped by SIGTERM: 1 request finished\n"]
        assert sum(line.startswith(done) for line in lines + last) <= 1
        assert reason == "length" and len(text.split()) == rest[-1].usage.completion_tokens == 200
        with pytest.raises(openai.APIConnectionError):
            client.completions.create(model=NAME, prompt="t3", max_tokens=1)
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
@pytest.mark.bench
def test_step_benchmark_times_every_case(long_dir, tmp_path):
    """bench/serve_step.py at a tiny scale: every case (rows x greedy/sampled, rows x
    contexts, rows x an arrival with and without a cached prefix) timed, positive, in
    its JSON file. On the 8,192-token context's directory: its default engine's 6
    programs are test_default_flags_on_an_8192_token_context's, which the run has
    compiled (the persistent compilation cache)."""
    import runpy

    script = pathlib.Path(__file__).resolve().parents[1] / "bench" / "serve_step.py"
    bench = runpy.run_path(str(script), run_name="bench_serve_step")
    bench["main"]([str(long_dir), "--rows", "1", "2", "--contexts", "40", "--steps", "2", "--repeats", "1",
                   "--json", str(tmp_path / "step.json")])
    times = json.loads((tmp_path / "step.json").read_text())["step_ms"]
    assert sorted(times) == sorted(f"rows={r} {c}" for r in (1, 2) for c in (
        "context=32 greedy", "context=32 sampled", "context=40 greedy", "arrival of 62 new tokens",
        "arrival of 62 new tokens after a cached 300"))
    assert all(len(v) == 1 and v[0] > 0 for v in times.values())
