"""An OpenAI-compatible HTTP server over an ``AsyncEngine`` (FastAPI; ``jaxpar-serve``
runs it with uvicorn).

``create_app(async_engine, model_name, tokenizer, chat_template=...)`` serves:

* ``POST /v1/completions``: ``prompt`` a string, a list of strings, a list of token ids
  or a list of such lists; ``max_tokens`` (16), ``temperature`` (1), ``top_p`` (1),
  ``seed`` (random when absent), ``stop`` (a string or a list), ``n`` (1 to ``MAX_N``
  choices per prompt: choice ``i`` of a seeded request samples with ``seed + i``, vLLM's
  rule, else each with a random seed of its own; a choice's ``index`` is
  ``prompt_index * n + i``, OpenAI's order), ``presence_penalty`` and
  ``frequency_penalty`` (in [-2, 2]), ``response_format`` (read by
  ``jaxpar.serving.structured.schema_of``: the JSON schema it gives constrains the
  tokens; ``{"type": "text"}`` none), ``logprobs`` (0 to 5, OpenAI's legacy range: each
  token's logprob and the top k as ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``; ``text_offset`` counts the token strings' lengths from the
  completion's start, vLLM's rule); ``stream``
  as server-sent events in OpenAI's chunk format ending with ``data: [DONE]``
  (``stream_options.include_usage`` adds a last chunk with ``usage``), each chunk with
  the logprobs of the tokens it adds.
* ``POST /v1/chat/completions`` where a chat template is given (rendered with jinja2 as
  ``transformers`` renders it: ``messages``, ``add_generation_prompt=True``, the
  tokenizer's special tokens); ``max_tokens`` defaults to the rest of the context; the
  fields above but ``logprobs: true`` with ``top_logprobs`` 0 to 20 (the choice's
  ``logprobs.content``: ``{"token", "logprob", "bytes", "top_logprobs"}`` per token).
* ``GET /v1/models``, ``GET /health`` (503 once shutting down), ``GET /metrics``
  (Prometheus text).

Logprobs are the engine's (log-softmax of the model's raw logits, before penalties,
temperature and constraints), one per generated token (the end token and those that
complete a stop string included, as ``usage`` counts them); a token's string is
``tokenizer.decode([id])``, the token decoded alone (``bytes``: its UTF-8 bytes).
``usage`` counts each prompt's tokens once however many choices it has, every choice's
completion tokens, and ``prompt_tokens_details.cached_tokens``: per prompt, the most
prompt tokens any of its choices read from the prefix cache (so at most
``prompt_tokens``).

With ``api_key``, a ``/v1/...`` request without the header ``Authorization: Bearer
KEY`` gets 401 (``invalid_api_key``; the key compared in constant time); ``/health``
and ``/metrics`` stay open, for load balancers and Prometheus. A request body over
``max_request_bytes`` (1 MiB by default) gets 413 before it is parsed: refused on its
``Content-Length`` before reading, or (sent chunked, without one) once that many bytes
have come in.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for
a bad request naming the field (malformed JSON, a missing or empty prompt,
``max_tokens`` < 1 or past the context, ``temperature`` < 0, ``top_p`` outside (0, 1],
``n`` outside [1, ``MAX_N``], a penalty outside [-2, 2], ``logprobs`` or
``top_logprobs`` out of range, ``top_logprobs`` without ``logprobs: true``, a
``response_format`` ``structured`` refuses, a missing or unknown model, a prompt longer
than the context, options not supported: ``echo``, ``best_of`` > 1, ``suffix``,
``logit_bias``, ``tools``), 401 and 413 as above, 429 when the queue is full, 503 while
shutting down. A stream the engine cannot finish (shutdown's timeout) ends with an
``error`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxpar.serving.async_engine import AsyncEngine, EngineClosed, Histogram, QueueFull, RequestStream
from jaxpar.serving.chat_template import ChatTemplate
from jaxpar.serving.requests import RequestOutput, SamplingParams
from jaxpar.serving.openai_requests import (MAX_COMPLETION_LOGPROBS, MAX_N, MAX_TOP_LOGPROBS, APIError,
                                            _chat_logprobs, _chat_prompt, _check_common, _completion_logprobs,
                                            _completion_prompts, _json_body, _max_tokens, _sampling, error_body)
from jaxpar.serving.openai_responses import _CHAT, _COMPLETION, _events, _finish_reason, _Format, _merged, _usage

# Requests are read (and errors shaped) in openai_requests.py, responses written in
# openai_responses.py; the public names below include those re-exported from there.
__all__ = ["MAX_COMPLETION_LOGPROBS", "MAX_N", "MAX_REQUEST_BYTES", "MAX_TOP_LOGPROBS", "APIError", "ServerState",
           "chat_completions", "completions", "create_app", "error_body", "health", "metrics", "metrics_text",
           "models"]

MAX_REQUEST_BYTES = 1 << 20  # a request body's default limit (--max-request-bytes)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.status, error.message, error.param, error.code), error.status)


# ------------------------------------------------------------------ the app's state


@dataclasses.dataclass
class ServerState:
    """What the endpoints share: the engine, the one model's name, its tokenizer, the
    chat template (compiled on first use) and the request body limit."""

    async_engine: AsyncEngine
    model_name: str
    tokenizer: Any
    chat_template: str | None
    special_tokens: Mapping[str, str]
    max_request_bytes: int
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    _template: ChatTemplate | None = dataclasses.field(default=None, init=False, repr=False)

    @property
    def context(self) -> int:
        return self.async_engine.engine.max_context

    def template(self) -> ChatTemplate:
        """The compiled chat template; 400 when the model has none or jinja2 is missing."""
        if self.chat_template is None:
            raise APIError(400, f"model {self.model_name!r} has no chat template; use /v1/completions",
                           "messages", "no_chat_template")
        if self._template is None:
            try:
                self._template = ChatTemplate(self.chat_template, self.special_tokens)
            except ImportError:
                raise APIError(400, "chat templates need jinja2, which is not installed (pip install jinja2)",
                               "messages") from None
        return self._template

    def decode(self, token_id: int) -> str:
        """A token's string: the token decoded alone, ``tokenizer.decode([id])``."""
        return self.tokenizer.decode([token_id])


# ------------------------------------------------------------------ running a request


async def _unless_disconnected(request: Request, work) -> bool:
    """Runs the coroutine ``work`` unless the client disconnects first (then cancels it,
    which aborts its requests); True when it finished. Errors propagate."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()
    return True


async def _start(async_engine: AsyncEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestStream]:
    """One engine request per ``(prompt, params)``, all added or none (errors as
    APIError)."""
    started = await asyncio.gather(*(async_engine.stream(p, params) for p, params in requests),
                                   return_exceptions=True)
    errors = [e for e in started if isinstance(e, BaseException)]
    if not errors:
        return started
    for stream in started:
        if not isinstance(stream, BaseException):
            await stream.aclose()
    error = errors[0]
    if isinstance(error, ValueError):
        raise APIError(400, str(error)) from None
    if isinstance(error, QueueFull):
        raise APIError(429, str(error), code="queue_full") from None
    if isinstance(error, EngineClosed):
        raise APIError(503, str(error), code="shutting_down") from None
    raise error


async def _respond(request: Request, state: ServerState, body: dict, prompts: list[list[int]],
                   choices: list[SamplingParams], fmt: _Format):
    """Runs each of ``prompts`` with each of ``choices`` (choice ``prompt_index * n +
    i``): a JSON response, or with ``stream`` server-sent events."""
    if not isinstance(body.get("stream", False), bool):
        raise APIError(400, f"stream={body['stream']!r} must be true or false", "stream")
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    merged = _merged(await _start(state.async_engine, [(p, params) for p in prompts for params in choices]))
    head = {"id": f"{fmt.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    if body.get("stream"):
        events = _events(state, head, merged, prompts, len(choices), fmt, choices[0].stop, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    finals: list[RequestOutput] = [None] * (len(prompts) * len(choices))

    async def collect():
        async for index, output in merged:
            finals[index] = output

    if not await _unless_disconnected(request, collect()):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    return {**head, "object": fmt.object,
            "choices": [fmt.choice(i, o.text, _finish_reason(o),
                                   None if o.logprobs is None else fmt.logprobs(state.decode, o.logprobs, 0))
                        for i, o in enumerate(finals)],
            "usage": _usage(prompts, finals)}


# ------------------------------------------------------------------ metrics


def _histogram(name: str, help_: str, histogram: Histogram) -> list[str]:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    total = 0
    for bound, count in zip((*histogram.buckets, "+Inf"), histogram.counts):
        total += count
        lines.append(f'{name}_bucket{{le="{bound}"}} {total}')
    return lines + [f"{name}_sum {histogram.sum}", f"{name}_count {histogram.count}"]


def metrics_text(async_engine: AsyncEngine) -> str:
    """The Prometheus text exposition (format 0.0.4) of ``async_engine.metrics()``."""
    m = async_engine.metrics()
    lines = []
    for name, kind, help_, value in [
        ("jaxpar_requests_running", "gauge", "Requests in a batch slot.", m.running),
        ("jaxpar_requests_waiting", "gauge", "Requests waiting for a batch slot.", m.waiting),
        ("jaxpar_kv_pages_free", "gauge", "KV cache pages free.", m.pages_free),
        ("jaxpar_kv_pages_total", "gauge", "KV cache pages (the null page left out).", m.pages_total),
        ("jaxpar_generated_tokens_total", "counter", "Tokens generated.", m.generated_tokens),
        ("jaxpar_preemptions_total", "counter", "Running requests preempted (their pages taken back, to "
         "be recomputed) for want of pages.", m.preemptions),
        ("jaxpar_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
         m.prefix_cache_queries),
        ("jaxpar_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
         m.prefix_cache_hits),
        ("jaxpar_prefix_cache_hit_rate", "gauge", "Prefix cache hits over queries, in tokens (0 before any "
         "query).", m.prefix_cache_hits / m.prefix_cache_queries if m.prefix_cache_queries else 0),
    ] + ([] if m.speculative_rounds is None else [
        ("jaxpar_speculative_rounds_total", "counter", "Speculative rounds, one per running sequence per "
         "step.", m.speculative_rounds),
        ("jaxpar_speculative_accepted_drafts_total", "counter", "Draft tokens the model accepted.",
         m.accepted_drafts),
        ("jaxpar_speculative_accepted_per_round", "gauge", "Mean tokens a round gives a sequence, the "
         "model's own included (Spec-Bench's accepted tokens per step).",
         (m.speculative_rounds + m.accepted_drafts) / max(m.speculative_rounds, 1)),
    ]):
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    name = "jaxpar_requests_finished_total"
    lines += [f"# HELP {name} Requests ended, by finish_reason (stop, length, abort, error).",
              f"# TYPE {name} counter"]
    lines += [f'{name}{{finish_reason="{reason}"}} {count}' for reason, count in sorted(m.finished.items())]
    lines += _histogram("jaxpar_time_to_first_token_seconds", "Time from a request's arrival to its "
                        "first token.", m.time_to_first_token)
    lines += _histogram("jaxpar_time_per_output_token_seconds", "A request's time per token after "
                        "its first.", m.time_per_output_token)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the endpoints


async def completions(request: Request, state: ServerState):
    """``POST /v1/completions``."""
    body = await _json_body(request, state.max_request_bytes)
    _check_common(body, state.model_name)
    prompts = _completion_prompts(body, state.tokenizer)
    max_tokens = _max_tokens(body, [len(p) for p in prompts], state.context, 16, ("max_tokens",))
    choices = _sampling(body, max_tokens, _completion_logprobs(body))
    return await _respond(request, state, body, prompts, choices, _COMPLETION)


async def chat_completions(request: Request, state: ServerState):
    """``POST /v1/chat/completions``: the messages rendered by the chat template."""
    body = await _json_body(request, state.max_request_bytes)
    template = state.template()
    _check_common(body, state.model_name)
    prompt = _chat_prompt(body, template, state.tokenizer)
    max_tokens = _max_tokens(body, [len(prompt)], state.context, None, ("max_completion_tokens", "max_tokens"))
    choices = _sampling(body, max_tokens, _chat_logprobs(body))
    return await _respond(request, state, body, [prompt], choices, _CHAT)


async def models(request: Request, state: ServerState):
    """``GET /v1/models``: the one model served."""
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "jaxpar", "max_model_len": state.context}]}


async def health(request: Request, state: ServerState):
    """``GET /health``: 200, or 503 once shutting down."""
    if state.async_engine.closed:
        raise APIError(503, "shutting down", code="shutting_down")
    return {"status": "ok"}


async def metrics(request: Request, state: ServerState):
    """``GET /metrics``: Prometheus text."""
    return PlainTextResponse(metrics_text(state.async_engine), media_type="text/plain; version=0.0.4")


# ------------------------------------------------------------------ the app


class _RequireKey:
    """ASGI middleware: a request to ``/v1`` or below without ``Authorization: Bearer
    KEY`` gets 401 (the header compared in constant time); other paths stay open."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), None)
            if given is None or not hmac.compare_digest(given, self.expected):
                message = ("no API key: send the header 'Authorization: Bearer <key>'" if given is None else
                           "the API key in the Authorization header is not this server's")
                await _error_response(APIError(401, message, code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _route(endpoint: Callable, state: ServerState) -> Callable:
    """``endpoint(request, state)`` as a FastAPI route taking the request alone."""
    async def route(request: Request):
        return await endpoint(request, state)

    return route


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return _error_response(error)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a wrong method) in OpenAI's shape."""
    return _error_response(APIError(error.status_code, str(error.detail)))


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    return _error_response(APIError(500, f"{type(error).__name__}: {error}"))


def create_app(async_engine: AsyncEngine, model_name: str, tokenizer, *, chat_template: str | None = None,
               special_tokens: Mapping[str, str] | None = None, shutdown_timeout: float = 30.0,
               api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The OpenAI-compatible app over ``async_engine`` (module docstring). Its shutdown
    (the ASGI lifespan's) shuts the engine down.

    Args:
      model_name: the one model id served (``/v1/models``; a request naming another is
        refused).
      tokenizer: the engine's ``tokenizers.Tokenizer``.
      chat_template: a Hugging Face chat template (jinja2); None: no chat endpoint.
      special_tokens: variables the template reads (``bos_token``, ``eos_token``).
      shutdown_timeout: seconds the app's shutdown lets accepted requests finish.
      api_key: the key ``/v1/...`` requests must send as ``Authorization: Bearer KEY``;
        None: no key (``/health`` and ``/metrics`` never need one).
      max_request_bytes: the largest request body accepted (413 past it).
    """
    state = ServerState(async_engine, model_name, tokenizer, chat_template, special_tokens or {},
                        max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(async_engine.shutdown, shutdown_timeout)

    app = FastAPI(title="jaxpar-serve", lifespan=lifespan)
    app.state.model_name = model_name
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    for method, path, endpoint in [("POST", "/v1/completions", completions),
                                   ("POST", "/v1/chat/completions", chat_completions),
                                   ("GET", "/v1/models", models), ("GET", "/health", health),
                                   ("GET", "/metrics", metrics)]:
        app.add_api_route(path, _route(endpoint, state), methods=[method], name=endpoint.__name__)
    if api_key is not None:
        app.add_middleware(_RequireKey, api_key=api_key)
    return app
