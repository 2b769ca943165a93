"""Reading the OpenAI API's request bodies for ``jaxpar.serving.server``: the JSON
body (size-limited), the model and unsupported options, the prompts as token ids (a
chat's messages rendered by its template), ``max_tokens`` against the context, and
each choice's ``SamplingParams``; every field checked, a bad one refused with an
``APIError`` (400, naming it) in OpenAI's error shape (``error_body``), which the rest
of the server raises too. The fields and their limits are in the server's docstring.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence

from fastapi import Request

from jaxpar.serving.chat_template import ChatTemplate, TemplateRefused
from jaxpar.serving.requests import SamplingParams

MAX_N = 16  # choices per prompt
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
