"""n > 1 at the orchestrator: ctx answers with n choices, their SSE form, the relay's record
(orchestrator.choices, orchestrator.sse, orchestrator.disagg.check_ctx_answer)."""

from __future__ import annotations

import json

import pytest

from orchestrator.choices import ChoicesProgress, all_finished, num_choices
from orchestrator.choices_relay import moved_choices
from orchestrator.disagg import check_ctx_answer
from orchestrator.sse import answer_to_events
from orchestrator.upstream import AttemptFailed


def answer(chat: bool, finishes=("length", "stop")) -> dict:
    choices = []
    for i, finish in enumerate(finishes):
        c = {"index": i, "finish_reason": finish, "logprobs": None}
        if chat:
            c["message"] = {"role": "assistant", "content": f"t{i}"}
        else:
            c["text"] = f"t{i}"
        choices.append(c)
    return {"id": "x", "created": 3, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}


def payloads(events: list[bytes]) -> list:
    return [json.loads(e[6:]) if e != b"data: [DONE]\n\n" else "[DONE]" for e in events]


@pytest.mark.parametrize("chat", [False, True])
def test_a_final_ctx_answer_of_n_choices_becomes_one_index_per_choice(chat):
    docs = payloads(answer_to_events(answer(chat), chat, include_usage=True))
    assert docs[-1] == "[DONE]" and docs[-2]["choices"] == [] and docs[-2]["usage"]["completion_tokens"] == 2
    chunks = [c for d in docs[:-2] for c in d["choices"]]
    texts = {}
    for c in chunks:
        piece = (c["delta"].get("content") or "") if chat else c["text"]
        texts[c["index"]] = texts.get(c["index"], "") + piece
    assert texts == {0: "t0", 1: "t1"}
    assert {c["index"]: c["finish_reason"] for c in chunks if c["finish_reason"]} == {0: "length", 1: "stop"}
    if chat:
        assert [c["index"] for c in chunks if c["delta"].get("role") == "assistant"] == [0, 1]


def test_check_ctx_answer_wants_n_choices_in_index_order():
    check_ctx_answer(answer(False), 2)
    with pytest.raises(AttemptFailed, match="exactly 1"):
        check_ctx_answer(answer(False), 1)
    swapped = answer(False)
    swapped["choices"].reverse()
    with pytest.raises(AttemptFailed, match="indexes"):
        check_ctx_answer(swapped, 2)
    going_on = answer(False, finishes=(None, "stop"))
    with pytest.raises(AttemptFailed, match="ctx_request_id"):
        check_ctx_answer(going_on, 2)  # a choice goes on: choice 0 must carry the ctx params
    going_on["choices"][0]["disaggregated_params"] = {"ctx_request_id": "c"}
    check_ctx_answer(going_on, 2)
    assert not all_finished(going_on) and all_finished(answer(False))


def test_num_choices():
    assert (num_choices({}), num_choices({"n": 1}), num_choices({"n": 4})) == (1, 1, 4)


def test_choices_progress_relays_chunks_and_knows_when_every_choice_ended():
    p = ChoicesProgress.for_body({"n": 2}, chat=False, parser=lambda: None)
    first = p.attempt().absorb({"id": "gen-1", "created": 9, "model": "m",
                                "choices": [{"index": 1, "text": "a", "finish_reason": None}]})
    assert first["choices"][0]["text"] == "a" and p.head["id"] == "gen-1"
    a = p.attempt()
    a.absorb({"id": "other", "created": 10, "model": "m", "choices": [{"index": 1, "text": "", "finish_reason": "stop"}]})
    assert p.finish_reason is None
    out = a.absorb({"id": "other", "created": 10, "model": "m",
                    "choices": [{"index": 0, "text": "b", "finish_reason": "length"}]})
    assert out["id"] == "gen-1" and out["created"] == 9 and p.finish_reason is not None
    assert [c.finish_reason for c in p.choices] == ["length", "stop"] and p.choices[0].text == "b"
    assert a.absorb({"id": "other", "created": 1, "model": "m", "choices": []}) is None
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert a.absorb({"id": "o", "created": 1, "model": "m", "choices": [], "usage": usage})["usage"] == usage
    assert p.final_usage() == usage
    with pytest.raises(ValueError, match="choice index"):
        a.absorb({"id": "o", "created": 1, "model": "m", "choices": [{"index": 2, "text": "x"}]})


def test_a_continued_choice_merges_into_its_index_without_repeats_and_usage_counts_every_choice():
    """The n-choice stream gives choice 1 some text, then breaks; choice 1's continuation (an n = 1
    stream from output token 0, its own id and usage) adds only the text past what the client has,
    re-indexed to 1; its usage-only chunk is dropped, and the request's usage is the prompt once
    plus every choice's tokens."""
    p = ChoicesProgress.for_body({"n": 2}, chat=True, parser=lambda: None)
    p.take_ctx_answer({"id": "ctx", "created": 5, "model": "m", "usage": {"prompt_tokens": 7},
                       "choices": [{"index": 0, "disaggregated_params": {"first_gen_tokens": [10, 20]}},
                                   {"index": 1}]})
    n_stream = p.attempt()
    first = n_stream.absorb({"id": "g", "created": 1, "model": "m", "choices": [
        {"index": 1, "delta": {"role": "assistant", "content": "ab"}, "token_ids": [20, 21], "finish_reason": None}]})
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "ab"} and first["id"] == "ctx"
    n_stream.absorb({"id": "g", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"content": "x"}, "token_ids": [10], "finish_reason": "stop"}]})
    p.continued = True  # the stream broke: choice 1 continues as its own n = 1 stream
    cont = p.choices[1].attempt()
    out = cont.absorb({"id": "other", "created": 2, "model": "m", "choices": [
        {"index": 1, "delta": {"role": "assistant", "content": "abcd"}, "token_ids": [20, 21, 22, 23],
         "finish_reason": "length"}]})
    assert out["choices"][0]["index"] == 1 and out["choices"][0]["delta"] == {"content": "cd"}
    assert out["id"] == "ctx" and p.choices[1].token_ids == [20, 21, 22, 23]
    assert cont.absorb({"id": "other", "created": 2, "model": "m", "choices": [],
                        "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}}) is None
    assert p.finish_reason is not None
    assert p.final_usage() == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    doc = p.answer()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in doc["choices"]] == [
        (0, "x", "stop"), (1, "abcd", "length")]
    assert doc["usage"]["completion_tokens"] == 5


def test_moved_choices_reads_one_lease_per_choice_and_nothing_from_a_hand_back():
    """A drain's moved event for an n > 1 stream: choice index -> its lease's params; a hand-back or
    an entry without a choice index or lease id gives nothing to pull (that choice is prefilled again)."""
    c0 = {"choice_index": 0, "ctx_request_id": "r-c0", "first_gen_tokens": [5, 6], "kv_num_tokens": 9}
    c1 = {"choice_index": 1, "ctx_request_id": "r-c1", "first_gen_tokens": [7, 8], "kv_num_tokens": 9}
    assert moved_choices({"choices": [c1, c0]}) == {0: c0, 1: c1}
    assert moved_choices({"handed_back": True}) == {}
    assert moved_choices({"choices": [{"ctx_request_id": "r-c0"}, {"choice_index": 1}, "x"]}) == {}
