"""Experiment: where one request's time goes on each dispatch path (issue 13: generation_first
and kv_cache_aware against context_first and round_robin).

    .venv/bin/python bench/dispatch_trace.py [--requests 200] [--repeats 3] \\
        [--routers round_robin,kv_cache_aware] [--styles context_first,generation_first]

The setup of ``bench/orchestrator_overhead.py`` (its :func:`start`: fake workers A and B on core 0,
one orchestrator per router and style on core 1), with the fake workers started with ``--trace``.
The client is this process, pinned to core 0 like the overhead bench's: one keep-alive connection
per target, raw HTTP/1.1, one streamed completion at a time (a new 32-word prompt each, 16 tokens),
stamping ``time.monotonic()`` before writing the request (``send``), at the first body byte holding
an SSE event (``first``: TTFT) and at the end of the stream (``done``: E2EL). Every request
carries an ``X-Request-Id``, so the fake workers' step times for it (``GET /trace``,
:class:`fake_worker.StepTrace`) line up with the client's: CLOCK_MONOTONIC is one clock for all
processes of a host.

Per target it prints the median offset of every step from ``send`` (µs) and each process's CPU per
request (µs; user + system from ``/proc`` over the measured requests; the client's is this
process's). Targets alternate within each repeat. Raw JSON: ``bench/results/dispatch_trace.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

import orchestrator_overhead as oo  # noqa: E402
from _harness import RESULTS, Procs, loadavg, md_table, median, say, tree_cpu_s  # noqa: E402
from pdbench.datasets import WORDS  # noqa: E402

# Steps in the order they usually happen; A is the ctx (prefill) worker, B the gen (decode) one.
STEPS = ("A.ctx_in", "A.plain_in", "B.gen_in", "B.plain_in", "B.wait_sent", "A.lease_in", "A.ctx_out", "A.plain_out",
         "client.first", "A.lease_out", "B.wait_back", "B.gen_first", "B.gen_out", "B.plain_out", "client.done")
READ_TIMEOUT_S = 10.0
TRACE_SIZE = 100_000  # request ids each fake worker keeps step times for (more than one run sends)


def tag_of(name: str) -> str:
    """A target name as X-Request-Id characters (the orchestrator replaces an id it finds unsafe)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name)


class StreamClient:
    """One keep-alive HTTP/1.1 connection to ``url`` that POSTs streamed completions and times them.

    Expects the chunked answer that uvicorn (and hyper) give a stream; raises ConnectionError on a
    non-200 answer or a closed connection, socket.timeout past :data:`READ_TIMEOUT_S`."""

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").rpartition(":")
        self._host = f"{host}:{port}"
        self._sock = socket.create_connection((host, int(port)), timeout=READ_TIMEOUT_S)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stream(self, body: bytes, request_id: str) -> tuple[float, float, float]:
        """(send, first, done) ``time.monotonic()`` seconds of one streamed ``/v1/completions``."""
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {self._host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nX-Request-Id: {request_id}\r\n\r\n").encode()
        t_send = time.monotonic()
        self._sock.sendall(head + body)
        buf, t_first = b"", None
        while True:
            # ACK at once (Linux clears the flag after a while): a server that writes a stream in
            # small pieces with Nagle on would otherwise wait out our delayed ACK (40 ms) per piece.
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            data = self._sock.recv(1 << 16)
            now = time.monotonic()
            if not data:
                raise ConnectionError(f"connection closed after {len(buf)} bytes: {buf[:400]!r}")
            buf += data
            if t_first is None and b"data: " in buf:
                t_first = now
            if buf.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
                break
        if not buf.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in buf:
            raise ConnectionError(f"not a complete 200 stream: {buf[:300]!r}")
        return t_send, t_first, now

    def close(self) -> None:
        self._sock.close()


def run_target(url: str, n: int, rng: random.Random, tag: str) -> list[tuple[str, float, float, float]]:
    """``n`` sequential streamed requests with new 32-word prompts: (request id, send, first, done)."""
    client = StreamClient(url)
    out = []
    try:
        for i in range(n):
            prompt = " ".join(rng.choice(WORDS) for _ in range(32))
            body = json.dumps({"model": "fake-model", "prompt": prompt, "max_tokens": 16, "stream": True}).encode()
            rid = f"{tag}-{i}"
            out.append((rid, *client.stream(body, rid)))
    finally:
        client.close()
    return out


def steps_of(worker_urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """``{request id: {"A.step" or "B.step": t}}`` from both fake workers' ``/trace``."""
    merged: dict[str, dict[str, float]] = {}
    for name, url in worker_urls.items():
        letter = "A" if name == "worker_a" else "B"
        for rid, steps in httpx.get(url + "/trace", timeout=10, trust_env=False).json()["steps"].items():
            merged.setdefault(rid, {}).update({f"{letter}.{k}": v for k, v in steps.items()})
    return merged


def offsets_us(requests: list[tuple[str, float, float, float]], steps: dict[str, dict[str, float]]) -> dict[str, float]:
    """The median offset (µs) of each step from the client's send, over ``requests``."""
    per_step: dict[str, list[float]] = {}
    for rid, t_send, t_first, t_done in requests:
        marks = {**steps.get(rid, {}), "client.first": t_first, "client.done": t_done}
        for step, t in marks.items():
            per_step.setdefault(step, []).append(1e6 * (t - t_send))
    return {step: median(xs) for step, xs in per_step.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="measured requests per target and repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmups", type=int, default=20)
    p.add_argument("--routers", default="round_robin,kv_cache_aware")
    p.add_argument("--styles", default="context_first,generation_first")
    p.add_argument("--sglang-python", default=None, help="python of a venv with sglang-router (skipped if absent)")
    p.add_argument("--fake-ctx-signal", choices=("push", "pull"), default="push",
                   help="how the fake gen worker waits for the fake ctx worker (bench/fake_ctx_feed.py)")
    a = p.parse_args()
    ns = argparse.Namespace(sglang_python=a.sglang_python, pdserve_routers=a.routers, pdserve_workers="1",
                            styles=a.styles, router_cores="1")
    load0, t0 = loadavg(), time.monotonic()
    reqs: dict[str, list] = {}
    cpu: dict[str, dict[str, float]] = {}
    with Procs(RESULTS / "dispatch_trace" / "logs") as procs:
        urls = oo.start(procs, ns, worker_args=("--trace", str(TRACE_SIZE), "--ctx-signal", a.fake_ctx_signal))
        os.sched_setaffinity(0, {0})  # the client shares core 0 with the workers, as in the overhead bench
        pids = {"A": procs.procs["worker_a"].pid, "B": procs.procs["worker_b"].pid}
        for name, url in urls.items():
            run_target(url, a.warmups, random.Random(99), f"warm-{tag_of(name)}")
        for rep in range(a.repeats):
            for name, url in urls.items():
                router = oo.router_pid(procs, name)
                who = {**pids, **({"router": router} if router else {})}
                before = {k: tree_cpu_s(pid) for k, pid in who.items()} | {"client": time.process_time()}
                got = run_target(url, a.requests, random.Random(rep), f"r{rep}-{tag_of(name)}")
                after = {k: tree_cpu_s(pid) for k, pid in who.items()} | {"client": time.process_time()}
                reqs.setdefault(name, []).extend(got)
                for k in after:
                    cpu.setdefault(name, {}).setdefault(k, 0.0)
                    cpu[name][k] += after[k] - before[k]
                say(f"repeat {rep} {name}: TTFT p50 {1e3 * median([r[2] - r[1] for r in got]):.2f} ms, "
                    f"E2EL p50 {1e3 * median([r[3] - r[1] for r in got]):.2f} ms")
        steps = steps_of(procs.worker_urls)
    n = a.requests * a.repeats
    table = {name: offsets_us(r, steps) for name, r in reqs.items()}
    rows = [[step, *(f"{table[t][step]:.0f}" if step in table[t] else "—" for t in table)] for step in STEPS]
    rows += [[f"CPU µs/req: {k}", *(f"{1e6 * cpu[t][k] / n:.0f}" if k in cpu[t] else "—" for t in table)]
             for k in ("router", "A", "B", "client")]
    text = md_table(["step (µs after the client's send, median)", *table], rows)
    (RESULTS / "dispatch_trace.json").write_text(json.dumps({"requests": reqs, "steps": steps, "cpu_s": cpu,
                                                             "medians_us": table}, indent=1))
    print(text)
    say(f"{n} requests per target in {(time.monotonic() - t0) / 60:.1f} min; 1-min load average "
        f"{load0:.1f} -> {loadavg():.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
