"""The ``serve`` part (65 s): the serving engine's throughput and latency under load.

The engine ``jaxpar-serve`` runs (``bench/serve.py``'s engine mode: paged KV cache,
continuous then static batching) on a ``small`` target with random weights, 64 requests
at 32/s, 32 slots, prompts of 16-192 tokens asking 16-64 (``serve_settings``: one page
bucket, 6 programs to compile; ``tiny`` and 6 requests in ``--smoke``). First, where
fastapi, uvicorn and httpx import and the train part left its ``small`` run with a
checkpoint: ``jaxpar-serve`` over HTTP on that run (``part_serve_http``, a part of its
own, ``--child serve_http``, killed with its server at half the time left), before this
process holds any GPU memory. Output tokens/s, requests/s, TTFT and TPOT p50/p99, as
BENCHMARKS.md's "Serving" table prints them.
"""

from __future__ import annotations

import argparse
import time

from part import Record, Skip, load_bench, md_table, missing, run_part, short, time_left
from probe import HTTP_DEPS, need_pallas_gpu
from train_bench import run_dir


def serve_settings(ns) -> dict:
    """The load: one page bucket (prompt + new tokens within 16 pages of 16), so the
    engine compiles one program per step shape (decode rows x prompt tokens)."""
    if ns.smoke:
        return dict(config="tiny", requests=6, rate=50.0, max_batch=4, prompt_tokens=[8, 32], max_tokens=[4, 8])
    return dict(config="small", requests=64, rate=32.0, max_batch=32, prompt_tokens=[16, 192], max_tokens=[16, 64])


def serve_args(settings: dict) -> argparse.Namespace:
    """What bench/serve.py's functions read of its command line."""
    return argparse.Namespace(model=None, config=settings["config"], requests=settings["requests"],
                              max_batch=settings["max_batch"], prompt_tokens=settings["prompt_tokens"],
                              max_tokens=settings["max_tokens"], page_size=16, max_num_batched_tokens=256, seed=0,
                              overrides=[], draft=None, method=None, system_tokens=0)


def context(settings: dict) -> int:
    """The longest prompt plus its most new tokens."""
    return settings["prompt_tokens"][1] + settings["max_tokens"][1]


def serve_row_text(r: dict) -> str:
    return (f"{r['server']} {r['mode']}: {r['output_tokens_per_s']:,.0f} output tokens/s, "
            f"TTFT p50/p99 {r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f} s, TPOT p50 {r['tpot_p50_s'] * 1e3:.1f} ms")


def part_serve_http(ns, rec: Record) -> None:
    """``jaxpar-serve RUN --batching continuous`` (bench/serve.py's ``start_server``) and
    the load over HTTP; a process group of its own, which the serve part kills at its
    share of the time (the server with it)."""
    import numpy as np

    from jaxpar.train.runs import load_tokenizer

    serve = load_bench("serve")
    settings = serve_settings(ns)
    args = serve_args(settings)
    small = run_dir(ns.work, "small")
    tokenizer = load_tokenizer(small)
    ids = serve.corpus_ids(tokenizer.get_vocab_size(), tokenizer)
    requests = serve.make_requests(args, ids, [], np.random.default_rng(0))
    args.model = str(small)
    command = serve.server_command(args, serve.Variant("jaxpar-serve", "continuous"), context(settings), None)
    process, url, started = serve.start_server(command)
    rec["start_s"] = round(started, 1)  # load + compile every program
    try:
        rec["row"] = {"server": "jaxpar-serve (HTTP)", "mode": "continuous",
                      "model": f"{'tiny' if ns.smoke else 'small'}, the train part's run",
                      **serve.run_http(url, "bench", tokenizer, requests, settings["rate"]), "start_s": rec["start_s"]}
    finally:
        process.terminate()
        process.wait(timeout=60)
    rec["status"] = "ok"


def serve_over_http(ns, rec: Record) -> None:
    """``rec["http"]``: ``ok`` (its row added), ``skipped: why`` or ``failed: why``."""
    http_missing = missing(HTTP_DEPS)
    if http_missing:
        rec["http"] = f"skipped: {', '.join(http_missing)} not installed (jaxpar-serve's HTTP stack)"
        return
    if not (run_dir(ns.work, "small") / "checkpoints").exists():
        rec["http"] = "skipped: no small run with a checkpoint from the train part"
        return
    if time_left() < 60:
        rec["http"] = "skipped: time limit"
        return
    share = 0.5 * time_left()
    code, text, http, _ = run_part("serve_http", ns.work, time.time() + share, ns.smoke)
    print(text[-6000:], flush=True)
    if code is None:
        rec["http"] = f"failed: killed after {share:.0f} s (its share of the part)"
    elif http.get("status") != "ok":
        rec["http"] = f"failed: {http.get('reason') or short(text) or f'exit {code}'}"
    else:
        rec["http"] = "ok"
        rec["rows"].append(http["row"])
    if rec["http"] != "ok":
        rec["http_tail"] = text[-3000:]
    rec.save()


def part_serve(ns, rec: Record) -> None:
    need_pallas_gpu(ns)
    gone = missing(("flax", "tokenizers", "yaml"))
    if gone:
        raise Skip(f"{', '.join(gone)} not installed")
    settings = serve_settings(ns)
    args = serve_args(settings)
    rec["settings"] = settings
    rec["rows"] = []
    serve_over_http(ns, rec)  # first, before this process holds any GPU memory (the server is another process)
    import numpy as np

    serve = load_bench("serve")
    model, _ = serve.load(args)
    requests = serve.make_requests(args, serve.corpus_ids(model.cfg.vocab_size, None), [], np.random.default_rng(0))
    for mode in serve.MODES:
        if time_left() < (15 if ns.smoke else 30) and any(r["server"] == "jaxpar engine" for r in rec["rows"]):
            rec.setdefault("skipped", []).append(f"engine {mode}: time limit")
            continue
        began = time.perf_counter()
        engine = serve.Engine(model, tokenizer=None, max_batch=settings["max_batch"], max_context=context(settings),
                              page_size=args.page_size, max_num_batched_tokens=args.max_num_batched_tokens,
                              batching=mode)
        engine.warm_up()
        warm = time.perf_counter() - began
        row = {"server": "jaxpar engine", "mode": mode, "model": f"{settings['config']} (random weights)",
               **serve.run(engine, requests, settings["rate"]), "warm_up_s": round(warm, 1),
               "programs": len(engine.compiled_programs)}
        rec["rows"].append(row)
        rec.save()
        del engine
        print(f"  {serve_row_text(row)} (warm-up {warm:.0f} s)", flush=True)
    rows = rec["rows"]
    http_failed = rec["http"].startswith("failed")
    rec["status"] = "ok" if rows and not http_failed else "failed"
    if http_failed:
        rec["reason"] = f"HTTP {rec['http']}"
    rec["summary"] = (f"{settings['config']}, {settings['requests']} requests at {settings['rate']:g}/s, "
                      f"{settings['max_batch']} slots: " + "; ".join(serve_row_text(r) for r in rows)
                      + ("" if rec["http"] == "ok" else f"; HTTP {rec['http']}")
                      + "".join(f"; {s}" for s in rec.get("skipped", [])))
    rec["details"] = md_table(
        ["server", "model", "batching", "rate (req/s)", "output tok/s", "req/s", "TTFT p50 / p99 (s)",
         "TPOT p50 / p99 (ms)", "compile"],
        [[r["server"], r["model"], r["mode"], f"{settings['rate']:g}", f"{r['output_tokens_per_s']:,.1f}",
          f"{r['requests_per_s']:.2f}", f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}",
          f"{r['tpot_p50_s'] * 1e3:.1f} / {r['tpot_p99_s'] * 1e3:.1f}",
          f"{r['warm_up_s']:.0f} s ({r['programs']} programs)" if "warm_up_s" in r
          else (f"{r['start_s']:.0f} s (server start)" if "start_s" in r else "-")] for r in rows])
