"""UCX KV transceiver (``ucxx``): the ctx side serves parked blocks, the gen side pulls them.

Interchangeable with :mod:`kv_transfer.tcp_backend` (same constructors, ``endpoint``, ``start``,
``stop``, ``pull``, same errors).

**Connection model.** Every server and client owns one UCX worker (:mod:`kv_transfer.ucx_worker`).
The ctx worker's address rides in the endpoint string ``ucx://HOST:PORT/<base64url worker
address>``; the gen side creates an endpoint from it (error handling on) and caches it per peer,
replacing it when the same name arrives with a new address (the peer restarted). Each request
carries the gen worker's address; the ctx side answers over an endpoint to it. ``HOST:PORT`` only
names the ctx server (UCX binds no port); with port 0 the worker address itself is the name.

**Where the bytes go.** Between processes on one host (equal :func:`kv_transfer.cma.host_identity`)
the gen side reads the ctx blocks itself with ``process_vm_readv`` (:mod:`kv_transfer.cma`; UCX's
own ``cma`` would abort the gen process if the ctx died mid-copy). Between hosts they travel as UCX
tagged messages. Either way they land straight in the gen side's allocated blocks.

**Protocol** (tagged messages; control frames as in :mod:`kv_transfer.wire`). The gen side picks a
tag base ``B`` per pull (its low 24 bits are zero):

1. gen → ctx on ``CTRL_TAG``: ``{"op": "pull", "ctx_request_id", "layout", "dst_runs",
   "reply_to", "tag": B, "release": bool, "budget_ms": int, "host": str | null, "src_first": int}``
   — ``budget_ms`` is what is left of the gen side's timeout; ``host`` asks for a same-host read;
   ``src_first`` (default 0) is the index of the first lease block wanted (a partial pull skips
   the blocks the gen side's prefix cache holds).
2. ctx checks the layout pairing and pins the lease; answers on ``B``: ``{"ok": true, "bytes": N,
   "src_runs", "tag": B}`` plus, for a same-host read, ``"pid"`` and ``"src_addrs"`` (one
   ``[address, bytes]`` per segment); or ``{"ok": false, "error", "tag": B}``. Every reply echoes
   ``B``; the gen side rejects a reply naming another base. ``"pid_start"`` (the ctx process's start
   time, /proc/PID/stat field 22) lets the gen side check, before and after reading, that the pid
   still names the ctx process and not a recycled one.
3. Both sides cut the block pairing into segments contiguous on both sides
   (:func:`kv_transfer.runs.plan_segments`). *Same host:* the gen side reads each segment, then
   sends ``{"op": "done", "ctx_request_id", "tag": B, "reply_to", "release": bool}``; the ctx side unpins on
   it. *Between hosts:* right behind the answer the ctx side sends segment ``i`` with tag ``B+1+i``
   (rendezvous: the send completes once the gen side has the bytes), then unpins.
4. With ``"release": true`` the ctx side releases the lease itself while still pinned, so no
   timer or cancel can have freed the blocks mid-copy. With ``"release": false`` (one lease pulled
   in pieces, e.g. by several gen TP ranks) the gen side sends ``{"op": "release", ...}`` once all
   pieces are in; ctx frees the lease and acks on ``B + ACK``, saying whether it was still there.

**Deadlines and the pin.** The ctx side counts the gen side's budget from when the request
arrived (its own waits end at its own timeout if that is shorter). If the copy is not confirmed
(gen side gone, slow, or the sends did not complete), the lease stays pinned until the gen side's
budget plus ``GRACE_S`` has passed, and only then is unpinned (and may expire or be freed): the gen
side never starts a read or posts a receive after its deadline, so no block is read after it was
freed.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kv_transfer import cma
from kv_transfer.layout import KVLayout, KVLayoutMismatch, bytes_per_block, check_pairing
from kv_transfer.lease import LeaseError, LeaseTable
from kv_transfer.local_control import LocalControlServer
from kv_transfer.pin_holds import PinHolds
from kv_transfer.runs import Segment, from_runs, plan_segments, to_runs
from kv_transfer.ucx_worker import (FRAME_BYTES, Array, Conn, EndpointCache, EndpointFailed, Worker, as_array,
                                    frame, ucx, wait_all)
from kv_transfer.wire import KVTransferError, unpack_msg
from pdserve.procfs import proc_start_time

log = logging.getLogger(__name__)

SCHEME = "ucx://"
CTRL_TAG = 0xC7A1_0000_0000_0001  # ctx workers receive requests here; gen tag bases stay below 2**63
_SEQ_BITS = 24
ACK = (1 << _SEQ_BITS) - 1  # offset of the release ack; segments use offsets 1 .. ACK - 1
GRACE_S = 2.0  # a pin outlives the gen side's deadline by this much (one chunk's copy, clock skew)
# After answering a same-host pull of at most this many bytes the connection thread polls for its
# ``done`` (kv_transfer.local_control.SPIN_S); a larger read (~10 GB/s here) takes longer than
# that poll, which would only burn CPU and count as a miss (a backoff of the next polls).
POLL_DONE_BYTES = 2 << 20


_SEAL_BYTES = 8

Reply = Callable[..., None]  # reply(answer: dict, fast: bool = False): answer one pull


def seal_address(address: bytes) -> str:
    """A UCX worker address for the wire: base64url of the address and an 8-byte BLAKE2b checksum.
    UCX asserts (aborting the process) on a malformed address, so nothing unchecked reaches it."""
    return base64.urlsafe_b64encode(address + hashlib.blake2b(address, digest_size=_SEAL_BYTES).digest()).decode()


def unseal_address(text: str) -> bytes:
    """Inverse of :func:`seal_address`. Raises :class:`KVTransferError` for anything it did not make."""
    try:
        raw = base64.urlsafe_b64decode(text.encode())
    except ValueError:
        raw = b""
    address, seal = raw[:-_SEAL_BYTES], raw[-_SEAL_BYTES:]
    if not address or hashlib.blake2b(address, digest_size=_SEAL_BYTES).digest() != seal:
        raise KVTransferError("malformed UCX worker address (checksum mismatch)")
    return address


def format_endpoint(host: str, port: int, address: bytes) -> str:
    return f"{SCHEME}{host}:{port}/{seal_address(address)}"


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
        address = unseal_address(encoded)
    except KVTransferError as err:
        raise KVTransferError(f"malformed KV endpoint {short_endpoint(endpoint)!r}: {err}") from None
    if not host or not port.isdigit():
        raise KVTransferError(f"malformed KV endpoint {short_endpoint(endpoint)!r}")
    return (name if int(port) else encoded), address


class UcxKVServer:
    """Ctx-side transceiver: serves the blocks of parked leases to gen servers over UCX.

    Args:
        kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (block-major).
        layout: this server's layout (checked against the puller's).
        leases: the lease table holding parked requests.
        host, port: name this server in its endpoint (see the module docstring; nothing is bound).
        timeout_s: longest deadline of one pull on this side (the gen side's budget may be shorter).
        on_sent: ``(bytes, seconds)`` after each served pull.
        same_host_reads: let same-host gen servers read the cache with ``process_vm_readv``
            (:func:`kv_transfer.cma.allow_readers` at start); False: bytes always go as UCX messages.
            Ignored (bytes go as messages) for a cache that is not contiguous host memory: the
            readers address a run of blocks as one range from the cache's base pointer.
    """

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable,
                 host: str, port: int, timeout_s: float,
                 on_sent: Callable[[int, float], None] | None = None, same_host_reads: bool = True) -> None:
        self.kv_cache, self.layout, self.leases = kv_cache, layout, leases
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.on_sent = on_sent or (lambda nbytes, seconds: None)
        self._bytes_per_block = bytes_per_block(layout)
        # Block i starts at _cache_ptr + i * _block_stride and a run of blocks is one range:
        # true of a contiguous cache only (the engine's); a view (a slice of heads or layers, every
        # other block) would be read as other bytes, so its blocks go as messages (.contiguous()).
        self._cache_ptr = kv_cache.data_ptr()
        self._block_stride = kv_cache.stride(0) * kv_cache.element_size()
        readable = kv_cache.is_contiguous() and not kv_cache.is_cuda
        if same_host_reads and not readable:
            log.info("KV cache %s is not contiguous host memory: same-host pulls get its blocks as UCX messages",
                     tuple(kv_cache.shape))
        self._layout_dump = layout.model_dump()
        self._host_id = cma.host_identity() if same_host_reads and readable else ""
        self._identity = (os.getpid(), proc_start_time(os.getpid()))  # a recycled pid cannot pass for us
        self._worker = Worker(progress_thread=False)  # progressed by the control loop
        self._peers = EndpointCache(self._worker, capacity=256)
        self._holds = PinHolds(leases)
        self._stopping = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-ucx-serve")
        self._control_buf = np.empty(FRAME_BYTES, dtype=np.uint8)
        self._thread = threading.Thread(target=self._control_loop, name="kv-ucx-server", daemon=True)
        self._local = LocalControlServer(self._on_local) if self._host_id else None

    @property
    def endpoint(self) -> str:
        return format_endpoint(self.host, self.port, self._worker.address)

    def start(self) -> None:
        if self._host_id:
            cma.allow_readers()  # same-host gen servers read the cache with process_vm_readv
        self._thread.start()
        if self._local is not None:
            self._local.start()
        log.info("KV transfer backend: ucx, worker address of %d bytes, peer name %s:%d",
                 len(self._worker.address), self.host, self.port)

    def stop(self, timeout_s: float = 5.0) -> None:
        # Order: no new requests, then let in-flight pulls abort (their waits watch _stopping) and
        # unpin their leases, then close endpoints; the worker goes last.
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._local is not None:
            self._local.stop(timeout_s)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._holds.clear()
        self._peers.close_all()
        self._worker.stop()

    def _control_loop(self) -> None:
        """Receive requests and hand each to the pool (``done`` is handled here: it only unpins).
        Drives this worker's progress: it sleeps in epoll (GIL released) and wakes when a message
        arrives, at the latest every few milliseconds to unpin expired holds."""
        while not self._stopping.is_set():
            req = self._worker.recv_any(Array(self._control_buf), CTRL_TAG)
            while not req.completed:
                if self._stopping.is_set():
                    return  # the posted receive dies with the worker; its buffer is ours until then
                self._worker.wait_event()
                self._holds.reap()
            received = time.monotonic()
            try:
                req.check_error()
                msg = unpack_msg(memoryview(self._control_buf))
            except (ucx.UCXError, KVTransferError) as err:
                log.warning("dropping a bad KV control message: %s", err)
                continue
            try:
                if msg.get("op") == "done":
                    self._on_done(msg)
                elif self._serves_inline(msg):
                    self._guarded_handle(msg, received)
                else:
                    self._pool.submit(self._guarded_handle, msg, received)
            except Exception:  # noqa: BLE001 - one bad message must not end KV serving
                log.exception("KV control message %r could not be handled", str(msg)[:200])

    def _serves_inline(self, msg: dict) -> bool:
        """A same-host pull is answered on the control loop itself: its work is a lease lookup and
        one posted answer (no wait), and a hand-off to the pool cost more than that (~80 us of the
        ~250 us budget of a 1 MiB pull). Cross-host pulls, releases and a fault-injection delay go
        to the pool (they wait on sends)."""
        return (bool(self._host_id) and msg.get("op") == "pull" and msg.get("host") == self._host_id
                and not self.leases.pull_delay_s)

    def _guarded_handle(self, msg: dict, received: float) -> None:
        try:
            self._handle(msg, received)
        except Exception:  # noqa: BLE001 - the pool would swallow it silently; its pin ends with its hold
            log.exception("KV request %s failed", msg.get("ctx_request_id"))

    def _on_done(self, msg: dict) -> None:
        try:
            key = _pull_key(msg)
        except (KeyError, ValueError, TypeError) as err:
            log.warning("dropping a malformed KV done message: %s", err)
            return
        finished = self._holds.done(key, msg.get("release") is True)
        if finished is not None:
            self.on_sent(finished[1], finished[0])

    def _deadlines(self, msg: dict, received: float) -> tuple[float, float]:
        """(when this side stops waiting, when a pin may end): our timeout, cut to the gen side's
        budget, counted from arrival; a pin outlives that by ``GRACE_S``. The answer tells the gen
        side what is left (``budget_ms``), and it reads no later, so no pull pins a lease for longer
        than this server's timeout plus the grace, whatever budget the gen side asked for."""
        budget_s = msg["budget_ms"] / 1000 if isinstance(msg.get("budget_ms"), int) else self.timeout_s
        deadline = received + min(self.timeout_s, budget_s)
        return deadline, deadline + GRACE_S

    def _handle(self, msg: dict, received: float) -> None:
        try:
            reply_to = unseal_address(str(msg["reply_to"]))
            base = int(msg["tag"])
            if base & ACK or not 0 < base < 1 << 63:
                raise ValueError(f"bad tag base {base:#x}")
        except (KeyError, ValueError, TypeError, KVTransferError) as err:
            log.warning("dropping a KV request without a usable reply address: %s", err)
            return
        deadline, hold_until = self._deadlines(msg, received)
        if time.monotonic() >= deadline:
            log.warning("dropping KV request %s: its gen side gave up before it was served", msg.get("ctx_request_id"))
            return
        try:
            conn, _ = self._peers.acquire(reply_to, reply_to)
        except KVTransferError as err:
            log.warning("cannot answer a KV request: %s", err)
            return
        try:
            if msg.get("op") == "pull":
                self._serve_pull(self._ucx_reply(conn, base, deadline), base, msg, deadline, hold_until, conn)
            elif msg.get("op") == "release":
                released = self.leases.release(str(msg.get("ctx_request_id")))
                self._send_control(conn, base + ACK, {"ok": True, "released": released}, deadline)
            else:
                self._send_control(conn, base, {"ok": False, "error": f"unknown op {msg.get('op')!r}"}, deadline)
        except EndpointFailed as err:
            self._peers.discard(conn)
            log.warning("KV request %s ended with an error: %s", msg.get("ctx_request_id"), err)
        finally:
            self._peers.release(conn)

    def _send_control(self, conn: Conn, tag: int, msg: dict, deadline: float) -> None:
        msg["tag"] = tag & ~ACK  # the request's tag base, echoed: the gen side checks it
        wait_all(self._worker, [self._worker.send(conn, frame(msg), tag)], deadline, "answering a KV request",
                 self._stopping)

    def _ucx_reply(self, conn: Conn, base: int, deadline: float) -> Reply:
        """Answers on ``base`` over UCX: refusals are waited for; a same-host answer is posted and
        left to the control loop's progress (``fast=True``): if it never arrives the gen side times
        out and the hold unpins at its deadline, as for a lost ``done``."""
        def reply(msg: dict, fast: bool = False) -> None:
            if not fast:
                self._send_control(conn, base, msg, deadline)
                return
            msg["tag"] = base
            self._worker.adopt([self._worker.send(conn, frame(msg), base)])
        return reply

    def _on_local(self, msg: dict, reply: Callable[[dict], None]) -> bool:
        """A frame on the same-host control socket (:mod:`kv_transfer.local_control`): a same-host
        pull, answered there, or its ``done``. The pins and deadlines are those of a UCX pull.
        Returns True when a pull of at most :data:`POLL_DONE_BYTES` was answered (its ``done`` is
        due within the connection thread's poll)."""
        received = time.monotonic()
        if msg.get("op") == "done":
            self._on_done(msg)
            return False
        try:
            base = int(msg["tag"])
            if base & ACK or not 0 < base < 1 << 63:
                raise ValueError(f"bad tag base {base:#x}")
        except (KeyError, ValueError, TypeError) as err:
            reply({"ok": False, "error": f"bad KV request: {err}"})
            return False
        if msg.get("op") != "pull" or msg.get("host") != self._host_id:
            reply({"ok": False, "error": "the same-host control socket serves same-host pulls only", "tag": base})
            return False
        deadline, hold_until = self._deadlines(msg, received)
        answered = []

        def answer_pull(answer: dict, fast: bool = False) -> None:
            answered.append(answer.get("ok") is True and answer.get("bytes", 0) <= POLL_DONE_BYTES)
            reply({**answer, "tag": base})
        self._serve_pull(answer_pull, base, msg, deadline, hold_until)
        return any(answered)

    def _serve_pull(self, reply: Reply, base: int, msg: dict, deadline: float, hold_until: float,
                    conn: Conn | None = None) -> None:
        """Pin the lease and answer; ``conn`` (UCX only) carries the bytes of a cross-host pull."""
        rid = str(msg.get("ctx_request_id"))
        try:
            if msg.get("layout") != self._layout_dump:  # the same layout as ours needs no parsing
                check_pairing(KVLayout.model_validate(msg.get("layout")), self.layout, "gen", "ctx")
            dst_ids = from_runs(msg.get("dst_runs") or [])
            first = msg.get("src_first", 0)
            if not isinstance(first, int) or first < 0:
                raise ValueError(f"bad src_first {first!r}")
            lease = self.leases.begin_pull(rid)
        except (LeaseError, KVLayoutMismatch, ValueError, TypeError) as err:
            reply({"ok": False, "error": str(err)})
            return
        num_blocks = len(dst_ids)
        if not 0 < num_blocks <= len(lease.block_ids) - first:
            self.leases.end_pull(rid)
            error = f"asked for {num_blocks} blocks from block {first}; lease {rid} holds {len(lease.block_ids)}"
            reply({"ok": False, "error": error})
            return
        src_ids = lease.block_ids[first:first + num_blocks]
        answer = {"ok": True, "bytes": num_blocks * self._bytes_per_block, "src_runs": to_runs(src_ids),
                  "budget_ms": int((hold_until - GRACE_S - time.monotonic()) * 1000)}
        # From here on the gen side may be reading: the pin ends with the copy's confirmation (or
        # completed sends), else at hold_until. Registered before anything can fail or be answered.
        key = _pull_key(msg)
        if not self._holds.hold(key, hold_until, answer["bytes"]):
            self.leases.end_pull(rid)
            error = f"a pull of {rid} with tag base {base:#x} from this gen client is in progress already"
            reply({"ok": False, "error": error})
            return
        segments = plan_segments(src_ids, dst_ids)
        if self._host_id and msg.get("host") == self._host_id:
            self._answer_direct(reply, answer, segments)
        elif conn is not None:
            self._send_blocks(conn, key, answer, segments, deadline, msg.get("release") is True)

    def _answer_direct(self, reply: Reply, answer: dict, segments: list[Segment]) -> None:
        """Same host: tell the gen side where the blocks are (and where this server's same-host
        control socket listens); it reads them and confirms (``done``)."""
        row, base, stride = self._bytes_per_block, self._cache_ptr, self._block_stride
        answer["pid"], answer["pid_start"] = self._identity
        # Addresses by arithmetic on the contiguous cache (indexing the tensor per segment cost
        # ~10 us of a ~250 us pull).
        answer["src_addrs"] = [[base + s.src_start * stride, s.count * row] for s in segments]
        if self._local is not None:
            answer["local_control"] = self._local.name
        reply(answer, fast=True)

    def _send_blocks(self, conn: Conn, key: tuple[str, int, str], answer: dict, segments: list[Segment],
                     deadline: float, release: bool) -> None:
        """Between hosts: the answer and the segments back to back; unpin once the sends completed
        (a failure leaves the hold: the gen side may still read posted sends until its deadline)."""
        rid, base, _ = key
        answer["tag"] = base
        buffers = [frame(answer)]
        requests = [self._worker.send(conn, buffers[0], base)]
        for i, seg in enumerate(segments):
            blocks = self.kv_cache[seg.src_start:seg.src_start + seg.count]
            buffers.append(as_array(blocks if blocks.is_contiguous() else blocks.contiguous()))
            requests.append(self._worker.send(conn, buffers[-1], base + 1 + i))
        wait_all(self._worker, requests, deadline, f"sending {answer['bytes']} bytes of {rid}", self._stopping)
        finished = self._holds.done(key, release)
        if finished is not None:
            self.on_sent(finished[1], finished[0])


def _pull_key(msg: dict) -> tuple[str, int, str]:
    """Names one pull of one gen client: (ctx_request_id, tag base, reply_to). Raises KeyError/ValueError/TypeError."""
    return str(msg["ctx_request_id"]), int(msg["tag"]), str(msg["reply_to"])


def check_echo(answer: dict, base: int, endpoint: str) -> None:
    """A reply must name the pull it answers."""
    if answer.get("tag", base) != base:
        raise KVTransferError(f"ctx KV server {endpoint} answered tag base {answer.get('tag')!r}, "
                              f"not {base:#x}: a crossed reply")
