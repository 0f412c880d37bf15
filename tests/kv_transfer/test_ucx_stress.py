"""UCX under concurrency: several gen processes, each one client used from 4 threads, pull at once
from two ctx processes; every pull's bytes must land where asked, and every lease must be released.

Guards against control frames and KV data crossing (UCX tag matching is worker-wide: a receive
matches any peer's message with the same tag).
"""

import multiprocessing as mp
import random
import threading
import time

import pytest
import torch

from kv_transfer.factory import make_kv_client

from .conftest import HAVE_UCXX, CtxSide, layout

pytestmark = pytest.mark.skipif(not HAVE_UCXX, reason="ucxx is not installed (pip install ucxx-cu12): UCX backend untested")

SERVERS, CLIENTS, THREADS, PULLS_PER_THREAD = 2, 3, 4, 20  # 240 pulls in all
SRC_BLOCKS, DST_BLOCKS_PER_THREAD, MAX_PULL = 24, 12, 6
DEADLINE_S = 90


def stress_layout():
    # 64 KiB blocks: pulls of 1..6 blocks use UCX's rendezvous path, as real KV blocks do
    return layout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=8)


def source_cache(server: int) -> torch.Tensor:
    lay = stress_layout()
    shape = (SRC_BLOCKS, lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + server))


def rid_of(client: int, thread: int, k: int) -> str:
    return f"c{client}-t{thread}-{k}"


def plan(rid: str) -> tuple[int, list[int], list[int]]:
    """(server, source blocks, destination blocks within the thread's range) of one pull."""
    rng = random.Random(rid)
    n = rng.randint(1, MAX_PULL)
    return int(rid.rsplit("-", 1)[1]) % SERVERS, rng.sample(range(SRC_BLOCKS), n), rng.sample(range(DST_BLOCKS_PER_THREAD), n)


def all_rids():
    return [rid_of(c, t, k) for c in range(CLIENTS) for t in range(THREADS) for k in range(PULLS_PER_THREAD)]


def serve(server: int, to_parent, from_parent) -> None:
    side = CtxSide("ucx", source_cache(server), stress_layout(), timeout_s=20)
    for rid in all_rids():
        srv, src, _ = plan(rid)
        if srv == server:
            side.leases.park(rid, src, len(src) * stress_layout().block_size, ttl_s=120)
    to_parent.put((server, side.server.endpoint))
    from_parent.get(timeout=DEADLINE_S + 30)
    to_parent.put((server, len(side.leases), sorted(r for r, why in side.freed if why != "released")))
    side.stop()


def pull_all(client: int, endpoints: list[str], to_parent) -> None:
    lay = stress_layout()
    kv = source_cache(0)[:0].new_zeros(THREADS * DST_BLOCKS_PER_THREAD, *source_cache(0).shape[1:])
    sources = [source_cache(s) for s in range(SERVERS)]
    kv_client = make_kv_client("ucx", lay)
    errors: list[str] = []
    done = [0]
    lock = threading.Lock()

    def run(thread: int) -> None:
        base = thread * DST_BLOCKS_PER_THREAD
        for k in range(PULLS_PER_THREAD):
            rid = rid_of(client, thread, k)
            server, src, dst = plan(rid)
            dst = [base + d for d in dst]
            kv[dst] = -1.0
            try:
                n = kv_client.pull(endpoints[server], rid, lay, kv, dst, timeout_s=20)
                if n != len(dst) * kv[0].numel() * 4:
                    raise AssertionError(f"{n} bytes")
                if not torch.equal(kv[dst], sources[server][src]):
                    raise AssertionError("wrong bytes landed")
            except Exception as err:  # noqa: BLE001 - reported to the parent
                with lock:
                    errors.append(f"{rid}: {type(err).__name__}: {err}")
                continue
            with lock:
                done[0] += 1

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kv_client.stop()
    to_parent.put((client, done[0], errors))


def test_many_gen_processes_pull_concurrently_from_two_ctx_processes():
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    stops = [spawn.Queue() for _ in range(SERVERS)]
    servers = [spawn.Process(target=serve, args=(s, results, stops[s]), daemon=True) for s in range(SERVERS)]
    clients = []
    t0 = time.monotonic()
    try:
        for p in servers:
            p.start()
        endpoints = dict(results.get(timeout=60) for _ in servers)
        clients = [spawn.Process(target=pull_all, args=(c, [endpoints[s] for s in range(SERVERS)], results), daemon=True)
                   for c in range(CLIENTS)]
        for p in clients:
            p.start()
        reports = [results.get(timeout=DEADLINE_S) for _ in clients]
        for q in stops:
            q.put("stop")
        leftovers = [results.get(timeout=30) for _ in servers]
        errors = [e for _, _, errs in reports for e in errs]
        assert not errors, f"{len(errors)} of {len(all_rids())} pulls failed:\n" + "\n".join(errors[:20])
        assert sum(done for _, done, _ in reports) == len(all_rids())
        # every lease was pulled and released (none left parked, none freed any other way)
        assert all(parked == 0 and not other for _, parked, other in leftovers), leftovers
        for p in clients + servers:
            p.join(30)
            assert p.exitcode == 0
        assert time.monotonic() - t0 < DEADLINE_S + 30
    finally:
        for p in clients + servers:
            if p.is_alive():
                p.kill()
