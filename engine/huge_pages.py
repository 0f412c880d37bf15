"""Tensors on transparent huge pages (2 MiB): the KV cache (engine.kv_memory) and the GEMV weights
(engine.gemv_layout).

The kernel backs an anonymous range with huge pages when ``/sys/kernel/mm/transparent_hugepage/enabled``
is ``always``, or ``madvise`` and the range was advised ``MADV_HUGEPAGE`` (madvise(2)); only 2
MiB-aligned 2 MiB extents qualify, so the mapping is over-allocated by one huge page and the tensor
starts at an aligned address. Where the kernel says ``never`` the advice is a no-op, and where it
has no THP at all madvise fails with ``EINVAL``; either way the memory stays on 4 KiB pages (logged).
Every page is committed at allocation (``MADV_POPULATE_WRITE``, Linux >= 5.14, else by writing
zeros), as ``torch.zeros`` does: memory the host cannot hold fails at start, not later.
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


def allocate_huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype, purpose: str = "memory") -> torch.Tensor:
    """A zero-filled tensor of ``shape`` on an anonymous mapping advised ``MADV_HUGEPAGE``.

    The tensor keeps the mapping alive; the memory is unmapped when the last view of it dies.
    ``purpose`` names the memory in the warning logged when the advice fails (e.g. ``KV cache``).

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
            log.warning("%s stays on 4 KiB pages: madvise(MADV_HUGEPAGE) failed (%s)", purpose, err)
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
