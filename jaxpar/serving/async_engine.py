"""``AsyncEngine``: the synchronous ``Engine`` driven from one background thread, with an
asyncio interface for a server.

The engine is not thread-safe, so one thread owns it: it runs ``Engine.step()`` while
anything is unfinished and sleeps on a condition when idle. Callers (coroutines on any
event loop) never touch the engine; they post commands (add a request, abort one) that
the thread runs between steps, and each request's outputs come back through its own
``asyncio.Queue``, fed with ``loop.call_soon_threadsafe``.

* ``await stream(prompt, params)`` adds the request and returns an async iterator of
  ``RequestOutput`` snapshots (cumulative: each holds every token so far), the last one
  finished. ``add_request``'s ``ValueError``, ``QueueFull`` and ``EngineClosed`` are
  raised by the ``await``, before anything is queued. Leaving the iteration early (a
  client gone, a cancelled task) aborts the request: the thread frees its pages before
  its next step.
* ``await generate(prompt, params)``: the final output.
* ``shutdown(timeout)``: stop admitting, let accepted requests finish for up to
  ``timeout`` seconds, abort what is left, stop the thread.

``metrics()`` returns what ``/metrics`` reports: requests running and waiting, KV pages
free and total, generated tokens, preemptions, prefix cache queries and hits (prompt
tokens), and histograms of time to first token (from the request's arrival) and time
per output token (a request's decode time over its tokens after the first, observed
when it finishes).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from jaxpar.serving.engine import Engine
from jaxpar.serving.requests import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class QueueFull(RuntimeError):
    """Too many requests waiting for a batch slot (a server answers 429)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and admits no new request (a server answers 503)."""


@dataclasses.dataclass
class Histogram:
    """Prometheus-style: ``counts[i]`` observations ``<= buckets[i]`` and above the
    bucket before (the last entry: above every bucket), their sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))] += 1
        self.sum += value
        self.count += 1


@dataclasses.dataclass
class Metrics:
    """The serving counters; gauges as of the engine's last step."""

    running: int = 0
    waiting: int = 0
    pages_free: int = 0
    pages_total: int = 0
    generated_tokens: int = 0
    # the engine's counters: running requests preempted for want of pages, and prompt
    # tokens looked up in / found in the prefix cache
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # requests ended, by finish_reason: "stop", "length", "abort" (a client gone, or
    # shutdown's timeout) and "error" (an engine step raised)
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    # speculative decoding (an engine with a draft): rounds run per sequence, drafts accepted
    speculative_rounds: int | None = None
    accepted_drafts: int = 0
    time_to_first_token: Histogram = dataclasses.field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    time_per_output_token: Histogram = dataclasses.field(default_factory=lambda: Histogram(TPOT_BUCKETS))

    def count_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


@dataclasses.dataclass
class _Tracked:
    """A request the thread serves: where its outputs go, and its timings."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    last: RequestOutput
    first_token: float | None = None


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    """``fn(*args)`` on ``loop``'s thread; nothing when that loop is closed (its caller
    gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _snapshot(output: RequestOutput) -> RequestOutput:
    """A copy of ``output`` the engine's later steps leave alone (they append to its
    lists) for a reader on another thread."""
    return dataclasses.replace(output, token_ids=list(output.token_ids),
                               logprobs=None if output.logprobs is None else list(output.logprobs))


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(None) if error is None else future.set_exception(error)


class RequestStream:
    """One request's outputs, an async iterator of ``RequestOutput`` snapshots ending
    with the finished one. Cancelled while waiting, closed (``aclose``) or dropped
    before the end, it aborts its request."""

    def __init__(self, owner: AsyncEngine, request_id: str, queue: asyncio.Queue):
        self.request_id, self._owner, self._queue, self._ended = request_id, owner, queue, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        try:
            output = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        while not self._queue.empty():  # snapshots are cumulative: a slow reader takes the latest
            output = self._queue.get_nowait()
        if isinstance(output, BaseException):  # the step failed
            self._ended = True
            raise output
        self._ended = output.finished
        return output

    async def aclose(self) -> None:
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            request_id = self.request_id
            self._owner._submit(lambda: self._owner._abort(request_id))

    def __del__(self):
        self._end()


class AsyncEngine:
    """Owns ``engine`` on a background thread (started here).

    Args:
      max_queue: a request is refused (``QueueFull``) when this many already wait beyond
        the free batch slots; None: no limit.
    """

    def __init__(self, engine: Engine, *, max_queue: int | None = None):
        self.engine, self.max_queue = engine, max_queue
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._closed = False  # admits nothing new
        self._stopping = False  # the thread ends once nothing is unfinished
        self._abort_all = False  # shutdown's timeout passed
        self._exited = False
        self._tracked: dict[str, _Tracked] = {}
        self._metrics = Metrics(pages_free=engine.pool.free, pages_total=engine.pool.total)
        self._thread = threading.Thread(target=self._run, name="jaxpar-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ callers' side

    async def stream(self, prompt: Sequence[int] | str,
                     params: SamplingParams = SamplingParams()) -> RequestStream:
        """Adds a request; returns its outputs as they grow (``RequestStream``: iterate
        it to the end; leaving early, ``aclose()`` it to abort the request at once).

        Raises:
          ValueError: ``Engine.add_request`` refused the request.
          QueueFull: ``max_queue`` requests already wait.
          EngineClosed: shutting down.
        """
        arrival = time.perf_counter()
        if self._closed:
            raise EngineClosed("the server is shutting down and admits no new request")
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        request_id = f"req-{uuid.uuid4().hex}"
        added = loop.create_future()
        tracked = _Tracked(loop, queue, arrival, RequestOutput(request_id, []))
        self._submit(lambda: self._add(prompt, params, request_id, tracked, added), add=True)
        try:
            await added
        except asyncio.CancelledError:
            self._submit(lambda: self._abort(request_id))  # added after all, or not: both fine
            raise
        return RequestStream(self, request_id, queue)

    async def generate(self, prompt: Sequence[int] | str,
                       params: SamplingParams = SamplingParams()) -> RequestOutput:
        """The request's final output (errors as ``stream``'s; cancelled, it aborts)."""
        output = None
        async for output in await self.stream(prompt, params):
            pass
        return output

    def metrics(self) -> Metrics:
        """A copy of the counters (thread-safe)."""
        with self._cond:
            return copy.deepcopy(self._metrics)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stops admitting new requests (``EngineClosed``); accepted ones go on."""
        with self._cond:
            self._closed = True

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stops admitting, lets the accepted requests finish for up to ``timeout``
        seconds (None: no bound), then aborts what is left (their streams end with
        ``finish_reason="abort"``) and stops the thread. Blocks; True when everything
        finished in time."""
        with self._cond:
            self._closed = self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return True
        with self._cond:
            self._abort_all = True
            self._cond.notify()
        self._thread.join()
        return False

    def _submit(self, command: Callable[[], None], *, add: bool = False) -> None:
        """``command`` to the thread, run before its next step. Once the thread has
        ended, an add raises ``EngineClosed`` (it would wait forever), an abort is moot."""
        with self._cond:
            if self._exited:
                if add:
                    raise EngineClosed("the engine has shut down")
                return
            self._commands.append(command)
            self._cond.notify()

    # ------------------------------------------------------------ the thread

    def _add(self, prompt, params: SamplingParams, request_id: str, tracked: _Tracked,
             added: asyncio.Future) -> None:
        engine = self.engine
        try:
            if self._closed:
                raise EngineClosed("the server is shutting down and admits no new request")
            free_slots = engine.max_batch - engine.running
            if self.max_queue is not None and engine.waiting - free_slots >= self.max_queue:
                raise QueueFull(f"{engine.waiting} requests are waiting for {engine.max_batch} batch "
                                f"slots (max_queue={self.max_queue}); retry later")
            engine.add_request(prompt, params, request_id)
        except Exception as error:  # noqa: BLE001 - it goes back to the caller
            _post(tracked.loop, _settle, added, error)
            return
        if not isinstance(prompt, str):
            tracked.last.prompt_token_ids = list(prompt)
        self._tracked[request_id] = tracked
        _post(tracked.loop, _settle, added, None)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        if self._tracked.pop(request_id, None) is not None:  # its reader is gone
            with self._cond:
                self._metrics.count_finished("abort")

    def _publish(self, outputs: list[RequestOutput], now: float) -> None:
        """Snapshots of ``outputs`` to their readers; the counters."""
        with self._cond:
            metrics = self._metrics
            for output in outputs:
                tracked = self._tracked.get(output.request_id)
                if tracked is None:
                    continue
                metrics.generated_tokens += len(output.token_ids) - len(tracked.last.token_ids)
                if tracked.first_token is None and output.token_ids:
                    tracked.first_token = now
                    metrics.time_to_first_token.observe(now - tracked.arrival)
                if output.finished:
                    del self._tracked[output.request_id]
                    metrics.count_finished(output.finish_reason)
                    if len(output.token_ids) > 1:
                        metrics.time_per_output_token.observe(
                            (now - tracked.first_token) / (len(output.token_ids) - 1))
                tracked.last = _snapshot(output)
                _post(tracked.loop, tracked.queue.put_nowait, tracked.last)

    def _fail_all(self, error: BaseException) -> None:
        """Every request ends: ``error`` to its reader (a step raised), or with
        ``error=None`` an ``"abort"`` output (shutdown's timeout)."""
        for request_id, tracked in list(self._tracked.items()):
            self.engine.abort(request_id)
            ending = error or dataclasses.replace(tracked.last, finish_reason="abort")
            _post(tracked.loop, tracked.queue.put_nowait, ending)
            with self._cond:
                self._metrics.count_finished("abort" if error is None else "error")
        self._tracked.clear()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._commands or self._stopping or engine.has_unfinished()):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                if self._stopping and not commands and (self._abort_all or not engine.has_unfinished()):
                    self._fail_all(None)
                    self._exited = True
                    return
            for command in commands:
                command()
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception as error:  # noqa: BLE001 - the readers must not wait forever
                    log.exception("engine step failed; its requests end with the error")
                    self._fail_all(error)
                else:
                    self._publish(outputs, time.perf_counter())
            with self._cond:
                metrics = self._metrics
                metrics.running, metrics.waiting = engine.running, engine.waiting
                metrics.pages_free, metrics.pages_total = engine.pool.free, engine.pool.total
                if engine.draft is not None:
                    metrics.speculative_rounds, metrics.accepted_drafts = engine.rounds, engine.accepted
                metrics.preemptions = engine.preemptions
                metrics.prefix_cache_queries, metrics.prefix_cache_hits = engine.prefix_queries, engine.prefix_hits
