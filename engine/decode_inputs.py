"""A pure-decode step's input tensors from one host list (the step's Python-side fast path).

A decode step at batch 1 needs a dozen tiny index tensors (token ids, positions, logit rows, KV
slots, block tables and key ranges per window). Built one by one (``torch.arange`` / ``cat`` /
``%`` / ``torch.tensor`` each), right after a forward that evicted the interpreter's and torch's
dispatch code from the caches, they cost ~0.25 ms a step on the 2-core EPYC. Here every index is
computed in Python, written into one flat list, turned into one int64 tensor by one call, and
handed out as views of it. The values, shapes and dtypes are exactly those of the general path
(``ModelRunner.inputs`` with ``engine.attention_meta.build_metadata``); tests/engine/test_decode_inputs.py
compares them field by field.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata, kv_rows
from engine.attention_meta import StepItem, first_block


def is_pure_decode(items: Sequence[StepItem]) -> bool:
    """True when every item computes one token (decode rows only: no prefill chunk)."""
    return all(it.num_new == 1 for it in items)


def _decode_window(items: Sequence[StepItem], bs: int, window: int | None
                   ) -> tuple[list[int], list[int], list[int], int, int]:
    """One window's (flat block tables [D * nb], lows [D], key counts [D], nb, max keys): row r
    reads its blocks from first_block on and sees keys [lo, hi) of them, as
    engine.attention_meta._decode_metadata."""
    starts, lows, n_keys = [], [], []
    for it in items:
        q = it.num_computed
        f = first_block(q, window, bs)
        starts.append(f)
        n_keys.append(q + 1 - f * bs)
        lows.append(0 if window is None else max(0, q - window + 1 - f * bs))
    max_keys = max(n_keys)
    nb = -(-max_keys // bs)
    table: list[int] = []
    for f, it in zip(starts, items):
        row = it.block_ids[f:f + nb]
        table += row
        if len(row) < nb:
            table += [0] * (nb - len(row))
    return table, lows, n_keys, nb, max_keys


def decode_inputs(items: Sequence[StepItem], input_ids: list[int], logit_rows: list[int], block_size: int,
                  windows: Sequence[int | None], num_layers: int | None, with_mask: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int | None, AttentionMetadata], int]:
    """Host tensors of a pure-decode step (is_pure_decode(items), at least one item).

    items: D decode rows (position num_computed each); input_ids: their D tokens; logit_rows: the
    rows projected to the vocabulary (sample rows, then prompt rows); windows: the distinct
    attention windows of the model (None = full attention); num_layers: the cache's layer count
    for the gather path's decode_rows (None: not built, as the CPU kernels read the block table);
    with_mask: build decode_mask where rows see different key ranges (the gather path's SDPA needs
    it; the kernels read decode_key_ranges).
    Returns (ids [D], positions [D], logit rows [S], metadata per window, largest position), all
    int64 views of one tensor, equal to ModelRunner's general path. Raises ValueError without items.
    """
    if not items:
        raise ValueError("decode_inputs needs at least one decode row")
    bs, d, s = block_size, len(items), len(logit_rows)
    pos = [it.num_computed for it in items]
    flat = list(input_ids) + pos + list(logit_rows)
    flat += [it.block_ids[p // bs] for it, p in zip(items, pos)]
    flat += [p % bs for p in pos]
    per_window = []
    for w in windows:
        table, lows, n_keys, nb, max_keys = _decode_window(items, bs, w)
        per_window.append((w, nb, max_keys, lows, n_keys))
        for lo, n in zip(lows, n_keys):
            flat += (lo, n)
        flat += table
    sizes = [d, d, s, d, d]
    for _, nb, _, _, _ in per_window:
        sizes += (2 * d, d * nb)
    ids, positions, rows, slot_blocks, slot_offsets, *per_meta = torch.tensor(flat, dtype=torch.long).split(sizes)
    metas = {}
    for i, (w, nb, max_keys, lows, n_keys) in enumerate(per_window):
        ranges, tables = per_meta[2 * i].view(d, 2), per_meta[2 * i + 1].view(d, nb)
        meta = AttentionMetadata(slot_blocks=slot_blocks, slot_offsets=slot_offsets, num_decodes=d,
                                 decode_tables=tables, decode_max_ctx=max_keys, decode_mask=None,
                                 prefills=[], decode_key_ranges=ranges)
        if with_mask and (any(lo > 0 for lo in lows) or any(n != max_keys for n in n_keys)):
            keys = torch.arange(max_keys)[None, :]
            meta.decode_mask = ((keys >= ranges[:, :1]) & (keys < ranges[:, 1:]))[:, None, None, :]
        if num_layers is not None:
            meta.decode_rows = kv_rows(tables, num_layers)
        metas[w] = meta
    return ids, positions, rows, metas, max(pos)
