"""Serving under load (``jaxpar.serving``, issue 19): continuous batching against static
batching on the same engine, requests arriving as a Poisson process.

    python bench/serve.py [--model PATH | --config tiny] [--rates 2 4 8 16]
        [--requests 48] [--max-batch 8] [--prompt-tokens 16 256] [--max-tokens 8 96]
        [--seed 0] [--json PATH] [--png PATH]

Each rate (requests per second) runs the same requests twice, continuous and static
(``Engine(batching=...)``: static admits only into an empty batch): prompts are slices of
the interpreter's standard library source (tokenized with the model's tokenizer, or as
bytes modulo the vocabulary for a random-weights ``--config`` model), lengths uniform in
``--prompt-tokens``, each asking for a number of tokens uniform in ``--max-tokens``, no
end token (every request generates exactly what it asks for, so both modes do the same
work). The engine runs in this process, its loop driven by the wall clock: requests are
added when their arrival time has passed, then one ``Engine.step``. Programs are
compiled before the clock starts (``Engine.warm_up``).

Reported per mode and rate: time to first token (arrival to the step that samples it)
p50/p99, time per output token (first to last token over the tokens after the first)
p50/p99, request and output-token throughput over the run (first arrival to last
token), and KV-page utilisation (pages reserved / pages, mean over steps). The PNG
plots p99 time to first token and median time per output token against output tokens/s.
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
    ttft = [first[r] - arrived[r] for r in arrived]
    tpot = [(last[r][0] - first[r]) / (last[r][1] - 1) for r in arrived if last[r][1] > 1]
    tokens = sum(n for _, n in last.values())
    span = max(t for t, _ in last.values())
    pct = lambda xs, q: float(np.percentile(xs, q))  # noqa: E731
    return {"rate": rate, "requests": len(arrived), "output_tokens": tokens, "seconds": span,
            "requests_per_s": len(arrived) / span, "output_tokens_per_s": tokens / span,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
            "kv_utilisation": float(np.mean(used)), "steps": len(used)}


def draw(rows: list[dict], png: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, marker in zip(MODES, "os"):
        mine = [r for r in rows if r["mode"] == mode]
        x = [r["output_tokens_per_s"] for r in mine]
        for ax, key, label in ((axes[0], "ttft_p99_s", "p99 time to first token (s)"),
                               (axes[1], "tpot_p50_s", "median time per output token (s)")):
            ax.plot(x, [r[key] for r in mine], marker=marker, label=f"{mode} batching")
            for r in mine:
                ax.annotate(f"{r['rate']:g}/s", (r["output_tokens_per_s"], r[key]), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
            ax.set_xlabel("output tokens / s")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a run or Hugging Face directory (default: random weights)")
    parser.add_argument("--config", default="tiny", help="the random-weights model's config")
    parser.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[16, 256])
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[8, 96])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--png", type=pathlib.Path)
    args = parser.parse_args(argv)

    model, tokenizer = load(args)
    requests = make_requests(args, model.cfg.vocab_size, tokenizer, np.random.default_rng(args.seed))
    context = args.prompt_tokens[1] + args.max_tokens[1]
    rows = []
    print("| mode | rate (req/s) | output tok/s | req/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | KV pages used |")
    print("|---|---|---|---|---|---|---|")
    for rate in args.rates:
        for mode in MODES:
            engine = Engine(model, tokenizer=tokenizer, max_batch=args.max_batch, max_context=context,
                            page_size=args.page_size, prefill_chunk=args.prefill_chunk, batching=mode)
            engine.warm_up()
            row = {"mode": mode, **run(engine, requests, rate), "programs": len(engine.compiled_programs)}
            rows.append(row)
            print(f"| {mode} | {rate:g} | {row['output_tokens_per_s']:.1f} | {row['requests_per_s']:.2f} | "
                  f"{row['ttft_p50_s']:.2f} / {row['ttft_p99_s']:.2f} | {row['tpot_p50_s'] * 1e3:.1f} / "
                  f"{row['tpot_p99_s'] * 1e3:.1f} | {row['kv_utilisation']:.0%} |", flush=True)
    meta = {"command": " ".join(["python", *sys.argv]) if argv is None else "main(...)",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}", "jax": jax.__version__,
            "model": args.model or f"{args.config} (random weights)"}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.png:
        draw(rows, args.png, f"{meta['model']}, {args.requests} requests, {args.max_batch} slots, "
                             f"{meta['devices']}, {meta['date']}")
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
