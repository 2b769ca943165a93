"""Speculative decoding, Spec-Bench style: mean accepted tokens per round and wall time,
per method, kind of text and batch.

    python bench/speculative.py --target PATH [--draft DIR] [--glide DIR [DIR ...]] [--lookup tree select] [--runner-up]
        [--batch 1 8]
        [--kinds code chat prose] [--prompts 4] [--max-new-tokens 64] [--gamma 4 [5 ...]]
        [--bins K x 11] [--json P] [--png P]

``--target`` is a jaxpar run, a Hugging Face directory or a ``.gguf`` file (SmolLM2's);
``--draft`` a small independent model with the same tokenizer (method ``speculative``);
``--glide`` a ``jaxpar-train glide`` run trained against the target (methods ``glide``
and ``cape``), or several, timed in the same interleaved loop (rows ``glide:NAME`` and
``cape:NAME``, NAME the run dir's name): drafts compared on one drifting machine.
Prompts, ``--prompts`` of each kind, tokenized by the target's tokenizer:

* ``code``: the first ``--prompt-tokens`` tokens of the held-out (validation) files of
  the target's corpus (a jaxpar run's data config; else the default corpus, the
  interpreter's standard library);
* ``chat``: questions written here, rendered through the target's chat template (a
  Hugging Face directory's or GGUF file's; else ``User: ...\nAssistant:``), each its
  own length;
* ``prose``: paragraphs of the interpreter's own ``LICENSE.txt`` (the history of the
  software and the license texts: English prose), their first ``--prompt-tokens``.

Every method generates ``--max-new-tokens`` greedily (the end token does not stop it,
so every method does the same work). Per method and batch size:

* ``accepted/round``: tokens a round gave a sequence, the target's own (correction or
  bonus) token included, as Spec-Bench counts it, per kind and over all; hardware
  independent;
* ``tokens/s`` and ``speedup`` over ``ar`` at the same batch, timed in this process:
  the whole generation, prefill included, one jitted loop (``speculative_generate``),
  compiled first (the verification's weights, made once per model with the first
  generation, as an engine prepares them at load: ``speculative.loop_heads``), the
  median of ``--repeats`` runs, interleaved: per batch of prompts
  each repeat runs every method in turn, so a drifting machine slows all alike;
* ``repeats``: the lowest and highest speedup of a single repeat (each repeat's time
  summed over the prompts): how far the machine moved while the table was taken;
* ``round, in ar steps``: a round's time over one ``ar`` step's (accepted/round over
  the speedup): what the draft and the verification of ``gamma + 1`` tokens cost;
* ``lossless``: every method's tokens equal ``ar``'s (the script exits non-zero
  otherwise);
* the draft's training cost: its run's steps and the sum of their ``step_time_s``.

``--lookup KIND [KIND ...]``: also each drafted method but ``cape`` with prompt lookup
(``speculative_generate(..., lookup=KIND)``: a chain copied from the sequence, verified
beside the draft's, ``tree``, or instead of it, ``select``), rows ``glide+lookup-KIND``
(``glide+lookup-KIND:NAME``); ``--lookup-tokens N``: ``select``'s copied chain is ``N``
tokens long (default: the row's gamma).

``--runner-up``: also each ``speculative`` and ``glide`` row, plain or with ``select``,
verifying another first token beside the chain in the same pass
(``speculative_generate(..., runner_up=True)``), rows ``glide+runner-up``,
``glide+lookup-select+runner-up``.

``--draft-vocab N [N ...]``: also decode with the GliDe draft restricted to the ``N``
most frequent tokens of its training split (FR-Spec's restriction at decoding, of a
draft trained over any vocabulary; one ``glide`` row per ``N``, named ``glide@N``): how
acceptance and round time move with the head's size. A draft trained with
``glide.draft_vocab`` is measured as it is in the plain ``glide`` row.

``--png``: speedup against accepted tokens per round, one point per method and batch,
with the break-even line (speedup 1) and, per gamma, the line of its GliDe rounds' cost
(speedup = accepted / round, in ar steps): how many more tokens a round a draft must
accept for a given speedup.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import sysconfig
import time

import jax
import numpy as np

from jaxpar.inference.decoding import DEFAULT_BINS, speculative_generate
from jaxpar.inference.speculative import LOOKUPS
from jaxpar.train import data as data_lib
from jaxpar.train.runs import load_glide_draft, load_model, load_tokenizer, read_config


KINDS = ("code", "chat", "prose")
CHAT = [
    "How do I reverse a list in Python?",
    "Write a function that checks whether a string is a palindrome.",
    "What is the difference between a process and a thread?",
    "Explain what a hash table is to a beginner.",
    "Give me three tips for writing readable code.",
    "What does the `with` statement do in Python?",
    "Summarise the rules of chess in a few sentences.",
    "Why is the sky blue?",
]


def _corpus_config(target: pathlib.Path):
    """The data config of the target's corpus: a jaxpar run's, else the default one."""
    from jaxpar.models.gguf import is_gguf
    from jaxpar.train.config import DataConfig
    from jaxpar.train.runs import is_hf

    return DataConfig() if is_hf(target) or is_gguf(target) else read_config(target).data


def _first_tokens(texts, tokenizer, count: int, length: int, kind: str) -> list[np.ndarray]:
    """The first ``length`` tokens of the first ``count`` of ``texts`` that have as many."""
    out = []
    for text in texts:
        ids = tokenizer.encode(text).ids
        if len(ids) >= length:
            out.append(np.asarray(ids[:length], np.int32))
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} {kind} texts have {length} tokens; lower --prompt-tokens")


def prompts(target: pathlib.Path, kind: str, count: int, length: int) -> list[np.ndarray]:
    """``count`` prompts of ``kind`` (the module docstring), in the target's tokens."""
    tokenizer = load_tokenizer(target)
    if kind == "code":
        texts = (d.text for d in data_lib.split_documents(_corpus_config(target), "validation"))
        return _first_tokens(texts, tokenizer, count, length, kind)
    if kind == "prose":
        license_text = pathlib.Path(sysconfig.get_paths()["stdlib"], "LICENSE.txt").read_text()
        paragraphs = [" ".join(p.split()) for p in license_text.split("\n\n")]
        return _first_tokens(paragraphs, tokenizer, count, length, kind)
    render = chat_renderer(target)
    return [np.asarray(tokenizer.encode(render(q)).ids, np.int32) for q in CHAT[:count]]


def chat_renderer(target: pathlib.Path):
    """``question -> text``: one user turn through the target's chat template (a
    Hugging Face directory's or GGUF file's; else ``User: ...\nAssistant:``), ready for
    the assistant's answer."""
    from jaxpar.serving.chat_template import ChatTemplate
    from jaxpar.commands.serve import chat_template

    template, special = chat_template(target)
    if not template:
        return lambda question: f"User: {question}\nAssistant:"
    render = ChatTemplate(template, special).render
    return lambda question: render([{"role": "user", "content": question}])


def training_cost(run_dir: pathlib.Path | None) -> str:
    """``"N steps, S s"`` of a draft run's ``metrics.jsonl`` (its steps' ``step_time_s``)."""
    path = run_dir and run_dir / "metrics.jsonl"
    if not path or not path.exists():
        return "unknown"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return f"{len(rows)} steps, {sum(r.get('step_time_s', 0.0) for r in rows):.0f} s"


def restricted(draft, run_dir: pathlib.Path, n: int, target):
    """A copy of GliDe ``draft`` that predicts over the ``n`` most frequent tokens of its
    run's training rows (``jaxpar.train.glide.most_frequent``, as ``glide.draft_vocab``
    counts them; a ``glide.self_distill`` run's are ``target``'s continuations)."""
    from flax import nnx

    from jaxpar.models.glide import DraftVocab
    from jaxpar.train.glide import most_frequent
    from jaxpar.train.loop import load_data

    V = draft.cfg.vocab_size
    copy = nnx.clone(draft)
    copy.vocab = DraftVocab(most_frequent(load_data(read_config(run_dir), target)[1], n, V), V)
    return copy


def method_of(row: str) -> str:
    """The decoding method of a row's name: ``glide@8192``, ``glide+lookup-tree`` and
    ``cape:RUN`` are ``glide``, ``glide`` and ``cape``."""
    return row.partition("@")[0].partition(":")[0].partition("+")[0]


def lookup_of(row: str) -> str:
    """A row's prompt lookup: ``glide+lookup-select:RUN``'s is ``select``; ``""``: none."""
    return row.partition("+lookup-")[2].partition(":")[0].partition("@")[0].partition("+")[0]


def runner_up_of(row: str) -> bool:
    """Whether a row verifies the draft's other first token too (``glide+runner-up``,
    ``glide+lookup-select+runner-up:RUN``)."""
    return "+runner-up" in row.partition(":")[0]


def run(target, rows, batch, methods, args):
    """Per method of ``methods`` (``(name, draft, run_dir, gamma)``): ``(tokens per row,
    emitted per row, rounds per row, seconds, seconds by repeat)`` over ``rows`` in
    batches of ``batch``: ``seconds`` the sum over batches of their median repeat,
    ``seconds by repeat`` the sum over batches of each repeat's (how far a repeat
    strays from the median).

    Timed interleaved: per batch of rows, every method is compiled first, then each
    repeat times every method in turn and a method's time is its median, so a machine
    whose speed drifts (a shared VM's does, by 20% between hours) slows every method
    alike and the speedups stay comparable."""
    results = [([], [], [], [], np.zeros(args.repeats)) for _ in methods]
    calls = [dict(draft=draft, method=method_of(name), gamma=gamma, bins=args.bins, lookup=lookup_of(name),
                  lookup_tokens=args.lookup_tokens if lookup_of(name) == "select" else 0, runner_up=runner_up_of(name),
                  max_new_tokens=args.max_new_tokens) for name, draft, _, gamma in methods]
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        began = time.perf_counter()
        for kwargs in calls:
            speculative_generate(target, chunk, **kwargs)  # compile (cached for the next chunks)
        print(f"batch {batch}, prompts {start + 1}-{start + len(chunk)} of {len(rows)}: {len(calls)} methods "
              f"compiled and run once in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
        times, outs = [[] for _ in methods], [None] * len(methods)
        for _ in range(args.repeats):
            for i, kwargs in enumerate(calls):
                began = time.perf_counter()
                outs[i] = speculative_generate(target, chunk, **kwargs)
                times[i].append(time.perf_counter() - began)
        for (tokens, emitted, rounds, seconds, by_repeat), out, t in zip(results, outs, times):
            tokens += out.tokens
            rounds += out.rounds.tolist()
            emitted += out.emitted.tolist()
            seconds.append(statistics.median(t))
            by_repeat += t
    return [(tokens, np.asarray(emitted), np.asarray(rounds), sum(seconds), by_repeat)
            for tokens, emitted, rounds, seconds, by_repeat in results]


def plot(results, path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    # A colour per gamma (its points and its round-cost line), a marker per method (and
    # prompt lookup, and the runner-up), hollow markers above the smallest batch; the legend
    # names each (labels beside points that lie close together overlap).
    gamma_list = sorted({r["gamma"] for r in results if r["gamma"]})
    colour = {g: f"C{i}" for i, g in enumerate(gamma_list)}
    smallest = min(r["batch"] for r in results)
    for r in results:
        if r["method"] == "ar":
            continue
        marker = {"tree": "D", "select": "P"}.get(lookup_of(r["method"])) or {
            "speculative": "o", "glide": "s", "cape": "^"}[method_of(r["method"])]
        if runner_up_of(r["method"]):  # a star with lookup select, an X on a plain chain
            marker = "*" if lookup_of(r["method"]) else "X"
        c = colour[r["gamma"]]
        ax.scatter(r["accepted_per_step"], r["speedup"], marker=marker, s=60, edgecolors=c,
                   facecolors=c if r["batch"] == smallest else "none",
                   label=f"{r['method']}, batch {r['batch']}" + (f", gamma {r['gamma']}" if len(gamma_list) > 1 else ""))
    ax.axhline(1.0, color="gray", linestyle="--", label="break-even (ar)")
    # Where a round's cost puts a draft: speedup = accepted / (round, in ar steps), one
    # line per gamma through its glide rounds' mean cost at the smallest batch.
    xs = np.linspace(1.0, max(r["accepted_per_step"] for r in results) + 0.5, 2)
    for gamma in gamma_list:
        rounds = [r["round_in_ar_steps"] for r in results
                  if r["gamma"] == gamma and r["batch"] == smallest and method_of(r["method"]) == "glide"
                  and "@" not in r["method"] and not lookup_of(r["method"]) and not runner_up_of(r["method"])]
        if rounds:
            cost = float(np.mean(rounds))
            ax.plot(xs, xs / cost, linestyle=":", linewidth=1, color=colour[gamma],
                    label=f"a round of {cost:.2f} ar steps (glide, gamma {gamma}, batch {smallest})")
    ax.set_xlabel("accepted tokens per round (the target's own included)")
    ax.set_ylabel("wall-time speedup over ar")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=pathlib.Path, required=True)
    parser.add_argument("--draft", type=pathlib.Path, help="independent draft run (method speculative)")
    parser.add_argument("--glide", type=pathlib.Path, nargs="+", default=[],
                        help="GliDe draft run(s) (methods glide, cape)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--prompts", type=int, default=4, help="prompts of each kind")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--gamma", type=int, nargs="+", default=[4],
                        help="draft tokens per round; several: every drafted method at each")
    parser.add_argument("--bins", type=int, nargs="+", default=list(DEFAULT_BINS), metavar="K",
                        help="CaPE's widths by draft confidence decile (11 ints; its tree has "
                             "1 + gamma x max(bins) nodes)")
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[],
                        help="also glide with the draft restricted to its N most frequent tokens")
    parser.add_argument("--lookup", nargs="+", choices=LOOKUPS, default=[],
                        help="also speculative and glide with prompt lookup of these kinds")
    parser.add_argument("--lookup-tokens", type=int, default=0,
                        help="select: the copied chain's length (default: each row's gamma)")
    parser.add_argument("--runner-up", action="store_true",
                        help="also each speculative and glide row (plain or lookup select) verifying the draft's "
                             "other first token too")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--png", type=pathlib.Path)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    target = load_model(args.target)
    kinds = [(kind, p) for kind in args.kinds
             for p in prompts(args.target, kind, args.prompts, args.prompt_tokens)]
    rows = [p for _, p in kinds]
    drafted = []
    if args.draft:
        drafted.append(("speculative", load_model(args.draft), args.draft))
    names = [run.name for run in args.glide]
    if len(set(names)) < len(names):
        parser.error(f"--glide runs need distinct directory names (their rows' names), got {names}")
    for run_dir in args.glide:
        glide, name = load_glide_draft(run_dir), f":{run_dir.name}" if len(args.glide) > 1 else ""
        drafted += [(f"glide{name}", glide, run_dir), (f"cape{name}", glide, run_dir)]
        drafted += [(f"glide{name}@{n}", restricted(glide, run_dir, n, target), run_dir) for n in args.draft_vocab]
    plain = [(name, draft, run_dir) for name, draft, run_dir in drafted
             if method_of(name) in ("speculative", "glide") and "@" not in name]
    drafted += [(f"{method_of(name)}+lookup-{kind}{name[len(method_of(name)):]}", draft, run_dir)
                for kind in args.lookup for name, draft, run_dir in plain]
    if args.runner_up:
        drafted += [(f"{head}+runner-up{sep}{tail}", draft, run_dir) for name, draft, run_dir in drafted
                    for head, sep, tail in [name.partition(":")]
                    if method_of(name) in ("speculative", "glide") and "@" not in name
                    and lookup_of(name) in ("", "select")]
    methods = [("ar", None, None, 1)] + [(*m, gamma) for gamma in args.gamma for m in drafted]
    device = jax.devices()[0].device_kind
    print(f"target {args.target}, {len(rows)} prompts ({', '.join(args.kinds)}), {args.max_new_tokens} new "
          f"tokens, gamma {' '.join(map(str, args.gamma))}, on {device}", file=sys.stderr)
    began_utc = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = []
    for batch in args.batch:
        measured = run(target, rows, batch, methods, args)
        reference, _, _, ar_seconds, ar_by_repeat = measured[0]  # methods[0] is ar
        for (name, draft, run_dir, gamma), (tokens, emitted, rounds, seconds, by_repeat) in zip(methods, measured):
            per_kind = {kind: float(emitted[[k == kind for k, _ in kinds]].sum()
                                    / max(rounds[[k == kind for k, _ in kinds]].sum(), 1))
                        for kind in args.kinds} if name != "ar" else {kind: 1.0 for kind in args.kinds}
            accepted = float(emitted.sum() / rounds.sum()) if name != "ar" else 1.0
            results.append({"method": name, "gamma": gamma if name != "ar" else None, "batch": batch,
                            "accepted_per_step": accepted, "by_kind": per_kind,
                            "tokens_per_s": sum(len(t) for t in tokens) / seconds,
                            "speedup": ar_seconds / seconds, "seconds": seconds,
                            "speedup_by_repeat": (ar_by_repeat / by_repeat).tolist(),
                            # a round's time in ar steps: tokens per round over the speedup
                            "round_in_ar_steps": accepted * seconds / ar_seconds,
                            "lossless": all(np.array_equal(a, b) for a, b in zip(tokens, reference)),
                            "draft_training": training_cost(run_dir) if run_dir else ""})
            print(json.dumps(results[-1]), file=sys.stderr)
    kinds_header = " / ".join(args.kinds)
    print(f"\n| method | batch | accepted/round ({kinds_header}) | all | tokens/s ({device}) | speedup over ar "
          f"| repeats | gamma | round, in ar steps | lossless | draft training |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        by_kind = " / ".join(f"{r['by_kind'][k]:.2f}" for k in args.kinds)
        print(f"| {r['method']} | {r['batch']} | {by_kind} | {r['accepted_per_step']:.2f} | {r['tokens_per_s']:.1f} "
              f"| {r['speedup']:.2f}x | {min(r['speedup_by_repeat']):.2f}-{max(r['speedup_by_repeat']):.2f}x "
              f"| {r['gamma'] or ''} | {r['round_in_ar_steps']:.2f} "
              f"| {'yes' if r['lossless'] else 'NO'} | {r['draft_training']} |")
    meta = {"target": str(args.target), "glide": [str(d) for d in args.glide], "device": device,
            "gamma": args.gamma, "bins": args.bins, "kinds": args.kinds, "max_new_tokens": args.max_new_tokens,
            "prompts": len(rows), "prompt_tokens": args.prompt_tokens, "repeats": args.repeats,
            "began_utc": began_utc}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.png:
        plot(results, args.png, f"{args.target.name}: {len(rows)} prompts, {args.max_new_tokens} new tokens, "
                                f"gamma {' '.join(map(str, args.gamma))}, {device}, {began_utc}")
    if not all(r["lossless"] for r in results):
        sys.exit("a method's tokens differ from ar's: not lossless")


if __name__ == "__main__":
    main()
