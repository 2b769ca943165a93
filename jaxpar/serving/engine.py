"""The serving engine: a model, a paged KV cache and an iteration-level scheduler (Orca's
continuous batching, vLLM's ``LLM.generate`` shape).

Each ``Engine.step``:

1. **admits** waiting requests, in arrival order, while a batch slot is free and the
   page pool holds the pages of the request's prompt plus its ``max_tokens``. Pages are
   reserved whole at admission, so a running sequence never runs out of pages and
   nothing is preempted (vLLM allocates page by page and preempts under pressure: more
   requests in flight when outputs end early, at the cost of recomputation).
2. **prefills** up to ``prefill_chunk`` prompt tokens, packed into one row without
   padding between prompts (EnergonAI's padding removal): sequences in admission order,
   each taking what is left of the row; a longer prompt continues in the next steps'
   rows, so a long prompt never stalls the others' decoding. A sequence whose prompt is
   done samples its first token here.
3. **decodes** one token for every sequence that has one to extend, in one program over
   every batch slot; finished sequences leave at once and their pages go back.

A sequence ends at one of its ``eos_ids``, after ``max_tokens`` tokens, or (with a
tokenizer) when its text contains one of its ``stop`` strings, the text then cut before
it.

Compiled programs: per page bucket (the pages of a sequence a program reads: x4 from 16
pages up to the context's, so attention reads what the batch's longest sequence needs),
one decode program (with a draft: one speculative round) and one prefill program per
row bucket (powers of two from 16 up to ``prefill_chunk``; with a draft, the draft's
prefill too); ``Engine.compiled_programs`` lists them, ``warm_up`` compiles them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.inference import drafting, speculative, token_tree
from jaxpar.kernels import KernelOptions
from jaxpar.models.glide import GlideDraft
from jaxpar.models.transformer import ACT_BTKH, sharding_rules
from jaxpar.offload.budget import free_memory
from jaxpar.placement import rules as rules_lib
from jaxpar.placement.execution import Execution
from jaxpar.placement.sharding import model_shardings
from jaxpar.serving import programs
from jaxpar.serving.pages import NULL_PAGE, PagePool, init_pages, page_bytes


class Call(NamedTuple):
    """One call of a compiled program: ``key`` names its shape bucket
    (``Engine.compiled_programs``), ``program`` is a ``jaxpar.serving.programs``
    function and ``args`` its arguments."""

    key: tuple
    program: Callable
    args: tuple


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples: greedy at ``temperature == 0``, else from the nucleus
    ``top_p``; its tokens depend on ``seed`` alone (not on the batch it runs in)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    def check(self) -> None:
        """ValueError, one line naming the bad value."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")


@dataclasses.dataclass
class RequestOutput:
    """A request's tokens so far. ``finish_reason``: None while running, ``"stop"`` (an
    end token or stop string), ``"length"`` (``max_tokens``) or ``"abort"``. ``text``
    (with a tokenizer) is cut before a stop string and leaves an end token out;
    ``token_ids`` are all generated, an end token included."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _Sequence:
    output: RequestOutput
    params: SamplingParams
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the cache
    admitted: int = 0  # admission order: prompts prefill first come, first served

    @property
    def prompt(self) -> list[int]:
        return self.output.prompt_token_ids

    @property
    def cached(self) -> int:
        """Tokens in the cache once the last generated one is written: the position the
        next decode writes at."""
        return len(self.prompt) + len(self.output.token_ids) - 1


class Engine:
    """Serves ``model`` (a ``jaxpar.models.Transformer``) from a paged KV cache.

    Args:
      tokenizer: a ``tokenizers.Tokenizer``, for string prompts, ``text`` and ``stop``.
      eos_ids: tokens that end a sequence.
      max_batch: batch slots, the sequences decoded together.
      max_context: the longest prompt + ``max_tokens`` a request may ask for (default
        the model's ``max_position``).
      page_size: tokens per page.
      kv_pages: pages in the pool (the null page included); else what ``kv_memory``
        bytes (per device) hold; else enough for ``max_batch`` sequences of
        ``max_context`` tokens, or, where fewer fit, 90% of the device's free memory
        after the weights (on a GPU; a CPU does not say).
      prefill_chunk: most prompt tokens prefilled per step.
      batching: ``"continuous"`` (admit whenever a slot and pages are free) or
        ``"static"`` (admit only into an empty batch, which then runs until its last
        sequence ends: the baseline continuous batching is measured against).
      draft, method, gamma: speculative decoding with ``draft``: each decode step is then
        one round for every running sequence, the draft proposing ``gamma`` tokens and
        the model verifying them in one pass, each sequence accepting its own prefix
        (lossless: exact match when greedy, the speculative-sampling rule otherwise). The
        draft's own pages mirror the model's (the same page tables). ``method``
        ``"speculative"`` (Leviathan et al.; the default for a ``Transformer`` draft over
        the model's vocabulary), ``"glide"`` (the default for a ``GlideDraft`` trained
        against ``model``: its layers cross-attend to the model's pages of the tokens
        verified so far) or ``"cape"`` (either draft; its chain widened into a token
        tree of ``bins`` widths by its confidence, verified in one pass, for greedy
        requests; sampling requests verify the chain). On a ``mesh`` the draft is split as
        the model is (its kv heads must split alike: a GliDe draft's always do).
      mesh, rules: serve on ``mesh`` (``mesh.tensor=k`` splits the weights and the
        pages' kv heads over ``k`` devices, ``jaxpar.models.transformer.sharding_rules``
        as training does: kv heads replicated where ``k`` outnumbers them); ``model``'s
        parameters are placed there (the model itself is left as it is).
      kernels: who computes attention, norms and the loss (``jaxpar.kernels.KernelOptions``;
        default ``auto``: the Pallas kernels on a GPU, XLA elsewhere). With Pallas
        attention, decoding reads the pages in place (``jaxpar.serving.pages``).
    """

    def __init__(self, model, *, tokenizer=None, eos_ids: Sequence[int] = (), max_batch: int = 8,
                 max_context: int | None = None, page_size: int = 16, kv_pages: int | None = None,
                 kv_memory: int | None = None, prefill_chunk: int = 256, batching: str = "continuous",
                 draft=None, method: str | None = None, gamma: int = 4,
                 bins: Sequence[int] = token_tree.DEFAULT_BINS, mesh=None, rules=None,
                 kernels: KernelOptions = KernelOptions()):
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching={batching!r} must be 'continuous' or 'static'")
        self.method = None  # the speculative round's static settings (temperature and top_p: the rows')
        if draft is not None:
            name = method or ("glide" if isinstance(draft, GlideDraft) else "speculative")
            self.method = speculative.Method(name, gamma, token_tree.check_bins(bins))
            speculative.check(self.method, model, draft)
            if drafting.reads_features(draft):
                raise ValueError("jaxpar-serve does not yet run a GliDe draft that reads the target's features "
                                 "(glide.features=true); decode it with jaxpar-generate or "
                                 "jaxpar.inference.decoding")
        elif method is not None:
            raise ValueError(f"method={method!r} needs a draft model")
        self.batching = batching
        cfg = model.cfg
        self.tokenizer, self.eos_ids = tokenizer, frozenset(int(i) for i in eos_ids)
        self.vocab_size = cfg.vocab_size
        self.max_batch, self.page_size = max_batch, page_size
        self.max_context = max_context or cfg.max_position
        # a speculative round writes positions past what a request keeps: up to gamma (a
        # chain), or the tree's nodes but the root (cape)
        self.lookahead = self.method.tokens_verified - 1 if draft is not None else 0
        self.max_pages = math.ceil((self.max_context + self.lookahead) / page_size)
        self.graphdef, self.params = nnx.split(model)
        self.mesh, self.execution, kv_sharding, split = mesh, Execution(kernels=kernels), None, 1
        if mesh is not None:
            given, rules = rules, sharding_rules(cfg, mesh, rules)
            self.execution = Execution(rules_lib.for_mesh(mesh, rules), kernels=kernels)
            if draft is not None:  # one Execution traces both models: their rules must agree
                draft_cfg = draft.cfg  # a GliDe draft's: the model's widths
                theirs = rules_lib.for_mesh(mesh, sharding_rules(draft_cfg, mesh, given))
                if theirs != self.execution.rules:
                    raise ValueError(f"the draft's kv heads ({draft_cfg.kv_heads}) do not split over the mesh as "
                                     f"the model's ({cfg.kv_heads}) do: serve this draft on one device")
            self.params = jax.device_put(self.params, model_shardings(self.params, mesh, rules))
            heads = rules_lib.logical_to_spec(ACT_BTKH[2:3], self.execution.rules)[0]
            kv_sharding = NamedSharding(mesh, PartitionSpec(None, None, None, heads, None))
            split = math.prod(mesh.shape[a] for a in rules_lib.as_tuple(heads))
        per_page = page_bytes(cfg.layers, page_size, cfg.kv_heads, cfg.head_dim, cfg.compute_dtype) // split
        if draft is not None:
            d = draft.cache_config() if isinstance(draft, GlideDraft) else draft.cfg
            per_page += page_bytes(d.layers, page_size, d.kv_heads, d.head_dim, d.compute_dtype)
        if kv_pages is None and kv_memory:
            kv_pages = kv_memory // per_page
        if kv_pages is None:
            kv_pages = max_batch * self.max_pages + 1
            free = free_memory(jax.tree.leaves(self.params)[0].sharding.device_set)
            if free is not None:
                kv_pages = min(kv_pages, int(0.9 * free) // per_page)
        self.kv = init_pages(cfg.layers, kv_pages, page_size, cfg.kv_heads, cfg.head_dim, cfg.compute_dtype)
        if kv_sharding is not None:
            self.kv = jax.device_put(self.kv, kv_sharding)
        self.draft, self.gamma, self.draft_kv = None, gamma, None
        if draft is not None:
            self.draft = nnx.split(draft)
            self.draft_kv = init_pages(d.layers, kv_pages, page_size, d.kv_heads, d.head_dim, d.compute_dtype)
            if mesh is not None:  # split as the model is
                self.draft = (self.draft[0], jax.device_put(self.draft[1], model_shardings(self.draft[1], mesh,
                                                                                           rules)))
                self.draft_kv = jax.device_put(self.draft_kv, kv_sharding)
        self.rounds = self.accepted = 0  # speculative rounds run per sequence, drafts accepted
        self.pool = PagePool(kv_pages)
        self.buckets = tuple(sorted({min(2 ** n, prefill_chunk) for n in range(4, max(5, math.ceil(
            math.log2(prefill_chunk)) + 1))}))
        self.prefill_chunk = self.buckets[-1]
        # Pages a program reads per sequence, bucketed (x4 from 16 pages up to the context's):
        # attention reads what the longest sequence of the batch needs, not the whole context.
        widths = {self.max_pages}
        while (width := 16 * 4 ** (len(widths) - 1)) < self.max_pages:
            widths.add(width)
        self.page_buckets = tuple(sorted(widths))
        self.compiled_programs: set[tuple] = set()
        self._waiting: deque[_Sequence] = deque()
        self._slots: list[_Sequence | None] = [None] * max_batch
        self._by_id: dict[str, _Sequence] = {}
        self._ids, self._admissions = itertools.count(), itertools.count()

    # -------------------------------------------------------------- requests

    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        """Queues a request; returns its id. ValueError (one line) for an empty prompt, a
        token outside the vocabulary, bad sampling values, a prompt + ``max_tokens``
        past ``max_context``, or the id of a request still unfinished."""
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
        if self._pages_needed(len(prompt), params.max_tokens) > self.pool.total:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} needs more "
                             f"pages than the cache has ({self.pool.total})")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._by_id:
            raise ValueError(f"request_id={request_id!r} is already in the engine")
        sequence = _Sequence(RequestOutput(request_id, prompt), params)
        self._by_id[request_id] = sequence
        self._waiting.append(sequence)
        return request_id

    def abort(self, request_id: str) -> None:
        """Ends a request now (its pages go back); a finished or unknown id is ignored."""
        sequence = self._by_id.get(request_id)
        if sequence is not None and not sequence.output.finished:
            if sequence in self._waiting:
                self._waiting.remove(sequence)
            self._finish(sequence, "abort")

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

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
        return self._by_id[request_id].output

    def warm_up_programs(self) -> list[Call]:
        """Every program the engine runs (decode or the speculative round, prefill per
        bucket, with a draft the draft's prefill too), as calls on rows that touch only
        the null page: what ``warm_up`` compiles."""
        G = self.max_batch
        empty, zeros = [None] * G, np.zeros(G, np.int32)
        calls = []
        for width in self.page_buckets:
            tables = np.full((G, width), NULL_PAGE, np.int32)
            for C in self.buckets:
                row = (np.zeros(C, np.int32), np.zeros(C, np.int32), np.full(C, -1, np.int32), tables, zeros, empty)
                calls.append(self._prefill_call(*row))
                if self.draft is not None:
                    calls.append(self._draft_prefill_call(*row[:4]))
            calls.append(self._round_call(zeros, zeros, tables, zeros, empty) if self.draft is not None
                         else self._decode_call(zeros, tables, zeros, empty))
        return calls

    def warm_up(self, report: Callable[[tuple], None] | None = None) -> None:
        """Compiles every program the engine runs (``warm_up_programs``), so serving
        compiles nothing. Ahead of time: each is lowered and compiled, not run (a later
        call of the same shapes runs that executable; where JAX's persistent compilation
        cache is on, a second start loads them from it). ``report(key)`` after each."""
        for call in self.warm_up_programs():
            with self._on_mesh():
                call.program.lower(*call.args).compile()
            self.compiled_programs.add(call.key)
            if report is not None:
                report(call.key)

    # -------------------------------------------------------------- one step

    def step(self) -> list[RequestOutput]:
        """Admits, prefills one row, decodes one token per running sequence; returns the
        outputs that changed (new tokens, or finished)."""
        changed: dict[str, RequestOutput] = {}
        self._admit()
        for sequence in self._prefill():
            changed[sequence.output.request_id] = sequence.output
        for sequence in self._decode():
            changed[sequence.output.request_id] = sequence.output
        return list(changed.values())

    def _admit(self) -> None:
        if self.batching == "static" and self.running:
            return
        while self._waiting and None in self._slots:
            sequence = self._waiting[0]
            need = self._pages_needed(len(sequence.prompt), sequence.params.max_tokens)
            if need > self.pool.free:
                return  # first come, first served: nothing overtakes it
            self._waiting.popleft()
            sequence.pages = self.pool.take(need)
            sequence.slot, sequence.admitted = self._slots.index(None), next(self._admissions)
            self._slots[sequence.slot] = sequence

    def _pages_needed(self, prompt: int, max_tokens: int) -> int:
        """Pages for positions ``0 .. prompt + max_tokens - 2`` (the last token is never
        written), and the speculative rounds' lookahead."""
        return math.ceil((prompt + max_tokens - 1 + self.lookahead) / self.page_size)

    def _on_mesh(self):
        """The engine's mesh in force (programs trace and run on it), if it has one."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _call(self, call: Call):
        """Runs ``call`` on the engine's mesh (its programs donate the pages they update)."""
        self.compiled_programs.add(call.key)
        with self._on_mesh():
            return call.program(*call.args)

    def _decode_call(self, tokens, tables, lengths, rows) -> Call:
        return Call(("decode", len(rows), tables.shape[1]), programs.decode,
                    (self.graphdef, self.execution, self.params, self.kv, tokens, tables, lengths,
                     self._sampling(rows)))

    def _round_call(self, prev, last, tables, lengths, rows) -> Call:
        """One speculative round (``programs.speculative_round``)."""
        return Call(("speculative_round", len(rows), tables.shape[1], self.gamma), programs.speculative_round,
                    (self.graphdef, self.draft[0], self.execution, self.method, self.params, self.draft[1], self.kv,
                     self.draft_kv, prev, last, tables, lengths, self._sampling(rows)))

    def _prefill_call(self, tokens, positions, index, tables, last, rows) -> Call:
        return Call(("prefill", len(tokens), len(rows), tables.shape[1]), programs.prefill,
                    (self.graphdef, self.execution, self.params, self.kv, tokens, positions, index, tables, last,
                     self._sampling(rows)))

    def _draft_prefill_call(self, tokens, positions, index, tables) -> Call:
        """The prefill's row through the draft: its cache mirrors the model's (a GliDe
        draft reads the model's pages of the row)."""
        return Call(("draft_prefill", len(tokens), tables.shape[0], tables.shape[1]), programs.draft_prefill,
                    (self.draft[0], self.graphdef, self.execution, self.draft[1], self.params, self.draft_kv, self.kv,
                     tokens, positions, index, tables))

    def _width(self, positions: int) -> int:
        """The page bucket that holds ``positions`` positions."""
        return next(w for w in self.page_buckets if w * self.page_size >= positions)

    def _table(self, sequence: _Sequence | None, width: int) -> np.ndarray:
        row = np.full((width,), NULL_PAGE, np.int32)
        if sequence is not None:
            pages = sequence.pages[:width]
            row[:len(pages)] = pages
        return row

    def _prefill_program(self, tokens, positions, index, tables, last, rows):
        """The packed row through the model and then, with a draft, through the draft:
        the model's sampled tokens."""
        sampled, self.kv = self._call(self._prefill_call(tokens, positions, index, tables, last, rows))
        if self.draft is not None:
            self.draft_kv = self._call(self._draft_prefill_call(tokens, positions, index, tables))
        return sampled

    def _sampling(self, sequences: list[_Sequence | None]):
        """``(seeds, counts, temperature, top_p)`` per row; empty rows greedy."""
        rows = [(s.params.seed, len(s.output.token_ids), s.params.temperature, s.params.top_p)
                if s is not None else (0, 0, 0.0, 1.0) for s in sequences]
        seeds, counts, temperature, top_p = zip(*rows)
        return (jnp.asarray(seeds, jnp.uint32), jnp.asarray(counts, jnp.int32),
                jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32))

    def _prefill(self) -> list[_Sequence]:
        """One packed row of prompt chunks; the sequences whose prompts it completes get
        their first token."""
        pending = sorted((s for s in self._slots if s is not None and s.prefilled < len(s.prompt)),
                         key=lambda s: s.admitted)
        if not pending:
            return []
        G, budget = self.max_batch, self.prefill_chunk
        chunks = []
        for sequence in pending[:G]:
            take = min(len(sequence.prompt) - sequence.prefilled, budget)
            if take == 0:
                break
            chunks.append((sequence, take))
            budget -= take
        used = sum(take for _, take in chunks)
        C = next(b for b in self.buckets if b >= used)
        width = self._width(max(s.prefilled + take for s, take in chunks))
        tokens, positions, index = (np.zeros(C, np.int32), np.zeros(C, np.int32), np.full(C, -1, np.int32))
        tables, last = np.full((G, width), NULL_PAGE, np.int32), np.zeros(G, np.int32)
        row = [None] * G
        at = 0
        for g, (sequence, take) in enumerate(chunks):
            start = sequence.prefilled
            tokens[at:at + take] = sequence.prompt[start:start + take]
            positions[at:at + take] = np.arange(start, start + take)
            index[at:at + take] = g
            tables[g], last[g], row[g] = self._table(sequence, width), at + take - 1, sequence
            at += take
        next_tokens = np.asarray(self._prefill_program(tokens, positions, index, tables, last, row))
        done = []
        for g, (sequence, take) in enumerate(chunks):
            sequence.prefilled += take
            if sequence.prefilled == len(sequence.prompt):
                self._append(sequence, int(next_tokens[g]))
                done.append(sequence)
        return done

    def _decode(self) -> list[_Sequence]:
        """One token for every slot whose sequence has a generated token to extend."""
        active = [s if s is not None and s.output.token_ids and not s.output.finished else None
                  for s in self._slots]
        if not any(active):
            return []
        tokens = np.array([s.output.token_ids[-1] if s else 0 for s in active], np.int32)
        lengths = np.array([s.cached if s else 0 for s in active], np.int32)
        stepped = [s for s in active if s is not None]
        width = self._width(max(s.cached for s in stepped) + 1 + self.lookahead)
        tables = np.stack([self._table(s, width) for s in active])
        if self.draft is not None:
            prev = np.array([(s.prompt + s.output.token_ids)[-2] if s else 0 for s in active], np.int32)
            emitted, accepted, self.kv, self.draft_kv = self._call(self._round_call(prev, tokens, tables, lengths,
                                                                                    active))
            emitted, accepted = np.asarray(emitted), np.asarray(accepted)
            for sequence in stepped:
                self.rounds, self.accepted = self.rounds + 1, self.accepted + int(accepted[sequence.slot])
                for token in emitted[sequence.slot, :accepted[sequence.slot] + 1]:
                    self._append(sequence, int(token))
                    if sequence.output.finished:
                        break
            return stepped
        next_tokens, self.kv = self._call(self._decode_call(tokens, tables, lengths, active))
        next_tokens = np.asarray(next_tokens)
        for sequence in stepped:
            self._append(sequence, int(next_tokens[sequence.slot]))
        return stepped

    # -------------------------------------------------------------- endings

    def _append(self, sequence: _Sequence, token: int) -> None:
        out = sequence.output
        out.token_ids.append(token)
        if self.tokenizer is not None:
            # an end token is not text (jaxpar-generate leaves it out too)
            out.text = self.tokenizer.decode(out.token_ids[:-1] if token in self.eos_ids else out.token_ids)
            for stop in sequence.params.stop:
                if stop and stop in out.text:
                    out.text = out.text[:out.text.index(stop)]
                    return self._finish(sequence, "stop")
        if token in self.eos_ids:
            return self._finish(sequence, "stop")
        if len(out.token_ids) >= sequence.params.max_tokens:
            return self._finish(sequence, "length")

    def _finish(self, sequence: _Sequence, reason: str) -> None:
        sequence.output.finish_reason = reason
        del self._by_id[sequence.output.request_id]  # a server's finished requests must not pile up
        if sequence.slot >= 0:
            self._slots[sequence.slot] = None
            self.pool.give_back(sequence.pages)
            sequence.slot, sequence.pages = -1, []
