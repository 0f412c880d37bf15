"""Chaos on the real model (issue 14 part 5): 2 ctx + 2 gen SmolLM2 servers on the default MPI
lattice, launched and restarted by the orchestrator's local launcher (``max_restarts: 3``), under
exactly ``--num-requests`` (80) streaming greedy chat requests at concurrency 8 with ``kill -9`` of
gen server 0's rank 0 at 10 s, ctx server 0's frontend at 25 s and gen server 1's frontend at 40 s
(fixed times, as in the issue). Every request runs (none is skipped when the kills are over); each
is bounded by ``--bound-s`` and the whole load by ``--run-bound-s`` (requests not started by then
are reported as not started, never silently dropped).

Prints completed / identical (text equal to an undisturbed greedy run taken first on the same
cluster) / failed / hung, and per kill the time to its replacement shown ready at the orchestrator
next to the **cold start under the same load**: a third gen server scaled up while the chaos load's
shape (same prompts, concurrency, max_tokens) runs against the 2 + 2 cluster, timed to ready, then
scaled away. That is the fair baseline (a replacement starts while the load runs); the idle cold
start (the same, with no load) is printed beside it. Then whether every server is back and every KV
pool full; writes the ``chaos`` section of docs/benchmarks.md.

    .venv/bin/python bench/chaos.py [--model smollm2|tiny] [--num-requests 80] [--concurrency 8]
                                    [--max-tokens 64] [--kills-at 10 25 40] [--after-replacement]
                                    [--section chaos] [--no-doc]

``--model tiny`` (a random-weight 2-layer Llama made on the spot, with ``--interval-s`` so the load
spans the kills) checks the script in a minute; its numbers say nothing about SmolLM2.
``--after-replacement`` makes the third kill also wait for the first one's replacement (+ 1 s), as
the suite's test does: on a loaded machine a cold start can outlast the 30 s between the gen
kills, and with both gen servers down every request fails at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import yaml  # noqa: E402

from bench._chaos import (ChaosLoad, Kill, plan_victims, reference_texts, run_chaos, run_load, tally,  # noqa: E402
                          wait_all_ready, wait_kv_full)
from bench._harness import Procs, conditions, free_port, loadavg, md_table, say, update_section  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "a mountain", "a lighthouse", "the desert", "a city at night", "a forest", "a river",
          "the moon", "a train journey", "a library", "a storm", "a garden", "an old ship", "a market",
          "the winter", "a bridge"]
PROMPTS = [f"Write a short story about {t}." for t in TOPICS]


def topology(log_dir: Path, model_path: str, model: str) -> dict:
    return {
        "model": {"path": model_path, "name": model},
        "engine": {"dtype": "float32", "block_size": 16, "num_kv_blocks": 512, "max_batch_size": 16,
                   "num_threads": 1},  # engine.dead_exit_grace_s: the default
        "kv_transfer": {"lease_ms": 10000, "timeout_ms": 10000},
        "orchestrator": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 0.2,
                         "heartbeat_ttl_s": 10, "drain_timeout_s": 60, "startup_timeout_s": 600},
        "launcher": {"kind": "local", "log_dir": str(log_dir), "grace_s": 5, "monitor_interval_s": 0.2},
        "pools": {"ctx": {"servers": [{"port": 0}, {"port": 0}], "max_restarts": 3},
                  "gen": {"servers": [{"port": 0}, {"port": 0}], "max_restarts": 3, "max_instances": 3}},
    }


def scale_gen(url: str, auth: dict, instances: int) -> None:
    r = httpx.post(url + "/cluster/pools/gen/scale", json={"instances": instances}, headers=auth, timeout=10,
                   trust_env=False)
    assert r.status_code == 202, r.text


def cold_start_s(url: str, auth: dict, timeout_s: float) -> float:
    """Seconds from asking for a third gen server to the orchestrator showing it ready, on an idle
    cluster; then scales gen back to 2 and waits for that. Raises AssertionError past ``timeout_s``."""
    t0 = time.monotonic()
    scale_gen(url, auth, 3)
    wait_all_ready(url, {"ctx": 2, "gen": 3}, timeout_s)
    cold = time.monotonic() - t0
    scale_gen(url, auth, 2)
    wait_all_ready(url, {"ctx": 2, "gen": 2}, timeout_s)
    return cold


async def cold_start_under_load(load: ChaosLoad, auth: dict, warm_s: float, timeout_s: float) -> tuple[float, list]:
    """The same cold start as :func:`cold_start_s`, timed while ``load`` (the chaos load's shape:
    same prompts, concurrency and max_tokens) runs, which is what a replacement started during the
    chaos run competes with: the load starts, ``warm_s`` seconds later a third gen server is asked
    for, and once it is ready the load stops starting requests; after the load's open requests end,
    gen goes back to 2. Returns (seconds to ready, the load's outcomes). Raises AssertionError past
    ``timeout_s``."""
    task = asyncio.create_task(run_load(load))
    await asyncio.sleep(warm_s)
    t0 = time.monotonic()
    await asyncio.to_thread(scale_gen, load.url, auth, 3)
    await asyncio.to_thread(wait_all_ready, load.url, {"ctx": 2, "gen": 3}, timeout_s)
    cold = time.monotonic() - t0
    load.stop.set()
    outcomes = await task
    scale_gen(load.url, auth, 2)
    wait_all_ready(load.url, {"ctx": 2, "gen": 2}, timeout_s)
    return cold, outcomes


def cpu_flags() -> str:
    """Which of the flags that decide the dtype and the kernels' speed this CPU has (/proc/cpuinfo)."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))


def report(counts: dict, records, cold: dict, back: bool, pools: dict, load_before: float, cmd: str,
           load: ChaosLoad, title: str, model: str) -> str:
    """The markdown section: conditions, the tally, one row per kill against the cold start under load."""
    base = cold["loaded"]
    rows = [[f"kill -9 {r.kill.pool} {r.kill.index} {r.kill.target}", f"{r.t_kill_s:.1f}" if r.t_kill_s else "-",
             f"{r.ready_after_s:.1f}" if r.ready_after_s else "never", f"{base:.1f}",
             f"{r.ready_after_s - base:+.1f}" if r.ready_after_s else "-",
             "yes" if r.ready_after_s is not None and r.ready_after_s <= base + 2 else "no"] for r in records]
    full = all(f == t and p == 0 for f, t, p in pools.values())
    n = counts["requests"]
    return "\n".join([
        f"### {title}", "",
        f"`{cmd}`", "",
        conditions(load_before) + f" CPU flags: {cpu_flags()}; the servers run fp32 ({model}).", "",
        f"{n} streaming greedy chat requests at c{load.concurrency} over {load.duration_s:.0f} s "
        f"({load.not_started} of {load.n} not started within the run bound): **{counts['completed']} completed, "
        f"{counts['identical']} identical to the undisturbed run ({counts['identical'] / max(n, 1):.0%}), "
        f"{counts['failed']} failed, {counts['hung']} hung** (slowest request {counts['slowest_s']:.1f} s). "
        f"Every server back serving: {'yes' if back else 'no'}; every KV pool back to full: "
        f"{'yes' if full else 'no'}. Errors seen: {'; '.join(counts['errors']) or 'none'}.", "",
        md_table(["kill", "at s", "replacement ready after s", "cold start under load s", "minus cold s",
                  "<= cold + 2 s"], rows), "",
        f"Cold start = a third gen server scaled up and timed to ready at the orchestrator in the same run: "
        f"{base:.1f} s under the chaos load's shape (c{load.concurrency} streams against the 2 + 2 cluster; the "
        f"baseline above), {cold['idle']:.1f} s on the idle cluster. Streams whose gen server died migrate "
        f"(prompt + tokens so far re-sent; seeds continue); ctx kills are retried on the other ctx server.",
    ])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                    help="tiny: a random-weight 2-layer Llama, to check the script quickly")
    ap.add_argument("--num-requests", "--requests", dest="num_requests", type=int, default=80,
                    help="exactly this many requests run under the kills")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--interval-s", type=float, default=0.0, help="request starts at least this far apart")
    ap.add_argument("--kills-at", type=float, nargs=3, default=[10.0, 25.0, 40.0])
    ap.add_argument("--bound-s", type=float, default=300.0, help="a request open longer than this is hung")
    ap.add_argument("--run-bound-s", type=float, default=900.0,
                    help="no request starts later than this after the load began (those are reported)")
    ap.add_argument("--warm-s", type=float, default=3.0,
                    help="the load runs this long before the cold start under load is timed")
    ap.add_argument("--after-replacement", action="store_true",
                    help="the third kill also waits for the first kill's replacement to be ready")
    ap.add_argument("--section", default="chaos", help="the docs/benchmarks.md section to write")
    ap.add_argument("--no-doc", action="store_true")
    return ap.parse_args()


async def chaos_run(load: ChaosLoad, records, run_bound_s: float) -> list:
    """Every request of ``load`` under the kills; past ``run_bound_s`` no new request starts."""
    async def bound() -> None:
        await asyncio.sleep(run_bound_s)
        load.stop.set()

    guard = asyncio.create_task(bound())
    try:
        return await run_chaos(load, records, watch_s=600, tail_s=None)
    finally:
        guard.cancel()


def main() -> None:
    args = parse_args()
    load_before = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    if args.model == "tiny":
        from engine.tiny import make_tiny_llama

        model_path, model = str(make_tiny_llama(tmp / "tiny-llama", seed=0)), "tiny-llama"
    else:
        model_path, model = "smollm2", MODEL
    doc = topology(tmp / "logs", model_path, model)
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(doc))
    token = secrets.token_hex(16)
    auth = {"Authorization": f"Bearer {token}"}
    url = f"http://127.0.0.1:{doc['orchestrator']['port']}"
    k1, k2, k3 = args.kills_at
    kills = [Kill(k1, "gen", 0, "rank0"), Kill(k2, "ctx", 0, "frontend"),
             Kill(k3, "gen", 1, "frontend", after_replacement_of=0 if args.after_replacement else None)]

    def shaped(n: int) -> ChaosLoad:
        return ChaosLoad(url, model, PROMPTS, n, args.concurrency, args.max_tokens, args.bound_s, args.interval_s)

    with Procs(tmp / "logs") as procs:
        t0 = time.monotonic()
        procs.start("orchestrator", [sys.executable, "-m", "orchestrator", "--config", str(tmp / "cluster.yaml")],
                    env={"PDSERVE_ADMIN_TOKEN": token})
        procs.wait_http("orchestrator", url + "/health", timeout_s=600)
        wait_all_ready(url, {"ctx": 2, "gen": 2}, 600)
        say(f"cluster ready after {time.monotonic() - t0:.1f} s (4 servers at once); logs in {tmp / 'logs'}")
        refs = asyncio.run(reference_texts(url, model, PROMPTS, args.max_tokens, args.concurrency, args.bound_s))
        say("undisturbed reference taken")
        cold = {"idle": cold_start_s(url, auth, 600)}
        say(f"one gen server's cold start, idle cluster: {cold['idle']:.1f} s")
        cold["loaded"], warm_outs = asyncio.run(cold_start_under_load(shaped(5_000), auth, args.warm_s, 600))
        say(f"one gen server's cold start under c{args.concurrency} load: {cold['loaded']:.1f} s "
            f"(that load: {tally(warm_outs, refs)})")
        records = plan_victims(url, kills)
        load = shaped(args.num_requests)
        outcomes = asyncio.run(chaos_run(load, records, args.run_bound_s))
        counts = tally(outcomes, refs)
        say(f"{counts}; {load.not_started} not started")
        try:
            status = wait_all_ready(url, {"ctx": 2, "gen": 2}, 120)
            back = True
        except AssertionError as err:
            say(str(err))
            status, back = httpx.get(url + "/cluster/status", timeout=5, trust_env=False).json(), False
        pools = wait_kv_full(status, 30)
        for r in records:
            say(f"{r.kill}: killed pid {r.killed_pid} at {r.t_kill_s} s; replacement ready after {r.ready_after_s} s "
                f"(cold start under load {cold['loaded']:.1f} s, idle {cold['idle']:.1f} s)")
        say(f"KV pools (free, total, parked): {pools}; load average now {loadavg():.1f}")
    cmd = "python bench/chaos.py " + " ".join(sys.argv[1:])
    title = "third kill after the first replacement is ready" if args.after_replacement else "kills at fixed times"
    text = report(counts, records, cold, back, pools, load_before, cmd.strip(), load, title, model)
    print(text)
    if not args.no_doc:
        update_section(args.section, text)


if __name__ == "__main__":
    main()
