"""Choosing and building the KV transceivers: ``kv_transfer.backend`` → a server and a client.

``auto`` picks ucx where ``ucxx`` imports and tcp otherwise; both backends share one interface
(constructors, ``endpoint``, ``start``/``stop``, ``pull``) and raise the same errors. A KV cache on
CUDA is always served by the CUDA IPC backend (``cudaipc://``: same-host GPU → GPU copies, TCP staged
through host memory otherwise): UCX's same-host path reads host memory only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal, Union

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.tcp_backend import TcpKVClient, TcpKVServer

log = logging.getLogger(__name__)

Backend = Literal["ucx", "tcp"]
KVServer = Union[TcpKVServer, "UcxKVServer"]  # noqa: F821 (imported lazily)
KVClient = Union[TcpKVClient, "UcxKVClient"]  # noqa: F821


@functools.cache
def _ucx_import_error() -> str | None:
    """Why ``ucx_backend`` cannot be used here, or None when it can (imported once per process)."""
    try:
        import kv_transfer.ucx_client  # noqa: F401 (imports ucx_backend and ucxx)
    except Exception as err:  # an ImportError, or a shared library that does not load
        return f"{type(err).__name__}: {err}"
    return None


def preload_ucx() -> str | None:
    """Load ucxx now (before anything else loads another libucs, e.g. MPI); the error text, or None."""
    return _ucx_import_error()


def resolve_backend(setting: str) -> Backend:
    """``"auto"`` → ``"ucx"`` where ``import ucxx`` works, else ``"tcp"``; explicit settings pass through."""
    if setting in ("ucx", "tcp"):
        return setting  # type: ignore[return-value]
    if setting != "auto":
        raise ValueError(f"unknown KV transfer backend {setting!r}; expected auto, ucx or tcp")
    error = _ucx_import_error()
    if error is None:
        log.info("KV transfer backend auto → ucx (ucxx imports)")
        return "ucx"
    log.info("KV transfer backend auto → tcp (ucxx unusable: %s)", error)
    return "tcp"


def _ucx():
    error = _ucx_import_error()
    if error is not None:
        raise RuntimeError(f"KV transfer backend ucx needs ucxx (pip install ucxx-cu12): {error}")
    import kv_transfer.ucx_backend as ucx_backend
    return ucx_backend


def _ucx_client_cls():
    _ucx()
    from kv_transfer.ucx_client import UcxKVClient
    return UcxKVClient


def make_kv_server(backend: str, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable,
                   host: str, port: int, timeout_s: float,
                   on_sent: Callable[[int, float], None] | None = None, same_host_reads: bool = True) -> KVServer:
    """The ctx-side transceiver for ``backend`` (``auto`` is resolved here). Call ``start()`` on it.
    ``same_host_reads=False``: a ucx server never offers its memory to same-host readers."""
    if kv_cache.is_cuda:
        from kv_transfer.cuda_ipc_backend import CudaIpcKVServer

        log.info("KV cache on %s: KV transfer backend cudaipc (kv_transfer.backend %s applies to host caches)",
                 kv_cache.device, backend)
        return CudaIpcKVServer(kv_cache, layout, leases, host, port, timeout_s, on_sent=on_sent)
    if resolve_backend(backend) == "ucx":
        return _ucx().UcxKVServer(kv_cache, layout, leases, host, port, timeout_s, on_sent=on_sent,
                                  same_host_reads=same_host_reads)
    return TcpKVServer(kv_cache, layout, leases, host, port, timeout_s, on_sent=on_sent)


def make_kv_client(backend: str, layout: KVLayout, same_host_reads: bool = True) -> KVClient:
    """The gen-side transceiver for ``backend``; it talks only to servers of the same backend.
    ``same_host_reads=False`` makes a ucx client take every byte as UCX messages (benchmarks).
    ``cudaipc`` (a CUDA ctx cache's endpoint scheme): :class:`CudaIpcKVClient`."""
    if backend == "cudaipc":
        from kv_transfer.cuda_ipc_backend import CudaIpcKVClient

        return CudaIpcKVClient(layout)
    if resolve_backend(backend) == "ucx":
        return _ucx_client_cls()(layout, same_host_reads=same_host_reads)
    return TcpKVClient(layout)
