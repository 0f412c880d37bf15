"""Wire formats of OpenAI function calling on ``/v1/chat/completions`` (request and response side).

Shapes follow the OpenAI API reference (https://platform.openai.com/docs/api-reference/chat/create,
``tools``, ``tool_choice``, ``message.tool_calls``; streaming: ``delta.tool_calls`` with an
``index`` per call, ``id`` and ``function.name`` in its first delta, ``function.arguments`` as
fragments after). What the schemas mean and how a choice is enforced is in :mod:`pdserve.tool_use`.

Imports only pydantic (the orchestrator never imports torch).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    """One callable function: ``name``, ``description``, ``parameters`` (a JSON Schema object;
    absent = no arguments, i.e. ``{"type": "object", "properties": {}}``), ``strict`` (accepted:
    a forced choice is always enforced by the grammar)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=65536)
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    """``{"type": "function", "function": {...}}`` (the only tool type)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly that function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    """``name`` and ``arguments``: a JSON text (OpenAI sends a string, not an object)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., max_length=256)
    arguments: str = Field(..., max_length=1 << 20)


class ToolCall(BaseModel):
    """One call, in an assistant message of the history or of an answer."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(..., min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


MAX_TOOLS = 128  # OpenAI's limit on tools per request
