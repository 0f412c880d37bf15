"""Attention metadata of one step: which cache slots each new token writes, which blocks each
query reads and which keys it masks, for full attention or one sliding window.

A query at position i sees the keys j with j <= i and, under a window of W tokens, j > i - W
(HF transformers' `sliding_window_overlay`; Mistral's definition). Under a window only the
blocks from the one holding key i - W + 1 on are gathered, so a decode step costs O(W), not
O(context); keys of that first block before i - W + 1 are masked.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.attention import AttentionMetadata, PrefillChunk, kv_rows


class StepItem(Protocol):
    """One sequence's share of a step: tokens [num_computed, num_computed + num_new)."""

    num_computed: int
    num_new: int
    block_ids: list[int]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Query positions [L, 1] and key positions [S] or [L, S] -> [L, S] bool (True = attend):
    causal, and inside the window if any."""
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def first_block(first_query: int, window: int | None, block_size: int) -> int:
    """Index in the block table of the first block a query at position first_query (or later)
    can read: 0 for full attention."""
    return 0 if window is None else max(0, first_query - window + 1) // block_size


def build_metadata(items: Sequence[StepItem], pos: torch.Tensor, block_size: int,
                   window: int | None, num_layers: int | None = None) -> AttentionMetadata:
    """items: decodes (num_new == 1) first, then prefill chunks; pos: [T] their positions.
    window: None (full attention) or the sliding window in tokens. num_layers: the cache's
    layer count, for the decode rows' one-gather row ids (engine.attention.kv_rows); None: the
    decode gathers K and V separately.

    Index lists are built in Python and become one tensor each (a per-item tensor op costs more
    than the arithmetic at decode batch sizes)."""
    bs = block_size
    slot_blocks: list[int] = []
    for it in items:
        ids = it.block_ids
        slot_blocks += [ids[p // bs] for p in range(it.num_computed, it.num_computed + it.num_new)]
    n_dec = sum(1 for it in items if it.num_new == 1)
    meta = AttentionMetadata(slot_blocks=torch.tensor(slot_blocks, dtype=torch.long), slot_offsets=pos % bs,
                             num_decodes=n_dec, decode_tables=None, decode_max_ctx=0, decode_mask=None,
                             prefills=[])
    if n_dec:
        _decode_metadata(meta, items[:n_dec], bs, window)
        if num_layers is not None:
            meta.decode_rows = kv_rows(meta.decode_tables, num_layers)
    start = n_dec
    for it in items[n_dec:]:
        meta.prefills.append(_chunk(it, torch.tensor(it.block_ids, dtype=torch.long), start, bs, window))
        start += it.num_new
    return meta


def _decode_metadata(meta: AttentionMetadata, items: Sequence[StepItem], bs: int,
                     window: int | None) -> None:
    """Row r gathers its blocks from first_block on and sees keys [lo, hi) of them
    (decode_key_ranges): hi - 1 is its own position, lo the first key inside its window. The
    mask (the same rule as `visible`) is built only when some row sees fewer keys than the
    widest one."""
    q_pos = [it.num_computed for it in items]
    starts = [first_block(q, window, bs) for q in q_pos]
    n_keys = [q + 1 - f * bs for q, f in zip(q_pos, starts)]
    lows = [0 if window is None else max(0, q - window + 1 - f * bs) for q, f in zip(q_pos, starts)]
    max_keys = max(n_keys)
    nb = -(-max_keys // bs)
    rows = []
    for f, it in zip(starts, items):
        row = list(it.block_ids[f:f + nb])
        rows.append(row + [0] * (nb - len(row)))
    meta.decode_tables, meta.decode_max_ctx = torch.tensor(rows, dtype=torch.long), max_keys
    meta.decode_key_ranges = torch.tensor(list(zip(lows, n_keys)), dtype=torch.long)
    if any(lo > 0 for lo in lows) or any(n != max_keys for n in n_keys):
        keys = torch.arange(max_keys)[None, :]
        mask = (keys >= meta.decode_key_ranges[:, :1]) & (keys < meta.decode_key_ranges[:, 1:])
        meta.decode_mask = mask[:, None, None, :]


def _chunk(it: StepItem, table: torch.Tensor, start: int, bs: int,
           window: int | None) -> PrefillChunk:
    c, k = it.num_computed, it.num_new
    end = c + k
    q_pos = torch.arange(c, end)[:, None]
    if c == 0:   # the whole context is this chunk: attend to its own k/v
        needs_mask = window is not None and k > window
        mask = visible(q_pos, q_pos[:, 0], window) if needs_mask else None
        return PrefillChunk(start=start, length=k, ctx_len=k, block_ids=table[:0], mask=mask,
                            direct=True)
    f = first_block(c, window, bs)
    k_pos = torch.arange(f * bs, end)
    return PrefillChunk(start=start, length=k, ctx_len=end - f * bs,
                        block_ids=table[f:-(-end // bs)], mask=visible(q_pos, k_pos, window))
