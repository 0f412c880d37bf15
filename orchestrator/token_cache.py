"""A bounded LRU of tokenizer inputs and their token ids, for routing at the orchestrator.

A prompt text seen again (a retried request, a benchmark or eval harness repeating prompts, a
shared few-shot prompt) is not tokenized again. Keyed by the exact text handed to the tokenizer
(the rendered chat template for chat bodies), so a hit returns what tokenizing would return.
Bounded twice: at most ``max_entries`` texts and ``max_tokens`` token ids in all (a text with
more ids than that is not kept). Thread-safe: long prompts are tokenized in a worker thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_ENTRIES = 4096
MAX_TOKENS = 1 << 19  # ids held in all: ~20 MB of Python ints at most


class TokenCache:
    """LRU ``text -> token ids``; the lists handed out are shared: callers must not change them."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_tokens: int = MAX_TOKENS) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, list[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Token ids held in all."""
        return self._tokens

    def get(self, text: str) -> list[int] | None:
        """The ids cached for ``text`` (now the most recently used), or None."""
        with self._lock:
            ids = self._entries.get(text)
            if ids is None:
                self.misses += 1
                return None
            self._entries.move_to_end(text)
            self.hits += 1
            return ids

    def put(self, text: str, ids: list[int]) -> None:
        """Keep ``ids`` for ``text``, dropping the least recently used entries past the bounds."""
        if len(ids) > self.max_tokens or self.max_entries <= 0:
            return
        with self._lock:
            old = self._entries.pop(text, None)
            if old is not None:
                self._tokens -= len(old)
            self._entries[text] = ids
            self._tokens += len(ids)
            while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
                _, dropped = self._entries.popitem(last=False)
                self._tokens -= len(dropped)
