"""Writing the OpenAI API's responses for ``jaxpar.serving.server`` from the engine's
outputs: each endpoint's ``_Format`` (its object, choices, stream chunks and logprobs
objects), ``usage``, the finish reason, the choices' output streams merged into one,
and a streamed response's server-sent events (what each chunk may send so far, ending
with ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from jaxpar.serving.async_engine import RequestStream
from jaxpar.serving.requests import RequestOutput
from jaxpar.serving.openai_requests import APIError, error_body

if TYPE_CHECKING:  # annotations only
    from jaxpar.serving.requests import Logprob
    from jaxpar.serving.server import ServerState


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


def _sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


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
