"""What the HTTP server layer costs per request: uvicorn + raw ASGI vs a bare httptools protocol.

    .venv/bin/python bench/http_server_cost.py [--seconds 5] [--repeats 2]

Both servers answer every POST with the same streamed body (the 16 SSE events and ``[DONE]`` of
the overhead bench's requests, in two chunked writes), so the difference is the server layer
alone: uvicorn as the orchestrator runs it (uvloop, httptools, ``HeadWithBodyProtocol``, no proxy
headers, no access log) with a raw ASGI app, against an ``asyncio.Protocol`` that parses with
httptools and writes the answer itself (a task per request, as uvicorn makes). Server on core 1,
wrk (1 thread, 32 keep-alive connections) on core 0; prints req/s and the server's CPU µs per
request (``/proc/PID/stat`` user + system over the run), alternating the two servers. Needs
``wrk`` (``apt-get install -y wrk``).

Run as a server: ``http_server_cost.py --serve uvicorn|bare --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EVENT = (b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1796590000,'
         b'"model":"fake-model","choices":[{"index":0,"text":" tok","finish_reason":null,"logprobs":null}]}\n\n')
BODY = EVENT * 16 + b"data: [DONE]\n\n"
FIRST, REST = BODY[:len(EVENT)], BODY[len(EVENT):]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def asgi_app(scope, receive, send) -> None:
    """The answer as an ASGI app: read the body, a head, two body messages."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    await send({"type": "http.response.body", "body": FIRST, "more_body": True})
    await send({"type": "http.response.body", "body": REST, "more_body": False})


class BareProtocol(asyncio.Protocol):
    """The same answer from a bare httptools request parser (keep-alive, chunked body out)."""

    HEAD = b"".join([b"HTTP/1.1 200 OK\r\n", *[k + b": " + v + b"\r\n" for k, v in SSE_HEADERS],
                     b"transfer-encoding: chunked\r\n\r\n"])

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.parser = __import__("httptools").HttpRequestParser(self)
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.loop.create_task(self.answer())

    async def answer(self) -> None:
        self.transport.write(self.HEAD + b"%x\r\n" % len(FIRST) + FIRST + b"\r\n")  # type: ignore[attr-defined]
        self.transport.write(b"%x\r\n" % len(REST) + REST + b"\r\n0\r\n\r\n")  # type: ignore[attr-defined]


def serve(kind: str, port: int) -> None:
    import uvloop

    if kind == "uvicorn":
        import uvicorn

        from orchestrator.http_protocol import HeadWithBodyProtocol

        uvicorn.run(asgi_app, host="127.0.0.1", port=port, loop="uvloop", http=HeadWithBodyProtocol,
                    log_level="warning", access_log=False, lifespan="off", proxy_headers=False)
        return

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(BareProtocol, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(kind: str, seconds: int) -> tuple[float, float]:
    """(req/s, server CPU µs per request) of one wrk run against a fresh server of ``kind``."""
    from pdserve.ports import free_port

    port = free_port()
    proc = subprocess.Popen(["taskset", "-c", "1", sys.executable, __file__, "--serve", kind, "--port", str(port)])
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["curl", "-s", "-o", "/dev/null", "-X", "POST", f"http://127.0.0.1:{port}/"],
                             timeout=5).returncode != 0:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the {kind} server did not start")
            time.sleep(0.2)
        script = Path(f"/tmp/http_server_cost-{port}.lua")
        script.write_text('wrk.method = "POST"\nwrk.body = "{}"\nwrk.headers["Content-Type"] = "application/json"\n')
        cpu0 = cpu_s(proc.pid)
        out = subprocess.run(["taskset", "-c", "0", "wrk", "-t1", "-c32", f"-d{seconds}s", "-s", str(script),
                              f"http://127.0.0.1:{port}/v1/completions"], capture_output=True, text=True,
                             timeout=seconds + 60).stdout
        cpu = cpu_s(proc.pid) - cpu0
        script.unlink()
        done = int(re.search(r"(\d+) requests in", out).group(1))
        return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)), 1e6 * cpu / max(done, 1)
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", choices=("uvicorn", "bare"))
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seconds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    if a.serve:
        serve(a.serve, a.port)
        return 0
    print(f"1-min load average {os.getloadavg()[0]:.1f}")
    print("| server | req/s | server CPU µs/req |")
    print("|---|---:|---:|")
    for _ in range(a.repeats):
        for kind in ("uvicorn", "bare"):
            rps, us = measure(kind, a.seconds)
            print(f"| {kind} | {rps:.0f} | {us:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
