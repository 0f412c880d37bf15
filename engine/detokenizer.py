"""Incremental detokenization that never emits half of a multi-byte character."""
from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    It decodes a small window [prefix_offset:] and subtracts the text of [prefix_offset:read_offset],
    so tokenizers that treat the first token specially still give the right spacing. A delta that
    ends in U+FFFD (an incomplete UTF-8 sequence) is held back until more tokens arrive or flush().
    The concatenated deltas plus flush() equal decode(all ids).
    """

    def __init__(self, tokenizer: _Decoder):
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly complete text (possibly "")."""
        self.ids.extend(token_ids)
        prefix_text = self._tok.decode(self.ids[self._prefix:self._read])
        new_text = self._tok.decode(self.ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Return text held back so far (even if incomplete); call once at the end."""
        prefix_text = self._tok.decode(self.ids[self._prefix:self._read])
        new_text = self._tok.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text):]
