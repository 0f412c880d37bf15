"""``n`` > 1 at the orchestrator: what the relay knows of a request with several choices.

The ctx server prefills once and answers one choice per index, its ``disaggregated_params`` (on
choice 0) holding one first token per choice; the gen server pulls the prompt's KV once, forks
the n choices and streams them from each one's first token, every chunk carrying one choice and
its ``index`` (chunks of different indexes interleave). Each choice's finish_reason, stop-string
hold-back and logprobs are the gen server's (it decodes every choice), and its usage counts the
prompt once and the completion tokens of all choices. So the orchestrator relays the gen stream
as written (:class:`ChoicesProgress` only gives it the request's head and records what ended), and
a non-streaming request gets the gen server's JSON answer.

Limits (documented in ``docs/architecture.md``, "n > 1"): the ctx server's first tokens are not
sent ahead of the gen stream (the first byte waits for the KV pull), and a stream whose gen server
dies mid-decode is not migrated: it ends with an error event (``migration_limit`` applies to
n = 1 only). A gen server that fails before its first byte is retried as for n = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def num_choices(body: dict) -> int:
    """The body's ``n`` (1 when absent; the body is already validated)."""
    n = body.get("n")
    return n if isinstance(n, int) and n > 1 else 1


def all_finished(answer: dict) -> bool:
    """Whether every choice of a ctx answer finished at its first token (nothing to decode)."""
    return all(c.get("finish_reason") is not None for c in answer.get("choices") or [{}])


@dataclass
class ChoicesProgress:
    """A :class:`orchestrator.progress.Progress` stand-in for the relay of an n > 1 gen stream.

    ``finished``: choice index -> finish_reason of each choice that ended; ``finish_reason`` is set
    (the last one's) once all ``n`` did. ``token_ids`` stays empty: such a stream is not migrated.
    """

    chat: bool
    n: int
    head: dict | None = None
    usage: dict | None = None
    finished: dict[int, str] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        if len(self.finished) < self.n:
            return None
        return next(reversed(self.finished.values()))

    def attempt(self) -> "ChoicesProgress":
        """The merger of a gen stream (there is only ever one per request)."""
        return self

    def absorb(self, event: dict[str, Any]) -> dict | None:
        """Record one gen chunk and return it for the client (the request's id and created time)."""
        if self.head is None:
            self.head = {k: event.get(k) for k in ("id", "created", "model")}
        event.update(id=self.head["id"], created=self.head["created"])
        choices = event.get("choices")
        if not choices:  # the usage-only chunk
            self.usage = event.get("usage") or None
            return event if self.usage else None
        for choice in choices:
            if choice.get("finish_reason") is not None:
                self.finished[int(choice.get("index") or 0)] = choice["finish_reason"]
        return event

    def final_usage(self) -> dict:
        """The gen server's usage; zeros when its stream broke before sending one (the completion
        tokens of n choices are not counted here)."""
        return self.usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
