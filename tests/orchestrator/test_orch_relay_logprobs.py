"""Logprobs and per-chunk usage through the relay: each position once, the echoed prompt once,
a migrated stream continuing without duplicates (orchestrator.progress, orchestrator.relay_logprobs)."""

from __future__ import annotations

import pytest

from orchestrator.progress import Progress

PROMPT = [3, 4, 5]


def name(t: int) -> str:
    return f"token_id:{t}"


def comp_lp(ids: list[int], prompt: list[int] | None = None) -> dict:
    """A completions logprobs object as a server writes it (logprob of token t = -t/10); the
    offsets are deliberately wrong (0): the relay must compute its own."""
    toks = ([name(t) for t in prompt] if prompt else []) + [name(t) for t in ids]
    vals = ([None] + [-t / 10 for t in prompt[1:]] if prompt else []) + [-t / 10 for t in ids]
    tops = ([None] + [{name(t): -t / 10} for t in prompt[1:]] if prompt else []) + [{name(t): -t / 10} for t in ids]
    return {"tokens": toks, "token_logprobs": vals, "top_logprobs": tops, "text_offset": [0] * len(toks)}


def chat_lp(ids: list[int]) -> dict:
    return {"content": [{"token": name(t), "logprob": -t / 10, "bytes": [], "top_logprobs": []} for t in ids],
            "refusal": None}


def ctx_answer(chat: bool, first: int, lp: dict, text: str) -> dict:
    choice = {"index": 0, "finish_reason": None, "logprobs": lp,
              "disaggregated_params": {"first_gen_tokens": [first], "cached_tokens": 2}}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return {"id": "c", "created": 1, "model": "m", "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def chunk(chat: bool, text: str, ids: list[int], lp: dict | None, usage: dict | None = None, finish=None) -> dict:
    choice = {"index": 0, "finish_reason": finish, "token_ids": ids, "logprobs": lp}
    choice.update({"delta": {"role": None, "content": text}} if chat else {"text": text})
    return {"id": "g", "created": 2, "model": "m", "choices": [choice], "usage": usage}


def tokens(lp: dict | None, chat: bool) -> list[str]:
    if lp is None:
        return []
    return [e["token"] for e in lp["content"]] if chat else lp["tokens"]


def texts(ids: list[int]) -> str:
    return "".join(name(t) for t in ids)


def test_echo_prompt_and_first_token_sent_once_with_offsets_over_the_whole_text():
    p = Progress.for_body({"echo": True, "logprobs": 1}, chat=False)
    echo = texts(PROMPT)
    p.take_ctx_answer(ctx_answer(False, 7, comp_lp([7], PROMPT), echo + name(7)))
    head = p.first_chunk(p.text)["choices"][0]["logprobs"]
    assert head["tokens"] == [name(t) for t in PROMPT + [7]] and head["token_logprobs"][0] is None
    a = p.attempt()
    # The gen stream starts at token 0 again: echoed prompt + the ctx's token, then the next one.
    out = a.absorb(chunk(False, echo + name(7) + name(8), [7, 8], comp_lp([7, 8], PROMPT)))
    assert out["choices"][0]["text"] == name(8) and out["choices"][0]["logprobs"]["tokens"] == [name(8)]
    a.absorb(chunk(False, name(9), [9], comp_lp([9]), finish="length"))
    lp = p.answer()["choices"][0]["logprobs"]
    assert lp["tokens"] == [name(t) for t in PROMPT + [7, 8, 9]]
    assert lp["token_logprobs"] == [None, -0.4, -0.5, -0.7, -0.8, -0.9]
    full = p.text
    assert [full[o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]


@pytest.mark.parametrize("chat", [True, False])
def test_a_migrated_stream_continues_the_logprobs_without_duplicates(chat):
    mk = chat_lp if chat else comp_lp
    p = Progress.for_body({"logprobs": True} if chat else {"logprobs": 0}, chat)
    p.take_ctx_answer(ctx_answer(chat, 7, mk([7]), name(7)))
    got = [tokens(p.first_logprobs, chat)]
    a = p.attempt()
    for c in (chunk(chat, name(7) + name(8), [7, 8], mk([7, 8])), chunk(chat, name(9), [9], mk([9]))):
        got.append(tokens(a.absorb(c)["choices"][0]["logprobs"], chat))
    # The gen server died; the target gets first_gen_tokens [7, 8, 9] and only token 7's logprob.
    b = p.attempt()
    assert b.absorb(chunk(chat, texts([7, 8, 9]), [7, 8, 9], mk([7]))) is None  # nothing new
    for c in (chunk(chat, name(10), [10], mk([10])), chunk(chat, name(11), [11], mk([11]), finish="length")):
        got.append(tokens(b.absorb(c)["choices"][0]["logprobs"], chat))
    flat = [t for part in got for t in part]
    assert flat == [name(t) for t in (7, 8, 9, 10, 11)]
    assert tokens(p.answer()["choices"][0]["logprobs"], chat) == flat


def test_held_back_text_still_carries_its_tokens_logprobs():
    p = Progress.for_body({"stop": ["xy"], "logprobs": 0}, chat=False)
    p.take_ctx_answer(ctx_answer(False, 7, comp_lp([7]), "a"))
    a = p.attempt()
    out = a.absorb(chunk(False, "a", [7, 8], comp_lp([7, 8])))  # token 8's text "x" is held back
    assert out is not None and out["choices"][0]["text"] == "" and out["choices"][0]["logprobs"]["tokens"] == [name(8)]


def test_no_logprobs_asked_means_none_in_the_answer():
    p = Progress.for_body({}, chat=False)
    p.take_ctx_answer(ctx_answer(False, 7, None, "a"))
    p.attempt().absorb(chunk(False, "ab", [7, 8], None, finish="length"))
    assert p.answer()["choices"][0]["logprobs"] is None and p.first_logprobs is None


def test_continuous_usage_on_the_first_chunk_and_every_gen_chunk():
    p = Progress.for_body({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, chat=False)
    p.take_ctx_answer(ctx_answer(False, 7, None, "a"))
    assert p.first_chunk("a")["usage"]["completion_tokens"] == 1
    gen_usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                 "prompt_tokens_details": {"cached_tokens": 0}}  # a re-prefill's own hit
    out = p.attempt().absorb(chunk(False, "ab", [7, 8], None, usage=gen_usage))
    assert out["usage"]["completion_tokens"] == 2
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 2  # the first ctx server's hit
    plain = Progress.for_body({}, chat=False)
    plain.take_ctx_answer(ctx_answer(False, 7, None, "a"))
    assert plain.first_chunk("a")["usage"] is None  # negative control: only when asked
