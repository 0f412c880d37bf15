"""oneDNN-packed CPU linears (engine.cpu_linear): same products as F.linear, same greedy tokens."""
import pytest
import torch

from engine.request import EngineRequest
from engine.cpu_linear import pack_weight, packing_available
from engine.layers import linear
from tests.engine.engine_testutil import greedy, run_all

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 300])
def test_packed_linear_matches_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(3072, 576, generator=gen), torch.randn(3072, generator=gen)
    x = torch.randn(rows, 576, generator=gen)
    packed = pack_weight(w)
    assert packed.is_mkldnn and tuple(packed.shape) == (3072, 576)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    out = linear(x, packed, b)
    assert out.shape == (rows, 3072) and out.dtype == torch.float32
    # fp32: another accumulation order than MKL's sgemm, same accuracy class against fp64
    assert (out.double() - ref).abs().max() < 5e-4
    wb, xb, bb = w.bfloat16(), x.bfloat16(), b.bfloat16()
    # bf16: F.linear already runs oneDNN, on the plain weight: the packed one gives the same bits
    assert torch.equal(linear(xb, pack_weight(wb), bb), torch.nn.functional.linear(xb, wb, bb))


def test_pack_weight_leaves_what_it_cannot_pack():
    for w in (torch.randn(8, 4, dtype=torch.float16), torch.randn(8), torch.randn(8, 4).to(torch.float64)):
        assert pack_weight(w) is w


def test_packed_model_same_greedy_tokens(tiny_engine_factory):
    """The on/off oracle: packing changes rounding only, never the tiny model's greedy tokens."""
    on = tiny_engine_factory(num_kv_blocks=64, pack_cpu_linears=True, cpu_kernels="off")
    off = tiny_engine_factory(num_kv_blocks=64, pack_cpu_linears=False, cpu_kernels="off")
    assert on.runner.model.layers[0].gate_up.is_mkldnn and on.runner.model.lm_head.is_mkldnn
    assert not off.runner.model.layers[0].gate_up.is_mkldnn
    assert not on.runner.model.embed.is_mkldnn  # the tied embedding stays dense for the lookup
    prompts = [[5 + (7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate((3, 16, 17, 40))]
    reqs = lambda: [EngineRequest(f"r{i}", p, greedy(24)) for i, p in enumerate(prompts)]  # noqa: E731
    got, want = run_all(on, reqs()), run_all(off, reqs())
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in want.items()}


def test_fp32_default_layout_is_the_hint_8_one():
    """fp32 packs for 8 rows by default (issue 11: 1.4x faster at 1 row, 1.7x at 8 on the 2-core
    EPYC). At 2+ rows the hint-1 and hint-8 layouts run the same kernel (same bits), so the
    default changes 1-row products only: there the hint-1 layout's GEMV rounds differently."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(960, 576, generator=gen) * 0.05
    default, hint1, hint8 = pack_weight(w), pack_weight(w, 1), pack_weight(w, 8)
    one = torch.randn(1, 576, generator=gen)
    assert torch.equal(linear(one, default), linear(one, hint8))
    assert not torch.equal(linear(one, hint1), linear(one, hint8))  # the default matters here
    for rows in (2, 5, 8, 64):
        x = torch.randn(rows, 576, generator=gen)
        assert torch.equal(linear(x, default), linear(x, hint1))
