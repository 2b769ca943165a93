"""``jaxpar-serve PATH [--host 127.0.0.1] [--port 8000] [--max-batch N] [...]``: an
OpenAI-compatible server (``jaxpar.serving.server``) for a trained run or a Hugging Face
directory.

PATH is read as ``jaxpar-generate`` reads it (``jaxpar.train.runs``): the model, its
tokenizer, its end-of-sequence ids and its context length. A Hugging Face directory's
chat template (``chat_template.jinja``, or ``tokenizer_config.json``'s
``chat_template``) enables ``/v1/chat/completions``. On stderr, a line says what it
loads and one how many programs it compiles (``Engine.warm_up``, every program it will
run; a progress bar over them on a terminal; JAX's persistent compilation cache in
``--cache-dir``/xla makes a second start load them), then one gives the URL. The server
listens once the smallest programs are compiled (the smallest flat batch, and with a
draft the one-sequence round) and compiles the others while it serves, each step
within the programs compiled so far (a bigger batch waits a step or two), smallest
first; a line says when the last is compiled. ``--wait-for-programs`` compiles them all
before listening (benchmarks: no compiling beside the first requests). SIGTERM (or
Ctrl-C) stops admitting requests, lets the running ones finish for up to
``--shutdown-timeout`` seconds, and exits 0 with a line saying how many finished.

``--api-key KEY`` (default: the environment's ``JAXPAR_API_KEY``) makes every ``/v1``
request send ``Authorization: Bearer KEY`` (401 otherwise); ``/health`` and
``/metrics`` stay open. ``--max-request-bytes`` (1 MiB, 1,048,576, by default) refuses
a larger request body with 413 before reading it.

PATH may also be a ``.gguf`` file (``jaxpar.models.from_gguf``), whose chat template
the file carries.

``--draft DIR`` serves with speculative decoding: every engine step is one round for the
running batch (``Engine(draft=, method=, gamma=)``), lossless. DIR is a small model
sharing PATH's tokenizer (``--method speculative``, its default) or a ``jaxpar-train
glide`` run trained against PATH (``--method glide``, its default: the draft reads the
model's own paged cache); ``--method cape`` widens either draft's proposals into CaPE's
token trees for greedy requests (``--bins``).

``mesh.tensor=K`` serves tensor-parallel over ``K`` devices (``Engine(mesh=)``: weights,
a draft's too, and KV heads split by the training rules); ``mesh.expert=E`` splits a MoE
model's experts over ``E`` devices (times ``K``), each running its own experts over every
token of the batch and the outputs summed over them (``jaxpar.placement.rules.EXPERTS_OWNED``:
vLLM's expert parallelism without data-parallel attention; attention as with
``mesh.tensor`` alone); ``mesh.data=R`` serves ``R`` replicas, each on ``E x K``
devices of its own with its own pages and batch slots (``jaxpar.serving.replicas``: each
request goes to the least busy one; ``--max-batch`` and ``--kv-memory`` are per
replica). Other overrides are refused in one line.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pathlib
import signal
import socket
import sys
import time

from tqdm.std import tqdm

from jaxpar.commands.common import CommandParser, add_compile_cache_flags, compile_cache_from_args
from jaxpar.commands.generate import check_same_tokenizer, load_draft
from jaxpar.inference.token_tree import DEFAULT_BINS, check_bins
from jaxpar.serving.config import add_flags, from_args
from jaxpar.models.gguf import gguf_metadata, is_gguf
from jaxpar.train.runs import as_hf, check_run_dir, context_length, eos_ids, is_hf, load_model, load_tokenizer

def _parser() -> CommandParser:
    parser = CommandParser(prog="jaxpar-serve", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("run_dir", type=pathlib.Path, metavar="PATH",
                        help="a jaxpar-train run directory or a Hugging Face directory")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="mesh.tensor=K: tensor-parallel serving over K devices; mesh.expert=E: a MoE "
                             "model's experts split over E devices; mesh.data=R: R replicas")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (the log line says which)")
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests waiting beyond the free batch room before new ones get 429 "
                             "(%(default)s)")
    parser.add_argument("--model-name", help="the model id clients name (default: PATH's directory name)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish after SIGTERM (%(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("JAXPAR_API_KEY"), metavar="KEY",
                        help="/v1 requests must send 'Authorization: Bearer KEY' (401 otherwise); /health and "
                             "/metrics stay open (default: $JAXPAR_API_KEY; none when unset)")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20, metavar="N",
                        help="the largest request body accepted, 413 past it (%(default)s: 1 MiB)")
    parser.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    parser.add_argument("--draft", type=pathlib.Path, metavar="DRAFT_DIR",
                        help="speculative decoding's draft model (a run, Hugging Face directory or .gguf file)")
    parser.add_argument("--bins", type=int, nargs="+", default=list(DEFAULT_BINS), metavar="K",
                        help="cape: 11 tree widths by draft confidence decile (default: %(default)s)")
    add_flags(parser)  # the engine's settings: jaxpar.serving.config.ServingConfig's fields
    add_compile_cache_flags(parser, cache_dir=True)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while the programs compile")
    parser.add_argument("--wait-for-programs", action="store_true",
                        help="compile every program before listening (default: listen once the smallest step, and "
                             "with a draft the smallest round, is compiled; the others compile while it serves)")
    return parser


def check_args(args, parser: CommandParser) -> None:
    """``parser.error`` (one line, exit 2) for what is not supported yet or a bad value."""
    if args.method is not None and args.draft is None:
        parser.error(f"--method {args.method} needs --draft DRAFT_DIR")
    try:
        check_bins(args.bins)
    except ValueError as e:
        parser.error(f"--bins: {e}")
    for override in args.overrides:
        key, _, value = override.partition("=")
        if key not in ("mesh.tensor", "mesh.data", "mesh.expert"):
            parser.error(f"{override}: only mesh.tensor=K, mesh.expert=E and mesh.data=R are supported by "
                         f"jaxpar-serve")
        if not value.isdigit() or int(value) < 1:
            parser.error(f"{override}: {key} must be a positive integer")
    try:
        from_args(args)
    except ValueError as e:  # one line naming the field: its flag
        name = str(e).partition("=")[0]
        parser.error(f"--{name.replace('_', '-')}{str(e)[len(name):].replace('=', ' ', 1)}")
    for flag, value, least in [("--max-queue", args.max_queue, 0), ("--port", args.port, 0),
                               ("--shutdown-timeout", args.shutdown_timeout, 0), ("--max-context", args.max_context, 2),
                               ("--max-request-bytes", args.max_request_bytes, 1)]:
        if value is not None and value < least:
            parser.error(f"{flag} {value} must be at least {least}")
    if args.port > 65535:
        parser.error(f"--port {args.port} must be at most 65535")
    if args.api_key == "":
        parser.error("--api-key (or JAXPAR_API_KEY) is empty: give a key, or unset it to serve without one")


def _context(args, model_context: int) -> int:
    """``--max-context`` (at most the model's), or the model's context."""
    if args.max_context is None:
        return model_context
    if args.max_context > model_context:
        raise ValueError(f"--max-context {args.max_context} is past the model's context of {model_context}")
    return args.max_context


def mesh_size(args, axis: str) -> int:
    """The size a ``mesh.AXIS=N`` override gives (the last one), else 1."""
    values = [int(o.partition("=")[2]) for o in args.overrides if o.startswith(f"mesh.{axis}=")]
    return values[-1] if values else 1


def meshes(data: int, tensor: int, expert: int = 1) -> list:
    """Each of ``data`` replicas' mesh: ``expert x tensor`` devices of its own on an
    ``expert`` axis (where ``expert > 1``) and a ``tensor`` axis (Auto), in device order;
    ``[None]`` for one replica on one device."""
    if data == tensor == expert == 1:
        return [None]
    import jax

    devices, each = jax.devices(), expert * tensor
    if data * each > len(devices):
        raise ValueError(f"mesh.data={data} x mesh.expert={expert} x mesh.tensor={tensor} is more than the "
                         f"{len(devices)} devices here")
    shape, names = ((expert, tensor), ("expert", "tensor")) if expert > 1 else ((tensor,), ("tensor",))
    return [jax.make_mesh(shape, names, devices=devices[r * each:(r + 1) * each],
                          axis_types=(jax.sharding.AxisType.Auto,) * len(names)) for r in range(data)]


def serving_rules(model, expert: int):
    """The rules a server's engines run with: the training rules (None), or with
    ``mesh.expert`` the batch whole on every expert device (``EXPERTS_OWNED``), the
    model's experts checked to split over it (``ValueError``: one line)."""
    if expert == 1:
        return None
    from jaxpar.models.config import check_expert_ways
    from jaxpar.placement import rules as rules_lib

    check_expert_ways(model.cfg.moe, expert, missing="this model has none")
    return rules_lib.override(rules_lib.DEFAULT_RULES, rules_lib.EXPERTS_OWNED)


def chat_template(run_dir: pathlib.Path) -> tuple[str | None, dict[str, str]]:
    """A Hugging Face directory's chat template and the special tokens it may read
    (``bos_token``, ``eos_token`` from ``tokenizer_config.json``): ``chat_template.jinja``
    (where ``transformers`` saves it now), else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of named templates: the ``default`` one).
    ``(None, {})`` for a jaxpar run or a directory without one."""
    run_dir = pathlib.Path(run_dir)
    if is_gguf(run_dir):
        meta, tokenizer = gguf_metadata(run_dir), load_tokenizer(run_dir)
        tokens = {name: tokenizer.id_to_token(i) for name, i in
                  (("bos_token", meta.bos_id), ("eos_token", (meta.eos_ids or (None,))[0])) if i is not None}
        return meta.chat_template, tokens
    if not is_hf(run_dir):
        return None, {}
    config_path = run_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    tokens = {}
    for name in ("bos_token", "eos_token"):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            tokens[name] = token
    if (run_dir / "chat_template.jinja").is_file():
        return (run_dir / "chat_template.jinja").read_text(), tokens
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return (template if isinstance(template, str) else None), tokens


def say(message: str) -> None:
    print(f"jaxpar-serve: {message}", file=sys.stderr, flush=True)


def warm_up(engine, progress: bool, wait: bool) -> None:
    """``engine.warm_up()`` with a line saying what it compiles and, on a terminal, a
    progress bar over the programs; unless ``wait``, in the background once the smallest
    are compiled, with a line when the last one is (and what start-up made frozen out of
    the collector's walks: ``build``)."""
    count, started = len(engine.warm_up_programs()), time.perf_counter()
    say(f"compiling {count} programs: {engine.describe_programs()}; "
        + ("serving once all are compiled" if wait else "serving once the smallest are, the others compiling meanwhile")
        + " (a second start loads them from the compilation cache)")
    done = []

    def report(key):
        bar.update(1)  # nothing once closed
        done.append(key)
        if len(done) == count and not wait:  # the last one, most likely compiled while serving
            gc.collect()
            gc.freeze()
            say(f"all {count} programs compiled, {time.perf_counter() - started:.1f} s after the first began")

    with tqdm(total=count, desc="compile", unit="program", disable=not progress or None, leave=False) as bar:
        engine.warm_up(report=report, background=not wait)


def build(args):
    """``(async_engine, app, engine)`` for parsed ``args``: the model loaded, the engine
    warmed up (``warm_up``: its smallest programs compiled, or with
    ``--wait-for-programs`` all)."""
    # Here: the engine and the FastAPI app (the web stack, 0.3 s) load only to serve, not
    # for --help, a bad flag, or bench/speculative.py's chat_template.
    from jaxpar.serving import Engine
    from jaxpar.serving.async_engine import AsyncEngine
    from jaxpar.serving.replicas import Replicas
    from jaxpar.serving.server import create_app

    say(f"loading {args.run_dir}" + (f" and the draft {args.draft}" if args.draft else ""))
    source = as_hf(args.run_dir, args.cache_dir)  # a GGUF file: converted once
    tokenizer = load_tokenizer(source)
    model = load_model(source)
    draft = None
    if args.draft is not None:
        check_run_dir(args.draft)
        draft_source = as_hf(args.draft, args.cache_dir)
        check_same_tokenizer(source, draft_source)
        draft = load_draft(draft_source)
    config = dataclasses.replace(from_args(args), max_context=_context(args, context_length(source, model)),
                                 bins=tuple(args.bins))
    expert = mesh_size(args, "expert")
    rules = serving_rules(model, expert)
    replicas = [Engine(model, config, tokenizer=tokenizer, eos_ids=eos_ids(source, tokenizer), draft=draft,
                       mesh=mesh, rules=rules)
                for mesh in meshes(mesh_size(args, "data"), mesh_size(args, "tensor"), expert)]
    engine = replicas[0] if len(replicas) == 1 else Replicas(replicas)
    warm_up(engine, not args.no_progress, args.wait_for_programs)
    # What start-up made (the model, its programs, JAX's caches: some 270,000 objects)
    # lives as long as the server: out of the collector's sight, Python's full
    # collections no longer walk it (each walk stopped both the engine thread and the
    # event loop for 50-130 ms, a random request's time to first token), as vLLM does.
    gc.collect()
    gc.freeze()
    async_engine = AsyncEngine(engine, max_queue=args.max_queue)
    template, special_tokens = chat_template(source)
    name = args.model_name or args.run_dir.resolve().name
    app = create_app(async_engine, name, tokenizer, chat_template=template, special_tokens=special_tokens,
                     shutdown_timeout=args.shutdown_timeout, api_key=args.api_key,
                     max_request_bytes=args.max_request_bytes)
    return async_engine, app, engine


def main(argv=None) -> int:
    import uvicorn  # here, as build's imports

    parser = _parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    try:
        check_run_dir(args.run_dir)
    except FileNotFoundError as e:
        parser.error(str(e))
    compile_cache_from_args(args, parser)
    try:
        async_engine, app, engine = build(args)
    except (FileNotFoundError, ValueError) as e:  # the model, a flag or the machine's limits: bad input
        print(f"jaxpar-serve: error: {e}", file=sys.stderr)
        return 2
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        engine.stop_warm_up()
        print(f"jaxpar-serve: error: {e}", file=sys.stderr)
        return 1

    class Server(uvicorn.Server):
        stopped_by = None  # the first signal

        def handle_exit(self, sig, frame):
            self.stopped_by = self.stopped_by or sig
            async_engine.close()  # admit nothing from now on, while running requests finish
            super().handle_exit(sig, frame)
            # uvicorn re-raises a caught signal after its graceful shutdown, so the process
            # would die of SIGTERM; a shutdown that finished its requests exits 0.
            self._captured_signals.clear()

    config = uvicorn.Config(app, log_level="info" if args.access_log else "warning",
                            access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout)
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    compiled, count = len(engine.compiled_programs), len(engine.warm_up_programs())
    say(f"serving {app.state.model_name!r} on http://{host}:{port}/v1 ({compiled} of {count} programs compiled"
        f"{'' if compiled == count else ', the others compiling'}; at most {engine.max_batch} running, "
        f"{engine.pool.total} KV pages of {engine.page_size} tokens, context {engine.max_context}"
        f"{'; /v1 needs the API key' if args.api_key else ''})")
    server = Server(config)
    server.run(sockets=[sock])
    engine.stop_warm_up()  # after the program compiling, if any is
    ended = async_engine.metrics().finished
    done, cut = ended.get("stop", 0) + ended.get("length", 0), ended.get("abort", 0) + ended.get("error", 0)
    say(f"stopped{f' by {signal.Signals(server.stopped_by).name}' if server.stopped_by else ''}: {done} "
        f"request{'s' * (done != 1)} finished" + (f", {cut} aborted" if cut else ""))
    return 0


def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
