"""The pure-decode input fast path (engine.decode_inputs) builds exactly the tensors of the general
path (ModelRunner.inputs through engine.attention_meta.build_metadata), and an engine on it
decodes the same tokens as on the general path."""
import dataclasses
import random

import pytest
import torch

from engine.attention_meta import build_metadata
from engine.decode_inputs import decode_inputs, is_pure_decode
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams


@dataclasses.dataclass
class Item:
    num_computed: int
    num_new: int
    block_ids: list[int]


def _general(items, ids, rows, bs, windows, num_layers):
    pos = torch.cat([torch.arange(it.num_computed, it.num_computed + it.num_new) for it in items])
    metas = {w: build_metadata(items, pos, bs, w, num_layers) for w in windows}
    return (torch.tensor(ids, dtype=torch.long), pos, torch.tensor(rows, dtype=torch.long), metas,
            max(it.num_computed for it in items))


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what


def _random_items(rng, bs, d):
    items = []
    for _ in range(d):
        c = rng.randrange(0, 120)
        nblocks = c // bs + 1 + rng.randrange(0, 2)  # a table may hold a block past the position
        items.append(Item(c, 1, rng.sample(range(200), nblocks)))
    return items


@pytest.mark.parametrize("seed", range(40))
def test_decode_inputs_equal_the_general_path(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    items = _random_items(rng, bs, rng.randrange(1, 9))
    windows = rng.choice([(None,), (7,), (None, 12), (3, None, 40)])
    num_layers = rng.choice([None, 5])
    ids = [rng.randrange(1000) for _ in items]
    rows = list(range(len(items)))[:rng.randrange(0, len(items) + 1)]
    want = _general(items, ids, rows, bs, windows, num_layers)
    got = decode_inputs(items, ids, rows, bs, windows, num_layers)
    for name, a, b in zip(("ids", "positions", "rows"), got[:3], want[:3]):
        _same(a, b, name)
    assert got[4] == want[4]
    assert got[3].keys() == want[3].keys()
    for w in windows:
        g, e = got[3][w], want[3][w]
        assert g.num_decodes == e.num_decodes and g.decode_max_ctx == e.decode_max_ctx and g.prefills == e.prefills
        for f in ("slot_blocks", "slot_offsets", "decode_tables", "decode_mask", "decode_rows", "decode_key_ranges"):
            _same(getattr(g, f), getattr(e, f), f"window {w}: {f}")


def test_decode_inputs_without_mask_keeps_the_key_ranges():
    items = [Item(37, 1, [5, 17, 2]), Item(5, 1, [30])]  # different lengths: the general path masks
    got = decode_inputs(items, [1, 2], [0, 1], 16, (None,), None, with_mask=False)[3][None]
    assert got.decode_mask is None and got.decode_rows is None
    assert got.decode_key_ranges.tolist() == [[0, 38], [0, 6]]


def test_is_pure_decode_and_empty():
    assert is_pure_decode([Item(3, 1, [0])]) and not is_pure_decode([Item(3, 1, [0]), Item(0, 4, [1])])
    with pytest.raises(ValueError):
        decode_inputs([], [], [], 16, (None,), None)


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_engine_decodes_the_same_tokens_on_both_paths(tiny_engine_factory, cpu_kernels):
    """Greedy and seeded sampled requests of different lengths, batched: the fast path on and off."""
    outs = []
    for fast in (True, False):
        engine = tiny_engine_factory(cpu_kernels=cpu_kernels)
        engine.runner.fast_decode_inputs = fast
        for i, (n, temp) in enumerate([(5, 0.0), (23, 0.0), (40, 0.9)]):
            engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=list(range(7, 7 + n)),
                                             sampling=SamplingParams(max_tokens=24, temperature=temp, seed=3,
                                                                     ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        outs.append(tokens)
    assert outs[0] == outs[1] and all(len(t) == 24 for t in outs[0].values())
