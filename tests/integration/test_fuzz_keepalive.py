"""The bad-input fuzz against real processes (tiny cluster: 1 ctx + 1 gen + orchestrator), 100 cases
per server kind, each kind over ONE keep-alive connection: no 5xx, the connection is never
dropped, and a greedy request on it answers exactly as before. A body over the size limit is a
413 that closes the connection; the next connection is served."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest

from pdserve.request_body import MAX_BODY_BYTES
from tests.fuzz.bodies import KINDS, completion_body, dumps
from tests.fuzz.harness import error_problem, probe_request, probe_text
from tests.fuzz.keepalive import KeepAlive
from tests.fuzz.run import run_over_socket

N_CASES = 100


def url_of(cluster, kind: str) -> str:
    return cluster.url if kind == "orchestrator" else cluster.server_url(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_over_one_keepalive_connection(tiny_cluster, kind):
    report, sender = asyncio.run(run_over_socket(url_of(tiny_cluster, kind), kind, N_CASES, seed=7,
                                                 model=tiny_cluster.model))
    sender.conn.close()
    assert not report.failures, report.summary()
    assert sender.connections == 1 and report.probes >= 1


@pytest.mark.parametrize("kind", KINDS)
def test_oversized_body_is_413_and_closes_only_that_connection(tiny_cluster, kind):
    parts = urlsplit(url_of(tiny_cluster, kind))
    conn = KeepAlive(parts.hostname, parts.port)
    body = dumps(completion_body(tiny_cluster.model))
    # Announce one byte over the limit but send only a small body: the server must answer from the
    # header alone, without waiting for (or reading) the rest.
    conn.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1) + body)
    answer = conn._read()
    conn.close()
    assert answer.status == 413 and error_problem(answer.body) is None, answer
    assert answer.headers.get("connection") == "close" and conn.closed
    fresh = KeepAlive(parts.hostname, parts.port)
    path, probe = probe_request(tiny_cluster.model)
    assert probe_text(fresh.request("POST", path, probe, {"content-type": "application/json"}))
    fresh.close()


def test_fuzz_cli_against_a_live_orchestrator(tiny_cluster, capsys):
    from tests.fuzz.run import main

    assert main(["--url", tiny_cluster.url, "--kind", "orchestrator", "--n", "40", "--seed", "3",
                 "--model", tiny_cluster.model]) == 0
    out = capsys.readouterr().out
    assert out.startswith("0 failures") and "connections used: 1" in out
