"""The same-host control socket under concurrency and faults: four threads of one client, a
deadline shorter than the bounded poll, a ctx side that never answers or drops the connection
before answering, and a ctx server stopped while a connection thread polls for a ``done``."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import torch

import kv_transfer.local_control as local_control
from kv_transfer.factory import make_kv_client
from kv_transfer.local_control import exchange
from kv_transfer.wire import KVTransferError, recv_msg, send_msg

from .conftest import BS, CtxSide, cache, layout, needs_ucx


@pytest.fixture
def ucx_side():
    side = CtxSide("ucx", torch.randn_like(cache()), layout())
    yield side
    side.stop()


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < end:
        time.sleep(0.005)
    return predicate()


def test_exchange_keeps_a_deadline_shorter_than_its_poll_and_sends_nothing_past_it():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer"):
            exchange(a, {"op": "pull"}, time.monotonic() + 1e-3)  # nobody answers
        assert time.monotonic() - t0 < 0.5
        assert recv_msg(b) == {"op": "pull"}  # it was sent once
        with pytest.raises(TimeoutError, match="before it was sent"):
            exchange(a, {"op": "late"}, time.monotonic() - 1e-3)
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)  # nothing was sent past the deadline
    finally:
        a.close()
        b.close()


def test_exchange_reports_a_peer_that_closes_before_answering_at_once():
    """A ctx process that dies after reading the pull: EOF, seen well before the deadline."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def read_then_die():
        recv_msg(b)
        b.close()

    peer = threading.Thread(target=read_then_die)
    peer.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="no answer .* closed"):
            exchange(a, {"op": "pull"}, time.monotonic() + 10)
        assert time.monotonic() - t0 < 2.0
    finally:
        peer.join(5)
        a.close()


@needs_ucx
def test_four_threads_pull_concurrently_over_the_control_socket(ucx_side):
    """The gen side pulls on 4 threads with one client: every pull's bytes land where asked, the
    control connections are pooled (at most one per thread), and every lease is released."""
    threads, pulls = 4, 15
    src = ucx_side.server.kv_cache
    dst = torch.zeros(threads * 8, *src.shape[1:])
    plans = {}
    rng = random.Random(0)
    for t in range(threads):
        for k in range(pulls):
            lease = rng.sample(range(src.shape[0]), rng.randint(2, 5))
            first = rng.randint(0, 1)
            ids = [t * 8 + d for d in rng.sample(range(8), len(lease) - first)]
            plans[f"t{t}-{k}"] = (lease, first, ids)
            ucx_side.leases.park(f"t{t}-{k}", lease, len(lease) * BS, ttl_s=60)
    client = make_kv_client("ucx", layout())
    start, errors = threading.Barrier(threads), []

    def run(t: int) -> None:
        start.wait(10)
        for k in range(pulls):
            lease, first, ids = plans[f"t{t}-{k}"]
            try:
                client.pull(ucx_side.server.endpoint, f"t{t}-{k}", layout(), dst, ids, timeout_s=10, src_first=first)
                if not torch.equal(dst[ids], src[lease[first:]]):
                    errors.append(f"t{t}-{k}: wrong bytes")
            except KVTransferError as err:
                errors.append(f"t{t}-{k}: {err}")

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert not any(w.is_alive() for w in workers) and not errors, errors
        assert client.same_host_reads == threads * pulls
        assert client.local_control_pulls >= threads * pulls - threads  # each thread's first may go over UCX
        assert len(ucx_side.server._local._conns) <= threads
        assert _wait_for(lambda: len(ucx_side.freed) == threads * pulls)
        assert {reason for _, reason in ucx_side.freed} == {"released"}
    finally:
        client.stop()
    assert _wait_for(lambda: not ucx_side.server._local._conns)  # closed client: the ctx threads end


@needs_ucx
def test_a_ctx_side_that_never_answers_fails_the_pull_by_its_deadline(ucx_side, monkeypatch):
    for rid in ("r0", "r1", "r2"):
        ucx_side.leases.park(rid, [1, 2], 8, ttl_s=30)
    local = ucx_side.server._local
    client = make_kv_client("ucx", layout())
    release = threading.Event()
    real = local._handler

    def silent(msg, reply):
        release.wait(10)  # bounded: the test sets it right after the pull failed
        return False

    try:
        client.pull(ucx_side.server.endpoint, "r0", layout(), cache(), [0, 1], timeout_s=5)  # learns the socket
        monkeypatch.setattr(local, "_handler", silent)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="r1 .*control socket.*no answer"):
            client.pull(ucx_side.server.endpoint, "r1", layout(), cache(), [0, 1], timeout_s=0.3)
        assert 0.25 < time.monotonic() - t0 < 1.5
        release.set()
        monkeypatch.setattr(local, "_handler", real)
        # the failed connection was closed, not pooled: its ctx thread ends; the lease was never pinned
        assert _wait_for(lambda: not local._conns)
        dst = cache()
        client.pull(ucx_side.server.endpoint, "r2", layout(), dst, [3, 4], timeout_s=5)
        assert torch.equal(dst[3:5], ucx_side.server.kv_cache[1:3]) and client.local_control_pulls == 1
        assert ucx_side.leases.begin_pull("r1") is not None  # r1 still parked, pullable
        ucx_side.leases.end_pull("r1")
    finally:
        release.set()
        client.stop()


@needs_ucx
def test_a_control_connection_dropped_before_the_answer_fails_the_pull_promptly(ucx_side, monkeypatch):
    """The ctx side ends the connection without answering (as when its process dies): the pull
    fails at once with an error naming the request, not at its deadline."""
    for rid in ("r0", "r1"):
        ucx_side.leases.park(rid, [1], 4, ttl_s=30)
    client = make_kv_client("ucx", layout())

    def broken(msg, reply):
        raise RuntimeError("injected: the handler failed")

    try:
        client.pull(ucx_side.server.endpoint, "r0", layout(), cache(), [0], timeout_s=5)
        monkeypatch.setattr(ucx_side.server._local, "_handler", broken)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="r1 .*control socket"):
            client.pull(ucx_side.server.endpoint, "r1", layout(), cache(), [0], timeout_s=10)
        assert time.monotonic() - t0 < 2.0
    finally:
        client.stop()


@needs_ucx
def test_stopping_the_server_while_a_connection_thread_polls_for_done_is_prompt(monkeypatch):
    """After answering a pull the connection thread polls for its ``done`` (here: up to 30 s and
    never ended by a stall, so it is surely polling); stopping the server must end that poll and
    the thread at once."""
    monkeypatch.setattr(local_control, "SPIN_S", 30.0)
    monkeypatch.setattr(local_control, "STALL_S", float("inf"))  # no early end on a loaded host
    side = CtxSide("ucx", torch.randn_like(cache()), layout())
    server = side.server
    side.leases.park("r", [1, 2], 8, ttl_s=30)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stopped = False
    try:
        sock.settimeout(5)
        sock.connect("\0" + server._local.name)
        send_msg(sock, {"op": "pull", "ctx_request_id": "r", "tag": 1 << 24, "host": server._host_id,
                        "budget_ms": 5000, "layout": layout().model_dump(), "dst_runs": [[0, 2]], "reply_to": "x"})
        assert recv_msg(sock)["ok"] is True  # answered: the thread now polls for the done
        conn_threads = list(server._local._conns.values())
        assert len(conn_threads) == 1
        t0 = time.monotonic()
        side.stop()
        stopped = True
        assert time.monotonic() - t0 < 2.0
        assert not conn_threads[0].is_alive()
        assert sock.recv(1) == b""  # the server closed its end
    finally:
        sock.close()
        if not stopped:
            side.stop()
