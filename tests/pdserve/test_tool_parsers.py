"""Tool-call and reasoning parsing on text (pdserve.output_parser and its parsers): whole answers,
and the same text fed in every split, whose streamed deltas must join to the whole answer."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.output_parser import OutputParser, ParsedDelta, output_parser
from pdserve.tool_call_body import CallBody
from pdserve.tool_use import ToolUse

AUTO, FORCED = ToolUse("auto"), ToolUse("forced", {"type": "object"})

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'


def parse(text: str, use: ToolUse = AUTO, tools: str = "hermes", reasoning: str = "none") -> dict:
    p = output_parser(use, tools, reasoning)
    assert p is not None
    p.feed(text)
    p.finish()
    return {**p.message(), "finish": p.finish_reason("stop")}


def streamed(text: str, pieces: list[str], use: ToolUse = AUTO, tools: str = "hermes",
             reasoning: str = "none") -> tuple[dict, list[ParsedDelta]]:
    """The message a client rebuilds from the stream's deltas (as an OpenAI client joins them)."""
    assert "".join(pieces) == text
    p = output_parser(use, tools, reasoning)
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    content, thinking, calls = [], [], {}
    for d in deltas:
        content.append(d.content)
        thinking.append(d.reasoning)
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index not in calls, "a call's header came twice"
                calls[c.index] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
            calls[c.index]["function"]["arguments"] += c.arguments
    rebuilt = {"content": "".join(content) or None, "reasoning_content": "".join(thinking) or None,
               "tool_calls": [calls[i] for i in sorted(calls)] or None, "finish": p.finish_reason("stop")}
    return rebuilt, deltas


def splits(text: str, seed: int) -> list[list[str]]:
    """Character by character, and two random cuts into pieces of 1-7 characters."""
    rng = random.Random(seed)
    out = [list(text)]
    for _ in range(2):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out


def without_ids(msg: dict) -> dict:
    calls = [{**c, "id": None} for c in msg["tool_calls"] or []]
    return {**msg, "tool_calls": calls or None}


def test_one_call_with_text_before_it():
    m = parse("Let me check. " + CALL)
    assert m["content"] == "Let me check."
    (call,) = m["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == 29 and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": [1, 2]}
    assert m["finish"] == "tool_calls"


def test_two_calls_and_only_calls_give_null_content():
    m = parse(CALL + "\n" + CALL.replace("get_weather", "get_time") + "\n")
    assert m["content"] is None
    assert [c["function"]["name"] for c in m["tool_calls"]] == ["get_weather", "get_time"]
    assert m["tool_calls"][0]["id"] != m["tool_calls"][1]["id"]


def test_no_call_is_plain_content_and_the_finish_reason_stays():
    text = "Paris is sunny. <b>bold</b> and a < sign\n"
    m = parse(text)
    assert m == {"content": text, "reasoning_content": None, "tool_calls": None, "finish": "stop"}


def test_arguments_before_name_braces_inside_strings_and_escapes():
    body = '{"arguments": {"q": "a } b { \\" c", "n": {"x": [1, {"y": null}]}}, "name": "search"}'
    (call,) = parse(f"<tool_call>{body}</tool_call>")["tool_calls"]
    assert call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"]) == {"q": 'a } b { " c', "n": {"x": [1, {"y": None}]}}


def test_a_call_without_arguments_gets_an_empty_object():
    (call,) = parse('<tool_call>{"name": "now"}</tool_call>')["tool_calls"]
    assert call["function"]["arguments"] == "{}"


def test_a_tag_that_holds_no_call_object_is_content():
    for text in ("<tool_call>not json</tool_call> after", '<tool_call>{"x": 1}</tool_call>', "<tool_call>"):
        m = parse(text)
        assert m["tool_calls"] is None and m["content"] == text and m["finish"] == "stop", text


def test_an_unfinished_call_at_the_end_keeps_what_was_generated():
    p = output_parser(AUTO, "hermes", "none")
    p.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Par')
    p.finish()
    (call,) = p.message()["tool_calls"]
    assert call["function"]["arguments"] == '{"city": "Par'
    assert p.finish_reason("length") == "length"  # cut by max_tokens: not a finished call


@pytest.mark.parametrize("text", [
    "Let me check. " + CALL,
    CALL + "\n\n" + CALL.replace("Paris", "Rome") + " done",
    "no calls at all, just < and <tool text",
    "<tool_call>bad</tool_call>" + CALL,
    '<tool_call>{"arguments": {"a": "</tool_call>"}, "name": "f"}</tool_call>',
])
def test_every_split_streams_to_the_whole_answer(text):
    whole = parse(text)
    for i, pieces in enumerate(splits(text, seed=len(text))):
        rebuilt, _ = streamed(text, pieces)
        assert without_ids(rebuilt) == without_ids(whole), (i, pieces)


def test_a_possible_tag_start_is_held_back_until_decided():
    p = output_parser(AUTO, "hermes", "none")
    assert p.feed("Hi <tool").content == "Hi"  # "<tool" may begin <tool_call>; the space waits too
    d = p.feed("box>")
    assert d.content == " <toolbox>" and not d.tool_calls


def test_the_header_comes_once_the_name_is_complete_then_argument_fragments():
    p = output_parser(AUTO, "hermes", "none")
    assert not p.feed('<tool_call>{"name": "get_wea')  # the name may still change
    d = p.feed('ther", "arguments": {"ci')
    (head,) = d.tool_calls
    assert head.to_openai() == {"index": 0, "id": head.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"ci'}}
    (more,) = p.feed('ty": "Paris"}}</tool_call>').tool_calls
    assert more.to_openai() == {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}


def test_forced_call_is_the_whole_output():
    text = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    m = parse(text, FORCED, tools="none")
    (call,) = m["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert m["content"] is None and m["finish"] == "tool_calls"
    for pieces in splits(text, 3):
        assert without_ids(streamed(text, pieces, FORCED, tools="none")[0]) == without_ids(m)


def test_forced_output_that_is_not_a_call_stays_text():
    m = parse("plain words", FORCED, tools="none")
    assert m["content"] == "plain words" and m["tool_calls"] is None and m["finish"] == "stop"


def test_reasoning_then_content():
    text = "<think>\nThe user wants Paris.\n</think>\n\nParis."
    m = parse(text, ToolUse("none"), reasoning="qwen3")
    assert m["reasoning_content"] == "\nThe user wants Paris.\n" and m["content"] == "Paris."
    for pieces in splits(text, 5):
        assert streamed(text, pieces, ToolUse("none"), reasoning="qwen3")[0] == m


def test_without_a_leading_think_everything_is_content():
    text = "Paris. <think>not reasoning</think>"
    assert parse(text, ToolUse("none"), reasoning="qwen3")["content"] == text


def test_reasoning_then_a_tool_call():
    text = "<think>need the weather</think>\n" + CALL
    m = parse(text, reasoning="qwen3")
    assert m["reasoning_content"] == "need the weather" and m["content"] is None
    assert m["tool_calls"][0]["function"]["name"] == "get_weather"
    for pieces in splits(text, 7):
        assert without_ids(streamed(text, pieces, reasoning="qwen3")[0]) == without_ids(m)


def test_unterminated_reasoning_is_all_reasoning():
    m = parse("<think>still thinking", ToolUse("none"), reasoning="qwen3")
    assert m["reasoning_content"] == "still thinking" and m["content"] is None


def test_no_parser_when_nothing_to_parse():
    assert output_parser(ToolUse("none"), "hermes", "none") is None
    assert output_parser(AUTO, "none", "none") is None  # auto without a parser: text stays content
    assert isinstance(output_parser(FORCED, "none", "none"), OutputParser)


def test_call_body_scanner_positions():
    b = CallBody()
    b.feed('  {"name": "f", "arguments": {"a": [1]} }  tail')
    assert b.name == "f" and b.args_text == '{"a": [1]}' and b.text[b.closed_at - 1] == "}"
    bad = CallBody()
    bad.feed('["name"]')
    assert bad.invalid
