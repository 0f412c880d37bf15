"""Per-token logprobs through the relay: each gen stream's entries merged into what the client has.

Shapes (:mod:`executor.logprobs_format`): chat ``{"content": [entry, ...], "refusal": None}``;
completions ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (parallel lists), an
echoed prompt's entries first (its first token with ``None`` logprob).

Every gen stream starts at output token 0 (:mod:`orchestrator.progress`), so its entries are
placed by output position and only positions the client lacks are sent:

* the first logprobs-bearing chunk of a stream opens with the ``prompt_n`` echoed-prompt entries
  (completions with ``echo``; sent to the client once per request);
* a chunk with ``n`` token ids and ``k`` output entries holds the entries of its last ``k``
  positions (a migration target gets all earlier tokens as ``first_gen_tokens`` but only the new
  ctx server's logprob of token 0, so its first chunk has ``n`` > ``k``: those positions are
  the client's already). Without token ids (no migration possible) ``n`` = ``k``.

A completions ``text_offset`` is recomputed here (the running length of the entries' token texts
from the start of the choice's text, echo included: the gen server's own rule), because a
migration target's first chunk covers more text than its entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_COMPLETION_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def split(lp: dict, chat: bool) -> list:
    """A chunk's logprobs object → one item per token (chat: the entry dict; completions: a
    ``(token, logprob, top)`` tuple). Raises KeyError/TypeError on a malformed object."""
    if chat:
        return list(lp.get("content") or [])
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))


@dataclass
class LogprobsSent:
    """One request's logprobs as the client has them (``acc``: every item sent, in order).

    ``prompt_n``: echoed-prompt entries at the head of a stream (None: not known yet);
    ``out_sent``: output positions the client has entries for; ``offset``: completions text offset
    (characters) after the last sent entry.
    """

    chat: bool
    echo: bool
    seen: bool = False
    prompt_n: int | None = None
    prompt_sent: bool = False
    out_sent: int = 0
    offset: int = 0
    acc: list = field(default_factory=list)

    def pack(self, items: list) -> dict:
        """Items → the response's logprobs object (completions: ``text_offset`` assigned here)."""
        if self.chat:
            return {"content": list(items), "refusal": None}
        out: dict[str, list] = {k: [] for k in _COMPLETION_KEYS}
        for token, value, top in items:
            out["tokens"].append(token)
            out["token_logprobs"].append(value)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out

    def answer(self) -> dict | None:
        """The non-stream answer's ``choice.logprobs`` (None: the request asked for none)."""
        if not self.seen:
            return None
        if self.chat:
            return {"content": list(self.acc), "refusal": None}
        keep, self.offset = self.offset, 0
        try:
            return self.pack(self.acc)
        finally:
            self.offset = keep


class LogprobsCursor:
    """One gen stream's (or the ctx answer's) position in the output, for :class:`LogprobsSent`."""

    def __init__(self, sent: LogprobsSent) -> None:
        self.sent = sent
        self.pos = 0          # output positions this stream has covered
        self.started = False  # its first logprobs-bearing chunk came

    def take(self, lp: object, n_ids: int | None) -> dict | None:
        """The client's logprobs object for one chunk's ``lp`` (None when the chunk has none).

        ``n_ids``: the chunk's token-id count (None: the stream carries no token ids).
        Raises ValueError on a logprobs object of the wrong shape."""
        if not isinstance(lp, dict):
            self.pos += n_ids or 0
            return None
        s = self.sent
        try:
            items = split(lp, s.chat)
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed logprobs object in a gen chunk: {err!r}") from None
        s.seen = True
        new: list = []
        if not self.started:
            self.started = True
            if s.prompt_n is None:
                s.prompt_n = max(len(items) - (1 if n_ids is None else n_ids), 0) if s.echo else 0
            head, items = items[:s.prompt_n], items[s.prompt_n:]
            if head and not s.prompt_sent:
                new.extend(head)
            s.prompt_sent = s.prompt_sent or bool(head)
        k = len(items)
        n = k if n_ids is None else max(n_ids, k)
        start = self.pos + n - k
        self.pos += n
        skip = max(s.out_sent - start, 0)
        new.extend(items[skip:])
        s.out_sent = max(s.out_sent, start + k)
        s.acc.extend(new)
        return s.pack(new)
