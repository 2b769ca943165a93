"""What a speculative round costs, in ``ar`` steps: the target's pass over ``k`` tokens
(a round verifies ``gamma + 1``), and the GliDe draft's step over one token and over
two (a round's first draft step reads ``[prev, last]``), each timed alone after its
compile, batch 1, with the target's cache holding ``--context`` tokens.

    python bench/round_cost.py --target PATH --glide DIR [--context 100] [--tokens 1 2 3 4 5 6 8]
        [--gamma 3 4 5] [--repeats 40] [--json P]

The predicted round for ``gamma`` is ``target(gamma + 1) + draft(2) + (gamma - 1) x
draft(1)`` ar steps (the bookkeeping between them is not counted), to set beside the
``round, in ar steps`` that ``bench/speculative.py`` measures over whole generations:
break-even is that many accepted tokens a round, a speedup ``s`` needs ``s`` times it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.inference.drafting import as_draft
from jaxpar.models.cache import init_cache
from jaxpar.train.runs import load_glide_draft, load_model


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prefill(graph, params, tokens, length):
    target, _ = nnx.merge(graph, params)
    return target.decode(tokens, init_cache(target.cfg, tokens.shape[0], length)).cache


@functools.partial(jax.jit, static_argnums=0)
def _target_pass(graph, params, tokens, cache):
    target, _ = nnx.merge(graph, params)
    logits, cache, _ = target.decode(tokens, cache)
    return jnp.argmax(logits, -1), cache


@functools.partial(jax.jit, static_argnums=0)
def _draft_step(graph, params, tokens, draft_cache, cache, head):
    target, draft = nnx.merge(graph, params)
    features = None  # a draft that reads the target's features is timed with zeros for them
    kind = as_draft(draft)
    if kind.reads_features:
        features = jnp.zeros((*tokens.shape, target.cfg.dim), target.cfg.compute_dtype)
    logits, draft_cache = kind.forward(target, tokens, draft_cache, cache, head, features)
    return jnp.argmax(logits, -1), draft_cache


def _seconds(f, *args, repeats: int) -> float:
    jax.block_until_ready(f(*args))  # compile
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def costs(target, draft, *, context: int, tokens: list[int], repeats: int, seed: int = 0) -> dict:
    """``{"target": {k: seconds}, "draft": {1: s, 2: s}}``, medians of ``repeats``."""
    rng = np.random.default_rng(seed)
    graph, params = nnx.split((target, draft))
    length = context + max(tokens) + 1
    ids = lambda n: jnp.asarray(rng.integers(0, target.cfg.vocab_size, (1, n)), jnp.int32)  # noqa: E731
    cache = _prefill(graph, params, ids(context), length)
    out = {"target": {k: _seconds(_target_pass, graph, params, ids(k), cache, repeats=repeats) for k in tokens}}
    draft_cache = dataclasses.replace(draft.init_cache(1, length), lengths=jnp.asarray([context - 1], jnp.int32))
    head = draft.head(target)
    out["draft"] = {k: _seconds(_draft_step, graph, params, ids(k), draft_cache, cache, head, repeats=repeats)
                    for k in (1, 2)}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=pathlib.Path, required=True)
    parser.add_argument("--glide", type=pathlib.Path, required=True, help="a GliDe draft run for the target")
    parser.add_argument("--context", type=int, default=100, help="tokens in the target's cache")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    parser.add_argument("--gamma", type=int, nargs="+", default=[3, 4, 5])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    tokens = sorted(set(args.tokens) | {1} | {g + 1 for g in args.gamma})

    target, draft = load_model(args.target), load_glide_draft(args.glide)
    measured = costs(target, draft, context=args.context, tokens=tokens, repeats=args.repeats)
    ar = measured["target"][1]
    device = jax.devices()[0].device_kind
    print(f"\n| pass ({device}, batch 1, {args.context} tokens cached) | ms | ar steps |\n|---|---|---|")
    for k, s in measured["target"].items():
        print(f"| target over {k} token{'s' if k > 1 else ''} | {s * 1e3:.1f} | {s / ar:.2f} |")
    for k, s in measured["draft"].items():
        print(f"| draft over {k} token{'s' if k > 1 else ''} | {s * 1e3:.2f} | {s / ar:.3f} |")
    predicted = {g: (measured["target"][g + 1] + measured["draft"][2] + (g - 1) * measured["draft"][1]) / ar
                 for g in args.gamma}
    print("\n| gamma | predicted round, ar steps |\n|---|---|")
    for g, cost in predicted.items():
        print(f"| {g} | {cost:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "context": args.context, "seconds": measured,
                                         "predicted_round_in_ar_steps": predicted}, indent=1))


if __name__ == "__main__":
    main()
