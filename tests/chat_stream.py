"""Rebuild the message an OpenAI client assembles from a chat stream's deltas (shared by the tool tests)."""
from __future__ import annotations


def rebuild_chat_stream(chunks) -> dict:
    """content, reasoning (None when empty), calls [{name, arguments}] joined by index, and the last
    finish_reason of an iterable of openai ChatCompletionChunk. Asserts a call's id comes once."""
    content, reasoning, calls, finish = [], [], {}, None
    for ch in chunks:
        for choice in ch.choices:
            d = choice.delta
            content.append(d.content or "")
            reasoning.append(getattr(d, "reasoning_content", None) or "")
            for tc in d.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": "".join(content) or None, "reasoning": "".join(reasoning) or None,
            "calls": [calls[i] for i in sorted(calls)], "finish": finish}
