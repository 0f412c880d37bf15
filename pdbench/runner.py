"""Arrivals and concurrency: run a list of samples against a server, return the records.

Arrivals follow a Poisson process at ``request_rate`` requests/s (exponential gaps; with
``burstiness`` ≠ 1 the gaps are gamma-distributed with the same mean), or all at once for
``inf``. ``max_concurrency`` caps the requests in flight (a request's clock starts when it gets a
slot, as in ``vllm bench serve``). Every run is bounded: dispatching stops and in-flight requests
are cancelled at ``max_duration_s``.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from .client import RequestOptions, send_request
from .datasets import Sample
from .metrics import RequestRecord


@dataclass
class RunSettings:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    max_duration_s: float = 1800.0
    request_timeout_s: float = 600.0
    seed: int = 0
    progress: bool = True


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """``n`` gaps (s) before each request; all 0 for an infinite rate. Raises ValueError."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


def progress_bar(total: int, enabled: bool, desc: str):
    """A tqdm bar on stderr, or None (disabled, or tqdm not installed)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def make_client(settings: RunSettings, max_concurrency: int | None) -> httpx.AsyncClient:
    """One client for a run; the pool never queues a request behind another (no hidden TTFT)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_concurrency or 256)
    timeout = httpx.Timeout(settings.request_timeout_s, connect=10.0)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


async def warm_up(client: httpx.AsyncClient, samples: list[Sample], opts: RequestOptions,
                  concurrency: int) -> list[RequestRecord]:
    """Send ``samples`` (not measured) at most ``concurrency`` at a time."""
    sem = asyncio.Semaphore(max(1, concurrency))

    async def one(s: Sample) -> RequestRecord:
        async with sem:
            return await send_request(client, s, opts)

    return list(await asyncio.gather(*(one(s) for s in samples)))


async def dispatch(jobs: list[Callable[[], Awaitable[None]]], settings: RunSettings, bar=None) -> float:
    """Start each job after its arrival gap, at most ``max_concurrency`` at once; cancel whatever is
    still running at ``max_duration_s``. Returns the duration (s). A job fills in its own results."""
    gaps = arrival_gaps(len(jobs), settings.request_rate, settings.burstiness, settings.seed)
    sem = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None

    async def one(job: Callable[[], Awaitable[None]]) -> None:
        if sem is None:
            await job()
        else:
            async with sem:
                await job()
        if bar is not None:
            bar.update(1)

    start = time.perf_counter()
    deadline = start + settings.max_duration_s
    tasks: list[asyncio.Task] = []
    try:
        for job, gap in zip(jobs, gaps):
            if gap > 0:
                await asyncio.sleep(min(gap, max(0.0, deadline - time.perf_counter())))
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(one(job)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=10.0)
    finally:
        for t in tasks:
            t.cancel()
        if bar is not None:
            bar.close()
    return time.perf_counter() - start


def cut_message(settings: RunSettings) -> str:
    """The error of a request the run's ``max_duration_s`` cut or never started."""
    return f"not finished within --max-duration {settings.max_duration_s:g} s"


async def run_load(client: httpx.AsyncClient, samples: list[Sample], opts: RequestOptions,
                   settings: RunSettings, desc: str = "bench") -> tuple[list[RequestRecord], float]:
    """Send ``samples`` with the configured arrivals; return (records in sample order, duration s)."""
    records: list[RequestRecord | None] = [None] * len(samples)

    def job(i: int, s: Sample) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            records[i] = await send_request(client, s, opts)
        return run

    bar = progress_bar(len(samples), settings.progress, desc)
    duration = await dispatch([job(i, s) for i, s in enumerate(samples)], settings, bar)
    out = [r if r is not None else RequestRecord(ok=False, error=cut_message(settings), prompt_tokens=s.prompt_len)
           for r, s in zip(records, samples)]
    return out, duration
