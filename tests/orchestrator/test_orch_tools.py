"""Tool calls and reasoning through the orchestrator with the official openai client (fake servers
that stream a scripted raw text): the orchestrator parses the text it assembles, stream and not,
across a migration and under generation_first; requests are validated before any server sees them."""

from __future__ import annotations

import json

import openai
import pytest

from orch_fakes import MODEL
from orchestrator.sse import answer_to_events
from tests.chat_stream import rebuild_chat_stream

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL_TOKENS = ["I will", " check.", " <tool", '_call>\n{"name": "get_', 'weather", "argu', 'ments": {"city": ',
               '"Paris"}}\n</tool', "_call>"]
THINK_TOKENS = ["<think>", "The capital", "?</thi", "nk>\n\n", "Paris", "."]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def scripted(cluster, tokens: list[str]) -> None:
    for node in cluster.ctx + cluster.gen:
        node.behavior.tokens, node.behavior.finish_reason = tokens, "stop"


@pytest.fixture
def hermes(make_cluster):
    def factory(tokens=CALL_TOKENS, **kw):
        c = make_cluster(model={"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}, **kw)
        scripted(c, tokens)
        return c, openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    return factory


def ask(client, tokens=CALL_TOKENS, **kw):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=len(tokens), **kw)


def rebuilt(chunks) -> dict:
    """The message an OpenAI client builds from a stream's deltas (calls joined by index)."""
    return rebuild_chat_stream(chunks)


def whole(r) -> dict:
    m = r.choices[0].message
    return {"content": m.content, "reasoning": getattr(m, "reasoning_content", None),
            "calls": [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []],
            "finish": r.choices[0].finish_reason}


def test_auto_call_is_parsed_from_the_assembled_text(hermes):
    c, client = hermes()
    r = ask(client, tools=[WEATHER])
    m = r.choices[0].message
    assert m.content == "I will check." and r.choices[0].finish_reason == "tool_calls"
    (call,) = m.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    gen_params = c.gen[0].record.bodies[0]["disaggregated_params"]
    assert gen_params["raw_output"] is True  # the gen server streams raw text, the relay parses it
    assert "raw_output" not in c.ctx[0].record.bodies[0]["disaggregated_params"]
    assert c.gen[0].record.bodies[0]["tools"] == [WEATHER]  # tools reach the servers' templates


def test_stream_deltas_reassemble_to_the_non_stream_answer(hermes):
    _, client = hermes()
    chunks = list(ask(client, tools=[WEATHER], stream=True))
    assert rebuilt(chunks) == whole(ask(client, tools=[WEATHER]))
    assert not any("<tool" in (ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
    heads = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or []) if tc.id]
    assert len(heads) == 1 and heads[0].function.name == "get_weather" and heads[0].type == "function"
    assert len({ch.id for ch in chunks}) == 1


def test_a_migration_in_the_middle_of_a_call_gives_the_same_call(hermes):
    _, client = hermes()
    want = rebuilt(ask(client, tools=[WEATHER], stream=True))
    c, client = hermes(n_gen=2)
    for g in c.gen:  # each gen server's first stream breaks inside the call's JSON
        g.behavior.break_after_chunks, g.behavior.break_times = 5, 1
    got = rebuilt(ask(client, tools=[WEATHER], stream=True))
    assert got == want and len(got["calls"]) == 1
    assert sum(g.record.aborted_streams for g in c.gen) >= 1


def test_generation_first_stream_is_parsed_too(hermes):
    c, client = hermes(schedule_style="generation_first")
    got = rebuilt(ask(client, tools=[WEATHER], stream=True))
    assert got["calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert got["finish"] == "tool_calls"
    assert c.gen[0].record.bodies[0]["disaggregated_params"]["raw_output"] is True


def test_reasoning_content(hermes):
    _, client = hermes(THINK_TOKENS)
    r = ask(client, THINK_TOKENS)
    assert r.choices[0].message.reasoning_content == "The capital?" and r.choices[0].message.content == "Paris."
    assert r.choices[0].finish_reason == "stop"
    assert rebuilt(list(ask(client, THINK_TOKENS, stream=True))) == whole(r)


def test_tool_choice_none_leaves_the_text_alone(hermes):
    c, client = hermes()
    r = ask(client, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == "".join(CALL_TOKENS) and not r.choices[0].message.tool_calls


def test_without_parsers_nothing_changes(make_cluster):
    c = make_cluster()
    scripted(c, CALL_TOKENS)
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    r = ask(client, tools=[WEATHER])  # model.tool_call_parser: none (the default)
    assert r.choices[0].message.content == "".join(CALL_TOKENS) and r.choices[0].finish_reason == "stop"
    assert "raw_output" not in c.gen[0].record.bodies[0]["disaggregated_params"]


@pytest.mark.parametrize("kw,error,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     openai.BadRequestError, "tool_choice"),
    ({"tool_choice": "required"}, openai.BadRequestError, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": {"a": {"type": 5}}}}}]},
     openai.BadRequestError, "tools.0.function.parameters"),
    ({"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}}, openai.BadRequestError,
     "chat_template_kwargs"),
    ({"extra_body": {"chat_template_kwargs": "enable_thinking"}}, openai.UnprocessableEntityError, None),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, openai.UnprocessableEntityError, None),
])
def test_bad_tool_requests_are_refused_before_any_server(hermes, kw, error, param):
    c, client = hermes()
    with pytest.raises(error) as exc:
        ask(client, **kw)
    if param is not None:
        assert exc.value.param == param
    assert c.ctx[0].record.bodies == []


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": None}],
    [{"role": "tool", "content": "sunny"}],  # no tool_call_id
    [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
])
def test_malformed_history_is_a_422(hermes, messages):
    _, client = hermes()
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)


def test_history_with_calls_and_tool_messages_is_accepted_and_forwarded(hermes):
    c, client = hermes()
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=len(CALL_TOKENS))
    assert c.ctx[0].record.bodies[0]["messages"] == history


def test_a_final_answer_with_calls_becomes_stream_events():
    answer = {"id": "x", "created": 1, "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning_content": "why", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}
    first = json.loads(answer_to_events(answer, chat=True, include_usage=False)[0][len(b"data: "):])
    delta = first["choices"][0]["delta"]
    assert delta["tool_calls"] == [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "f", "arguments": "{}"}}]
    assert delta["reasoning_content"] == "why" and delta["content"] is None and delta["role"] == "assistant"
