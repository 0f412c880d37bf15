"""The prefix-cache workloads of pdbench without a model: seeded generators (system-prompt,
multiturn conversations), the history each turn sends, and the multiturn runner against an
in-process fake OpenAI server (httpx.MockTransport) that answers from what it was sent."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from pdbench.client import RequestOptions
from pdbench.conversations import ConversationSpec, make_conversations, transcript, turn_messages, turn_sample
from pdbench.datasets import WorkloadSpec, make_workload
from pdbench.metrics import RequestRecord, per_turn_summary
from pdbench.multiturn import EARLIER_TURN_FAILED, run_conversations
from pdbench.runner import RunSettings


def test_system_prompt_ids_share_exactly_the_prefix():
    spec = WorkloadSpec(name="system-prompt", num_prompts=6, prefix_len=180, input_len=20, num_prefixes=1,
                        vocab_size=49152, seed=4)
    samples = make_workload(spec)
    head = samples[0].prompt[:180]
    for s in samples:
        assert len(s.prompt) == s.prompt_len == 200 and s.prompt[:180] == head and s.messages is None
    assert len({tuple(s.prompt[180:]) for s in samples}) == 6          # every suffix its own
    assert make_workload(spec) == samples                               # seeded
    assert make_workload(WorkloadSpec(**{**spec.__dict__, "seed": 5})) != samples


def test_system_prompt_text_is_a_system_message_on_chat():
    spec = WorkloadSpec(name="system-prompt", num_prompts=4, prefix_len=30, input_len=5, num_prefixes=2,
                        prompt_format="text")
    samples = make_workload(spec)
    systems = [s.messages[0]["content"] for s in samples]
    assert [m["role"] for m in samples[0].messages] == ["system", "user"]
    assert systems[0] == systems[2] != systems[1] == systems[3]        # two prefixes, round robin
    assert len(systems[0].split()) == 30
    for s in samples:  # completions gets the same text: system, then user
        assert s.prompt == s.messages[0]["content"] + " " + s.messages[1]["content"]
        assert len(s.messages[1]["content"].split()) == 5


def test_shuffled_prefix_order_takes_every_prefix_once_per_round():
    spec = WorkloadSpec(name="prefix", num_prompts=20, prefix_len=8, input_len=2, num_prefixes=4,
                        prefix_order="shuffle", seed=3)
    samples = make_workload(spec)
    heads = [tuple(s.prompt[:8]) for s in samples]
    index = {h: i for i, h in enumerate(dict.fromkeys(heads))}
    order = [index[h] for h in heads]
    assert len(index) == 4
    for r in range(5):
        assert sorted(order[4 * r:4 * r + 4]) == [0, 1, 2, 3]
    assert order != [i % 4 for i in range(20)]                          # not the cycle
    cycle = make_workload(WorkloadSpec(**{**spec.__dict__, "prefix_order": "cycle"}))
    assert [tuple(s.prompt[:8]) for s in cycle][:4] == list(dict.fromkeys(tuple(s.prompt[:8]) for s in cycle))


def test_system_prompt_needs_a_prefix():
    with pytest.raises(ValueError, match="prefix_len"):
        make_workload(WorkloadSpec(name="system-prompt", prefix_len=0))


def test_conversations_are_seeded_and_independent_of_their_number():
    spec = ConversationSpec(num_conversations=3, num_turns=5, user_len=50, output_len=32, seed=1)
    convs = make_conversations(spec)
    assert [len(c.user_messages) for c in convs] == [5, 5, 5]
    assert make_conversations(spec) == convs
    more = make_conversations(ConversationSpec(**{**spec.__dict__, "num_conversations": 6}))
    assert more[:3] == convs                                            # conversation i does not depend on N
    assert make_conversations(ConversationSpec(**{**spec.__dict__, "seed": 2}))[0] != convs[0]
    words = [len(m.split()) for c in convs for m in c.user_messages]
    assert all(50 <= w <= 55 for w in words)                             # ~50 words + "Conversation i turn t:"
    assert len({m for c in convs for m in c.user_messages}) == 15       # no two user messages alike
    assert all(c.system == "" for c in convs)


def test_shared_system_prompt_opens_every_conversation():
    convs = make_conversations(ConversationSpec(num_conversations=2, num_turns=2, system_len=40))
    first = [turn_messages(c, [])[0] for c in convs]
    assert first[0] == first[1] and first[0]["role"] == "system" and len(first[0]["content"].split()) == 40


def test_each_turn_sends_the_history_with_the_given_answers():
    conv = make_conversations(ConversationSpec(num_conversations=1, num_turns=3))[0]
    answers = ["first answer", "second answer"]
    msgs = turn_messages(conv, answers)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in msgs] == [conv.user_messages[0], answers[0], conv.user_messages[1], answers[1],
                                            conv.user_messages[2]]
    for k in range(1, 3):  # turn k's request (plus its answer) is the start of turn k+1's
        before = turn_messages(conv, answers[:k - 1]) + [{"role": "assistant", "content": answers[k - 1]}]
        assert turn_messages(conv, answers[:k])[:len(before)] == before
        assert transcript(turn_messages(conv, answers[:k])).startswith(transcript(turn_messages(conv, answers[:k - 1])))
    with pytest.raises(ValueError, match="3 turns"):
        turn_messages(conv, ["a", "b", "c"])
    s = turn_sample(conv, answers[:1])
    assert s.messages == turn_messages(conv, answers[:1]) and s.output_len == conv.output_len
    assert s.prompt.endswith("\nAssistant:") and "Assistant: first answer\nUser: " in s.prompt


def test_conversation_spec_checks():
    for bad in ({"num_turns": 0}, {"num_conversations": 0}, {"user_len": 0}, {"output_len": 0},
                {"system_len": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_conversations(ConversationSpec(**bad))


def test_per_turn_summary():
    def rec(start, first, prompt, cached):
        return RequestRecord(ok=True, start=start, chunk_times=[first, first + 0.1], prompt_tokens=prompt,
                             output_tokens=2, cached_tokens=cached)

    convs = [[rec(0.0, 0.5, 100, 0), rec(1.0, 1.2, 200, 96)],
             [rec(0.0, 0.7, 100, 0), RequestRecord(ok=False, error="HTTP 503: busy")]]
    t1, t2 = per_turn_summary(convs, (50.0, 90.0))
    assert (t1["turn"], t1["completed"], t1["failed"], t1["prefix_hit_rate"]) == (1, 2, 0, 0.0)
    assert math.isclose(t1["ttft_ms"]["median"], 600.0) and math.isclose(t1["mean_prompt_tokens"], 100.0)
    assert (t2["completed"], t2["failed"]) == (1, 1)
    assert math.isclose(t2["prefix_hit_rate"], 96 / 200) and math.isclose(t2["ttft_ms"]["median"], 200.0)


class FakeChatServer:
    """Streams ``answer <n>`` for the n-th request it receives and reports as cached the prompt
    tokens (one per word) of the longest request it saw before that this one starts with."""

    def __init__(self, fail_on: set[int] = frozenset(), delay_s: float = 0.0) -> None:
        self.bodies: list[dict] = []
        self.fail_on, self.delay_s = fail_on, delay_s
        self.seen: list[list[dict]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        n = len(self.bodies)
        self.bodies.append(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if n in self.fail_on:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        msgs = body["messages"]
        words = sum(len(m["content"].split()) for m in msgs)
        cached = max((sum(len(m["content"].split()) for m in s) for s in self.seen if msgs[:len(s)] == s), default=0)
        self.seen.append(msgs)
        usage = {"prompt_tokens": words, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": cached}}
        events = [{"choices": [{"delta": {"content": "answer "}}]}, {"choices": [{"delta": {"content": str(n)}}]},
                  {"choices": [], "usage": usage}]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})


def run_fake(server: FakeChatServer, spec: ConversationSpec, **settings):
    async def go():
        transport = httpx.MockTransport(server)
        async with httpx.AsyncClient(transport=transport) as client:
            opts = RequestOptions(base_url="http://fake", model="m", endpoint="chat")
            return await run_conversations(client, make_conversations(spec), opts,
                                           RunSettings(progress=False, **settings))

    return asyncio.run(go())


def test_runner_sends_the_answers_back_in_order():
    server = FakeChatServer()
    by_conv, duration = run_fake(server, ConversationSpec(num_conversations=3, num_turns=4, user_len=5),
                                 max_concurrency=2)
    assert duration > 0 and [len(c) for c in by_conv] == [4, 4, 4] and all(r.ok for c in by_conv for r in c)
    for conv in by_conv:
        for prev, nxt in zip(conv, conv[1:]):
            assert nxt.prompt_tokens > prev.prompt_tokens and nxt.cached_tokens == prev.prompt_tokens
    for body in server.bodies:  # every assistant message it got is an answer it gave before
        given = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        assert all(a.startswith("answer ") and int(a.split()[1]) < server.bodies.index(body) for a in given)
    assert sorted(len(b["messages"]) for b in server.bodies) == [1, 1, 1, 3, 3, 3, 5, 5, 5, 7, 7, 7]


def test_a_failed_turn_ends_its_conversation():
    server = FakeChatServer(fail_on={1})
    by_conv, _ = run_fake(server, ConversationSpec(num_conversations=1, num_turns=4, user_len=3))
    recs = by_conv[0]
    assert [r.ok for r in recs] == [True, False, False, False] and len(server.bodies) == 2
    assert "503" in recs[1].error and recs[2].error == recs[3].error == EARLIER_TURN_FAILED


def test_max_duration_cuts_the_run():
    server = FakeChatServer(delay_s=0.3)
    by_conv, duration = run_fake(server, ConversationSpec(num_conversations=2, num_turns=10, user_len=3),
                                 max_duration_s=1.0)
    assert duration < 3.0
    done = [r.ok for c in by_conv for r in c]
    assert len(done) == 20 and 2 <= sum(done) < 20
    assert all("max-duration" in r.error for c in by_conv for r in c if not r.ok)
