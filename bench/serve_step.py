r"""What one step of jaxpar-serve's engine costs, in-process (no HTTP): decode steps by
the rows decoding, greedy and sampled (after 32-token prompts), and greedy by the context
the rows decode at; and the step that brings a new request's 62 tokens while the rows
decode, with and without a cached 300-token prefix before them (the chat load's
arrivals; issue 49, "where a step's time goes").

    python bench/serve_step.py PATH [--rows 1 8] [--contexts 32 350 2000] [--repeats 2]
        [--steps 16] [--json OUT]

PATH: a GGUF file, Hugging Face directory or run. The engine runs at its defaults (the
server's), its programs compiled first. For each case, ``rows`` requests of random
prompts are admitted and prefilled, then ``--steps`` decode steps are timed one by one
(wall clock around ``Engine.step``, whose results are on the host when it returns); the
median is reported. Sampled: ``temperature=0.8, top_p=0.9``. Cases are interleaved over
``--repeats`` so a slow minute of a shared machine shows as a spread, not a bias.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import time

import numpy as np


def decode_ms(engine, vocab: int, rng, rows: int, context: int, params, steps: int) -> float:
    """The median decode step (ms) of ``rows`` requests of ``context`` random prompt tokens."""
    from jaxpar.serving import SamplingParams

    for _ in range(rows):
        engine.add_request(rng.integers(0, vocab, context).tolist(),
                           SamplingParams(max_tokens=steps + 4, **params))
    while engine.scheduler.waiting or any(s.remaining > 1 for s in engine.scheduler.running):
        engine.step()  # prompts in
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return round(float(np.median(times)) * 1e3, 1)


def arrival_ms(engine, vocab: int, rng, rows: int, cached: int, repeats: int = 5) -> float:
    """The median step (ms) that brings a new request while ``rows`` requests decode:
    with ``cached`` > 0, a prefix of that many tokens already cached (the rows share it
    too) then 50 of its own (the chat load's arrivals; 300: 288 tokens in full pages
    cached, 62 computed), else 62 tokens of its own (the same tokens computed, nothing
    read from a cached prefix)."""
    from jaxpar.serving import SamplingParams

    prefix = rng.integers(0, vocab, cached).tolist()
    own = lambda: rng.integers(0, vocab, 50 if cached else 62).tolist()  # noqa: E731
    engine.add_request(prefix + own(), SamplingParams(max_tokens=1))  # the prefix cached
    while engine.has_unfinished():
        engine.step()
    for _ in range(rows):
        engine.add_request(prefix + own(), SamplingParams(max_tokens=3 * repeats + 8))
    while engine.scheduler.waiting or any(s.remaining > 1 for s in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(repeats):
        engine.add_request(prefix + own(), SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return round(float(np.median(times)) * 1e3, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=pathlib.Path)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32, 350, 2000])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)

    from jaxpar.serving import Engine
    from jaxpar.train.runs import as_hf, load_model

    model = load_model(as_hf(args.path))
    engine = Engine(model)
    engine.warm_up()
    rng = np.random.default_rng(0)
    samplings = {"greedy": {}, "sampled": {"temperature": 0.8, "top_p": 0.9, "seed": 1}}
    cases = [(rows, 32, name) for rows in args.rows for name in samplings]
    cases += [(rows, context, "greedy") for rows in args.rows for context in args.contexts if context != 32]
    cases += [(rows, cached, "arrival") for rows in args.rows for cached in (0, 300)]
    results: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for rows, context, name in cases:
            key = f"rows={rows} context={context} {name}" if name != "arrival" else (
                f"rows={rows} arrival of 62 new tokens" + (f" after a cached {context}" if context else ""))
            ms = (arrival_ms(engine, model.cfg.vocab_size, rng, rows, context) if name == "arrival" else
                  decode_ms(engine, model.cfg.vocab_size, rng, rows, context, samplings[name], args.steps))
            results.setdefault(key, []).append(ms)
            print(f"{key}: {results[key][-1]} ms", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": str(args.path)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "step_ms": results}, indent=1))
    print("| case | step (ms), each repeat |\n|---|---|")
    for key, values in results.items():
        print(f"| {key} | {' / '.join(map(str, values))} |")


if __name__ == "__main__":
    main()
