"""Helpers to read SSE bodies in tests."""

from __future__ import annotations

import json


def parse_sse(raw: bytes) -> list[dict | str]:
    """The ``data:`` payloads of an SSE body: dicts, and the string ``"[DONE]"``."""
    out: list[dict | str] = []
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_text(events: list[dict | str], chat: bool) -> str:
    text = ""
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            text += (c["delta"].get("content") or "") if chat else c["text"]
    return text
