"""A lean concurrency-1 client for router latency: raw HTTP/1.1 keep-alive sockets, one streamed
completion at a time, and an *interleaved* schedule that sends each prompt to every target in turn.

Why interleaved: a 2-core VM's speed drifts by 10–50% over seconds (other tenants, frequency), and
runs of one target after another see different minutes of it, so the latency of target X minus
that of *direct* moves by more than the routers differ. Sent prompt by prompt, target after target
(the order rotating each prompt), every target sees the same instants: the drift cancels out of
the differences. The client is the same for every target (one socket each, ``TCP_NODELAY``), and
costs a few µs per request, far less than ``pdserve bench``'s asyncio/httpx client.

TTFT is the first SSE ``data:`` byte, E2EL the chunked body's last chunk (``0\\r\\n\\r\\n``), both
from the request's ``sendall`` (ms, ``time.perf_counter``). Every request is bounded by the socket's
10 s timeout.
"""

from __future__ import annotations

import json
import random
import socket
import time

WORDS = "alpha beta gamma delta omega sigma river stone cloud paper seven green quick brown fox".split()
SOCKET_TIMEOUT_S = 10.0


def connect(url: str) -> socket.socket:
    """A TCP connection to ``http://host:port`` (``TCP_NODELAY``, 10 s timeout per operation)."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    sock = socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def prompt_request(rng: random.Random, model: str = "fake-model", words: int = 32, max_tokens: int = 16) -> bytes:
    """The bytes of one streamed ``POST /v1/completions`` of ``words`` random words (a new prompt each call)."""
    body = json.dumps({"model": model, "prompt": " ".join(rng.choice(WORDS) for _ in range(words)),
                       "max_tokens": max_tokens, "stream": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


def one_request(sock: socket.socket, url: str, req: bytes, quickack: bool = True) -> tuple[float, float]:
    """One streamed completion on a keep-alive connection: (TTFT, E2EL) in ms.

    Raises:
        RuntimeError: the connection closed, or the answer is not a 200 SSE stream ending in [DONE].
        TimeoutError: no byte for 10 s (the socket's timeout).
    """
    t0 = time.perf_counter()
    sock.sendall(req)
    buf, first = b"", None
    while not buf.endswith(b"0\r\n\r\n"):  # the chunked body's last chunk
        if quickack:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)  # Linux resets it after some ACKs
        piece = sock.recv(65536)
        if not piece:
            raise RuntimeError(f"{url} closed the connection")
        buf += piece
        if first is None and b"data: " in buf:
            first = time.perf_counter()
    done = time.perf_counter()
    if b" 200 " not in buf[:16] or b"[DONE]" not in buf:
        raise RuntimeError(f"{url} answered {buf[:300]!r}")
    return 1e3 * ((first or done) - t0), 1e3 * (done - t0)


def interleaved(urls: dict[str, str], n: int, seed: int, warmup: int = 5) -> dict[str, list[tuple[float, float]]]:
    """``n`` prompts, each sent to every target of ``urls`` (name -> base URL) back to back, the
    order rotating by one target per prompt; one keep-alive connection per target, ``warmup``
    unrecorded prompts first. Returns name -> [(TTFT ms, E2EL ms)] in prompt order."""
    rng = random.Random(seed)
    names = list(urls)
    socks = {name: connect(urls[name]) for name in names}
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    try:
        for i in range(warmup + n):
            req = prompt_request(rng)
            k = i % len(names)
            for name in names[k:] + names[:k]:
                sample = one_request(socks[name], urls[name], req)
                if i >= warmup:
                    out[name].append(sample)
    finally:
        for sock in socks.values():
            sock.close()
    return out
