"""TCP KV transceiver: the ctx side serves parked blocks, the gen side pulls them.

Protocol (one connection per pull, gen side speaks first; control frames as in ``wire``):

1. gen → ctx ``{"op": "pull", "ctx_request_id", "layout", "num_blocks", "release": bool}``
2. ctx checks the lease and the layout pairing, answers ``{"ok": true, "bytes": N}`` followed by
   N raw bytes (``num_blocks`` block-major blocks in token order), or ``{"ok": false, "error"}``.
   With ``"release": true`` it releases the lease once the last byte left its cache (into the
   kernel's socket buffer), still pinned, so no timer or cancel can free it mid-copy.
3. Pieces of one lease (``"release": false``): gen → ctx ``{"op": "release", "ctx_request_id"}``
   after the last; ctx frees the lease and answers ``{"ok": true, "released": bool}``. A lease
   whose puller dies is left to its timer.

Blocking sockets in threads, no staging copies: the ctx side ``sendall``s each run of consecutive
source blocks straight from its cache, the gen side ``recv_into``s each run of consecutive
destination blocks straight into its own (the stream is cut differently on both sides; only the
byte order, block i of the lease → ``dst_block_ids[i]``, is shared).
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable

import torch

from kv_transfer.layout import KVLayout, KVLayoutMismatch, bytes_per_block, check_pairing
from kv_transfer.lease import LeaseError, LeaseTable
from kv_transfer.runs import landing, to_runs
from kv_transfer.wire import KVTransferError, parse_endpoint, recv_exact_into, recv_msg, send_msg

log = logging.getLogger(__name__)



def _byte_view(blocks: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, shared (no copy)."""
    return memoryview(blocks.view(torch.uint8).reshape(-1).numpy())


class TcpKVServer:
    """Ctx-side transceiver: serves the blocks of parked leases to gen servers.

    Args:
        kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (block-major).
        layout: this server's layout (checked against the puller's).
        leases: the lease table holding parked requests.
        host, port: where to listen (port 0 = any free port; see :attr:`endpoint`).
        timeout_s: socket timeout of one pull.
    """

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable,
                 host: str, port: int, timeout_s: float,
                 on_sent: Callable[[int, float], None] | None = None) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.leases = leases
        self.timeout_s = timeout_s
        self.on_sent = on_sent or (lambda nbytes, seconds: None)
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve_connection(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-tcp-server",
                                        kwargs={"poll_interval": 0.2}, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def start(self) -> None:
        self._thread.start()
        log.info("KV transfer backend: tcp, listening on %s", self.endpoint)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)

    def _serve_connection(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout_s)
        try:
            while True:
                try:
                    msg = recv_msg(sock)
                except KVTransferError:
                    return  # peer closed
                if msg.get("op") == "pull":
                    self._serve_pull(sock, msg)
                elif msg.get("op") == "release":
                    released = self.leases.release(str(msg.get("ctx_request_id")))
                    send_msg(sock, {"ok": True, "released": released})
                else:
                    send_msg(sock, {"ok": False, "error": f"unknown op {msg.get('op')!r}"})
                    return
        except (OSError, KVTransferError) as err:
            log.warning("KV connection ended with an error: %s", err)

    def _serve_pull(self, sock: socket.socket, msg: dict) -> None:
        rid = str(msg.get("ctx_request_id"))
        try:
            remote = KVLayout.model_validate(msg.get("layout"))
            check_pairing(remote, self.layout, "gen", "ctx")
            lease = self.leases.begin_pull(rid)
        except (LeaseError, KVLayoutMismatch, ValueError, TypeError) as err:
            send_msg(sock, {"ok": False, "error": str(err)})
            return
        try:
            num_blocks = msg.get("num_blocks", 0)
            if not isinstance(num_blocks, int) or not 0 < num_blocks <= len(lease.block_ids):
                send_msg(sock, {"ok": False, "error": f"asked for {num_blocks} blocks; lease {rid} holds {len(lease.block_ids)}"})
                return
            bpb = bytes_per_block(self.layout)
            send_msg(sock, {"ok": True, "bytes": num_blocks * bpb})
            t0 = time.perf_counter()
            for start, count in to_runs(lease.block_ids[:num_blocks]):  # pinned: the blocks stay ours
                sock.sendall(_byte_view(self.kv_cache[start:start + count].contiguous().cpu()))  # a CUDA cache: staged
            if msg.get("release") is True:
                self.leases.release(rid)  # still pinned: applied by end_pull below
            self.on_sent(num_blocks * bpb, time.perf_counter() - t0)
        finally:
            self.leases.end_pull(rid)


class TcpKVClient:
    """Gen-side transceiver: pulls a parked request's blocks into local blocks."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def start(self) -> None:
        """Nothing to start (one connection per pull); here so that clients are interchangeable."""

    def stop(self) -> None:
        """Nothing to stop."""

    def pull(self, endpoint: str, ctx_request_id: str, remote_layout: KVLayout,
             kv_cache: torch.Tensor, dst_block_ids: list[int], timeout_s: float, release: bool = True) -> int:
        """Copy ``len(dst_block_ids)`` blocks of lease ``ctx_request_id`` into ``kv_cache[dst_block_ids]``.

        With ``release`` the ctx side releases the lease once it sent the bytes; without, call
        :meth:`release` after the last piece (it fails if the lease vanished between pieces: the
        blocks may have been reused). The whole pull is bounded by ``timeout_s``. Blocking; call
        from a worker thread.

        Returns:
            bytes received.
        Raises:
            KVLayoutMismatch: the layouts differ (checked before connecting, and again by the ctx side).
            KVTransferError: the peer is unreachable, refused, closed early, or ``timeout_s`` passed.
        """
        check_pairing(self.layout, remote_layout)
        host, port = parse_endpoint(endpoint)
        deadline = time.monotonic() + timeout_s
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                sock.settimeout(timeout_s)
                send_msg(sock, {"op": "pull", "ctx_request_id": ctx_request_id, "layout": self.layout.model_dump(),
                                "num_blocks": len(dst_block_ids), "release": release})
                answer = recv_msg(sock)
                if not answer.get("ok"):
                    raise KVTransferError(f"ctx KV server {endpoint} refused the pull: {answer.get('error')}")
                nbytes = int(answer["bytes"])
                expected = len(dst_block_ids) * kv_cache[0].numel() * kv_cache.element_size()
                if nbytes != expected:
                    raise KVTransferError(f"ctx KV server {endpoint} sends {nbytes} bytes; {expected} expected")
                self._receive(sock, kv_cache, dst_block_ids, deadline)
                return nbytes
        except socket.timeout:
            raise KVTransferError(f"KV pull from {endpoint} timed out after {timeout_s:.1f} s") from None
        except OSError as err:
            raise KVTransferError(f"KV pull from {endpoint} failed: {err}") from None

    @staticmethod
    def _receive(sock: socket.socket, kv_cache: torch.Tensor, dst_block_ids: list[int], deadline: float) -> None:
        """Read the pulled blocks in order, each run of consecutive ids straight into the cache
        (through a staging tensor only where the cache slice is not contiguous)."""
        for start, count in to_runs(dst_block_ids):
            blocks = kv_cache[start:start + count]
            target = landing(blocks)
            recv_exact_into(sock, _byte_view(target), deadline)
            if target is not blocks:
                blocks.copy_(target)

    def release(self, endpoint: str, ctx_request_id: str, timeout_s: float) -> None:
        """Release a lease after a pull made with ``release=False``.

        Raises:
            KVTransferError: unreachable peer, timeout, or the lease was already gone.
        """
        host, port = parse_endpoint(endpoint)
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                sock.settimeout(timeout_s)
                self._release_on(sock, endpoint, ctx_request_id)
        except OSError as err:
            raise KVTransferError(f"releasing KV lease {ctx_request_id} at {endpoint} failed: {err}") from None

    @staticmethod
    def _release_on(sock: socket.socket, endpoint: str, ctx_request_id: str) -> None:
        send_msg(sock, {"op": "release", "ctx_request_id": ctx_request_id})
        if not recv_msg(sock).get("released"):
            raise KVTransferError(f"KV lease {ctx_request_id} at {endpoint} was gone when released "
                                  "(expired or cancelled during the pull); its blocks may have been reused")
