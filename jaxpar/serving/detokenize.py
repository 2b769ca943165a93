"""Incremental detokenization: a sequence's text grown token by token, each token decoding
a short window of the ids rather than all of them (which is quadratic in the output).

The rule is Hugging Face TGI's and vLLM's: decode the ids from ``prefix`` on and the ids
from ``prefix`` to ``read``; what the first has beyond the second is the new text, kept
only once it does not end in an incomplete character (U+FFFD: a multi-byte character
split over tokens waits for its last byte). Decoding a window that starts a few tokens
back, rather than the new token alone, gives word-initial spaces and merged pieces the
text they have in the whole decode.
"""

from __future__ import annotations


class Detokenizer:
    """The text of ``ids`` as they are appended (``add``); ``finish`` flushes what an
    incomplete character still holds back."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # the window: ids[prefix:read] are in text already

    def add(self, token: int) -> str:
        """Appends ``token``; returns the text it adds (possibly empty)."""
        self.ids.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """The text still held back (an incomplete character at the end), now added."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        after = decode(self.ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        new = after[len(before):]
        self.text += new
        self._prefix, self._read = self._read, len(self.ids)
        return new
