"""Merging gen streams into what the client has: no text twice, none missing (orchestrator.progress)."""

from __future__ import annotations

import pytest

from orchestrator.progress import Progress, held_back_len
from orchestrator.sse import EventSplitter


def ctx_answer(text: str, chat: bool, first=(7,), cached: int = 2) -> dict:
    choice = {"index": 0, "finish_reason": None,
              "disaggregated_params": {"first_gen_tokens": list(first), "cached_tokens": cached}}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": "cmpl-ctx", "created": 5, "model": "m", "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def gen_chunk(text: str, chat: bool, ids=None, finish=None, role=False) -> dict:
    choice: dict = {"index": 0, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = list(ids)
    if chat:
        choice["delta"] = {"role": "assistant" if role else None, "content": text}
    else:
        choice["text"] = text
    return {"id": "cmpl-gen", "created": 9, "model": "m", "choices": [choice]}


def sent(out: dict | None, chat: bool) -> str:
    if out is None:
        return ""
    c = out["choices"][0]
    return c["delta"]["content"] if chat else c["text"]


@pytest.mark.parametrize("chat", [True, False])
def test_gen_stream_repeating_the_first_token_is_cut_to_the_new_text(chat):
    p = Progress.for_body({}, chat)
    assert p.take_ctx_answer(ctx_answer("Hello", chat)) == "Hello"
    a = p.attempt()
    # The gen server's first chunk holds the first token again, plus the next one.
    out = a.absorb(gen_chunk("Hello,", chat, ids=[7, 8], role=True))
    assert sent(out, chat) == ","
    assert out["id"] == "cmpl-ctx" and out["created"] == 5 and "token_ids" not in out["choices"][0]
    if chat:
        assert "role" not in out["choices"][0]["delta"]  # the client had role with the first chunk
    assert sent(a.absorb(gen_chunk(" world", chat, ids=[9])), chat) == " world"
    assert p.text == "Hello, world" and p.token_ids == [7, 8, 9]


def test_a_held_back_stop_prefix_is_not_sent_at_once_and_comes_later():
    p = Progress.for_body({"stop": ["lo!"]}, chat=False)
    assert p.take_ctx_answer(ctx_answer("Hello", False)) == "Hel"  # "lo" may begin "lo!"
    a = p.attempt()
    assert sent(a.absorb(gen_chunk("Hel", False, ids=[7])), False) == ""  # the gen server held "lo" back too
    assert a.absorb(gen_chunk("", False, ids=[8])) is None                 # held-back text, no news
    assert sent(a.absorb(gen_chunk("lo, you", False, ids=[9])), False) == "lo, you"
    assert p.text == "Hello, you"


def test_held_back_len_is_the_longest_stop_prefix_suffix():
    assert held_back_len("abcab", ["abd", "cabx"]) == 3
    assert held_back_len("abc", ["x"]) == 0
    assert held_back_len("xa", ["ab"]) == 1
    assert held_back_len("ab", ["ab"]) == 0  # only proper prefixes: a whole stop string ends the request


def test_a_migration_target_restarting_at_token_0_adds_only_the_missing_text():
    p = Progress.for_body({}, chat=True)
    p.take_ctx_answer(ctx_answer("A", True, first=[1]))
    first = p.attempt()
    for piece, tid in (("A", 1), ("B", 2), ("", 3), ("CD", 4)):  # token 3 was held back (partial UTF-8)
        first.absorb(gen_chunk(piece, True, ids=[tid]))
    assert p.text == "ABCD" and p.token_ids == [1, 2, 3, 4]
    target = p.attempt()  # got first_gen_tokens [1, 2, 3, 4]; streams their text again, then more
    assert sent(target.absorb(gen_chunk("ABC", True, ids=[1, 2, 3, 4])), True) == ""
    assert p.token_ids == [1, 2, 3, 4]
    assert sent(target.absorb(gen_chunk("DE", True, ids=[5])), True) == "E"
    out = target.absorb(gen_chunk("", True, ids=[], finish="length"))
    assert out["choices"][0]["finish_reason"] == "length" and p.finish_reason == "length"
    assert p.text == "ABCDE" and p.token_ids == [1, 2, 3, 4, 5]


def test_usage_keeps_the_first_ctx_servers_cache_hit_and_the_answer_is_assembled():
    p = Progress.for_body({}, chat=True)
    p.take_ctx_answer(ctx_answer("Hi", True, cached=2))
    a = p.attempt()
    a.absorb(gen_chunk("Hi!", True, ids=[7, 8], finish="stop"))
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 3}}  # a re-prefill's own hit
    out = a.absorb({"id": "x", "created": 1, "model": "m", "choices": [], "usage": usage})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 and out["id"] == "cmpl-ctx"
    answer = p.answer()
    assert answer["object"] == "chat.completion" and answer["id"] == "cmpl-ctx"
    assert answer["choices"][0]["message"]["content"] == "Hi!"
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 2 and "disaggregated_params" not in answer["choices"][0]


def test_event_splitter_joins_events_cut_anywhere():
    raw = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(raw)):
        s = EventSplitter()
        events = s.feed(raw[:cut]) + s.feed(raw[cut:])
        assert events == [b'{"a":1}', b'{"b":2}', b"[DONE]"], cut
        assert not s.pending
    s = EventSplitter()
    assert s.feed(b'data: {"a"') == [] and s.pending


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("logprobs", [None, {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                                                           "top_logprobs": []}], "refusal": None}])
def test_the_first_chunk_is_what_the_pydantic_model_dumps(chat, logprobs):
    from pdserve.protocol import (ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChunk,
                                  CompletionChunkChoice)

    p = Progress.for_body({"prompt": "x"}, chat)
    answer = ctx_answer("Hi", chat)
    answer["choices"][0]["logprobs"] = logprobs if chat else None
    text = p.take_ctx_answer(answer)
    head = {"id": "cmpl-ctx", "created": 5, "model": "m"}
    if chat:
        expected = ChatCompletionChunk(**head, choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=text),
                                                                        logprobs=p.first_logprobs)])
    else:
        expected = CompletionChunk(**head, choices=[CompletionChunkChoice(text=text, logprobs=p.first_logprobs)])
    from orchestrator import jsonio

    assert jsonio.dumps(p.first_chunk(text)) == jsonio.dumps(expected.model_dump(mode="json"))  # key order too
    assert p.first_chunk(text) is not p.first_chunk(text)  # a fresh dict each time (the template is shared)
