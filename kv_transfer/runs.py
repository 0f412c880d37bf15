"""Coalescing block ids into contiguous runs, so that one message moves many blocks.

Both sides of a pull compute the same plan from the same two id lists: the ctx side sends one
message per segment straight out of its cache, the gen side posts one receive per segment straight
into its cache. A segment ends wherever the source *or* the destination ids stop being
consecutive, so every segment is one contiguous slice on both sides (no staging copy).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Segment(NamedTuple):
    """``count`` blocks from ``src_start`` (ctx cache) to ``dst_start`` (gen cache)."""

    src_start: int
    dst_start: int
    count: int


def to_runs(block_ids: list[int]) -> list[list[int]]:
    """``[5, 6, 7, 2]`` → ``[[5, 3], [2, 1]]`` (start, length): the compact wire form of an id list."""
    runs: list[list[int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return runs


def from_runs(runs: list[list[int]]) -> list[int]:
    """Inverse of :func:`to_runs`. Raises ``ValueError`` for a malformed run."""
    ids: list[int] = []
    for run in runs:
        start, length = (int(x) for x in run)
        if start < 0 or length < 1:
            raise ValueError(f"bad block run {run!r}")
        ids.extend(range(start, start + length))
    return ids


def plan_segments(src_ids: list[int], dst_ids: list[int]) -> list[Segment]:
    """Cut the pairing ``src_ids[i] → dst_ids[i]`` into maximal runs contiguous on both sides."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    segments: list[Segment] = []
    for s, d in zip(src_ids, dst_ids):
        last = segments[-1] if segments else None
        if last and last.src_start + last.count == s and last.dst_start + last.count == d:
            segments[-1] = last._replace(count=last.count + 1)
        else:
            segments.append(Segment(s, d, 1))
    return segments


def landing(blocks: torch.Tensor) -> torch.Tensor:
    """Where received bytes for ``blocks`` (a slice of a cache) can land: the slice itself when it is
    contiguous host memory (no copy), else a contiguous host staging tensor (a non-contiguous or a
    CUDA slice); in that case ``blocks.copy_(it)`` after."""
    if blocks.is_contiguous() and not blocks.is_cuda:
        return blocks
    return torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=blocks.is_cuda)
