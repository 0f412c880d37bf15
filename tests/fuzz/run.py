"""Run the fuzz against a live server over one keep-alive connection.

    python -m tests.fuzz.run --url http://127.0.0.1:8000 --kind orchestrator --n 1000 --model NAME

A dropped connection (EOF, reset, or ``Connection: close`` after anything but a 413) or a read
that times out counts as a failure with status 599, and the run reconnects. Exit status 0 when every case passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from urllib.parse import urlsplit

from tests.fuzz.bodies import KINDS, Case, dumps, generate
from tests.fuzz.harness import Answer, Report, run_cases
from tests.fuzz.keepalive import ConnectionDropped, KeepAlive

DROPPED = 599  # not an HTTP status: marks a connection the server dropped


class SocketSender:
    """``send`` for :func:`run_cases` over one :class:`KeepAlive` connection (reconnects after a drop)."""

    def __init__(self, url: str, timeout_s: float = 15.0) -> None:  # under harness.CASE_TIMEOUT_S
        parts = urlsplit(url)
        self.host, self.port, self.timeout_s = parts.hostname or "127.0.0.1", parts.port or 80, timeout_s
        self.conn = KeepAlive(self.host, self.port, timeout_s)
        self.connections = 1

    def _reconnect(self) -> None:
        self.conn.close()
        self.conn = KeepAlive(self.host, self.port, self.timeout_s)
        self.connections += 1

    def request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        try:
            answer = self.conn.request(method, path, body, headers)
        except ConnectionDropped as err:
            self._reconnect()
            return Answer(DROPPED, {}, f"connection dropped: {err}".encode())
        except TimeoutError:  # a hang: the connection is mid-answer, so it cannot be reused
            self._reconnect()
            return Answer(DROPPED, {}, f"no answer within {self.timeout_s} s".encode())
        if self.conn.closed:
            self._reconnect()
            if answer.status != 413:
                return Answer(DROPPED, {}, f"server closed the connection after a {answer.status}".encode())
        return answer

    async def send(self, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        return await asyncio.to_thread(self.request, "POST", path, body, headers)

    async def release_lease(self, case: Case, answer: Answer) -> None:
        """After a ctx server's context_only answer: free its lease (as the orchestrator would)."""
        if answer.status != 200 or b"ctx_request_id" not in answer.body:
            return
        params = json.loads(answer.body)["choices"][0].get("disaggregated_params") or {}
        if params.get("ctx_request_id"):
            body = dumps({"ctx_request_id": params["ctx_request_id"]})
            await asyncio.to_thread(self.request, "POST", "/disagg/release", body, {"content-type": "application/json"})

    def server_info(self) -> dict:
        answer = self.conn.request("GET", "/server_info")
        return json.loads(answer.body) if answer.status == 200 else {}


async def run_over_socket(url: str, kind: str, n: int, seed: int, model: str,
                          vocab_size: int = 49152) -> tuple[Report, SocketSender]:
    """Generate ``n`` cases for ``kind`` and run them against ``url`` over one connection."""
    sender = SocketSender(url)
    layout = sender.server_info().get("kv_layout") if kind == "gen" else None
    cases = generate(kind, n, seed, model=model, vocab_size=vocab_size, kv_layout=layout)
    report = await run_cases(sender.send, cases, model, after=sender.release_lease if kind == "ctx" else None)
    return report, sender


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="base URL of an orchestrator, ctx or gen server")
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--n", type=int, default=1000, help="number of cases (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--vocab-size", type=int, default=49152)
    args = p.parse_args(argv)
    report, sender = asyncio.run(run_over_socket(args.url, args.kind, args.n, args.seed, args.model, args.vocab_size))
    print(report.summary(limit=50))
    print(f"connections used: {sender.connections}")
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
