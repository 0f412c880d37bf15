"""What tools + tool_choice ask (pdserve.tool_use) and the chat template's inputs (pdserve.chat_template)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.chat_template import hf_messages, template_tools
from pdserve.tool_use import ToolError, call_schema, check_template_kwargs, tool_use

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": None}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_modes():
    assert tool_use(None, None).mode == "none"
    assert tool_use([WEATHER], None).mode == "auto"
    assert tool_use([WEATHER], "auto").mode == "auto"
    assert tool_use([WEATHER], "none").mode == "none"
    assert tool_use([WEATHER, TIME], "required").mode == "forced"
    assert tool_use([WEATHER, TIME], named("get_time")).mode == "forced"


def test_named_choice_schema_fixes_the_name_and_takes_the_parameters():
    schema = tool_use([WEATHER, TIME], named("get_weather")).schema
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    for bad in ({"name": "get_time", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {}},
                {"name": "get_weather", "arguments": {"city": 3}}, {"name": "get_weather"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_accepts_a_call_of_any_tool_and_no_other():
    schema = tool_use([WEATHER, TIME], "required").schema
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Rome"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "other", "arguments": {}}, schema)
    assert tool_use([WEATHER], "required").schema == call_schema(WEATHER["function"])


@pytest.mark.parametrize("tools,choice,param", [
    ([WEATHER], named("nope"), "tool_choice"),
    (None, "required", "tool_choice"),
    (None, named("get_weather"), "tool_choice"),
    ([WEATHER, WEATHER], "auto", "tools.1.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                     "properties": {"a": {"type": "strang"}}}}}],
     "auto", "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "auto",
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}], "auto",
     "tools.0.function.parameters"),
])
def test_refused_with_the_field_named(tools, choice, param):
    with pytest.raises(ToolError) as err:
        tool_use(tools, choice)
    assert err.value.param == param


def test_template_kwargs_may_not_replace_what_the_server_sets():
    check_template_kwargs({"enable_thinking": False})
    with pytest.raises(ToolError, match="tools"):
        check_template_kwargs({"tools": []})


def test_history_in_hf_shape():
    msgs = hf_messages([
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    assert msgs[0] == {"role": "user", "content": "Weather in Paris?"}
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_arguments_that_are_not_json_are_refused():
    with pytest.raises(ValueError, match=r"messages.0.tool_calls.0.function.arguments"):
        hf_messages([{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])


def test_template_tools_leave_unset_fields_out():
    assert template_tools([TIME]) == [{"type": "function", "function": {"name": "get_time"}}]
    assert json.loads(json.dumps(template_tools([WEATHER]))) == [WEATHER]
