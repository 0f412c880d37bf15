"""CUDA IPC memory handles for a KV cache: export one on the ctx side, open it once on the gen side.

The GPU twin of :mod:`kv_transfer.cma`: a process maps another process's device memory through a
``cudaIpcMemHandle_t`` (CUDA runtime API, "Interprocess Communication"), and copies from it with
the GPU's own copy engines. torch exposes the handle of a storage's allocation as
``UntypedStorage._share_cuda_()`` (the tuple ``torch.multiprocessing.reductions.reduce_storage``
sends: device, handle, size, offset inside the cudaMalloc block, ref-counter file and offset,
event handle, whether an event must be waited on) and opens one with
``UntypedStorage._new_shared_cuda(*that tuple)``. Here that tuple travels as JSON (bytes as
base64), never pickled.

Only processes on the same host (and with access to the same GPU) can open a handle; a handle from
a process that has exited cannot be opened (``cudaIpcOpenMemHandle`` fails), and memory mapped
before the exporter died stays mapped but is no longer guarded by its leases: the backend only
trusts bytes copied while the exporter holds the pin (see :mod:`kv_transfer.cuda_ipc_backend`).
"""

from __future__ import annotations

import base64

import torch

__all__ = ["CudaIpcError", "export_handle", "open_handle"]

_BYTES_FIELDS = (1, 4, 6)  # positions of bytes in the _share_cuda_ tuple: handle, ref-counter, event


class CudaIpcError(RuntimeError):
    """A CUDA IPC handle could not be exported or opened (wrong device, exporter gone, no CUDA)."""


def export_handle(cache: torch.Tensor) -> dict:
    """A JSON-able description of CUDA tensor ``cache`` that another process can open.

    Returns ``{"share": [...], "shape": [...], "stride": [...], "storage_offset": int, "dtype": str}``.
    Raises:
        CudaIpcError: ``cache`` is not on a CUDA device.
    """
    if not cache.is_cuda:
        raise CudaIpcError(f"CUDA IPC needs a CUDA tensor; the KV cache is on {cache.device}")
    share = list(cache.untyped_storage()._share_cuda_())
    for i in _BYTES_FIELDS:
        share[i] = base64.b64encode(share[i]).decode() if share[i] is not None else None
    return {"share": share, "shape": list(cache.shape), "stride": list(cache.stride()),
            "storage_offset": cache.storage_offset(), "dtype": str(cache.dtype).removeprefix("torch.")}


def open_handle(desc: dict, new_shared_cuda=None) -> torch.Tensor:
    """The tensor :func:`export_handle` described, mapped into this process (opened once: cache it).

    new_shared_cuda: the opener (``torch.UntypedStorage._new_shared_cuda``; a parameter for tests).
    Raises:
        CudaIpcError: the description is malformed, or CUDA refused to open the handle (the exporter
            has exited, another GPU, no CUDA here); the message says which.
    """
    opener = new_shared_cuda or torch.UntypedStorage._new_shared_cuda
    try:
        share = list(desc["share"])
        for i in _BYTES_FIELDS:
            share[i] = base64.b64decode(share[i]) if share[i] is not None else None
        dtype = getattr(torch, str(desc["dtype"]))
        shape, stride, offset = list(desc["shape"]), list(desc["stride"]), int(desc["storage_offset"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise CudaIpcError(f"malformed CUDA IPC handle description: {err}") from None
    try:
        storage = opener(*share)
    except RuntimeError as err:  # torch raises RuntimeError for every CUDA error
        raise CudaIpcError(f"cannot open the peer's CUDA IPC handle (has it exited?): {err}") from None
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
