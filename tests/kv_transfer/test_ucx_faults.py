"""UCX backend under faults: a ctx that dies mid-copy, a gen side that stalls past its deadline,
a client stopped under running pulls. Both byte paths: same-host reads and UCX messages."""

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from kv_transfer.factory import make_kv_client
from kv_transfer.ucx_backend import GRACE_S
from kv_transfer.wire import KVTransferError

from .conftest import HAVE_UCXX, CtxSide, cache, layout

pytestmark = pytest.mark.skipif(not HAVE_UCXX, reason="ucxx is not installed (pip install ucxx-cu12): UCX backend untested")

PATHS = [pytest.param(True, id="same-host-read"), pytest.param(False, id="ucx-messages")]
# The same-host read again, asked over the ctx server's same-host control socket (a second pull
# to the same peer goes there: kv_transfer.local_control).
KILL_PATHS = [*PATHS, pytest.param("control-socket", id="same-host-control-socket")]


def big_layout():
    """1 MiB blocks: UCX sends them by rendezvous, so no byte moves before the gen side asks."""
    return layout(num_layers=64, num_kv_heads=8, head_dim=64)


def big_cache(num_blocks: int = 8) -> torch.Tensor:
    lay = big_layout()
    return torch.zeros(num_blocks, lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)


def _serve(to_parent) -> None:
    """Child ctx process: one lease, endpoint and pid published, then serve until killed."""
    side = CtxSide("ucx", torch.randn_like(big_cache()), big_layout())
    side.leases.park("r", [1, 2, 3], 12, ttl_s=60)
    side.leases.park("warm-up", [4], 4, ttl_s=60)
    to_parent.put((side.server.endpoint, os.getpid()))
    time.sleep(120)


def _gen_pulls_while_ctx_dies(path, to_parent) -> None:
    """Child gen process: kill the ctx after its answer arrived, right before the bytes move."""
    from kv_transfer import cma, ucx_client

    same_host_reads = bool(path)

    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    ctx = spawn.Process(target=_serve, args=(q,), daemon=True)
    ctx.start()
    endpoint, pid = q.get(timeout=60)

    def kill_ctx():
        os.kill(pid, signal.SIGKILL)
        ctx.join(10)

    client = make_kv_client("ucx", big_layout(), same_host_reads=same_host_reads)
    if path == "control-socket":  # learn the peer's control socket (before the hook below kills it)
        client.pull(endpoint, "warm-up", big_layout(), big_cache(), [0], timeout_s=3.0)
        assert client.local_control_peers == 1, "the warm-up pull did not learn the control socket"
    if same_host_reads:
        real = cma.read_remote
        cma.read_remote = lambda *a, **kw: (kill_ctx(), real(*a, **kw))[1]
    else:
        real = ucx_client.UcxKVClient._receive
        ucx_client.UcxKVClient._receive = lambda self, *a, **kw: (kill_ctx(), real(self, *a, **kw))[1]
    t0 = time.monotonic()
    try:
        client.pull(endpoint, "r", big_layout(), big_cache(), [0, 1, 2], timeout_s=3.0)
        to_parent.put(("succeeded", time.monotonic() - t0))
    except KVTransferError as err:
        to_parent.put((str(err), time.monotonic() - t0))
    finally:
        client.stop()


@pytest.mark.parametrize("same_host_reads", KILL_PATHS)
def test_ctx_killed_mid_copy_fails_the_pull_not_the_gen_process(same_host_reads):
    """UCX's own cma would abort the reading process here (error handling off); ours must not."""
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    gen = spawn.Process(target=_gen_pulls_while_ctx_dies, args=(same_host_reads, q))
    gen.start()
    gen.join(60)
    assert gen.exitcode == 0, f"the gen process died (exit code {gen.exitcode})"
    message, seconds = q.get(timeout=5)
    assert message != "succeeded" and ("failed" in message or "timed out" in message), message
    if same_host_reads:
        assert "ctx process is gone" in message
    assert seconds < 3.5


@pytest.mark.parametrize("same_host_reads", PATHS)
def test_an_unconfirmed_pull_keeps_its_lease_pinned_past_the_gen_deadline(same_host_reads, monkeypatch):
    """The gen side stalls between the answer and the bytes until its deadline passed, and never
    tells the ctx side (as if it hung). Its pull must fail, not read late; the lease (expired
    meanwhile) stays pinned until the granted budget (the ctx side's timeout, however long the gen
    side asked for) plus GRACE_S, and only then is freed."""
    from kv_transfer import ucx_client

    big, shape = big_layout(), big_cache(4).shape
    side = CtxSide("ucx", torch.randn(shape), big, timeout_s=0.5)
    try:
        stage = "_read_direct" if same_host_reads else "_receive"
        real = getattr(ucx_client.UcxKVClient, stage)

        def stalled(self, *a, **kw):
            time.sleep(0.8)
            return real(self, *a, **kw)

        monkeypatch.setattr(ucx_client.UcxKVClient, stage, stalled)
        monkeypatch.setattr(ucx_client.UcxKVClient, "_send_done", lambda self, *a, **kw: None)
        client = make_kv_client("ucx", big, same_host_reads=same_host_reads)
        # Parked after the client exists: making a UCX worker can take longer than the 0.2 s lease
        # on a loaded machine, and the pull must reach a live lease.
        side.leases.park("r", [1, 2, 3], 12, ttl_s=0.2)
        t0 = time.monotonic()
        try:
            # The gen side asks for 30 s; the ctx side grants its own 0.5 s (echoed in the answer).
            with pytest.raises(KVTransferError, match="deadline passed"):
                client.pull(side.server.endpoint, "r", big, torch.zeros(shape), [0, 1, 2], timeout_s=30)
            assert time.monotonic() - t0 < 0.5 + 0.8 + 1
            assert side.freed == [], "a lease was freed while its pull could still read it"
            deadline = time.monotonic() + 0.5 + GRACE_S + 2
            while not side.freed and time.monotonic() < deadline:
                time.sleep(0.02)
            assert side.freed == [("r", "expired")]
            assert time.monotonic() - t0 >= 0.5 + GRACE_S - 0.1
        finally:
            client.stop()
    finally:
        side.stop()


def test_stopping_a_client_under_running_pulls_fails_them_cleanly(ctx_side):
    """stop() while threads pull: every pull ends with an error or its bytes; nothing crashes.
    Same-host pulls take ~0.2 ms, so there are many and stop() comes once some have finished."""
    n = 400
    for i in range(n):
        ctx_side.leases.park(f"r{i}", [i % 16], 4, ttl_s=30)
    client = make_kv_client("ucx", layout())
    results: list[str] = []

    def puller(k: int) -> None:
        for i in range(k, n, 4):
            try:
                client.pull(ctx_side.server.endpoint, f"r{i}", layout(), cache(), [0], timeout_s=2)
                results.append("ok")
            except KVTransferError:
                results.append("error")

    threads = [threading.Thread(target=puller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    end = time.monotonic() + 10
    while len(results) < 8 and time.monotonic() < end:
        time.sleep(0.001)
    client.stop()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(results) == n and "error" in results


def test_a_recycled_pid_is_never_read():
    """The answer names the ctx process by pid and start time; a pid that now names another
    process (here: a start time that does not match) is refused before any byte is read, and the
    lease is unpinned for the next puller."""
    side = CtxSide("ucx", torch.randn(8, *cache().shape[1:]), layout())
    client = make_kv_client("ucx", layout())
    try:
        pid, start = side.server._identity
        side.server._identity = (pid, start + 1)
        side.leases.park("r", [1, 2], 8, ttl_s=30)
        dst = cache()
        with pytest.raises(KVTransferError, match=f"the ctx process \\(pid {pid}\\) is gone"):
            client.pull(side.server.endpoint, "r", layout(), dst, [0, 1], timeout_s=2)
        assert dst.abs().sum() == 0
        side.server._identity = (pid, start)
        client.pull(side.server.endpoint, "r", layout(), dst, [0, 1], timeout_s=2)
        assert torch.equal(dst[:2], side.server.kv_cache[1:3])
        deadline = time.monotonic() + 2  # the release travels in the fire-and-forget "done"
        while not side.freed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert side.freed == [("r", "released")]
    finally:
        client.stop()
        side.stop()


def test_the_control_loop_survives_garbage_and_garbage_addresses_fail_cleanly():
    """A control frame that is not JSON (invalid UTF-8) is dropped and serving goes on; an
    endpoint whose worker address is corrupt fails the pull with an error (UCX itself would abort)."""
    import base64

    import numpy as np

    from kv_transfer.ucx_backend import CTRL_TAG, parse_endpoint
    from kv_transfer.ucx_worker import Array

    side = CtxSide("ucx", torch.randn(8, *cache().shape[1:]), layout())
    client = make_kv_client("ucx", layout())
    try:
        peer, address = parse_endpoint(side.server.endpoint)
        conn, _ = client._peers.acquire(peer, address)
        garbage = np.frombuffer(b"\x00\x00\x00\x04\xff\xfe\xfd\xfc", dtype=np.uint8).copy()
        client._wait([client._worker.send(conn, Array(garbage), CTRL_TAG)], time.monotonic() + 2, "sending garbage")
        client._peers.release(conn)
        side.leases.park("r", [1, 2], 8, ttl_s=30)
        dst = cache()
        client.pull(side.server.endpoint, "r", layout(), dst, [0, 1], timeout_s=3)
        assert torch.equal(dst[:2], side.server.kv_cache[1:3])
        prefix, _, sealed = side.server.endpoint.rpartition("/")
        raw = bytearray(base64.urlsafe_b64decode(sealed))
        raw[5] ^= 0x5A
        corrupt = prefix + "/" + base64.urlsafe_b64encode(bytes(raw)).decode()
        with pytest.raises(KVTransferError, match="checksum mismatch"):
            client.pull(corrupt, "r", layout(), cache(), [0], timeout_s=2)
    finally:
        client.stop()
        side.stop()


def test_same_host_read_counts_only_if_it_finished_before_the_deadline(monkeypatch):
    """The ctx side guarantees its memory until the deadline (plus grace), not after: a read that
    returns after the deadline is refused, whatever it copied."""
    from kv_transfer import cma

    src = torch.arange(1024, dtype=torch.float32)
    dst = torch.zeros_like(src)
    cma.read_remote(os.getpid(), src.data_ptr(), dst.data_ptr(), 4096, time.monotonic() + 5)
    assert torch.equal(src, dst)
    with pytest.raises(TimeoutError, match="deadline"):
        cma.read_remote(os.getpid(), src.data_ptr(), dst.data_ptr(), 4096, time.monotonic() - 1)
    clock = iter([100.0, 100.0 + 10])  # checked before the syscall (in time), then after it (late)

    class LateClock:
        monotonic = staticmethod(lambda: next(clock))

    monkeypatch.setattr(cma, "time", LateClock)
    with pytest.raises(TimeoutError, match="finished past its deadline"):
        cma.read_remote(os.getpid(), src.data_ptr(), dst.data_ptr(), 4096, 105.0)
    monkeypatch.undo()
    with pytest.raises(cma.CMAError) as err:
        cma.read_remote(2**22 + 12345, src.data_ptr(), dst.data_ptr(), 4096, float("inf"))
    assert err.value.errno == 3  # ESRCH: no such process
