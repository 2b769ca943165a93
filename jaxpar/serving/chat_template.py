"""Hugging Face chat templates rendered as ``transformers`` renders them, without the
web server's dependencies: ``jaxpar-serve``'s ``/v1/chat/completions`` and the
benchmarks' chat prompts (``bench/speculative.py``) both render through it."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping


class TemplateRefused(ValueError):
    """The template's own ``raise_exception(message)`` refused the messages."""


class ChatTemplate:
    """A Hugging Face chat template rendered as ``transformers`` renders it (a sandboxed
    jinja2 environment, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
    ``strftime_now``, a ``tojson`` that keeps non-ASCII text).

    Raises (constructing it):
      ImportError: jinja2 is not installed.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str]):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateRefused(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: time.strftime(fmt))
        self.template, self.special_tokens = env.from_string(source), dict(special_tokens)

    def render(self, messages: list) -> str:
        """The prompt text of ``messages`` (``[{role, content}]``), ready for the
        assistant's turn (``add_generation_prompt``).

        Raises:
          TemplateRefused: the template refused these messages.
        """
        return self.template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
