"""pdserve.request_body: the classes that once crashed every app (500 + a dropped keep-alive
connection) are 400s, valid-but-unusual JSON still parses, and the error boundary keeps the
connection usable when a handler fails anyway."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from pdserve.asgi_guard import ErrorBoundary
from pdserve.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.request_body import MAX_JSON_DEPTH, BodyError, decode_json, validate_request
from tests.fuzz.harness import error_problem
from tests.fuzz.keepalive import KeepAlive


@pytest.mark.parametrize("raw,fragment", [
    (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper"),           # RecursionError before
    (b'{"a":' + b"[" * (MAX_JSON_DEPTH) + b"]" * (MAX_JSON_DEPTH) + b"}", "nests deeper"),
    (b'{"a":' + b"9" * 5000 + b"}", "not valid JSON"),                               # int digit limit
    (b'{"a":"\\ud800"}', "lone UTF-16 surrogate"),                                   # tokenizer TypeError
    (b'{"k\\udfff":1}', "lone UTF-16 surrogate"),
    (b'{"a":"\xed\xa0\x80"}', "not valid JSON"),                                     # UTF-8-encoded surrogate
    (b'{"a":NaN}', "NaN is not a JSON number"), (b'{"a":-Infinity}', "-Infinity"),
    (b'{"a":1e309}', "out of range"), (b'\xff{}', "not valid JSON"), (b"", "not valid JSON"),
    (b"[]", "must be a JSON object"), ('{"a":1}'.encode("utf-16"), "not valid JSON"),
])
def test_bad_json_is_400(raw, fragment):
    with pytest.raises(BodyError) as info:
        decode_json(raw)
    assert info.value.status == 400 and fragment in info.value.message


def test_unusual_valid_json_parses():
    body = decode_json(b' {"a": "\\ud83d\\ude00 \xc3\xa9", "b": -0, "c": 1e-400, "d": [' + b"[" * 100 + b"]" * 100
                       + b'], "e": ' + str(2**70).encode() + b", \"a\": 2} ")
    assert body["a"] == 2 and body["b"] == 0 and body["c"] == 0.0 and body["e"] == 2**70


@pytest.mark.parametrize("model,body,param", [
    (CompletionRequest, {"model": "m", "prompt": "x", "seed": 2**63}, "seed"),
    (CompletionRequest, {"model": "m", "prompt": [2**31]}, "prompt.list[constrained-int].0"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2**64},
     "max_tokens"),
])
def test_integers_past_the_wire_bounds_are_422(model, body, param):
    with pytest.raises(BodyError) as info:
        validate_request(body, model)
    assert info.value.status == 422 and info.value.param.startswith(param.split(".")[0])


def test_error_boundary_answers_500_json_and_keeps_the_connection():
    app = FastAPI()

    @app.post("/boom")
    async def boom() -> dict:
        raise RuntimeError("a bug")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    app.add_middleware(ErrorBoundary, name="test")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        conn = KeepAlive("127.0.0.1", sock.getsockname()[1])
        first = conn.request("POST", "/boom", b"{}")
        assert first.status == 500 and error_problem(first.body) is None and not conn.closed
        assert conn.request("GET", "/ok").status == 200
        conn.close()
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.mark.parametrize("temperature,effective", [(1e-300, 0.0), (4.9e-324, 0.0), (0.0, 0.0), (1e-5, 1e-5),
                                                   (None, 1.0), (0.7, 0.7)])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature, effective):
    from executor.openai_adapter import sampling_params

    body = validate_request({"model": "m", "prompt": "x", "temperature": temperature}, CompletionRequest)
    assert sampling_params(body).temperature == effective
