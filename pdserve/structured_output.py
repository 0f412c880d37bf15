"""Structured output: the request fields that ask for it and the one spec the engine receives.

A client asks for structured output in one of these forms (each is one request field):

- OpenAI's ``response_format``: ``{"type": "text"}`` (no-op), ``{"type": "json_object"}`` (any
  JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
  (https://platform.openai.com/docs/api-reference/chat/create#chat-create-response_format);
- vLLM's extension fields ``guided_json`` (a schema, as an object or a JSON string),
  ``guided_regex``, ``guided_choice`` (a list of strings), ``guided_grammar`` (a Lark grammar);
- vLLM's newer ``structured_outputs: {json | regex | choice | grammar | json_object}``.

:func:`spec_of` turns whichever one a body carries into a :class:`StructuredOutputSpec`, which
travels in ``engine.sampling_params.SamplingParams.structured_output`` to the engine; the engine
compiles it (``engine.structured_output``) into a token mask. Another feature that constrains
output (``tool_choice: "required"`` or a named function) builds a spec itself, e.g.
``StructuredOutputSpec(kind="json_schema", json_schema=schema)``, and sets that field.

Imports only pydantic (the orchestrator never imports torch).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
_PAYLOAD = {"json_schema": "json_schema", "regex": "regex", "choice": "choices", "grammar": "grammar"}
MAX_CHOICES = 1024  # guided_choice entries at most (each one becomes a grammar alternative)


class StructuredOutputSpec(BaseModel):
    """What one request's output must match; exactly the payload field of its ``kind`` is set.

    kind ``json_schema``: ``json_schema`` (a JSON Schema object, draft 2020-12 as the grammar
    library reads it); ``json_object``: any JSON object (no payload); ``regex``: ``regex`` (the
    whole output matches it); ``choice``: ``choices`` (the output is exactly one of them);
    ``grammar``: ``grammar`` (a Lark-syntax context-free grammar, llguidance's dialect).
    Frozen: one spec is shared by every step; :meth:`key` names it in compile caches.
    Raises (pydantic ValidationError) when the payload does not match the kind.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Kind
    json_schema: dict[str, Any] | None = None
    regex: str | None = Field(None, min_length=1, max_length=65536)
    choices: tuple[str, ...] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, min_length=1, max_length=1 << 20)

    @model_validator(mode="after")
    def _payload_matches_kind(self) -> "StructuredOutputSpec":
        wanted = _PAYLOAD.get(self.kind)
        for name in _PAYLOAD.values():
            if name != wanted and getattr(self, name) is not None:
                raise ValueError(f"a {self.kind} spec takes no {name}")
        if wanted is not None and getattr(self, wanted) is None:
            raise ValueError(f"a {self.kind} spec needs {wanted}")
        return self

    def key(self) -> str:
        """A canonical string naming this spec (sorted-key JSON): equal specs, equal keys."""
        return json.dumps(self.model_dump(exclude_none=True), sort_keys=True, separators=(",", ":"))


class JSONSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: ``name`` (``a-zA-Z0-9_-``, at most 64 characters),
    ``schema`` (the JSON Schema; absent = any JSON object), ``strict`` (accepted: the grammar is
    always enforced), ``description`` (accepted, unused)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``type`` text | json_object | json_schema (which needs ``json_schema``)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema goes with (and only with) type 'json_schema'")
        return self


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs`` field: exactly one of ``json`` (a schema, object or JSON
    string), ``regex``, ``choice``, ``grammar`` (Lark), ``json_object: true``."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


def _schema(value: dict[str, Any] | str, field: str) -> dict[str, Any]:
    """A schema given as an object or as a JSON string (vLLM accepts both)."""
    if isinstance(value, dict):
        return value
    try:
        out = json.loads(value)
    except ValueError as err:
        raise ValueError(f"{field} is not valid JSON: {err}") from None
    if not isinstance(out, dict):
        raise ValueError(f"{field} must be a JSON Schema object")
    return out


def _from_response_format(rf: ResponseFormat) -> StructuredOutputSpec | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object" or rf.json_schema.schema_ is None:
        return StructuredOutputSpec(kind="json_object")
    return StructuredOutputSpec(kind="json_schema", json_schema=rf.json_schema.schema_)


def _from_structured_outputs(so: StructuredOutputsParams) -> list[tuple[str, StructuredOutputSpec]]:
    out = []
    if so.json_ is not None:
        out.append(("structured_outputs.json", StructuredOutputSpec(
            kind="json_schema", json_schema=_schema(so.json_, "structured_outputs.json"))))
    if so.regex is not None:
        out.append(("structured_outputs.regex", StructuredOutputSpec(kind="regex", regex=so.regex)))
    if so.choice is not None:
        out.append(("structured_outputs.choice", StructuredOutputSpec(kind="choice", choices=tuple(so.choice))))
    if so.grammar is not None:
        out.append(("structured_outputs.grammar", StructuredOutputSpec(kind="grammar", grammar=so.grammar)))
    if so.json_object:
        out.append(("structured_outputs.json_object", StructuredOutputSpec(kind="json_object")))
    return out


def spec_of(response_format: ResponseFormat | None = None, guided_json: dict[str, Any] | str | None = None,
            guided_regex: str | None = None, guided_choice: list[str] | None = None,
            guided_grammar: str | None = None, structured_outputs: StructuredOutputsParams | None = None
            ) -> StructuredOutputSpec | None:
    """The one structured-output spec of a request's fields (None: unconstrained output).

    Raises ValueError (the message names the fields) when more than one form is given, or when a
    payload is malformed (a schema string that is not a JSON object, an empty choice list).
    Whether the grammar library can compile the spec is checked later, by the server
    (``engine.structured_output``), still before any engine work.
    """
    found: list[tuple[str, StructuredOutputSpec]] = []
    field = "response_format"  # the request field being read, named in the error
    try:
        if response_format is not None:
            spec = _from_response_format(response_format)
            if spec is not None:
                found.append(("response_format", spec))
        field = "guided_json"
        if guided_json is not None:
            found.append(("guided_json", StructuredOutputSpec(kind="json_schema",
                                                              json_schema=_schema(guided_json, "guided_json"))))
        field = "guided_regex"
        if guided_regex is not None:
            found.append(("guided_regex", StructuredOutputSpec(kind="regex", regex=guided_regex)))
        field = "guided_choice"
        if guided_choice is not None:
            found.append(("guided_choice", StructuredOutputSpec(kind="choice", choices=tuple(guided_choice))))
        field = "guided_grammar"
        if guided_grammar is not None:
            found.append(("guided_grammar", StructuredOutputSpec(kind="grammar", grammar=guided_grammar)))
        field = "structured_outputs"
        if structured_outputs is not None:
            found += _from_structured_outputs(structured_outputs)
    except ValidationError as err:  # a client's error: name its field, not pydantic's internals
        raise ValueError(f"{field}: " + "; ".join(e["msg"] for e in err.errors(include_url=False))) from None
    except ValueError as err:
        raise ValueError(str(err)) from None
    if len(found) > 1:
        raise ValueError(f"one structured-output constraint per request, got {', '.join(n for n, _ in found)}")
    return found[0][1] if found else None
