"""GliDe drafts' acceptance against their training steps: for each draft run and each of
its checkpoints, the mean accepted tokens per round of method ``glide`` on the
Spec-Bench-style prompts of ``bench/speculative.py``, beside the run's validation loss.

    python bench/glide_curve.py --target PATH --runs LABEL=DIR [LABEL=DIR ...]
        [--kinds code chat prose] [--prompts 4] [--max-new-tokens 64] [--gamma 4]
        [--json P] [--png P]

Each ``DIR`` is a ``jaxpar-train glide`` run for ``--target`` (keep its checkpoints:
``checkpoint.keep``); ``LABEL`` names it in the table and the picture (e.g. ``kl=...``
and ``no-kl=...`` to compare distillation with the next-token loss alone). Acceptance is
counted as ``bench/speculative.py`` counts it (the target's own token included, greedy,
``--max-new-tokens`` each) and is hardware independent; every checkpoint's tokens are
checked against ``ar``'s (the script exits non-zero if any differ). All prompts decode
as one batch: acceptance is per sequence and does not depend on the batch.

``--png``: accepted tokens per round against training steps, one line per run, and the
validation loss the run logged at those steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from jaxpar.inference.decoding import speculative_generate
from jaxpar.train.checkpoints import Checkpoints
from jaxpar.train.runs import load_glide_draft, load_model

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from speculative import KINDS, prompts  # noqa: E402  (the same prompts as the wall-time table)


def validation_losses(run_dir: pathlib.Path) -> dict[int, float]:
    """``{step: val_loss}`` of a run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def curve(target, rows, reference, run_dir: pathlib.Path, args) -> list[dict]:
    """One ``{"step", "accepted_per_round", "val_loss", "lossless"}`` per checkpoint."""
    losses = validation_losses(run_dir)
    with Checkpoints(run_dir, keep=1 << 30) as checkpoints:
        steps = checkpoints.steps()
    if not steps:
        raise SystemExit(f"no checkpoints in {run_dir}")
    points = []
    for step in steps:
        draft = load_glide_draft(run_dir, step)
        out = speculative_generate(target, rows, draft=draft, method="glide", gamma=args.gamma,
                                   max_new_tokens=args.max_new_tokens)
        points.append({"step": step, "accepted_per_round": float(out.emitted.sum() / out.rounds.sum()),
                       "val_loss": losses.get(step),
                       "lossless": all(np.array_equal(a, b) for a, b in zip(out.tokens, reference))})
        print(json.dumps({"run": str(run_dir), **points[-1]}), file=sys.stderr)
    return points


def plot(curves: dict[str, list[dict]], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    for label, points in curves.items():
        steps = [p["step"] for p in points]
        top.plot(steps, [p["accepted_per_round"] for p in points], marker="o", label=label)
        losses = [(p["step"], p["val_loss"]) for p in points if p["val_loss"] is not None]
        if losses:
            bottom.plot(*zip(*losses), marker="o", label=label)
    top.set_ylabel("accepted tokens per round\n(the target's own included)")
    top.set_title(title, fontsize=9)
    top.legend(fontsize=8)
    bottom.set_ylabel("validation loss\n(the run's own objective)")
    bottom.set_xlabel("draft training steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=pathlib.Path, required=True)
    parser.add_argument("--runs", nargs="+", required=True, metavar="LABEL=DIR")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--prompts", type=int, default=4, help="prompts of each kind")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--png", type=pathlib.Path)
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, sep, directory = spec.partition("=")
        if not sep or not label or not directory:
            parser.error(f"--runs {spec!r} must be LABEL=DIR")
        runs[label] = pathlib.Path(directory)

    target = load_model(args.target)
    rows = [p for kind in args.kinds for p in prompts(args.target, kind, args.prompts, args.prompt_tokens)]
    reference = speculative_generate(target, rows, method="ar", max_new_tokens=args.max_new_tokens).tokens
    curves = {label: curve(target, rows, reference, run_dir, args) for label, run_dir in runs.items()}

    print(f"\n| run | step | validation loss | accepted/round | lossless |")
    print("|---|---|---|---|---|")
    for label, points in curves.items():
        for p in points:
            loss = "" if p["val_loss"] is None else f"{p['val_loss']:.3f}"
            print(f"| {label} | {p['step']} | {loss} | {p['accepted_per_round']:.3f} "
                  f"| {'yes' if p['lossless'] else 'NO'} |")
    meta = {"target": str(args.target), "gamma": args.gamma, "kinds": args.kinds, "prompts": len(rows),
            "max_new_tokens": args.max_new_tokens, "runs": {k: str(v) for k, v in runs.items()}}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "curves": curves}, indent=1))
    if args.png:
        plot(curves, args.png, f"{args.target.name}: {len(rows)} prompts, {args.max_new_tokens} new "
                               f"tokens, gamma {args.gamma}")
    if not all(p["lossless"] for points in curves.values() for p in points):
        sys.exit("a draft's tokens differ from ar's: not lossless")


if __name__ == "__main__":
    main()
