"""Gen side of the UCX KV transceiver: pull a parked request's blocks straight into local blocks.

Protocol, deadlines and where the bytes go: :mod:`kv_transfer.ucx_backend`.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import random
import re
import threading
import time

import numpy as np
import torch

from kv_transfer import cma
from kv_transfer.local_control import LocalControlClient, exchange
from kv_transfer.layout import KVLayout, check_pairing
from kv_transfer.peer_procs import PeerProcesses
from kv_transfer.runs import Segment, from_runs, landing, plan_segments, to_runs
from kv_transfer.ucx_backend import (ACK, CTRL_TAG, _SEQ_BITS, check_echo, parse_endpoint, seal_address,
                                     short_endpoint)
from kv_transfer.ucx_worker import (FRAME_BYTES, Array, Conn, EndpointCache, EndpointFailed, Worker, as_array,
                                    frame, wait_all)
from kv_transfer.wire import KVTransferError, send_msg, unpack_msg

log = logging.getLogger(__name__)

class _DirectRefused(KVTransferError):
    """The kernel refused a same-host read (EPERM): this peer's bytes must come as UCX messages."""


class _LocalUnreachable(KVTransferError):
    """The peer's same-host control socket is gone (it restarted or stopped): ask over UCX."""


_LOCAL_NAME = re.compile(r"pdserve-kv-[0-9]+-[0-9a-f]{16}")


class UcxKVClient:
    """Gen-side transceiver: pulls a parked request's blocks straight into local blocks.

    Args:
        layout: the layout of the cache pulls land in (checked against the ctx side's).
        same_host_reads: read same-host ctx caches with ``process_vm_readv`` (False: every byte
            travels as UCX messages, e.g. to measure that path).
    """

    def __init__(self, layout: KVLayout, same_host_reads: bool = True) -> None:
        self.layout = layout
        self._layout_dump = layout.model_dump()
        self._worker = Worker()
        self._reply_to = seal_address(self._worker.address)
        self._peers = EndpointCache(self._worker, capacity=64)
        self._tags = itertools.count(random.getrandbits(32))
        self._stopping = threading.Event()
        self._host_id = cma.host_identity() if same_host_reads else ""
        self._no_direct: set[str | bytes] = set()  # peers whose memory the kernel would not let us read
        self._local_names: dict[str | bytes, tuple[bytes, str]] = {}  # peer -> (its address, control socket)
        self._local = LocalControlClient()
        self._ctx_procs = PeerProcesses()
        self._parsed: dict[str, tuple[str | bytes, bytes]] = {}
        self._count_lock = threading.Lock()
        self.same_host_reads = 0  # pulls whose bytes were read straight from the ctx process
        self.local_control_pulls = 0  # of those, pulls asked over the peer's same-host control socket

    def start(self) -> None:
        """Nothing to start (the worker runs from construction); here for symmetry with the server."""

    def stop(self) -> None:
        self._stopping.set()
        self._local.close_all()
        self._ctx_procs.close()
        self._peers.close_all()
        self._worker.stop()

    @property
    def cached_endpoints(self) -> int:
        return len(self._peers)

    @property
    def local_control_peers(self) -> int:
        """Same-host peers whose control socket this client knows (their next pulls go there)."""
        return len(self._local_names)

    @property
    def connects(self) -> int:
        """Endpoints created so far (a cache hit creates none)."""
        return self._peers.connects

    def pull(self, endpoint: str, ctx_request_id: str, remote_layout: KVLayout,
             kv_cache: torch.Tensor, dst_block_ids: list[int], timeout_s: float, release: bool = True,
             src_first: int = 0) -> int:
        """Copy ``len(dst_block_ids)`` blocks of lease ``ctx_request_id``, from its block ``src_first``
        on (a partial pull), into ``kv_cache[dst_block_ids]``.

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
        peer, address = self._parse(endpoint)
        if not dst_block_ids or not all(0 <= b < kv_cache.shape[0] for b in dst_block_ids):
            raise KVTransferError(f"destination blocks {dst_block_ids!r} are not all in 0..{kv_cache.shape[0] - 1}")
        if self._stopping.is_set():
            raise KVTransferError("the KV transceiver is stopping")
        deadline = time.monotonic() + timeout_s
        name = short_endpoint(endpoint)
        local = self._local_names.get(peer) if self._host_id and peer not in self._no_direct else None
        if local is not None and local[0] == address:
            try:
                return self._pull_local(local[1], name, ctx_request_id, kv_cache, list(dst_block_ids), deadline,
                                        release, src_first)
            except _LocalUnreachable as err:
                log.info("KV pull from %s: its same-host control socket is gone (%s); asking over UCX", name, err)
                self._local_names.pop(peer, None)
                self._local.forget(local[1])
        for attempt in (0, 1):
            try:
                conn, fresh = self._peers.acquire(peer, address)
            except KVTransferError as err:
                raise KVTransferError(f"KV pull from {name} failed: {err}") from None
            try:
                direct = bool(self._host_id) and peer not in self._no_direct
                return self._pull_once(conn, name, ctx_request_id, kv_cache, list(dst_block_ids), deadline,
                                       release, direct, peer, address, src_first)
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

    def _parse(self, endpoint: str) -> tuple[str | bytes, bytes]:
        """:func:`parse_endpoint`, remembered (unsealing an address costs more than the rest of a
        same-host pull's bookkeeping); bounded by the endpoint cache's size."""
        parsed = self._parsed.get(endpoint)
        if parsed is None:
            parsed = parse_endpoint(endpoint)
            if len(self._parsed) >= 256:
                self._parsed.clear()
            self._parsed[endpoint] = parsed
        return parsed

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
                   dst_ids: list[int], deadline: float, release: bool, direct: bool,
                   peer: str | bytes, address: bytes, src_first: int) -> int:
        base = self._next_base()
        answer = self._ask(conn, rid, dst_ids, base, deadline, release, direct, src_first)
        nbytes, segments, deadline = self._check_answer(answer, base, endpoint, kv_cache, dst_ids, deadline,
                                                        lambda: self._send_done(conn, rid, base, release=False))
        if "src_addrs" in answer:
            try:
                self._read_direct(answer, kv_cache, segments, deadline, rid)
            except BaseException:
                self._send_done(conn, rid, base, release=False)  # unpin now rather than at the hold's end
                raise
            self._send_done(conn, rid, base, release)
            self._count_direct()
            self._learn_local(peer, address, answer.get("local_control"))
        else:
            self._receive(conn, rid, kv_cache, segments, base, nbytes, deadline)
        return nbytes

    def _pull_local(self, local: str, endpoint: str, rid: str, kv_cache: torch.Tensor, dst_ids: list[int],
                    deadline: float, release: bool, src_first: int) -> int:
        """A same-host pull whose control frames go over the peer's Unix control socket
        (:mod:`kv_transfer.local_control`): same messages, pins and deadlines as over UCX.
        Raises :class:`_LocalUnreachable` when the socket is gone (nothing was asked yet)."""
        base = self._next_base()
        try:
            sock = self._local.acquire(local, max(1e-3, deadline - time.monotonic()))
        except OSError as err:
            raise _LocalUnreachable(str(err)) from None
        answered = clean = False
        done = lambda rel: send_msg(sock, self._done_msg(rid, base, rel))  # noqa: E731
        try:
            answer = exchange(sock, self._pull_request(rid, dst_ids, base, deadline, release, True, src_first),
                              deadline, self._local.poller)
            answered = True
            nbytes, segments, deadline = self._check_answer(answer, base, endpoint, kv_cache, dst_ids, deadline,
                                                            lambda: done(False))
            if "src_addrs" not in answer:
                raise KVTransferError(f"ctx KV server {endpoint} answered a same-host pull without addresses")
            if self._stopping.is_set():
                raise KVTransferError("the KV transceiver is stopping")
            self._read_direct(answer, kv_cache, segments, deadline, rid)
            done(release)
            clean = True
        except (OSError, TimeoutError) as err:
            raise KVTransferError(f"KV pull of {rid} from {endpoint} (same-host control socket) failed: {err}") from None
        except BaseException:
            if answered and not clean:
                self._try_unpin(done)
            raise
        finally:
            self._local.release(local, sock, reuse=clean)
        self._count_direct(local_control=True)
        return nbytes

    @staticmethod
    def _try_unpin(done) -> None:
        try:
            done(False)  # unpin now rather than at the hold's end
        except OSError as err:
            log.info("could not tell the ctx side a failed same-host pull ended (%s); it unpins on its own", err)

    def _learn_local(self, peer: str | bytes, address: bytes, local: object) -> None:
        """Remember the peer's same-host control socket (named in its answer) for its next pulls."""
        if isinstance(local, str) and _LOCAL_NAME.fullmatch(local):
            old = self._local_names.get(peer)
            self._local_names[peer] = (address, local)
            if old is not None and old[1] != local:
                self._local.forget(old[1])  # the peer restarted: its old socket's connections are dead

    def _count_direct(self, local_control: bool = False) -> None:
        with self._count_lock:
            self.same_host_reads += 1
            self.local_control_pulls += local_control

    def _check_answer(self, answer: dict, base: int, endpoint: str, kv_cache: torch.Tensor, dst_ids: list[int],
                      deadline: float, unpin) -> tuple[int, list[Segment], float]:
        """(bytes, segments, the deadline cut to the ctx side's pin) of an accepted pull answer.
        Raises :class:`KVTransferError` for a refusal or a malformed answer (``unpin()`` first
        where the ctx side pinned the lease)."""
        check_echo(answer, base, endpoint)
        if not answer.get("ok"):
            raise KVTransferError(f"ctx KV server {endpoint} refused the pull: {answer.get('error')}")
        try:
            src_ids = from_runs(answer.get("src_runs") or [])
            nbytes = int(answer["bytes"])
        except (KeyError, ValueError, TypeError) as err:
            raise KVTransferError(f"ctx KV server {endpoint} answered a malformed pull header: {err}") from None
        row_bytes = math.prod(kv_cache.shape[1:]) * kv_cache.element_size()  # one block
        if len(src_ids) != len(dst_ids) or nbytes != len(dst_ids) * row_bytes:
            unpin()  # nothing will be read
            raise KVTransferError(f"ctx KV server {endpoint} sends {len(src_ids)} blocks / {nbytes} bytes; "
                                  f"{len(dst_ids)} blocks / {len(dst_ids) * row_bytes} bytes expected")
        if isinstance(answer.get("budget_ms"), int):  # the ctx side keeps its pin this long: read before
            deadline = min(deadline, time.monotonic() + answer["budget_ms"] / 1000)
        return nbytes, plan_segments(src_ids, dst_ids), deadline

    def _pull_request(self, rid: str, dst_ids: list[int], base: int, deadline: float, release: bool,
                      direct: bool, src_first: int) -> dict:
        return {"op": "pull", "ctx_request_id": rid, "layout": self._layout_dump, "dst_runs": to_runs(dst_ids),
                "reply_to": self._reply_to, "tag": base, "release": release,
                "budget_ms": int((deadline - time.monotonic()) * 1000), "host": self._host_id if direct else None,
                "src_first": src_first}

    def _ask(self, conn: Conn, rid: str, dst_ids: list[int], base: int, deadline: float,
             release: bool, direct: bool, src_first: int) -> dict:
        """Send the pull request; the ctx side's answer."""
        reply_buf = np.empty(FRAME_BYTES, dtype=np.uint8)
        request = self._pull_request(rid, dst_ids, base, deadline, release, direct, src_first)
        try:
            if request["budget_ms"] <= 0:
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
        # A contiguous host cache: each segment lands in place, its address by arithmetic (slicing
        # the tensor per segment cost ~20 us of a ~250 us pull); otherwise through landing().
        direct = not kv_cache.is_cuda and kv_cache.is_contiguous()
        row = math.prod(kv_cache.shape[1:]) * kv_cache.element_size()
        base = kv_cache.data_ptr()
        for seg, (addr, nbytes) in zip(segments, addrs):
            blocks = target = None
            if not direct:
                blocks = kv_cache[seg.dst_start:seg.dst_start + seg.count]
                target = landing(blocks)
            if nbytes != seg.count * row:
                raise KVTransferError(f"same-host segment of {rid}: {nbytes} bytes for a "
                                      f"{seg.count * row}-byte destination")
            dst_addr = base + seg.dst_start * row if direct else target.data_ptr()
            try:
                cma.read_remote(pid, addr, dst_addr, nbytes, deadline)
            except TimeoutError as err:
                raise KVTransferError(f"KV pull of {rid} timed out: {err}") from None
            except cma.CMAError as err:
                if err.errno == errno.EPERM:
                    raise _DirectRefused(f"the kernel refused a same-host read ({err})") from None
                gone = " (the ctx process is gone)" if err.errno == errno.ESRCH else ""
                raise KVTransferError(f"KV pull of {rid} failed mid-copy{gone}: {err}") from None
            if not direct and target is not blocks:
                blocks.copy_(target)
        self._check_ctx_process(pid, pid_start, rid)  # it lived through the copy: the bytes are its

    def _check_ctx_process(self, pid: int, pid_start: object, rid: str) -> None:
        """The pid still names the ctx process that answered (not a recycled pid): a pidfd check."""
        if not self._ctx_procs.alive(pid, pid_start):
            raise KVTransferError(f"KV pull of {rid} failed: the ctx process (pid {pid}) is gone")

    def _send_done(self, conn: Conn, rid: str, base: int, release: bool) -> None:
        """Tell the ctx side the read is over (it unpins, and releases if asked). Fire and forget:
        the send is posted and left to the progress thread (its buffer kept alive until it leaves);
        if it never arrives, the ctx side unpins at the end of its hold anyway."""
        try:
            request = self._worker.send(conn, frame(self._done_msg(rid, base, release)), CTRL_TAG)
        except EndpointFailed as err:
            log.info("KV pull of %s: the ctx side was not told the copy ended (%s); it unpins on its own", rid, err)
            return
        self._worker.adopt([request])

    def _done_msg(self, rid: str, base: int, release: bool) -> dict:
        return {"op": "done", "ctx_request_id": rid, "tag": base, "reply_to": self._reply_to, "release": release}

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
