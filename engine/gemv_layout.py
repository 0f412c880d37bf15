"""The weight layout of pdserve's batch-1 GEMV kernel (``torch.ops.pdserve_cpu.gemv`` and
``decode_layers``, engine/csrc/cpu_ops.cpp): 4-row panels, held in one arena on huge pages.

A weight ``[N, K]`` (float32 or bfloat16) keeps its shape and dtype but not its element order:
with ``N4 = N - N % 4`` and ``K16 = K - K % 16``, rows ``[0, N4)`` become ``N4 / 4`` panels of
``4 K`` elements, each panel its ``K16 / 16`` column chunks (the 16 elements of row 0 of the
chunk, then of rows 1, 2, 3) followed by the ``K - K16`` last columns of row 0, 1, 2, 3; rows
``[N4, N)`` follow row-major. The kernel's 4-row block reads one ascending stream of addresses,
not four rows ``4 K`` bytes apart, and it accumulates in the same order as on row-major rows,
so the products keep their bits. Measured on a 2-core AVX2 EPYC VM (SmolLM2's 121 float32 products
of one step, 2 threads, ``bench/gemv_vs_step.py`` alternating builds of the commit before and after this
layout with its arena): 32.5-37.2 ms on row-major rows, 25.7-30.0 ms on panels, against a reduction
over 1 GiB at 20.9-23.3 GB/s (25.7 ms for these bytes at 20.9; docs/benchmarks.md, issue 11).

Such a tensor is only for the GEMV kernel: indexing it as a matrix reads shuffled elements
(:func:`from_gemv_panels` undoes the order, for tests and checks).
"""
from __future__ import annotations

import logging

import torch

from engine.huge_pages import allocate_huge_page_tensor

log = logging.getLogger(__name__)

ALIGN_BYTES = 4096  # each weight of the arena starts on a page (and so a cache line) boundary


def _views(w: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three regions of ``out`` (a contiguous [N, K]) in the panel layout: the panels' column
    chunks [P, K16/16, 4, 16], the panels' last columns [P, 4, K - K16] and the tail rows [N - N4, K]."""
    n, k = w.shape
    n4, k16 = n - n % 4, k - k % 16
    flat = out.view(-1)
    panels = flat[: n4 * k].view(n4 // 4, 4 * k)
    chunks = panels[:, : 4 * k16].unflatten(1, (k16 // 16, 4, 16))
    last_cols = panels[:, 4 * k16:].unflatten(1, (4, k - k16))
    return chunks, last_cols, flat[n4 * k:].view(n - n4, k)


def to_gemv_panels(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` [N, K] (CPU, any float dtype) in the panel layout (module docstring), written into
    ``out`` (a contiguous tensor of w's shape and dtype; a new one when None) and returned.

    Raises:
        ValueError: ``w`` is not 2-D, or ``out`` does not match it.
    """
    if w.dim() != 2:
        raise ValueError(f"a GEMV weight is [N, K], got shape {tuple(w.shape)}")
    if out is None:
        out = torch.empty(w.shape, dtype=w.dtype)
    elif out.shape != w.shape or out.dtype != w.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(w.shape)} {w.dtype} tensor")
    n, k = w.shape
    n4, k16 = n - n % 4, k - k % 16
    chunks, last_cols, tail = _views(w, out)
    chunks.copy_(w[:n4, :k16].reshape(n4 // 4, 4, k16 // 16, 16).transpose(1, 2))
    last_cols.copy_(w[:n4, k16:].reshape(n4 // 4, 4, k - k16))
    tail.copy_(w[n4:])
    return out


def from_gemv_panels(panels: torch.Tensor) -> torch.Tensor:
    """The row-major [N, K] weight that :func:`to_gemv_panels` turned into ``panels`` (a copy)."""
    n, k = panels.shape
    n4, k16 = n - n % 4, k - k % 16
    chunks, last_cols, tail = _views(panels, panels.contiguous())
    w = torch.empty(panels.shape, dtype=panels.dtype)
    w[:n4, :k16] = chunks.transpose(1, 2).reshape(n4, k16)
    w[:n4, k16:] = last_cols.reshape(n4, k - k16)
    w[n4:] = tail
    return w


def gemv_panel_arena(weights: list[torch.Tensor], huge_pages: bool = True) -> list[torch.Tensor]:
    """Every weight of ``weights`` (2-D, one dtype) in the panel layout, all in one arena: one
    mapping on transparent huge pages (engine.huge_pages; ``huge_pages=False``: plain memory),
    each weight starting on a 4 KiB boundary. The arena lives as long as any returned tensor.

    Raises:
        ValueError: a weight is not 2-D or the dtypes differ.
        OSError: the arena could not be mapped.
    """
    if not weights:
        return []
    dtype = weights[0].dtype
    if any(w.dtype != dtype or w.dim() != 2 for w in weights):
        raise ValueError("GEMV weights must all be 2-D and of one dtype")
    size = dtype.itemsize
    offsets, total = [], 0
    for w in weights:
        offsets.append(total)
        total += -(-w.numel() * size // ALIGN_BYTES) * ALIGN_BYTES
    if huge_pages:
        arena = allocate_huge_page_tensor((total,), torch.uint8, purpose="GEMV weights")
    else:
        arena = torch.empty(total, dtype=torch.uint8)
    out = []
    for w, off in zip(weights, offsets):
        view = arena[off: off + w.numel() * size].view(dtype).view(w.shape)
        out.append(to_gemv_panels(w, view))
    log.debug("GEMV weights: %d tensors, %.1f MB in one arena (huge pages %s)", len(out), total / 1e6, huge_pages)
    return out
