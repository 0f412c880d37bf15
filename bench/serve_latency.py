"""Serving latency benchmark: N concurrent streaming chat requests against an OpenAI endpoint.

    python bench/serve_latency.py --url http://127.0.0.1:8000 --num-requests 32 --concurrency 4

Prints TTFT, TPOT and ITL (ms: mean / p50 / p99) and throughput. Definitions follow
``vllm bench serve``: TTFT = time to the first content token; ITL = gaps between content chunks;
TPOT = (E2EL - TTFT) / (output_tokens - 1), per request, for requests with > 1 output token.
Output tokens come from the stream's usage chunk (``include_usage``), else the content chunk count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = "the quick brown fox jumps over the lazy dog while a curious cat watches from the fence".split()


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


def make_prompt(n_words: int, i: int) -> str:
    """About ``n_words`` words (roughly that many tokens), distinct per request."""
    return f"Request {i}. " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n_words))


async def fetch_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model id served at ``url``. Raises httpx.HTTPError."""
    r = await client.get(f"{url}/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    """Stream one chat completion and time its content chunks."""
    start = time.perf_counter()
    times: list[float] = []
    usage_tokens = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Result(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return Result(ok=False, error=str(event["error"].get("message")))
                if event.get("usage"):
                    usage_tokens = event["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    times.append(time.perf_counter())
    except httpx.HTTPError as err:
        return Result(ok=False, error=f"{type(err).__name__}: {err}")
    end = time.perf_counter()
    if not times:
        return Result(ok=False, error="no content in the stream")
    return Result(ok=True, ttft_s=times[0] - start, e2el_s=end - start,
                  output_tokens=usage_tokens or len(times), itl_s=[b - a for a, b in zip(times, times[1:])])


def stats_ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    ms = sorted(v * 1000 for v in values)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return f"mean {statistics.fmean(ms):8.2f}  p50 {statistics.median(ms):8.2f}  p99 {p99:8.2f}"


def report(results: list[Result], wall_s: float) -> None:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tpot = [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl_s]
    out_tokens = sum(r.output_tokens for r in ok)
    print(f"requests: {len(ok)} ok, {len(failed)} failed, wall {wall_s:.2f} s")
    print(f"throughput: {len(ok) / wall_s:.2f} req/s, {out_tokens / wall_s:.1f} output tok/s")
    print(f"TTFT (ms): {stats_ms([r.ttft_s for r in ok])}")
    print(f"TPOT (ms): {stats_ms(tpot)}")
    print(f"ITL  (ms): {stats_ms(itl)}")
    print(f"E2EL (ms): {stats_ms([r.e2el_s for r in ok])}")
    for r in failed[:5]:
        print(f"  failed: {r.error}")


async def run(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = args.model or await fetch_model(client, url)
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded(i: int) -> Result:
            body = {"model": model, "messages": [{"role": "user", "content": make_prompt(args.prompt_len, i)}],
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with sem:
                return await one_request(client, url, body)

        start = time.perf_counter()
        tasks = [asyncio.create_task(bounded(i)) for i in range(args.num_requests)]
        done, pending = await asyncio.wait(tasks, timeout=args.total_timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
        wall = time.perf_counter() - start
    results = [t.result() for t in done]
    results += [Result(ok=False, error=f"not finished within --total-timeout {args.total_timeout:g} s")] * len(pending)
    report(results, wall)
    return 0 if all(r.ok for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="orchestrator (or any server) base URL")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in words (~tokens)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--total-timeout", type=float, default=1800.0, help="seconds for the whole run")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--num-requests, --concurrency and --max-tokens must be >= 1")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
