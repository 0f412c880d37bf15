"""The decode K/V gather as one index_select over the flat cache (engine.attention.kv_rows):
same keys, values and attention output bits as the per-layer K and V gathers."""
import dataclasses

import torch

from engine.attention import _gather, _gather_decode, flat_cache, kv_rows, paged_attention
from engine.attention_meta import build_metadata


@dataclasses.dataclass
class Item:
    num_computed: int
    num_new: int
    block_ids: list[int]


def _setup(window=None):
    gen = torch.Generator().manual_seed(3)
    layers, bs, kvh, hd = 4, 16, 3, 8
    cache = torch.randn(40, layers, 2, bs, kvh, hd, generator=gen)
    # three decodes of different lengths over scattered blocks (padded tables, masked keys)
    items = [Item(37, 1, [5, 17, 2]), Item(5, 1, [30]), Item(60, 1, [9, 1, 33, 21])]
    pos = torch.tensor([it.num_computed for it in items])
    return cache, items, pos, layers, bs, kvh, hd, gen


def test_kv_rows_address_each_layers_k_then_v_blocks():
    cache = torch.arange(6 * 3 * 2 * 2, dtype=torch.float32).view(6, 3, 2, 2, 1, 1)
    tables = torch.tensor([[4, 1], [0, 5]])
    rows = kv_rows(tables, 3)
    assert rows.shape == (3, 8)
    flat = flat_cache(cache)
    for layer in range(3):
        got = flat.index_select(0, rows[layer]).view(2, 4, -1)
        for j, b in enumerate(tables.flatten().tolist()):
            assert torch.equal(got[0, j], cache[b, layer, 0].flatten())
            assert torch.equal(got[1, j], cache[b, layer, 1].flatten())


def test_one_gather_equals_two_gathers_and_same_attention_bits():
    for window in (None, 20):
        cache, items, pos, layers, bs, kvh, hd, gen = _setup()
        one = build_metadata(items, pos, bs, window, num_layers=layers)
        two = build_metadata(items, pos, bs, window)
        assert one.decode_rows is not None and two.decode_rows is None
        heads = 6
        for layer in range(layers):
            k, v = _gather_decode(cache, layer, one)
            assert torch.equal(k, _gather(cache[:, layer, 0], one.decode_tables, one.decode_max_ctx))
            assert torch.equal(v, _gather(cache[:, layer, 1], one.decode_tables, one.decode_max_ctx))
            assert k.stride() == _gather(cache[:, layer, 0], one.decode_tables, one.decode_max_ctx).stride()
            q = torch.randn(3, heads, hd, generator=gen)
            kn, vn = torch.randn(3, kvh, hd, generator=gen), torch.randn(3, kvh, hd, generator=gen)
            c1, c2 = cache.clone(), cache.clone()
            out1 = paged_attention(q, kn, vn, c1, layer, one)
            out2 = paged_attention(q, kn, vn, c2, layer, two)
            assert torch.equal(out1, out2) and torch.equal(c1, c2)
