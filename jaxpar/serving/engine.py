"""The serving engine: a model, a paged KV cache and an iteration-level scheduler (Orca's
continuous batching, vLLM's ``LLM.generate`` shape).

Each ``Engine.step`` runs one compiled program:

1. the scheduler (``jaxpar.serving.scheduler``) builds the step within its token budget
   (``max_num_batched_tokens``): a decode row for every running sequence with a token
   to extend, chunks of the prompts still prefilling, then newly admitted requests
   (which first reuse the cached pages of their longest cached prefix), taking pages as
   sequences grow and preempting the newest when the pool runs dry;
2. the model runs once over the step's row (decode rows, then the prompt chunks packed
   without padding between them: ``jaxpar.serving.programs.step``), or with a draft a
   speculative round for the decode rows and the chunks through both models
   (``programs.speculative_step``), and samples a token for every decode row and every
   prompt whose last chunk ran;
3. the tokens are appended; finished sequences leave at once and their pages go back
   (full ones stay cached for later prefixes).

A sequence ends at one of its ``eos_ids``, after ``max_tokens`` tokens, or (with a
tokenizer) when its text contains one of its ``stop`` strings, the text then cut before
it. Its text grows incrementally (``jaxpar.serving.detokenize``).

Compiled programs: one per step shape (``Engine.compiled_programs``): the flat token
batch's bucket, and with a draft the rounds' rows bucket (``Scheduler.shapes``), so a
handful whatever the context length. ``warm_up`` compiles them all, smallest first; in
the background (``warm_up(background=True)``, the server's default) the engine serves
from the first of each kind on, each step within the programs compiled so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.inference import drafting, speculative, token_tree
from jaxpar.kernels import KernelOptions
from jaxpar.models.transformer import ACT_BTKH, sharding_rules
from jaxpar.offload.budget import free_memory
from jaxpar.placement import rules as rules_lib
from jaxpar.placement.execution import Execution
from jaxpar.placement.sharding import model_shardings
from jaxpar.serving import code_maps, programs
from jaxpar.serving.config import CPU_KV_MEMORY, MAX_BATCH, ServingConfig
from jaxpar.serving.detokenize import Detokenizer
from jaxpar.serving.page_pool import PagePool
from jaxpar.serving.pages import NULL_PAGE, init_pages, page_bytes
from jaxpar.serving.requests import Logprob, RequestOutput, SamplingParams, _Request  # noqa: F401 (re-exported)
from jaxpar.serving.scheduler import Plan, Scheduler, Seq
from jaxpar.serving.warm_up import Warming


class Call(NamedTuple):
    """One call of a compiled program: ``key`` names its shape bucket
    (``Engine.compiled_programs``), ``program`` is a ``jaxpar.serving.programs``
    function, ``static`` its static (first) arguments and ``args`` the others."""

    key: tuple
    program: Callable
    static: tuple
    args: tuple


class Engine:
    """Serves ``model`` (a ``jaxpar.models.Transformer``) from a paged KV cache, as
    ``config`` (``jaxpar.serving.config.ServingConfig``; keyword ``settings`` override
    its fields: ``Engine(model, max_batch=4)``) says.

    Args:
      tokenizer: a ``tokenizers.Tokenizer``, for string prompts, ``text``, ``stop`` and
        ``json_schema``.
      eos_ids: tokens that end a sequence.

    Settings (``ServingConfig``'s fields):
      max_num_batched_tokens: the step's token budget (decode rows and prompt chunks):
        larger steps prefill faster, smaller ones keep each step, and so each running
        sequence's next token, quicker.
      max_batch: the most sequences running at once (default: as many as the budget
        and the page pool allow, at most ``MAX_BATCH``).
      max_context: the longest prompt + ``max_tokens`` a request may ask for (default
        the model's ``max_position``).
      page_size: tokens per page.
      kv_pages: pages in the pool (the null page included); else what ``kv_memory``
        bytes (per device) hold; else 90% of the device's free memory after the weights
        (a GPU), or ``CPU_KV_MEMORY`` bytes where the device does not say (a CPU),
        bounded by what ``max_batch`` sequences of ``max_context`` tokens need.
      prefix_caching: full pages keyed by their tokens are reused by later requests with
        the same prefix (``jaxpar.serving.page_pool``).
      max_prefills: the most prompts with a chunk in one step.
      batching: ``"continuous"`` (admit whenever the budget and the pages allow) or
        ``"static"`` (admit only into an empty batch, which then runs until its last
        sequence ends: the baseline continuous batching is measured against).
      draft, method, gamma: speculative decoding with ``draft``: each decode row is then
        one round, the draft proposing ``gamma`` tokens and the model verifying them in
        one pass, each sequence accepting its own prefix (lossless: exact match when
        greedy, the speculative-sampling rule otherwise). The draft's own pages mirror
        the model's (the same page tables). ``method`` ``"speculative"`` (Leviathan et
        al.; the default for a ``Transformer`` draft over the model's vocabulary),
        ``"glide"`` (the default for a ``GlideDraft`` trained against ``model``: its
        layers cross-attend to the model's pages of the tokens verified so far) or
        ``"cape"`` (either draft; its chain widened into a token tree of ``bins`` widths
        by its confidence, verified in one pass, for greedy requests; sampling requests
        verify the chain). On a ``mesh`` the draft is split as the model is (its kv heads
        must split alike: a GliDe draft's always do). With a draft, a request's logprobs
        are the model's at each emitted token in the round's verification pass; a
        request with penalties or a schema takes one token a round, the model's own with
        its bias (the bias changes with every token: drafts verified without it could
        not be kept), beside the others' rounds.
      mesh, rules: serve on ``mesh`` (``mesh.tensor=k`` splits the weights and the
        pages' kv heads over ``k`` devices, ``jaxpar.models.transformer.sharding_rules``
        as training does: kv heads replicated where ``k`` outnumbers them); ``model``'s
        parameters are placed there (the model itself is left as it is).
      kernels: who computes attention, norms and the loss (``jaxpar.kernels.KernelOptions``;
        default ``auto``: the Pallas kernels on a GPU, XLA elsewhere). With Pallas
        attention, decoding reads the pages in place (``jaxpar.serving.pages``).
    """

    def __init__(self, model, config: ServingConfig | None = None, *, tokenizer=None, eos_ids: Sequence[int] = (),
                 draft=None, mesh=None, rules=None, kernels: KernelOptions = KernelOptions(), **settings):
        config = dataclasses.replace(config or ServingConfig(), **settings)
        config.check()
        self.config = config
        max_num_batched_tokens, max_batch, page_size = config.max_num_batched_tokens, config.max_batch, config.page_size
        self.method = self._method(model, draft, config.method, config.gamma, config.bins)
        cfg = model.cfg
        self.tokenizer, self.eos_ids = tokenizer, frozenset(int(i) for i in eos_ids)
        self.vocab_size, self.page_size = cfg.vocab_size, page_size
        self.max_context = config.max_context or cfg.max_position
        # a decode row computes one token, or a round's verified ones (which write past
        # what a request keeps: up to gamma, or the tree's nodes but the root)
        self.tokens_per_row = self.method.tokens_verified if draft is not None else 1
        if self.tokens_per_row > max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is below one speculative round's "
                             f"{self.tokens_per_row} tokens")
        self.max_pages = math.ceil((self.max_context + self.tokens_per_row - 1) / page_size)
        self.graphdef, self.params = nnx.split(model)
        kv_sharding, split = self._place(cfg, mesh, rules, draft, kernels)
        d = None if draft is None else drafting.as_draft(draft).cache_config()
        per_page = page_bytes(cfg.layers, page_size, cfg.kv_heads, cfg.head_dim, cfg.compute_dtype) // split
        if d is not None:
            per_page += page_bytes(d.layers, page_size, d.kv_heads, d.head_dim, d.compute_dtype)
        kv_pages = self._pool_size(config.kv_pages, config.kv_memory, per_page, max_batch)
        max_batch = max_batch or max(1, min(MAX_BATCH, kv_pages - 1, max_num_batched_tokens // self.tokens_per_row))
        self.kv = jax.device_put(init_pages(cfg.layers, kv_pages, page_size, cfg.kv_heads, cfg.head_dim,
                                            cfg.compute_dtype), kv_sharding)
        self.draft, self.gamma, self.draft_kv = None, config.gamma, None
        if draft is not None:  # its pages mirror the model's; on a mesh, split as the model is
            graph, params = nnx.split(draft)
            if mesh is not None:
                params = jax.device_put(params, model_shardings(params, mesh, sharding_rules(cfg, mesh, rules)))
            self.draft = (graph, params)
            self.draft_kv = jax.device_put(init_pages(d.layers, kv_pages, page_size, d.kv_heads, d.head_dim,
                                                      d.compute_dtype), kv_sharding)
        self.rounds = self.accepted = 0  # speculative rounds run per sequence, drafts accepted
        self.pool = PagePool(kv_pages, caching=config.prefix_caching)
        self.scheduler = Scheduler(self.pool, page_size=page_size, max_pages=self.max_pages, max_batch=max_batch,
                                   max_num_batched_tokens=max_num_batched_tokens, max_prefills=config.max_prefills,
                                   tokens_per_row=self.tokens_per_row, draft=draft is not None,
                                   static=config.batching == "static")
        self.max_batch, self.max_num_batched_tokens = max_batch, max_num_batched_tokens
        self.compiled_programs: set[tuple] = set()
        self._executables: dict[tuple, jax.stages.Compiled] = {}  # warm_up's, by key
        self._warming: Warming | None = None
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._no_bias: dict[int, jax.Array] = {}  # rows -> zeros [rows, V] on the device

    def _place(self, cfg, mesh, rules, draft, kernels: KernelOptions):
        """The ``Execution`` the programs trace under and, on a ``mesh``, the parameters
        placed by the training rules: ``(the pages' sharding or None, the devices the kv
        heads split over)``."""
        self.mesh, self.execution = mesh, Execution(kernels=kernels)
        if mesh is None:
            return None, 1
        given, rules = rules, sharding_rules(cfg, mesh, rules)
        self.execution = Execution(rules_lib.for_mesh(mesh, rules), kernels=kernels)
        if draft is not None:  # one Execution traces both models: their rules must agree
            theirs = rules_lib.for_mesh(mesh, sharding_rules(draft.cfg, mesh, given))  # a GliDe draft's: the model's widths
            if theirs != self.execution.rules:
                raise ValueError(f"the draft's kv heads ({draft.cfg.kv_heads}) do not split over the mesh as "
                                 f"the model's ({cfg.kv_heads}) do: serve this draft on one device")
        self.params = jax.device_put(self.params, model_shardings(self.params, mesh, rules))
        heads = rules_lib.logical_to_spec(ACT_BTKH[2:3], self.execution.rules)[0]
        split = math.prod(mesh.shape[a] for a in rules_lib.as_tuple(heads))
        return NamedSharding(mesh, PartitionSpec(None, None, None, heads, None)), split

    @staticmethod
    def _method(model, draft, method, gamma, bins) -> speculative.Method | None:
        """The speculative round's static settings (None without a draft)."""
        if draft is None:
            if method is not None:
                raise ValueError(f"method={method!r} needs a draft model")
            return None
        kind = drafting.as_draft(draft)
        name = method or kind.method
        chosen = speculative.Method(name, gamma, token_tree.check_bins(bins))
        speculative.check(chosen, model, draft)
        if kind.reads_features:
            raise ValueError("jaxpar-serve does not yet run a GliDe draft that reads the target's features "
                             "(glide.features=true); decode it with jaxpar-generate or "
                             "jaxpar.inference.decoding")
        return chosen

    def _pool_size(self, kv_pages, kv_memory, per_page: int, max_batch) -> int:
        """Pages in the pool (``Engine``'s ``kv_pages`` argument)."""
        if kv_pages is not None:
            return kv_pages
        if kv_memory:
            return kv_memory // per_page
        whole = (max_batch or MAX_BATCH) * self.max_pages + 1  # every sequence at its longest
        free = free_memory(jax.tree.leaves(self.params)[0].sharding.device_set)
        return max(2, min(whole, int(0.9 * free if free is not None else CPU_KV_MEMORY) // per_page))

    # -------------------------------------------------------------- requests

    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        """Queues a request; returns its id. ValueError (one line) for an empty prompt, a
        token outside the vocabulary, bad sampling values, a prompt + ``max_tokens``
        past ``max_context`` or the page pool, or the id of a request still unfinished."""
        params.check()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs an Engine with a tokenizer")
            prompt = self.tokenizer.encode(prompt).ids
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty")
        outside = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if outside is not None:  # the embedding's gather would clamp it silently
            raise ValueError(f"token id {outside} is outside the model's vocabulary of {self.vocab_size}")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} is past the "
                             f"context of {self.max_context} tokens")
        need = math.ceil((len(prompt) + params.max_tokens - 1 + self.tokens_per_row - 1) / self.page_size)
        if need > self.pool.total:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} needs more "
                             f"pages than the cache has ({self.pool.total})")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        request = _Request(RequestOutput(request_id, prompt, logprobs=None if params.logprobs is None else []),
                           params, Seq(request_id, list(prompt), len(prompt)))
        if self.tokenizer is not None:
            request.detokenizer, request.output.text = Detokenizer(self.tokenizer), ""
        if params.json_schema is not None:
            request.constraint = self._constraint(params.json_schema)
        self._requests[request_id] = request
        self.scheduler.waiting.append(request.seq)
        return request_id

    def _constraint(self, schema: str):
        if self.tokenizer is None:
            raise ValueError("json_schema needs an Engine with a tokenizer")
        from jaxpar.serving import structured  # an optional extra

        return structured.constraint(schema, self.tokenizer, self.vocab_size, sorted(self.eos_ids))

    def abort(self, request_id: str) -> None:
        """Ends a request now (its pages go back); a finished or unknown id is ignored."""
        request = self._requests.get(request_id)
        if request is not None and not request.output.finished:
            self._finish(request, "abort")

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens of the requests admitted (the prefix cache's lookups)."""
        return self.scheduler.prefix_queries

    @property
    def prefix_hits(self) -> int:
        """Of those, the tokens read from the prefix cache."""
        return self.scheduler.prefix_hits

    def generate(self, prompts: Sequence[Sequence[int] | str],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[RequestOutput]:
        """Runs ``prompts`` to completion; their outputs in the prompts' order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [self.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        outputs = [self.output(i) for i in ids]
        while self.has_unfinished():
            self.step()
        return outputs

    def output(self, request_id: str) -> RequestOutput:
        """An unfinished request's output, which grows as it runs (KeyError otherwise)."""
        return self._requests[request_id].output

    # -------------------------------------------------------------- programs

    def warm_up_programs(self) -> list[Call]:
        """Every program a step can run (``Scheduler.shapes``), as calls on batches of
        padding only (they touch only the null page): what ``warm_up`` compiles."""
        return [self._round_call(Plan([], [], size, 0)) if kind == "round_step" else
                self._step_call(Plan([], [], 0, size))[0] for kind, size in self.scheduler.shapes()]

    def describe_programs(self) -> str:
        """What the compiled programs cover, in words (the server's start-up line)."""
        s = self.scheduler
        carried = "prompt chunks" if s.rows_buckets else "decode tokens and prompt chunks"
        text = (f"{len(s.token_buckets)} steps of {', '.join(map(str, s.token_buckets))} tokens ({carried} of up "
                f"to {self.max_batch} sequences, any context up to {self.max_context})")
        if s.rows_buckets:
            text += (f" and {len(s.rows_buckets)} speculative rounds of {', '.join(map(str, s.rows_buckets))} "
                     f"sequences")
        return text

    @property
    def maps_per_program(self) -> int:
        """The memory mappings XLA:CPU adds per compiled program of this engine, on
        average over its programs (``jaxpar.serving.code_maps``: a speculative round's
        are about three times a step's)."""
        kinds = [kind for kind, _ in self.scheduler.shapes()]
        total = sum(code_maps.MAPS_PER_SPECULATIVE_PROGRAM if k == "round_step" else code_maps.MAPS_PER_PROGRAM
                    for k in kinds)
        return -(-total // len(kinds))

    def warm_up(self, report: Callable[[tuple], None] | None = None, *, check_maps: bool = True,
                background: bool = False) -> None:
        """Compiles every program the engine runs (``warm_up_programs``), so serving
        compiles nothing. Ahead of time: each is lowered and compiled, not run, and its
        executable kept for the calls of its key (``jax.jit``'s own call would trace and
        lower the program again the first time its shapes come, 0.3-0.5 s of a request's
        time to first token; where JAX's persistent compilation cache is on, a second
        start loads them from it). ``report(key)`` after each. First, on a CPU, whether
        the programs' code fits the process's memory-map limit
        (``code_maps.check_code_mappings``: ValueError, one line, where it would not;
        ``check_maps=False``: the caller checked).

        Smallest first, on a thread of its own (``warm_up.Warming``): the smallest step,
        with a draft the smallest round, then the next of each. ``background=True``
        returns once the first of each kind is compiled, and the engine serves while the
        others compile, each step within the programs compiled so far
        (``Scheduler.ready``: a larger batch waits for a later step); ``wait_warm_up``
        waits for the rest, ``stop_warm_up`` stops after the program compiling.
        """
        calls = self.warm_up_programs()
        if check_maps:
            code_maps.check_code_mappings(len(calls), platform=jax.default_backend(),
                                          maps_per_program=self.maps_per_program)
        kinds = [call.key[0] for call in calls]
        rank = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]  # the n-th of its kind
        order = [call for _, call in sorted(zip(rank, calls), key=lambda pair: pair[0])
                 if call.key not in self._executables]
        self.scheduler.ready = frozenset(self._executables)

        def compile_one(call: Call):
            with self._on_mesh():
                self._executables[call.key] = call.program.lower(*call.static, *call.args).compile()
            self.compiled_programs.add(call.key)
            self.scheduler.ready |= {call.key}  # a new set: the engine thread reads it unlocked
            if report is not None:
                report(call.key)

        self._warming = Warming(order, compile_one, ready=lambda: {k for k, _ in self.scheduler.ready} >= set(kinds),
                                finished=lambda: setattr(self.scheduler, "ready", None))  # every shape
        self._warming.wait_ready()
        if not background:
            self._warming.join()

    def wait_warm_up(self, timeout: float | None = None) -> bool:
        """Waits for ``warm_up``'s programs (re-raising what it raised); True when all
        are compiled."""
        if self._warming is not None:
            self._warming.join(timeout)
        return self.scheduler.ready is None

    def stop_warm_up(self) -> None:
        """Stops ``warm_up`` after the program it is compiling (the engine keeps serving
        within the ones compiled)."""
        if self._warming is not None:
            self._warming.stop()

    def _on_mesh(self):
        """The engine's mesh in force (programs trace and run on it), if it has one."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _call(self, call: Call):
        """Runs ``call`` on the engine's mesh (its programs donate the pages they update):
        its executable from ``warm_up``, else through ``jax.jit`` (which compiles it)."""
        self.compiled_programs.add(call.key)
        with self._on_mesh():
            if call.key in self._executables:
                return self._executables[call.key](*call.args)
            return call.program(*call.static, *call.args)

    def _round_call(self, plan: Plan) -> Call:
        """A draft's round for the step's decode rows (``Plan.rows`` of them)."""
        return Call(("round_step", plan.rows), programs.round_step,
                    (self.graphdef, self.draft[0], self.execution, self.method),
                    (self.params, self.draft[1], self.kv, self.draft_kv, *self._round_arrays(plan)))

    def _step_call(self, plan: Plan) -> tuple[Call, list[Seq]]:
        """The step's flat batch (``Plan.tokens``), and the sequences it samples for, in
        its rows' order."""
        draft_graph, draft_params = self.draft or (None, None)
        batch, samplers = self._batch(plan)
        return Call(("step", plan.tokens), programs.step, (self.graphdef, draft_graph, self.execution),
                    (self.params, draft_params, self.kv, self.draft_kv, batch,
                     self._sampling(samplers, batch.sample_at.shape[0]))), samplers

    # -------------------------------------------------------------- one step

    def step(self) -> list[RequestOutput]:
        """Schedules, runs and applies one step; returns the outputs that changed (new
        tokens, or finished)."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        return self._apply(plan, *self._run(plan))

    def _table(self, seq: Seq | None) -> np.ndarray:
        row = np.full((self.max_pages,), NULL_PAGE, np.int32)
        if seq is not None:
            row[:len(seq.pages)] = seq.pages
        return row

    def _batch(self, plan: Plan) -> tuple[programs.Batch, list[Seq]]:
        """The step's flat batch (``programs.Batch``): its decode tokens (without a
        draft), then its prompt chunks, padded to ``plan.tokens``; and the sequences its
        sampling rows are for (each decoding one, each prompt whose last chunk runs)."""
        T = plan.tokens
        S = min(T, self.max_batch)
        parts = ([] if self.draft is not None else [(s, 1) for s in plan.decode]) + plan.chunks
        tokens, positions, seq = np.zeros(T, np.int32), np.zeros(T, np.int32), np.full(T, -1, np.int32)
        tables = np.full((S, self.max_pages), NULL_PAGE, np.int32)
        sample_at, samplers, at = np.zeros(S, np.int32), [], 0
        for i, (s, n) in enumerate(parts):
            start = s.computed
            tokens[at:at + n] = s.tokens[start:start + n]
            positions[at:at + n] = np.arange(start, start + n)
            seq[at:at + n] = i
            tables[i] = self._table(s)
            at += n
            if s.remaining == n:  # its last token to compute: it samples
                sample_at[len(samplers)] = at - 1
                samplers.append(s)
        return programs.Batch(tokens, positions, seq, tables, sample_at, np.int32(len(samplers))), samplers

    def _round_arrays(self, plan: Plan):
        """A round's ``(window, tables, lengths, sampling)`` for the decode rows, padded
        to ``plan.rows`` rows of no sequence."""
        rows = plan.decode + [None] * (plan.rows - len(plan.decode))
        tables = np.stack([self._table(s) for s in rows])
        lengths = np.array([s.computed if s else 0 for s in rows], np.int32)
        return np.stack([self._window(s) for s in rows]), tables, lengths, self._sampling(rows, plan.rows)

    def _window(self, seq: Seq | None) -> np.ndarray:
        """A round's draft window for ``seq`` (``speculative.draft_window`` tokens ending
        at its last, from ``window_start``; zeros past the last, or for no sequence)."""
        W = speculative.draft_window(self.method)
        row = np.zeros(W, np.int32)
        if seq is not None:
            start = max(seq.computed - (W - 1), 0)
            got = seq.tokens[start:seq.computed + 1]
            row[:len(got)] = got
        return row

    def _sampling(self, seqs: list[Seq | None], rows: int) -> programs.Sampling:
        """Each row's sampling (``programs.Sampling``): ``seqs``', then greedy rows of no
        sequence up to ``rows``."""
        requests = [self._requests[s.request_id] if s is not None else None for s in seqs]
        requests += [None] * (rows - len(requests))
        fields = [(r.params.seed, r.seq.generated, r.params.temperature, r.params.top_p,
                   r.params.logprobs is not None, r.params.biased) if r is not None else (0, 0, 0.0, 1.0, False, False)
                  for r in requests]
        seeds, counts, temperature, top_p, logprobs, biased = zip(*fields)
        return programs.Sampling(np.asarray(seeds, np.uint32), np.asarray(counts, np.int32),
                                 np.asarray(temperature, np.float32), np.asarray(top_p, np.float32),
                                 self._bias(requests), np.asarray(logprobs, bool), np.asarray(biased, bool))

    def _bias(self, requests: list[_Request | None]):
        """``[R, V]`` added to the rows' logits: the penalties and schema masks of the rows
        that have them (zeros kept on the device when none has)."""
        R = len(requests)
        if not any(r is not None and r.params.biased for r in requests):
            if R not in self._no_bias:  # placed where the programs read it: no transfer, no reshard
                where = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
                self._no_bias[R] = jax.device_put(np.zeros((R, self.vocab_size), np.float32), where)
            return self._no_bias[R]
        bias = np.zeros((R, self.vocab_size), np.float32)
        for row, request in enumerate(requests):
            if request is None or not request.params.biased:
                continue
            p = request.params
            if request.counts and (p.presence_penalty or p.frequency_penalty):
                ids = np.fromiter(request.counts.keys(), np.int64)
                counts = np.fromiter(request.counts.values(), np.float32)
                bias[row, ids] -= p.presence_penalty + p.frequency_penalty * counts
            if request.constraint is not None:
                bias[row, ~request.constraint.allowed()] = -np.inf
        return bias

    def _run(self, plan: Plan):
        """The step's programs: ``(emitted, accepted, sampled, samplers)`` as numpy
        (``emitted``, ``accepted``: a draft's rounds, ``programs.Sampled [B, gamma + 1]``
        and ``[B]``, else None; ``sampled``: the flat batch's ``programs.Sampled`` for
        ``samplers``, else None)."""
        emitted = accepted = sampled = None
        samplers = []
        if plan.rows:  # each call reads the pages the one before it left (both donate them)
            emitted, accepted, self.kv, self.draft_kv = self._call(self._round_call(plan))
        if plan.tokens:
            call, samplers = self._step_call(plan)
            sampled, self.kv, self.draft_kv = self._call(call)
        return (*jax.tree.map(lambda x: None if x is None else np.asarray(x), (emitted, accepted, sampled)),
                samplers)

    def _apply(self, plan: Plan, emitted, accepted, sampled, samplers) -> list[RequestOutput]:
        """The step's tokens appended; the outputs that changed."""
        changed = []
        for row, seq in enumerate(plan.decode if emitted is not None else ()):
            request = self._requests[seq.request_id]
            self.rounds, self.accepted = self.rounds + 1, self.accepted + int(accepted[row])
            self.scheduler.computed(seq, int(accepted[row]) + 1)
            for slot in range(int(accepted[row]) + 1):
                self._append(request, *self._token(request, emitted, (row, slot)))
                if request.output.finished:
                    break
            changed.append(request.output)
        for seq, n in ([] if emitted is not None else [(s, 1) for s in plan.decode]) + plan.chunks:
            self.scheduler.computed(seq, n)
        for row, seq in enumerate(samplers):
            request = self._requests[seq.request_id]
            self._append(request, *self._token(request, sampled, row))
            changed.append(request.output)
        return changed

    @staticmethod
    def _token(request: _Request, sampled: programs.Sampled, row) -> tuple[int, Logprob | None]:
        """Row ``row`` of ``sampled`` (an index, or ``(row, slot)`` of a round's): its
        token, and its ``Logprob`` where ``request`` asked."""
        token, k = int(sampled.tokens[row]), request.params.logprobs
        if k is None:
            return token, None
        top = tuple((int(i), float(lp)) for i, lp in zip(sampled.top_ids[row][:k], sampled.top_logprobs[row][:k]))
        return token, Logprob(token, float(sampled.logprob[row]), top)

    # -------------------------------------------------------------- tokens and endings

    def _append(self, request: _Request, token: int, logprob: Logprob | None = None) -> None:
        """Appends ``token`` (and its ``logprob``) to ``request``; ends it where it ends."""
        out = request.output
        out.token_ids.append(token)
        out.cached_tokens = request.seq.cached_tokens or 0
        request.seq.tokens.append(token)
        request.counts[token] += 1
        if out.logprobs is not None:
            out.logprobs.append(logprob)
        if request.constraint is not None and token not in self.eos_ids:
            request.constraint.advance(token)
        if request.detokenizer is not None and token not in self.eos_ids:  # an end token is not text
            start = max(0, len(out.text) - max((len(s) for s in request.params.stop), default=0))
            out.text += request.detokenizer.add(token)
            for stop in request.params.stop:
                at = out.text.find(stop, start) if stop else -1
                if at >= 0:
                    out.text = out.text[:at]
                    return self._finish(request, "stop", flush=False)
        if token in self.eos_ids:
            return self._finish(request, "stop")
        if len(out.token_ids) >= request.params.max_tokens:
            return self._finish(request, "length")

    def _finish(self, request: _Request, reason: str, flush: bool = True) -> None:
        """``request`` ends with ``reason``; its text gets what an incomplete character
        held back (unless a stop string cut it)."""
        out = request.output
        if request.detokenizer is not None and flush:
            out.text += request.detokenizer.finish()
        out.finish_reason = reason
        del self._requests[out.request_id]  # a server's finished requests must not pile up
        self.scheduler.finish(request.seq)
