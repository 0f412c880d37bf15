"""The string-built SSE chunks equal the pydantic models' bytes, for every chunk kind."""
import json

import pytest

from executor.openai_adapter import ChunkEncoder, chunk
from pdserve.protocol import RELAY_LINE, Usage, sse_event

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


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_pass_through_event_is_its_record_then_the_chunk_without_role(chat, text):
    """disaggregated_params.relay_head: RELAY_LINE [start, end, ids, finish] (character offsets of
    the output text), then the chunk as the client gets it; a record alone when there is nothing to say."""
    enc = ChunkEncoder(chat, "cmpl-orch", 11, "m")
    raw = enc.relay_event(text, None, 7, [3, 4])
    record, rest = raw.split(b"\n", 1)
    assert record.startswith(RELAY_LINE) and json.loads(record[len(RELAY_LINE):]) == [7, 7 + len(text), [3, 4], None]
    if not text:
        assert rest == b"\n"
        return
    assert rest == enc.event(text, None) and b'"role"' not in rest
    doc = json.loads(rest[len(b"data: "):])
    assert doc["id"] == "cmpl-orch" and doc["created"] == 11
    assert (doc["choices"][0]["delta"]["content"] if chat else doc["choices"][0]["text"]) == text


def test_a_finish_without_text_is_a_record_and_its_chunk():
    raw = ChunkEncoder(False, "cmpl-orch", 11, "m").relay_event("", "stop", 5, [])
    record, rest = raw.split(b"\n", 1)
    assert json.loads(record[len(RELAY_LINE):]) == [5, 5, [], "stop"]
    assert json.loads(rest[len(b"data: "):])["choices"][0]["finish_reason"] == "stop"


def test_a_stream_passes_through_only_when_its_text_goes_out_as_is():
    from executor.http_server import passes_through
    from executor.openai_adapter import Shape
    from pdserve.protocol import CompletionRequest

    body = CompletionRequest(model="m", prompt="hi", stream=True)
    assert passes_through(body, Shape())
    assert not passes_through(CompletionRequest(model="m", prompt="hi", stream=True, n=2), Shape())
    assert not passes_through(body, Shape(logprobs=0))
    assert not passes_through(body, Shape(echo="hi"))
    assert not passes_through(body, Shape(continuous_usage=True))
    assert not passes_through(body, Shape(parsers={0: object()}))  # type: ignore[dict-item]
