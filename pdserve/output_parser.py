"""A chat answer's text → OpenAI's message parts: ``reasoning_content``, ``content``, ``tool_calls``.

One :class:`OutputParser` per request, fed the output text in order (:meth:`OutputParser.feed`,
then :meth:`OutputParser.finish` once). The reasoning parser (``model.reasoning_parser``) runs
first, the tool-call parser (``model.tool_call_parser``, or the forced-call parser for
``tool_choice`` required / named) on the content it leaves. Each call returns a
:class:`ParsedDelta`: what a stream sends now. The non-stream message is the join of the same
deltas (:meth:`OutputParser.message`), so a stream and a non-stream answer of one text agree.

Where it runs: where the text is final for the client (docs/architecture.md, "Tools and
reasoning"): on a server that answers the client itself, and in the orchestrator's relay for
every stream it assembles (the servers then stream raw text: ``disaggregated_params.raw_output``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdserve.reasoning_parser import Qwen3ReasoningParser
from pdserve.tool_call_body import CallDelta
from pdserve.tool_parsers import ForcedCallParser, HermesToolParser, ToolParser
from pdserve.tool_use import ToolUse

ToolCallParserName = Literal["none", "hermes"]
ReasoningParserName = Literal["none", "qwen3"]


@dataclass
class ParsedDelta:
    """What one piece of text adds: content, reasoning and call pieces (each may be empty)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def __add__(self, other: "ParsedDelta") -> "ParsedDelta":
        calls = list(self.tool_calls)
        for d in other.tool_calls:
            if calls and calls[-1].index == d.index and d.id is None:  # more arguments of the same call
                last = calls[-1]
                calls[-1] = CallDelta(last.index, last.arguments + d.arguments, last.id, last.name)
            else:
                calls.append(d)
        return ParsedDelta(self.content + other.content, self.reasoning + other.reasoning, calls)

    def to_openai(self) -> dict:
        """The chunk's ``delta`` fields besides ``role`` (``content`` null when only calls or reasoning came)."""
        out: dict = {"content": self.content if self.content or not (self.reasoning or self.tool_calls) else None}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [d.to_openai() for d in self.tool_calls]
        return out


class OutputParser:
    """Reasoning, then tool calls, over one answer's text (see the module docstring)."""

    def __init__(self, reasoning: Qwen3ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning, self._tools = reasoning, tools
        self._content: list[str] = []
        self._thinking: list[str] = []
        self._calls: dict[int, dict] = {}
        self.finished = False

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._record(reasoning, *self._tool_feed(content))

    def finish(self) -> ParsedDelta:
        """Flush whatever was held back (idempotent: a second call returns an empty delta)."""
        if self.finished:
            return ParsedDelta()
        self.finished = True
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        text, calls = self._tool_feed(content)
        if self._tools is not None:
            more, last = self._tools.finish()
            text, calls = text + more, calls + last
        return self._record(reasoning, text, calls)

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` when the model stopped by itself after making calls; else the engine's reason."""
        return "tool_calls" if engine_reason == "stop" and self.called else engine_reason

    def message(self) -> dict:
        """``content`` (None when empty), ``reasoning_content`` (None when empty), ``tool_calls`` (None when none)."""
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for _, c in sorted(self._calls.items())]
        return {"content": "".join(self._content) or None, "reasoning_content": "".join(self._thinking) or None,
                "tool_calls": calls or None}

    def _tool_feed(self, content: str) -> tuple[str, list[CallDelta]]:
        if self._tools is None or not content:
            return content, []
        return self._tools.feed(content)

    def _record(self, reasoning: str, content: str, calls: list[CallDelta]) -> ParsedDelta:
        self._thinking.append(reasoning)
        self._content.append(content)
        for d in calls:
            call = self._calls.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
            call["arguments"] += d.arguments
        return ParsedDelta(content, reasoning, calls)


def output_parser(use: ToolUse, tool_call_parser: ToolCallParserName,
                  reasoning_parser: ReasoningParserName) -> OutputParser | None:
    """The parser of one chat answer, or None when its text goes to the client as is."""
    tools: ToolParser | None = None
    if use.mode == "forced":
        tools = ForcedCallParser()
    elif use.mode == "auto" and tool_call_parser == "hermes":
        tools = HermesToolParser()
    reasoning = Qwen3ReasoningParser() if reasoning_parser == "qwen3" else None
    if tools is None and reasoning is None:
        return None
    return OutputParser(reasoning, tools)
