"""pdserve's fused float32 CPU kernels (engine.cpu_ops) against their ATen reference.

Each kernel must equal the ATen ops it replaces to float32 rounding (exp, sums and FMAs in
another order): RMSNorm + residual add, SwiGLU, RoPE + KV write, decode attention over the paged
cache (GQA, ragged contexts, sliding windows, key counts that are not multiples of 8, head dims
with and without the AVX2 fast paths). The engine-level oracle (greedy == HF transformers) runs
with the kernels too: tests/engine/test_model_vs_hf.py uses the default engine.cpu_kernels: auto.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, _decode, kv_rows, write_kv
from engine.attention_meta import build_metadata
from engine.cpu_linear import DualWeight, pack_weight, packed_linear
from engine.cpu_ops import TORCH_OPS, KernelOps, load_library, missing_cpu_features, select_ops
from engine.gemv_layout import to_gemv_panels
from engine.layers import RotaryTable, apply_rope, linear

pytestmark = pytest.mark.skipif(load_library() is not None,
                                reason=f"pdserve CPU kernels: {load_library()} (make install builds them)")

K = KernelOps()
TOL = dict(rtol=2e-5, atol=2e-5)
BF16 = torch.bfloat16


@pytest.mark.parametrize("t,h", [(1, 576), (8, 576), (3, 100), (300, 64)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(t, h, with_delta):
    g = torch.Generator().manual_seed(t * h)
    x, delta = torch.randn(t, h, generator=g) * 3, torch.randn(t, h, generator=g)
    w = torch.randn(h, generator=g)
    ref_x, ref = TORCH_OPS.add_rms_norm(x.clone(), delta if with_delta else None, w, 1e-5)
    got_x, got = K.add_rms_norm(x.clone(), delta if with_delta else None, w, 1e-5)
    torch.testing.assert_close(got_x, ref_x, rtol=0, atol=0)  # the residual add is exact
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("t,i", [(1, 1536), (8, 1536), (5, 37)])
def test_silu_mul(t, i):
    gate_up = torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(i)) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-8])  # saturated and tiny gates
    torch.testing.assert_close(K.silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up), **TOL)


def _cache(blocks=24, layers=3, bs=4, kvh=2, hd=64, seed=0):
    return torch.randn(blocks, layers, 2, bs, kvh, hd, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hd", [64, 32])
def test_rope_store_kv(hd):
    nh, kvh, t, layer = 6, 2, 7, 1
    g = torch.Generator().manual_seed(hd)
    qkv = torch.randn(t, nh + 2 * kvh, hd, generator=g)
    positions = torch.tensor([0, 5, 9, 30, 31, 64, 200])
    blocks, offsets = torch.tensor([3, 3, 7, 1, 1, 20, 11]), torch.tensor([0, 1, 2, 3, 0, 1, 2])
    rope = RotaryTable(hd, 10000.0, torch.float32, size=64)
    meta = AttentionMetadata(slot_blocks=blocks, slot_offsets=offsets, num_decodes=0, decode_tables=None,
                             decode_max_ctx=0, decode_mask=None, prefills=[])
    ref_cache, got_cache = _cache(hd=hd), _cache(hd=hd)
    qk = apply_rope(qkv[:, :nh + kvh], *rope.lookup(positions, 200))
    write_kv(ref_cache[:, layer, 0], ref_cache[:, layer, 1], qk[:, nh:], qkv[:, nh + kvh:], meta)
    got = qkv.clone()
    K.rope_store_kv(got, *rope.tables(200, positions.device), positions, got_cache, layer, blocks, offsets, nh)
    torch.testing.assert_close(got[:, :nh + kvh], qk, **TOL)
    torch.testing.assert_close(got[:, nh + kvh:], qkv[:, nh + kvh:], rtol=0, atol=0)
    torch.testing.assert_close(got_cache, ref_cache, **TOL)


class _Item:
    def __init__(self, num_computed: int, block_ids: list[int]):
        self.num_computed, self.num_new, self.block_ids = num_computed, 1, block_ids


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hd,nh,kvh", [(64, 6, 2), (128, 4, 4), (32, 9, 3), (8, 2, 1)])
def test_decode_attention(window, hd, nh, kvh):
    """Ragged rows (1 to 23 keys: tails of the 8-key fast path), GQA groups of 1 to 3, a q that
    is a strided view of qkv (as the model passes it), against gather + SDPA with its mask."""
    bs, layers, layer = 4, 3, 2
    cache = _cache(blocks=40, layers=layers, bs=bs, kvh=kvh, hd=hd, seed=hd)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1)).tolist()
    lengths = [1, 8, 9, 23, 16]
    items, used = [], 0
    for n in lengths:  # a query at position n - 1 sees keys 0 .. n - 1
        nblocks = -(-n // bs)
        items.append(_Item(n - 1, perm[used:used + nblocks]))
        used += nblocks
    pos = torch.tensor([it.num_computed for it in items])
    meta = build_metadata(items, pos, bs, window, layers)
    qkv = torch.randn(len(items), nh + 2 * kvh, hd, generator=torch.Generator().manual_seed(2))
    q = qkv[:, :nh]
    ref = _decode(q.contiguous(), cache, layer, meta)
    got = K.decode_attention(q, cache, layer, meta.decode_tables, meta.decode_key_ranges, hd ** -0.5)
    torch.testing.assert_close(got, ref, **TOL)


def test_decode_attention_rejects_bad_ranges():
    cache = _cache()
    q = torch.randn(1, 4, 64)
    tables = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="bad key range"):
        K.decode_attention(q, cache, 0, tables, torch.tensor([[0, 9]]), 0.125)  # 2 blocks of 4 keys
    with pytest.raises(RuntimeError, match="block id outside"):
        K.decode_attention(q, cache, 0, torch.tensor([[0, 99]]), torch.tensor([[0, 8]]), 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        K.decode_attention(q.double(), cache, 0, tables, torch.tensor([[0, 8]]), 0.125)


def test_select_ops():
    assert select_ops("off", torch.float32, "cpu") is TORCH_OPS
    assert isinstance(select_ops("auto", torch.float32, "cpu"), KernelOps)
    assert isinstance(select_ops("auto", torch.bfloat16, "cpu"), KernelOps)
    assert select_ops("auto", torch.float16, "cpu") is TORCH_OPS
    with pytest.raises(RuntimeError, match="float32 or bfloat16 on the CPU only"):
        select_ops("on", torch.float16, "cpu")


def test_kv_rows_unchanged_by_key_ranges():
    """The metadata's key ranges agree with its mask: row r's visible keys are exactly [lo, hi)."""
    items = [_Item(10, [0, 1, 2]), _Item(3, [5])]
    meta = build_metadata(items, torch.tensor([10, 3]), 4, 6, 2)
    visible = meta.decode_mask[:, 0, 0, :]
    for r, (lo, hi) in enumerate(meta.decode_key_ranges.tolist()):
        expect = torch.zeros(visible.shape[1], dtype=torch.bool)
        expect[lo:hi] = True
        assert torch.equal(visible[r], expect)
    assert meta.decode_rows is not None and torch.equal(meta.decode_rows, kv_rows(meta.decode_tables, 2))


@pytest.mark.parametrize("n,k", [(960, 576), (7, 576), (49, 37), (3, 1), (2048, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_a_float64_product(n, k, with_bias):
    """Row counts and K that are not multiples of the 4-row / 16- or 32-float blocks; within
    fp32 rounding of a float64 reference and at least as close as oneDNN's packed product."""
    g = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    ref = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    got = torch.ops.pdserve_cpu.gemv(x, to_gemv_panels(w), bias)
    assert got.shape == (1, n)
    err = (got.double() - ref).abs().max().item()
    assert err < 1e-5 * max(1.0, k ** 0.5)
    packed_err = (packed_linear(x, pack_weight(w), bias).double() - ref).abs().max().item()
    assert err <= 2 * packed_err + 1e-6


def test_dual_weight_routes_one_row_to_gemv_and_more_to_onednn():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 32, generator=g), torch.randn(3, 32, generator=g)
    dual = DualWeight(pack_weight(w), to_gemv_panels(w))
    assert torch.equal(linear(x[:1], dual), torch.ops.pdserve_cpu.gemv(x[:1], dual.panels, None))
    assert torch.equal(linear(x, dual), packed_linear(x, dual.packed, None))
    with pytest.raises(RuntimeError, match="gemv takes"):
        torch.ops.pdserve_cpu.gemv(x, dual.panels, None)


def test_missing_cpu_features_reads_the_flags_line(tmp_path):
    """A CPU without AVX2/FMA must not load a library built for x86-64-v3 (it would die of SIGILL)."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 only")
    old = tmp_path / "old"
    old.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx\n")
    new = tmp_path / "new"
    new.write_text("processor\t: 0\nflags\t\t: fpu sse avx avx2 fma avx512f\n")
    assert missing_cpu_features(old) == ["avx2", "fma"]
    assert missing_cpu_features(new) == []


# bfloat16: the kernels round where the ATen path rounds (each op's output), so the residual add,
# RMSNorm, SwiGLU and RoPE give ATen's bits; attention and the GEMV accumulate in float32 and
# round once (as SDPA and oneDNN do), within a bf16 rounding step of them.

def test_bf16_add_rms_norm_and_silu_mul_match_aten_bits():
    g = torch.Generator().manual_seed(7)
    x, d = torch.randn(5, 576, generator=g).to(BF16), torch.randn(5, 576, generator=g).to(BF16)
    w = torch.randn(576, generator=g).to(BF16)
    ref_x, ref = TORCH_OPS.add_rms_norm(x.clone(), d, w, 1e-5)
    got_x, got = K.add_rms_norm(x.clone(), d, w, 1e-5)
    assert torch.equal(got_x, ref_x) and torch.equal(got, ref)
    gate_up = (torch.randn(5, 2 * 1536, generator=g) * 4).to(BF16)
    assert torch.equal(K.silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up))


def test_bf16_rope_store_kv_matches_aten_bits():
    nh, kvh, hd, layer = 6, 2, 64, 0
    qkv = torch.randn(4, nh + 2 * kvh, hd, generator=torch.Generator().manual_seed(8)).to(BF16)
    positions, blocks, offsets = torch.tensor([0, 7, 100, 301]), torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3])
    rope = RotaryTable(hd, 10000.0, BF16, size=64)
    qk = apply_rope(qkv[:, :nh + kvh], *rope.lookup(positions, 301))
    cache = _cache(blocks=8, layers=2, kvh=kvh, hd=hd).to(BF16)
    got = qkv.clone()
    K.rope_store_kv(got, *rope.tables(301, positions.device), positions, cache, layer, blocks, offsets, nh)
    assert torch.equal(got[:, :nh + kvh], qk)
    assert torch.equal(cache[blocks, layer, 0, offsets], qk[:, nh:])
    assert torch.equal(cache[blocks, layer, 1, offsets], qkv[:, nh + kvh:])


@pytest.mark.parametrize("window", [None, 5])
def test_bf16_decode_attention_close_to_sdpa(window):
    bs, layers, layer, nh, kvh, hd = 4, 2, 1, 6, 2, 64
    cache = _cache(blocks=30, layers=layers, bs=bs, kvh=kvh, hd=hd, seed=9).to(BF16)
    items = [_Item(n - 1, list(range(i * 7, i * 7 + -(-n // bs)))) for i, n in enumerate([3, 17, 26])]
    meta = build_metadata(items, torch.tensor([it.num_computed for it in items]), bs, window, layers)
    q = torch.randn(3, nh, hd, generator=torch.Generator().manual_seed(10)).to(BF16)
    ref = _decode(q.float(), cache.float(), layer, meta)  # float32 math on the same bf16 values
    got = K.decode_attention(q, cache, layer, meta.decode_tables, meta.decode_key_ranges, hd ** -0.5)
    assert got.dtype == BF16
    torch.testing.assert_close(got.float(), ref.to(BF16).float(), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("n,k", [(960, 576), (49, 37), (2048, 1536)])
def test_bf16_gemv_close_to_onednn(n, k):
    g = torch.Generator().manual_seed(n + k)
    x, w, bias = (torch.randn(1, k, generator=g).to(BF16), torch.randn(n, k, generator=g).to(BF16),
                  torch.randn(n, generator=g).to(BF16))
    ref = torch.nn.functional.linear(x, w, bias)
    got = torch.ops.pdserve_cpu.gemv(x, to_gemv_panels(w), bias)
    assert got.dtype == BF16
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2 * k ** 0.5)


@pytest.mark.parametrize("shape", [(1, 49152), (3, 17), (1, 1), (8, 1000)])
def test_argmax_rows_is_torch_argmax(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    assert torch.equal(torch.ops.pdserve_cpu.argmax_rows(x), torch.argmax(x, -1))


def test_argmax_rows_ties_nan_and_signed_zero_as_torch():
    x = torch.zeros(4, 10)
    x[0, 3] = x[0, 5] = float("nan")      # the first NaN wins over everything
    x[1, 7], x[1, 2] = float("inf"), -0.0  # inf beats the zeros
    x[2] = -0.0
    x[2, 4] = 0.0                           # -0.0 == 0.0: the first index
    x[3, 6] = x[3, 8] = 2.0                 # a tie: the first index
    assert torch.equal(torch.ops.pdserve_cpu.argmax_rows(x), torch.argmax(x, -1))
    with pytest.raises(RuntimeError, match="argmax_rows takes"):
        torch.ops.pdserve_cpu.argmax_rows(x.bfloat16())
