"""jaxpar-serve (issue 19's server): a real server on 127.0.0.1 answering the official
``openai`` client. Concurrent requests get the tokens they get decoded alone, streamed
or not; stop strings and the end token cut where they should; bad requests get
OpenAI's error shape and the server goes on; a full queue answers 429; a client gone
mid-stream has its pages back; no compiles after warm-up; SIGTERM finishes the running
request and exits 0."""

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import tokenizers
import uvicorn
from conftest import random_init
from flax import nnx
from test_serving import compiles_during

from jaxpar.inference.decoding import generate
from jaxpar.models import ModelConfig, Transformer, to_hf
from jaxpar.models.glide import GlideDraft
from jaxpar.serving import Engine, SamplingParams
from jaxpar.serving.async_engine import AsyncEngine
from jaxpar.serving.replicas import Replicas
from jaxpar.serving.server import create_app
from jaxpar.train import serve
from jaxpar.train.runs import eos_ids, load_model, load_tokenizer

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

    def client(self) -> openai.AsyncOpenAI:
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


def start(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    """``app`` served by uvicorn on a thread, on a free port of 127.0.0.1."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
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
    args = serve._parser().parse_args([str(hf_dir), "--max-batch", "4", "--page-size", "32",
                                       "--prefill-chunk", "32", "--model-name", NAME, *extra])
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
    served.know(PROMPTS)
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
        assert usage == {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                         "total_tokens": len(prompt) + len(tokens)}


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
        assert not engine._by_id  # finished requests are not kept
    assert not getattr(served.engine, "_where", None)


def test_concurrent_requests_get_their_tokens_alone(served):
    """48 requests at once through 4 batch slots: prompts of 1 to 300 tokens (one reaching
    the end token), 1 to 100 new tokens, greedy, streamed or not, as token ids or text,
    plus three with stop strings: each request's text and usage are those of its tokens
    decoded alone, streamed deltas join to that text, stop strings cut before their
    first appearance; nothing compiles; every page is free after. A seeded sampling
    request gives the same text alone as in the crowd."""
    mixed = cases(0)
    # stop strings: two words of a reference, and one that never appears beside one that does
    first, second = [p for p in PROMPTS if len(served.reference(p, 24)) == 24][:2]  # no end token in 24
    words = text_of(served.reference(first, 24)).split(" ")
    stops = [(first, [f"{words[5]} {words[6]}"], False), (first, [f"{words[5]} {words[6]}"], True),
             (second, ["t999", text_of(served.reference(second, 9)[7:9])], True)]
    sampled = dict(prompt=PROMPTS[3], max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    cut = [lambda client, p=p, stop=stop, s=s: complete(client, p, 24, stream=s, stop=stop, temperature=0)
           for p, stop, s in stops]
    results, compiles = requests_at_once(served, mixed, *cut,
                                         lambda client: client.completions.create(model=NAME, **sampled))
    assert compiles == 0
    check_completions(served, mixed, results[:len(mixed)])
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


@pytest.mark.slow
def test_concurrent_requests_on_tensor_parallel_replicas_with_a_glide_draft(hf_dir):
    """The 48 requests again (other lengths) on a server of two replicas (mesh.data=2),
    each tensor-parallel (mesh.tensor=2: model and draft split) with a GliDe draft
    (random: some of its proposals accepted, most not, which is what tests the rounds):
    each request its tokens decoded alone, no compiles, every page free; /metrics
    counts the rounds. Prefill rows of 16 tokens, one bucket (the served fixture's two
    are tested above): each bucket costs a warm-up compile per replica, most of this
    test's time."""
    tokenizer = load_tokenizer(hf_dir)
    replicas = Replicas([Engine(load_model(hf_dir), tokenizer=tokenizer, eos_ids=eos_ids(hf_dir, tokenizer),
                                max_batch=4, page_size=32, prefill_chunk=16, mesh=mesh, gamma=3,
                                draft=GlideDraft(CFG, 1, rngs=nnx.Rngs(3))) for mesh in serve.meshes(2, 2)])
    for served in serving(hf_dir, engine=replicas):
        mixed = cases(1)
        results, compiles = requests_at_once(served, mixed)
        assert compiles == 0
        check_completions(served, mixed, results)
        pages_all_free(served)
        metrics = served.metrics()
    assert [e.mesh.shape for e in replicas.engines] == [{"tensor": 2}] * 2
    assert all(0 < e.accepted < e.rounds for e in replicas.engines)  # both replicas served
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
    ({"model": NAME, "prompt": "t5", "n": 2}, 400, "n", "n=2 is not supported"),
    ({"model": "gpt-4", "prompt": "t5"}, 400, "model", "model 'gpt-4' is not served here"),
    ({"prompt": "t5"}, 400, "model", "the request names no model (model=None); this server serves 'tiny-served'"),
    ({"model": NAME, "prompt": [3] * 512}, 400, "prompt", "the prompt is 512 tokens"),
    ({"model": NAME, "prompt": [3, 500]}, 400, None, "token id 500 is outside the model's vocabulary of 128"),
    ({"model": NAME, "prompt": "t5", "echo": True}, 400, "echo", "not supported"),
]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(served):
    """Each bad request: its status and OpenAI's error object naming the bad value; a
    valid request after all of them succeeds."""
    with httpx.Client(base_url=served.url) as raw:
        for body, status, param, words in BAD:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            response = raw.post("/v1/completions", **kw)
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
    """With no queue allowed, 4 streams fill the 4 batch slots and a fifth request gets
    429 (the official client's RateLimitError). The streams' clients then disconnect
    mid-stream: every page comes back (/metrics) within a moment. /metrics holds every
    series issue 19 names."""
    served.async_engine.max_queue = 0

    async def run():
        client = served.client()
        whole = await client.completions.create(model=NAME, prompt="t16", max_tokens=250, temperature=0)
        assert whole.choices[0].finish_reason == "length"  # so these streams would run 250 tokens
        streams = [await client.completions.create(model=NAME, prompt="t16", max_tokens=250, temperature=0,
                                                   stream=True) for _ in range(4)]
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
    assert busy["jaxpar_requests_running"] == 4 and busy["jaxpar_kv_pages_free"] < busy["jaxpar_kv_pages_total"]
    deadline = time.monotonic() + 10
    while (m := served.metrics())["jaxpar_kv_pages_free"] != m["jaxpar_kv_pages_total"]:
        assert time.monotonic() < deadline, "the disconnected streams' pages never came back"
        time.sleep(0.05)
    assert m["jaxpar_requests_running"] == m["jaxpar_requests_waiting"] == 0
    # aborted: not run on to their 4 x 250 tokens
    assert m["jaxpar_generated_tokens_total"] - busy["jaxpar_generated_tokens_total"] < 500
    assert m["jaxpar_generated_tokens_total"] > 0 and m["jaxpar_time_to_first_token_seconds_count"] > 0
    for series in ["jaxpar_time_to_first_token_seconds_bucket{le=\"+Inf\"}",
                   "jaxpar_time_per_output_token_seconds_bucket{le=\"+Inf\"}",
                   "# TYPE jaxpar_time_per_output_token_seconds histogram",
                   "# TYPE jaxpar_generated_tokens_total counter"]:
        assert series in m["_text"]
    assert m["jaxpar_time_per_output_token_seconds_count"] > 0
    ended = [{reason: float(count) for reason, count in re.findall(
        r'^jaxpar_requests_finished_total\{finish_reason="(\w+)"\} (\S+)$', metrics["_text"], re.M)}
        for metrics in (busy, m)]
    assert ended[0]["length"] >= 1  # the whole completion
    assert ended[1].get("abort", 0) - ended[0].get("abort", 0) == 4  # the streams whose clients hung up


def test_command_line_refuses_what_is_not_supported_yet(hf_dir, capsys):
    """Bad CaPE bins and mesh sizes, overrides other than mesh.tensor and mesh.data: one
    line, exit 2, before loading."""
    for argv, words in [([str(hf_dir), "--draft", str(hf_dir), "--method", "cape", "--bins", "3"],
                         "--bins: bins=[3] must be 11 positive integers"),
                        ([str(hf_dir), "mesh.seq=2"], "mesh.seq=2: only mesh.tensor=K and mesh.data=R are supported"),
                        ([str(hf_dir), "mesh.data=0"], "mesh.data=0: mesh.data must be a positive integer"),
                        ([str(hf_dir), "mesh.tensor=x"], "mesh.tensor=x: mesh.tensor must be a positive integer"),
                        ([str(hf_dir), "--method", "speculative"], "--method speculative needs --draft"),
                        ([str(hf_dir), "--max-batch", "0"], "--max-batch 0 must be at least 1")]:
        with pytest.raises(SystemExit) as exit_:
            serve.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_command_line_serves_speculatively_on_replicas(hf_dir):
    """``--draft`` (the model as its own draft: every proposal accepted) and
    ``mesh.data=2`` build two replicas that give the tokens decoded alone."""
    prompts = [[5, 9, 2, 7], [8, 3]]
    engine = serve.build(serve._parser().parse_args([str(hf_dir), "--prefill-chunk", "16", "--max-context", "64",
                                                     "--draft", str(hf_dir), "--gamma", "2", "mesh.data=2"]))[2]
    got = [o.token_ids for o in engine.generate([text_of(p) for p in prompts], SamplingParams(max_tokens=8))]
    first = engine.engines[0]
    want = decode_alone(nnx.merge(first.graphdef, first.params), prompts)
    for tokens, reference in zip(got, want):
        assert tokens == reference[:len(tokens)] and (len(tokens) == 8 or tokens[-1] in first.eos_ids)
    assert all(e.method.name == "speculative" and e.accepted == 2 * e.rounds > 0 for e in engine.engines)


@pytest.mark.slow
def test_sigterm_finishes_the_running_request_and_exits_0(hf_dir):
    """``python -m jaxpar.train.serve PATH --port 0``: a line saying what it loads, one
    saying how many programs it compiles, then one with the URL; SIGTERM during a
    streamed request stops the listener, the stream still ends with all its tokens, and
    the process exits 0 with a line saying how many requests it finished."""
    process = subprocess.Popen([sys.executable, "-m", "jaxpar.train.serve", str(hf_dir), "--port", "0",
                                "--max-batch", "2", "--prefill-chunk", "16", "--max-context", "256",
                                "--model-name", NAME],
                               stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not (match := re.search(r"^jaxpar-serve: .* on (http://127\.0\.0\.1:\d+)/v1 \((\d+) compiled "
                                      r"programs", lines[-1] if lines else "")):
            lines.append(process.stderr.readline())
            assert lines[-1], "".join(lines)  # the process ended without its line
        assert int(match[2]) == 2, lines[-1]  # one decode, one prefill bucket
        assert [line.split(" (")[0] for line in lines[:-1]] == [f"jaxpar-serve: loading {hf_dir}\n",
                                                              "jaxpar-serve: compiling 2 programs"], lines
        client = openai.OpenAI(base_url=f"{match[1]}/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(model=NAME, prompt="t16", max_tokens=200, temperature=0, stream=True,
                                           stream_options={"include_usage": True})  # no end token in 200
        text = next(chunks).choices[0].text
        process.send_signal(signal.SIGTERM)
        rest = list(chunks)
        text += "".join(c.choices[0].text for c in rest if c.choices)
        reason = [c.choices[0].finish_reason for c in rest if c.choices][-1]
        assert process.wait(60) == 0, process.stderr.read()
        assert process.stderr.read() == "jaxpar-serve: stopped by SIGTERM: 1 request finished\n"
        assert reason == "length" and len(text.split()) == rest[-1].usage.completion_tokens == 200
        with pytest.raises(openai.APIConnectionError):
            client.completions.create(model=NAME, prompt="t3", max_tokens=1)
    finally:
        process.kill()
        process.wait()
