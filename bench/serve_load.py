"""The load of ``bench/serve.py`` and its measurement, client side: the requests
(prompts sliced from the standard library's source, Poisson arrivals at rate 1, the chat
load's shared system prompt), the KV pool ``--kv-fraction`` leaves (``kv_budget``),
driving them through the in-process engine (``run``) or streamed to an OpenAI-compatible
server (``run_http``), jaxpar-serve's ``/metrics`` counters before and after a rate, and
a run's figures (time to first token, time per output token, throughput: ``summary``).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import sysconfig
import time
from typing import NamedTuple

import numpy as np

from jaxpar.serving import Engine, SamplingParams
from jaxpar.serving.pages import page_bytes

# /metrics counters read before and after each rate: the row's key, the metric's name
METRICS = {"preemptions": "jaxpar_preemptions_total", "prefix_cache_queries": "jaxpar_prefix_cache_queries_total",
           "prefix_cache_hits": "jaxpar_prefix_cache_hits_total"}


class Request(NamedTuple):
    """One request of a load: ``arrival`` (seconds at rate 1), its ``prompt`` ids (a
    chat request's system ids then its user ids, ``system`` of them the system's) and
    ``max_tokens``."""

    arrival: float
    prompt: list[int]
    max_tokens: int
    system: int = 0


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
