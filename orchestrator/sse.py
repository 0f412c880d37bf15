"""Server-sent events the orchestrator writes itself (the gen server's stream is relayed as is).

Used when the ctx server already finished the request at its first token and the client asked
for ``stream``: the final JSON answer becomes the chunk sequence an OpenAI stream would have.
"""

from __future__ import annotations

from pdserve.protocol import (
    SSE_DONE,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChunk,
    CompletionChunkChoice,
    Usage,
    error_body,
    sse_event,
)


def answer_to_events(answer: dict, chat: bool, include_usage: bool, continuous_usage: bool = False) -> list[bytes]:
    """Convert a final non-stream answer (one choice or ``n``) to SSE events ending with ``[DONE]``:
    each choice's chunks carry its ``index`` and its ``logprobs`` ride on its content chunk;
    ``continuous_usage`` puts usage on every chunk."""
    head = {"id": answer.get("id", ""), "created": int(answer.get("created", 0)), "model": answer.get("model", "")}
    full = Usage.model_validate(answer["usage"]) if answer.get("usage") else None
    each = full if continuous_usage else None
    chunks: list[ChatCompletionChunk | CompletionChunk] = []
    for i, choice in enumerate(answer["choices"]):
        index, finish, logprobs = choice.get("index", i), choice.get("finish_reason"), choice.get("logprobs")
        if chat:
            chunks += [
                ChatCompletionChunk(**head, usage=each, choices=[ChatChunkChoice(
                    index=index, delta=_whole_delta(choice.get("message") or {}), logprobs=logprobs)]),
                ChatCompletionChunk(**head, usage=each, choices=[ChatChunkChoice(
                    index=index, delta=ChatDelta(), finish_reason=finish)]),
            ]
        else:
            chunks.append(CompletionChunk(**head, usage=each, choices=[CompletionChunkChoice(
                index=index, text=choice.get("text") or "", finish_reason=finish, logprobs=logprobs)]))
    if include_usage and full is not None:
        cls = ChatCompletionChunk if chat else CompletionChunk
        chunks.append(cls(**head, choices=[], usage=full))
    return [sse_event(c) for c in chunks] + [SSE_DONE]


def _whole_delta(message: dict) -> ChatDelta:
    """One delta holding a whole answer message: its content, reasoning and calls (with their indexes)."""
    calls = [{"index": i, **c} for i, c in enumerate(message.get("tool_calls") or [])] or None
    reasoning = message.get("reasoning_content")
    content = message.get("content")
    if content is None and calls is None and reasoning is None:
        content = ""
    return ChatDelta(role="assistant", content=content, reasoning_content=reasoning, tool_calls=calls)


def error_events(message: str, type_: str = "upstream_error", code: int = 502) -> list[bytes]:
    """An SSE error event (OpenAI error body) followed by ``[DONE]``: how a broken stream ends."""
    return [sse_event(error_body(message, type_, code)), SSE_DONE]


class EventSplitter:
    """Cuts a gen server's SSE body (pieces in any size) into the payloads of its ``data:`` events.

    :meth:`feed` returns the complete events' payloads (bytes after ``data: ``; ``b"[DONE]"`` for
    the end marker); a partial event waits for the next piece. Events are separated by a blank
    line (``\\n\\n``), as every pdserve server writes them (WHATWG HTML, "server-sent events").
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, piece: bytes) -> list[bytes]:
        data = self._buf + piece
        *events, self._buf = data.split(b"\n\n")
        return [e[6:] if e.startswith(b"data: ") else e.removeprefix(b"data:") for e in events if e.strip()]

    @property
    def pending(self) -> bool:
        """Whether a partial event is buffered (a stream that ends now was cut mid-event)."""
        return bool(self._buf.strip())
