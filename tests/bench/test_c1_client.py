"""bench/_c1.py: the raw keep-alive client of the router latency benches, against scripted servers
on 127.0.0.1 (threads, bounded by socket timeouts)."""

from __future__ import annotations

import random
import socket
import sys
import threading

import pytest

from tests.integration.procs import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from _c1 import connect, interleaved, one_request, prompt_request  # noqa: E402

SSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
       b"e\r\ndata: {\"a\":1}\n\n\r\n" b"e\r\ndata: [DONE]\n\n\r\n" b"0\r\n\r\n")


class Server:
    """Answers every request on every connection with ``answer``; records (port, body) per request."""

    def __init__(self, answer: bytes) -> None:
        self.answer, self.seen = answer, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(5)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        conn.settimeout(5)
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    piece = conn.recv(65536)
                    if not piece:
                        return
                    buf += piece
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buf) < length:
                    buf += conn.recv(65536)
                self.seen.append(buf[:length])
                buf = buf[length:]
                conn.sendall(self.answer)

    def close(self) -> None:
        self.sock.close()


def test_one_request_times_first_sse_byte_and_last_chunk():
    srv = Server(SSE)
    try:
        sock = connect(srv.url)
        ttft, e2el = one_request(sock, srv.url, prompt_request(random.Random(0)))
        sock.close()
        assert 0 < ttft <= e2el < 5000
        assert b'"stream": true' in srv.seen[0]
    finally:
        srv.close()


def test_a_non_200_answer_is_an_error():
    srv = Server(b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nbad\r\n0\r\n\r\n")
    try:
        sock = connect(srv.url)
        with pytest.raises(RuntimeError, match="answered"):
            one_request(sock, srv.url, prompt_request(random.Random(0)))
        sock.close()
    finally:
        srv.close()


def test_interleaved_sends_each_prompt_to_every_target_on_one_connection_each():
    servers = {name: Server(SSE) for name in ("direct", "x", "y")}
    try:
        out = interleaved({n: s.url for n, s in servers.items()}, 6, seed=3, warmup=2)
        assert {n: len(v) for n, v in out.items()} == {"direct": 6, "x": 6, "y": 6}
        bodies = [s.seen for s in servers.values()]
        assert bodies[0] == bodies[1] == bodies[2] and len(bodies[0]) == 8  # same prompts, warm-up included
        assert len(set(bodies[0])) == 8  # a new prompt each time
    finally:
        for s in servers.values():
            s.close()
