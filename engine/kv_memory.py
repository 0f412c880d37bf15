"""Memory for the KV cache: anonymous mappings on transparent huge pages, or a shared file.

Why huge pages: a KV pull between two processes on one host is a ``process_vm_readv`` (UCX
``cma``), and the kernel pins every source and destination page of it; with 4 KiB pages that
page walk, not the copy, bounds the pull (measured here: 4.4 GB/s for 256 MiB with 4 KiB pages,
8–11 GB/s with 2 MiB pages; memcpy 8.4 / 13.3 GB/s). The kernel backs an anonymous range with
huge pages when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``, or ``madvise`` and
the range was advised ``MADV_HUGEPAGE`` (madvise(2)); only 2 MiB-aligned 2 MiB extents qualify, so
the mapping is over-allocated by one huge page and the tensor starts at an aligned address.
Where the kernel says ``never`` the advice is a no-op, and where it has no THP at all madvise
fails with ``EINVAL``; either way the cache runs on 4 KiB pages.

The whole cache is committed at allocation (``MADV_POPULATE_WRITE``, Linux >= 5.14, else by
writing zeros), as ``torch.zeros`` does: a ``num_kv_blocks`` too large for the host fails at start
rather than under load, and the huge pages exist before the first pull.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); not in Python's mmap module
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages_mode() -> str:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``); ``unavailable`` without the sysfs file."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return "unavailable"
    selected = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return selected[0] if selected else "unavailable"


def allocate_huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor of ``shape`` on an anonymous mapping advised ``MADV_HUGEPAGE``.

    The tensor keeps the mapping alive; the memory is unmapped when the last view of it dies.

    Raises:
        OSError: the mapping could not be made (out of address space or memory limits).
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to ``region``
    offset = -base.data_ptr() % HUGE_PAGE_BYTES
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)  # no-op where the kernel's THP mode is ``never``
        except OSError as err:
            log.warning("KV cache stays on 4 KiB pages: madvise(MADV_HUGEPAGE) failed (%s)", err)
    tensor = base[offset:offset + nbytes]
    _commit(region, tensor)
    return tensor.view(dtype).view(shape)


def _commit(region: mmap.mmap, tensor: torch.Tensor) -> None:
    """Back every page now (see the module docstring)."""
    try:
        region.madvise(_MADV_POPULATE_WRITE)
        return
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise  # ENOMEM and friends: the host cannot hold this cache
    tensor.zero_()


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, path: str | None = None,
                      huge_pages: bool = True, device: str = "cpu") -> torch.Tensor:
    """A zeroed KV cache of ``shape`` (``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``).

    Args:
        path: back the cache by this file through a shared mapping, so that another process on the
            host can map it too (tensor-parallel followers' caches, mapped by rank 0). Such shmem
            gets huge pages only where ``transparent_hugepage/shmem_enabled`` allows; it is not advised.
        huge_pages: put an anonymous cache on transparent huge pages (see the module docstring).
        device: ``cpu`` or ``cuda:N``; a CUDA cache is plain device memory (``path`` and
            ``huge_pages`` are host-memory options and are ignored there).
    """
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    if path is not None:
        cache = torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
        cache.zero_()
        return cache
    if not huge_pages:
        return torch.zeros(shape, dtype=dtype)
    return allocate_huge_page_tensor(shape, dtype)
