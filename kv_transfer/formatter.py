"""TP-mismatch formatter: re-slice KV heads when ctx ``tp_size`` ≠ gen ``tp_size``.

Rank ``k`` of a TP group of size ``T`` holds the KV heads ``[floor(k*H/T), floor((k+1)*H/T))`` of
the model's ``H`` KV heads (uneven splits allowed), in every layer, for K and V alike. Blocks are block-major,
``[n, num_layers, 2, block_size, heads, head_dim]``, so heads are dimension 4.

**Pull plan.** Gen rank ``g`` of ``Tg`` needs global heads ``[g*H/Tg, (g+1)*H/Tg)``. Each ctx rank
``c`` of ``Tc`` whose range ``[c*H/Tc, (c+1)*H/Tc)`` overlaps it contributes the overlap;
:func:`pull_plan` lists them in head order as :class:`HeadSlice` (ctx rank, heads in the ctx
rank's local numbering, heads in the gen rank's local numbering):

- ``Tc == Tg``: one slice, ctx rank ``g``, all heads: a plain pull, no formatting.
- ``Tc > Tg`` (e.g. ctx TP=2 → gen TP=1): ``Tc/Tg`` ctx ranks, each whole; the gen rank
  concatenates their heads (:func:`assemble`).
- ``Tc < Tg`` (e.g. ctx TP=1 → gen TP=2): one ctx rank ``g*Tc//Tg``, a slice of its heads
  (:func:`split_heads` on the ctx side before sending, or slice after landing).

So the gen rank pulls the same block ids from every ctx rank in its plan (all ranks of one server
share the block table) and writes each piece into its own head range.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

HEADS_AXIS = 4  # [n, layers, 2, block_size, heads, head_dim]


class HeadSlice(NamedTuple):
    """Heads ``[src_start, src_stop)`` of ctx rank ``ctx_rank`` go to ``[dst_start, dst_stop)`` of the gen rank."""

    ctx_rank: int
    src_start: int
    src_stop: int
    dst_start: int
    dst_stop: int


def head_range(num_heads: int, rank: int, tp_size: int) -> tuple[int, int]:
    """Global KV heads ``[start, stop)`` held by ``rank`` of ``tp_size``: the engine's own partition
    (:func:`engine.tp.kv_head_range`, contiguous and as even as possible, so 3 heads over TP=2 are
    2 + 1). Raises ``ValueError`` for a bad rank or more ranks than heads."""
    from engine.tp import kv_head_range

    return kv_head_range(num_heads, rank, tp_size)


def pull_plan(num_heads: int, ctx_tp: int, gen_tp: int, gen_rank: int) -> list[HeadSlice]:
    """Which ctx ranks (and which of their heads) gen rank ``gen_rank`` of ``gen_tp`` needs."""
    lo, hi = head_range(num_heads, gen_rank, gen_tp)
    plan = []
    for c in range(ctx_tp):
        c_lo, c_hi = head_range(num_heads, c, ctx_tp)
        a, b = max(lo, c_lo), min(hi, c_hi)
        if a < b:
            plan.append(HeadSlice(c, a - c_lo, b - c_lo, a - lo, b - lo))
    return plan


def split_heads(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Heads ``[start, stop)`` of ``blocks`` as a contiguous tensor (what one gen rank needs from one ctx rank)."""
    return blocks[..., start:stop, :].contiguous()


def assemble(pieces: dict[int, torch.Tensor], plan: list[HeadSlice], out: torch.Tensor | None = None) -> torch.Tensor:
    """Build the gen rank's blocks from the blocks pulled from each ctx rank of ``plan``.

    Args:
        pieces: ctx rank → its blocks ``[n, L, 2, bs, H/Tc, D]`` (all of that rank's heads).
        out: where to write ``[n, L, 2, bs, H/Tg, D]`` (e.g. the gen cache's blocks); allocated if None.
    """
    first = pieces[plan[0].ctx_rank]
    if out is None:
        shape = list(first.shape)
        shape[HEADS_AXIS] = plan[-1].dst_stop
        out = torch.empty(shape, dtype=first.dtype)
    for s in plan:
        out[..., s.dst_start:s.dst_stop, :] = pieces[s.ctx_rank][..., s.src_start:s.src_stop, :]
    return out


def reformat(ctx_blocks: list[torch.Tensor], gen_tp: int) -> list[torch.Tensor]:
    """All ctx ranks' blocks → every gen rank's blocks (the whole exchange in one place; for tests and tools)."""
    ctx_tp = len(ctx_blocks)
    num_heads = ctx_blocks[0].shape[HEADS_AXIS] * ctx_tp
    pieces = dict(enumerate(ctx_blocks))
    return [assemble(pieces, pull_plan(num_heads, ctx_tp, gen_tp, g)) for g in range(gen_tp)]
