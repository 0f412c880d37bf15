"""KV transfer throughput: GB/s per request over ucx and tcp between two processes, next to memcpy.

A ctx process serves a block-major cache (1 MiB blocks: 32 layers x K,V x 16 tokens x 8 heads x
64 dims, fp16); this process pulls 1, 16 and 256 MiB per request into its own cache and times
each pull end to end (request, answer, bytes, confirmation; the ctx side releases the lease itself). Both caches
are allocated like the engine's (``engine.kv_memory``: transparent huge pages unless
``--small-pages``) and every page is touched first. memcpy is a single-threaded ``torch`` ``copy_``
of the same bytes between two touched tensors in this process, in the same run, on the same kind
of pages (and, for reference, on 4 KiB pages). Prints a markdown table of medians: GB/s and the
median (p50) time of one pull in microseconds.

    .venv/bin/python bench/kv_transfer.py [--repeats 7] [--sizes-mib 1 16 256]
                                          [--backends ucx ucx-messages tcp] [--scattered] [--small-pages]

``ucx`` is the backend as servers run it (same-host bytes read with ``process_vm_readv``, UCX for
control); ``ucx-messages`` makes the client take every byte as UCX messages, the path used between
hosts (on one host UCX then runs over tcp: endpoints have error handling, see kv_transfer/cma.py).

``--scattered`` uses every other block on the ctx side (one message per block) instead of runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.huge_pages import transparent_huge_pages_mode  # noqa: E402
from engine.kv_memory import allocate_kv_cache  # noqa: E402
from kv_transfer.factory import make_kv_client, make_kv_server  # noqa: E402
from kv_transfer.layout import KVLayout, bytes_per_block  # noqa: E402
from kv_transfer.lease import LeaseTable  # noqa: E402

LAYOUT = KVLayout(model="bench", num_layers=32, num_kv_heads=8, head_dim=64, block_size=16, dtype="float16")
BLOCK_SHAPE = (LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
MIB = 1 << 20


def make_cache(num_blocks: int, huge_pages: bool, fill: float) -> torch.Tensor:
    """A KV cache allocated like the engine's, every page touched."""
    cache = allocate_kv_cache((num_blocks, *BLOCK_SHAPE), torch.float16, huge_pages=huge_pages)
    return cache.fill_(fill)


def ctx_process(backend: str, num_blocks: int, huge_pages: bool, conn) -> None:
    """Serve a cache; park leases on request (``("park", rid, ids)``) until ``("stop",)``."""
    torch.set_num_threads(1)
    cache = make_cache(num_blocks, huge_pages, 0.5)
    leases = LeaseTable(lambda rid, reason: None)
    leases.start()
    server = make_kv_server(backend, cache, LAYOUT, leases, "127.0.0.1", 0, 60.0)
    server.start()
    conn.send(server.endpoint)
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        leases.park(cmd[1], cmd[2], len(cmd[2]) * LAYOUT.block_size, ttl_s=120)
        conn.send("ok")
    server.stop()
    leases.stop()


def median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def bench_memcpy(nbytes: int, repeats: int, huge_pages: bool) -> float:
    """Median GB/s of a single-threaded ``copy_`` of ``nbytes`` between two touched tensors."""
    blocks = nbytes // MIB
    src, dst = make_cache(blocks, huge_pages, 1.0), make_cache(blocks, huge_pages, 2.0)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return median_gbps(nbytes, times[1:])


def bench_backend(backend: str, sizes_blocks: list[int], repeats: int, scattered: bool,
                  huge_pages: bool) -> dict[int, float]:
    """Median seconds of one pull of each size (in 1 MiB blocks) from a ctx process, end to end."""
    stride = 2 if scattered else 1
    num_blocks = max(sizes_blocks) * stride + 1
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    kind = "ucx" if backend == "ucx-messages" else backend
    proc = spawn.Process(target=ctx_process, args=(kind, num_blocks, huge_pages, child), daemon=True)
    proc.start()
    client = make_kv_client(kind, LAYOUT, same_host_reads=backend != "ucx-messages")
    gen_cache = make_cache(num_blocks, huge_pages, 1.0)
    results = {}
    try:
        endpoint = parent.recv()
        for n in sizes_blocks:
            times = []
            for i in range(repeats + 1):  # the first pull warms up (endpoint, registration caches)
                rid = f"{n}-{i}"
                parent.send(("park", rid, list(range(0, n * stride, stride))))
                parent.recv()
                t0 = time.perf_counter()
                client.pull(endpoint, rid, LAYOUT, gen_cache, list(range(n)), timeout_s=60)
                times.append(time.perf_counter() - t0)
            results[n] = statistics.median(times[1:])
    finally:
        parent.send(("stop",))
        proc.join(30)
        client.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed pulls per size (after one warm-up pull)")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--backends", nargs="+", default=["ucx", "ucx-messages", "tcp"],
                    choices=["ucx", "ucx-messages", "tcp"])
    ap.add_argument("--scattered", action="store_true")
    ap.add_argument("--small-pages", action="store_true",
                    help="KV caches on 4 KiB pages (torch.zeros) instead of the engine's huge-page mapping")
    args = ap.parse_args()
    torch.set_num_threads(1)
    assert bytes_per_block(LAYOUT) == MIB
    sizes, huge = args.sizes_mib, not args.small_pages
    memcpy = {n: bench_memcpy(n * MIB, args.repeats, huge) for n in sizes}
    memcpy_4k = {n: bench_memcpy(n * MIB, args.repeats, False) for n in sizes}
    by_backend = {b: bench_backend(b, sizes, args.repeats, args.scattered, huge) for b in args.backends}
    pages = "2 MiB transparent huge pages" if huge else "4 KiB pages"
    print(f"\nKV per request, median of {args.repeats} pulls ({'scattered blocks' if args.scattered else 'contiguous runs'}; "
          f"caches on {pages}, THP mode {transparent_huge_pages_mode()}; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f})\n")
    print("| KV per request | memcpy GB/s | memcpy 4 KiB pages GB/s | "
          + " | ".join(f"{b} GB/s (% of memcpy), p50 µs" for b in args.backends) + " |")
    print("|---|---|---|" + "---|" * len(args.backends))
    for n in sizes:
        gbps = {b: n * MIB / by_backend[b][n] / 1e9 for b in args.backends}
        cells = [f"{gbps[b]:.2f} ({100 * gbps[b] / memcpy[n]:.0f}%), {1e6 * by_backend[b][n]:.0f}"
                 for b in args.backends]
        print(f"| {n} MiB | {memcpy[n]:.2f} | {memcpy_4k[n]:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
