"""``jaxpar-generate RUN_DIR --prompt TEXT``: sample from a trained run or an HF model.

RUN_DIR is a ``jaxpar-train`` run directory (its latest checkpoint, ``config.yaml``
and ``tokenizer.json``) or a Hugging Face Llama directory (``config.json``,
``*.safetensors``, ``tokenizer.json``). Text streams to stdout as it is produced, then
a line with tokens/s goes to stderr; ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from jaxpar.decoding import generate
from jaxpar.train.data import EOS
from jaxpar.train.runs import load_model, load_tokenizer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxpar-generate", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("need --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    run_dir = args.run_dir
    try:
        tokenizer = load_tokenizer(run_dir)
        model = load_model(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"jaxpar-generate: error: {e}", file=sys.stderr)
        return 1
    prompt = np.asarray([tokenizer.encode(args.prompt).ids], np.int32)
    if prompt.shape[1] == 0:
        parser.error("--prompt encodes to no tokens")
    eos = tokenizer.token_to_id(EOS)
    if not args.json:
        sys.stdout.write(args.prompt)
    ids, shown, started = [], "", time.perf_counter()
    for token in generate(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, seed=args.seed, eos_id=eos):
        if not ids:
            started = time.perf_counter()  # time decoding, not compilation and prefill
        ids.append(int(token[0]))
        text = tokenizer.decode([i for i in ids if i != eos])
        if not args.json and not text.endswith("\ufffd"):  # wait for whole UTF-8 characters
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    elapsed = time.perf_counter() - started
    rate = (len(ids) - 1) / elapsed if len(ids) > 1 and elapsed > 0 else 0.0
    text = tokenizer.decode([i for i in ids if i != eos])
    if args.json:
        print(json.dumps({"text": text, "tokens": ids, "tokens_per_s": rate}))
    else:
        sys.stdout.write(text[len(shown):] + "\n")
        print(f"[{len(ids)} tokens, {rate:.1f} tokens/s]", file=sys.stderr)
    return 0


def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
