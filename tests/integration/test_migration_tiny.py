"""Real processes, tiny random Llama: a seeded request whose gen server process is killed mid-decode
continues on another gen server and equals the undisturbed run token for token (stream and not)."""

from __future__ import annotations

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
from tests.integration.test_disagg_tiny import plain, run

STEP_DELAY_S = "0.03"  # gen servers decode slowly enough to be killed mid-stream (~33 tokens/s)
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def migration_cluster(tiny_model_dir, procs, tmp_path_factory) -> Cluster:
    """1 ctx + 3 gen servers: each test kills one gen server's process and needs another to migrate
    to. The gen servers run the engine in-process (``executor: inproc``): they start faster, and
    SIGKILL of the one process leaves no rank behind."""
    topo = write_topology(tmp_path_factory.mktemp("topo") / "migration.yaml", str(tiny_model_dir), TINY_NAME,
                          num_gen=3, orchestrator={"migration_limit": 2, "health_interval_s": 0.1})
    doc = yaml.safe_load(topo.read_text())
    doc["pools"]["gen"]["engine"] = {"executor": "inproc"}
    topo.write_text(yaml.safe_dump(doc))
    return Cluster(topo, procs).start(env={"gen": {"PDSERVE_TEST_STEP_DELAY_S": STEP_DELAY_S}})


def seeded(path: str, stream: bool) -> dict:
    body = {"model": TINY_NAME, "max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 1234, "ignore_eos": True,
            "stream": stream}
    if "chat" in path:
        return {**body, "messages": [{"role": "user", "content": "Tell me a story about the sea."}]}
    return {**body, "prompt": "Once upon a time, by the sea,"}


def busy_gen_server(cluster: Cluster, timeout_s: float = 20.0) -> str:
    """The URL of the one gen server with a request in flight (per the orchestrator)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        servers = httpx.get(cluster.url + "/cluster/status", timeout=5).json()["pools"]["gen"]["servers"]
        busy = [s["url"] for s in servers if s.get("in_flight")]
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.02)
    raise AssertionError("no gen server took the request")


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


@pytest.mark.parametrize("path,stream", [("/v1/completions", True), ("/v1/chat/completions", False)])
def test_killed_gen_rank_mid_decode_migrates_and_equals_the_undisturbed_run(migration_cluster, path, stream):
    c = migration_cluster
    reference = run(c.url, path, seeded(path, stream))
    assert reference[1] == "length" and reference[2]["completion_tokens"] == MAX_TOKENS
    before = migrations(c)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(run(c.url, path, seeded(path, stream))), daemon=True)
    worker.start()
    victim = busy_gen_server(c)
    time.sleep(0.4)  # ~a dozen tokens into the decode
    assert worker.is_alive(), "the request finished before the kill"
    kill_gen_server(c, victim)
    worker.join(60)
    assert not worker.is_alive() and result, "the migrated request did not finish"
    assert plain(result[0]) == plain(reference)  # same text, finish reason, prompt and completion tokens
    assert migrations(c) == before + 1
    # The target continued from the tokens generated so far (a restart from token 1 would also
    # reproduce a seeded text): the orchestrator handed it more than the ctx server's first token.
    handed = [int(m) for m in re.findall(r"migrating the request \((\d+) generated tokens", c.procs.log("orchestrator"))]
    assert len(handed) == before + 1 and 1 < handed[-1] < MAX_TOKENS, handed
