"""pdserve.request_body.decode_json: the orjson fast path gives what the stdlib path gives, value
for value (int stays int) and error for error (the same status and message)."""

from __future__ import annotations

import json

import pytest

from pdserve import request_body
from pdserve.request_body import MAX_JSON_DEPTH, BodyError, decode_json

CHAT = {"model": "m", "messages": [{"role": "user", "content": "héllo \U0001f600"}], "max_tokens": 16,
        "temperature": 0.7, "top_p": 1.0, "stream": True, "stream_options": {"include_usage": True}}
BODIES = [
    json.dumps(CHAT).encode(),
    json.dumps({"model": "m", "prompt": [1, 2, 3] * 50, "max_tokens": 1, "seed": 2**63 - 1}).encode(),
    b'{"model":"m","prompt":"x","seed":9223372036854775808}',      # past int64: an int, never a float
    b'{"model":"m","prompt":"x","seed":18446744073709551616}',     # past uint64
    b'{"model":"m","prompt":"x","seed":-9223372036854775809}',
    b'{"a":123456789012345678901234567890,"b":1e300,"c":-0.0,"d":-0,"e":1.0000000000000002}',
    b'{"a":1,"a":2}', b'{"a":"\\u0000\\ud83d\\ude00"}', b' {"a":1} ', b'{"a":"1234567890123456789"}',
    b'{"a":' + b"[" * (MAX_JSON_DEPTH - 2) + b"]" * (MAX_JSON_DEPTH - 2) + b"}",
    b'{"a":' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}",
    b'{"a":' + b"[" * 2000 + b"]" * 2000 + b"}",
    b'{"a":NaN}', b'{"a":Infinity}', b'{"a":1e309}', b'{"a":"\\ud800"}', b'{"k\\udfff":1}',
    b'{"a":"\xed\xa0\x80"}', b'\xef\xbb\xbf{"a":1}', b'{"a":"x\x01"}', b'{"a":1}x', b"", b"null", b"[]",
    b"1", b'"s"', b"\xff{}", '{"a":1}'.encode("utf-16"), b'{"a":' + b"9" * 5000 + b"}",
]


def _outcome(raw: bytes) -> tuple[str, str]:
    try:
        return "value", repr(decode_json(raw))
    except BodyError as err:
        return "error", f"{err.status} {err.message}"


@pytest.mark.parametrize("raw", BODIES, ids=lambda raw: repr(raw[:30]))
def test_fast_path_equals_the_stdlib_path(raw, monkeypatch):
    fast = _outcome(raw)
    monkeypatch.setattr(request_body, "_decode_fast", lambda raw: None)
    assert fast == _outcome(raw)


def test_the_common_body_takes_the_fast_path(monkeypatch):
    def no_stdlib(*args, **kwargs):
        raise AssertionError("the stdlib parser ran")

    monkeypatch.setattr(request_body.json, "loads", no_stdlib)
    assert decode_json(json.dumps(CHAT).encode()) == CHAT
