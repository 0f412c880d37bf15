"""Same-host control socket of the UCX backend (kv_transfer.local_control) and the pidfd check of
the ctx process (kv_transfer.peer_procs)."""

import os
import socket
import subprocess
import time

import pytest
import torch

import kv_transfer.local_control as local_control
from kv_transfer.factory import make_kv_client
from kv_transfer.local_control import Poller
from kv_transfer.peer_procs import PeerProcesses
from kv_transfer.wire import recv_msg, send_msg
from pdserve.procfs import proc_start_time

from .conftest import HAVE_UCXX, CtxSide, cache, layout

needs_ucx = pytest.mark.skipif(not HAVE_UCXX, reason="ucxx is not installed: UCX backend untested")


@pytest.fixture
def ucx_side():
    src = torch.randn_like(cache())
    side = CtxSide("ucx", src, layout())
    yield side
    side.stop()


@needs_ucx
def test_later_same_host_pulls_are_asked_over_the_control_socket(ucx_side):
    src = ucx_side.server.kv_cache
    for i in range(4):
        ucx_side.leases.park(f"r{i}", [2 * i, 2 * i + 1], 8, ttl_s=30)
    client = make_kv_client("ucx", layout())
    try:
        for i in range(4):
            dst = cache()
            assert client.pull(ucx_side.server.endpoint, f"r{i}", layout(), dst, [5, 9], timeout_s=5) > 0
            assert torch.equal(dst[5], src[2 * i]) and torch.equal(dst[9], src[2 * i + 1])
        assert client.same_host_reads == 4
        assert client.local_control_pulls == 3  # the first one learns the socket over UCX
        # the last "done" (release: true) is fire-and-forget: the ctx side frees r3 a moment later
        deadline = time.monotonic() + 2.0
        while len(ucx_side.freed) < 4 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert len(ucx_side.freed) == 4 and all(reason == "released" for _, reason in ucx_side.freed)
        assert len(ucx_side.leases) == 0
    finally:
        client.stop()


@needs_ucx
def test_a_gone_control_socket_falls_back_to_ucx(ucx_side):
    for i in range(2):
        ucx_side.leases.park(f"r{i}", [i], 4, ttl_s=30)
    client = make_kv_client("ucx", layout())
    try:
        client.pull(ucx_side.server.endpoint, "r0", layout(), cache(), [0], timeout_s=5)
        assert client.local_control_peers == 1
        ucx_side.server._local.stop()  # as if the socket vanished (the ctx restarted under the same name)
        dst = cache()
        client.pull(ucx_side.server.endpoint, "r1", layout(), dst, [3], timeout_s=5)
        assert torch.equal(dst[3], ucx_side.server.kv_cache[1])
        assert client.local_control_pulls == 0 and client.same_host_reads == 2
    finally:
        client.stop()


@needs_ucx
def test_the_control_socket_serves_same_host_pulls_only(ucx_side):
    ucx_side.leases.park("r", [1], 4, ttl_s=30)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect("\0" + ucx_side.server._local.name)
        send_msg(sock, {"op": "release", "ctx_request_id": "r", "tag": 1 << 24})
        assert recv_msg(sock)["ok"] is False
        send_msg(sock, {"op": "pull", "ctx_request_id": "r", "tag": 1 << 24, "host": "another host",
                        "layout": layout().model_dump(), "dst_runs": [[0, 1]], "reply_to": "x"})
        answer = recv_msg(sock)
        assert answer["ok"] is False and "same-host" in answer["error"]
        send_msg(sock, {"op": "pull", "tag": 3})  # a tag base with low bits set
        assert recv_msg(sock)["ok"] is False
    assert len(ucx_side.leases) == 1  # nothing was released or pinned


def test_peer_processes_see_a_process_exit_and_a_wrong_start_time():
    procs = PeerProcesses()
    me = os.getpid()
    try:
        assert procs.alive(me, proc_start_time(me))
        assert procs.alive(me, proc_start_time(me))  # cached fd
        assert not procs.alive(me, proc_start_time(me) + 1)  # a recycled pid names another process
        child = subprocess.Popen(["sleep", "30"])
        start = proc_start_time(child.pid)
        assert procs.alive(child.pid, start)
        child.kill()
        child.wait(10)
        assert not procs.alive(child.pid, start)
    finally:
        procs.close()


def test_the_poll_is_bounded_and_sees_a_frame(monkeypatch):
    """The bounded poll before a blocking read: False once its budget is spent with nothing to read
    (and no sooner), True as soon as a frame (or EOF) is there."""
    monkeypatch.setattr(local_control, "STALL_S", float("inf"))  # a loaded host must not end it early here
    monkeypatch.setattr(local_control, "BACKOFF_S", 0.0)  # the spent budget must not stop the next polls
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    poller = Poller()
    try:
        t0 = time.perf_counter()
        assert poller.wait(a, 2e-3) is False
        assert time.perf_counter() - t0 >= 2e-3
        b.sendall(b"x")
        assert poller.wait(a, 10.0) is True
        a.recv(1)
        b.close()
        assert poller.wait(a, 10.0) is True  # EOF is readable: the blocking read then reports it
    finally:
        a.close()
        b.close()


def test_a_stalled_poll_ends_at_once_and_the_poller_backs_off(monkeypatch):
    """An iteration that took longer than STALL_S (here every one: the yield sleeps 1 ms, as a
    thread that waits for the GIL or a CPU does) ends the poll long before its budget; during the
    backoff ``wait`` does not poll at all (a frame already there is not seen); a miss right after
    a backoff (here a spent budget) doubles the next one; a poll that sees its frame resets it."""
    monkeypatch.setattr(local_control, "BACKOFF_S", 0.3)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    poller = Poller()

    def stalled_wait() -> None:
        with monkeypatch.context() as m:
            m.setattr(local_control.os, "sched_yield", lambda: time.sleep(1e-3))
            t0 = time.perf_counter()
            assert poller.wait(a, 5.0) is False
            assert time.perf_counter() - t0 < 1.0

    try:
        stalled_wait()
        assert (poller.misses, poller.backoff_s) == (1, 0.3)
        b.sendall(b"x")
        t0 = time.perf_counter()
        assert poller.wait(a, 5.0) is False  # backing off: returns at once without looking
        assert time.perf_counter() - t0 < 0.1
        a.recv(1)
        time.sleep(0.35)
        monkeypatch.setattr(local_control, "STALL_S", float("inf"))
        assert poller.wait(a, 2e-3) is False  # the budget spent: a miss too, twice as long
        assert (poller.misses, poller.backoff_s) == (2, 0.6)
        time.sleep(0.65)
        b.sendall(b"y")
        assert poller.wait(a, 5.0) is True and (poller.misses, poller.backoff_s) == (2, 0.0)
    finally:
        a.close()
        b.close()


@needs_ucx
def test_a_pull_answer_makes_the_server_poll_for_its_done_and_a_refusal_does_not(ucx_side):
    """_on_local says when a ``done`` is due (an accepted same-host pull), so the connection thread
    polls for it; a refused pull (no such lease) is not followed by one."""
    from kv_transfer.ucx_backend import ACK  # imports ucxx

    replies = []
    server = ucx_side.server
    tag = ACK + 1  # a tag base: the low bits number a pull's messages
    bad = {"op": "pull", "tag": tag, "host": server._host_id, "ctx_request_id": "nope", "budget_ms": 1000,
           "layout": server.layout.model_dump(), "dst_runs": [[0, 1]], "reply_to": "x"}
    assert server._on_local(bad, replies.append) is False
    assert replies[-1]["ok"] is False and "nope" in replies[-1]["error"]
    ucx_side.leases.park("r", [1, 2], 8, ttl_s=30)
    good = {**bad, "ctx_request_id": "r", "dst_runs": [[0, 2]]}
    assert server._on_local(good, replies.append) is True
    assert replies[-1]["ok"] is True and replies[-1]["src_addrs"][0][0] == server.kv_cache[1].data_ptr()
    assert server._on_local({"op": "done", "ctx_request_id": "r", "tag": tag, "reply_to": "x", "release": True},
                            replies.append) is False
    assert ucx_side.freed == [("r", "released")]


@needs_ucx
def test_no_poll_for_the_done_of_a_pull_larger_than_one_poll_reads(ucx_side, monkeypatch):
    """A read that outlasts the poll (more than POLL_DONE_BYTES) is answered without a poll after it."""
    import kv_transfer.ucx_backend as ucx_backend  # imports ucxx

    server = ucx_side.server
    monkeypatch.setattr(ucx_backend, "POLL_DONE_BYTES", server._bytes_per_block)
    ucx_side.leases.park("one", [1], 4, ttl_s=30)
    ucx_side.leases.park("two", [1, 2], 8, ttl_s=30)
    replies = []
    pull = {"op": "pull", "tag": ucx_backend.ACK + 1, "host": server._host_id, "budget_ms": 1000,
            "layout": server.layout.model_dump(), "reply_to": "x"}
    assert server._on_local({**pull, "ctx_request_id": "one", "dst_runs": [[0, 1]]}, replies.append) is True
    assert server._on_local({**pull, "ctx_request_id": "two", "dst_runs": [[0, 2]], "tag": 2 * (ucx_backend.ACK + 1)},
                            replies.append) is False
    assert [r["ok"] for r in replies] == [True, True]
