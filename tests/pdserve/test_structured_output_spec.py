"""The structured-output request fields → one StructuredOutputSpec (pdserve.structured_output)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.structured_output import StructuredOutputSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def completion(**kw) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="hi", **kw)


@pytest.mark.parametrize("make", [chat, completion], ids=["chat", "completions"])
@pytest.mark.parametrize("fields, want", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutputSpec(kind="json_schema", json_schema=SCHEMA)),
    ({"response_format": {"type": "json_object"}}, StructuredOutputSpec(kind="json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, StructuredOutputSpec(kind="json_object")),
    ({"guided_json": SCHEMA}, StructuredOutputSpec(kind="json_schema", json_schema=SCHEMA)),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'},
     StructuredOutputSpec(kind="json_schema", json_schema=SCHEMA)),
    ({"guided_regex": "[0-9]+"}, StructuredOutputSpec(kind="regex", regex="[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputSpec(kind="choice", choices=("yes", "no"))),
    ({"guided_grammar": 'start: "a"+'}, StructuredOutputSpec(kind="grammar", grammar='start: "a"+')),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputSpec(kind="json_schema", json_schema=SCHEMA)),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutputSpec(kind="choice", choices=("x",))),
    ({"structured_outputs": {"regex": "a|b"}}, StructuredOutputSpec(kind="regex", regex="a|b")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputSpec(kind="json_object")),
    ({"response_format": {"type": "text"}}, None),
    ({}, None),
])
def test_each_form_gives_its_spec(make, fields, want):
    assert make(**fields).structured_output_spec() == want


@pytest.mark.parametrize("fields, match", [
    ({"guided_choice": ["a"], "guided_regex": "a"}, "one structured-output constraint per request"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "response_format, guided_json"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs.regex"),
    ({"guided_choice": []}, "at least 1"),
    ({"guided_json": "[1, 2]"}, "must be a JSON Schema object"),
    ({"guided_json": "{not json"}, "is not valid JSON"),
    ({"response_format": {"type": "json_schema"}}, "json_schema goes with"),
    ({"response_format": {"type": "text", "json_schema": {"name": "n"}}}, "json_schema goes with"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}}, "pattern"),
    ({"response_format": {"type": "xml"}}, "type"),
])
def test_malformed_or_conflicting_fields_are_refused(fields, match):
    with pytest.raises(ValidationError, match=match):
        chat(**fields)


@pytest.mark.parametrize("fields, field", [({"guided_choice": []}, "guided_choice"), ({"guided_regex": ""}, "guided_regex"),
                                           ({"structured_outputs": {"choice": []}}, "structured_outputs")])
def test_an_empty_payload_names_its_field_without_pydantic_internals(fields, field):
    with pytest.raises(ValidationError) as exc:
        chat(**fields)
    message = str(exc.value.errors()[0]["msg"])
    assert f"{field}: " in message and "pydantic" not in message and "input_value" not in message, message


def test_spec_payload_must_match_its_kind():
    with pytest.raises(ValidationError, match="needs regex"):
        StructuredOutputSpec(kind="regex")
    with pytest.raises(ValidationError, match="takes no json_schema"):
        StructuredOutputSpec(kind="choice", choices=("a",), json_schema=SCHEMA)
    with pytest.raises(ValidationError, match="takes no regex"):
        StructuredOutputSpec(kind="json_object", regex="a")


def test_key_is_canonical():
    a = StructuredOutputSpec(kind="json_schema", json_schema={"type": "object", "required": ["x"]})
    b = StructuredOutputSpec(kind="json_schema", json_schema={"required": ["x"], "type": "object"})
    c = StructuredOutputSpec(kind="json_schema", json_schema={"type": "object"})
    assert a.key() == b.key() != c.key()
    assert StructuredOutputSpec(kind="choice", choices=("a", "b")).key() != \
        StructuredOutputSpec(kind="choice", choices=("b", "a")).key()


def test_spec_survives_the_wire():
    """The orchestrator forwards the body as a dict; the server parses the same spec back."""
    body = chat(guided_choice=["yes", "no"]).model_dump(exclude_none=True, by_alias=True)
    assert chat(**{k: v for k, v in body.items() if k not in ("model", "messages")}).structured_output_spec() == \
        StructuredOutputSpec(kind="choice", choices=("yes", "no"))
