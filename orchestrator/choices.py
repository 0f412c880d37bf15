"""``n`` > 1 at the orchestrator: one :class:`~orchestrator.progress.Progress` per choice.

The ctx server prefills once and answers one choice per index, its ``disaggregated_params`` (on
choice 0) holding one first token per choice; the gen server pulls the prompt's KV once, forks
the n choices and streams them from each one's first token, every chunk carrying one choice and
its ``index`` (chunks of different indexes interleave). :class:`ChoicesProgress` keeps what the
client has of each choice in a :class:`ChoiceProgress` (an n = 1 Progress: cumulative text,
stop-string and UTF-8 hold-back, token ids, logprobs without duplicates, the chat parser of that
choice's text) and feeds it from the n-choice stream by choice index (:class:`ChoicesAttempt`).

When the n-choice stream breaks mid-decode (``migration_limit`` > 0), each choice that has not
finished continues as its own n = 1 request (:mod:`orchestrator.choices_relay`): re-prefilled on a
ctx server, then decoded on a gen server with ``first_gen_tokens`` = that choice's tokens so far and
``disaggregated_params.choice_index`` = its index, so it samples as that choice would have (the
sampler's noise is a function of seed, choice and position). Its chunks (``index`` = the choice)
merge into the same client stream through the choice's own Progress (:class:`ChoiceAttempt`).

Usage: the prompt once, completion tokens summed over the choices; after a continuation it is
made here from each choice's token ids (the gen servers' usage chunks are per choice then), and
``continuous_usage_stats`` chunks carry that running total. A non-streaming request (streamed
internally when ``migration_limit`` > 0) is answered with every choice in index order.

Limits (``docs/architecture.md``, "n > 1"): the ctx server's first tokens are not sent ahead of the
gen stream (the first byte waits for the KV pull). A gen server that fails before its first byte is
retried as for n = 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.output_parser import OutputParser
from pdserve.protocol import Usage

from .progress import Attempt, Progress


def num_choices(body: dict) -> int:
    """The body's ``n`` (1 when absent; the body is already validated)."""
    n = body.get("n")
    return n if isinstance(n, int) and n > 1 else 1


def all_finished(answer: dict) -> bool:
    """Whether every choice of a ctx answer finished at its first token (nothing to decode)."""
    return all(c.get("finish_reason") is not None for c in answer.get("choices") or [{}])


@dataclass
class ChoiceProgress(Progress):
    """Choice ``index`` of an n > 1 request as the client has it (``owner``: the request's
    :class:`ChoicesProgress`; ``role_sent``: chat, this choice's first delta named the role)."""

    index: int = 0
    owner: "ChoicesProgress | None" = None
    role_sent: bool = False

    def attempt(self) -> "ChoiceAttempt":
        return ChoiceAttempt(self)


class ChoiceAttempt(Attempt):
    """One gen stream's view of one choice: the n-choice stream's chunks of that index, or a
    continuation's (an n = 1 stream with ``choice_index``)."""

    p: ChoiceProgress

    def absorb(self, event: dict[str, Any]) -> dict | None:
        """:meth:`Attempt.absorb`, then: the chunk carries ``index`` = the choice, the choice's first
        chat delta names the role, and per-chunk usage is the request's once choices continued
        elsewhere. A usage-only chunk is recorded, never returned (the request's usage is made by
        :class:`ChoicesProgress`)."""
        if not event.get("choices"):
            super().absorb(event)
            return None
        chunk = super().absorb(event)
        if chunk is None:
            return None
        p = self.p
        choice = chunk["choices"][0]
        choice["index"] = p.index
        if p.chat and not p.role_sent:
            choice["delta"] = {"role": "assistant", **(choice.get("delta") or {})}
            p.role_sent = True
        if chunk.get("usage") and p.owner is not None and p.owner.continued:
            chunk["usage"] = p.owner.final_usage()
        return chunk


@dataclass
class ChoicesProgress:
    """An n > 1 request's output as the client has it (the relay's ``progress``).

    ``choices``: one :class:`ChoiceProgress` per index; ``usage``: the n-choice stream's usage chunk;
    ``prompt_tokens``/``cached_tokens``: the ctx answer's; ``continued``: some choice continued on
    another gen server (usage is then counted here); ``token_ids`` stays empty (the n-choice gen
    request takes its first tokens from the ctx answer; each choice keeps its own).
    """

    chat: bool
    choices: list[ChoiceProgress]
    head: dict | None = None
    usage: dict | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    continued: bool = False
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def for_body(cls, body: dict, chat: bool, parser: Callable[[], OutputParser | None]) -> "ChoicesProgress":
        """``parser()``: a new parser of one choice's text (each choice holds its own parse state)."""
        n = num_choices(body)
        choices = [ChoiceProgress.for_body(body, chat, parser()) for _ in range(n)]
        me = cls(chat=chat, choices=choices)
        for i, c in enumerate(choices):
            c.index, c.owner = i, me
        return me

    @property
    def n(self) -> int:
        return len(self.choices)

    @property
    def finish_reason(self) -> str | None:
        """None until every choice finished; then the last choice's finish_reason."""
        if any(c.finish_reason is None for c in self.choices):
            return None
        return self.choices[-1].finish_reason

    def take_ctx_answer(self, answer: dict) -> None:
        """Record the ctx server's answer: the request's head, prompt and cached tokens, each choice's
        first token (``first_gen_tokens``, one per choice). Its text is not sent ahead (the gen
        stream sends every choice from its first token)."""
        params = answer["choices"][0].get("disaggregated_params") or {}
        self.set_head({"id": answer.get("id", ""), "created": int(answer.get("created", 0) or 0),
                       "model": answer.get("model", "")})
        self.prompt_tokens = (answer.get("usage") or {}).get("prompt_tokens")
        self.cached_tokens = params.get("cached_tokens")
        first = [int(t) for t in params.get("first_gen_tokens") or []]
        if len(first) == self.n:
            for c, t in zip(self.choices, first):
                c.token_ids = [t]

    def set_head(self, head: dict) -> None:
        self.head = head
        for c in self.choices:
            c.head = head

    def attempt(self) -> "ChoicesAttempt":
        """A merger of the n-choice gen stream."""
        return ChoicesAttempt(self)

    def final_usage(self) -> dict:
        """The request's usage: the n-choice stream's, or (a choice continued elsewhere, or that stream
        broke before its usage chunk) the prompt once plus every choice's output tokens."""
        if self.usage is not None and not self.continued:
            return self.usage
        prompt = self.prompt_tokens
        if prompt is None:
            prompt = next((c.usage.get("prompt_tokens") for c in self.choices if c.usage), 0) or 0
        done = sum(len(c.token_ids) for c in self.choices)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def answer(self) -> dict:
        """The non-stream answer: every choice's (OpenAI shape), in index order, and the request's usage."""
        docs = [c.answer() for c in self.choices]
        doc = docs[0]
        doc["choices"] = [{**d["choices"][0], "index": i} for i, d in enumerate(docs)]
        doc["usage"] = Usage.model_validate(self.final_usage()).model_dump(mode="json")
        return doc


class ChoicesAttempt:
    """The n-choice gen stream's merger: each chunk's choices go to their :class:`ChoiceAttempt`."""

    def __init__(self, progress: ChoicesProgress) -> None:
        self.p = progress
        self._by_index: dict[int, ChoiceAttempt] = {}

    def absorb(self, event: dict[str, Any]) -> dict | None:
        """Merge one parsed chunk; return the chunk for the client or None. Raises ValueError on a
        choice index out of range or a malformed logprobs object."""
        p = self.p
        if p.head is None:
            p.set_head({k: event.get(k) for k in ("id", "created", "model")})
        assert p.head is not None
        event.update(id=p.head["id"], created=p.head["created"])
        choices = event.get("choices")
        if not choices:  # the usage-only chunk
            p.usage = event.get("usage") or None
            return event if p.usage else None
        out = []
        for choice in choices:
            i = choice.get("index") or 0
            if not isinstance(i, int) or not 0 <= i < p.n:
                raise ValueError(f"choice index {i!r} outside 0..{p.n - 1}")
            sub = self._by_index.get(i)
            if sub is None:
                sub = self._by_index[i] = p.choices[i].attempt()
            chunk = sub.absorb({**event, "choices": [choice]})
            if chunk is not None:
                out.extend(chunk["choices"])
        if not out:
            return None
        event["choices"] = out
        return event
