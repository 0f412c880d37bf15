"""The string-built SSE chunks equal the pydantic models' bytes, for every chunk kind."""
import json

import pytest

from executor.openai_adapter import ChunkEncoder, chunk
from pdserve.protocol import Usage, sse_event

TEXTS = ["", "Hello", " world\n", 'quote " and \\ backslash', "tab\tcr\r\x00\x1f\x7f",
         "café ☕ 你好 🙂", "\u2028\u2029", "</script>"]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("text", TEXTS + [None])
@pytest.mark.parametrize("finish, role", [(None, True), (None, False), ("stop", False),
                                          ("length", True)])
def test_content_chunk_bytes_equal_pydantic(chat, text, finish, role):
    rid, created, model = "chatcmpl-abc", 1764580000, 'Smol"LM2 ✓'
    want = sse_event(chunk(chat, rid, created, model, text, finish, role=role))
    got = ChunkEncoder(chat, rid, created, model).event(text, finish, role=role)
    assert got == want
    assert json.loads(got[len(b"data: "):])["choices"][0]["finish_reason"] == finish


@pytest.mark.parametrize("chat", [True, False])
def test_usage_chunk_bytes_equal_pydantic(chat):
    usage = Usage(prompt_tokens=12, completion_tokens=30, total_tokens=42)
    want = sse_event(chunk(chat, "cmpl-1", 5, "m", None, None, usage=usage))
    assert ChunkEncoder(chat, "cmpl-1", 5, "m").usage_event(usage) == want


@pytest.mark.parametrize("role", [True, False])
def test_chat_delta_names_the_role_only_in_the_first_chunk(role):
    """OpenAI streams ``"role": "assistant"`` in the first delta and leaves ``role`` out after it
    (no ``"role": null``, which strictly typed clients may reject)."""
    raw = ChunkEncoder(True, "chatcmpl-1", 1, "m").event("hi", None, role=role)
    delta = json.loads(raw.decode().removeprefix("data: "))["choices"][0]["delta"]
    assert delta == ({"role": "assistant", "content": "hi"} if role else {"content": "hi"})
    tool = ChunkEncoder(True, "chatcmpl-1", 1, "m").event(None, None, role=role, delta={"tool_calls": []})
    assert ("role" in json.loads(tool.decode().removeprefix("data: "))["choices"][0]["delta"]) is role
