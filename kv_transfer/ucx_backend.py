"""UCX KV transceiver (``ucxx``): the ctx side serves parked blocks, the gen side pulls them zero-copy.

Interchangeable with :mod:`kv_transfer.tcp_backend` (same constructors, ``endpoint``, ``start``,
``stop``, ``pull``, same errors).

**Connection model.** Every server and client owns one UCX worker (its own context and progress
thread; nothing process-global, so a process may hold several). The ctx worker's address rides in
the endpoint string ``ucx://HOST:PORT/<base64url worker address>`` and the gen side creates an
endpoint from it with endpoint error handling *off*: that is what lets UCX use ``cma`` (one
``process_vm_readv`` from the ctx process into the gen cache). The listener API forces error
handling and then runs over tcp only (~1 GB/s, FACTS.md). Each gen request carries the gen
worker's address; the ctx side answers over an endpoint to it.

Without error handling UCX reports no peer failure, so every wait has a deadline, and an endpoint
that timed out or failed is closed at once: closing cancels its posted receives, so a late message
cannot land in blocks that were meanwhile freed and reused.

**Peers.** ``HOST:PORT`` names the ctx server (UCX binds no port): the gen side caches one
endpoint per name and replaces it when the same name arrives with a new worker address (the peer
restarted). With port 0 the worker address itself is the name; stale endpoints then age out of
the bounded cache.

**Protocol** (tagged messages; control frames as in :mod:`kv_transfer.wire`). The gen side picks a
tag base ``B`` per pull (its low 24 bits are zero):

1. gen → ctx on ``CTRL_TAG``: ``{"op": "pull", "ctx_request_id", "layout", "dst_runs",
   "reply_to", "tag": B, "release": bool}``.
2. ctx checks the layout pairing and pins the lease; answers on ``B``:
   ``{"ok": true, "bytes": N, "src_runs", "tag": B}`` or ``{"ok": false, "error", "tag": B}`` (every
   reply echoes ``B``; the gen side rejects a reply naming another base).
3. Right behind the answer (no round trip), both sides cut the block pairing into runs contiguous
   on both sides (:func:`kv_transfer.runs.plan_segments`); segment ``i`` goes from
   ``ctx_cache[src:src+n]`` to ``gen_cache[dst:dst+n]`` with tag ``B+1+i``. Large messages use UCX
   rendezvous: the gen side reads the ctx memory, and the ctx send completes only once the bytes
   have landed; small ones are copied out eagerly at send time. Either way, once every send has
   completed the ctx blocks are no longer read.
4. With ``"release": true`` the ctx side then releases the lease itself, still pinned (so no timer
   or cancel can have freed the blocks mid-copy): a pull costs one round trip plus the bytes. With
   ``"release": false`` (one lease pulled in pieces, e.g. by several gen TP ranks) the gen side
   sends ``{"op": "release", ...}`` on ``CTRL_TAG`` once all pieces are in; ctx frees the lease and
   acks on ``B + ACK``, saying whether the lease was still there.
"""

from __future__ import annotations

import base64
import itertools
import logging
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kv_transfer.layout import KVLayout, KVLayoutMismatch, bytes_per_block, check_pairing
from kv_transfer.lease import LeaseError, LeaseTable
from kv_transfer.runs import from_runs, plan_segments, to_runs
from kv_transfer.wire import MAX_HEADER_BYTES, KVTransferError, pack_msg, unpack_msg

# UCX reads this when its library loads (at import), so it must be set before importing ucxx.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
from ucxx._lib import libucxx as ucx  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

log = logging.getLogger(__name__)

SCHEME = "ucx://"
CTRL_TAG = 0xC7A1_0000_0000_0001  # ctx workers receive requests here; gen tag bases stay below 2**63
_SEQ_BITS = 24
ACK = (1 << _SEQ_BITS) - 1  # offset of the release ack; segments use offsets 1 .. ACK - 1
_FRAME_BYTES = 4 + MAX_HEADER_BYTES
_EPOLL_TIMEOUT_MS = 5  # bound of one event wait: a wakeup another thread's progress consumed costs this much


def format_endpoint(host: str, port: int, address: bytes) -> str:
    return f"{SCHEME}{host}:{port}/{base64.urlsafe_b64encode(address).decode()}"


def short_endpoint(endpoint: str) -> str:
    """An endpoint for messages: the worker address cut to its first characters."""
    return endpoint if len(endpoint) <= 48 else endpoint[:40] + "…"


def parse_endpoint(endpoint: str) -> tuple[str, bytes]:
    """``ucx://HOST:PORT/ADDR`` → (peer name, worker address). Raises :class:`KVTransferError`."""
    if not endpoint.startswith(SCHEME):
        raise KVTransferError(f"unsupported KV endpoint {endpoint!r} (this server speaks ucx://)")
    name, _, encoded = endpoint[len(SCHEME):].partition("/")
    host, _, port = name.rpartition(":")
    try:
        address = base64.urlsafe_b64decode(encoded.encode())
    except ValueError:
        address = b""
    if not host or not port.isdigit() or not address:
        raise KVTransferError(f"malformed KV endpoint {short_endpoint(endpoint)!r}")
    return (name if int(port) else encoded), address


class _EndpointFailed(KVTransferError):
    """A wait on an endpoint timed out or UCX failed it: the endpoint must not be reused."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.before_data = False  # set when it failed before any KV byte was asked for


def _as_array(blocks: torch.Tensor) -> Array:
    """A contiguous tensor as a flat byte buffer sharing its memory."""
    return Array(blocks.view(torch.uint8).reshape(-1).numpy())


def _frame(msg: dict) -> Array:
    return Array(np.frombuffer(bytearray(pack_msg(msg)), dtype=np.uint8))


class _Request:
    """A UCX request together with the buffer it reads or fills.

    ``ucxx`` requests keep only a raw pointer to their buffer: a send posted from a temporary
    (``send(ep, _frame(msg), tag)``) lets Python free the frame while UCX has not sent it yet (a
    fresh endpoint queues sends until its wireup completes; rendezvous reads the buffer late), and
    the peer then receives whatever reuses that memory: a "bad control message" of garbage length.
    Holding the buffer here keeps it alive as long as anyone can still wait on the request.
    """

    __slots__ = ("request", "buffer")

    def __init__(self, request, buffer: Array) -> None:
        self.request, self.buffer = request, buffer

    @property
    def completed(self) -> bool:
        return self.request.completed

    def check_error(self) -> None:
        self.request.check_error()


class _Worker:
    """One UCX context + worker; submissions are serialized by a lock.

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
            # Blocking (event-driven) progress: polling mode is faster but starves a 2-core machine.
            # The epoll timeout bounds a lost wakeup: with the default (-1, wait forever) a second
            # rendezvous pull on a cached endpoint hung here until its deadline.
            self._worker.start_progress_thread(polling_mode=False, epoll_timeout=_EPOLL_TIMEOUT_MS)
        else:
            self._worker.init_blocking_progress_mode()
        self.address: bytes = self._worker.address.tobytes()
        self._lock = threading.Lock()
        self._stopped = False
        self._orphans: list[_Request] = []  # abandoned by a failed wait; kept until UCX is done with them

    def adopt(self, requests: list[_Request]) -> None:
        """Keep the buffers of requests nobody waits for any more alive until they complete or are
        cancelled (closing their endpoint), so that no late byte lands in, or leaves from, freed memory."""
        with self._lock:
            self._orphans = [r for r in self._orphans if not r.completed]
            self._orphans.extend(r for r in requests if not r.completed)

    def connect(self, address: bytes):
        try:
            with self._lock:
                addr = ucx.UCXAddress.create_from_buffer(address)
                return self._worker.create_endpoint_from_worker_address(addr, False)
        except ucx.UCXError as err:
            raise KVTransferError(f"cannot reach the UCX peer: {type(err).__name__}: {err}") from None

    def send(self, ep, buf: Array, tag: int) -> _Request:
        with self._lock:
            return _Request(ep.tag_send(buf, ucx.UCXXTag(tag)), buf)

    def recv(self, ep, buf: Array, tag: int) -> _Request:
        """A receive tied to ``ep``: closing ``ep`` cancels it."""
        with self._lock:
            return _Request(ep.tag_recv(buf, ucx.UCXXTag(tag)), buf)

    def recv_any(self, buf: Array, tag: int) -> _Request:
        with self._lock:
            return _Request(self._worker.tag_recv(buf, ucx.UCXXTag(tag)), buf)

    def progress(self) -> None:
        self._worker.progress()

    def wait_event(self) -> None:
        """Sleep (GIL released) until the worker has an event or ``_EPOLL_TIMEOUT_MS`` passed, then progress."""
        self._worker.progress_worker_event(_EPOLL_TIMEOUT_MS)

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            if self._progress_thread:
                self._worker.stop_progress_thread()


def _wait(worker: _Worker, requests: list, deadline: float, what: str, stopping: threading.Event) -> None:
    """Wait until every request completed, progressing the worker from this thread meanwhile.

    The progress thread alone sleeps in epoll and misses the completion of requests posted from
    other threads until its epoll timeout (each round trip then costs milliseconds); a waiter
    that progresses its own requests answers in microseconds.
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
            raise _EndpointFailed(f"{what}: the transceiver is stopping", timed_out=False)
        left = deadline - time.monotonic()
        if left <= 0:
            worker.adopt(pending)
            raise _EndpointFailed(f"{what} timed out", timed_out=True)
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
            raise _EndpointFailed(f"{what} failed: {type(err).__name__}: {err}", timed_out=False) from None


class _Conn:
    __slots__ = ("key", "address", "ep", "users", "retired", "closed")

    def __init__(self, key: str | bytes, address: bytes, ep) -> None:
        self.key, self.address, self.ep = key, address, ep
        self.users, self.retired, self.closed = 0, False, False


class _EndpointCache:
    """Endpoints per peer name, LRU-bounded; a retired endpoint closes when its last user is done."""

    def __init__(self, worker: _Worker, capacity: int) -> None:
        self._worker, self._capacity = worker, capacity
        self._conns: OrderedDict[str | bytes, _Conn] = OrderedDict()
        self._lock = threading.Lock()
        self.connects = 0

    def __len__(self) -> int:
        return len(self._conns)

    def acquire(self, key: str | bytes, address: bytes) -> tuple[_Conn, bool]:
        """The endpoint for ``key`` (created if new or if the peer's address changed) and whether it is new."""
        with self._lock:
            conn = self._conns.get(key)
            if conn is not None and conn.address != address:
                log.info("KV peer %s restarted (new UCX worker address); replacing its endpoint", _show(key))
                self._retire(conn)
                conn = None
            fresh = conn is None
            if fresh:
                conn = _Conn(key, address, self._worker.connect(address))
                self.connects += 1
                self._conns[key] = conn
                while len(self._conns) > self._capacity:
                    self._retire(next(iter(self._conns.values())))
            self._conns.move_to_end(key)
            conn.users += 1
            return conn, fresh

    def release(self, conn: _Conn) -> None:
        with self._lock:
            conn.users -= 1
            if conn.retired and conn.users == 0:
                _close(conn)

    def discard(self, conn: _Conn) -> None:
        """Close now, even under other users: their receives must not outlive a failed endpoint."""
        with self._lock:
            if self._conns.get(conn.key) is conn:
                del self._conns[conn.key]
            if not conn.retired:
                conn.retired = True
                _close(conn)

    def close_all(self) -> None:
        with self._lock:
            for conn in self._conns.values():
                conn.retired = True
                _close(conn)
            self._conns.clear()

    def _retire(self, conn: _Conn) -> None:
        del self._conns[conn.key]
        conn.retired = True
        if conn.users == 0:
            _close(conn)


def _close(conn: _Conn) -> None:
    if conn.closed:
        return  # closing a UCX endpoint twice crashes the process
    conn.closed = True
    try:
        conn.ep.close()
    except ucx.UCXError as err:
        log.debug("closing a UCX endpoint: %s", err)


def _show(key: str | bytes) -> str:
    return key if isinstance(key, str) else f"<{len(key)}-byte address>"


class UcxKVServer:
    """Ctx-side transceiver: serves the blocks of parked leases to gen servers over UCX.

    Args:
        kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (block-major).
        layout: this server's layout (checked against the puller's).
        leases: the lease table holding parked requests.
        host, port: name this server in its endpoint (see the module docstring; nothing is bound).
        timeout_s: deadline of one pull on this side.
        on_sent: ``(bytes, seconds)`` after each served pull.
    """

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable,
                 host: str, port: int, timeout_s: float,
                 on_sent: Callable[[int, float], None] | None = None) -> None:
        self.kv_cache, self.layout, self.leases = kv_cache, layout, leases
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.on_sent = on_sent or (lambda nbytes, seconds: None)
        self._bytes_per_block = bytes_per_block(layout)
        self._worker = _Worker(progress_thread=False)  # progressed by the control loop
        self._peers = _EndpointCache(self._worker, capacity=256)
        self._stopping = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-ucx-serve")
        self._control_buf = np.empty(_FRAME_BYTES, dtype=np.uint8)
        self._thread = threading.Thread(target=self._control_loop, name="kv-ucx-server", daemon=True)

    @property
    def endpoint(self) -> str:
        return format_endpoint(self.host, self.port, self._worker.address)

    def start(self) -> None:
        self._thread.start()
        log.info("KV transfer backend: ucx, worker address of %d bytes, peer name %s:%d",
                 len(self._worker.address), self.host, self.port)

    def stop(self, timeout_s: float = 5.0) -> None:
        # Order: no new requests, then let in-flight pulls abort (their waits watch _stopping) and
        # unpin their leases, then close endpoints; the progress thread goes last.
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._peers.close_all()
        self._worker.stop()

    def _control_loop(self) -> None:
        """Receive pull and release requests; hand each to the pool. Drives this worker's progress:
        it sleeps in epoll (GIL released) and wakes when a message arrives."""
        while not self._stopping.is_set():
            req = self._worker.recv_any(Array(self._control_buf), CTRL_TAG)
            while not req.completed:
                if self._stopping.is_set():
                    return  # the posted receive dies with the worker; its buffer is ours until then
                self._worker.wait_event()
            try:
                req.check_error()
                msg = unpack_msg(memoryview(self._control_buf))
            except (ucx.UCXError, KVTransferError) as err:
                log.warning("dropping a bad KV control message: %s", err)
                continue
            self._pool.submit(self._handle, msg)

    def _handle(self, msg: dict) -> None:
        try:
            reply_to = base64.urlsafe_b64decode(str(msg["reply_to"]).encode())
            base = int(msg["tag"])
            if base & ACK or not 0 < base < 1 << 63:
                raise ValueError(f"bad tag base {base:#x}")
        except (KeyError, ValueError, TypeError) as err:
            log.warning("dropping a KV request without a usable reply address: %s", err)
            return
        deadline = time.monotonic() + self.timeout_s
        try:
            conn, _ = self._peers.acquire(reply_to, reply_to)
        except KVTransferError as err:
            log.warning("cannot answer a KV request: %s", err)
            return
        try:
            if msg.get("op") == "pull":
                self._serve_pull(conn, base, msg, deadline)
            elif msg.get("op") == "release":
                released = self.leases.release(str(msg.get("ctx_request_id")))
                self._send_control(conn, base + ACK, {"ok": True, "released": released}, deadline)
            else:
                self._send_control(conn, base, {"ok": False, "error": f"unknown op {msg.get('op')!r}"}, deadline)
        except _EndpointFailed as err:
            self._peers.discard(conn)
            log.warning("KV request %s ended with an error: %s", msg.get("ctx_request_id"), err)
        finally:
            self._peers.release(conn)

    def _send_control(self, conn: _Conn, tag: int, msg: dict, deadline: float) -> None:
        msg["tag"] = tag & ~ACK  # the request's tag base, echoed: the gen side checks it
        _wait(self._worker, [self._worker.send(conn.ep, _frame(msg), tag)], deadline, "answering a KV request", self._stopping)

    def _serve_pull(self, conn: _Conn, base: int, msg: dict, deadline: float) -> None:
        rid = str(msg.get("ctx_request_id"))
        try:
            remote = KVLayout.model_validate(msg.get("layout"))
            check_pairing(remote, self.layout, "gen", "ctx")
            dst_ids = from_runs(msg.get("dst_runs") or [])
            lease = self.leases.begin_pull(rid)
        except (LeaseError, KVLayoutMismatch, ValueError, TypeError) as err:
            self._send_control(conn, base, {"ok": False, "error": str(err)}, deadline)
            return
        try:
            num_blocks = len(dst_ids)
            if not 0 < num_blocks <= len(lease.block_ids):
                error = f"asked for {num_blocks} blocks; lease {rid} holds {len(lease.block_ids)}"
                self._send_control(conn, base, {"ok": False, "error": error}, deadline)
                return
            src_ids = lease.block_ids[:num_blocks]
            nbytes = num_blocks * self._bytes_per_block
            answer = {"ok": True, "bytes": nbytes, "src_runs": to_runs(src_ids), "tag": base}
            t0 = time.perf_counter()
            buffers = [_frame(answer)]
            requests = [self._worker.send(conn.ep, buffers[0], base)]
            for i, seg in enumerate(plan_segments(src_ids, dst_ids)):
                blocks = self.kv_cache[seg.src_start:seg.src_start + seg.count]
                buffers.append(_as_array(blocks if blocks.is_contiguous() else blocks.contiguous()))
                requests.append(self._worker.send(conn.ep, buffers[-1], base + 1 + i))
            try:
                _wait(self._worker, requests, deadline, f"sending {nbytes} bytes of {rid}", self._stopping)
            except _EndpointFailed:
                self._peers.discard(conn)  # cancel the sends before end_pull may free the blocks
                raise
            if msg.get("release") is True:
                self.leases.release(rid)  # still pinned: applied by end_pull below
            self.on_sent(nbytes, time.perf_counter() - t0)
        finally:
            self.leases.end_pull(rid)


def _check_echo(answer: dict, base: int, endpoint: str) -> None:
    """A reply must name the pull it answers (servers without the echo are accepted)."""
    if answer.get("tag", base) != base:
        raise KVTransferError(f"ctx KV server {endpoint} answered tag base {answer.get('tag')!r}, "
                              f"not {base:#x}: a crossed reply")


class UcxKVClient:
    """Gen-side transceiver: pulls a parked request's blocks straight into local blocks over UCX."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._worker = _Worker()
        self._reply_to = base64.urlsafe_b64encode(self._worker.address).decode()
        self._peers = _EndpointCache(self._worker, capacity=64)
        self._tags = itertools.count(random.getrandbits(32))
        self._stopping = threading.Event()

    def start(self) -> None:
        """Nothing to start (the worker runs from construction); here for symmetry with the server."""

    def stop(self) -> None:
        self._stopping.set()
        self._peers.close_all()
        self._worker.stop()

    @property
    def cached_endpoints(self) -> int:
        return len(self._peers)

    @property
    def connects(self) -> int:
        """Endpoints created so far (a cache hit creates none)."""
        return self._peers.connects

    def pull(self, endpoint: str, ctx_request_id: str, remote_layout: KVLayout,
             kv_cache: torch.Tensor, dst_block_ids: list[int], timeout_s: float, release: bool = True) -> int:
        """Copy ``len(dst_block_ids)`` blocks of lease ``ctx_request_id`` into ``kv_cache[dst_block_ids]``.

        With ``release`` the ctx side frees the lease once its sends completed (step 4 of the module
        docstring); without, call :meth:`release` after the last piece. Blocking; call from a worker thread.

        Returns:
            bytes received.
        Raises:
            KVLayoutMismatch: the layouts differ (checked before connecting, and again by the ctx side).
            KVTransferError: the peer is unreachable, refused, failed, or ``timeout_s`` passed.
        """
        check_pairing(self.layout, remote_layout)
        peer, address = parse_endpoint(endpoint)
        if not dst_block_ids or not all(0 <= b < kv_cache.shape[0] for b in dst_block_ids):
            raise KVTransferError(f"destination blocks {dst_block_ids!r} are not all in 0..{kv_cache.shape[0] - 1}")
        deadline = time.monotonic() + timeout_s
        for attempt in (0, 1):
            conn, fresh = self._peers.acquire(peer, address)
            try:
                return self._pull_once(conn, short_endpoint(endpoint), ctx_request_id, kv_cache, list(dst_block_ids),
                                       deadline, release)
            except _EndpointFailed as err:
                self._peers.discard(conn)
                # A cached endpoint may have gone bad with its peer: reconnect once, if UCX said so
                # before any byte moved (a timeout has spent the budget already).
                retry = not fresh and attempt == 0 and not err.timed_out and err.before_data
                if not retry:
                    after = f" after {timeout_s:.1f} s" if err.timed_out else ""
                    raise KVTransferError(f"KV pull from {short_endpoint(endpoint)} failed: {err}{after}") from None
                log.info("KV pull from %s: cached endpoint failed (%s); reconnecting once", short_endpoint(endpoint), err)
            finally:
                self._peers.release(conn)
        raise AssertionError("unreachable")

    def release(self, endpoint: str, ctx_request_id: str, timeout_s: float) -> None:
        """Release a lease after pulls made with ``release=False``.

        Raises:
            KVTransferError: unreachable peer, timeout, or the lease was already gone.
        """
        peer, address = parse_endpoint(endpoint)
        deadline = time.monotonic() + timeout_s
        conn, _ = self._peers.acquire(peer, address)
        try:
            base = (next(self._tags) % (1 << (63 - _SEQ_BITS)) or 1) << _SEQ_BITS
            self._release_lease(conn, short_endpoint(endpoint), ctx_request_id, base, deadline)
        except _EndpointFailed as err:
            self._peers.discard(conn)
            raise KVTransferError(f"releasing KV lease {ctx_request_id} at {short_endpoint(endpoint)} failed: {err}") from None
        finally:
            self._peers.release(conn)

    def _release_lease(self, conn: _Conn, endpoint: str, rid: str, base: int, deadline: float) -> None:
        ack_buf = np.empty(_FRAME_BYTES, dtype=np.uint8)
        ack = self._worker.recv(conn.ep, Array(ack_buf), base + ACK)
        release = {"op": "release", "ctx_request_id": rid, "reply_to": self._reply_to, "tag": base}
        self._wait([self._worker.send(conn.ep, _frame(release), CTRL_TAG), ack], deadline, "releasing the lease")
        answer = unpack_msg(memoryview(ack_buf))
        _check_echo(answer, base, endpoint)
        if not answer.get("released"):
            raise KVTransferError(f"KV lease {rid} at {endpoint} was gone when released "
                                  "(expired or cancelled during the pull); its blocks may have been reused")

    def _pull_once(self, conn: _Conn, endpoint: str, rid: str, kv_cache: torch.Tensor,
                   dst_ids: list[int], deadline: float, release: bool = True) -> int:
        base = (next(self._tags) % (1 << (63 - _SEQ_BITS)) or 1) << _SEQ_BITS
        reply_buf = np.empty(_FRAME_BYTES, dtype=np.uint8)
        try:
            reply = self._worker.recv(conn.ep, Array(reply_buf), base)
            request = {"op": "pull", "ctx_request_id": rid, "layout": self.layout.model_dump(),
                       "dst_runs": to_runs(dst_ids), "reply_to": self._reply_to, "tag": base, "release": release}
            sent = self._worker.send(conn.ep, _frame(request), CTRL_TAG)
            self._wait([sent, reply], deadline, "waiting for the ctx side's answer")
        except _EndpointFailed as err:
            err.before_data = True
            raise
        answer = unpack_msg(memoryview(reply_buf))
        _check_echo(answer, base, endpoint)
        if not answer.get("ok"):
            raise KVTransferError(f"ctx KV server {endpoint} refused the pull: {answer.get('error')}")
        try:
            src_ids = from_runs(answer.get("src_runs") or [])
            nbytes = int(answer["bytes"])
        except (KeyError, ValueError, TypeError) as err:
            raise KVTransferError(f"ctx KV server {endpoint} answered a malformed pull header: {err}") from None
        row_bytes = kv_cache[0].numel() * kv_cache.element_size()
        if len(src_ids) != len(dst_ids) or nbytes != len(dst_ids) * row_bytes:
            raise KVTransferError(f"ctx KV server {endpoint} sends {len(src_ids)} blocks / {nbytes} bytes; "
                                  f"{len(dst_ids)} blocks / {len(dst_ids) * row_bytes} bytes expected")
        self._receive(conn, rid, kv_cache, plan_segments(src_ids, dst_ids), base, nbytes, deadline)
        return nbytes

    def _receive(self, conn: _Conn, rid: str, kv_cache: torch.Tensor, segments: list, base: int,
                 nbytes: int, deadline: float) -> None:
        """One receive per segment, straight into the cache (staged only for a non-contiguous cache)."""
        if len(segments) >= ACK - 1:
            raise KVTransferError(f"pull of {rid} needs {len(segments)} messages; at most {ACK - 2} fit the tags")
        staged, requests = [], []
        for i, seg in enumerate(segments):
            blocks = kv_cache[seg.dst_start:seg.dst_start + seg.count]
            if not blocks.is_contiguous():
                staged.append((blocks, torch.empty_like(blocks, memory_format=torch.contiguous_format)))
                blocks = staged[-1][1]
            requests.append(self._worker.recv(conn.ep, _as_array(blocks), base + 1 + i))
        self._wait(requests, deadline, f"receiving {nbytes} bytes of {rid}")
        for dst, tmp in staged:
            dst.copy_(tmp)

    def _wait(self, requests: list, deadline: float, what: str) -> None:
        _wait(self._worker, requests, deadline, what, self._stopping)
