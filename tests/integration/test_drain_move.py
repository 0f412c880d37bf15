"""Drain by moving KV through the orchestrator (tiny random Llama, 1 ctx + 2 gen servers in this
process on real sockets, KV over TCP): a gen server told ``POST /admin/drain {"mode": "move_kv"}``
hands its running streams to the other gen server, which pulls their KV and decodes on.

Checked: the client's stream / JSON answer equals an undisturbed run token for token (greedy, so
text and usage too); no recompute (the two gen servers together compute exactly the tokens one
undisturbed gen server computes, and the target pulls exactly the bytes the drained server sent);
a server with several running streams is empty within seconds; every KV pool is full afterwards.
The same for generation_first requests (a second cluster; a non-stream one is streamed internally),
whose moved answers equal the colocated run. And n = 2 streams, moved choice by choice (one lease
per choice, each continued as an n = 1 pull with its choice index).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.threaded_cluster import MODEL, ThreadedCluster, env_vars

TOKEN = "drain-test-token"
MAX_TOKENS = 100       # ~5 s of decode at the injected step delay: the drain lands mid-stream; 6 fit the KV cache
STEP_DELAY_S = "0.05"
GENS = ("gen", "gen1", "gen2")  # the first test drains one, the n > 1 test another
GENFIRST_TOKENS = 60   # ~3 s of decode: still mid-stream at the drain
SESSION = {"X-Session-Id": "drain-test"}  # session affinity: every request of the test on one gen server


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with env_vars({"PDSERVE_TEST_STEP_DELAY_S": STEP_DELAY_S, "PDSERVE_ADMIN_TOKEN": TOKEN}):
        c = ThreadedCluster.start(tiny_model_dir, tmp_path_factory.mktemp("drain"), num_gen=3,
                                  orchestrator={"migration_limit": 2, "session_affinity": "header",
                                                "kv_aware_balance_threshold": 100})
        try:
            yield c
        finally:
            c.stop()


def body(path: str, stream: bool, n: int = MAX_TOKENS) -> dict:
    b = {"model": MODEL, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    if "chat" in path:
        return {**b, "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}
    return {**b, "prompt": "Once upon a time, by the sea, there lived"}


def ask(url: str, path: str, b: dict) -> tuple[str, dict]:
    """(text, usage) of one n = 1 request, stream or not (usage: prompt and completion tokens; the
    cached tokens depend on what the ctx server's prefix cache held)."""
    texts, usage = ask_choices(url, path, b)
    assert list(texts) == [0], texts
    return texts[0], usage


def tokens_of(usage: dict) -> dict:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def info(cluster, name: str) -> dict:
    return httpx.get(cluster.server_url(name) + "/server_info", timeout=10).json()


def gens_of(cluster) -> list[str]:
    """The gen servers of ``cluster`` (the generation_first cluster has two, the other three)."""
    return [g for g in GENS if g in cluster.servers]


def busy_gen_of(cluster, names, timeout_s: float = 30.0) -> str:
    """The first of ``names`` with a request decoding (polls its stats)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in names:
            if info(cluster, name).get("scheduled_requests", 0) > 0:
                return name
        time.sleep(0.05)
    raise AssertionError(f"none of {names} started decoding")


def busy_gen(cluster, timeout_s: float = 30.0) -> str:
    """The gen server with a request decoding (polls its stats)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in gens_of(cluster):
            if info(cluster, name).get("scheduled_requests", 0) > 0:
                return name
        time.sleep(0.05)
    raise AssertionError("no gen server started decoding")


def drain_move(cluster, name: str) -> dict:
    r = httpx.post(cluster.server_url(name) + "/admin/drain", json={"mode": "move_kv"},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_empty(cluster, name: str, timeout_s: float) -> float:
    """Seconds until ``name`` holds no request, no parked KV and all its blocks are free."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        s = info(cluster, name)
        if (s["scheduled_requests"] == s["waiting_requests"] == s["parked_requests"] == s["moved_leases"] == 0
                and s["free_blocks"] == s["total_blocks"]):
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"{name} still busy after {timeout_s} s: {info(cluster, name)}")



def drain_mid_decode(cluster, name: str, sequences: int, workers: list) -> tuple[float, float]:
    """Once ``sequences`` sequences decode on gen server ``name`` (bounded: 30 s), drain it with
    move_kv; wait for it to empty (10 s) and for the client threads (120 s each). Returns (seconds
    until the server was empty, seconds until every stream ended), both from the drain."""
    deadline = time.monotonic() + 30
    while info(cluster, name)["scheduled_requests"] < sequences:
        assert time.monotonic() < deadline, f"not all {sequences} sequences decode on {name}: {info(cluster, name)}"
        time.sleep(0.05)
    time.sleep(0.3)  # a few tokens decoded there
    assert drain_move(cluster, name)["mode"] == "move_kv"
    t0 = time.monotonic()
    drained_s = wait_empty(cluster, name, 10.0)
    for w in workers:
        w.join(120)
    assert not any(w.is_alive() for w in workers)
    return drained_s, time.monotonic() - t0


def totals(cluster) -> dict:
    out = {}
    for name in gens_of(cluster):
        s = info(cluster, name)
        out[name] = (s["tokens_computed"], s["kv_transfer"]["received"]["bytes"], s["kv_moved_sent"]["bytes"])
    return out


CASES = (("/v1/completions", True), ("/v1/chat/completions", True), ("/v1/completions", False))


def test_drain_moves_every_stream_without_recompute_in_seconds(cluster):
    cases = list(CASES) * 2  # 6 requests: streams and a non-stream one (streamed internally)
    expected = run_all(cluster, cases[:3])
    assert all(usage["completion_tokens"] == MAX_TOKENS for _, usage in expected)
    before = totals(cluster)
    results: dict = {}
    workers = run_all(cluster, cases, results, wait=False)
    name = busy_gen(cluster)
    drained_s, streams_s = drain_mid_decode(cluster, name, len(cases), workers)
    # One stream each, equal to the undisturbed run: same text, same usage, nothing repeated or missing.
    assert [results[i] for i in range(len(cases))] == expected * 2
    after = totals(cluster)
    targets = [g for g in GENS if g != name]
    moved = info(cluster, name)["requests_moved"]
    assert moved == len(cases), f"{moved} of {len(cases)} requests moved"
    moved_bytes = after[name][2] - before[name][2]
    assert moved_bytes > 0 and sum(after[t][1] - before[t][1] for t in targets) == moved_bytes  # pulled = parked
    # Undisturbed, a gen phase computes MAX_TOKENS - 1 tokens (the ctx server sampled the first);
    # moved, the two gen servers together compute exactly as many: no token is computed twice.
    computed = sum(after[g][0] - before[g][0] for g in GENS)
    assert computed == len(cases) * (MAX_TOKENS - 1)
    # Empty long before its streams would have finished there: they went on decoding elsewhere.
    assert drained_s < 3.0 and streams_s > drained_s + 1.0, (drained_s, streams_s)
    for t in targets:
        wait_empty(cluster, t, 10.0)


CHOICE_CASES = (("/v1/completions", True), ("/v1/chat/completions", True), ("/v1/completions", False))


def choices_body(path: str, stream: bool) -> dict:
    """An n = 2 seeded sampled request (the choices differ)."""
    return {**body(path, stream), "n": 2, "temperature": 1.0, "seed": 99}


def ask_choices(url: str, path: str, b: dict) -> tuple[dict, dict]:
    """({index: text}, usage) of an n-choice request, stream or not."""
    texts: dict = {}
    if not b["stream"]:
        r = httpx.post(url + path, json=b, timeout=120, headers=SESSION)
        assert r.status_code == 200, r.text
        doc = r.json()
        return {c["index"]: c["message"]["content"] if "chat" in path else c["text"] for c in doc["choices"]}, \
            tokens_of(doc["usage"])
    usage = None
    with httpx.stream("POST", url + path, json=b, timeout=120, headers=SESSION) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event and "moved" not in event, event
            for c in event.get("choices", []):
                piece = (c.get("delta") or {}).get("content") or c.get("text") or ""
                texts[c["index"]] = texts.get(c["index"], "") + piece
            usage = event.get("usage") or usage
    assert usage is not None, "no usage chunk"
    return dict(sorted(texts.items())), tokens_of(usage)


def test_drain_moves_each_choice_of_n_choices_streams_without_recompute(cluster):
    """n > 1 on a move_kv drain: the draining gen server parks each unfinished choice of a movable
    seeded n = 2 stream under its own lease (``"<id>-c<i>"``) and ends the stream with one moved
    entry per choice; the orchestrator continues each choice as an n = 1 pull of its lease on
    another gen server, with its choice index. Every answer equals the undisturbed run choice for
    choice, usage included; the targets pull exactly the bytes the drained server sent; no token is
    computed twice (each target computes the one token left per moved choice, then decodes on: the
    gen servers together compute what undisturbed ones do); nothing is handed back; the drained
    server is empty in seconds and every gen KV pool is full afterwards."""
    ready = [g for g in GENS if httpx.get(cluster.server_url(g) + "/health", timeout=5).status_code == 200]
    assert len(ready) >= 2, ready  # one to drain, one to take its choices (the test above may have drained one)
    expected = [ask_choices(cluster.url, p, choices_body(p, s)) for p, s in CHOICE_CASES]
    assert all(len(set(texts.values())) == 2 and usage["completion_tokens"] == 2 * MAX_TOKENS
               for texts, usage in expected), expected
    before = totals(cluster)
    stats0 = {g: info(cluster, g) for g in ready}
    results: dict = {}

    def one(i, path, stream):
        results[i] = ask_choices(cluster.url, path, choices_body(path, stream))

    workers = [threading.Thread(target=one, args=(i, p, s)) for i, (p, s) in enumerate(CHOICE_CASES)]
    for w in workers:
        w.start()
    name = busy_gen_of(cluster, ready)
    drained_s, streams_s = drain_mid_decode(cluster, name, 2 * len(CHOICE_CASES), workers)
    assert [results[i] for i in range(len(CHOICE_CASES))] == expected
    s = info(cluster, name)
    moved_choices = 2 * len(CHOICE_CASES)
    assert s["requests_moved"] - stats0[name]["requests_moved"] == moved_choices, s  # one lease per choice
    assert s["requests_handed_back"] == stats0[name]["requests_handed_back"], s  # not the fallback
    assert drained_s < 3.0 and streams_s > drained_s + 1.0, (drained_s, streams_s)
    after = totals(cluster)
    targets = [g for g in ready if g != name]
    moved_bytes = after[name][2] - before[name][2]
    assert moved_bytes > 0 and sum(after[t][1] - before[t][1] for t in targets) == moved_bytes  # pulled = parked
    # Undisturbed, each choice's gen phase computes MAX_TOKENS - 1 tokens (the ctx server sampled the
    # first); moved, the gen servers together compute exactly as many: the pull brings the KV of every
    # token but the last, so each target computes that one and then one per new token.
    computed = sum(after[g][0] - before[g][0] for g in ready)
    assert computed == moved_choices * (MAX_TOKENS - 1), computed
    for t in targets:
        wait_empty(cluster, t, 10.0)


def run_all(cluster, cases, results: dict | None = None, wait: bool = True, max_tokens: int = MAX_TOKENS):
    """Run ``cases`` concurrently (same session); with ``wait`` their answers in order, else the threads."""
    results = {} if results is None else results

    def one(i, path, stream):
        results[i] = ask(cluster.url, path, body(path, stream, max_tokens))

    workers = [threading.Thread(target=one, args=(i, p, s)) for i, (p, s) in enumerate(cases)]
    for w in workers:
        w.start()
    if not wait:
        return workers
    for w in workers:
        w.join(120)
    return [results[i] for i in range(len(cases))]


@pytest.fixture(scope="module")
def genfirst_cluster(tiny_model_dir, tmp_path_factory):
    """The same cluster shape with ``schedule_style: generation_first`` (both requests leave at once)."""
    with env_vars({"PDSERVE_TEST_STEP_DELAY_S": STEP_DELAY_S, "PDSERVE_ADMIN_TOKEN": TOKEN}):
        c = ThreadedCluster.start(tiny_model_dir, tmp_path_factory.mktemp("drain-gf"), num_gen=2,
                                  orchestrator={"migration_limit": 2, "session_affinity": "header",
                                                "kv_aware_balance_threshold": 100,
                                                "schedule_style": "generation_first"})
        try:
            yield c
        finally:
            c.stop()


def test_generation_first_streams_move_too_and_equal_colocated(genfirst_cluster):
    """A generation_first request is movable like a context_first one (the relay follows its token
    ids; a non-stream one is streamed internally from the gen server): moved mid-decode, its answer
    equals the colocated run's (text and usage), with no token computed twice."""
    c, n = genfirst_cluster, GENFIRST_TOKENS
    cases = list(CASES) * 2  # streams and a non-stream request
    with ThreadPoolExecutor(3) as pool:  # the reference: both phases on one server, no disaggregation
        colocated = list(pool.map(lambda case: ask(c.server_url("ctx"), case[0], body(*case, n)), cases[:3]))
    before = totals(c)
    results: dict = {}
    workers = run_all(c, cases, results, wait=False, max_tokens=n)
    name = busy_gen(c)
    deadline = time.monotonic() + 30
    while info(c, name)["scheduled_requests"] < len(cases):
        assert time.monotonic() < deadline, f"not all {len(cases)} requests decode on {name}: {info(c, name)}"
        time.sleep(0.05)
    time.sleep(0.3)
    assert drain_move(c, name)["mode"] == "move_kv"
    wait_empty(c, name, 10.0)
    for w in workers:
        w.join(120)
    assert not any(w.is_alive() for w in workers)
    assert [results[i] for i in range(len(cases))] == colocated * 2  # disaggregated and moved == colocated
    assert info(c, name)["requests_moved"] == len(cases)
    after = totals(c)
    target = next(g for g in gens_of(c) if g != name)
    moved_bytes = after[name][2] - before[name][2]
    assert moved_bytes > 0 and after[target][1] - before[target][1] == moved_bytes  # pulled = parked
    assert sum(after[g][0] - before[g][0] for g in gens_of(c)) == len(cases) * (n - 1)
