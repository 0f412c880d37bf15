"""What the same-host KV pull's bounded poll costs an engine decoding in the same process.

A gen rank process pulls KV on worker threads while its engine decodes. Since the same-host pull
polls its control socket (``kv_transfer.local_control.SPIN_S``, 300 us, a non-blocking ``poll``
with ``sched_yield`` between polls) instead of blocking at once, a pull thread may keep a core and
take the GIL more often while it waits. This measures it: one process runs an engine decoding a
batch (main thread) and 4 pull threads sharing one UCX client (1 MiB pulls from a ctx process on
this host, each thread sleeping ``gap`` ms between pulls); phases alternate, in rotating order:

- ``none``: no pulls (the engine alone);
- ``poll``: pulls as built (``SPIN_S`` 300 us in both processes; a poll that misses its frame
  backs off: ``kv_transfer.local_control.Poller``);
- ``block``: pulls with ``SPIN_S`` 0 in both processes (block at once: before the poll came);
- ``poll-nostall``: the poll as first built: no backoff (``BACKOFF_S`` 0), no early end
  (``STALL_S`` infinite);
- ``poll-gen`` / ``poll-ctx``: only the gen / the ctx side polls (as built).

Each phase times ``--steps`` decode steps and reports, over all rounds: decode step p50/p90 (ms),
pulls per second, pull p50 (us), and the CPU seconds per wall second of this process and of the
ctx process. Read the difference between ``poll`` and ``block`` (same pull rate) as the poll's
cost, and ``block`` against ``none`` as the cost of pulling at all.

    .venv/bin/python bench/poll_cost.py [--model tiny|smollm2] [--batch 8] [--steps 40]
                                        [--rounds 3] [--gaps-ms 0 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import kv_transfer.local_control as local_control  # noqa: E402
from kv_transfer.factory import make_kv_client, make_kv_server  # noqa: E402
from kv_transfer.layout import KVLayout  # noqa: E402
from kv_transfer.lease import LeaseTable  # noqa: E402

LAYOUT = KVLayout(model="bench", num_layers=32, num_kv_heads=8, head_dim=64, block_size=16, dtype="float16")
BLOCK_SHAPE = (32, 2, 16, 8, 64)  # 1 MiB in float16
PULL_THREADS = 4  # the gen server's pull pool (gen_worker.kv_role)
SRC_BLOCKS = 64
SPIN_AS_BUILT, STALL_AS_BUILT, BACKOFF_AS_BUILT = local_control.SPIN_S, local_control.STALL_S, local_control.BACKOFF_S


def ctx_process(conn) -> None:
    """Serve 1 MiB blocks; ``("park", rids)`` parks leases, ``("spin", s, stall, backoff)`` sets SPIN_S, STALL_S and BACKOFF_S, and
    ``("cpu",)`` answers this process's CPU seconds so far; ``("stop",)`` ends it."""
    torch.set_num_threads(1)
    cache = torch.rand(SRC_BLOCKS, *BLOCK_SHAPE).to(torch.float16)
    leases = LeaseTable(lambda rid, reason: None)
    leases.start()
    server = make_kv_server("ucx", cache, LAYOUT, leases, "127.0.0.1", 0, 60.0)
    server.start()
    conn.send(server.endpoint)
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        if cmd[0] == "park":
            for i, rid in enumerate(cmd[1]):
                leases.park(rid, [i % SRC_BLOCKS], LAYOUT.block_size, ttl_s=600)
        elif cmd[0] == "spin":
            local_control.SPIN_S, local_control.STALL_S, local_control.BACKOFF_S = cmd[1:]
            server._local._poller = local_control.Poller()  # each phase starts without a backoff
        conn.send(time.process_time())
    server.stop()
    leases.stop()


class Puller:
    """4 threads pulling 1 MiB each, ``gap_s`` apart, while running (leases parked 200 at a time)."""

    def __init__(self, endpoint: str, ctx, gap_s: float) -> None:
        self.endpoint, self.ctx, self.gap_s = endpoint, ctx, gap_s
        self.client = make_kv_client("ucx", LAYOUT)
        self.dst = torch.zeros(PULL_THREADS * 4, *BLOCK_SHAPE, dtype=torch.float16)
        self.times: list[float] = []
        self._rids: list[str] = []
        self._parked = 0
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(t,), daemon=True) for t in range(PULL_THREADS)]

    def _next_rid(self) -> str:
        with self._lock:
            if not self._rids:
                self._rids = [f"p{self._parked + i}" for i in range(200)]
                self._parked += 200
                self.ctx.send(("park", self._rids))
                self.ctx.recv()
            return self._rids.pop()

    def _loop(self, t: int) -> None:
        while self._running.is_set():
            rid = self._next_rid()
            t0 = time.perf_counter()
            self.client.pull(self.endpoint, rid, LAYOUT, self.dst, [t * 4], timeout_s=10)
            with self._lock:
                self.times.append(time.perf_counter() - t0)
            if self.gap_s:
                time.sleep(self.gap_s)

    def start(self) -> None:
        self._running.set()
        for th in self._threads:
            th.start()

    def stop(self) -> None:
        self._running.clear()
        for th in self._threads:
            th.join(30)
        self.client.stop()


def make_engine(model: str, batch: int, threads: int):
    from engine.llm_engine import LLMEngine
    from engine.request import EngineRequest
    from engine.sampling_params import SamplingParams
    from pdserve.config import EngineSettings

    if model == "tiny":
        from engine.tiny import make_tiny_llama
        model = str(make_tiny_llama(tempfile.mkdtemp(prefix="poll-cost-"), seed=0))
    engine = LLMEngine(EngineSettings(dtype="float32", device="cpu", num_kv_blocks=1024, num_threads=threads,
                                      max_batch_size=batch), model, kv_connector="none")
    for i in range(batch):
        engine.add_request(EngineRequest(f"d{i}", list(range(100 + i, 132 + i)),
                                         SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)))
    for _ in range(3):  # prefill, then a couple of decode steps to warm up
        engine.step()
    return engine


def time_steps(engine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - t0)
    return out


def run_phase(engine, kind: str, steps: int, gap_s: float, endpoint: str, ctx, stats: dict) -> None:
    """Time ``steps`` decode steps with pulls of ``kind`` running; add them to ``stats[kind]``."""
    stall, backoff = (float("inf"), 0.0) if kind == "poll-nostall" else (STALL_AS_BUILT, BACKOFF_AS_BUILT)
    local_control.SPIN_S = SPIN_AS_BUILT if kind in ("poll", "poll-gen", "poll-nostall") else 0.0
    local_control.STALL_S, local_control.BACKOFF_S = stall, backoff
    ctx.send(("spin", SPIN_AS_BUILT if kind in ("poll", "poll-ctx", "poll-nostall") else 0.0, stall, backoff))
    ctx_cpu0 = ctx.recv()
    puller = Puller(endpoint, ctx, gap_s) if kind != "none" else None
    if puller:
        puller.start()
        time.sleep(0.05)  # the first pulls learn the control socket
    n0 = len(puller.times) if puller else 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    step_times = time_steps(engine, steps)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n_pulls = (len(puller.times) - n0) if puller else 0
    stalls = puller.client._local.poller.misses if puller else 0
    if puller:
        puller.stop()
    ctx.send(("cpu",))
    ctx_cpu = ctx.recv() - ctx_cpu0
    s = stats.setdefault(kind, {"steps": [], "pulls": [], "n_pulls": 0, "wall": 0.0, "cpu": 0.0, "ctx_cpu": 0.0,
                                "stalls": 0})
    s["stalls"] += stalls
    s["steps"] += step_times
    s["pulls"] += puller.times if puller else []
    s["n_pulls"] += n_pulls
    s["wall"] += wall
    s["cpu"] += cpu
    s["ctx_cpu"] += ctx_cpu


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    global PULL_THREADS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny (random 2-layer Llama) or smollm2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per phase")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=[0.0, 20.0],
                    help="sleep of each pull thread between pulls (0: back to back)")
    ap.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    ap.add_argument("--pull-threads", type=int, default=PULL_THREADS)
    ap.add_argument("--phases", nargs="+", default=["none", "poll", "block"],
                    choices=["none", "poll", "block", "poll-nostall", "poll-gen", "poll-ctx"],
                    help="poll-gen / poll-ctx: only the gen / ctx side polls")
    args = ap.parse_args()
    PULL_THREADS = args.pull_threads
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=ctx_process, args=(child,), daemon=True)
    proc.start()
    try:
        endpoint = parent.recv()
        engine = make_engine(args.model, args.batch, args.threads)
        load0 = os.getloadavg()[0]
        print(f"model {args.model}, batch {args.batch}, engine threads {args.threads}, {PULL_THREADS} pull threads, "
              f"{args.steps} steps per phase, "
              f"{args.rounds} rounds; {os.cpu_count()} CPUs, load at start {load0:.2f}")
        print("| gap ms | phase | step p50 ms | step p90 ms | pulls/s | pull p50 us | CPU s/s here | CPU s/s ctx "
              "| gen poll misses |")
        print("|---|---|---|---|---|---|---|---|---|")
        kinds = args.phases
        for gap in args.gaps_ms:
            stats: dict = {}
            for r in range(args.rounds):
                for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                    run_phase(engine, kind, args.steps, gap / 1000, endpoint, parent, stats)
            for kind in kinds:
                s = stats[kind]
                pulls = s["pulls"]
                print(f"| {gap:g} | {kind} | {statistics.median(s['steps']) * 1e3:.2f} | {pct(s['steps'], 0.9) * 1e3:.2f} | "
                      f"{s['n_pulls'] / s['wall']:.0f} | {statistics.median(pulls) * 1e6 if pulls else 0:.0f} | "
                      f"{s['cpu'] / s['wall']:.2f} | {s['ctx_cpu'] / s['wall']:.2f} | {s['stalls']} |")
        print(f"load at end {os.getloadavg()[0]:.2f}")
    finally:
        parent.send(("stop",))
        proc.join(30)


if __name__ == "__main__":
    main()
