"""Bad client input → OpenAI-style error bodies; FastAPI's ``{"detail": ...}`` never leaks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from orch_fakes import MODEL
from test_orch_flow import CHAT

ERROR_KEYS = {"message", "type", "param", "code"}


def post(cluster, path: str, content: bytes | str) -> httpx.Response:
    return httpx.post(cluster.url + path, content=content, headers={"content-type": "application/json"}, timeout=5)


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    return body["error"]


def test_malformed_json_is_400(cluster):
    err = assert_openai_error(post(cluster, "/v1/chat/completions", b'{"model": '), 400)
    assert "not valid JSON" in err["message"] and err["type"] == "invalid_request_error"


def test_non_object_body_is_400(cluster):
    assert_openai_error(post(cluster, "/v1/completions", b"[1, 2]"), 400)


def test_client_disaggregated_params_refused(cluster):
    body = {**CHAT, "disaggregated_params": {"request_type": "context_only"}}
    err = assert_openai_error(httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=5), 400)
    assert err["param"] == "disaggregated_params"
    assert cluster.ctx[0].record.bodies == []


@pytest.mark.parametrize("patch,path", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"messages": "hi"}, "messages"),
])
def test_schema_violation_is_422_naming_the_field(cluster, patch, path):
    body = {**CHAT, **patch}
    err = assert_openai_error(httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=5), 422)
    assert err["param"] == path and err["message"].startswith(path + ":")


def test_missing_field_is_422(cluster):
    err = assert_openai_error(httpx.post(cluster.url + "/v1/completions", json={"model": MODEL}, timeout=5), 422)
    assert err["param"] == "prompt"


def test_unknown_model_is_404_model_not_found(cluster):
    body = {**CHAT, "model": "gpt-17"}
    err = assert_openai_error(httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=5), 404)
    assert err["code"] == "model_not_found" and "gpt-17" in err["message"]


def test_unknown_route_and_wrong_method_use_openai_bodies(cluster):
    assert_openai_error(httpx.get(cluster.url + "/v1/nothing", timeout=5), 404)
    assert_openai_error(httpx.get(cluster.url + "/v1/chat/completions", timeout=5), 405)


def test_bad_requests_are_counted(cluster):
    post(cluster, "/v1/completions", b"nope")
    text = httpx.get(cluster.url + "/metrics", timeout=5).text
    assert 'pdserve_orchestrator_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert 'pdserve_orchestrator_errors_total{kind="bad_request"} 1.0' in text


def test_importing_the_app_does_not_import_torch():
    code = ("import sys, orchestrator.app, orchestrator.cli, orchestrator.launcher, pdserve.kv_pairing; "
            "bad = [m for m in ('torch', 'engine', 'executor', 'ctx_worker', 'gen_worker', 'kv_transfer') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=repo)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_stream_options_without_stream_is_refused(cluster):
    """OpenAI and vLLM refuse ``stream_options`` on a non-streaming request; so do we (before any server)."""
    body = {**CHAT, "stream_options": {"include_usage": True}}
    err = assert_openai_error(httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=5), 422)
    assert "stream_options" in err["message"]
    assert cluster.ctx[0].record.bodies == []
    ok = httpx.post(cluster.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=5)
    assert ok.status_code == 200
