"""What a chat request hands its model's chat template, the same on the servers and the orchestrator.

HF chat templates (https://huggingface.co/docs/transformers/chat_templating, "Tool use") read
``messages`` with ``role``/``content``, assistant ``tool_calls`` as ``{id, type, function: {name,
arguments}}`` with ``arguments`` a *mapping* (OpenAI sends a JSON string: it is decoded here, as
vLLM does), ``tool`` messages with ``tool_call_id``, the ``tools`` list in OpenAI's JSON shape, and
any extra variables (``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``).

Imports only the standard library (the orchestrator never imports torch).
"""

from __future__ import annotations

import json
from typing import Any


def hf_messages(messages: list[dict]) -> list[dict]:
    """Validated JSON messages → the template's messages. Content parts are joined (only
    ``{"type": "text"}`` parts); null content becomes ``""`` (templates concatenate it).

    Raises:
        ValueError: a non-text content part, or tool-call ``arguments`` that are not JSON (400).
    """
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m["role"], "content": message_text(m.get("content"))}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                msg[key] = m[key]
        if m.get("tool_calls"):
            msg["tool_calls"] = [_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m["tool_calls"])]
        out.append(msg)
    return out


def message_text(content: object) -> str:
    """A message's text: a string, null (``""``) or a list of text parts. Raises ValueError otherwise."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else [content]:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def template_tools(tools: list[dict] | None) -> list[dict] | None:
    """``tools`` as the template gets them (OpenAI's shape, unset fields left out)."""
    if not tools:
        return None
    return [{"type": "function", "function": {k: v for k, v in t["function"].items() if v is not None}}
            for t in tools]


def _call(call: dict, where: str) -> dict:
    fn = call["function"]
    try:
        arguments = json.loads(fn["arguments"])
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}.function.arguments is not JSON: {err}") from None
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}}
