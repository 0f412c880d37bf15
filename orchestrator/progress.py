"""What one request's client has been sent so far, and how each gen stream merges into it.

Every gen stream of a request starts at output token 0: the gen server counts the
``first_gen_tokens`` it is handed as output (detokenized, stop-checked, in ``usage``) and streams
their text first. That holds for the first gen stream (``first_gen_tokens`` = the ctx server's
token, whose text the client already got at once), for a retry, and for a migration target
(``first_gen_tokens`` = every token generated so far). So an attempt's cumulative text is the
output text from its start, and the client gets only the characters past what it already has:
no text twice, none missing. Text a server holds back (a tail that may begin a stop string, an
incomplete UTF-8 character) was never sent, so the next server, which decodes the same tokens,
sends it.

The token ids come from the extension field ``choices[0].token_ids`` that a gen server adds when
asked (``disaggregated_params.stream_token_ids``); :meth:`Attempt.absorb` strips it before the
client sees a chunk.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from .relay_logprobs import LogprobsCursor, LogprobsSent
from pdserve.output_parser import OutputParser, ParsedDelta
from pdserve.stop_text import held_back_len
from pdserve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionResponse,
    ToolCall,
    Usage,
)

log = logging.getLogger("orchestrator.progress")

TOKEN_IDS_FIELD = "token_ids"  # the gen stream's extension field (see module docstring)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop]
    return [s for s in stop or [] if isinstance(s, str) and s]


@dataclass
class Progress:
    """One request's output as the client has it.

    ``token_ids``: output token ids generated so far (the ctx server's first token included);
    ``parts``: the text pieces the client was sent (their concatenation is the answer's text; a
    pass-through event's text is not kept: :meth:`Attempt.take_record`, a client's stream only);
    ``sent_len``: characters sent; ``head``: ``id``/``created``/``model`` of every chunk the client
    gets (the first answer's, so the stream keeps one id across servers); ``cached_tokens``: the
    first ctx server's prefix-cache hit (a migration's re-prefill reports that one, not its own).
    ``parser`` (chat): reads reasoning and tool calls out of the text the client gets, in order
    (the servers stream it raw); ``parts``/``sent_len`` stay the raw text, by which streams merge.
    """

    chat: bool
    stops: list[str]
    head: dict | None = None
    token_ids: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    sent_len: int = 0
    finish_reason: str | None = None
    usage: dict | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    logprobs: LogprobsSent | None = None
    continuous_usage: bool = False
    first_logprobs: dict | None = None
    first_usage: dict | None = None
    parser: OutputParser | None = None
    first_delta: ParsedDelta | None = None

    @classmethod
    def for_body(cls, body: dict, chat: bool, parser: OutputParser | None = None) -> "Progress":
        opts = body.get("stream_options") or {}
        return cls(chat=chat, stops=_stops(body),
                   logprobs=LogprobsSent(chat=chat, echo=not chat and bool(body.get("echo"))),
                   continuous_usage=bool(opts.get("continuous_usage_stats")),
                   parser=parser if chat else None)

    def take_ctx_answer(self, answer: dict, head: dict | None = None) -> str:
        """Record the ctx server's (not final) answer; return the text the client may get now.
        ``head``: the ``id`` and ``created`` the client's chunks carry (pass-through streams,
        :attr:`orchestrator.disagg.Exchange.relay_head`), else the answer's.

        The ctx server finished its part, so it held nothing back for stop strings: the tail
        that could begin one is held back here, as the gen server will."""
        choice = answer["choices"][0]
        params = choice.get("disaggregated_params") or {}
        if head is None:
            head = {"id": answer.get("id", ""), "created": int(answer.get("created", 0) or 0)}
        self.head = {"id": head["id"], "created": head["created"], "model": answer.get("model", "")}
        self.token_ids = [int(t) for t in params.get("first_gen_tokens") or []]
        self.cached_tokens = params.get("cached_tokens")
        usage = answer.get("usage") or {}
        self.prompt_tokens = usage.get("prompt_tokens")
        if self.logprobs is not None:
            self.first_logprobs = LogprobsCursor(self.logprobs).take(choice.get("logprobs"), len(self.token_ids))
        self.first_usage = answer.get("usage")
        text = ((choice.get("message") or {}).get("content") if self.chat else choice.get("text")) or ""
        safe = text[:len(text) - held_back_len(text, self.stops)]
        self._send(safe)
        if self.parser is not None:
            self.first_delta = self.parser.feed(safe)
        return safe

    def _send(self, text: str) -> None:
        if text:
            self.parts.append(text)
            self.sent_len += len(text)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def first_chunk(self, text: str) -> dict:
        """The chunk the client gets at once (chat: it carries ``role: assistant``), with the ctx
        answer's logprobs and (``continuous_usage_stats``) its usage.

        Without usage or a parsed delta it is filled into the pydantic model's own dump of an empty first chunk
        (:func:`_first_chunk_template`), which is what building and dumping the model gives, at a
        tenth of the cost: this chunk is on every stream's path to its first byte."""
        assert self.head is not None
        with_usage = bool(self.continuous_usage and self.first_usage)
        if not with_usage and self.first_delta is None:
            template = _first_chunk_template(self.chat)
            choice = {**template["choices"][0], "logprobs": self.first_logprobs}
            if self.chat:
                choice["delta"] = {**choice["delta"], "content": text}
            else:
                choice["text"] = text
            return {**template, **self.head, "choices": [choice]}
        usage = Usage.model_validate(self.first_usage) if with_usage else None
        if self.chat:  # with usage, or a parsed delta (reasoning, tool calls): built by the models
            delta = ChatDelta(role="assistant", content=text)
            if self.first_delta is not None:
                delta = ChatDelta(role="assistant", **self.first_delta.to_openai())
            return ChatCompletionChunk(**self.head, usage=usage, choices=[ChatChunkChoice(
                delta=delta, logprobs=self.first_logprobs)]).model_dump(mode="json")
        return CompletionChunk(**self.head, usage=usage, choices=[CompletionChunkChoice(
            text=text, logprobs=self.first_logprobs)]).model_dump(mode="json")

    def final_usage(self) -> dict:
        """The gen server's usage, or (its stream broke after the last token) one made here."""
        if self.usage is not None:
            return self.usage
        prompt, done = self.prompt_tokens or 0, len(self.token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done).model_dump(mode="json")

    def answer(self) -> dict:
        """The non-stream answer (OpenAI shape) assembled from what was streamed internally."""
        head = self.head or {"id": "", "created": 0, "model": ""}
        usage = Usage.model_validate(self.final_usage())
        lp = None if self.logprobs is None else self.logprobs.answer()
        if self.chat:
            choice = ChatChoice(message=self._message(), finish_reason=self.finish_reason, logprobs=lp)
            doc = ChatCompletionResponse(**head, choices=[choice], usage=usage).model_dump(mode="json")
        else:
            choice = CompletionChoice(text=self.text, finish_reason=self.finish_reason, logprobs=lp)
            doc = CompletionResponse(**head, choices=[choice], usage=usage).model_dump(mode="json")
        doc["choices"][0].pop("disaggregated_params", None)
        return doc

    def _message(self) -> ChatResponseMessage:
        if self.parser is None:
            return ChatResponseMessage(content=self.text)
        self.parser.finish()  # a no-op when the final chunk came; else it flushes what was held back
        parts = self.parser.message()
        calls = [ToolCall.model_validate(c) for c in parts["tool_calls"]] if parts["tool_calls"] else None
        return ChatResponseMessage(content=parts["content"], reasoning_content=parts["reasoning_content"],
                                   tool_calls=calls)

    def attempt(self) -> "Attempt":
        """A merger for one more gen stream of this request (it starts at output token 0)."""
        return Attempt(self)


class Attempt:
    """One gen stream's view: its cumulative text length, token ids and logprobs position."""

    def __init__(self, progress: Progress) -> None:
        self.p = progress
        self.lp = None if progress.logprobs is None else LogprobsCursor(progress.logprobs)
        self.text_len = 0
        self.token_ids: list[int] = []
        self.chunks = 0

    def absorb(self, event: dict[str, Any]) -> dict | None:
        """Merge one parsed gen chunk; return the chunk for the client, or None (nothing new).

        The returned chunk is ``event`` itself, rewritten: the request's id and created time,
        ``token_ids`` removed, the text cut to what the client does not have yet, the logprobs to
        the positions it lacks (:mod:`orchestrator.relay_logprobs`); per-chunk ``usage``
        (continuous_usage_stats) is kept. Raises ValueError on a malformed logprobs object."""
        self.chunks += 1
        p = self.p
        if p.head is None:
            p.head = {k: event.get(k) for k in ("id", "created", "model")}
        event["id"], event["created"] = p.head["id"], p.head["created"]
        choices = event.get("choices")
        if not choices:  # the usage-only chunk
            usage = event.get("usage")
            if not usage:
                return None
            p.usage = self._usage(usage)
            event["usage"] = p.usage
            return event
        choice = choices[0]
        ids = choice.pop(TOKEN_IDS_FIELD, None)
        self._take_ids(ids)
        if self.lp is not None and not isinstance(choice.get("logprobs"), dict):
            # The usual chunk, without logprobs: LogprobsCursor.take's first case, inline (per chunk).
            self.lp.pos += len(ids) if isinstance(ids, list) else 0
            choice["logprobs"] = lp = None
        else:
            lp = self._logprobs(choice, ids)
        if event.get("usage"):
            event["usage"] = self._usage(event["usage"])
        delta = choice.get("delta") if p.chat else None
        piece = ((delta or {}).get("content") if p.chat else choice.get("text")) or ""
        new = self._unsent(piece)
        finish = choice.get("finish_reason")
        if p.parser is not None:
            return self._parsed(event, choice, delta, new, finish, lp)
        if finish is not None:
            p.finish_reason = finish
        if not new and finish is None and not _has_items(lp):
            return None
        if p.chat:
            choice["delta"] = {**_without_role(delta), "content": new}
        else:
            choice["text"] = new
        return event

    def take_record(self, start: int, end: int, ids: list, finish: str | None) -> bool:
        """Merge a pass-through event's record (:data:`pdserve.protocol.RELAY_LINE`: its text is
        output characters ``start``..``end``) when its chunk goes to the client as the server wrote
        it: its text begins where the client's ends (or it has none). False (nothing merged) when
        its text overlaps what the client has: the caller merges the chunk with :meth:`absorb`.
        The text itself is not kept (:attr:`Progress.parts`). Raises ValueError on a record that
        does not continue this stream's text, or token ids that are not ints."""
        if start != self.text_len or end < start:
            raise ValueError(f"its text at characters {start}..{end} does not follow the stream's {self.text_len}")
        p = self.p
        if start < p.sent_len and end > start:  # text the client has (some or all of it): absorb cuts it
            return False
        if ids:
            self._take_ids(ids)
            if self.lp is not None:
                self.lp.pos += len(ids)
        self.chunks += 1
        self.text_len = end
        if end > p.sent_len:
            p.sent_len = end
        if finish is not None:
            p.finish_reason = finish
        return True

    def _parsed(self, event: dict, choice: dict, delta: dict | None, new: str, finish: str | None,
                lp: dict | None) -> dict | None:
        """:meth:`absorb` for a request whose text is parsed here: the new raw text goes through the
        request's parser; the chunk carries the parsed delta, and ``finish_reason`` becomes
        ``tool_calls`` when the model stopped after making calls."""
        parser = self.p.parser
        assert parser is not None
        parsed = parser.feed(new)
        if finish is not None:
            parsed = parsed + parser.finish()
            finish = choice["finish_reason"] = parser.finish_reason(finish)
            self.p.finish_reason = finish
        if not parsed and finish is None and not _has_items(lp):
            return None
        choice["delta"] = {**_without_role(delta), **parsed.to_openai()}
        return event

    def _logprobs(self, choice: dict, ids: object) -> dict | None:
        """The chunk's logprobs cut to the positions the client lacks (set on ``choice``)."""
        if self.lp is None:
            return None
        n_ids = len(ids) if isinstance(ids, list) else None
        choice["logprobs"] = self.lp.take(choice.get("logprobs"), n_ids)
        return choice["logprobs"]

    def _usage(self, usage: dict) -> dict:
        if self.p.cached_tokens is not None:  # the first ctx server's hit, not a re-prefill's
            usage = {**usage, "prompt_tokens_details": {**(usage.get("prompt_tokens_details") or {}),
                                                        "cached_tokens": self.p.cached_tokens}}
        return usage

    def _take_ids(self, ids: object) -> None:
        if isinstance(ids, list) and ids:
            mine = self.token_ids
            mine.extend(map(int, ids))
            if mine is not self.p.token_ids and len(mine) > len(self.p.token_ids):
                # From now on this stream's list is the request's (one list, no copy per chunk:
                # a copy each chunk made a long answer quadratic); a later attempt starts its own.
                self.p.token_ids = mine

    def _unsent(self, piece: str) -> str:
        """The part of ``piece`` past what the client has (by characters of the output text)."""
        before = self.text_len
        self.text_len = end = before + len(piece)
        p = self.p
        if end <= p.sent_len:
            return ""
        new = piece[p.sent_len - before:] if p.sent_len > before else piece
        if new:  # Progress._send, inline (per chunk)
            p.parts.append(new)
            p.sent_len += len(new)
        return new


@functools.cache
def _first_chunk_template(chat: bool) -> dict:
    """The JSON dump of an empty first chunk (chat: ``role: assistant``), every default included."""
    if chat:
        model: ChatCompletionChunk | CompletionChunk = ChatCompletionChunk(
            id="", created=0, model="", choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
    else:
        model = CompletionChunk(id="", created=0, model="", choices=[CompletionChunkChoice(text="")])
    return model.model_dump(mode="json")


def _has_items(lp: dict | None) -> bool:
    """Whether a logprobs object (either shape) holds any entry."""
    return bool(lp) and bool(lp.get("content") or lp.get("tokens"))


def _without_role(delta: dict | None) -> dict:
    """A relayed delta without ``role``: the client's first chunk (sent by this relay) named it, and
    OpenAI's later deltas leave it out."""
    return {k: v for k, v in (delta or {}).items() if k != "role"}
