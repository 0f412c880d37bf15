"""UCX plumbing of the KV transceivers: one worker per transceiver, endpoints per peer, bounded waits.

**Endpoints have error handling on** (UCX ``PEER`` mode): a dead or unreachable peer fails the
requests on its endpoint with an error instead of aborting this process. The price: UCX then
uses no shared-memory transport between such endpoints (tcp on one host), which is why same-host
KV bytes do not travel through UCX at all (:mod:`kv_transfer.cma`). UCX carries the control
messages, and the bytes between hosts.

**Endpoint lifetime.** Posting on an endpoint that another thread has just closed crashes the
process (ucxx keeps a raw handle), so every post and the close take the connection's lock, and a
closed (or UCX-failed) endpoint refuses posts with :class:`EndpointFailed`.

**Buffers.** ucxx requests keep only a raw pointer to their buffer: :class:`Request` holds the
buffer as long as anyone can wait on the request, and :meth:`Worker.adopt` keeps abandoned ones
alive until UCX is done with them (a freed control frame was once sent as garbage).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from kv_transfer.wire import MAX_HEADER_BYTES, KVTransferError, pack_msg

# UCX reads this when its library loads (at import), so it must be set before importing ucxx.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
from ucxx._lib import libucxx as ucx  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

log = logging.getLogger(__name__)

FRAME_BYTES = 4 + MAX_HEADER_BYTES
EPOLL_TIMEOUT_MS = 5  # bound of one event wait: a wakeup another thread's progress consumed costs this much


class EndpointFailed(KVTransferError):
    """A wait on an endpoint timed out or UCX failed it: the endpoint must not be reused."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.before_data = False  # set when it failed before any KV byte was asked for


def as_array(blocks: torch.Tensor) -> Array:
    """A contiguous tensor as a flat byte buffer sharing its memory."""
    return Array(blocks.view(torch.uint8).reshape(-1).numpy())


def frame(msg: dict) -> Array:
    return Array(np.frombuffer(bytearray(pack_msg(msg)), dtype=np.uint8))


class Request:
    """A UCX request together with the buffer it reads or fills."""

    __slots__ = ("request", "buffer")

    def __init__(self, request, buffer: Array) -> None:
        self.request, self.buffer = request, buffer

    @property
    def completed(self) -> bool:
        return self.request.completed

    def check_error(self) -> None:
        self.request.check_error()


class Conn:
    """One endpoint to one peer, shared by the pulls to it; ``lock`` orders posts against the close."""

    __slots__ = ("key", "address", "ep", "users", "retired", "closed", "lock")

    def __init__(self, key: str | bytes, address: bytes, ep) -> None:
        self.key, self.address, self.ep = key, address, ep
        self.users, self.retired, self.closed = 0, False, False
        self.lock = threading.Lock()


def _alive(ep) -> bool:
    alive = ep.alive
    return bool(alive() if callable(alive) else alive)


def close_conn(conn: Conn) -> None:
    """Close once (a second close, or closing an endpoint UCX already closed, crashes)."""
    with conn.lock:
        if conn.closed:
            return
        conn.closed = True
        try:
            if _alive(conn.ep):
                conn.ep.close()
        except ucx.UCXError as err:
            log.debug("closing a UCX endpoint: %s", err)


class Worker:
    """One UCX context + worker.

    With ``progress_thread`` a ucxx progress thread sleeps in epoll and progresses the worker on
    events (the gen side: its pulls run on many threads). Without it, the owner drives progress
    with :meth:`wait_event` (the ctx side's control loop), which wakes as soon as a message
    arrives instead of polling.
    """

    def __init__(self, progress_thread: bool = True) -> None:
        self._context = ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self._worker = ucx.UCXWorker(self._context)
        self._progress_thread = progress_thread
        if progress_thread:
            # Event-driven: polling mode is faster but starves a 2-core machine. The epoll timeout
            # bounds a lost wakeup (with -1 a second pull on a cached endpoint once hung here).
            self._worker.start_progress_thread(polling_mode=False, epoll_timeout=EPOLL_TIMEOUT_MS)
        else:
            self._worker.init_blocking_progress_mode()
        self.address: bytes = self._worker.address.tobytes()
        self._lock = threading.Lock()
        self._stopped = False
        self._orphans: list[Request] = []

    def adopt(self, requests: list[Request]) -> None:
        """Keep the buffers of requests nobody waits for any more alive until they complete or are
        cancelled (closing their endpoint), so that no late byte lands in, or leaves from, freed memory."""
        with self._lock:
            self._orphans = [r for r in self._orphans if not r.completed]
            self._orphans.extend(r for r in requests if not r.completed)

    def connect(self, address: bytes):
        """An endpoint with error handling to the worker at ``address``. Raises :class:`KVTransferError`."""
        try:
            with self._lock:
                addr = ucx.UCXAddress.create_from_buffer(address)
                return self._worker.create_endpoint_from_worker_address(addr, True)
        except ucx.UCXError as err:
            raise KVTransferError(f"cannot reach the UCX peer: {type(err).__name__}: {err}") from None

    def send(self, conn: Conn, buf: Array, tag: int) -> Request:
        """Post a send on ``conn``. Raises :class:`EndpointFailed` if it is closed or failed."""
        with conn.lock:
            self._check_open(conn)
            with self._lock:
                return Request(conn.ep.tag_send(buf, ucx.UCXXTag(tag)), buf)

    def recv(self, conn: Conn, buf: Array, tag: int) -> Request:
        """Post a receive tied to ``conn`` (closing ``conn`` cancels it). Raises :class:`EndpointFailed`."""
        with conn.lock:
            self._check_open(conn)
            with self._lock:
                return Request(conn.ep.tag_recv(buf, ucx.UCXXTag(tag)), buf)

    def recv_any(self, buf: Array, tag: int) -> Request:
        with self._lock:
            return Request(self._worker.tag_recv(buf, ucx.UCXXTag(tag)), buf)

    @staticmethod
    def _check_open(conn: Conn) -> None:
        if conn.closed or not _alive(conn.ep):
            raise EndpointFailed("the UCX endpoint is closed (peer failed or transceiver stopping)", timed_out=False)

    def progress(self) -> None:
        self._worker.progress()

    def wait_event(self) -> None:
        """Sleep (GIL released) until the worker has an event or ``EPOLL_TIMEOUT_MS`` passed, then progress."""
        self._worker.progress_worker_event(EPOLL_TIMEOUT_MS)

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            if self._progress_thread:
                self._worker.stop_progress_thread()


def wait_all(worker: Worker, requests: list[Request], deadline: float, what: str, stopping: threading.Event) -> None:
    """Wait until every request completed, progressing the worker from this thread meanwhile.

    The progress thread alone sleeps in epoll and misses the completion of requests posted from
    other threads until its epoll timeout; a waiter that progresses its own requests answers in
    microseconds. Raises :class:`EndpointFailed` on timeout, stop, or a UCX error.
    """
    pause, spins = 2e-5, 0
    pending = requests
    while pending:
        worker.progress()
        pending = [r for r in pending if not r.completed]
        if not pending:
            break
        if stopping.is_set():
            worker.adopt(pending)
            raise EndpointFailed(f"{what}: the transceiver is stopping", timed_out=False)
        left = deadline - time.monotonic()
        if left <= 0:
            worker.adopt(pending)
            raise EndpointFailed(f"{what} timed out", timed_out=True)
        spins += 1
        if spins < 64:
            time.sleep(0)  # yield the GIL only: most answers come within tens of microseconds
            continue
        time.sleep(min(pause, left))
        pause = min(pause * 2, 1e-3)
    for r in requests:
        try:
            r.check_error()
        except ucx.UCXError as err:
            raise EndpointFailed(f"{what} failed: {type(err).__name__}: {err}", timed_out=False) from None


class EndpointCache:
    """Endpoints per peer name, LRU-bounded; a retired endpoint closes when its last user is done."""

    def __init__(self, worker: Worker, capacity: int) -> None:
        self._worker, self._capacity = worker, capacity
        self._conns: OrderedDict[str | bytes, Conn] = OrderedDict()
        self._lock = threading.Lock()
        self.connects = 0

    def __len__(self) -> int:
        return len(self._conns)

    def acquire(self, key: str | bytes, address: bytes) -> tuple[Conn, bool]:
        """The endpoint for ``key`` (created if new or if the peer's address changed) and whether it is new."""
        with self._lock:
            conn = self._conns.get(key)
            if conn is not None and (conn.address != address or conn.closed):
                if conn.address != address:
                    log.info("KV peer %s restarted (new UCX worker address); replacing its endpoint", show_key(key))
                self._retire(conn)
                conn = None
            fresh = conn is None
            if fresh:
                conn = Conn(key, address, self._worker.connect(address))
                self.connects += 1
                self._conns[key] = conn
                while len(self._conns) > self._capacity:
                    self._retire(next(iter(self._conns.values())))
            self._conns.move_to_end(key)
            conn.users += 1
            return conn, fresh

    def release(self, conn: Conn) -> None:
        with self._lock:
            conn.users -= 1
            if conn.retired and conn.users == 0:
                close_conn(conn)

    def discard(self, conn: Conn) -> None:
        """Close now, even under other users: their receives must not outlive a failed endpoint
        (they fail with an error; their posts after this are refused, never crash)."""
        with self._lock:
            if self._conns.get(conn.key) is conn:
                del self._conns[conn.key]
            conn.retired = True
        close_conn(conn)

    def close_all(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for conn in conns:
            conn.retired = True
            close_conn(conn)

    def _retire(self, conn: Conn) -> None:
        del self._conns[conn.key]
        conn.retired = True
        if conn.users == 0:
            close_conn(conn)


def show_key(key: str | bytes) -> str:
    return key if isinstance(key, str) else f"<{len(key)}-byte address>"
