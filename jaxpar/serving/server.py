"""An OpenAI-compatible HTTP server over an ``AsyncEngine`` (FastAPI; ``jaxpar-serve``
runs it with uvicorn).

``create_app(async_engine, model_name, tokenizer, chat_template=...)`` serves:

* ``POST /v1/completions``: ``prompt`` a string, a list of strings (one choice per
  prompt, ``index`` in the list's order), a list of token ids or a list of such lists;
  ``max_tokens`` (16), ``temperature`` (1), ``top_p`` (1), ``seed`` (random when
  absent), ``stop`` (a string or a list); ``stream`` as server-sent events in OpenAI's
  chunk format ending with ``data: [DONE]`` (``stream_options.include_usage`` adds a
  last chunk with ``usage``).
* ``POST /v1/chat/completions`` where a chat template is given (rendered with jinja2 as
  ``transformers`` renders it: ``messages``, ``add_generation_prompt=True``, the
  tokenizer's special tokens); ``max_tokens`` defaults to the rest of the context.
* ``GET /v1/models``, ``GET /health`` (503 once shutting down), ``GET /metrics``
  (Prometheus text).

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for
a bad request (malformed JSON, a missing or empty prompt, ``max_tokens`` < 1 or past
the context, ``temperature`` < 0, ``top_p`` outside (0, 1], ``n`` > 1, a missing or unknown model,
a prompt longer than the context, options not supported: ``echo``, ``logprobs``,
``best_of`` > 1, ``suffix``, penalties, ``logit_bias``), 429 when the queue is full,
503 while shutting down. A stream the engine cannot finish (shutdown's timeout) ends
with an ``error`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxpar.serving.async_engine import AsyncEngine, EngineClosed, Histogram, QueueFull, RequestStream
from jaxpar.serving.chat_template import ChatTemplate, TemplateRefused
from jaxpar.serving.engine import RequestOutput, SamplingParams

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}
# Options jaxpar does not implement: refused when set to anything but their neutral value.
_UNSUPPORTED = {"echo": (None, False), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
                "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0),
                "frequency_penalty": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
                "response_format": (None, {"type": "text"})}


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


# ------------------------------------------------------------------ request fields


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
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


def _check_common(body: dict, model_name: str) -> None:
    """Model, n and the options jaxpar does not implement."""
    model = body.get("model")
    if not isinstance(model, str) or not model:  # OpenAI requires it, and its clients always send it
        raise APIError(400, f"the request names no model (model={model!r}); this server serves {model_name!r}",
                       "model")
    if model != model_name:
        raise APIError(400, f"model {model!r} is not served here; this server serves {model_name!r}",
                       "model", "model_not_found")
    n = _number(body, "n", 1, int)
    if n != 1:
        raise APIError(400, f"n={n} is not supported: one choice per request (n=1)", "n")
    for name, neutral in _UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise APIError(400, f"{name}={body[name]!r} is not supported by jaxpar-serve", name)


def _sampling(body: dict, prompt_lengths: list[int], context: int, default_max_tokens: int | None,
              token_names=("max_tokens",)) -> SamplingParams:
    """The request's ``SamplingParams``, every value checked (400 naming it).
    ``default_max_tokens`` None: the rest of the context after the longest prompt."""
    name = next((n for n in token_names if body.get(n) is not None), token_names[0])
    longest = max(prompt_lengths)
    if longest >= context:
        raise APIError(400, f"the prompt is {longest} tokens: the model's context of {context} tokens "
                            "leaves no room for a completion", "prompt", "context_length_exceeded")
    max_tokens = _number(body, name, default_max_tokens or context - longest, int)
    if max_tokens < 1:
        raise APIError(400, f"{name}={max_tokens} must be at least 1", name)
    if longest + max_tokens > context:
        raise APIError(400, f"the prompt's {longest} tokens + {name}={max_tokens} are past the model's "
                            f"context of {context} tokens", name, "context_length_exceeded")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise APIError(400, f"temperature={temperature} must be >= 0", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p={top_p} must be in (0, 1]", "top_p")
    seed = _number(body, "seed", None, int)
    if seed is not None and not 0 <= seed < 2 ** 32:
        raise APIError(400, f"seed={seed} must be in [0, 2**32)", "seed")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"stop={body.get('stop')!r} must be a string or a list of strings", "stop")
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                          seed=secrets.randbits(32) if seed is None else seed,
                          stop=tuple(s for s in stop if s))


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_prompts(body: dict, tokenizer) -> list[list[int]]:
    """``prompt`` as token ids, one list per choice."""
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


# ------------------------------------------------------------------ responses


def _usage(prompts: list[list[int]], outputs: list[RequestOutput]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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


# ------------------------------------------------------------------ the app


def create_app(async_engine: AsyncEngine, model_name: str, tokenizer, *, chat_template: str | None = None,
               special_tokens: Mapping[str, str] | None = None, shutdown_timeout: float = 30.0) -> FastAPI:
    """The OpenAI-compatible app over ``async_engine`` (module docstring).

    Args:
      model_name: the one model id served (``/v1/models``; a request naming another is
        refused).
      tokenizer: the engine's ``tokenizers.Tokenizer``.
      chat_template: a Hugging Face chat template (jinja2); None: no chat endpoint.
      special_tokens: variables the template reads (``bos_token``, ``eos_token``).
      shutdown_timeout: seconds the app's shutdown lets accepted requests finish.
    """
    context = async_engine.engine.max_context
    created = int(time.time())
    template: list[ChatTemplate | None] = [None]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(async_engine.shutdown, shutdown_timeout)

    app = FastAPI(title="jaxpar-serve", lifespan=lifespan)
    app.state.model_name = model_name

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return _error_response(error)

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return _error_response(APIError(500, f"{type(error).__name__}: {error}"))

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return _error_response(APIError(error.status_code, str(error.detail)))

    async def streams(prompts: list[list[int]], params: SamplingParams) -> list[RequestStream]:
        """One engine request per prompt, all added or none (errors as APIError)."""
        started = await asyncio.gather(*(async_engine.stream(p, params) for p in prompts),
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

    def finish_reason(output: RequestOutput) -> str:
        if output.finish_reason == "abort":
            raise APIError(503, "the server shut down before the request finished", code="shutting_down")
        return output.finish_reason

    async def respond(request, body, prompts, params, chunk, choice, kind):
        """Runs ``prompts``: a JSON response, or with ``stream`` server-sent events.
        ``chunk(index, delta, finish_reason)`` and ``choice(index, text, finish_reason)``
        build the per-choice objects."""
        if not isinstance(body.get("stream", False), bool):
            raise APIError(400, f"stream={body['stream']!r} must be true or false", "stream")
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        merged = _merged(await streams(prompts, params))
        rid, now = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": now, "model": model_name}

        if not body.get("stream"):
            finals: list[RequestOutput] = [None] * len(prompts)

            async def collect():
                async for index, output in merged:
                    finals[index] = output

            if not await _unless_disconnected(request, collect()):
                return Response(status_code=499)  # nginx's "client closed request": nobody reads it
            return {**head, "object": kind,
                    "choices": [choice(i, o.text, finish_reason(o)) for i, o in enumerate(finals)],
                    "usage": _usage(prompts, finals)}

        async def events():
            sent, finals = [""] * len(prompts), [None] * len(prompts)
            try:
                for index in range(len(prompts)):
                    first = chunk(index, None, None)
                    if first is not None:
                        yield _sse({**head, "object": f"{kind}.chunk", "choices": [first]})
                async for index, output in merged:
                    if output.finish_reason == "abort":
                        raise APIError(503, "the server shut down before the request finished",
                                       code="shutting_down")
                    text = _visible(output, params.stop)
                    delta, sent[index] = text[len(sent[index]):], text
                    if delta or output.finished:
                        yield _sse({**head, "object": f"{kind}.chunk",
                                    "choices": [chunk(index, delta, output.finish_reason)]})
                    finals[index] = output
                if include_usage:
                    yield _sse({**head, "object": f"{kind}.chunk", "choices": [],
                                "usage": _usage(prompts, finals)})
            except APIError as error:
                yield _sse(error_body(error.status, error.message, error.param, error.code))
            finally:
                await merged.aclose()
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        _check_common(body, model_name)
        prompts = _completion_prompts(body, tokenizer)
        params = _sampling(body, [len(p) for p in prompts], context, 16)

        def chunk(index, delta, reason):
            return None if delta is None else {"index": index, "text": delta, "logprobs": None,
                                               "finish_reason": reason}

        def choice(index, text, reason):
            return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

        return await respond(request, body, prompts, params, chunk, choice, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        if chat_template is None:
            raise APIError(400, f"model {model_name!r} has no chat template; use /v1/completions",
                           "messages", "no_chat_template")
        if template[0] is None:
            try:
                template[0] = ChatTemplate(chat_template, special_tokens or {})
            except ImportError:
                raise APIError(400, "chat templates need jinja2, which is not installed "
                                    "(pip install jinja2)", "messages") from None
        _check_common(body, model_name)
        try:
            text = template[0].render(_chat_messages(body))
        except APIError:
            raise
        except TemplateRefused as e:
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None
        except Exception as e:  # noqa: BLE001 - a template error is about these messages
            raise APIError(400, f"the chat template failed on these messages: {e}", "messages") from None
        prompt = tokenizer.encode(text, add_special_tokens=False).ids  # the template wrote them
        if not prompt:
            raise APIError(400, "the chat prompt encodes to no tokens", "messages")
        params = _sampling(body, [len(prompt)], context, None, ("max_completion_tokens", "max_tokens"))

        def chunk(index, delta, reason):
            if delta is None:  # the first chunk names the role
                return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
            return {"index": index, "delta": {"content": delta} if delta else {}, "logprobs": None,
                    "finish_reason": reason}

        def choice(index, text, reason):
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": reason}

        return await respond(request, body, [prompt], params, chunk, choice, "chat.completion")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jaxpar", "max_model_len": context}]}

    @app.get("/health")
    async def health():
        if async_engine.closed:
            raise APIError(503, "shutting down", code="shutting_down")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(async_engine), media_type="text/plain; version=0.0.4")

    return app
