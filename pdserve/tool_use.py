"""What a chat request's ``tools`` + ``tool_choice`` ask of the server: checked once, on every side.

* ``none`` (or no tools): the answer is text; the tools still reach the chat template.
* ``auto`` (the default with tools): the model may call; the model's tool-call parser
  (``model.tool_call_parser``) finds the calls in its text (:mod:`pdserve.tool_parsers`).
* ``required`` / a named function: *forced*. The output is constrained by the grammar to one call
  object ``{"name": ..., "arguments": {...}}`` (:func:`call_schema`: name fixed, arguments = the
  function's ``parameters``; ``required``: ``anyOf`` over the tools), and the whole output is that
  call (:class:`pdserve.tool_parsers.ForcedCallParser`), whatever parser the model has.

:func:`tool_use` raises :class:`ToolError` (an HTTP 400 with ``param``) for a ``tool_choice`` naming
a function not in ``tools``, a forced choice without tools, two functions of one name, or a
``parameters`` that is not a valid JSON Schema (checked against its metaschema with ``jsonschema``,
draft 2020-12 unless the schema names another).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# Arguments this module's callers pass to the chat template themselves: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation",
                                      "documents", "continue_final_message", "return_dict", "chat_template"})


class ToolError(ValueError):
    """A request whose tools cannot be served (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolUse:
    """``mode``: none | auto | forced; ``schema``: forced only, the JSON Schema of the one call."""

    mode: Literal["none", "auto", "forced"]
    schema: dict[str, Any] | None = None


NO_TOOLS = ToolUse("none")


def tool_use(tools: list[dict] | None, tool_choice: str | dict | None) -> ToolUse:
    """The :class:`ToolUse` of a request (``tools``/``tool_choice`` as JSON values). Raises ToolError."""
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if not tools:
        if forced:
            raise ToolError(f"tool_choice {_shown(tool_choice)} needs tools", "tool_choice")
        return NO_TOOLS
    functions = [t["function"] for t in tools]
    _check_functions(functions)
    if tool_choice == "none":
        return NO_TOOLS
    if tool_choice is None or tool_choice == "auto":
        return ToolUse("auto")
    if tool_choice == "required":
        schemas = [call_schema(f) for f in functions]
        return ToolUse("forced", schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    name = tool_choice["function"]["name"]
    for f in functions:
        if f["name"] == name:
            return ToolUse("forced", call_schema(f))
    raise ToolError(f"tool_choice names function {name!r}, which is not in tools "
                    f"({', '.join(f['name'] for f in functions)})", "tool_choice")


def call_schema(function: dict) -> dict[str, Any]:
    """The JSON Schema of one call of ``function``: ``{"name": <its name>, "arguments": <its parameters>}``."""
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [function["name"]]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def check_template_kwargs(kwargs: dict | None) -> None:
    """Raise ToolError (param ``chat_template_kwargs``) when a key would replace an argument the server sets."""
    clash = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if clash:
        raise ToolError(f"chat_template_kwargs may not set {', '.join(clash)} (the server sets them)",
                        "chat_template_kwargs")


def _check_functions(functions: list[dict]) -> None:
    from jsonschema import Draft202012Validator, SchemaError, validators

    seen: set[str] = set()
    for i, f in enumerate(functions):
        if f["name"] in seen:
            raise ToolError(f"two tools are named {f['name']!r}", f"tools.{i}.function.name")
        seen.add(f["name"])
        params = f.get("parameters")
        if params is None:
            continue
        param = f"tools.{i}.function.parameters"
        if params.get("type", "object") != "object":
            raise ToolError(f"parameters of {f['name']!r} must be a schema of type object, not "
                            f"{params.get('type')!r}", param)
        try:
            validators.validator_for(params, default=Draft202012Validator).check_schema(params)
        except SchemaError as err:
            raise ToolError(f"parameters of {f['name']!r} is not a valid JSON Schema: {err.message}", param) from None


def _shown(choice: object) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice['function']['name']!r}"  # type: ignore[index]
