"""The engine's scheduler: which sequences run in the next step, with how many tokens each,
and which pages they hold (host side only; ``jaxpar.serving.engine`` runs the step).

Each step has a token budget (``max_num_batched_tokens``). It is spent, in this order
(vLLM's and Sarathi-Serve's chunked prefill):

1. **decode rows**: every running sequence with one token left to compute (its last
   sampled one) gets a row, oldest first: one token, or with a draft one speculative
   round (``tokens_per_row`` tokens verified);
2. **chunks of running prompts**: sequences still prefilling (a long prompt, or a
   preempted sequence recomputing its tokens) continue with what the budget leaves;
3. **admissions**: waiting requests, first come first served, while the budget, the
   batch (``max_batch`` running) and the page pool allow. A request first reuses the
   cached pages of its longest cached prefix (``jaxpar.serving.page_pool``) and prefills
   only the rest; one whose next prompt page another running sequence is computing
   right now waits a step for it (so ``n`` choices of one prompt share its pages).

Pages come on demand: a sequence holds the pages of the positions it has written, and
takes more as it grows. When the pool runs dry, the newest running sequence not yet
scheduled in this step is preempted (vLLM's recompute policy): its pages go back (its
full pages stay cached), its tokens are kept, and it waits at the head of the queue to
be prefilled again, prompt and generated tokens alike; it then samples exactly the
tokens it would have alone (its keys depend on its seed and token count only).

The step's shapes are bucketed, on one axis each: the step's flat token batch (decode
tokens and prompt chunks together) to a power-of-two ``token_buckets`` entry within the
budget; with a draft, the decode rows (speculative rounds, a program of their own) to
``rows_buckets`` and the prompt chunks' tokens to ``token_buckets``. How long the
sequences are changes no shape (the page tables are the context's whole width, and
attention reads each sequence's own pages up to its length): ``shapes`` lists every
shape a step can take (what ``Engine.warm_up`` compiles). While some are still
compiling (``Engine.warm_up(background=True)``), ``ready`` names the ones compiled and a
step stays within them: at most the largest compiled bucket's tokens (rows, with a
draft), the rest of the work waiting for a later step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter, deque

from jaxpar.serving.page_pool import PagePool, page_keys


@dataclasses.dataclass(eq=False)
class Seq:
    """A request's state in the scheduler: ``tokens`` (the prompt, then the generated
    ones), ``computed`` of them in the cache, in ``pages``; the first ``registered``
    pages are keyed in the prefix cache (shared ones included)."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    registered: int = 0
    order: int = -1  # admission order: the newest is preempted first
    cached_tokens: int | None = None  # prompt tokens the first admission found cached
    _keys: list[bytes] = dataclasses.field(default_factory=list)  # full pages' keys, as far as computed
    _pending: list[bytes] = dataclasses.field(default_factory=list)  # keys this sequence will register

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next one can be sampled."""
        return len(self.tokens) - self.computed

    def keys(self, pages: int, page_size: int) -> list[bytes]:
        """The keys of the first ``pages`` full pages of ``tokens`` (kept: tokens only grow)."""
        start = len(self._keys)
        if start < pages:
            self._keys += page_keys(self.tokens[start * page_size:pages * page_size], page_size, pages - start,
                                    self._keys[-1] if self._keys else b"")
        return self._keys[:pages]


@dataclasses.dataclass
class Plan:
    """One step: ``decode`` sequences (a token each, or with a draft a round each in
    ``rows`` compiled rows) and ``chunks`` ``(sequence, tokens)`` of prompts; ``tokens``
    compiled tokens in the flat batch (the decode tokens, without a draft, and the
    chunks')."""

    decode: list[Seq]
    chunks: list[tuple[Seq, int]]
    rows: int
    tokens: int


def _powers(top: int, first: int = 1, base: int = 2) -> tuple[int, ...]:
    """Powers of ``base`` from ``first`` below ``top``, and ``top``."""
    return tuple(sorted({first * base ** n for n in range(max(0, math.ceil(math.log(max(top / first, 1), base))))
                         if first * base ** n < top} | {top}))


class Scheduler:
    """Waiting and running sequences over ``pool`` (module docstring).

    Args:
      page_size: tokens per page.
      max_pages: the most pages one sequence holds (its context, and a round's lookahead).
      max_batch: the most sequences running at once.
      max_num_batched_tokens: the step's token budget.
      max_prefills: the most prompts with a chunk in one step.
      tokens_per_row: tokens a decode row computes (1; a speculative round's verified ones).
      draft: a draft model runs beside (decode rows are rounds, which need a generated
        token; pages are keyed one token late: the draft's cache runs a token behind).
      static: admit only into an empty batch (the baseline continuous batching beats).
    """

    def __init__(self, pool: PagePool, *, page_size: int, max_pages: int, max_batch: int,
                 max_num_batched_tokens: int, max_prefills: int, tokens_per_row: int = 1, draft: bool = False,
                 static: bool = False):
        self.pool, self.page_size, self.max_pages = pool, page_size, max_pages
        self.max_batch, self.budget, self.max_prefills = max_batch, max_num_batched_tokens, max_prefills
        self.tokens_per_row, self.draft, self.static = tokens_per_row, draft, static
        # a round's program costs seconds to compile (two models, gamma draft steps, the
        # acceptance's sampling): powers of 4, fewer programs for more padding rows
        self.rows_buckets = _powers(min(max_batch, max_num_batched_tokens // tokens_per_row), base=4) if draft else ()
        # from 8 tokens: on XLA:CPU a 16-row step of SmolLM2-135M costs 94 ms, an 8-row one
        # 66 and a 1-row one 57 (2026-11-28), so a few decoding requests pad to 8, not 16.
        # With a draft a step carries prompt chunks only (decode rows are rounds), and each
        # of its programs compiles the draft's forward too: powers of 4 from 16, half the
        # step programs (10 -> 7 in all at the server's defaults)
        first = 16 if draft else 8
        self.token_buckets = _powers(max_num_batched_tokens, max(1, min(first, max_num_batched_tokens // 2)),
                                     base=4 if draft else 2)
        self.ready: frozenset[tuple[str, int]] | None = None  # None: every shape (compiled on demand)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._pending: Counter[bytes] = Counter()  # keys running sequences are computing
        self._order = itertools.count()
        self.preemptions = self.prefix_queries = self.prefix_hits = 0

    # ---------------------------------------------------------------- shapes

    def shapes(self) -> list[tuple[str, int]]:
        """Every program a step runs, by its key: ``("step", T)`` for each token bucket
        and, with a draft, ``("round_step", B)`` for each rows bucket."""
        return [("step", t) for t in self.token_buckets] + [("round_step", r) for r in self.rows_buckets]

    def _buckets(self, kind: str, buckets: tuple[int, ...]) -> tuple[int, ...]:
        """``buckets`` whose programs a step may run now (``ready``)."""
        ready = self.ready  # one read: the warm-up thread replaces it
        return buckets if ready is None else tuple(b for b in buckets if (kind, b) in ready)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> Plan | None:
        """The next step's plan (None: nothing to run)."""
        token_buckets = self._buckets("step", self.token_buckets)
        rows_buckets = self._buckets("round_step", self.rows_buckets)
        # within the largest programs compiled: the flat batch (without a draft, decode
        # tokens and chunks; with one, the chunks) and the rounds' rows
        most_tokens = max(token_buckets, default=0)
        budget = self.budget if self.draft else min(self.budget, most_tokens)
        most_rows = max(rows_buckets, default=0) if self.draft else budget
        scheduled: set[int] = set()
        decode = self._decode_rows(scheduled, min(most_rows, budget // self.tokens_per_row))
        rows = next(b for b in rows_buckets if b >= len(decode)) if decode and self.draft else 0
        used = len(decode) * self.tokens_per_row
        chunks: list[tuple[Seq, int]] = []
        if used < budget:
            self._admit_static()
            left = self._running_chunks(chunks, scheduled, min(budget - used, most_tokens))
            self._admit(chunks, left)
        if not decode and not chunks:
            return None
        flat = sum(n for _, n in chunks) + (0 if self.draft else len(decode))
        tokens = next(t for t in token_buckets if t >= flat) if flat else 0
        return Plan(decode, chunks, rows, tokens)

    def decodes(self, seq: Seq) -> bool:
        """``seq`` takes a decode row: one token left to compute (with a draft: and a
        generated token, which a round feeds the draft with the one before)."""
        return seq.remaining == 1 and (not self.draft or seq.generated > 0)

    def _decode_rows(self, scheduled: set[int], most: int) -> list[Seq]:
        """At most ``most`` running sequences' decode rows, oldest first."""
        decode: list[Seq] = []
        for seq in list(self.running):
            if len(decode) == most:
                break
            if seq.order < 0 or not self.decodes(seq):  # preempted above, or prefilling
                continue
            if self._grow(seq, seq.computed + self.tokens_per_row, scheduled):
                decode.append(seq)
                scheduled.add(id(seq))
        return decode

    def _running_chunks(self, chunks: list, scheduled: set[int], left: int) -> int:
        """Chunks for the running sequences still prefilling; the tokens left."""
        for seq in list(self.running):
            if not left or len(chunks) == self.max_prefills:
                break
            if seq.order < 0 or id(seq) in scheduled or self.decodes(seq):
                continue
            n = min(seq.remaining, left)
            if self._grow(seq, seq.computed + n, scheduled):
                chunks.append((seq, n))
                scheduled.add(id(seq))
                left -= n
        return left

    def _admit(self, chunks: list, left: int) -> None:
        """Waiting sequences, first come first served, each with its first chunk."""
        if self.static:
            return
        i = 0
        while i < len(self.waiting) and left and len(chunks) < self.max_prefills and len(self.running) < self.max_batch:
            seq = self.waiting[i]
            full = (len(seq.tokens) - 1) // self.page_size  # full pages reusable (a token is left to sample)
            keys = seq.keys(full, self.page_size)
            run = self.pool.cached_run(keys)
            if run < full and self._pending[keys[run]]:  # a running sequence is computing it: wait for it
                i += 1
                continue
            shared = self.pool.lookup(keys[:run])
            computed = run * self.page_size
            n = min(len(seq.tokens) - computed, left)
            need = math.ceil((computed + n) / self.page_size) - run
            if need > self.pool.free:
                self.pool.release(shared)
                return  # first come, first served: nothing overtakes it for pages
            del self.waiting[i]
            seq.pages, seq.computed, seq.registered = shared + self.pool.take(need), computed, run
            seq.order = next(self._order)
            seq._pending = keys[run:(seq.prompt_len - 1) // self.page_size]
            self._pending.update(seq._pending)
            if seq.cached_tokens is None:  # the first admission: the prefix cache's hit rate
                seq.cached_tokens = min(computed, seq.prompt_len)
                self.prefix_queries += seq.prompt_len
                self.prefix_hits += seq.cached_tokens
            self.running.append(seq)
            chunks.append((seq, n))
            left -= n

    def _admit_static(self) -> None:
        """Static batching: into an empty batch only, as many as it holds, their prompts
        then chunked by the steps that follow (``_running_chunks``)."""
        if not self.static or self.running:
            return
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting.popleft()
            seq.order = next(self._order)
            if seq.cached_tokens is None:
                seq.cached_tokens = 0
                self.prefix_queries += seq.prompt_len
            self.running.append(seq)

    # ---------------------------------------------------------------- pages

    def _grow(self, seq: Seq, positions: int, scheduled: set[int]) -> bool:
        """``seq`` holds the pages of its first ``positions`` positions, preempting the
        newest unscheduled sequences newer than it while the pool is short, else ``seq``
        itself (False then)."""
        need = min(math.ceil(positions / self.page_size), self.max_pages) - len(seq.pages)
        while need > self.pool.free:
            victim = next((s for s in reversed(self.running) if s.order > seq.order and id(s) not in scheduled), seq)
            self.preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.pages += self.pool.take(need)
        return True

    def preempt(self, seq: Seq) -> None:
        """``seq`` leaves the batch with its tokens, to be prefilled again first."""
        self._release(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _release(self, seq: Seq) -> None:
        self.pool.release(seq.pages)
        self._pending.subtract(seq._pending)
        self._pending += Counter()  # drop the zeros
        seq.pages, seq.computed, seq.registered, seq.order, seq._pending = [], 0, 0, -1, []

    def finish(self, seq: Seq) -> None:
        """``seq`` leaves for good (finished or aborted), its pages back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def computed(self, seq: Seq, count: int) -> None:
        """``seq``'s next ``count`` tokens are now in the cache: its pages that are full
        get keyed (with a draft, once the token after them is in too)."""
        seq.computed += count
        full = min((seq.computed - self.draft) // self.page_size, len(seq.pages))
        if full > seq.registered:
            keys = seq.keys(full, self.page_size)
            for i in range(seq.registered, full):
                self.pool.register(seq.pages[i], keys[i])
                if seq._pending and seq._pending[0] == keys[i]:
                    self._pending[seq._pending.pop(0)] -= 1
            seq.registered = full
            self._pending += Counter()
