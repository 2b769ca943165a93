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
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxpar.serving.async_engine import AsyncEngine, EngineClosed, Histogram, QueueFull, RequestStream
from jaxpar.serving.chat_template import ChatTemplate, TemplateRefused
from jaxpar.serving.engine import RequestOutput, SamplingParams

if TYPE_CHECKING:  # annotations only
    from jaxpar.serving.engine import Logprob

MAX_N = 16  # choices per prompt
MAX_REQUEST_BYTES = 1 << 20  # a request body's default limit (--max-request-bytes)
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs: OpenAI's legacy range
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions' top_logprobs

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}
# Options jaxpar does not implement: refused when set to anything but their neutral value.
_UNSUPPORTED = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
                "tools": (None, [])}


class APIError(Exception):
    """An error response: ``status`` and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


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


# ------------------------------------------------------------------ request fields


async def _json_body(request: Request, limit: int) -> dict:
    """The body, a JSON object. Over ``limit`` bytes: 413, refused on its
    Content-Length before reading, or while reading one sent without it (chunked)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared)} bytes, over the server's limit of {limit} "
                            "bytes (--max-request-bytes)", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is over the server's limit of {limit} bytes "
                                f"(--max-request-bytes): {len(body)} read before stopping",
                           code="request_too_large")
    try:
        body = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def _number(body: dict, name: str, default, kind=(int, float)):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise APIError(400, f"{name}={value!r} must be a number" if kind != int else
                       f"{name}={value!r} must be an integer", name)
    return value


def _in_range(body: dict, name: str, default, low, high, kind=(int, float)):
    """``body[name]`` (``default`` when absent or null), 400 unless in [low, high]."""
    value = _number(body, name, default, kind)
    if value is not None and not low <= value <= high:  # NaN too
        raise APIError(400, f"{name}={value} must be in [{low}, {high}]", name)
    return value


def _check_common(body: dict, model_name: str) -> None:
    """The model, and the options jaxpar does not implement."""
    model = body.get("model")
    if not isinstance(model, str) or not model:  # OpenAI requires it, and its clients always send it
        raise APIError(400, f"the request names no model (model={model!r}); this server serves {model_name!r}",
                       "model")
    if model != model_name:
        raise APIError(400, f"model {model!r} is not served here; this server serves {model_name!r}",
                       "model", "model_not_found")
    for name, neutral in _UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise APIError(400, f"{name}={body[name]!r} is not supported by jaxpar-serve", name)


def _max_tokens(body: dict, prompt_lengths: list[int], context: int, default: int | None,
                names: Sequence[str]) -> int:
    """The first of ``names`` the body sets (chat has two), checked against the context;
    ``default`` None: the rest of the context after the longest prompt."""
    name = next((n for n in names if body.get(n) is not None), names[0])
    longest = max(prompt_lengths)
    if longest >= context:
        raise APIError(400, f"the prompt is {longest} tokens: the model's context of {context} tokens "
                            "leaves no room for a completion", "prompt", "context_length_exceeded")
    max_tokens = _number(body, name, default or context - longest, int)
    if max_tokens < 1:
        raise APIError(400, f"{name}={max_tokens} must be at least 1", name)
    if longest + max_tokens > context:
        raise APIError(400, f"the prompt's {longest} tokens + {name}={max_tokens} are past the model's "
                            f"context of {context} tokens", name, "context_length_exceeded")
    return max_tokens


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"stop={body.get('stop')!r} must be a string or a list of strings", "stop")
    return tuple(s for s in stop if s)


def _seeds(body: dict) -> list[int]:
    """One seed per choice (``n`` of them): ``seed + i`` (mod 2**32) for a seeded
    request, as vLLM seeds parallel sampling (the same seed would make the choices
    identical); else a random one each."""
    n = _in_range(body, "n", 1, 1, MAX_N, int)
    seed = _number(body, "seed", None, int)
    if seed is None:
        return [secrets.randbits(32) for _ in range(n)]
    if not 0 <= seed < 2 ** 32:
        raise APIError(400, f"seed={seed} must be in [0, 2**32)", "seed")
    return [(seed + i) % 2 ** 32 for i in range(n)]


def _json_schema(body: dict) -> str | None:
    """``response_format`` as the JSON schema the engine constrains tokens to (None:
    free text), by ``jaxpar.serving.structured.schema_of``; 400 when it refuses it."""
    response_format = body.get("response_format")
    if response_format is None:
        return None
    from jaxpar.serving.structured import schema_of  # imported by the requests that use it

    try:
        return schema_of(response_format)
    except (ValueError, ImportError) as e:  # its message names the value, or the extra to install
        raise APIError(400, str(e), "response_format") from None


def _completion_logprobs(body: dict) -> int | None:
    """/v1/completions' ``logprobs``: top tokens per token, 0 to 5; None: no logprobs."""
    return _in_range(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS, int)


def _chat_logprobs(body: dict) -> int | None:
    """/v1/chat/completions' ``logprobs: true`` with ``top_logprobs`` (0 to 20, default
    0) top tokens per token; None: no logprobs."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise APIError(400, f"logprobs={wanted!r} must be true or false", "logprobs")
    top = _in_range(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, int)
    if top is not None and not wanted:
        raise APIError(400, f"top_logprobs={top} needs logprobs=true", "top_logprobs")
    return (top or 0) if wanted else None


def _sampling(body: dict, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
    """The ``SamplingParams`` of each of a prompt's ``n`` choices, every value checked
    (400 naming it)."""
    temperature = _number(body, "temperature", 1.0)
    if not temperature >= 0:
        raise APIError(400, f"temperature={temperature} must be >= 0", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p={top_p} must be in (0, 1]", "top_p")
    fields = dict(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), stop=_stop(body),
                  logprobs=logprobs, presence_penalty=float(_in_range(body, "presence_penalty", 0.0, -2, 2)),
                  frequency_penalty=float(_in_range(body, "frequency_penalty", 0.0, -2, 2)),
                  json_schema=_json_schema(body))
    return [SamplingParams(seed=seed, **fields) for seed in _seeds(body)]


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_prompts(body: dict, tokenizer) -> list[list[int]]:
    """``prompt`` as token ids, one list per prompt."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "the request has no prompt", "prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise APIError(400, "prompt must be a non-empty string, a list of strings, a list of token ids "
                            "or a list of lists of token ids", "prompt")
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise APIError(400, "the prompt is empty", "prompt")
            p = tokenizer.encode(p).ids
            if not p:
                raise APIError(400, "the prompt encodes to no tokens", "prompt")
        ids.append(list(p))
    return ids


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"message {m!r} must be an object with a role", "messages")
        if isinstance(m.get("content"), list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in m["content"]):
                raise APIError(400, "only text content parts are supported", "messages")
            m["content"] = "".join(p.get("text", "") for p in m["content"])
    return messages


def _chat_prompt(body: dict, template: ChatTemplate, tokenizer) -> list[int]:
    """The messages rendered by the template, as token ids (the template wrote the
    special tokens); 400 when the template refuses or fails on them."""
    try:
        text = template.render(_chat_messages(body))
    except APIError:
        raise
    except TemplateRefused as e:
        raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None
    except Exception as e:  # noqa: BLE001 - a template error is about these messages
        raise APIError(400, f"the chat template failed on these messages: {e}", "messages") from None
    prompt = tokenizer.encode(text, add_special_tokens=False).ids
    if not prompt:
        raise APIError(400, "the chat prompt encodes to no tokens", "messages")
    return prompt


# ------------------------------------------------------------------ responses


def _usage(prompts: list[list[int]], outputs: list[RequestOutput]) -> dict:
    """Each prompt's tokens once, every choice's completion tokens; cached tokens: per
    prompt, the most any of its choices (``outputs`` in choice order) read from the
    prefix cache."""
    n = len(outputs) // len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    cached = sum(max(o.cached_tokens for o in outputs[i:i + n]) for i in range(0, len(outputs), n))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _visible(output: RequestOutput, stop: tuple[str, ...]) -> str:
    """The text a stream may send so far: all of it once finished; before that, without
    a trailing incomplete UTF-8 character and without a tail that could begin a stop
    string (the engine cuts the text there if the stop string completes)."""
    text = output.text or ""
    if output.finished:
        return text
    text = text.rstrip("\ufffd")
    hold = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - hold]


def _finish_reason(output: RequestOutput) -> str:
    """The output's ``finish_reason``; 503 for one the shutdown aborted."""
    if output.finish_reason == "abort":
        raise APIError(503, "the server shut down before the request finished", code="shutting_down")
    return output.finish_reason


def _completion_logprobs_object(decode: Callable[[int], str], logprobs: Sequence[Logprob], offset: int) -> dict:
    """OpenAI's legacy ``logprobs`` object of ``logprobs``; ``offset``: the text offset of
    the first (the lengths of the token strings before it)."""
    tokens = [decode(lp.token_id) for lp in logprobs]
    starts = []
    for token in tokens:
        starts.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{decode(t): p for t, p in lp.top} for lp in logprobs], "text_offset": starts}


def _chat_logprobs_object(decode: Callable[[int], str], logprobs: Sequence[Logprob], offset: int) -> dict:
    """Chat's ``logprobs`` object of ``logprobs`` (``offset`` unused: chat has none)."""
    def token(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**token(lp.token_id, lp.logprob), "top_logprobs": [token(t, p) for t, p in lp.top]}
                        for lp in logprobs]}


class _Format(NamedTuple):
    """How an endpoint writes its response: ``object`` (a chunk's is
    ``object + ".chunk"``), its ids' prefix, a stream's first chunk of a choice (None:
    none), a chunk ``(index, delta, finish_reason, logprobs)``, a choice ``(index,
    text, finish_reason, logprobs)`` and a logprobs object ``(decode, logprobs,
    text offset)``."""

    object: str
    id_prefix: str
    first: Callable[[int], dict] | None
    chunk: Callable[[int, str, str | None, dict | None], dict]
    choice: Callable[[int, str, str, dict | None], dict]
    logprobs: Callable[[Callable[[int], str], Sequence[Logprob], int], dict]


_COMPLETION = _Format(
    "text_completion", "cmpl", None,
    lambda index, delta, reason, logprobs: {"index": index, "text": delta, "logprobs": logprobs,
                                            "finish_reason": reason},
    lambda index, text, reason, logprobs: {"index": index, "text": text, "logprobs": logprobs,
                                           "finish_reason": reason},
    _completion_logprobs_object)
_CHAT = _Format(
    "chat.completion", "chatcmpl",
    lambda index: {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None},
    lambda index, delta, reason, logprobs: {"index": index, "delta": {"content": delta} if delta else {},
                                            "logprobs": logprobs, "finish_reason": reason},
    lambda index, text, reason, logprobs: {"index": index, "message": {"role": "assistant", "content": text},
                                           "logprobs": logprobs, "finish_reason": reason},
    _chat_logprobs_object)


@dataclasses.dataclass
class _Sent:
    """What a stream has sent of one choice: its text, how many tokens' logprobs, and
    the text offset after those tokens."""

    text: str = ""
    tokens: int = 0
    offset: int = 0

    def logprobs(self, output: RequestOutput, fmt: _Format, decode: Callable[[int], str]) -> dict | None:
        """The logprobs object of ``output``'s tokens not sent yet (None: the request
        asked for none), counted as sent."""
        if output.logprobs is None:
            return None
        new = output.logprobs[self.tokens:len(output.token_ids)]
        logprobs = fmt.logprobs(decode, new, self.offset)
        self.tokens += len(new)
        self.offset += sum(len(decode(lp.token_id)) for lp in new)
        return logprobs


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(index, output)`` from every stream as they come, until all have finished;
    closing it early closes (aborts) the streams still going."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, stream):
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as error:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, output = await queue.get()
            if isinstance(output, Exception):
                raise output
            left -= output.finished
            yield index, output
    finally:
        for task, stream in zip(tasks, streams):
            task.cancel()
            await stream.aclose()  # a task cancelled before it ran never reaches its stream


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


def _sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


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


async def _events(state: ServerState, head: dict, merged, prompts: list[list[int]], n: int, fmt: _Format,
                  stop: tuple[str, ...], include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed response: each choice's first chunk (chat:
    the role), then a chunk per output that adds text or finishes (with the logprobs of
    the tokens it adds), the usage chunk if asked, ``[DONE]``."""
    sent = [_Sent() for _ in range(len(prompts) * n)]
    finals: list[RequestOutput] = [None] * len(sent)

    def chunk(choice: dict) -> str:
        return _sse({**head, "object": f"{fmt.object}.chunk", "choices": [choice]})

    try:
        if fmt.first is not None:
            for index in range(len(sent)):
                yield chunk(fmt.first(index))
        async for index, output in merged:
            _finish_reason(output)
            text = _visible(output, stop)
            delta, sent[index].text = text[len(sent[index].text):], text
            if delta or output.finished:
                logprobs = sent[index].logprobs(output, fmt, state.decode)
                yield chunk(fmt.chunk(index, delta, output.finish_reason, logprobs))
            finals[index] = output
        if include_usage:
            yield _sse({**head, "object": f"{fmt.object}.chunk", "choices": [], "usage": _usage(prompts, finals)})
    except APIError as error:
        yield _sse(error_body(error.status, error.message, error.param, error.code))
    finally:
        await merged.aclose()
    yield _sse("[DONE]")


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
