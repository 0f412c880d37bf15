"""Reading one tool call's JSON object ``{"name": "...", "arguments": {...}}`` as it is generated.

:class:`CallBody` scans the text incrementally (each character once: depth, strings, escapes,
the top-level keys; RFC 8259's grammar, lenient only where a generated call is still incomplete)
and knows, at any point, the function name (once its string is complete), where the arguments
value starts and (once complete) ends, whether the object has closed, and whether the text is
not a call object at all. ``"parameters"`` is read as a synonym of ``"arguments"`` (Llama 3.x's
JSON tool format). :class:`CallStream` turns that into OpenAI's streamed call deltas: one delta
with the id and name, then the arguments text as it grows (raw, exactly as generated, so the
pieces join to the final ``arguments`` string).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

_WS = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")


class CallBody:
    """Incremental scanner of one call object (see the module docstring). Feed text with
    :meth:`feed`; read ``name``, ``args_start``/``args_end`` (indexes into ``text``), ``closed_at``
    (index just past the object's ``}``) and ``invalid`` (the text cannot be a call object)."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.closed_at: int | None = None
        self.invalid = False
        self._pos = 0
        self._depth = 0
        self._in_str = self._esc = False
        self._expect = "open"  # at depth 0/1: open, key, colon, value, value_str, scalar, nested, comma, done
        self._key: str | None = None
        self._start = 0  # where the current top-level string or value began

    def feed(self, piece: str) -> None:
        self.text += piece
        text = self.text
        while self._pos < len(text) and not self.invalid and self._expect != "done":
            self._step(text[self._pos], self._pos)
            self._pos += 1

    @property
    def args_text(self) -> str:
        """The arguments value as generated so far ("" before it starts)."""
        if self.args_start is None:
            return ""
        return self.text[self.args_start:self.args_end if self.args_end is not None else len(self.text)]

    def _step(self, c: str, i: int) -> None:
        if self._in_str:
            self._string_char(c, i)
        elif self._depth == 0:
            self._outside(c)
        elif self._depth == 1:
            self._top_level(c, i)
        else:
            self._nested(c, i)

    def _string_char(self, c: str, i: int) -> None:
        if self._esc:
            self._esc = False
        elif c == "\\":
            self._esc = True
        elif c == '"':
            self._in_str = False
            if self._depth == 1 and self._expect == "key":
                self._key = json.loads(self.text[self._start:i + 1])
                self._expect = "colon"
            elif self._depth == 1 and self._expect == "value_str":
                self._value_done(i + 1)

    def _outside(self, c: str) -> None:
        if c == "{" and self._expect == "open":
            self._depth, self._expect = 1, "key"
        elif c not in _WS:
            self.invalid = True

    def _top_level(self, c: str, i: int) -> None:
        if self._expect == "scalar":
            if c not in _WS + ",}":
                return
            self._value_done(i)
        if c in _WS:
            return
        expect = self._expect
        if expect == "key" and c == '"':
            self._in_str, self._start = True, i
        elif expect == "colon" and c == ":":
            self._expect = "value"
        elif expect == "value":
            self._value_begins(c, i)
        elif expect == "comma" and c == ",":
            self._expect = "key"
        elif expect in ("comma", "key") and c == "}":
            self._depth, self._expect, self.closed_at = 0, "done", i + 1
        else:
            self.invalid = True

    def _value_begins(self, c: str, i: int) -> None:
        self._start = i
        if self._key in _ARGUMENT_KEYS and self.args_start is None:
            self.args_start = i
        if c == '"':
            self._in_str, self._expect = True, "value_str"
        elif c in "{[":
            self._depth, self._expect = 2, "nested"
        else:
            self._expect = "scalar"

    def _nested(self, c: str, i: int) -> None:
        if c == '"':
            self._in_str = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._value_done(i + 1)

    def _value_done(self, end: int) -> None:
        if self._key == "name" and self.text[self._start] == '"' and self.name is None:
            self.name = json.loads(self.text[self._start:end])
        elif self._key in _ARGUMENT_KEYS and self.args_start == self._start:
            self.args_end = end
        self._key, self._expect = None, "comma"


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` + 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """One streamed piece of call ``index``: ``id`` and ``name`` in its first piece, then ``arguments`` text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        """The ``delta.tool_calls`` entry OpenAI streams for this piece."""
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


class CallStream:
    """The deltas of call ``index`` over a :class:`CallBody`: nothing until the name is known and
    the arguments have begun (or the object closed), then the header, then arguments text as it grows.
    ``started``: the header went out (the text is a call, whatever follows)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.body = CallBody()
        self.id = new_call_id()
        self.started = False
        self._sent = 0

    def feed(self, piece: str) -> list[CallDelta]:
        self.body.feed(piece)
        return self._deltas(final=False)

    def finish(self) -> list[CallDelta]:
        """Whatever is left (an object that closed without arguments gets ``{}``)."""
        return self._deltas(final=True)

    @property
    def arguments_missing(self) -> bool:
        return self.body.closed_at is not None and self.body.args_start is None

    def _deltas(self, final: bool) -> list[CallDelta]:
        body = self.body
        out: list[CallDelta] = []
        if not self.started:
            if body.name is None or (body.args_start is None and body.closed_at is None and not final):
                return out
            self.started = True
            out.append(CallDelta(self.index, id=self.id, name=body.name))
        args = "{}" if self.arguments_missing else body.args_text
        if len(args) > self._sent:
            if out:  # the header carries the first arguments text, as one entry
                out[0].arguments = args[self._sent:]
            else:
                out.append(CallDelta(self.index, arguments=args[self._sent:]))
            self._sent = len(args)
        return out
