"""Real processes, tiny random Llama, 1 ctx + 4 gen servers: gen servers that leave mid-decode.

In file order, one gen server fewer after each (one cluster for all three: each start of a real
server costs the suite seconds):

1. **SIGTERM moves KV** (issue 14): SIGTERM to the gen server holding six requests (streams and a
   non-stream one) makes it ask the orchestrator (``POST /cluster/workers/drain``), which answers
   ``move_kv`` (the other gen server is ready): its streams end with ``moved`` events, the relay
   continues them on the other gen servers, which pull their KV; the server exits 0 within 5 s
   with its KV pool full. Every answer equals the undisturbed greedy run; no recompute (the gen
   servers together compute exactly the tokens an undisturbed gen phase computes, and the targets
   pull exactly the KV bytes the drained server sent).
2. **Kill migrates**: seeded requests whose gen server process is killed mid-decode continue on
   another gen server and equal the undisturbed runs token for token (stream and not).
3. **Kill continues every unfinished choice** (n > 1): seeded n = 3 and greedy n = 2 requests whose
   gen server is killed mid-decode continue choice by choice on another gen server (each as an
   n = 1 request with its ``choice_index``) and equal the undisturbed runs choice for choice; a
   choice that finished before the kill is not continued.
4. **Nowhere to move**: SIGTERM to the last gen server: the orchestrator answers ``wait``, its
   stream finishes there, exit 0.
"""

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
from tests.integration.test_drain_move import ask, body, run_all

STEP_DELAY_S = "0.03"  # gen servers decode slowly enough to be killed mid-stream (~33 tokens/s)
MAX_TOKENS = 48
NUM_GEN = 4
MOVE_TOKENS = 100      # SIGTERM test: ~3 s of decode, the SIGTERM lands mid-stream
MOVE_CASES = (("/v1/completions", True), ("/v1/chat/completions", True), ("/v1/completions", False))
SUMMARY = re.compile(r"drained \((\w+)\) in ([\d.]+) s: moved (\d+) request\(s\), (\d+) KV bytes sent; "
                     r"tokens computed (\d+); free blocks (\d+) of (\d+)")


@pytest.fixture(scope="module")
def migration_cluster(tiny_model_dir, procs, tmp_path_factory) -> Cluster:
    """1 ctx + 4 gen servers (one for each test to take away). The gen servers run the engine in-process (``executor: inproc``): they
    start faster, and SIGKILL of the one process leaves no rank behind. Session affinity on a
    header (and a balance threshold above any test's load) puts every request of a test on one gen
    server, so one kill or SIGTERM hits them all."""
    topo = write_topology(tmp_path_factory.mktemp("topo") / "migration.yaml", str(tiny_model_dir), TINY_NAME,
                          num_gen=NUM_GEN, orchestrator={"migration_limit": 2, "health_interval_s": 0.1,
                                                   "session_affinity": "header", "kv_aware_balance_threshold": 100})
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


def stream_events(url: str, path: str, body: dict, headers: dict | None) -> list[dict]:
    """Every ``data:`` event of one streamed request (usage asked for), [DONE] left out."""
    with httpx.stream("POST", url + path, json={**body, "stream_options": {"include_usage": True}},
                      timeout=60, headers=headers) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def run_lp(url: str, path: str, body: dict, headers: dict | None = None) -> tuple:
    """(text, finish_reason, usage, [(token, logprob) per output token]); a stream's chunks'
    logprobs concatenated."""
    chat = path.endswith("chat/completions")
    if body["stream"]:
        events = stream_events(url, path, body, headers)
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


def info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def gens(c: Cluster) -> dict[str, str]:
    """Live gen servers: process name -> URL."""
    return {f"gen{i}": c.server_url("gen", i) for i in range(NUM_GEN) if f"gen{i}" in c.procs.procs}


def decoding_gen(c: Cluster, n: int, timeout_s: float = 30.0) -> str:
    """The process name of the gen server decoding ``n`` requests."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, url in gens(c).items():
            if info(url).get("scheduled_requests", 0) >= n:
                return name
        time.sleep(0.05)
    raise AssertionError(f"no gen server decodes {n} requests: {[info(u) for u in gens(c).values()]}")


def sigterm(c: Cluster, name: str, timeout_s: float = 30.0) -> tuple[int, float]:
    """SIGTERM the process ``name``; (its exit status, seconds from the signal to its exit)."""
    proc = c.procs.procs.pop(name)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout_s)
    return code, time.monotonic() - t0


def counters(url: str) -> tuple[int, int]:
    """(tokens this engine computed, KV bytes it pulled)."""
    s = info(url)
    return s["tokens_computed"], s["kv_transfer"]["received"]["bytes"]


def metric(c: Cluster, name: str) -> float:
    for line in httpx.get(c.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_sigterm_moves_every_stream_to_the_other_gen_server_and_exits_0_in_seconds(migration_cluster):
    c = migration_cluster
    cases = list(MOVE_CASES) * 2  # 6 requests: streams and a non-stream one (streamed internally, so movable)
    expected = run_all(c, cases[:3], max_tokens=MOVE_TOKENS)
    assert all(usage["completion_tokens"] == MOVE_TOKENS for _, usage in expected)
    before = {name: counters(url) for name, url in gens(c).items()}
    results: dict = {}
    workers = run_all(c, cases, results, wait=False, max_tokens=MOVE_TOKENS)
    victim = decoding_gen(c, len(cases))
    others = [n for n in gens(c) if n != victim]
    time.sleep(0.3)  # a few tokens decoded there
    code, exit_s = sigterm(c, victim)
    for w in workers:
        w.join(120)
    assert not any(w.is_alive() for w in workers)
    log = c.procs.log(victim)
    assert code == 0 and exit_s < 5.0, (code, exit_s, log[-3000:])
    # One stream each, equal to the undisturbed run: same text, same usage, nothing repeated or missing.
    assert [results[i] for i in range(len(cases))] == expected * 2
    assert "SIGTERM: draining by moving KV" in log, log[-3000:]
    summary = SUMMARY.search(log)
    assert summary is not None, log[-3000:]
    print(f"SIGTERM -> {summary.group(0)}; exit {code} in {exit_s:.2f} s")
    mode, _, moved, sent, computed, free, total = summary.groups()
    assert mode == "move_kv" and int(moved) == len(cases) and int(free) == int(total), summary.group(0)
    after = {n: counters(gens(c)[n]) for n in others}
    pulled = sum(after[n][1] - before[n][1] for n in others)
    assert int(sent) > 0 and pulled == int(sent)  # pulled = parked there: nothing prefilled again
    # Undisturbed, a gen phase computes MOVE_TOKENS - 1 tokens (the ctx server sampled the first);
    # moved, the gen servers together compute exactly as many: no token is computed twice.
    computed_all = int(computed) - before[victim][0] + sum(after[n][0] - before[n][0] for n in others)
    assert computed_all == len(cases) * (MOVE_TOKENS - 1), computed_all
    assert metric(c, "pdserve_orchestrator_kv_moves_total") == len(cases)
    assert metric(c, "pdserve_orchestrator_migrations_total") == 0  # moved, never migrated


DECODED_BEFORE_KILL = 12  # tokens per request the victim decodes before the kill (of MAX_TOKENS)


def wait_decoded(url: str, tokens: int, timeout_s: float = 30.0) -> None:
    """Until the gen server at ``url`` has computed ``tokens`` tokens in all (``tokens_computed``)."""
    deadline = time.monotonic() + timeout_s
    while counters(url)[0] < tokens:
        assert time.monotonic() < deadline, f"{url} computed {counters(url)[0]} of {tokens} tokens in {timeout_s} s"
        time.sleep(0.02)


def test_killed_gen_server_mid_decode_migrates_and_equals_the_undisturbed_runs(migration_cluster):
    c = migration_cluster
    reference = {case: run_lp(c.url, case[0], seeded(*case)) for case in CASES}
    for ref in reference.values():
        assert ref[1] == "length" and ref[2]["completion_tokens"] == MAX_TOKENS and len(ref[3]) == MAX_TOKENS
    computed_before = {url: counters(url)[0] for url in gens(c).values()}
    results: dict = {}
    workers = [threading.Thread(target=lambda case=case: results.__setitem__(case, run_in_session(c.url, *case)),
                                daemon=True) for case in CASES]
    for w in workers:
        w.start()
    victim = busy_gen_server(c, len(CASES))
    # Kill once the victim has decoded ~a dozen tokens per request (counted, not timed: under load
    # a fixed sleep could land before its first decoded token, and the handed count below is 1).
    wait_decoded(victim, computed_before[victim] + DECODED_BEFORE_KILL * len(CASES))
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


def choices_body(path: str, stream: bool, n: int, **kw) -> dict:
    """A seeded n-choice body (sampled unless ``temperature`` 0) with logprobs of token ids."""
    return {**seeded(path, stream), "n": n, "temperature": 1.0, "seed": 77, **kw}


def run_choices(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[dict, dict]:
    """({index: (text, finish_reason, [output tokens from the logprobs])}, usage) of an n-choice
    request, stream or not; a stream's chunks merged per index (each index's first chat delta
    must name the role; one finish reason per index; one usage chunk)."""
    chat = path.endswith("chat/completions")
    out: dict = {}
    if body["stream"]:
        events = stream_events(url, path, body, headers)
        assert all("error" not in d for d in events), [d for d in events if "error" in d]
        usages = [d["usage"] for d in events if d.get("usage") and not d["choices"]]
        assert len(usages) == 1, usages
        for c in (c for d in events for c in d["choices"]):
            got = out.setdefault(c["index"], ["", None, []])
            if chat and not got[0] and not got[2]:
                assert c["delta"].get("role") == "assistant", c
            got[0] += (c["delta"].get("content") or "") if chat else c["text"]
            if c.get("finish_reason"):
                assert got[1] is None, ("two finish reasons", c)
                got[1] = c["finish_reason"]
            if c.get("logprobs"):
                got[2] += _tokens(c["logprobs"], chat)
        usage = usages[0]
    else:
        r = httpx.post(url + path, json=body, timeout=60, headers=headers)
        assert r.status_code == 200, r.text
        d = r.json()
        usage = d["usage"]
        assert [c["index"] for c in d["choices"]] == list(range(body["n"]))
        for c in d["choices"]:
            out[c["index"]] = [c["message"]["content"] if chat else c["text"], c["finish_reason"],
                               _tokens(c["logprobs"], chat) if c.get("logprobs") else []]
    return ({i: tuple(v) for i, v in sorted(out.items())},
            {k: v for k, v in usage.items() if k != "prompt_tokens_details"})


def _tokens(lp: dict, chat: bool) -> list:
    return [e["token"] for e in lp["content"]] if chat else list(lp["tokens"])


def stop_for_choice_0(choices: dict) -> str:
    """A piece of choice 0's text a few tokens in that no other choice's text holds: a stop string
    that ends choice 0 early (before the kill) and no other."""
    text = choices[0][0]
    for start in range(4, len(text) - 6):
        piece = text[start:start + 5]
        if piece.strip() and text.find(piece) == start and all(piece not in t for i, (t, _, _) in choices.items() if i):
            return piece
    raise AssertionError(f"no stop string for choice 0 in {text!r}")


CHOICE_CASES = ("completions n=3 stop", "chat n=3", "greedy n=2 non-stream")


def test_killed_gen_server_continues_every_unfinished_choice_and_equals_the_undisturbed_runs(migration_cluster):
    c = migration_cluster
    comp, chat = "/v1/completions", "/v1/chat/completions"
    probe, _ = run_choices(c.url, comp, choices_body(comp, True, 3))
    stop = stop_for_choice_0(probe)
    cases = dict(zip(CHOICE_CASES, [(comp, choices_body(comp, True, 3, stop=[stop])), (chat, choices_body(chat, True, 3)),
                                    (comp, choices_body(comp, False, 2, temperature=0))]))
    reference = {k: run_choices(c.url, path, b) for k, (path, b) in cases.items()}
    early = reference[CHOICE_CASES[0]][0][0]
    assert early[1] == "stop" and len(early[2]) < DECODED_BEFORE_KILL // 2, early  # choice 0 ends early
    for name, (choices, usage) in reference.items():
        going_on = [v for i, v in choices.items() if name != CHOICE_CASES[0] or i]
        assert all(f == "length" and len(toks) == MAX_TOKENS for _, f, toks in going_on), (name, choices)
        assert usage["completion_tokens"] == sum(len(t) for _, _, t in choices.values()), (name, usage)
    greedy = reference[CHOICE_CASES[2]][0]
    assert greedy[0] == greedy[1]  # greedy choices are alike
    assert len({v[0] for v in reference[CHOICE_CASES[1]][0].values()}) == 3  # sampled: each choice its own
    before = {url: counters(url)[0] for url in gens(c).values()}
    migrated_before = migrations(c)
    results: dict = {}
    workers = [threading.Thread(target=lambda k=k, path=path, b=b: results.__setitem__(
        k, run_choices(c.url, path, b, headers={"X-Session-Id": "choices"})), daemon=True)
        for k, (path, b) in cases.items()]
    for w in workers:
        w.start()
    victim = busy_gen_server(c, len(cases))
    # 8 choices decode there (one stops early): kill ~a dozen tokens into the others
    wait_decoded(victim, before[victim] + DECODED_BEFORE_KILL * 7)
    assert all(w.is_alive() for w in workers), "a request finished before the kill"
    kill_gen_server(c, victim)
    for w in workers:
        w.join(60)
    assert sorted(results) == sorted(cases), "a request with continued choices did not finish"
    for k in cases:  # choice by choice: text, finish reason, tokens (none repeated or missing); usage
        assert results[k] == reference[k], k
    log = c.procs.log("orchestrator")
    continued = re.findall(r"continuing \d+ unfinished choice\(s\) \[([\d, ]+)\]", log)
    assert sorted(continued) == sorted(["1, 2", "0, 1, 2", "0, 1"]), continued  # the stop case's choice 0 ended
    assert migrations(c) - migrated_before == 7


def test_the_last_gen_server_has_nowhere_to_move_and_drains_by_waiting(migration_cluster):
    c = migration_cluster
    (name, _), = gens(c).items()  # the SIGTERM and the kill above left one
    path, stream = MOVE_CASES[0]
    short = body(path, stream, 40)  # ~1.2 s of decode at the injected step delay
    expected = ask(c.url, path, short)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(ask(c.url, path, short)))
    worker.start()
    decoding_gen(c, 1)
    code, exit_s = sigterm(c, name)
    worker.join(60)
    log = c.procs.log(name)
    assert code == 0 and result == [expected], (code, result, log[-3000:])
    assert "SIGTERM: draining by waiting (no other gen server is ready to take its requests" in log, log[-3000:]
    summary = SUMMARY.search(log)
    assert summary is not None and summary.group(1) == "wait", log[-3000:]
    print(f"SIGTERM, nowhere to move -> {summary.group(0)}; exit {code} in {exit_s:.2f} s")
