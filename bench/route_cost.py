"""Experiment: CPU time of the orchestrator's routing call per request (no network, no servers).

    .venv/bin/python bench/route_cost.py [--requests 1000] [--router kv_cache_aware]

What is timed (``time.process_time``, so other processes on the machine do not count) is what
:meth:`orchestrator.disagg.DisaggFlow.handle` does for a request before its first upstream byte:
the prompt's route hint (token ids at the orchestrator and their KV block hashes, for
``kv_cache_aware``), the ctx and the gen pick, and the self-check's prediction for each. Two ctx
and two gen servers, every KV index synced; one ctx and one gen server hold the blocks of the
shared system prompt (``chat, shared system prompt``) and of the long prompts' 1,800-token prefix.
The tokenizer is SmolLM2's (``bench/results/overhead/tokenizer``, written by
``bench/orchestrator_overhead.py``; made here from the ``smollm2`` model if absent).

Workloads (``--requests`` each): 32-word completions, every prompt new (the overhead bench's
Python client) and the same prompt every time (its wrk run); 4-turn chats of ~150 words after a
shared ~120-word system prompt; ~2,000-token completions sharing their first 1,800 tokens. Prints
µs per request for each.

``--cold``: new 32-word prompts while every index is synced and empty (what the overhead bench's
fake workers report), two numbers: what happens before the ctx request is written, and the whole
request's routing work — :meth:`DisaggFlow._with_retries` for the ctx phase (the real
``_context_attempt``, its upstream write and read stubbed with a canned ctx answer, so the routing
tokens after the write and the hit self-check are counted) and for the gen pick (issue 13, fourth
and sixth passes: with no block held anywhere ``kv_cache_aware`` no longer tokenizes at all).

The checkout's own ``orchestrator`` is imported (its root goes on ``sys.path``), not whichever
one an editable install points to.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's orchestrator/, pdserve/

import httpx  # noqa: E402

from _harness import RESULTS, loadavg, say  # noqa: E402
from fake_worker import FakeWorker  # noqa: E402
from orchestrator.disagg import DisaggFlow, Exchange  # noqa: E402
from orchestrator.h1client import H1Client  # noqa: E402
from orchestrator.kv_index import KVIndexes  # noqa: E402
from orchestrator.kv_selfcheck import HitSelfCheck  # noqa: E402
from orchestrator.metrics import Metrics  # noqa: E402
from orchestrator.pools import ClusterPools, Pool, Server, ServerState  # noqa: E402
from orchestrator.prompt_tokens import PromptTokenizer  # noqa: E402
from orchestrator.router import make_router  # noqa: E402
from orchestrator.tasks import TaskOwner  # noqa: E402
from pdserve.config import OrchestratorSettings  # noqa: E402
from pdserve.kv_events import KVSnapshot  # noqa: E402

MODEL, DTYPE, BLOCK = "fake-model", "float32", 16
WORDS = ("alpha beta gamma delta omega sigma river stone cloud paper seven green quick brown fox jumps over "
         "lazy dog when where which because system answer question model token block cache").split()


def tokenizer_dir() -> Path:
    d = RESULTS / "overhead" / "tokenizer"
    if not (d / "tokenizer.json").exists():
        from engine.model_files import resolve_model_path
        from engine.tokenizer import Tokenizer

        Tokenizer.from_model_path(Path(resolve_model_path("smollm2"))).hf.save_pretrained(str(d))
    return d


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def workloads(n: int, seed: int = 0) -> dict[str, list[tuple[str, dict]]]:
    """name -> [(endpoint, validated-looking body)] (the routing code reads bodies as dicts)."""
    rng = random.Random(seed)
    system = words(rng, 120)
    prefix = words(rng, 1500)  # ~1,800 tokens
    same = words(rng, 32)
    comp = "/v1/completions"
    chat = "/v1/chat/completions"

    def chat_body(r: random.Random) -> dict:
        turns = [{"role": "system", "content": system}]
        for i in range(4):
            turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": words(r, 37)})
        return {"model": MODEL, "messages": turns, "max_tokens": 16}

    return {
        "32 words, new each time": [(comp, {"model": MODEL, "prompt": words(rng, 32)}) for _ in range(n)],
        "32 words, the same each time": [(comp, {"model": MODEL, "prompt": same}) for _ in range(n)],
        "chat, shared system prompt": [(chat, chat_body(rng)) for _ in range(n)],
        "2,000 tokens, 1,800 shared": [(comp, {"model": MODEL, "prompt": prefix + " " + words(rng, 160)})
                                       for _ in range(n)],
        "_prefixes": [(chat, {"model": MODEL, "messages": [{"role": "system", "content": system}]}),
                      (comp, {"model": MODEL, "prompt": prefix})],
    }


async def make_flow(router: str, tok_dir: Path) -> tuple[DisaggFlow, KVIndexes]:
    payload = FakeWorker("both", str(tok_dir), 0.0).tokenizer_payload()
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda req: httpx.Response(200, json=payload)))
    servers = {role: [Server(role, i, f"http://{role}{i}:1", state=ServerState.READY) for i in range(2)]
               for role in ("ctx", "gen")}
    pools = ClusterPools(Pool("ctx", servers["ctx"]), Pool("gen", servers["gen"]))
    indexes = KVIndexes()
    for s in pools.all_servers():
        indexes.get(s.url).load_snapshot(KVSnapshot("e", 0, ()))
    settings = OrchestratorSettings(router=router)
    metrics = Metrics()
    routers = {role: make_router(router, indexes=indexes) for role in ("ctx", "gen")}
    tokenizer = PromptTokenizer(client, [pools.gen, pools.ctx])
    flow = DisaggFlow(pools, routers, H1Client(1.0), settings, metrics, TaskOwner(), tokenizer, BLOCK, MODEL,
                      DTYPE, HitSelfCheck(indexes, BLOCK, metrics.registry))
    await flow._route_hint(Exchange("/v1/completions", {"model": MODEL, "prompt": "warm up"}))  # loads it
    assert tokenizer.loaded, "the tokenizer did not load"
    return flow, indexes


async def hold(flow: DisaggFlow, indexes: KVIndexes, endpoint: str, body: dict, url: str) -> None:
    """Make ``url``'s index hold the full blocks of ``body``'s prompt (as its KV events would say)."""
    hint = await flow._route_hint(Exchange(endpoint, body))
    index = indexes.get(url)
    index.load_snapshot(KVSnapshot("e", 0, tuple(index.hashes) + tuple(hint.block_hashes)))


async def route_one(flow: DisaggFlow, endpoint: str, body: dict) -> None:
    """The routing call: hint, both picks, both predictions (what handle() does before any I/O)."""
    ex = Exchange(endpoint, body)
    hint = ex.hint = await flow._route_hint(ex)
    for role in ("ctx", "gen"):
        server = flow._routers[role].pick(flow._pools.pool(role), set(), hint)
        flow._predict(server, hint)


async def before_ctx_write(router: str, n: int) -> float:
    """µs per request of what ``handle()`` does before the ctx request is written (route hint, ctx
    pick, its prediction) for new 32-word prompts while every index is synced and *empty* (a cold
    cluster, or the overhead bench's fake workers): ``kv_cache_aware`` then tokenizes after the
    write (``RouteHint.pending``), so this is the routing cost on the TTFT's critical path."""
    flow, _ = await make_flow(router, tokenizer_dir())
    rng = random.Random(1)
    bodies = [{"model": MODEL, "prompt": words(rng, 32)} for _ in range(n + 50)]
    for body in bodies[:50]:  # warm up
        ex = Exchange("/v1/completions", body)
        ex.hint = await flow._route_hint(ex)
    t0 = time.process_time()
    for body in bodies[50:]:
        ex = Exchange("/v1/completions", body)
        hint = ex.hint = await flow._route_hint(ex)
        server = flow._routers["ctx"].pick(flow._pools.pool("ctx"), set(), hint)
        if hint is None or getattr(hint, "pending", None) is None:  # a pending hint predicts after the write
            flow._predict(server, hint)
    return 1e6 * (time.process_time() - t0) / n


_CTX_ANSWER = {"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
               "usage": {"prompt_tokens": 33, "completion_tokens": 1, "total_tokens": 34},
               "choices": [{"index": 0, "text": " x", "finish_reason": None,
                            "disaggregated_params": {"ctx_request_id": "r", "cached_tokens": 0}}]}


async def whole_cold_request(router: str, n: int) -> float:
    """µs per request of the whole routing work of a request (no block held anywhere, new 32-word
    prompts): the route hint, ``_with_retries`` of the ctx phase through the real
    ``_context_attempt`` (upstream I/O stubbed: :data:`_CTX_ANSWER` comes back at once) and of the gen
    pick (a stub attempt)."""
    import contextlib

    from orchestrator import disagg, jsonio

    raw = jsonio.dumps(_CTX_ANSWER)

    async def start_post(*args, **kwargs):
        return contextlib.nullcontext()

    async def read_answer(*args, **kwargs):
        return raw

    async def gen_attempt(server):
        return server

    disagg.start_post, disagg.read_answer = start_post, read_answer  # this process only measures
    flow, _ = await make_flow(router, tokenizer_dir())
    rng = random.Random(2)
    bodies = [{"model": MODEL, "prompt": words(rng, 32)} for _ in range(n + 50)]

    async def one(body: dict) -> None:
        ex = Exchange("/v1/completions", body)
        hint = ex.hint = await flow._route_hint(ex)
        await flow._with_retries("ctx", lambda s: flow._context_attempt(ex, s), hint)
        await flow._with_retries("gen", gen_attempt, hint)

    for body in bodies[:50]:  # warm up
        await one(body)
    t0 = time.process_time()
    for body in bodies[50:]:
        await one(body)
    return 1e6 * (time.process_time() - t0) / n


async def measure(router: str, n: int) -> dict[str, float]:
    flow, indexes = await make_flow(router, tokenizer_dir())
    loads = workloads(n)
    for endpoint, body in loads.pop("_prefixes"):
        for url in ("http://ctx0:1", "http://gen0:1"):
            await hold(flow, indexes, endpoint, body, url)
    out = {}
    for name, requests in loads.items():
        for endpoint, body in requests[:20]:  # warm caches of every kind
            await route_one(flow, endpoint, dict(body))
        bodies = [(e, dict(b)) for e, b in requests]
        t0 = time.process_time()
        for endpoint, body in bodies:
            await route_one(flow, endpoint, body)
        out[name] = 1e6 * (time.process_time() - t0) / len(bodies)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--router", default="kv_cache_aware")
    p.add_argument("--cold", action="store_true", help="only the CPU before the ctx write, no block held anywhere")
    a = p.parse_args()
    load = loadavg()
    if a.cold:
        us = asyncio.run(before_ctx_write(a.router, a.requests))
        whole = asyncio.run(whole_cold_request(a.router, a.requests))
        say(f"router {a.router}, {a.requests} new 32-word prompts, no block held: {us:.1f} µs/request before the "
            f"ctx write, {whole:.1f} µs/request of routing work in all (ctx attempt with stubbed I/O, gen pick); "
            f"1-min load average {load:.1f} -> {loadavg():.1f}")
        return 0
    result = asyncio.run(measure(a.router, a.requests))
    say(f"router {a.router}, {a.requests} requests per workload, 1-min load average {load:.1f} -> {loadavg():.1f}")
    print("| workload | routing CPU µs/request |\n|---|---:|")
    for name, us in result.items():
        print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
