"""Reasoning parsers: the model's text → (reasoning_content, content), piece by piece.

``model.reasoning_parser: qwen3`` (Qwen3, DeepSeek-R1 style): an output that begins (after
whitespace) with ``<think>`` is reasoning up to ``</think>``; the newlines right after
``</think>`` are dropped (Qwen3's chat template strips them when it renders the history) and the
rest is content. An output that does not begin with ``<think>`` is all content, so
``chat_template_kwargs: {"enable_thinking": false}`` (whose template writes an empty think block
into the prompt) gives plain content. A tail that may begin a tag is held back until the next
piece decides. Known limit: a template that opens ``<think>`` in the prompt itself (Qwen3's
2507 "thinking" models) is read as content, not reasoning.
"""

from __future__ import annotations

from pdserve.stop_text import held_back_len

THINK_START, THINK_END = "<think>", "</think>"


class Qwen3ReasoningParser:
    """See the module docstring. :meth:`feed` / :meth:`finish` return ``(reasoning, content)``."""

    def __init__(self) -> None:
        self._state = "start"  # start | reasoning | after | content
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning, content = "", ""
        if self._state == "start":
            head = self._pending.lstrip()
            if head.startswith(THINK_START):
                self._state, self._pending = "reasoning", head[len(THINK_START):]
            elif THINK_START.startswith(head):
                return "", ""  # still may become <think>
            else:
                self._state = "content"
        if self._state == "reasoning":
            at = self._pending.find(THINK_END)
            if at < 0:
                keep = held_back_len(self._pending, [THINK_END])
                reasoning, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
                return reasoning, ""
            reasoning, self._pending = self._pending[:at], self._pending[at + len(THINK_END):]
            self._state = "after"
        if self._state == "after":
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return reasoning, ""
            self._state = "content"
        content, self._pending = self._pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        if self._state == "reasoning":
            return rest, ""
        return "", rest if self._state != "after" else ""
