"""Turn a scheduled batch into model inputs, run the model and sample."""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.model import LlamaModel
from engine.sampler import Sampler
from engine.sequence import Sequence


def _ordered(items: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """Single-token items (decodes) first: attention batches them; chunks follow."""
    return [it for it in items if it[1] == 1] + [it for it in items if it[1] != 1]


class ModelRunner:
    """Executes one step for the scheduled (sequence, num_new_tokens) items."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int,
                 sampler: Sampler):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler

    def execute(self, items: list[tuple[Sequence, int]]) -> dict[str, int]:
        """Compute KV for the new tokens; return request_id -> sampled token for every sequence
        whose tokens are now all computed (decodes and final prefill chunks)."""
        items = _ordered(items)
        input_ids, positions, samplers = [], [], []
        for seq, k in items:
            c = seq.num_computed
            input_ids += seq.token_ids[c:c + k]
            positions += range(c, c + k)
            if c + k == seq.num_tokens:
                samplers.append((seq, len(input_ids) - 1))
        if not samplers:
            rows = torch.empty(0, dtype=torch.long)
        else:
            rows = torch.tensor([r for _, r in samplers])
        pos = torch.tensor(positions, dtype=torch.long)
        meta = self._metadata(items, pos)
        logits = self.model.forward(torch.tensor(input_ids), pos, rows, self.kv_cache, meta)
        if not samplers:
            return {}
        seqs = [s for s, _ in samplers]
        tokens = self.sampler.sample(logits, [s.sampling for s in seqs],
                                     [s.num_output_tokens for s in seqs])
        return {s.request_id: t for s, t in zip(seqs, tokens)}

    def _metadata(self, items: list[tuple[Sequence, int]], pos: torch.Tensor
                  ) -> AttentionMetadata:
        bs = self.block_size
        tables = [torch.tensor(seq.block_ids, dtype=torch.long) for seq, _ in items]
        slot_blocks = torch.cat([t[pos_slice // bs] for t, pos_slice in
                                 zip(tables, _split(pos, [k for _, k in items]))])
        decodes = [(seq, t) for (seq, k), t in zip(items, tables) if k == 1]
        meta = AttentionMetadata(slot_blocks=slot_blocks, slot_offsets=pos % bs,
                                 num_decodes=len(decodes), decode_tables=None, decode_max_ctx=0,
                                 decode_mask=None, prefills=[])
        if decodes:
            self._decode_metadata(meta, decodes)
        start = len(decodes)
        for (seq, k), table in zip(items[len(decodes):], tables[len(decodes):]):
            meta.prefills.append(self._chunk(seq, k, table, start))
            start += k
        return meta

    def _decode_metadata(self, meta: AttentionMetadata,
                         decodes: list[tuple[Sequence, torch.Tensor]]) -> None:
        ctx = [seq.num_computed + 1 for seq, _ in decodes]
        max_ctx = max(ctx)
        nb = -(-max_ctx // self.block_size)
        tables = torch.zeros(len(decodes), nb, dtype=torch.long)
        for i, (_, t) in enumerate(decodes):
            n = min(nb, len(t))
            tables[i, :n] = t[:n]
        meta.decode_tables = tables
        meta.decode_max_ctx = max_ctx
        if len(decodes) > 1:
            key = torch.arange(max_ctx)
            meta.decode_mask = (key[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :]

    def _chunk(self, seq: Sequence, k: int, table: torch.Tensor, start: int) -> PrefillChunk:
        c = seq.num_computed
        ctx = c + k
        mask = None
        if c > 0:
            q_pos = torch.arange(c, ctx)
            mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
        return PrefillChunk(start=start, length=k, ctx_len=ctx,
                            block_ids=table[:-(-ctx // self.block_size)], mask=mask)


def _split(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(x, sizes))
