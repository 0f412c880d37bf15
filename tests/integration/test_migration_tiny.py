"""Real processes, tiny random Llama: seeded requests whose gen server process is killed mid-decode
continue on another gen server and equal the undisturbed runs token for token (stream and not)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
import yaml

from tests.integration.conftest import TINY_NAME
from tests.integration.procs import Cluster, write_topology
from tests.integration.test_disagg_tiny import plain

STEP_DELAY_S = "0.03"  # gen servers decode slowly enough to be killed mid-stream (~33 tokens/s)
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def migration_cluster(tiny_model_dir, procs, tmp_path_factory) -> Cluster:
    """1 ctx + 2 gen servers. The gen servers run the engine in-process (``executor: inproc``): they
    start faster, and SIGKILL of the one process leaves no rank behind. Session affinity on a
    header puts both requests of the test on one gen server, so one kill hits both."""
    topo = write_topology(tmp_path_factory.mktemp("topo") / "migration.yaml", str(tiny_model_dir), TINY_NAME,
                          num_gen=2, orchestrator={"migration_limit": 2, "health_interval_s": 0.1,
                                                   "session_affinity": "header"})
    doc = yaml.safe_load(topo.read_text())
    doc["pools"]["gen"]["engine"] = {"executor": "inproc"}
    topo.write_text(yaml.safe_dump(doc))
    return Cluster(topo, procs).start(env={"gen": {"PDSERVE_TEST_STEP_DELAY_S": STEP_DELAY_S}})


CASES = (("/v1/completions", True), ("/v1/chat/completions", False))


def seeded(path: str, stream: bool) -> dict:
    body = {"model": TINY_NAME, "max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 1234, "ignore_eos": True,
            "stream": stream, "return_tokens_as_token_ids": True}
    if "chat" in path:
        return {**body, "messages": [{"role": "user", "content": "Tell me a story about the sea."}],
                "logprobs": True, "top_logprobs": 2}
    return {**body, "prompt": "Once upon a time, by the sea,", "logprobs": 2}


def run_lp(url: str, path: str, body: dict, headers: dict | None = None) -> tuple:
    """(text, finish_reason, usage, [(token, logprob) per output token]); a stream's chunks'
    logprobs concatenated."""
    chat = path.endswith("chat/completions")
    if body["stream"]:
        with httpx.stream("POST", url + path, json={**body, "stream_options": {"include_usage": True}},
                          timeout=60, headers=headers) as r:
            assert r.status_code == 200, r.read()
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert all("error" not in d for d in events), events
        usage = [d["usage"] for d in events if d.get("usage")][-1]
        choices = [c for d in events for c in d["choices"]]
        text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
        finish = [c["finish_reason"] for c in choices if c["finish_reason"]][-1]
    else:
        r = httpx.post(url + path, json=body, timeout=60, headers=headers)
        assert r.status_code == 200, r.text
        d = r.json()
        usage, choices = d["usage"], d["choices"]
        text, finish = (choices[0]["message"]["content"] if chat else choices[0]["text"]), choices[0]["finish_reason"]
    parts = [c["logprobs"] for c in choices if c.get("logprobs")]
    if chat:
        lp = [(e["token"], e["logprob"]) for p in parts for e in p["content"]]
    else:
        lp = [pair for p in parts for pair in zip(p["tokens"], p["token_logprobs"])]
    return text, finish, usage, lp


def run_in_session(url: str, path: str, stream: bool) -> tuple:
    """``run_lp`` with the session header that keeps both requests on one gen server."""
    return run_lp(url, path, seeded(path, stream), headers={"X-Session-Id": "migrate-me"})


def same_logprobs(got: list, ref: list) -> bool:
    """One entry per output token, the same tokens, logprobs within 1e-4 (the target re-prefilled)."""
    return [t for t, _ in got] == [t for t, _ in ref] and all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, ref))


def busy_gen_server(cluster: Cluster, n: int, timeout_s: float = 30.0) -> str:
    """The URL of the gen server with ``n`` requests in flight (per the orchestrator)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        servers = httpx.get(cluster.url + "/cluster/status", timeout=5).json()["pools"]["gen"]["servers"]
        busy = [s["url"] for s in servers if s.get("in_flight") == n]
        if busy:
            return busy[0]
        time.sleep(0.02)
    raise AssertionError(f"no gen server had {n} requests in flight")


def kill_gen_server(cluster: Cluster, url: str) -> None:
    """SIGKILL the gen server process listening at ``url`` (its connections break mid-stream)."""
    (i,) = [i for i in range(len(cluster.doc["pools"]["gen"]["servers"])) if cluster.server_url("gen", i) == url]
    proc = cluster.procs.procs.pop(f"gen{i}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def migrations(cluster: Cluster) -> float:
    for line in httpx.get(cluster.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve_orchestrator_migrations_total"):
            return float(line.split()[-1])
    return 0.0


def test_killed_gen_server_mid_decode_migrates_and_equals_the_undisturbed_runs(migration_cluster):
    c = migration_cluster
    reference = {case: run_lp(c.url, case[0], seeded(*case)) for case in CASES}
    for ref in reference.values():
        assert ref[1] == "length" and ref[2]["completion_tokens"] == MAX_TOKENS and len(ref[3]) == MAX_TOKENS
    results: dict = {}
    workers = [threading.Thread(target=lambda case=case: results.__setitem__(case, run_in_session(c.url, *case)),
                                daemon=True) for case in CASES]
    for w in workers:
        w.start()
    victim = busy_gen_server(c, len(CASES))
    time.sleep(0.4)  # ~a dozen tokens into the decode
    assert all(w.is_alive() for w in workers), "a request finished before the kill"
    kill_gen_server(c, victim)
    for w in workers:
        w.join(60)
    assert sorted(results) == sorted(CASES), "a migrated request did not finish"
    for case in CASES:  # same text, finish reason, prompt and completion tokens, logprobs without duplicates
        assert plain(results[case][:3]) == plain(reference[case][:3]), case
        assert same_logprobs(results[case][3], reference[case][3]), case
    assert migrations(c) == len(CASES)
    # The target continued from the tokens generated so far (a restart from token 1 would also
    # reproduce a seeded text): the orchestrator handed it more than the ctx server's first token.
    handed = [int(m) for m in re.findall(r"migrating the request \((\d+) generated tokens", c.procs.log("orchestrator"))]
    assert len(handed) == len(CASES) and all(1 < k < MAX_TOKENS for k in handed), handed
