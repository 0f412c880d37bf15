"""The relay's CPU per gen stream event: merged (parsed, rewritten, re-encoded) vs pass-through.

    .venv/bin/python bench/relay_cost.py [--events 16] [--requests 20000]

One request's gen stream of ``--events`` completion chunks in one upstream piece (what the overhead
bench's fake gen worker sends at once), through :class:`orchestrator.relay.GenRelay`'s per-event
merge, the way a pdserve gen server writes them: plain chunks with ``token_ids`` (no
``relay_head``) and pass-through events (``disaggregated_params.relay_head``: the first one, which
repeats the ctx server's token, is merged, the rest go out as written). Prints µs per request and
per event (best of 3 runs, on this process's core); no network, no event loop.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.metrics import Metrics  # noqa: E402
from orchestrator.progress import Progress  # noqa: E402
from orchestrator.relay import GenRelay  # noqa: E402
from orchestrator.sse import EventSplitter  # noqa: E402
from pdserve.protocol import RELAY_LINE  # noqa: E402

WORD = " tok"
HEAD = {"id": "cmpl-0123456789abcdef0123456789abcdef", "created": 1796590000}


def chunk(i: int, n: int, token_ids: bool) -> bytes:
    choice: dict = {"index": 0, "text": WORD}
    if token_ids:
        choice["token_ids"] = [1000 + i]
    choice.update(finish_reason="length" if i == n - 1 else None, logprobs=None)
    doc = {**HEAD, "object": "text_completion", "model": "fake-model", "choices": [choice], "usage": None}
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode()


def merged_piece(n: int) -> bytes:
    return b"".join(chunk(i, n, True) + b"\n\n" for i in range(n))


def passed_piece(n: int) -> bytes:
    return b"".join(RELAY_LINE + json.dumps([4 * i, 4 * i + 4, [1000 + i], "length" if i == n - 1 else None]).encode()
                    + b"\n" + chunk(i, n, False) + b"\n\n" for i in range(n))


def per_request_us(piece: bytes, requests: int) -> float:
    """µs to merge ``piece`` into a request whose client already has the first token (setup excluded)."""
    metrics, total = Metrics(), 0.0
    ctx = {"id": "x", "created": 1, "model": "fake-model",
           "choices": [{"index": 0, "text": WORD, "disaggregated_params": {"first_gen_tokens": [1000]}}]}
    for _ in range(requests):
        progress = Progress.for_body({"prompt": "x"}, chat=False)
        progress.take_ctx_answer(ctx, HEAD)
        relay = GenRelay(progress, None, 1, metrics, "/v1/completions", 0.0, False)  # type: ignore[arg-type]
        attempt, out = progress.attempt(), []
        t0 = time.perf_counter()
        for payload in EventSplitter().feed(piece):
            if relay._event(payload, attempt, out, "http://gen") is not None:
                raise RuntimeError("the scripted stream broke")
        total += time.perf_counter() - t0
        if progress.token_ids != list(range(1000, 1000 + piece.count(b"\n\n"))):
            raise RuntimeError("token ids lost")
    return 1e6 * total / requests


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=16)
    p.add_argument("--requests", type=int, default=20000)
    a = p.parse_args()
    print(f"| gen stream events | µs per request ({a.events} events) | µs per event |")
    print("|---|---:|---:|")
    for name, piece in (("merged (token_ids field)", merged_piece(a.events)),
                        ("pass-through (relay_head)", passed_piece(a.events))):
        us = min(per_request_us(piece, a.requests) for _ in range(3))
        print(f"| {name} | {us:.1f} | {us / a.events:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
