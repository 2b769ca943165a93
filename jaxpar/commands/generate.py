"""``jaxpar-generate RUN_DIR --prompt TEXT [--draft DRAFT_RUN_DIR --method M]``: generate
from a trained run or an HF model, plainly or by speculative decoding.

RUN_DIR is a ``jaxpar-train`` run directory (its latest checkpoint, ``config.yaml``
and ``tokenizer.json``), a Hugging Face Llama directory (``config.json``,
``*.safetensors``, ``tokenizer.json``) or a llama.cpp ``.gguf`` file of a Llama.
Generation stops at the end-of-sequence token (``jaxpar.train.runs.eos_ids``: a run's
end-of-text token; in a Hugging Face directory ``generation_config.json``'s ids, as
``transformers`` stops; a GGUF file's end tokens, as llama.cpp stops). Text streams
to stdout as it is produced, then a line with tokens/s goes to stderr; ``--json``
prints one JSON object instead.

The prompt's tokens and ``--max-new-tokens`` must fit the model's context
(``jaxpar.train.runs.context_length``: a run's ``seq_len``, a Hugging Face model's
``max_position_embeddings``); a longer prompt is refused, or with ``--truncate-prompt``
cut to its last ``context - max_new_tokens`` tokens with a warning.

With ``--draft`` (a jaxpar run of a small model with the same tokenizer, or a
``jaxpar-train glide`` run trained against RUN_DIR) the method defaults to
``speculative`` or ``glide`` by the draft's kind; ``cape`` adds CaPE's token trees to
either. The stderr line (and the JSON object) then add the mean accepted tokens per
step, bonus token included, and the speedup over ``ar`` on the same prompt, which runs
after it, untimed output not shown. Timing starts after the prefill and the first
compile, for both.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np

from jaxpar.inference import speculative
from jaxpar.inference.decoding import DEFAULT_BINS, METHODS, speculative_stream
from jaxpar.inference.speculative import LOOKUPS
from jaxpar.inference.drafting import as_draft
from jaxpar.models.gguf import is_gguf
from jaxpar.inference.speculative import Method
from jaxpar.commands.common import CommandParser, add_compile_cache_flags, compile_cache_from_args
from jaxpar.train.runs import (check_run_dir, context_length, eos_ids, is_hf, load_glide_draft, load_model,
                               load_tokenizer, read_config)


def load_draft(draft_dir: pathlib.Path):
    """A GliDe draft run (``task: glide``) or any model ``load_model`` reads."""
    if not (is_hf(draft_dir) or is_gguf(draft_dir)) and read_config(draft_dir).task == "glide":
        return load_glide_draft(draft_dir)
    return load_model(draft_dir)


def check_same_tokenizer(target_dir: pathlib.Path, draft_dir: pathlib.Path) -> None:
    if load_tokenizer(target_dir).get_vocab() != load_tokenizer(draft_dir).get_vocab():
        raise ValueError(f"the draft's tokenizer ({draft_dir}) differs from the target's "
                         f"({target_dir}); a draft must share the target's")


def _parser() -> CommandParser:
    parser = CommandParser(prog="jaxpar-generate", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("--prompt", required=True,
                        help="its tokens and --max-new-tokens must fit the model's context: a "
                             "jaxpar run's seq_len, a Hugging Face model's max_position_embeddings; "
                             "a longer one is refused (see --truncate-prompt)")
    parser.add_argument("--truncate-prompt", action="store_true",
                        help="instead of refusing a prompt that does not fit, keep its last "
                             "(context - max-new-tokens) tokens, with a warning")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft", type=pathlib.Path, metavar="DRAFT_RUN_DIR",
                        help="draft model run dir (a small jaxpar model or a jaxpar-train glide run)")
    parser.add_argument("--method", choices=METHODS,
                        help="default: ar without --draft, else speculative or glide by the draft")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per step (tree depth for cape)")
    parser.add_argument("--bins", type=int, nargs="+", default=list(DEFAULT_BINS), metavar="K",
                        help="cape: 11 tree widths by draft confidence decile (default: %(default)s)")
    parser.add_argument("--lookup", choices=LOOKUPS, default="",
                        help="speculative or glide, greedy: a chain copied from the text so far (prompt lookup), "
                             "verified beside the draft's (tree) or instead of it where the last two tokens "
                             "occurred before (select)")
    parser.add_argument("--lookup-tokens", type=int, default=0,
                        help="--lookup select: the copied chain's length (default: --gamma); a round where the "
                             "copy is taken verifies all of it")
    parser.add_argument("--runner-up", action="store_true",
                        help="speculative or glide, greedy (--lookup select or none): the pass also verifies the "
                             "draft's other choice for the first token, kept where the chain's first is wrong")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_compile_cache_flags(parser, cache_dir=True)
    return parser


def _run(target, prompt, eos, args, method, draft, tokenizer=None):
    """Streams one generation (printing it when ``tokenizer`` is given), stopping at any
    of the ids ``eos``, which the text leaves out; returns ``(ids, tokens_per_s,
    accepted_per_step, text_shown)``."""
    ids, shown, started, accepted = [], "", None, 1.0
    for new, accepted_now in speculative_stream(
            target, prompt, draft=draft, method=method, gamma=args.gamma, bins=args.bins,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            seed=args.seed, eos_ids=eos, lookup=args.lookup, lookup_tokens=args.lookup_tokens,
            runner_up=args.runner_up):
        if started is None:
            started, first = time.perf_counter(), len(new[0])  # after the prefill's token
        ids += [int(i) for i in new[0]]
        accepted = float(accepted_now[0])
        if tokenizer is not None:
            text = tokenizer.decode([i for i in ids if i not in eos])
            if not text.endswith("\ufffd"):  # wait for whole UTF-8 characters
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
    elapsed = time.perf_counter() - started
    rate = (len(ids) - first) / elapsed if len(ids) > first and elapsed > 0 else 0.0
    return ids, rate, accepted, shown


def fit_context(prompt: np.ndarray, context: int, new: int, truncate: bool,
                parser: CommandParser) -> np.ndarray:
    """``prompt`` int32 ``[1, P]`` where its P tokens and ``new`` more fit ``context``
    tokens; else, with ``truncate``, its last ``context - new`` tokens and a warning on
    stderr; else (or with no room left for a prompt) ``parser.error``: one line, exit 2."""
    length = prompt.shape[1]
    if length + new <= context:
        return prompt
    if new >= context:
        parser.error(f"--max-new-tokens {new} leaves no room for a prompt in the model's context "
                     f"of {context} tokens")
    if not truncate:
        what = (f"--prompt is {length} tokens, more than" if length > context else
                f"--prompt's {length} tokens and --max-new-tokens {new} make {length + new}, more than")
        parser.error(f"{what} the model's context of {context} tokens; shorten them, or pass "
                     "--truncate-prompt to keep the prompt's end")
    keep = context - new
    print(f"jaxpar-generate: warning: --prompt truncated to its last {keep} of {length} tokens "
          f"(the model's context is {context} tokens, --max-new-tokens {new})", file=sys.stderr)
    return prompt[:, -keep:]


def _loaded(args, parser: CommandParser):
    """``(tokenizer, target, draft, method, prompt, eos)`` of the command line; bad input
    (a model, draft or flag that cannot be used) is ``parser.error``: one line, exit 2."""
    try:
        for run_dir in filter(None, (args.run_dir, args.draft)):
            check_run_dir(run_dir)
    except FileNotFoundError as e:
        parser.error(str(e))
    compile_cache_from_args(args, parser)
    try:
        tokenizer = load_tokenizer(args.run_dir)
        target = load_model(args.run_dir)
        draft = None
        if args.draft is not None:
            check_same_tokenizer(args.run_dir, args.draft)
            draft = load_draft(args.draft)
        method = args.method or ("ar" if draft is None else as_draft(draft).method)
        speculative.check(Method(method, args.gamma, tuple(args.bins), args.temperature, args.top_p,
                                 args.lookup or "", args.lookup_tokens, args.runner_up), target, draft)
        prompt = np.asarray([tokenizer.encode(args.prompt).ids], np.int32)
        context = context_length(args.run_dir, target)
        eos = eos_ids(args.run_dir, tokenizer)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    if prompt.shape[1] == 0:
        parser.error("--prompt encodes to no tokens")
    prompt = fit_context(prompt, context, args.max_new_tokens, args.truncate_prompt, parser)
    return tokenizer, target, draft, method, prompt, eos


def main(argv=None) -> int:
    """Exit 2 for bad input (``parser.error``: flags, the model or draft, the prompt),
    1 for a failure once generating has started."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens} must be at least 1")
    if args.temperature < 0:
        parser.error(f"--temperature {args.temperature} must not be negative")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p {args.top_p} must be in (0, 1]")
    if args.method not in (None, "ar") and args.draft is None:
        parser.error(f"--method {args.method} needs --draft DRAFT_RUN_DIR")
    tokenizer, target, draft, method, prompt, eos = _loaded(args, parser)
    try:
        if not args.json:
            sys.stdout.write(args.prompt)
        ids, rate, accepted, shown = _run(target, prompt, eos, args, method, draft,
                                          None if args.json else tokenizer)
        result = {"text": tokenizer.decode([i for i in ids if i not in eos]), "tokens": ids,
                  "tokens_per_s": rate}
        if method != "ar":
            ar_rate = _run(target, prompt, eos, args, "ar", None)[1]
            result.update(method=method, gamma=args.gamma, accepted_per_step=accepted,
                          ar_tokens_per_s=ar_rate, speedup=rate / ar_rate if ar_rate else None)
    except (FileNotFoundError, ValueError) as e:
        print(f"jaxpar-generate: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    sys.stdout.write(result["text"][len(shown):] + "\n")
    line = f"[{len(ids)} tokens, {rate:.1f} tokens/s"
    if method != "ar":
        speedup = f"{result['speedup']:.2f}x" if result["speedup"] else "n/a"
        line += (f"; {method}, gamma {args.gamma}: {accepted:.2f} accepted tokens per step, "
                 f"{speedup} over ar ({result['ar_tokens_per_s']:.1f} tokens/s)")
    print(line + "]", file=sys.stderr)
    return 0


def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
