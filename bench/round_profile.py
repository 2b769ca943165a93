"""Where a decoding round's time goes, from XLA's own profile: ``ar``, ``glide`` and
``cape`` rounds of one generation (batch 1), in milliseconds a round, split into

* ``draft``: the draft's steps (``propose``), its head included;
* ``target layers: slices``: the layer scan slicing each layer's weights (and cache)
  out of the stacked arrays: on XLA:CPU a copy, where a step reads its weights from
  memory, the same whatever the tokens;
* ``target layers: matmuls``: the layers' projections and attention products;
* ``target layers: other``: the rest of the layers (softmax, norms, RoPE, cache writes,
  the scan's own control);
* ``target head``: the final norm and the vocabulary projection (49,152 x 576 for
  SmolLM2), over ``gamma + 1`` tokens (a chain), the tree's nodes (CaPE), or one (``ar``);
* ``verify, other``: acceptance, CaPE's tree (confidence, top-k, moving the accepted
  path's cache entries);
* ``finish``: the round's bookkeeping (emitted tokens, lengths, counters).

    python bench/round_profile.py --target PATH --glide DIR [--gamma 2 4] [--bins K x 11]
        [--lookup select [tree]] [--prompt-tokens 64] [--max-new-tokens 64] [--repeats 5] [--json P] [--png P]

Each method runs a generation of ``--max-new-tokens`` from one code prompt (compiled
and run once first) under ``jax.profiler.trace``, ``--repeats`` times interleaved with
the other methods' (the median per part: this VM's speed drifts); each XLA operation's time is
attributed by its JAX name stack in the compiled program (``jaxpar.inference.
speculative``'s ``draft`` / ``verify`` / ``finish`` scopes, the model's ``lm_head``),
summed over the generation and divided by its rounds (a loop's or conditional's own
event is its control, not its contents). Operations outside a round (the prefill) are
left out. The profiler's own overhead makes every figure somewhat larger than in
``bench/speculative.py``'s untraced runs; the split is what this is for.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.inference.speculative import LOOKUPS, Method, check, compiled
from jaxpar.inference.token_tree import DEFAULT_BINS
from jaxpar.train.runs import load_glide_draft, load_model

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from speculative import prompts  # noqa: E402  (bench/speculative.py's prompts)

PARTS = ("draft", "target layers: slices", "target layers: matmuls", "target layers: other", "target head",
         "verify, other", "finish")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\s([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def name_stacks(hlo_text: str) -> dict[str, tuple[str, str]]:
    """``{instruction: (opcode, JAX name stack)}`` of a compiled module's text. An
    instruction without a name stack of its own (XLA drops some, plain dots among them)
    takes its computation's: the scopes all its other instructions share."""
    out, computation = {}, []

    def close():
        named = [stack.split("/") for _, (_, stack) in computation if stack]
        shared = []
        for scopes in zip(*named) if named else ():
            if len(set(scopes)) > 1:
                break
            shared.append(scopes[0])
        for name, (opcode, stack) in computation:
            out[name] = (opcode, stack or "/".join(shared))
        computation.clear()

    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            op_name = _OP_NAME.search(line)
            computation.append((m.group(1), (m.group(2), op_name.group(1) if op_name else "")))
        elif line.startswith("}"):
            close()
    close()
    return out


def part(opcode: str, stack: str) -> str | None:
    """The round's part an operation belongs to (None: outside the rounds)."""
    scopes = stack.split("/")
    if "draft" in scopes:
        return "draft"
    if "finish" in scopes:
        return "finish"
    if "verify" not in scopes:
        return None
    if "lm_head" in scopes:
        return "target head"
    in_layers = "while" in scopes[scopes.index("verify"):]
    if in_layers:
        if opcode == "fusion" and scopes[-1] == "dynamic_slice":
            return "target layers: slices"
        return "target layers: matmuls" if opcode == "dot" or scopes[-1] == "dot_general" else "target layers: other"
    return "verify, other"


class Profiled:
    """One method's decoding loop over one prompt, compiled once (its program both runs
    and gives the name stacks) and run once, ready to trace."""

    def __init__(self, target, draft, row, method: str, gamma: int, bins, max_new_tokens: int, lookup: str = ""):
        settings = Method(method, gamma, tuple(bins), lookup=lookup)
        check(settings, target, draft if method != "ar" else None)
        graph, self.params = nnx.split((target, draft if method != "ar" else None))
        programs = compiled(settings, max_new_tokens, ())
        heads = programs.heads(graph, self.params)  # made once per model, as decoding's generations take them
        self.args = (jnp.asarray(row, jnp.int32)[None], jnp.asarray([len(row)], jnp.int32), jax.random.key(0), heads)
        loop = programs.loop
        self.program = loop.lower(graph, self.params, *self.args).compile()
        self.stacks = name_stacks(self.program.as_text())
        state = jax.block_until_ready(self.program(self.params, *self.args))
        self.rounds, self.accepted = int(state.rounds.sum()), float(state.emitted.sum() / state.rounds.sum())

    def trace(self) -> dict[str, float]:
        """Milliseconds a round per part, from one traced run."""
        with tempfile.TemporaryDirectory() as directory:
            with jax.profiler.trace(directory):
                jax.block_until_ready(self.program(self.params, *self.args))
            trace = next(pathlib.Path(directory).rglob("*.trace.json.gz"))
            events = json.load(gzip.open(trace))["traceEvents"]
        micros = collections.Counter()
        for event in events:
            if event.get("ph") == "X" and event.get("name") in self.stacks:
                where = part(*self.stacks[event["name"]])
                if where:
                    micros[where] += event["dur"]
        return {p: micros[p] / 1e3 / self.rounds for p in PARTS}


def profile(methods: dict[str, Profiled], repeats: int) -> dict:
    """Each method traced ``repeats`` times, interleaved (every repeat traces every
    method in turn, so a drifting machine slows all alike); the median per part."""
    traces = {name: [] for name in methods}
    for _ in range(repeats):
        for name, method in methods.items():
            traces[name].append(method.trace())
    return {name: {"rounds": methods[name].rounds, "accepted": methods[name].accepted,
                   "ms": {p: statistics.median(t[p] for t in traces[name]) for p in PARTS}}
            for name in methods}


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(names) + 2.4))
    left = np.zeros(len(names))
    colors = plt.get_cmap("tab10").colors
    for i, p in enumerate(PARTS):
        widths = np.array([results[n]["ms"][p] for n in names])
        ax.barh(names, widths, left=left, color=colors[i], label=p)
        left += widths
    ar = sum(results["ar"]["ms"].values())
    for y, n in enumerate(names):
        total = sum(results[n]["ms"].values())
        ax.text(total + 0.3, y, f"{total / ar:.2f} ar steps, {results[n]['accepted']:.2f} tokens",
                va="center", fontsize=8)
    ax.axvline(ar, color="gray", linestyle="--", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlim(0, left.max() * 1.35)
    ax.set_xlabel("ms a round (profiled, batch 1); dashed: one ar step")
    ax.set_title("Where a round's time goes")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=pathlib.Path, required=True)
    parser.add_argument("--glide", type=pathlib.Path, required=True, help="a GliDe draft run for the target")
    parser.add_argument("--gamma", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--bins", type=int, nargs=11, default=list(DEFAULT_BINS), metavar="K")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lookup", choices=LOOKUPS, nargs="*", default=[],
                        help="also glide with prompt lookup of these kinds (rows glide+lookup-KIND)")
    parser.add_argument("--repeats", type=int, default=5, help="traces of each method, interleaved")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--png", type=pathlib.Path)
    args = parser.parse_args(argv)

    target, draft = load_model(args.target), load_glide_draft(args.glide)
    row = prompts(args.target, "code", 1, args.prompt_tokens)[0]
    runs = [("ar", 1, "")] + [(m, g, "") for g in args.gamma for m in ("glide", "cape")]
    runs += [("glide", g, kind) for g in args.gamma for kind in args.lookup]
    methods = {"ar" if m == "ar" else f"{m}{'+lookup-' + kind if kind else ''}, gamma {g}":
               Profiled(target, draft, row, m, g, tuple(args.bins), args.max_new_tokens, kind)
               for m, g, kind in runs}
    results = profile(methods, args.repeats)
    ar = sum(results["ar"]["ms"].values())
    columns = [f"round ({jax.devices()[0].device_kind}), ms", *PARTS, "total, ms", "ar steps", "tokens/round"]
    print("\n| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for name, r in results.items():
        total = sum(r["ms"].values())
        print(f"| {name} | " + " | ".join(f"{r['ms'][p]:.2f}" for p in PARTS) +
              f" | {total:.1f} | {total / ar:.2f} | {r['accepted']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.png:
        plot(results, args.png)


if __name__ == "__main__":
    main()
