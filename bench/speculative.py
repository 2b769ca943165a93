"""Speculative decoding: mean accepted tokens per step and wall time, per method and batch.

    python bench/speculative.py --target runs/small --draft runs/small-draft \
        --glide runs/small-glide --batch 1 8 --json $OUT/speculative.json

``--target`` is a jaxpar run (or an HF directory with ``--prompts-from`` a jaxpar run for
its data config); ``--draft`` a small independent model with the same tokenizer;
``--glide`` a ``jaxpar-train glide`` run trained against the target. Prompts are the
first ``--prompt-tokens`` tokens of the first ``--prompts`` files of the validation split
of the target's corpus; every method generates ``--max-new-tokens`` greedily
(``eos`` does not stop it, so every method does the same work).

Per method (``ar``, ``speculative`` with the draft, ``glide``, ``cape`` with the GliDe
draft) and batch size:

* ``accepted/step``: tokens a round gave a sequence, the target's own (correction or
  bonus) token included, as Spec-Bench counts it; hardware independent.
* ``tokens/s`` and ``speedup`` over ``ar`` at the same batch: the whole generation,
  prefill included, one jitted loop (``speculative_generate``), compiled first, the
  median of ``--repeats`` runs. Meaningful on a GPU; on a CPU printed but not claimed.
* ``lossless``: every method's tokens equal ``ar``'s (greedy), checked on every run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

from jaxpar.inference.decoding import speculative_generate
from jaxpar.train import data as data_lib
from jaxpar.train.runs import load_glide_draft, load_model, load_tokenizer, read_config


def prompts(run_dir: pathlib.Path, count: int, length: int) -> list[np.ndarray]:
    """The first ``length`` tokens of the first ``count`` validation files (of at least
    that many tokens) of ``run_dir``'s corpus, tokenized by its tokenizer."""
    cfg = read_config(run_dir)
    tokenizer = load_tokenizer(run_dir)
    out = []
    for doc in data_lib.split_documents(cfg.data, "validation"):
        ids = tokenizer.encode(doc.text).ids
        if len(ids) >= length:
            out.append(np.asarray(ids[:length], np.int32))
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} validation files have {length} tokens; lower --prompt-tokens")


def validation_loss(run_dir: pathlib.Path) -> float | None:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    losses = [json.loads(l).get("val_loss") for l in path.read_text().splitlines()]
    losses = [l for l in losses if l is not None]
    return losses[-1] if losses else None


def run(target, rows, batch, method, draft, args):
    """``(tokens per row, accepted/step, seconds)`` over ``rows`` in batches of ``batch``."""
    tokens, emitted, rounds, seconds = [], 0.0, 0, []
    kwargs = dict(draft=draft, method=method, gamma=args.gamma, max_new_tokens=args.max_new_tokens)
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        speculative_generate(target, chunk, **kwargs)  # compile (cached for the next chunks)
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            out = speculative_generate(target, chunk, **kwargs)
            times.append(time.perf_counter() - began)
        seconds.append(statistics.median(times))
        tokens += out.tokens
        emitted += out.accepted_per_step * out.rounds.sum()
        rounds += int(out.rounds.sum())
    return tokens, emitted / rounds, sum(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=pathlib.Path, required=True)
    parser.add_argument("--draft", type=pathlib.Path, help="independent draft run (method speculative)")
    parser.add_argument("--glide", type=pathlib.Path, help="GliDe draft run (methods glide, cape)")
    parser.add_argument("--prompts-from", type=pathlib.Path, help="run whose corpus gives the prompts "
                        "(default: the target)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()

    target = load_model(args.target)
    rows = prompts(args.prompts_from or args.target, args.prompts, args.prompt_tokens)
    methods = [("ar", None)]
    if args.draft:
        methods.append(("speculative", load_model(args.draft)))
    if args.glide:
        glide = load_glide_draft(args.glide)
        methods += [("glide", glide), ("cape", glide)]
    device = jax.devices()[0].device_kind
    print(f"target {args.target} (validation loss {validation_loss(args.target)}), {len(rows)} prompts "
          f"of {args.prompt_tokens} tokens, {args.max_new_tokens} new, gamma {args.gamma}, on {device}",
          file=sys.stderr)
    results = []
    for batch in args.batch:
        reference, ar_seconds = None, None
        for name, draft in methods:
            tokens, accepted, seconds = run(target, rows, batch, name, draft, args)
            if name == "ar":
                reference, ar_seconds = tokens, seconds
            lossless = all(np.array_equal(a, b) for a, b in zip(tokens, reference))
            generated = sum(len(t) for t in tokens)
            results.append({"method": name, "batch": batch, "accepted_per_step": accepted,
                            "tokens_per_s": generated / seconds, "speedup": ar_seconds / seconds,
                            "lossless": lossless, "seconds": seconds})
            print(json.dumps(results[-1]), file=sys.stderr)
    print(f"\n| method | batch | accepted/step | tokens/s ({device}) | speedup over ar | lossless |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['method']} | {r['batch']} | {r['accepted_per_step']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {'yes' if r['lossless'] else 'NO'} |")
    if args.json:
        meta = {"target": str(args.target), "validation_loss": validation_loss(args.target),
                "device": device, "gamma": args.gamma, "max_new_tokens": args.max_new_tokens,
                "prompts": len(rows), "prompt_tokens": args.prompt_tokens}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if not all(r["lossless"] for r in results):
        sys.exit("a method's tokens differ from ar's: not lossless")


if __name__ == "__main__":
    main()
