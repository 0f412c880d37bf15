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

import math

import torch

from engine.huge_pages import allocate_huge_page_tensor


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
    return allocate_huge_page_tensor(shape, dtype, purpose="KV cache")
