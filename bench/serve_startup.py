r"""How long ``jaxpar-serve`` takes to start, and what its programs cost (issue 49).

    python bench/serve_startup.py PATH [--contexts 2048 8192] [--draft none random]
        [--serve CMD] [--label LABEL] [--json OUT]

For each context (``--max-context N``; ``model`` for none: the model's own) and each
draft (``none``; ``random``: a random 2-layer model with PATH's tokenizer, written
beside the results, serving ``--method speculative``: what a draft costs to compile
does not depend on its weights), ``jaxpar-serve PATH`` is started twice with a fresh
``--cache-dir``: first cold (nothing cached: a GGUF file converted, every program
compiled), then again on the same cache (the converted model and the compiled programs
loaded). Measured from the command (wall clock): to the line with the URL (``seconds``:
it listens once its smallest programs are compiled), to the first answer (a 4-token
greedy completion sent then: ``answer``), and to its line saying every program is
compiled (``all``: the others compile while it serves); the programs (its start-up
lines), and ``/proc/PID/maps`` lines once all are compiled (each XLA:CPU program maps
its code into the process; Linux stops a process at ``vm.max_map_count``, 65,530 by
default). A start that exits instead (the mappings' guard, an error) is recorded with
its last line. ``--wait`` starts it with ``--wait-for-programs`` (every program
compiled before it listens).

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
import threading
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


def first_answer(url: str, row: dict, began: float) -> None:
    """A 4-token greedy completion from the server at ``url`` (``.../v1``); its time
    since ``began`` into ``row["answer"]``."""
    import urllib.request

    body = json.dumps({"model": "startup", "prompt": "The capital of France is", "max_tokens": 4,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        assert json.load(response)["choices"][0]["text"] is not None
    row["answer"] = round(time.perf_counter() - began, 1)


def start(serve: list[str], path, flags: list[str], cache: pathlib.Path, timeout: float = 900) -> dict:
    """One start: seconds to the URL line, to the first answer and to every program
    compiled; programs; mappings (or the error's line)."""
    command = [*serve, str(path), "--port", "0", "--no-progress", "--cache-dir", str(cache), "--model-name",
               "startup", *flags]
    began = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines, row = [], {}
    try:
        for line in process.stderr:
            lines.append(line.rstrip())
            if " on http://" in line:
                row["seconds"] = round(time.perf_counter() - began, 1)
                found = re.search(r"\((\d+) of (\d+) programs compiled", line)  # an older release: "(N compiled"
                compiled, total = map(int, found.groups()) if found else [int(re.search(
                    r"\((\d+) compiled programs", line)[1])] * 2
                row |= {"programs": total, "compiled_when_listening": compiled}
                threading.Thread(target=first_answer, args=(re.search(r" on (http://\S+/v1) ", line)[1], row, began),
                                 daemon=True).start()
            if "seconds" in row and (line.startswith("jaxpar-serve: all ")
                                     or row["compiled_when_listening"] == row["programs"]):
                row["all"] = round(time.perf_counter() - began, 1)
                while "answer" not in row and time.perf_counter() - began < timeout:
                    time.sleep(0.05)
                with open(f"/proc/{process.pid}/maps") as f:
                    row["maps"] = sum(1 for _ in f)
                return row
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
    parser.add_argument("--wait", action="store_true", help="start it with --wait-for-programs")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix="serve_startup_"))
    rows = []
    for context in args.contexts:
        for draft in args.draft:
            flags = ([] if context == "model" else ["--max-context", context]) + ["--wait-for-programs"] * args.wait
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
    print("| server | context | draft | programs | cold: listening / first answer / all compiled (s) | "
          "cached: the same (s) | mappings |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cold, cached = r["cold"], r["cached"]
        if "error" in cold:
            print(f"| {r['label']} | {r['context']} | {r['draft']} | - | exits: {cold['error'][:120]} | - | - |")
            continue
        cold_times, cached_times = (" / ".join(str(t.get(k, "-")) for k in ("seconds", "answer", "all"))
                                    for t in (cold, cached))
        print(f"| {r['label']} | {r['context']} | {r['draft']} | {cold['programs']} | {cold_times} | "
              f"{cached_times} | {cold['maps']:,} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
