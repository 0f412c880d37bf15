"""Attention over the paged, block-major KV cache.

kv_cache layout: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim].
The batch is laid out with all decode tokens first (one per sequence), then prefill chunks.
Sliding windows need no code here: the metadata (engine.attention_meta) lists only the blocks a
window reaches and masks the keys outside it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's chunk of query tokens [start, start+length) of the step's batch.

    direct: the chunk is the whole context (keys = this chunk's own k/v, no gather);
    otherwise it attends to ctx_len keys gathered from block_ids (the first key is the first
    token of block_ids[0]). mask: [length, ctx_len] bool (True = attend), None = plain causal
    (only with direct).
    """

    start: int
    length: int
    ctx_len: int
    block_ids: torch.Tensor      # [ceil(ctx_len / block_size)] int64
    mask: torch.Tensor | None
    direct: bool = False


@dataclass
class AttentionMetadata:
    """Per-step indices shared by all layers of one attention kind (full, or one window)."""

    slot_blocks: torch.Tensor          # [T] block id of each new token
    slot_offsets: torch.Tensor         # [T] offset inside that block
    num_decodes: int                   # D: tokens 0..D-1 are single-token decodes
    decode_tables: torch.Tensor | None  # [D, max_blocks] int64 (padded with block 0)
    decode_max_ctx: int                # most keys gathered for one decode row, in tokens
    decode_mask: torch.Tensor | None   # [D, 1, 1, decode_max_ctx] bool; None: all keys seen
    prefills: list[PrefillChunk]
    decode_rows: torch.Tensor | None = None  # [num_layers, 2 * D * max_blocks] int64 (kv_rows)
    decode_key_ranges: torch.Tensor | None = None  # [D, 2] int64: row r sees keys [lo, hi) of its table row


def kv_rows(tables: torch.Tensor, num_layers: int) -> torch.Tensor:
    """Block ids [D, nb] -> [num_layers, 2 * D * nb] int64: row l lists, in the flat cache view
    (flat_cache), layer l's K rows of every block in tables' order, then its V rows.

    Built once a step (engine.attention_meta), so a layer gathers K and V with one index_select
    and no index arithmetic of its own."""
    base = tables.flatten() * (2 * num_layers)
    both = torch.cat([base, base + 1])
    return both[None, :] + 2 * torch.arange(num_layers, device=tables.device)[:, None]


def flat_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """The whole cache [N, L, 2, bs, kvh, hd] as rows [N * L * 2, bs * kvh * hd] (a view: one row
    is one block's K or V of one layer, contiguous). Raises RuntimeError on a non-contiguous cache."""
    return kv_cache.view(-1, math.prod(kv_cache.shape[3:]))


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store k, v: [T, kv_heads, head_dim] into the layer views cache_k/v: [N, bs, kv_heads, hd]."""
    cache_k[meta.slot_blocks, meta.slot_offsets] = k
    cache_v[meta.slot_blocks, meta.slot_offsets] = v


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """Blocks [..., nb] of a layer view -> [..., kv_heads, ctx_len, head_dim]: one copy (the
    index_select), returned as a transposed view whose last dim is contiguous.

    index_select (not `cache[ids]`): many times faster on CPU than advanced indexing of the
    strided view. No second copy into a head-major layout: SDPA's CPU flash kernel reads K/V
    through their strides (bit-identical results; at batch 8 the copy was half of the gather
    bytes). The KV heads are not expanded to the query heads (see _decode, _prefill).
    """
    x = cache.index_select(0, block_ids.flatten())         # [D*nb, bs, kvh, hd]
    x = x.view(*block_ids.shape, *cache.shape[1:])          # [..., nb, bs, kvh, hd]
    x = x.flatten(-4, -3)[..., :ctx_len, :, :]             # [..., ctx, kvh, hd]
    return x.transpose(-3, -2)


def _gather_decode(kv_cache: torch.Tensor, layer: int,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every decode row: two [D, kvh, decode_max_ctx, hd] views of one index_select
    over the flat cache (meta.decode_rows), the same values and strides as two _gather calls.

    One copy instead of two, from a contiguous source: each op that copies more than ~32k
    elements is an OpenMP parallel region, and at batch 8 the two gathers per layer were 16% of
    a SmolLM2 step (torch.profiler, 2 threads)."""
    d, nb = meta.decode_tables.shape
    bs, kvh, hd = kv_cache.shape[3:]
    x = flat_cache(kv_cache).index_select(0, meta.decode_rows[layer])   # [2 * D * nb, bs*kvh*hd]
    x = x.view(2, d, nb * bs, kvh, hd)[:, :, :meta.decode_max_ctx].transpose(-3, -2)
    return x[0], x[1]


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
            meta: AttentionMetadata, scale: float | None = None) -> torch.Tensor:
    """q: [D, heads, hd] -> [D, heads, hd].

    GQA without copies: the `group` query heads that share a KV head become that head's
    "query positions" ([D, kv_heads, group, hd] against K/V [D, kv_heads, S, hd]); a decode
    token attends to its whole context, so no causal mask is lost. Query head h uses KV head
    h // group, as HF's repeat_kv.
    """
    d, heads, hd = q.shape
    kvh = kv_cache.shape[4]
    if meta.decode_rows is None:  # metadata built without a layer count
        k = _gather(kv_cache[:, layer, 0], meta.decode_tables, meta.decode_max_ctx)  # [D, kvh, S, hd]
        v = _gather(kv_cache[:, layer, 1], meta.decode_tables, meta.decode_max_ctx)
    else:
        k, v = _gather_decode(kv_cache, layer, meta)
    out = F.scaled_dot_product_attention(q.view(d, kvh, heads // kvh, hd), k, v,
                                         attn_mask=meta.decode_mask, scale=scale)
    return out.reshape(d, heads, hd)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
             cache_v: torch.Tensor, chunk: PrefillChunk, scale: float | None = None) -> torch.Tensor:
    """q: [L, heads, hd], k/v: [L, kvh, hd] of this chunk -> [L, heads, hd].

    4-D inputs with enable_gqa: on CPU they take SDPA's flash kernel, 3-D ones the math path
    (3x slower at 512 tokens, plus a GQA-expanded copy of K and V).
    """
    if chunk.direct:  # the chunk is the whole context: use it directly
        ks, vs = k.transpose(0, 1), v.transpose(0, 1)
    else:
        ks = _gather(cache_k, chunk.block_ids, chunk.ctx_len)
        vs = _gather(cache_v, chunk.block_ids, chunk.ctx_len)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], ks[None], vs[None],
                                         attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                         enable_gqa=True, scale=scale)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    layer: int, meta: AttentionMetadata,
                    scale: float | None = None) -> torch.Tensor:
    """Write this step's k/v into layer `layer` of the cache, then attend.

    q: [T, heads, hd]; k, v: [T, kv_heads, hd]; kv_cache: the whole contiguous cache
    [num_blocks, num_layers, 2, block_size, kv_heads, hd]. scale: the factor of q.k before the
    softmax (None: SDPA's 1/sqrt(hd); Gemma 3: query_pre_attn_scalar ** -0.5). Returns
    [T, heads, hd].
    """
    write_kv(kv_cache[:, layer, 0], kv_cache[:, layer, 1], k, v, meta)
    return attend(q, k, v, kv_cache, layer, meta, scale)


DecodeAttention = Callable[[torch.Tensor, torch.Tensor, int, AttentionMetadata, float | None], torch.Tensor]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
           meta: AttentionMetadata, scale: float | None = None,
           decode: DecodeAttention | None = None) -> torch.Tensor:
    """paged_attention after its KV write (this step's k/v already in the cache): the decode
    rows by `decode` (q [D, heads, hd], kv_cache, layer, meta, scale -> [D, heads, hd]; None:
    gather + SDPA), then each prefill chunk. Returns [T, heads, hd]."""
    cache_k, cache_v = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    parts = []
    if meta.num_decodes:
        parts.append((decode or _decode)(q[:meta.num_decodes], kv_cache, layer, meta, scale))
    for chunk in meta.prefills:
        s = slice(chunk.start, chunk.start + chunk.length)
        parts.append(_prefill(q[s], k[s], v[s], cache_k, cache_v, chunk, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
