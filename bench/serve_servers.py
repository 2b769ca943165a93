"""The servers ``bench/serve.py`` measures, and the model files its peers load: jaxpar
set up one way (``Variant``: batching mode, prefix caching, the older release); the
command line of this checkout's jaxpar-serve or of ``--baseline-serve`` (only the flags
that release knows), a server started and waited on till it listens (``start_server``);
another server (``--against-url``, started by hand) warmed before it is timed; and the
GGUF's model as a Hugging Face directory for ``transformers serve`` (``write_hf``, the
``hf`` subcommand) and as an F32 GGUF for llama.cpp (``write_f32_gguf``, ``gguf-f32``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shlex
import subprocess
import sys
import threading
import time

import numpy as np

MODES = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A server (or the in-process engine) set up one way: its label, batching mode,
    prefix caching (None: the server's default) and whether it is the older release."""

    server: str
    mode: str
    prefix_caching: bool | None = None
    baseline: bool = False


def server_command(args, variant: Variant, max_context: int, kv_memory: int | None) -> list[str]:
    """The command line that starts ``variant`` on ``--port 0``: this checkout's
    jaxpar-serve with its flags, or ``--baseline-serve`` with only the flags the older
    release knows."""
    common = [args.model, "--port", "0", "--batching", variant.mode, "--page-size", str(args.page_size),
              "--model-name", "bench", "--max-queue", "100000", "--max-context", str(max_context)]
    if kv_memory:
        common += ["--kv-memory", str(kv_memory)]
    if variant.baseline:
        return [*shlex.split(args.baseline_serve), *common, "--max-batch", str(args.baseline_max_batch),
                *args.overrides]
    # every program compiled before it listens, as the peers do: the load measures serving, not warm-up
    command = [sys.executable, "-m", "jaxpar.commands.serve", *common, "--wait-for-programs", *args.overrides]
    if args.max_batch:
        command += ["--max-batch", str(args.max_batch)]
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if variant.prefix_caching is not None:
        command += ["--prefix-caching" if variant.prefix_caching else "--no-prefix-caching"]
    if args.draft:
        command += ["--draft", args.draft] + (["--method", args.method] if args.method else [])
    return command


def start_server(command: list[str]) -> tuple[subprocess.Popen, str, float]:
    """``(process, url, seconds to listen)``: ``command`` started, once it listens; its
    stderr drained from then on (a full pipe would stall it)."""
    t0 = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines = []
    while not (match := re.search(r" on (http://\S+/v1) ", lines[-1] if lines else "")):
        lines.append(process.stderr.readline())
        if not lines[-1]:
            process.wait(timeout=60)
            raise RuntimeError(f"{shlex.join(command)} ended before listening:\n" + "".join(lines[-40:]))
    threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
    return process, match[1], time.perf_counter() - t0


def warm_peer(url: str, model: str) -> None:
    """One short request to a server before it is timed (``transformers serve`` loads its
    model at the first request; every server pays first-request costs: jaxpar-serve's
    are about 0.3 s, which a 32-request p99 would otherwise report)."""
    import httpx

    body = {"model": model, "prompt": "def main():", "max_tokens": 4, "temperature": 0}
    response = httpx.post(url + "/completions", json=body, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"{url}/completions: HTTP {response.status_code}: {response.text[:300]}")


def write_hf(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """The GGUF file's model as a Hugging Face directory for ``transformers serve``:
    ``to_hf`` of ``from_gguf`` (float32), its tokenizer, end and BOS tokens and chat
    template (``tokenizer_config.json``), ``generation_config.json``."""
    from jaxpar.models import from_gguf, to_hf
    from jaxpar.models.gguf import gguf_metadata, gguf_tokenizer

    to_hf(from_gguf(gguf), out, overwrite=True)
    tokenizer, meta = gguf_tokenizer(gguf), gguf_metadata(gguf)
    tokenizer.save(str(out / "tokenizer.json"))
    eos = [tokenizer.id_to_token(i) for i in meta.eos_ids]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": meta.context_length,
              "eos_token": eos[0] if eos else None, "clean_up_tokenization_spaces": False,
              "bos_token": None if meta.bos_id is None else tokenizer.id_to_token(meta.bos_id)}
    if meta.chat_template:
        config["chat_template"] = meta.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": list(meta.eos_ids), "bos_token_id": meta.bos_id, "do_sample": False}, indent=1))


def write_f32_gguf(source: pathlib.Path, out: pathlib.Path) -> None:
    """``source`` with every tensor dequantized to F32 (its metadata copied, the file
    type set to ALL_F32): what llama.cpp then computes in float32, as jaxpar does."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = gguf.LlamaFileType.ALL_F32 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        w = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
        writer.add_tensor(tensor.name, w.reshape(tuple(reversed(tensor.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
