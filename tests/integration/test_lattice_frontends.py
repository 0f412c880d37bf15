"""The executor lattice with real processes: K frontends on one port (rank death and start-up
failure: test_lattice.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.integration.conftest import TINY_NAME
from tests.integration.procs import Cluster, write_topology


@pytest.fixture(scope="module")
def four_frontends(tiny_model_dir, procs, tmp_path_factory) -> str:
    topo = write_topology(tmp_path_factory.mktemp("topo") / "k4.yaml", str(tiny_model_dir), TINY_NAME,
                          engine={"num_frontends": 4})
    cluster = Cluster(topo, procs)
    url = cluster.server_url("gen")
    procs.start("gen-k4", "-m", "gen_worker", "--config", str(topo), "--log-dir", str(procs.log_dir))
    procs.wait_healthy("gen-k4", url)
    return url


def test_four_frontends_share_the_port(four_frontends):
    url = four_frontends
    deadline = time.monotonic() + 60
    seen: dict[str, int] = {}
    # Each request on a fresh connection: the kernel spreads connections over the 4 listeners.
    while time.monotonic() < deadline and (sum(seen.values()) < 200 or len(seen) < 4):
        with httpx.Client(timeout=10) as c:
            r = c.get(url + "/health")
        assert r.status_code == 200
        fid = r.headers["x-pdserve-frontend"]
        seen[fid] = seen.get(fid, 0) + 1
        if sum(seen.values()) >= 400:
            break
    assert set(seen) == {"0", "1", "2", "3"}, seen


def test_streams_come_back_to_the_frontend_that_took_them(four_frontends):
    url = four_frontends
    body = {"model": TINY_NAME, "prompt": "alpha beta", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    reference = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]

    async def one(i: int) -> tuple[str, str]:
        async with httpx.AsyncClient(timeout=30) as c:  # one connection per request
            text = []
            async with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
                fid = r.headers["x-pdserve-frontend"]
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text.append(json.loads(line[6:])["choices"][0]["text"])
            return fid, "".join(text)

    async def all_of_them():
        return await asyncio.gather(*[one(i) for i in range(32)])

    results = asyncio.run(all_of_them())
    assert all(text == reference for _, text in results)
    assert len({fid for fid, _ in results}) >= 2
    # every frontend's event loop reads its lane itself (executor.lattice_client.attach_loop)
    readers = {}
    for _ in range(40):
        r = httpx.get(url + "/server_info", timeout=10)
        readers[r.headers["x-pdserve-frontend"]] = r.json()["lane_reader"]
    assert set(readers.values()) == {"loop"} and len(readers) >= 2, readers


def test_attached_frontend_serves_health_and_metrics(four_frontends):
    url = four_frontends
    got = {}
    for _ in range(200):
        with httpx.Client(timeout=10) as c:
            r = c.get(url + "/metrics")
        got.setdefault(r.headers["x-pdserve-frontend"], r)
        if len(got) == 4:
            break
    for fid, r in got.items():
        assert r.status_code == 200 and "pdserve_kv_cache_free_blocks" in r.text, fid


def _frontend_children(pid: int) -> list[int]:
    """Live attached frontends of frontend 0 (children of any of its threads: the restarts come
    from the watcher thread)."""
    from pathlib import Path

    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    alive = []
    for k in kids:
        try:
            stat = Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if stat != "Z" and b"executor.frontend_main" in Path(f"/proc/{k}/cmdline").read_bytes():
                alive.append(k)
        except FileNotFoundError:
            continue
    return alive


def _seen_frontends(url: str, want: int, deadline: float) -> set[str]:
    seen: set[str] = set()
    while time.monotonic() < deadline and len(seen) < want:
        with httpx.Client(timeout=10) as c:
            r = c.get(url + "/health")
        if r.status_code == 200:
            seen.add(r.headers["x-pdserve-frontend"])
    return seen


def test_dead_attached_frontend_is_restarted(four_frontends, procs):
    frontend0 = procs.procs["gen-k4"].pid
    assert _seen_frontends(four_frontends, 4, time.monotonic() + 60) == {"0", "1", "2", "3"}
    before = _frontend_children(frontend0)
    assert len(before) == 3
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _frontend_children(frontend0)
        if len(now) == 3 and before[0] not in now:
            break
        time.sleep(0.2)
    assert len(now) == 3 and before[0] not in now, now
    # The restarted frontend serves again: all four answer on the shared port.
    assert _seen_frontends(four_frontends, 4, time.monotonic() + 60) == {"0", "1", "2", "3"}


def test_kill_9_of_frontend_0_takes_ranks_and_attached_frontends_down(four_frontends, procs):
    """Nothing is orphaned: ranks (own session) and attached frontends watch frontend 0's pidfd."""
    frontend0 = procs.procs["gen-k4"].pid
    ranks = [r["pid"] for r in httpx.get(four_frontends + "/server_info", timeout=10).json()["ranks"]]
    attached = _frontend_children(frontend0)
    assert ranks and len(attached) == 3
    ipc_dir = _ipc_dir_of(ranks[0])
    assert os.path.isdir(ipc_dir)
    os.kill(frontend0, signal.SIGKILL)
    procs.procs["gen-k4"].wait(10)

    def alive(pid: int) -> bool:
        from pathlib import Path

        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(p) for p in ranks + attached):
        time.sleep(0.1)
    assert not any(alive(p) for p in ranks + attached), [p for p in ranks + attached if alive(p)]
    # Rank 0 removed the IPC directory the killed proxy could not (no /dev/shm leak per restart).
    assert not os.path.exists(ipc_dir), sorted(os.listdir(ipc_dir))


def _ipc_dir_of(rank_pid: int) -> str:
    """The ``--ipc-dir`` a worker rank was started with (from its command line)."""
    from pathlib import Path

    argv = Path(f"/proc/{rank_pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--ipc-dir") + 1].decode()
