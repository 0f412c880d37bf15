"""Tool-call parsers: the model's text → content + streamed calls (:class:`~pdserve.tool_call_body.CallDelta`).

Each parser is fed the output text piece by piece (:meth:`feed`) and flushed once at the end
(:meth:`finish`); both return ``(content, call deltas)``. Text that may still turn into a call
(a tail that could begin ``<tool_call>``, a call whose name is not complete yet) is held back
until it is decided, so a stream never shows text that later becomes a call.

* :class:`HermesToolParser` (``model.tool_call_parser: hermes``): the Hermes / Qwen2.5 / Qwen3
  format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of calls with
  text around them (as the Qwen2.5 chat template renders calls in the history). A tag whose body
  is not a call object (it does not start with ``{``, or is not JSON before the name is known) is
  content, tags included.
* :class:`ForcedCallParser` (``tool_choice`` required or named, :mod:`pdserve.tool_use`): the
  whole output is one call object (the grammar made it so).

Content outside calls follows one rule in both: trailing whitespace is held until non-whitespace
text follows it; what is held at the end is dropped if a call was made, else sent. So the joined
stream equals the non-stream answer, which is built by the same code (:mod:`pdserve.output_parser`).
"""

from __future__ import annotations

from typing import Protocol

from pdserve.stop_text import held_back_len
from pdserve.tool_call_body import CallDelta, CallStream

START_TAG, END_TAG = "<tool_call>", "</tool_call>"


class ToolParser(Protocol):
    calls: int  # calls started so far

    def feed(self, text: str) -> tuple[str, list[CallDelta]]: ...

    def finish(self) -> tuple[str, list[CallDelta]]: ...


class _Content:
    """The whitespace rule for content outside calls (module docstring)."""

    def __init__(self) -> None:
        self._ws = ""

    def add(self, text: str) -> str:
        """The text that may go out now: up to its last non-whitespace character (the whitespace
        after it waits: it is dropped if a call comes next and nothing else does)."""
        self._ws += text
        out = self._ws.rstrip()
        self._ws = self._ws[len(out):]
        return out

    def end(self, called: bool) -> str:
        out, self._ws = ("" if called else self._ws), ""
        return out


class HermesToolParser:
    """``<tool_call>`` JSON ``</tool_call>`` (see the module docstring)."""

    def __init__(self) -> None:
        self.calls = 0
        self._content = _Content()
        self._pending = ""              # outside a tag: text not yet decided (a possible tag start)
        self._call: CallStream | None = None
        self._raw = ""                  # inside a tag: the text after <tool_call>
        self._text_tag = False          # inside a tag that is not a call: content until </tool_call>

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        deltas: list[CallDelta] = []
        self._pending += text
        while self._pending:
            if self._call is not None:
                if not self._in_call(content, deltas):
                    break
            elif self._text_tag:
                if not self._in_text_tag(content):
                    break
            elif not self._outside(content):
                break
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        content, deltas = [], []
        if self._call is not None:
            if self._call.started:
                deltas += self._call.finish()
            else:  # never became a call: the tag and its text are content
                content.append(self._content.add(START_TAG + self._raw))
            self._call = None
        elif self._pending:
            content.append(self._content.add(self._pending))
        self._pending = ""
        content.append(self._content.end(self.calls > 0))
        return "".join(content), deltas

    def _outside(self, content: list[str]) -> bool:
        """Handle text outside tags; False when the rest must wait for more text."""
        at = self._pending.find(START_TAG)
        if at < 0:
            keep = held_back_len(self._pending, [START_TAG])
            content.append(self._content.add(self._pending[:len(self._pending) - keep]))
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        content.append(self._content.add(self._pending[:at]))
        self._pending = self._pending[at + len(START_TAG):]
        self._call, self._raw = CallStream(self.calls), ""
        return True

    def _in_call(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """Feed the pending text to the open call; False when it needs more text."""
        call = self._call
        assert call is not None
        piece, self._pending = self._pending, ""
        self._raw += piece
        deltas += call.feed(piece)
        if call.started and self.calls == call.index:
            self.calls += 1
        body = call.body
        if not call.started and (body.invalid or body.closed_at is not None):
            # Not a call object (or one without a name): the tag and its text are content.
            self._call, self._text_tag = None, True
            self._pending, self._raw = self._raw, ""
            content.append(self._content.add(START_TAG))
            return True
        if body.closed_at is None and not body.invalid:
            return False
        end = self._raw.find(END_TAG, body.closed_at or 0)
        if end < 0:
            return False
        deltas += call.finish()
        self._pending = self._raw[end + len(END_TAG):]  # what follows the call (text, the next call)
        self._call, self._raw = None, ""
        return True

    def _in_text_tag(self, content: list[str]) -> bool:
        """Inside a tag that is not a call: content up to and with ``</tool_call>``; False: need more."""
        at = self._pending.find(END_TAG)
        if at < 0:
            keep = held_back_len(self._pending, [END_TAG])
            content.append(self._content.add(self._pending[:len(self._pending) - keep]))
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        content.append(self._content.add(self._pending[:at + len(END_TAG)]))
        self._pending = self._pending[at + len(END_TAG):]
        self._text_tag = False
        return True


class ForcedCallParser:
    """The whole output is one call object (``tool_choice`` required or named)."""

    def __init__(self) -> None:
        self.calls = 0
        self._call = CallStream(0)
        self._raw = ""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._raw += text
        deltas = self._call.feed(text)
        self.calls = int(self._call.started)
        return "", deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        if not self._call.started and self._call.body.name is None:
            return self._raw, []  # not a call (no grammar enforced it): the text stays text
        deltas = self._call.finish()
        self.calls = int(self._call.started)
        return "", deltas
