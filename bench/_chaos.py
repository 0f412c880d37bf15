"""The chaos scenario of issue 14 (part 5), shared by ``tests/control_plane/test_chaos.py`` (tiny
model) and ``bench/chaos.py`` (SmolLM2): a bounded number of streaming greedy chat requests at a
fixed concurrency against an orchestrator whose local launcher owns the servers, while ``kill -9``
lands on chosen processes (a server's rank 0 or its frontend) at fixed times.

Every request ends within ``bound_s`` or counts as **hung**; one that ends with ``[DONE]``, a
finish reason and no error event is **completed**, and **identical** when its text equals the
undisturbed greedy run of the same prompt (:func:`reference_texts`, taken before the kills on
the same cluster). For each kill the watcher records when the orchestrator next shows the server
at that address ``ready`` with a pid other than the killed server's (its replacement).

The orchestrator's ``/cluster/status`` (pools -> servers with ``url``, ``state``, ``pid``) and each
server's ``/server_info`` (``ranks``, ``free_blocks``, ``total_blocks``, ``parked_leases``) are the
only things read; nothing here imports the servers' code.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class Kill:
    """One ``kill -9``: ``at_s`` seconds after the load starts, of server ``index`` of ``pool``
    (its place in ``/cluster/status`` at the start); ``target`` is ``"rank0"`` (the engine's rank 0,
    from ``/server_info``) or ``"frontend"`` (the server's own process, frontend 0). With
    ``after_replacement_of`` (an index into the plan) it also waits, at least ``gap_s`` more, for
    that kill's replacement to be ready, so that a cold start slower than planned (a loaded machine)
    does not leave a pool empty; the time it really fired is in :class:`KillRecord`."""

    at_s: float
    pool: str
    index: int
    target: str
    after_replacement_of: int | None = None
    gap_s: float = 1.0


@dataclass
class KillRecord:
    """What happened to one :class:`Kill`: the server's address, its pid before, the pid killed,
    when (seconds after the load started) and how long until its replacement was shown ready
    (seconds after the kill; None if it never was within the watch)."""

    kill: Kill
    url: str
    server_pid: int
    killed_pid: int
    t_kill_s: float | None = None
    ready_after_s: float | None = None


@dataclass
class Outcome:
    """One request: prompt index, streamed text, finish reason, error message, seconds it took."""

    prompt: int
    text: str = ""
    finish: str | None = None
    error: str | None = None
    elapsed_s: float = 0.0
    hung: bool = False

    @property
    def completed(self) -> bool:
        return not self.hung and self.error is None and self.finish is not None


@dataclass
class ChaosLoad:
    """The load: ``n`` streaming chat requests over ``prompts`` (round robin) at ``concurrency``,
    ``max_tokens`` each (``ignore_eos``, greedy), each bounded by ``bound_s`` seconds. Starts are
    at least ``interval_s`` apart, and no request starts once :attr:`stop` is set (the suite's chaos
    run sets it ``tail_s`` after the last replacement is ready, so there ``n`` is an upper bound;
    ``bench/chaos.py`` never sets it during the kills, so all ``n`` run)."""

    url: str
    model: str
    prompts: list[str]
    n: int
    concurrency: int
    max_tokens: int
    bound_s: float
    interval_s: float = 0.0
    duration_s: float = 0.0
    not_started: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


def chat_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict, out: Outcome) -> None:
    """POST one streaming chat request and fill ``out`` (text, finish reason, error) from its SSE
    events (OpenAI chat chunks; an ``{"error": ...}`` event is how a broken stream ends)."""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = str(event["error"].get("message"))[:200]
                continue
            for choice in event.get("choices", []):
                out.text += choice.get("delta", {}).get("content") or ""
                out.finish = choice.get("finish_reason") or out.finish
    if out.finish is None and out.error is None:
        out.error = "the stream ended without a finish reason"


async def one_request(client: httpx.AsyncClient, load: ChaosLoad, i: int) -> Outcome:
    """Request ``i`` of ``load``; a request past ``load.bound_s`` is cancelled and marked hung."""
    out = Outcome(prompt=i % len(load.prompts))
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(stream_chat(client, load.url, chat_body(load.model, load.prompts[out.prompt],
                                                                        load.max_tokens), out), load.bound_s)
    except asyncio.TimeoutError:
        out.hung = True
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        out.error = f"{type(err).__name__}: {err}"[:200]
    out.elapsed_s = time.monotonic() - t0
    return out


async def run_load(load: ChaosLoad) -> list[Outcome]:
    """Run every request of ``load`` (``concurrency`` at a time); returns them in request order."""
    sem = asyncio.Semaphore(load.concurrency)
    # The client's own timeout is past the bound, so a stalled stream is seen as hung, not as an error.
    timeout = httpx.Timeout(load.bound_s + 10, connect=10)
    limits = httpx.Limits(max_connections=load.concurrency * 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        t0 = time.monotonic()

        async def gated(i: int) -> Outcome | None:
            delay = t0 + i * load.interval_s - time.monotonic()
            if delay > 0:  # wait for this request's start, or for the stop (then it never starts)
                try:
                    await asyncio.wait_for(load.stop.wait(), delay)
                    load.not_started += 1
                    return None
                except asyncio.TimeoutError:
                    pass
            async with sem:
                if load.stop.is_set():
                    load.not_started += 1
                    return None
                return await one_request(client, load, i)

        done = await asyncio.gather(*(gated(i) for i in range(load.n)))
        load.outcomes = [o for o in done if o is not None]
        load.duration_s = time.monotonic() - t0
    return load.outcomes


async def reference_texts(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
                          bound_s: float) -> list[str]:
    """The undisturbed greedy text of every prompt (one streaming request each). Raises
    AssertionError if any of them fails: a reference must be clean."""
    load = ChaosLoad(url, model, prompts, len(prompts), concurrency, max_tokens, bound_s)
    outs = await run_load(load)
    bad = [(o.prompt, o.error, o.hung) for o in outs if not o.completed]
    assert not bad, f"the undisturbed reference run failed: {bad}"
    return [o.text for o in outs]


def cluster_status(url: str) -> dict:
    return httpx.get(url + "/cluster/status", timeout=5, trust_env=False).json()


def plan_victims(url: str, kills: list[Kill]) -> list[KillRecord]:
    """Resolve each kill's address and pid now (before the load); raises AssertionError when a
    server has no pid yet or a kill names the same server twice."""
    status = cluster_status(url)
    records = []
    for k in kills:
        server = status["pools"][k.pool]["servers"][k.index]
        assert server.get("pid"), f"no pid for {server}"
        pid = server["pid"]
        if k.target == "rank0":
            ranks = httpx.get(server["url"] + "/server_info", timeout=10, trust_env=False).json()["ranks"]
            pid = next(r["pid"] for r in ranks if r["rank"] == 0)
        records.append(KillRecord(k, server["url"], server["pid"], pid))
    assert len({r.url for r in records}) == len(records), "each kill must hit a different server"
    return records


def _replacement_ready(status: dict, rec: KillRecord) -> bool:
    servers = status["pools"][rec.kill.pool]["servers"]
    return any(s["url"] == rec.url and s["state"] == "ready" and s.get("pid") not in (None, rec.server_pid)
               for s in servers)


async def kill_and_watch(url: str, rec: KillRecord, t0: float, watch_s: float, back: dict[int, asyncio.Event],
                         me: int, poll_s: float = 0.1) -> None:
    """Sleep until ``t0 + at_s`` (and, with ``after_replacement_of``, until that kill's ``back``
    event plus ``gap_s``; not firing at all if it is not set within ``watch_s``), ``kill -9`` the planned pid, then poll ``/cluster/status`` until the
    replacement is ready (sets ``back[me]``) or ``watch_s`` seconds pass (``ready_after_s`` stays
    None)."""
    await asyncio.sleep(max(0.0, t0 + rec.kill.at_s - time.monotonic()))
    if rec.kill.after_replacement_of is not None:
        try:
            await asyncio.wait_for(back[rec.kill.after_replacement_of].wait(), watch_s)
        except asyncio.TimeoutError:
            return  # never fired: t_kill_s stays None
        await asyncio.sleep(rec.kill.gap_s)
    t_kill = time.monotonic()
    rec.t_kill_s = t_kill - t0
    os.kill(rec.killed_pid, signal.SIGKILL)
    async with httpx.AsyncClient(timeout=2, trust_env=False) as client:
        while time.monotonic() - t_kill < watch_s:
            try:
                status = (await client.get(url + "/cluster/status")).json()
            except httpx.HTTPError:
                status = None
            if status and _replacement_ready(status, rec):
                rec.ready_after_s = time.monotonic() - t_kill
                back[me].set()
                return
            await asyncio.sleep(poll_s)


async def run_chaos(load: ChaosLoad, records: list[KillRecord], watch_s: float,
                    tail_s: float | None) -> list[Outcome]:
    """The load and every kill (with its watcher) at once. With ``tail_s`` a number, no request
    starts later than ``tail_s`` after the last watcher ended (``load.n`` is then a cap); with
    ``tail_s=None`` every one of the ``load.n`` requests runs (the issue's fixed count). Returns when
    every request has ended and every watcher is done (each within its ``at_s + 2 * watch_s``)."""
    t0 = time.monotonic()
    back = {i: asyncio.Event() for i in range(len(records))}
    watchers = [asyncio.create_task(kill_and_watch(load.url, r, t0, watch_s, back, i))
                for i, r in enumerate(records)]
    load_task = asyncio.create_task(run_load(load))
    await asyncio.gather(*watchers)
    if tail_s is not None:
        await asyncio.sleep(tail_s)
        load.stop.set()
    return await load_task


def tally(outcomes: list[Outcome], refs: list[str]) -> dict:
    """Counts: requests, completed, identical (completed and text == the reference), failed
    (ended otherwise: an error, or no finish reason), hung (completed + failed + hung = requests); plus the slowest request in seconds and a few error messages."""
    identical = sum(o.completed and o.text == refs[o.prompt] for o in outcomes)
    errors = sorted({o.error for o in outcomes if o.error})
    return {"requests": len(outcomes), "completed": sum(o.completed for o in outcomes), "identical": identical,
            "failed": sum(not o.completed and not o.hung for o in outcomes), "hung": sum(o.hung for o in outcomes),
            "slowest_s": max((o.elapsed_s for o in outcomes), default=0.0), "errors": errors[:5]}


def wait_all_ready(url: str, sizes: dict[str, int], timeout_s: float, poll_s: float = 0.2) -> dict:
    """Poll until every pool has ``sizes[pool]`` servers, all ready; returns that status. Raises
    AssertionError with the last status after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = cluster_status(url)
        pools = status["pools"]
        if all(len(pools[p]["servers"]) == n and all(s["state"] == "ready" for s in pools[p]["servers"])
               for p, n in sizes.items()):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"pools not all ready after {timeout_s:g} s: "
                                 f"{[(s['url'], s['state']) for p in sizes for s in pools[p]['servers']]}")
        time.sleep(poll_s)


def kv_pools(status: dict) -> dict[str, tuple[int, int, int]]:
    """Per server URL: (free blocks, total blocks, parked leases) from its ``/server_info``."""
    out = {}
    for pool in status["pools"].values():
        for s in pool["servers"]:
            info = httpx.get(s["url"] + "/server_info", timeout=10, trust_env=False).json()
            out[s["url"]] = (info["free_blocks"], info["total_blocks"], info.get("parked_leases", 0))
    return out


def wait_kv_full(status: dict, timeout_s: float, poll_s: float = 0.25) -> dict[str, tuple[int, int, int]]:
    """Poll until every server's KV pool is full (free == total, no parked lease); returns the last
    reading either way (the caller asserts on it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = kv_pools(status)
        if all(free == total and parked == 0 for free, total, parked in pools.values()) \
                or time.monotonic() > deadline:
            return pools
        time.sleep(poll_s)
