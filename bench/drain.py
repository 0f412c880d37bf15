"""Drain time of a gen server with long streams in flight: KV-move vs wait-for-finish (issue 14 part 3).

Two clusters, one after the other in the same run, each 1 ctx + 2 gen servers launched by the
orchestrator's local launcher (same topology but ``orchestrator.drain_mode``): 16 long greedy
streams go out at once (round robin puts about half on each gen server); once every stream has
``--warm-tokens`` tokens, ``POST /cluster/pools/gen/scale {"instances": 1}`` retires one gen
server. Measured: from the scale call to the retired server gone from the pool (its process
stopped), how many streams were on it, and that every stream completed with the same text in
both modes (greedy: the moved streams equal the undisturbed ones). Bounded: every request and
wait has a timeout (``--bound-s``).

    .venv/bin/python bench/drain.py [--model smollm2|tiny] [--streams 16] [--max-tokens 256]
                                    [--warm-tokens 16] [--section drain] [--no-doc]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import yaml  # noqa: E402

from bench._chaos import cluster_status, wait_all_ready  # noqa: E402
from bench._harness import Procs, conditions, free_port, loadavg, md_table, say, update_section  # noqa: E402

PROMPTS = [f"Write a long story about {t}." for t in (
    "the sea", "a mountain", "a lighthouse", "the desert", "a city at night", "a forest", "a river", "the moon",
    "a train journey", "a library", "a storm", "a garden", "an old ship", "a market", "the winter", "a bridge")]


def topology(model_path: str, model_name: str, log_dir: Path, mode: str, block_size: int) -> dict:
    return {
        "model": {"path": model_path, "name": model_name},
        "engine": {"dtype": "float32", "block_size": block_size, "num_kv_blocks": 512, "max_batch_size": 16,
                   "num_threads": 1},
        "kv_transfer": {"lease_ms": 30000, "timeout_ms": 10000},
        "orchestrator": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 0.2, "drain_timeout_s": 600,
                         "startup_timeout_s": 600, "drain_mode": mode, "migration_limit": 2},
        "launcher": {"kind": "local", "log_dir": str(log_dir), "grace_s": 10, "monitor_interval_s": 0.2},
        "pools": {"ctx": {"servers": [{"port": 0}]}, "gen": {"servers": [{"port": 0}, {"port": 0}], "min_instances": 1}},
    }


async def one_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                     counts: list[int], i: int, bound_s: float) -> tuple[str, str | None]:
    """(text, error or None) of one streaming chat request; ``counts[i]`` tracks its chunks."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    text = ""
    try:
        async with asyncio.timeout(bound_s):
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return text, f"HTTP {r.status_code}"
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return text, str(event["error"].get("message"))
                    for choice in event.get("choices", []):
                        text += (choice.get("delta") or {}).get("content") or ""
                        counts[i] += 1
    except (httpx.HTTPError, TimeoutError) as err:
        return text, f"{type(err).__name__}: {err}"
    return text, None


def gen_servers(url: str) -> list[dict]:
    return cluster_status(url)["pools"]["gen"]["servers"]


async def run_mode(url: str, auth: dict, args, model: str) -> dict:
    """16 streams, then scale gen 2 → 1 once each has warm tokens; the drain time and the texts."""
    n = args.streams
    counts = [0] * n
    async with httpx.AsyncClient(timeout=args.bound_s, limits=httpx.Limits(max_connections=n + 4)) as client:
        tasks = [asyncio.create_task(one_stream(client, url, model, PROMPTS[i % len(PROMPTS)], args.max_tokens,
                                                counts, i, args.bound_s)) for i in range(n)]
        deadline = time.monotonic() + args.bound_s
        while min(counts) < args.warm_tokens and time.monotonic() < deadline and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        before = {s["url"]: s["in_flight"] for s in gen_servers(url)}
        tokens_at_drain = sum(counts)
        t0 = time.monotonic()
        r = await client.post(url + "/cluster/pools/gen/scale", json={"instances": 1}, headers=auth)
        assert r.status_code == 202, r.text
        victim = None
        while time.monotonic() < deadline:
            servers = gen_servers(url)
            if len(servers) == 1:
                break
            victim = victim or next((s["url"] for s in servers if s["state"] == "draining"), None)
            await asyncio.sleep(0.05)
        drain_s = time.monotonic() - t0
        results = await asyncio.gather(*tasks)
        all_done_s = time.monotonic() - t0
    return {"drain_s": drain_s, "all_done_s": all_done_s, "on_victim": before.get(victim, 0) if victim else 0,
            "victim": victim, "texts": [t for t, _ in results], "errors": [e for _, e in results if e],
            "tokens_at_drain": tokens_at_drain, "chunks": sum(counts)}


def run_cluster(mode: str, args, model_path: str, model: str, tmp: Path) -> dict:
    doc = topology(model_path, model, tmp / f"logs-{mode}", mode, args.block_size)
    cfg = tmp / f"{mode}.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    token = secrets.token_hex(16)
    url = f"http://127.0.0.1:{doc['orchestrator']['port']}"
    with Procs(tmp / f"logs-{mode}") as procs:
        procs.start("orchestrator", [sys.executable, "-m", "orchestrator", "--config", str(cfg)],
                    env={"PDSERVE_ADMIN_TOKEN": token})
        procs.wait_http("orchestrator", url + "/health", timeout_s=args.bound_s)
        wait_all_ready(url, {"ctx": 1, "gen": 2}, args.bound_s)
        say(f"{mode}: cluster ready; logs in {tmp / f'logs-{mode}'}")
        out = asyncio.run(run_mode(url, {"Authorization": f"Bearer {token}"}, args, model))
        say(f"{mode}: drained in {out['drain_s']:.2f} s ({out['on_victim']} streams on it); all streams done after "
            f"{out['all_done_s']:.2f} s; errors {out['errors'][:3]}")
    return out


def cpu_flags() -> str:
    flags = set(Path("/proc/cpuinfo").read_text().split())
    return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))


def report(res: dict, args, model: str, load_before: float, cmd: str) -> str:
    same = sum(a == b for a, b in zip(res["move_kv"]["texts"], res["wait"]["texts"]))
    rows = [[mode, f"{r['drain_s']:.2f}", r["on_victim"], f"{r['all_done_s']:.2f}", args.streams - len(r["errors"]),
             len(r["errors"])] for mode, r in res.items()]
    return "\n".join([
        "### Drain time: KV-move vs wait-for-finish", "",
        f"`{cmd}`", "",
        conditions(load_before) + f" CPU flags: {cpu_flags()}; the servers run fp32, one thread each, on the default MPI lattice.", "",
        f"Model {model}; 1 ctx + 2 gen servers (local launcher), {args.streams} greedy chat streams of "
        f"{args.max_tokens} tokens in flight; at {args.warm_tokens}+ tokens each, `scale gen=1` retires one gen "
        "server. Drain time = the scale call to the server gone from the pool (process stopped).", "",
        md_table(["drain_mode", "drain s", "streams on the drained server", "all streams done s", "completed",
                  "failed"], rows), "",
        f"Texts equal between the two modes: {same} of {args.streams} (greedy: a moved stream equals the "
        "undisturbed one).",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--warm-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--bound-s", type=float, default=900.0, help="every wait and request is bounded by this")
    ap.add_argument("--section", default="drain")
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    load_before = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-drain-"))
    if args.model == "tiny":
        from engine.tiny import make_tiny_llama

        model_path, model = str(make_tiny_llama(tmp / "tiny-llama", seed=0)), "tiny-llama"
    else:
        model_path, model = "smollm2", "SmolLM2-135M-Instruct"
    res = {mode: run_cluster(mode, args, model_path, model, tmp) for mode in ("move_kv", "wait")}
    cmd = ("python bench/drain.py " + " ".join(sys.argv[1:])).strip()
    text = report(res, args, model, load_before, cmd)
    print(text)
    if not args.no_doc:
        update_section(args.section, text)


if __name__ == "__main__":
    main()
