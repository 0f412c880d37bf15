"""Same-host GPU → GPU KV transfer through CUDA IPC handles, with the TCP backend's control plane.

Endpoint scheme ``cudaipc://host:port``. The ctx side is a :class:`TcpKVServer` that also answers

1. gen → ctx ``{"op": "pull_ipc", "ctx_request_id", "layout", "num_blocks", "release", "host",
   "have"}`` (``host``: :func:`kv_transfer.cma.host_identity`; ``have``: the cache id the gen side
   already mapped, or null);
2. ctx checks host, lease and layout and **pins** the lease (as a TCP or CMA pull does), then
   answers ``{"ok": true, "cache_id", "block_ids", "handle"}`` (``handle``: the cache's
   :func:`kv_transfer.cuda_ipc.export_handle`, sent only when ``have`` is not its ``cache_id``) or
   ``{"ok": false, "error"}``;
3. the gen side copies ``block_ids`` device-to-device into its own blocks, waits for the copy
   (one stream synchronize), then sends ``{"op": "done"}``; the ctx side unpins (and with
   ``release`` releases) and answers ``{"ok": true}``. The copy counts only if that answer arrives
   before the pull's deadline: bytes are valid only while the ctx side held the pin.

A gen server opens a ctx server's handle once and caches it by ``cache_id`` (a fresh id per ctx
process, so a restarted ctx server on the same port is mapped anew); a refused or broken
connection drops the cached mapping and raises :class:`KVTransferError` naming the peer. A pull
that cannot use IPC (another host, or this side's cache is on the CPU) falls back to the TCP
``pull`` op, staged through host memory.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time

import torch

from kv_transfer.cma import host_identity
from kv_transfer.cuda_ipc import CudaIpcError, export_handle, open_handle
from kv_transfer.layout import KVLayout, KVLayoutMismatch, check_pairing
from kv_transfer.lease import LeaseError
from kv_transfer.tcp_backend import TcpKVClient, TcpKVServer
from kv_transfer.wire import KVTransferError, parse_endpoint, recv_msg, send_msg

log = logging.getLogger(__name__)

SCHEME = "cudaipc"


def _as_tcp(endpoint: str) -> str:
    """``cudaipc://HOST:PORT`` → ``tcp://HOST:PORT`` (the control plane); others unchanged."""
    prefix = f"{SCHEME}://"
    return "tcp://" + endpoint[len(prefix):] if endpoint.startswith(prefix) else endpoint


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``'s current stream (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class CudaIpcKVServer(TcpKVServer):
    """Ctx side: a TCP KV server whose cache (on CUDA) gen servers on this host map and copy from."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cache_id = f"{host_identity()}:{secrets.token_hex(8)}"
        self._handle: dict | None = None  # exported once, on the first IPC pull
        self._handle_lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"{SCHEME}://{self.host}:{self.port}"

    def _serve_connection(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout_s)
        try:
            msg = recv_msg(sock)
        except (OSError, KVTransferError):
            return
        if msg.get("op") != "pull_ipc":
            return self._serve_tcp(sock, msg)
        try:
            self._serve_ipc_pull(sock, msg)
        except (OSError, KVTransferError) as err:
            log.warning("CUDA IPC KV pull ended with an error: %s", err)

    def _serve_tcp(self, sock: socket.socket, first: dict) -> None:
        """The TCP protocol (pull staged through host memory, release) for a connection whose
        first message is already read."""
        try:
            if first.get("op") == "pull":
                self._serve_pull(sock, first)
            elif first.get("op") == "release":
                send_msg(sock, {"ok": True, "released": self.leases.release(str(first.get("ctx_request_id")))})
            else:
                send_msg(sock, {"ok": False, "error": f"unknown op {first.get('op')!r}"})
                return
        except (OSError, KVTransferError) as err:
            log.warning("KV connection ended with an error: %s", err)
            return
        super()._serve_connection(sock)

    def _export(self) -> dict:
        with self._handle_lock:
            if self._handle is None:
                self._handle = export_handle(self.kv_cache)
            return self._handle

    def _serve_ipc_pull(self, sock: socket.socket, msg: dict) -> None:
        rid = str(msg.get("ctx_request_id"))
        try:
            if msg.get("host") != host_identity() or not host_identity():
                raise ValueError("CUDA IPC needs the puller on this host (host identities differ)")
            check_pairing(KVLayout.model_validate(msg.get("layout")), self.layout, "gen", "ctx")
            handle = self._export() if msg.get("have") != self.cache_id else None
            lease = self.leases.begin_pull(rid)
        except (LeaseError, KVLayoutMismatch, CudaIpcError, ValueError, TypeError) as err:
            send_msg(sock, {"ok": False, "error": str(err)})
            return
        try:
            num_blocks = msg.get("num_blocks", 0)
            if not isinstance(num_blocks, int) or not 0 < num_blocks <= len(lease.block_ids):
                send_msg(sock, {"ok": False, "error": f"asked for {num_blocks} blocks; lease {rid} holds {len(lease.block_ids)}"})
                return
            t0 = time.perf_counter()
            send_msg(sock, {"ok": True, "cache_id": self.cache_id, "handle": handle,
                            "block_ids": list(lease.block_ids[:num_blocks])})
            if recv_msg(sock).get("op") != "done":  # pinned until the gen side copied (or the socket timeout)
                raise KVTransferError(f"lease {rid}: the puller did not confirm its copy")
            if msg.get("release") is True:
                self.leases.release(rid)  # still pinned: applied by end_pull below
            send_msg(sock, {"ok": True})
            self.on_sent(num_blocks * self.kv_cache[0].nbytes, time.perf_counter() - t0)
        finally:
            self.leases.end_pull(rid)


class CudaIpcKVClient(TcpKVClient):
    """Gen side: maps each ctx server's cache once and copies blocks GPU → GPU.

    opener: opens a handle description (:func:`kv_transfer.cuda_ipc.open_handle`; a parameter for tests).
    """

    def __init__(self, layout: KVLayout, opener=open_handle) -> None:
        super().__init__(layout)
        self._opener = opener
        self._mapped: dict[str, tuple[str, torch.Tensor]] = {}  # endpoint -> (cache id, peer cache)
        self._lock = threading.Lock()

    def stop(self) -> None:
        """Drop every mapping (CUDA unmaps a peer's memory when its last tensor is freed)."""
        with self._lock:
            self._mapped.clear()

    def pull(self, endpoint: str, ctx_request_id: str, remote_layout: KVLayout,
             kv_cache: torch.Tensor, dst_block_ids: list[int], timeout_s: float, release: bool = True) -> int:
        """As :meth:`TcpKVClient.pull`; over CUDA IPC when ``kv_cache`` is on CUDA, else over TCP.

        Raises:
            KVLayoutMismatch: the layouts differ.
            KVTransferError: the peer is gone or refused (its mapping is dropped), the handle could
                not be opened, or ``timeout_s`` passed before the ctx side confirmed the copy.
        """
        if not self._uses_ipc(kv_cache):
            return super().pull(_as_tcp(endpoint), ctx_request_id, remote_layout, kv_cache, dst_block_ids, timeout_s, release)
        check_pairing(self.layout, remote_layout)
        deadline = time.monotonic() + timeout_s
        try:
            with socket.create_connection(parse_endpoint(_as_tcp(endpoint)), timeout=timeout_s) as sock:
                sock.settimeout(timeout_s)
                return self._pull_ipc(sock, endpoint, ctx_request_id, kv_cache, dst_block_ids, deadline, release)
        except (OSError, KVTransferError, CudaIpcError) as err:
            self._forget(endpoint)
            if isinstance(err, socket.timeout):
                raise KVTransferError(f"CUDA IPC KV pull from {endpoint} timed out after {timeout_s:.1f} s") from None
            raise KVTransferError(f"CUDA IPC KV pull from {endpoint} failed (is the ctx server gone?): {err}") from None

    def _pull_ipc(self, sock, endpoint, rid, kv_cache, dst_block_ids, deadline, release) -> int:
        with self._lock:
            have = self._mapped.get(endpoint, (None, None))[0]
        send_msg(sock, {"op": "pull_ipc", "ctx_request_id": rid, "layout": self.layout.model_dump(),
                        "num_blocks": len(dst_block_ids), "release": release, "host": host_identity(), "have": have})
        answer = recv_msg(sock)
        if not answer.get("ok"):
            raise KVTransferError(f"ctx KV server {endpoint} refused the pull: {answer.get('error')}")
        peer = self._peer_cache(endpoint, answer)
        src = torch.tensor(answer["block_ids"], dtype=torch.long, device=kv_cache.device)
        dst = torch.tensor(dst_block_ids, dtype=torch.long, device=kv_cache.device)
        if len(src) != len(dst) or peer.shape[1:] != kv_cache.shape[1:]:
            raise KVTransferError(f"ctx KV server {endpoint} offers {len(src)} blocks of {tuple(peer.shape[1:])}; "
                                  f"{len(dst)} of {tuple(kv_cache.shape[1:])} expected")
        kv_cache.index_copy_(0, dst, peer.index_select(0, src))
        _synchronize(kv_cache.device)  # the copy is done before the ctx side unpins
        send_msg(sock, {"op": "done"})
        if not recv_msg(sock).get("ok") or time.monotonic() > deadline:
            raise KVTransferError(f"lease {rid} at {endpoint}: the copy was not confirmed before its deadline")
        return len(dst_block_ids) * kv_cache[0].nbytes

    def release(self, endpoint: str, ctx_request_id: str, timeout_s: float) -> None:
        """As :meth:`TcpKVClient.release` (the ctx side's TCP control plane)."""
        super().release(_as_tcp(endpoint), ctx_request_id, timeout_s)

    @staticmethod
    def _uses_ipc(kv_cache: torch.Tensor) -> bool:
        """Whether a pull into ``kv_cache`` maps the peer's cache (only a CUDA cache can)."""
        return kv_cache.is_cuda

    def _peer_cache(self, endpoint: str, answer: dict) -> torch.Tensor:
        """The peer's cache: mapped now when the answer carries a handle, else the cached mapping."""
        with self._lock:
            if answer.get("handle") is not None:
                self._mapped[endpoint] = (answer["cache_id"], self._opener(answer["handle"]))
            cached = self._mapped.get(endpoint)
        if cached is None or cached[0] != answer.get("cache_id"):
            raise KVTransferError(f"ctx KV server {endpoint} sent no CUDA IPC handle for cache {answer.get('cache_id')}")
        return cached[1]

    def _forget(self, endpoint: str) -> None:
        with self._lock:
            self._mapped.pop(endpoint, None)
