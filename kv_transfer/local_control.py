"""Same-host control channel of the UCX KV transceiver: framed JSON over a Unix stream socket.

Why: on one host the KV bytes of a pull never travel through UCX (the gen side reads them with
``process_vm_readv``, :mod:`kv_transfer.cma`), but its three control messages (pull, answer, done)
did, over UCX endpoints with error handling, which on one host run over tcp: each message cost
~75 us to post here and the round trip ~450 us, most of a 1 MiB pull's ~0.8 ms (profiled in
``docs/benchmarks.md``). A Unix socket carries the same frames (:mod:`kv_transfer.wire`) in tens of
microseconds.

The ctx server listens on an abstract-namespace socket (Linux; nothing on the file system to clean
up) named in its same-host pull answers (``"local_control"``); a gen client that got such an answer
sends that peer's later same-host pulls here. Only processes of this server's own user are served
(``SO_PEERCRED``), the same rule ``process_vm_readv`` itself applies. The messages, pins and
deadlines are exactly those of :mod:`kv_transfer.ucx_backend`; only the carrier differs.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from kv_transfer.wire import KVTransferError, recv_msg, send_msg

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64  # one per concurrent pull of each same-host gen client (4 each today)
# How long a side polls (without blocking) for the frame it expects next: the gen side for the
# answer to its pull, the ctx side for the ``done`` after answering one. A thread blocked in recv
# must be woken by the sender, which on this VM costs the *sender* ~15-20 us per send (the wake-up
# IPI) and the receiver its wake-up latency; a polling receiver costs neither. An answer takes
# ~60-100 us and a 1 MiB read ~60 us, so 300 us covers both for small pulls; past it the side
# blocks as before. Measured in docs/benchmarks.md (same-host pull latency).
SPIN_S = 300e-6
# Spinning pays only while the polling thread keeps its CPU and the GIL and the frame comes within
# the budget: a poll iteration then takes ~1-2 us. An iteration that took longer than STALL_S
# (the thread waited for the GIL: another thread of this process runs Python, the engine or other
# pulls; or for a CPU: a loaded host), or a budget spent without the frame, is a *miss*: the spin
# only took CPU from the thread that was to send the frame. With an engine decoding in the same
# process, on a loaded host, 1 MiB pulls took ~2.4-3.5 ms p50 polling vs ~0.6-0.9 ms blocking
# (bench/poll_cost.py, docs/benchmarks.md). So a miss ends the poll at once and its Poller blocks
# at once for BACKOFF_S, twice as long after each further miss (a loaded host stays loaded), at
# most MAX_BACKOFF_S; a poll that sees its frame in time starts the count again.
STALL_S = 100e-6
BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

Reply = Callable[[dict], None]


def _abstract(name: str) -> str:
    return "\0" + name


class LocalControlServer:
    """Serves control frames from same-host gen clients; one thread per connection.

    Args:
        handler: ``handler(msg, reply)`` for each frame received; ``reply(frame)`` answers on the
            same connection. Called on the connection's thread; exceptions are logged and end that
            connection only. A true result means another frame from the same client is due at
            once (a ``done`` after a pull answer): the thread polls for it for up to
            :data:`SPIN_S` before it blocks (:class:`Poller`, one for all connections).
    """

    def __init__(self, handler: Callable[[dict, Reply], bool | None]) -> None:
        self.name = f"pdserve-kv-{os.getpid()}-{secrets.token_hex(8)}"
        self._handler = handler
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(_abstract(self.name))
        self._listener.listen(MAX_CONNECTIONS)
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._poller = Poller()
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-local-accept", daemon=True)

    def start(self) -> None:
        self._accept_thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listener and every connection, then join their threads (bounded)."""
        self._stopping.set()
        _shutdown(self._listener)
        self._listener.close()
        self._accept_thread.join(timeout_s)
        with self._lock:
            conns = dict(self._conns)
        for sock in conns:
            _shutdown(sock)
        end = time.monotonic() + timeout_s
        for thread in conns.values():
            thread.join(max(0.0, end - time.monotonic()))

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            uid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if uid == os.getuid() and not full:
                    thread = threading.Thread(target=self._serve, args=(sock,), name="kv-local-conn", daemon=True)
                    self._conns[sock] = thread
                    thread.start()
                    continue
            log.warning("refusing a same-host KV control connection (uid %d, %d open)", uid, len(self._conns))
            sock.close()

    def _serve(self, sock: socket.socket) -> None:
        def reply(msg: dict) -> None:
            send_msg(sock, msg)

        try:
            while not self._stopping.is_set():
                try:
                    msg = recv_msg(sock)
                except KVTransferError:
                    return  # the gen side closed the connection (or sent a bad frame)
                if self._handler(msg, reply):
                    self._poller.wait(sock, SPIN_S)  # its ``done`` follows within microseconds
        except OSError as err:
            log.info("same-host KV control connection ended: %s", err)
        except Exception:  # noqa: BLE001 - one bad message ends its connection, never the server
            log.exception("same-host KV control message could not be handled")
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()


class LocalControlClient:
    """Connected sockets to same-host ctx servers, pooled per socket name (LIFO, one per pull), and
    the :class:`Poller` its pulls share (``poller``: pass it to :func:`exchange`)."""

    def __init__(self) -> None:
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self.poller = Poller()

    def acquire(self, name: str, timeout_s: float) -> socket.socket:
        """An idle connection to ``name`` or a new one. Raises ``OSError`` when none can be made
        (the ctx process is gone or restarted: its name no longer exists)."""
        with self._lock:
            idle = self._idle.get(name)
            if idle:
                return idle.pop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(_abstract(name))
        except OSError:
            sock.close()
            raise
        return sock

    def release(self, name: str, sock: socket.socket, reuse: bool) -> None:
        """Give a connection back after a pull; ``reuse`` False closes it (a failed exchange may
        leave unread bytes on it)."""
        if reuse:
            with self._lock:
                self._idle.setdefault(name, []).append(sock)
                return
        sock.close()

    def forget(self, name: str) -> None:
        """Close the idle connections to ``name`` (its server went away)."""
        with self._lock:
            socks = self._idle.pop(name, [])
        for sock in socks:
            sock.close()

    def close_all(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()


def exchange(sock: socket.socket, msg: dict, deadline: float, poller: Poller | None = None) -> dict:
    """Send ``msg`` and read one answer by ``deadline`` (``time.monotonic``), polling for it first
    (``poller``, for up to :data:`SPIN_S`; None: block at once).

    Raises:
        TimeoutError: the deadline passed.
        ConnectionError: the ctx side closed the connection before answering (its process died,
            or its connection thread ended) or sent a malformed frame.
        OSError: the connection failed otherwise.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the pull's deadline passed before it was sent")
    sock.settimeout(left)
    send_msg(sock, msg)
    if poller is not None:
        poller.wait(sock, min(SPIN_S, left))
    try:
        return recv_msg(sock)
    except socket.timeout:
        raise TimeoutError("no answer from the ctx side before the deadline") from None
    except KVTransferError as err:  # EOF or a bad frame: an OSError, so the caller names the pull
        raise ConnectionError(f"no answer from the ctx side: {err}") from None


class Poller:
    """The bounded poll before a blocking read, switched off for a while when it does not pay.

    :meth:`wait` polls a socket without blocking (``poll`` with a 0 timeout, GIL released in each
    call) and yields the CPU between polls (``sched_yield``: a peer thread that shares this CPU,
    e.g. the one about to send the awaited frame, runs first). A miss (an iteration longer than
    :data:`STALL_S`, or the budget spent, without the frame) ends the poll and makes every
    ``wait`` of the next :attr:`backoff_s` return at once (:data:`BACKOFF_S`, doubled per further
    miss up to :data:`MAX_BACKOFF_S`; a poll that sees its frame resets it). Shared by threads: a
    racing update only moves the end of a backoff.
    """

    def __init__(self) -> None:
        self._quiet_until = 0.0  # time.perf_counter(): no polling before it
        self.backoff_s = 0.0  # the length of the last backoff; 0 once a poll saw its frame
        self.misses = 0  # polls that ended without their frame (each started a backoff)

    def wait(self, sock: socket.socket, budget_s: float) -> bool:
        """Poll ``sock`` for up to ``budget_s`` seconds; True once it is readable (data or EOF),
        False after a miss or while backing off. Reading is left to the caller, which then
        blocks as usual."""
        start = time.perf_counter()
        if budget_s <= 0 or start < self._quiet_until:
            return False
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        end, last = start + budget_s, start
        while not poller.poll(0):
            now = time.perf_counter()
            if now - last > STALL_S or now >= end:
                self._miss(now)
                return False
            os.sched_yield()
            last = now
        self.backoff_s = 0.0
        return True

    def _miss(self, now: float) -> None:
        self.backoff_s = min(MAX_BACKOFF_S, max(BACKOFF_S, 2 * self.backoff_s))
        self._quiet_until = now + self.backoff_s
        self.misses += 1


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (a listener) or already closed
