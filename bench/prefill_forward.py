"""One prompt's forward, jaxpar's serving step against transformers' model, on SmolLM2's
float32 weights: what a request's first token costs each server on this machine (the
floor under its time to first token in ``bench/serve.py``).

    python bench/prefill_forward.py GGUF HF_DIR [--tokens 128] [--repeats 5]

``GGUF``: SmolLM2's file (jaxpar reads it, dequantized to float32); ``HF_DIR``: the same
weights as a Hugging Face directory (``python bench/serve.py hf GGUF HF_DIR``). jaxpar:
``Engine.generate`` of one prompt of ``--tokens`` random ids for one token, prefix
caching off (so every repeat prefills the whole prompt); transformers: the model's
forward over the same ids (``logits_to_keep=1``), torch on as many threads as cores.
Prints the minimum and median of ``--repeats`` runs of each, after two untimed ones.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import numpy as np


def timed(fn, repeats: int) -> list[float]:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=pathlib.Path)
    parser.add_argument("hf_dir", type=pathlib.Path)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    prompt = np.random.default_rng(0).integers(100, 40000, args.tokens).tolist()

    from jaxpar.serving import Engine, SamplingParams
    from jaxpar.train.runs import load_model

    engine = Engine(load_model(args.gguf), max_context=args.tokens + 16, prefix_caching=False)
    ours = timed(lambda: engine.generate([prompt], SamplingParams(max_tokens=1)), args.repeats)

    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        theirs = timed(lambda: model(ids, logits_to_keep=1), args.repeats)
    for name, times in (("jaxpar serving step", ours), (f"transformers {transformers.__version__} forward", theirs)):
        print(f"{name}, {args.tokens} tokens: {min(times) * 1e3:.0f} ms min, {np.median(times) * 1e3:.0f} ms median")


if __name__ == "__main__":
    main()
