"""Gen side of the UCX KV transceiver: pull a parked request's blocks straight into local blocks.

Protocol, deadlines and where the bytes go: :mod:`kv_transfer.ucx_backend`.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import random
import threading
import time

import numpy as np
import torch

from kv_transfer import cma
from kv_transfer.layout import KVLayout, check_pairing
from kv_transfer.runs import Segment, from_runs, landing, plan_segments, to_runs
from kv_transfer.ucx_backend import (ACK, CTRL_TAG, _SEQ_BITS, check_echo, parse_endpoint, seal_address,
                                     short_endpoint)
from kv_transfer.ucx_worker import (FRAME_BYTES, Array, Conn, EndpointCache, EndpointFailed, Worker, as_array,
                                    frame, wait_all)
from kv_transfer.wire import KVTransferError, unpack_msg
from pdserve.procfs import proc_start_time

log = logging.getLogger(__name__)

class _DirectRefused(KVTransferError):
    """The kernel refused a same-host read (EPERM): this peer's bytes must come as UCX messages."""


class UcxKVClient:
    """Gen-side transceiver: pulls a parked request's blocks straight into local blocks.

    Args:
        layout: the layout of the cache pulls land in (checked against the ctx side's).
        same_host_reads: read same-host ctx caches with ``process_vm_readv`` (False: every byte
            travels as UCX messages, e.g. to measure that path).
    """

    def __init__(self, layout: KVLayout, same_host_reads: bool = True) -> None:
        self.layout = layout
        self._worker = Worker()
        self._reply_to = seal_address(self._worker.address)
        self._peers = EndpointCache(self._worker, capacity=64)
        self._tags = itertools.count(random.getrandbits(32))
        self._stopping = threading.Event()
        self._host_id = cma.host_identity() if same_host_reads else ""
        self._no_direct: set[str | bytes] = set()  # peers whose memory the kernel would not let us read
        self._count_lock = threading.Lock()
        self.same_host_reads = 0  # pulls whose bytes were read straight from the ctx process

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

        With ``release`` the ctx side frees the lease once the copy is confirmed; without, call
        :meth:`release` after the last piece. Blocking; call from a worker thread.

        Returns:
            bytes received.
        Raises:
            KVLayoutMismatch: the layouts differ (checked before connecting, and again by the ctx side).
            KVTransferError: the peer is unreachable, refused, failed, or ``timeout_s`` passed.
        """
        check_pairing(self.layout, remote_layout)
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise KVTransferError(f"a KV pull needs a finite positive timeout, not {timeout_s!r}")
        peer, address = parse_endpoint(endpoint)
        if not dst_block_ids or not all(0 <= b < kv_cache.shape[0] for b in dst_block_ids):
            raise KVTransferError(f"destination blocks {dst_block_ids!r} are not all in 0..{kv_cache.shape[0] - 1}")
        if self._stopping.is_set():
            raise KVTransferError("the KV transceiver is stopping")
        deadline = time.monotonic() + timeout_s
        name = short_endpoint(endpoint)
        for attempt in (0, 1):
            try:
                conn, fresh = self._peers.acquire(peer, address)
            except KVTransferError as err:
                raise KVTransferError(f"KV pull from {name} failed: {err}") from None
            try:
                direct = bool(self._host_id) and peer not in self._no_direct
                return self._pull_once(conn, name, ctx_request_id, kv_cache, list(dst_block_ids), deadline,
                                       release, direct)
            except _DirectRefused as err:
                if attempt:
                    raise
                log.warning("KV pull from %s: %s; pulling from this peer over UCX messages from now on", name, err)
                self._no_direct.add(peer)
            except EndpointFailed as err:
                if not (err.timed_out and err.before_data):
                    # Broken, or receives into KV blocks are posted on it: close it, which cancels them
                    # (a late byte must not land in blocks freed after this failure). A pull that merely
                    # timed out waiting for its answer posted nothing but the answer's own buffer.
                    self._peers.discard(conn)
                # A cached endpoint may have gone bad with its peer: reconnect once, if UCX said so
                # before any byte moved (a timeout has spent the budget already).
                if fresh or attempt or err.timed_out or not err.before_data:
                    after = f" after {timeout_s:.1f} s" if err.timed_out else ""
                    raise KVTransferError(f"KV pull from {name} failed: {err}{after}") from None
                log.info("KV pull from %s: cached endpoint failed (%s); reconnecting once", name, err)
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
            self._release_lease(conn, short_endpoint(endpoint), ctx_request_id, self._next_base(), deadline)
        except EndpointFailed as err:
            self._peers.discard(conn)
            raise KVTransferError(f"releasing KV lease {ctx_request_id} at {short_endpoint(endpoint)} failed: {err}") from None
        finally:
            self._peers.release(conn)

    def _next_base(self) -> int:
        return (next(self._tags) % (1 << (63 - _SEQ_BITS)) or 1) << _SEQ_BITS

    def _release_lease(self, conn: Conn, endpoint: str, rid: str, base: int, deadline: float) -> None:
        ack_buf = np.empty(FRAME_BYTES, dtype=np.uint8)
        ack = self._worker.recv(conn, Array(ack_buf), base + ACK)
        release = {"op": "release", "ctx_request_id": rid, "reply_to": self._reply_to, "tag": base}
        self._wait([self._worker.send(conn, frame(release), CTRL_TAG), ack], deadline, "releasing the lease")
        answer = unpack_msg(memoryview(ack_buf))
        check_echo(answer, base, endpoint)
        if not answer.get("released"):
            raise KVTransferError(f"KV lease {rid} at {endpoint} was gone when released "
                                  "(expired or cancelled during the pull); its blocks may have been reused")

    def _pull_once(self, conn: Conn, endpoint: str, rid: str, kv_cache: torch.Tensor,
                   dst_ids: list[int], deadline: float, release: bool, direct: bool) -> int:
        base = self._next_base()
        answer = self._ask(conn, rid, dst_ids, base, deadline, release, direct)
        check_echo(answer, base, endpoint)
        if not answer.get("ok"):
            raise KVTransferError(f"ctx KV server {endpoint} refused the pull: {answer.get('error')}")
        try:
            src_ids = from_runs(answer.get("src_runs") or [])
            nbytes = int(answer["bytes"])
        except (KeyError, ValueError, TypeError) as err:
            raise KVTransferError(f"ctx KV server {endpoint} answered a malformed pull header: {err}") from None
        row_bytes = kv_cache[0].numel() * kv_cache.element_size()
        if len(src_ids) != len(dst_ids) or nbytes != len(dst_ids) * row_bytes:
            self._send_done(conn, rid, base, release=False)  # unpin: nothing will be read
            raise KVTransferError(f"ctx KV server {endpoint} sends {len(src_ids)} blocks / {nbytes} bytes; "
                                  f"{len(dst_ids)} blocks / {len(dst_ids) * row_bytes} bytes expected")
        segments = plan_segments(src_ids, dst_ids)
        if isinstance(answer.get("budget_ms"), int):  # the ctx side keeps its pin this long: read before
            deadline = min(deadline, time.monotonic() + answer["budget_ms"] / 1000)
        if "src_addrs" in answer:
            try:
                self._read_direct(answer, kv_cache, segments, deadline, rid)
            except BaseException:
                self._send_done(conn, rid, base, release=False)  # unpin now rather than at the hold's end
                raise
            self._send_done(conn, rid, base, release)
            with self._count_lock:
                self.same_host_reads += 1
        else:
            self._receive(conn, rid, kv_cache, segments, base, nbytes, deadline)
        return nbytes

    def _ask(self, conn: Conn, rid: str, dst_ids: list[int], base: int, deadline: float,
             release: bool, direct: bool) -> dict:
        """Send the pull request; the ctx side's answer."""
        reply_buf = np.empty(FRAME_BYTES, dtype=np.uint8)
        budget_ms = int((deadline - time.monotonic()) * 1000)
        request = {"op": "pull", "ctx_request_id": rid, "layout": self.layout.model_dump(),
                   "dst_runs": to_runs(dst_ids), "reply_to": self._reply_to, "tag": base, "release": release,
                   "budget_ms": budget_ms, "host": self._host_id if direct else None}
        try:
            if budget_ms <= 0:
                raise EndpointFailed("the pull's deadline passed before it was sent", timed_out=True)
            reply = self._worker.recv(conn, Array(reply_buf), base)
            sent = self._worker.send(conn, frame(request), CTRL_TAG)
            self._wait([sent, reply], deadline, "waiting for the ctx side's answer")
        except EndpointFailed as err:
            err.before_data = True
            raise
        return unpack_msg(memoryview(reply_buf))

    def _read_direct(self, answer: dict, kv_cache: torch.Tensor, segments: list[Segment], deadline: float,
                     rid: str) -> None:
        """Same host: read each segment from the ctx process into the cache (staged if not contiguous)."""
        try:
            pid, pid_start = int(answer["pid"]), answer.get("pid_start")
            addrs = [(int(a), int(n)) for a, n in answer["src_addrs"]]
        except (KeyError, ValueError, TypeError) as err:
            raise KVTransferError(f"malformed same-host pull answer for {rid}: {err}") from None
        self._check_ctx_process(pid, pid_start, rid)
        if len(addrs) != len(segments):
            raise KVTransferError(f"same-host pull answer for {rid} names {len(addrs)} segments, not {len(segments)}")
        for seg, (addr, nbytes) in zip(segments, addrs):
            blocks = kv_cache[seg.dst_start:seg.dst_start + seg.count]
            target = landing(blocks)
            if nbytes != target.numel() * target.element_size():
                raise KVTransferError(f"same-host segment of {rid}: {nbytes} bytes for a "
                                      f"{target.numel() * target.element_size()}-byte destination")
            try:
                cma.read_remote(pid, addr, target.data_ptr(), nbytes, deadline)
            except TimeoutError as err:
                raise KVTransferError(f"KV pull of {rid} timed out: {err}") from None
            except cma.CMAError as err:
                if err.errno == errno.EPERM:
                    raise _DirectRefused(f"the kernel refused a same-host read ({err})") from None
                gone = " (the ctx process is gone)" if err.errno == errno.ESRCH else ""
                raise KVTransferError(f"KV pull of {rid} failed mid-copy{gone}: {err}") from None
            if target is not blocks:
                blocks.copy_(target)
        self._check_ctx_process(pid, pid_start, rid)  # it lived through the copy: the bytes are its

    @staticmethod
    def _check_ctx_process(pid: int, pid_start: object, rid: str) -> None:
        """The pid still names the ctx process that answered (not a recycled pid)."""
        if pid_start is not None and proc_start_time(pid) != pid_start:
            raise KVTransferError(f"KV pull of {rid} failed: the ctx process (pid {pid}) is gone")

    def _send_done(self, conn: Conn, rid: str, base: int, release: bool) -> None:
        """Tell the ctx side the read is over (it unpins, and releases if asked). Fire and forget:
        the send is posted and left to the progress thread (its buffer kept alive until it leaves);
        if it never arrives, the ctx side unpins at the end of its hold anyway."""
        done = {"op": "done", "ctx_request_id": rid, "tag": base, "reply_to": self._reply_to, "release": release}
        try:
            request = self._worker.send(conn, frame(done), CTRL_TAG)
        except EndpointFailed as err:
            log.info("KV pull of %s: the ctx side was not told the copy ended (%s); it unpins on its own", rid, err)
            return
        self._worker.adopt([request])

    def _receive(self, conn: Conn, rid: str, kv_cache: torch.Tensor, segments: list[Segment], base: int,
                 nbytes: int, deadline: float) -> None:
        """Between hosts: one receive per segment, straight into the cache (staged only for a
        non-contiguous cache). Nothing is posted once the deadline passed."""
        if len(segments) >= ACK - 1:
            raise KVTransferError(f"pull of {rid} needs {len(segments)} messages; at most {ACK - 2} fit the tags")
        if time.monotonic() >= deadline:
            raise EndpointFailed(f"receiving {nbytes} bytes of {rid}: deadline passed before the copy", timed_out=True)
        staged, requests = [], []
        for i, seg in enumerate(segments):
            blocks = kv_cache[seg.dst_start:seg.dst_start + seg.count]
            target = landing(blocks)
            if target is not blocks:
                staged.append((blocks, target))
            requests.append(self._worker.recv(conn, as_array(target), base + 1 + i))
        self._wait(requests, deadline, f"receiving {nbytes} bytes of {rid}")
        for dst, tmp in staged:
            dst.copy_(tmp)

    def _wait(self, requests: list, deadline: float, what: str) -> None:
        wait_all(self._worker, requests, deadline, what, self._stopping)
