"""Engine logprobs (:class:`engine.logprobs.TokenLogprob`) in the OpenAI response shapes.

* chat: ``choice.logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}], "refusal": None}`` — ``top_logprobs`` lists the k most likely tokens.
* completions (legacy): ``choice.logprobs = {"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}`` — ``top_logprobs[i]`` maps token text to logprob for the k most likely tokens
  plus the chosen one (OpenAI: "up to logprobs + 1 elements"); ``text_offset[i]``: where token i's
  text starts in the choice's text; an echoed prompt's first token has ``None`` for both.

A token's text is ``tokenizer.decode([id])`` with special tokens kept (vLLM's), or ``token_id:N``
with ``return_tokens_as_token_ids`` (vLLM's extension). ``bytes``: that text's UTF-8 bytes.
Streams carry the same shapes per chunk, for the chunk's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.logprobs import TokenLogprob
from pdserve.protocol import TokenLogprobModel


@dataclass
class TokenNamer:
    """Turns token ids into response text: ``decode([id])`` or ``token_id:N``."""

    tokenizer: object
    as_ids: bool = False

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def to_wire(entries: list[TokenLogprob | None]) -> list[TokenLogprobModel | None]:
    """Engine entries → the ctx → gen wire models (``None`` stays ``None``)."""
    return [None if e is None else TokenLogprobModel(token_id=e.token_id, logprob=e.logprob, top=list(e.top))
            for e in entries]


def from_wire(entries: list[TokenLogprobModel | None] | None) -> list[TokenLogprob | None] | None:
    """The wire models → engine entries (exact: JSON round-trips a double)."""
    if entries is None:
        return None
    return [None if e is None else TokenLogprob(e.token_id, e.logprob, tuple((t, v) for t, v in e.top))
            for e in entries]


def _entry(name: TokenNamer, token_id: int, logprob: float) -> dict:
    text = name(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob], name: TokenNamer) -> dict:
    """The chat ``choice.logprobs`` object for ``entries`` (one per output token)."""
    content = [{**_entry(name, e.token_id, e.logprob), "top_logprobs": [_entry(name, t, v) for t, v in e.top]}
               for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenLogprob | None], name: TokenNamer, offset: int = 0) -> tuple[dict, int]:
    """The completions ``choice.logprobs`` object and the text offset after its tokens.

    ``entries``: one per token of the choice's text (echoed prompt first; ``None`` for a prompt's
    first token); ``offset``: where the first token's text starts (past earlier stream chunks).
    """
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        if e is None:
            continue
        text = name(e.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(e.logprob)
        tops.append({**{name(t): v for t, v in e.top}, text: e.logprob})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def prompt_first(entries: list[TokenLogprob | None], prompt_ids: list[int], name: TokenNamer,
                 offset: int = 0) -> tuple[dict, int]:
    """Completions logprobs of an echoed prompt: like :func:`completion_logprobs`, with the first
    prompt token listed with ``None`` logprob and ``None`` top_logprobs (nothing predicts it)."""
    rest, after = completion_logprobs(entries[1:], name, offset + len(name(prompt_ids[0])))
    first = name(prompt_ids[0])
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [offset, *rest["text_offset"]]}, after


def join_completion(a: dict, b: dict) -> dict:
    """Two completions logprobs objects, one after the other (echoed prompt, then output)."""
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
