"""What a request is to the engine: how it samples (``SamplingParams``), what it gives
back (``RequestOutput``, a ``Logprob`` per token where asked) and its engine-side state
(``_Request``). ``jaxpar.serving.engine`` re-exports the public three.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import NamedTuple

from jaxpar.serving.detokenize import Detokenizer
from jaxpar.serving.programs import TOP_LOGPROBS
from jaxpar.serving.scheduler import Seq


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples: greedy at ``temperature == 0``, else from the nucleus
    ``top_p``; its tokens depend on ``seed`` alone (not on the batch it runs in).

    ``logprobs``: None, or ``k`` in 0..20: each generated token's logprob and the ``k``
    most likely (``RequestOutput.logprobs``). ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's, in [-2, 2]) lower the logits of tokens the request
    has generated, by ``presence`` once and ``frequency`` per occurrence.
    ``json_schema`` (``jaxpar.serving.structured.schema_of``'s text): the output is JSON
    valid under it (a token mask each step).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    json_schema: str | None = None

    def check(self) -> None:
        """ValueError, one line naming the bad value."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and
                                              0 <= self.logprobs <= TOP_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r} must be None or an int in [0, {TOP_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [-2, 2]")

    @property
    def biased(self) -> bool:
        """The logits need a bias row (penalties or a schema)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.json_schema)


class Logprob(NamedTuple):
    """A generated token's ``logprob`` and the ``top`` most likely ``(token, logprob)``
    (``log_softmax`` of the model's logits, before penalties, mask and temperature)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class RequestOutput:
    """A request's tokens so far. ``finish_reason``: None while running, ``"stop"`` (an
    end token or stop string), ``"length"`` (``max_tokens``) or ``"abort"``. ``text``
    (with a tokenizer) is cut before a stop string and leaves an end token out;
    ``token_ids`` are all generated, an end token included; ``logprobs`` one per token
    where asked; ``cached_tokens``: prompt tokens read from the prefix cache."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(eq=False)
class _Request:
    """A request's engine-side state: its output, its scheduler state, its text and what
    its sampling carries from token to token."""

    output: RequestOutput
    params: SamplingParams
    seq: Seq
    detokenizer: Detokenizer | None = None
    counts: Counter = dataclasses.field(default_factory=Counter)  # generated tokens, for the penalties
    constraint: object | None = None  # a jaxpar.serving.structured.Constraint
