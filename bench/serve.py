"""Serving under load (``jaxpar.serving``, issue 19): requests arriving as a Poisson
process, continuous batching against static batching on the same engine, and jaxpar-serve
against another OpenAI-compatible server on the same load.

    python bench/serve.py engine [--model PATH | --config tiny] [--rates 2 4 8 16]
        [--requests 48] [--max-batch 8] [--prompt-tokens 16 256] [--max-tokens 8 96]
        [--seed 0] [--json PATH] [--png PATH]
    python bench/serve.py http --model PATH [--rates ...] [--requests ...] [...]
        [--against-url URL --against-model NAME --against-label LABEL [--against-mode MODE]]
        [--draft DIR [--method M]] [mesh.tensor=K mesh.data=R]
    python bench/serve.py plot RESULTS.json [RESULTS.json ...] --png PATH

``engine``: the engine in this process, its loop driven by the wall clock (requests are
added when their arrival time has passed, then one ``Engine.step``); every request
generates exactly what it asks for (no end token), so both modes do the same work.
``http`` (loopback): ``jaxpar-serve PATH --batching MODE`` is started for each mode
(``--port 0``, programs compiled before it listens) and the load is sent to it with
streamed ``/v1/completions`` (greedy, ``stream_options.include_usage``); with
``--against-url`` the same load also goes to that server (``transformers serve``, say),
its completions counted by the usage it reports. Requests may end at the model's end
token there, so modes and servers are compared by output tokens per second.

Prompts are slices of the interpreter's standard library source (the model's tokenizer;
bytes modulo the vocabulary for a random-weights ``--config`` model, engine mode only),
lengths uniform in ``--prompt-tokens``, each asking for a number of tokens uniform in
``--max-tokens``. Reported per mode and rate: time to first token (arrival to its first
token) p50/p99, time per output token (first to last token over the tokens after the
first) p50/p99, request and output-token throughput over the run (first arrival to
last token), and (engine mode) KV-page utilisation (pages reserved / pages, mean over
steps). The PNG plots p99 time to first token and median time per output token
against output tokens/s, one line per server and batching mode, the offered rate by
marker. ``plot`` redraws it from ``--json`` files (their rows together, the first
file's ``meta`` in the title), with the same drawing as a live run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import sysconfig
import time

import jax
import numpy as np
from flax import nnx

from jaxpar.serving import Engine, SamplingParams

MODES = ("continuous", "static")


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


def make_requests(args, vocab: int, tokenizer, rng) -> list[tuple[float, list[int], int]]:
    """``(arrival s, prompt ids, max_tokens)`` for ``args.requests`` requests at rate 1
    (the arrival times are scaled per rate)."""
    text = corpus_text()
    ids = np.asarray(tokenizer.encode(text).ids) if tokenizer else np.frombuffer(text.encode(), np.uint8).astype(np.int64) % vocab
    arrivals = np.cumsum(rng.exponential(1.0, args.requests))
    out = []
    for arrival in arrivals:
        n = int(rng.integers(args.prompt_tokens[0], args.prompt_tokens[1] + 1))
        start = int(rng.integers(0, len(ids) - n))
        out.append((float(arrival - arrivals[0]), ids[start:start + n].astype(int).tolist(),
                    int(rng.integers(args.max_tokens[0], args.max_tokens[1] + 1))))
    return out


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


def run(engine: Engine, requests, rate: float) -> dict:
    """The requests through ``engine`` at ``rate`` requests/s: per-request timings."""
    pending = [(arrival / rate, prompt, m) for arrival, prompt, m in requests]
    arrived, first, last, used = {}, {}, {}, []
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
    return {"rate": rate, **summary(arrived, first, last), "kv_utilisation": float(np.mean(used)),
            "steps": len(used)}


async def _one(client, url: str, model: str, text: str, max_tokens: int, t0: float, times: dict, key: int):
    """One streamed completion; records its first and last token times and token count."""
    import json as json_lib

    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first, count, chunks = None, None, 0
    async with client.stream("POST", f"{url}/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json_lib.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices") or ()):
                chunks += 1
                first = first or time.perf_counter() - t0
    times["first"][key] = first if first is not None else time.perf_counter() - t0
    times["last"][key] = (time.perf_counter() - t0, count if count is not None else chunks)


def run_http(url: str, model: str, tokenizer, requests, rate: float) -> dict:
    """The requests, as text, to the server at ``url`` at ``rate`` requests/s."""
    import asyncio

    import httpx

    async def main():
        times = {"arrived": {}, "first": {}, "last": {}}
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1000)) as client:
            t0 = time.perf_counter()
            tasks = []
            for key, (arrival, prompt, m) in enumerate(requests):
                await asyncio.sleep(max(arrival / rate - (time.perf_counter() - t0), 0))
                times["arrived"][key] = time.perf_counter() - t0
                tasks.append(asyncio.create_task(_one(client, url, model, tokenizer.decode(prompt), m, t0, times,
                                                      key)))
            await asyncio.gather(*tasks)
        return times

    times = asyncio.run(main())
    return {"rate": rate, **summary(times["arrived"], times["first"], times["last"])}


def start_server(path: str, mode: str, args) -> tuple:
    """``(process, url)``: ``jaxpar-serve PATH --batching MODE --port 0``, once listening."""
    import re
    import subprocess

    command = [sys.executable, "-m", "jaxpar.train.serve", path, "--port", "0", "--batching", mode,
               "--max-batch", str(args.max_batch), "--page-size", str(args.page_size),
               "--prefill-chunk", str(args.prefill_chunk), "--model-name", "bench", "--max-queue", "100000",
               "--max-context", str(args.prompt_tokens[1] + args.max_tokens[1] + 16), *args.overrides]
    if args.draft:
        command += ["--draft", args.draft] + (["--method", args.method] if args.method else [])
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines = []
    while not (match := re.search(r" on (http://\S+/v1) ", lines[-1] if lines else "")):
        lines.append(process.stderr.readline())
        if not lines[-1]:
            raise RuntimeError("jaxpar-serve ended before listening:\n" + "".join(lines))
    return process, match[1]


def series_label(row: dict) -> str:
    """The plain name of a row's series: ``jaxpar-serve, continuous batching``; another
    server by its ``--against-label`` and, when given, ``--against-mode``."""
    mode = row.get("mode")
    if mode in MODES:
        return f"{row['server']}, {mode} batching"
    return f"{row['server']}, {mode}" if mode and mode != "its own" else row["server"]


def title(meta: dict) -> str:
    """The picture's title from a run's ``meta``."""
    parts = [pathlib.Path(meta["model"]).name]
    if meta.get("requests"):
        parts.append(f"{meta['requests']} requests per rate")
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
    fig.legend(handles=lines, loc="lower left", ncol=2, fontsize=9, frameon=False, title="server, batching",
               title_fontsize=9, bbox_to_anchor=(0.06, 0.0))
    fig.legend(handles=points, loc="lower right", ncol=len(points), fontsize=9, frameon=False,
               title="offered load (marker)", title_fontsize=9, bbox_to_anchor=(0.94, 0.0))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.042 * rows_below, 1, 1))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _print(row: dict) -> None:
    kv = f"{row['kv_utilisation']:.0%}" if "kv_utilisation" in row else "-"
    print(f"| {row['server']} | {row.get('mode') or '-'} | {row['rate']:g} | {row['output_tokens_per_s']:.1f} | "
          f"{row['requests_per_s']:.2f} | {row['ttft_p50_s']:.2f} / {row['ttft_p99_s']:.2f} | "
          f"{row['tpot_p50_s'] * 1e3:.1f} / {row['tpot_p99_s'] * 1e3:.1f} | {kv} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="redraw the picture from --json files")
    plot.add_argument("results", type=pathlib.Path, nargs="+", help="this script's --json files")
    plot.add_argument("--png", type=pathlib.Path, required=True)
    for name in ("engine", "http"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=name == "http",
                       help="a run, Hugging Face directory or .gguf file (engine default: random weights)")
        p.add_argument("--config", default="tiny", help="the random-weights model's config (engine)")
        p.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8, 16])
        p.add_argument("--requests", type=int, default=48)
        p.add_argument("--max-batch", type=int, default=8)
        p.add_argument("--prompt-tokens", type=int, nargs=2, default=[16, 256])
        p.add_argument("--max-tokens", type=int, nargs=2, default=[8, 96])
        p.add_argument("--page-size", type=int, default=16)
        p.add_argument("--prefill-chunk", type=int, default=256)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", type=pathlib.Path)
        p.add_argument("--png", type=pathlib.Path)
        if name == "http":
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
        draw([row for run in runs for row in run["rows"]], args.png, title(runs[0]["meta"]))
        print(f"wrote {args.png}")
        return
    if args.command == "http":
        from jaxpar.train.runs import load_tokenizer

        model, tokenizer = None, load_tokenizer(pathlib.Path(args.model))
        vocab = tokenizer.get_vocab_size()
    else:
        model, tokenizer = load(args)
        vocab = model.cfg.vocab_size
    requests = make_requests(args, vocab, tokenizer, np.random.default_rng(args.seed))
    context = args.prompt_tokens[1] + args.max_tokens[1]
    rows = []
    print("| server | mode | rate (req/s) | output tok/s | req/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
          "| KV pages used |")
    print("|---|---|---|---|---|---|---|---|")
    for rate in args.rates:
        for mode in () if getattr(args, "only_against", False) else MODES:
            if args.command == "engine":
                engine = Engine(model, tokenizer=tokenizer, max_batch=args.max_batch, max_context=context,
                                page_size=args.page_size, prefill_chunk=args.prefill_chunk, batching=mode)
                engine.warm_up()
                row = {"server": "jaxpar engine", "mode": mode, **run(engine, requests, rate),
                       "programs": len(engine.compiled_programs)}
            else:
                process, url = start_server(args.model, mode, args)
                try:
                    row = {"server": "jaxpar-serve", "mode": mode, **run_http(url, "bench", tokenizer, requests, rate)}
                finally:
                    process.terminate()
                    process.wait(timeout=120)
            rows.append(row)
            _print(row)
        if args.command == "http" and args.against_url:
            row = {"server": args.against_label, "mode": args.against_mode,
                   **run_http(args.against_url, args.against_model, tokenizer, requests, rate)}
            rows.append(row)
            _print(row)
    meta = {"command": " ".join(["python", *sys.argv]) if argv is None else "main(...)",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}", "jax": jax.__version__,
            "model": args.model or f"{args.config} (random weights)", "requests": args.requests,
            "max_batch": args.max_batch}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.png:
        draw(rows, args.png, title(meta))
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
