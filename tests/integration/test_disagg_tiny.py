"""Real processes, tiny random Llama: disaggregated == colocated, concurrency, leases, bad input."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from tests.integration.conftest import TINY_NAME

# From 1 token to well over three KV blocks (block_size is 4 in the tiny cluster).
PROMPTS = [
    "Hi",
    "a",
    "The quick brown fox",
    "Once upon a time there was",
    "1 2 3 4 5 6 7 8 9 10 11 12 13",
    "Paris is the capital of France and Berlin is the capital of Germany.",
    "Write a short poem about the sea, the wind and the gulls over the harbour at dawn.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Zürich, Köln, Málaga — ünïcödé names",
    "In 1492 Columbus sailed the ocean blue; in 1969 people walked on the moon; in 2026 we serve LLMs.",
]


def completion_body(prompt, stream: bool, max_tokens: int = 24, **kw) -> dict:
    return {"model": TINY_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, **kw}


def chat_body(text: str, stream: bool, max_tokens: int = 24, **kw) -> dict:
    return {"model": TINY_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, **kw}


def run(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[str, str | None, dict | None]:
    """POST and return (text, finish_reason, usage), reading SSE when streaming."""
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=60, headers=headers)
        assert r.status_code == 200, r.text
        d = r.json()
        c = d["choices"][0]
        return (c["message"]["content"] if chat else c["text"]), c["finish_reason"], d["usage"]
    text, finish, usage = [], None, None
    with httpx.stream("POST", url + path, json={**body, "stream_options": {"include_usage": True}}, timeout=60,
                      headers=headers) as r:
        assert r.status_code == 200, r.read()
        lines = list(r.iter_lines())
    assert not [line for line in lines if line.startswith(":")]  # no pass-through record reaches a client
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        d = json.loads(e)
        assert "error" not in d, d
        if d.get("usage"):
            usage = d["usage"]
        for c in d["choices"]:
            text.append((c["delta"].get("content") or "") if chat else c["text"])
            finish = c["finish_reason"] or finish
    return "".join(text), finish, usage


@pytest.fixture(params=["context_first", "generation_first"])
def orch(request, tiny_cluster) -> str:
    """The orchestrator URL of one schedule style (same ctx and gen servers)."""
    return tiny_cluster.url if request.param == "context_first" else request.getfixturevalue("genfirst_url")


def plain(result: tuple) -> tuple:
    """(text, finish_reason, usage) without ``prompt_tokens_details``: which server's prefix cache
    served a prompt may differ between two paths; the answer may not."""
    text, finish, usage = result
    return text, finish, {k: v for k, v in (usage or {}).items() if k != "prompt_tokens_details"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disaggregated_equals_colocated(tiny_cluster, orch, path, stream):
    passed_before = passed_events(orch)
    for prompt in PROMPTS:
        body = chat_body(prompt, stream) if "chat" in path else completion_body(prompt, stream)
        disagg = run(orch, path, body)
        colocated = run(tiny_cluster.server_url("gen"), path, body)
        # cached_tokens may differ (the gen server's cache now holds the pulled blocks): compared apart.
        hits = [r[2].pop("prompt_tokens_details")["cached_tokens"] for r in (disagg, colocated)]
        assert disagg == colocated, prompt
        assert disagg[2]["completion_tokens"] == 24 and disagg[1] == "length"
        assert hits[1] == (disagg[2]["prompt_tokens"] - 1) // 4 * 4  # pulled blocks joined the gen cache
    if stream:  # the gen server honoured relay_head: chunks passed through as it wrote them
        assert passed_events(orch) > passed_before


def passed_events(url: str) -> float:
    """The orchestrator's count of pass-through events relayed as bytes (disaggregated_params.relay_head)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(r'pdserve_orchestrator_relayed_events_total\{how="passed"\} ([0-9.e+]+)', text)
    return float(found.group(1)) if found else 0.0


def test_single_token_prompt_ids(tiny_cluster):
    body = completion_body([17], False, max_tokens=8)
    assert plain(run(tiny_cluster.url, "/v1/completions", body)) == \
        plain(run(tiny_cluster.server_url("ctx"), "/v1/completions", body))


def test_max_tokens_one_finishes_on_ctx(tiny_cluster, orch):
    body = completion_body("hello there", False, max_tokens=1)
    text, finish, usage = run(orch, "/v1/completions", body)
    assert finish == "length" and usage["completion_tokens"] == 1
    assert plain((text, finish, usage)) == plain(run(tiny_cluster.server_url("gen"), "/v1/completions", body))
    streamed = run(orch, "/v1/completions", {**body, "stream": True})
    assert streamed[:2] == (text, finish)


def test_eight_concurrent_equal_each_alone(tiny_cluster, orch):
    bodies = [completion_body(p, False, max_tokens=16) for p in PROMPTS[:8]]
    alone = [run(tiny_cluster.url, "/v1/completions", b) for b in bodies]  # context_first, one at a time

    async def all_at_once():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*[c.post(orch + "/v1/completions", json=b) for b in bodies])
        return [(r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"], r.json()["usage"]) for r in rs]

    assert [plain(r) for r in asyncio.run(all_at_once())] == [plain(r) for r in alone]


def test_stop_string_disagg_equals_colocated(tiny_cluster, orch):
    base = completion_body(PROMPTS[6], False, max_tokens=24)
    full, _, _ = run(tiny_cluster.server_url("gen"), "/v1/completions", base)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), "need a non-blank stop string"
    body = {**base, "stop": [stop]}
    result = run(orch, "/v1/completions", body)
    assert plain(result) == plain(run(tiny_cluster.server_url("gen"), "/v1/completions", body))
    assert result[1] == "stop" and stop not in result[0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_stop_string_starting_in_the_first_token_equals_colocated(tiny_cluster, path):
    # The first token goes out at once: a tail of it that may begin a stop string must wait.
    make = chat_body if "chat" in path else completion_body
    base = make(PROMPTS[6], True, max_tokens=24)
    full, _, _ = run(tiny_cluster.server_url("gen"), path, base)
    for stop in (full[1:4], full[len(full) // 2: len(full) // 2 + 3]):
        body = {**base, "stop": [stop]}
        result = run(tiny_cluster.url, path, body)
        assert plain(result) == plain(run(tiny_cluster.server_url("gen"), path, body)), stop
        assert result[1] == "stop" and stop not in result[0]


def server_info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=5).json()


def test_ctx_server_refuses_generation_only_and_gen_refuses_context_only(tiny_cluster):
    body = completion_body("x", False, disaggregated_params={"request_type": "context_only"})
    r = httpx.post(tiny_cluster.server_url("gen") + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 400 and "does not run context_only" in r.json()["error"]["message"]


BAD_BODIES = [
    (b"{not json", 400),
    (json.dumps({"model": TINY_NAME}).encode(), 422),                     # missing messages
    (json.dumps({"model": TINY_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), 422),
    (json.dumps({"model": TINY_NAME, "messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(), 422),
    (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode(), 404),
    (json.dumps({"model": TINY_NAME, "messages": [{"role": "user", "content": "word " * 3000}]}).encode(), 400),
    # a string where a boolean belongs is refused, not coerced ("false" would be truthy downstream)
    (json.dumps({"model": TINY_NAME, "messages": [{"role": "user", "content": "x"}], "stream": "false"}).encode(), 422),
]


@pytest.mark.parametrize("target", ["orchestrator", "ctx", "gen"])
def test_bad_input_gets_openai_error_and_server_keeps_serving(tiny_cluster, target):
    url = tiny_cluster.url if target == "orchestrator" else tiny_cluster.server_url(target)
    for raw, status in BAD_BODIES:
        r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (raw[:60], r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"]
    assert run(url, "/v1/chat/completions", chat_body("still there?", False, max_tokens=4))[2]["completion_tokens"] == 4


def test_models_and_health(tiny_cluster):
    windows = []
    for url in (tiny_cluster.url, tiny_cluster.server_url("ctx"), tiny_cluster.server_url("gen")):
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        cards = httpx.get(url + "/v1/models", timeout=5).json()["data"]
        assert [m["id"] for m in cards] == [TINY_NAME]
        windows.append(cards[0]["max_model_len"])
    assert isinstance(windows[0], int) and windows[0] == min(windows[1:])  # the orchestrator's = its servers'


def test_pulled_lease_frees_ctx_blocks(tiny_cluster, orch):
    ctx, gen = tiny_cluster.server_url("ctx"), tiny_cluster.server_url("gen")
    start = server_info(ctx)["free_blocks"], server_info(gen)["free_blocks"]
    answered = server_info(ctx)["lease_waits_answered"]
    run(orch, "/v1/completions", completion_body(PROMPTS[9], False, max_tokens=4))
    # generation_first: the gen server asked the ctx server for the lease (once); context_first never does
    assert server_info(ctx)["lease_waits_answered"] == answered + (orch != tiny_cluster.url)
    deadline = time.monotonic() + 5
    while (server_info(ctx)["free_blocks"], server_info(gen)["free_blocks"]) != start and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (server_info(ctx)["free_blocks"], server_info(gen)["free_blocks"]) == start
    assert server_info(ctx)["parked_leases"] == 0 and server_info(ctx)["lease_waits"] == 0


def test_kv_transfer_metrics_on_both_servers(tiny_cluster):
    run(tiny_cluster.url, "/v1/completions", completion_body(PROMPTS[9], False, max_tokens=4))
    ctx = httpx.get(tiny_cluster.server_url("ctx") + "/metrics", timeout=10).text
    gen = httpx.get(tiny_cluster.server_url("gen") + "/metrics", timeout=10).text

    def value(text: str, prefix: str) -> float:
        return float(next(l for l in text.splitlines() if l.startswith(prefix)).rsplit(" ", 1)[1])

    assert value(ctx, 'pdserve_kv_transfer_bytes_total{direction="sent"}') > 0
    assert value(gen, 'pdserve_kv_transfer_bytes_total{direction="received"}') > 0
    assert value(ctx, 'pdserve_kv_transfer_seconds_count{direction="sent"}') >= 1
    assert value(gen, 'pdserve_kv_transfer_seconds_bucket{direction="received",le="+Inf"}') >= 1
    backend = httpx.get(tiny_cluster.server_url("gen") + "/server_info", timeout=10).json()["kv_backend"]
    assert f'pdserve_server_info{{kv_backend="{backend}",role="gen"}} 1.0' in gen
    if backend == "ucx":  # ctx and gen share this host: the bytes were read straight from the ctx process
        assert value(gen, "pdserve_kv_transfer_same_host_reads_total") >= 1
    # Queue time (arrival in the engine to admission) observed once per request on each side.
    assert value(ctx, 'pdserve_server_request_queue_time_seconds_count{request_type="context_only"}') >= 1
    assert value(gen, 'pdserve_server_request_queue_time_seconds_count{request_type="generation_only"}') >= 1
    for text in (ctx, gen):
        assert value(text, "pdserve_num_requests_waiting ") == 0 and value(text, "pdserve_num_requests_running ") == 0
