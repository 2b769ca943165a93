r"""How long ``jaxpar-serve`` takes to start, and what its programs cost (issue 49).

    python bench/serve_startup.py PATH [--contexts 2048 8192] [--draft none random]
        [--serve CMD] [--label LABEL] [--json OUT]

For each context (``--max-context N``; ``model`` for none: the model's own) and each
draft (``none``; ``random``: a random 2-layer model with PATH's tokenizer, written
beside the results, serving ``--method speculative``: what a draft costs to compile
does not depend on its weights), ``jaxpar-serve PATH`` is started twice with a fresh
``--cache-dir``: first cold (nothing cached: a GGUF file converted, every program
compiled), then again on the same cache (the converted model and the compiled programs
loaded). Measured from the command to the line with the URL (wall clock), the programs
it compiled (its start-up line), and ``/proc/PID/maps`` lines once it listens (each
XLA:CPU program maps its code into the process; Linux stops a process at
``vm.max_map_count``, 65,530 by default). A start that exits instead (the mappings'
guard, an error) is recorded with its last line.

``--serve CMD``: another jaxpar-serve's command (an older release in its own venv), to
measure before and after on the same machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time


def random_draft(path: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A random 2-layer Llama with ``path``'s tokenizer and vocabulary, as a Hugging Face
    directory (written once)."""
    if (out / "config.json").is_file():
        return out
    import dataclasses

    from flax import nnx

    from jaxpar.models import Transformer, to_hf
    from jaxpar.train.runs import as_hf, load_model

    source = as_hf(path)
    cfg = load_model(source).cfg
    small = dataclasses.replace(cfg, layers=2, dim=128, heads=4, kv_heads=2, head_dim=32, mlp_dim=256)
    to_hf(Transformer(small, rngs=nnx.Rngs(0)), out)
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
    return out


def start(serve: list[str], path, flags: list[str], cache: pathlib.Path, timeout: float = 900) -> dict:
    """One start: seconds to the URL line, programs, mappings (or the error's line)."""
    command = [*serve, str(path), "--port", "0", "--no-progress", "--cache-dir", str(cache), *flags]
    began = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    try:
        for line in process.stderr:
            lines.append(line.rstrip())
            if " on http://" in line:
                seconds = time.perf_counter() - began
                with open(f"/proc/{process.pid}/maps") as f:
                    maps = sum(1 for _ in f)
                programs = int(re.search(r"\((\d+) compiled programs", line)[1])
                return {"seconds": round(seconds, 1), "programs": programs, "maps": maps}
            if time.perf_counter() - began > timeout:
                break
        return {"error": lines[-1] if lines else "no output", "seconds": round(time.perf_counter() - began, 1)}
    finally:
        process.terminate()
        process.wait(60)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=pathlib.Path, help="the model: a .gguf file, Hugging Face directory or run")
    parser.add_argument("--contexts", nargs="+", default=["2048", "8192"], help="--max-context values; 'model': none")
    parser.add_argument("--draft", nargs="+", default=["none", "random"], choices=("none", "random"))
    parser.add_argument("--serve", default="jaxpar-serve", help="the server's command (default jaxpar-serve)")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix="serve_startup_"))
    rows = []
    for context in args.contexts:
        for draft in args.draft:
            flags = [] if context == "model" else ["--max-context", context]
            if draft == "random":
                flags += ["--draft", str(random_draft(args.path, work / "draft"))]
            cache = work / f"cache-{context}-{draft}"
            row = {"label": args.label, "context": context, "draft": draft}
            for when in ("cold", "cached"):
                row[when] = start(args.serve.split(), args.path, flags, cache)
                print(json.dumps({**row, "when": when, **row[when]}), flush=True)
            shutil.rmtree(cache, ignore_errors=True)
            rows.append(row)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "command": " ".join(sys.argv)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("| server | context | draft | programs | cold start (s) | cached start (s) | mappings |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cold, cached = r["cold"], r["cached"]
        if "error" in cold:
            print(f"| {r['label']} | {r['context']} | {r['draft']} | - | exits: {cold['error'][:120]} | - | - |")
            continue
        print(f"| {r['label']} | {r['context']} | {r['draft']} | {cold['programs']} | {cold['seconds']} | "
              f"{cached.get('seconds', '-')} | {cold['maps']:,} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
