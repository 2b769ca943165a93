"""JSON-schema constrained decoding (OpenAI's ``response_format``) for the serving
engine, on llguidance (https://github.com/guidance-ai/llguidance), the Rust library that
vLLM, SGLang and llama.cpp also offer for it.

``schema_of(response_format)`` checks a request's ``response_format`` and gives its
schema text (None: unconstrained); ``constraint(schema, tokenizer, vocab_size, eos_ids)``
gives the request its own ``Constraint``, which says each step which tokens may come
next (``allowed``) and follows the sampled one (``advance``). The text is compact JSON:
``,`` and ``:`` with no whitespace anywhere (llguidance's ``whitespace_flexible=False``,
forced over a schema's own ``x-guidance`` options, as is ``lenient=False``), so a model
cannot loop on spaces or newlines, and properties come in the schema's order.

Compiled once, kept in bounded LRU caches: llguidance's view of a tokenizer (per
``tokenizers.Tokenizer`` object, model vocabulary size and end tokens; about 0.2 s for
SmolLM2's 49,152 tokens), each schema's grammar, and each (tokenizer, schema) compiled
matcher, which a ``Constraint`` copies (microseconds): a second request with the
same schema compiles nothing, and its masks reuse the lexer states earlier requests built.
llguidance is imported on first use (``pip install 'jaxpar[structured]'``), so the engine
imports this module without it.

Why llguidance rather than xgrammar (measured on a busy 2-core CPU, SmolLM2-135M-Instruct's
GGUF tokenizer of 49,152 tokens, compact JSON, greedy decoding of random logits under four
small schemas): llguidance 1.9.1 is a 3.1 MB wheel with no dependencies, builds from a
``tokenizers.Tokenizer``'s JSON (0.2-0.45 s, once per tokenizer), compiles a schema in
0.3-0.9 ms and masks in 17-270 us per token on average (0.1-7 ms at worst); it refuses the
keywords it does not implement (``oneOf``, ``not``, ``if``/``then``, ``uniqueItems``,
``propertyNames``, ``dependentRequired``), so what it accepts it enforces. xgrammar 0.2.8 is
a 1.3 MB wheel that requires torch, transformers, triton and pydantic (5.7 GB installed with
CUDA torch; 1.5-1.9 s to import), takes its vocabulary as a list of token strings (0.05 s),
compiles a schema in 4.5-24 ms, and 1.2-2.2 s for one with a 200-character ``maxLength``
string, then masks in 70-390 us per token on average (0.7-41 ms at worst); it covers more
keywords but ignores some silently (``uniqueItems``, ``not``, ``if``/``then`` and
``dependentRequired`` let invalid values through).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence

import numpy as np

# Compact JSON whatever the schema's "x-guidance" asks: no whitespace (a random or weak
# model must not run on spaces forever), fixed separators, and no keyword ignored.
_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ",",
            "key_separator": ":", "lenient": False}


def _llguidance():
    """The llguidance module, imported on first use (an optional dependency)."""
    try:
        import llguidance
    except ImportError as e:
        raise ImportError("JSON response_format needs llguidance: pip install 'jaxpar[structured]'") from e
    return llguidance


def schema_of(response_format) -> str | None:
    """OpenAI's ``response_format`` -> None (unconstrained) or its JSON schema as JSON text.

    None and ``{"type": "text"}`` are unconstrained; ``{"type": "json_object"}`` is the schema
    ``{"type": "object"}``; ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` is
    its schema (``name`` and ``strict`` are not read: the schema is always enforced). The
    text is ``json.dumps(schema)``, the keys in the client's order: llguidance writes an
    object's properties in the schema's order, which a model may rely on (a ``reasoning``
    before an ``answer``), so the keys are not sorted.

    Raises:
      ValueError: one line naming what is wrong and the offending value: not an object,
        an unknown type, a json_schema without a schema object, or a schema llguidance
        refuses (compiled here, and cached for ``constraint``).
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format={response_format!r} must be an object with a 'type'")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise ValueError(f"response_format json_schema={spec!r} must be an object with a 'schema'")
        schema = spec["schema"]
        if not isinstance(schema, Mapping):
            raise ValueError(f"response_format json_schema schema={schema!r} must be a JSON object")
    else:
        raise ValueError(f"response_format type={kind!r} must be 'text', 'json_object' or 'json_schema'")
    text = json.dumps(schema)
    _grammar(text)
    return text


@functools.lru_cache(maxsize=256)
def _grammar(schema: str) -> str:
    """llguidance's grammar for ``schema`` (JSON text), checked; ValueError if refused."""
    matcher = _llguidance().LLMatcher
    try:
        grammar = matcher.grammar_from_json_schema(schema, overrides=_OPTIONS)
    except ValueError as e:
        raise ValueError(f"response_format schema is not valid JSON schema text: {e}") from None
    if error := matcher.validate_grammar(grammar):
        raise _refused(error)
    return grammar


def _refused(error: str) -> ValueError:
    """The ValueError for a schema llguidance refuses, its (multi-line) message on one line."""
    return ValueError(f"response_format schema refused by llguidance: {' '.join(error.split())}")


@functools.lru_cache(maxsize=8)
def _tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """llguidance's ``LLTokenizer`` for a ``tokenizers.Tokenizer`` (keyed by the object,
    which the cache holds, so its id is never reused meanwhile): its token bytes, special
    tokens, ``vocab_size`` mask bits and ``eos_ids`` as the only end tokens."""
    tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size < tokens:
        raise ValueError(f"vocab_size={vocab_size!r} is smaller than the tokenizer's {tokens} tokens")
    return _llguidance().LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))


@functools.lru_cache(maxsize=256)
def _matcher(schema: str, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """The compiled matcher of ``schema`` for this tokenizer, in its start state: each
    ``Constraint`` decodes on a copy of it."""
    grammar = _grammar(schema)
    matcher = _llguidance().LLMatcher(_tokenizer(tokenizer, vocab_size, eos_ids), grammar, log_level=0)
    if matcher.is_error():
        raise _refused(matcher.get_error())
    return matcher


def compiled_schemas() -> int:
    """How many (tokenizer, schema) matchers are compiled and cached."""
    return _matcher.cache_info().currsize


class Constraint:
    """One request's grammar state (host side), on its own copy of the schema's matcher:
    never shared between requests; one thread at a time."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher, self._vocab_size = matcher, vocab_size
        self._bits = None  # the current state's bitmask (bytes, bit i = token i), once computed

    def _bitmask(self) -> bytes:
        """The allowed tokens' bitmask, computed once per state (``allowed`` and
        ``advance`` of the same step share it)."""
        if self._bits is None:
            bits = self._matcher.compute_bitmask()
            if self._matcher.is_error():
                raise RuntimeError(f"constrained decoding failed: {self._matcher.get_error()}")
            self._bits = bits
        return self._bits

    def allowed(self) -> np.ndarray:
        """bool [vocab_size], a fresh array: the tokens that may come next. The end tokens
        are among them once the JSON value is complete, and alone once ``done``; ids past
        the tokenizer's vocabulary never are. Costs the mask (microseconds, see the module
        docstring) plus an unpack of vocab_size bits (about 4 us for 49,152)."""
        bits = np.frombuffer(self._bitmask(), np.uint8)
        return np.unpackbits(bits, count=self._vocab_size, bitorder="little").view(bool)

    def advance(self, token: int) -> None:
        """Follow the sampled ``token``; ValueError if ``allowed()`` does not allow it."""
        token = int(token)
        if not 0 <= token < self._vocab_size or not self._bitmask()[token >> 3] >> (token & 7) & 1:
            raise ValueError(f"token={token} is not allowed by the response_format schema here")
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"constrained decoding failed: {self._matcher.get_error()}")
        self._bits = None

    @property
    def done(self) -> bool:
        """The JSON value is complete and nothing but an end token may follow (a top-level
        number, which could take more digits, is done only after its end token)."""
        return self._matcher.is_stopped()


def constraint(schema: str, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> Constraint:
    """A fresh ``Constraint`` for ``schema`` (``schema_of``'s text) with ``tokenizer`` (a
    ``tokenizers.Tokenizer``) over the model's ``vocab_size`` tokens (ids past the
    tokenizer's are never allowed), ending at ``eos_ids`` (the model's end tokens: allowed
    exactly when the JSON value is complete). The tokenizer's llguidance side and the
    schema's matcher are compiled once and cached, so this costs a copy.

    Raises:
      ValueError: no end token, ``vocab_size`` below the tokenizer's, or a schema
        llguidance refuses.
    """
    eos = tuple(int(i) for i in eos_ids)
    if not eos:
        raise ValueError(f"eos_ids={eos_ids!r}: constrained decoding needs an end token")
    return Constraint(_matcher(schema, tokenizer, vocab_size, eos).deep_copy(), vocab_size)
