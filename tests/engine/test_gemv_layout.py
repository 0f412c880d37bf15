"""The GEMV kernel's 4-row panel layout (engine.gemv_layout) and its arena: every element lands
where the kernel reads it, whatever N % 4 and K % 16 (and K % 32, the AVX-512 chunk), in float32
and bfloat16; the arena holds each weight page-aligned on huge pages where the kernel allows."""
from __future__ import annotations

import pytest
import torch

from engine.cpu_ops import load_library
from engine.gemv_layout import ALIGN_BYTES, from_gemv_panels, gemv_panel_arena, to_gemv_panels
from engine.huge_pages import transparent_huge_pages_mode

SHAPES = [(960, 576), (7, 576), (49, 37), (3, 1), (4, 16), (5, 48), (8, 40), (2048, 1536)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panels_round_trip(n, k, dtype):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).to(dtype)
    panels = to_gemv_panels(w)
    assert panels.shape == w.shape and panels.dtype == dtype and panels.is_contiguous()
    assert torch.equal(from_gemv_panels(panels), w)
    assert torch.equal(panels.view(-1).sort().values, w.view(-1).sort().values)  # a permutation


def test_panel_element_order_is_the_kernels():
    """Element (n, c) of a panel row: chunk c // 16, then row n % 4, then c % 16; the last K % 16
    columns of the 4 rows after the chunks; rows past N - N % 4 row-major (cpu_ops.cpp panel_at)."""
    n, k = 9, 37  # two panels + one tail row; K16 = 32, 5 last columns
    w = torch.arange(n * k, dtype=torch.float32).view(n, k)
    flat = to_gemv_panels(w).view(-1)
    k16 = 32
    for row in range(n):
        for c in range(k):
            if row < 8:
                base, i = (row // 4) * 4 * k, row % 4
                off = base + ((c // 16) * 64 + i * 16 + c % 16 if c < k16 else 4 * k16 + i * (k - k16) + c - k16)
            else:
                off = row * k + c
            assert flat[off].item() == w[row, c].item(), (row, c)


def test_to_gemv_panels_checks_its_arguments():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        to_gemv_panels(torch.randn(8))
    with pytest.raises(ValueError, match="out must be"):
        to_gemv_panels(w, torch.empty(8, 17))


def test_arena_aligns_each_weight_and_keeps_values():
    ws = [torch.randn(n, k, generator=torch.Generator().manual_seed(n)) for n, k in [(5, 48), (960, 576), (3, 1)]]
    out = gemv_panel_arena(ws)
    assert [o.shape for o in out] == [w.shape for w in ws]
    assert all(o.data_ptr() % ALIGN_BYTES == 0 for o in out)
    assert all(torch.equal(from_gemv_panels(o), w) for o, w in zip(out, ws))
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()  # one arena
    with pytest.raises(ValueError, match="one dtype"):
        gemv_panel_arena([ws[0], ws[1].bfloat16()])


def test_arena_is_on_huge_pages_where_the_kernel_allows():
    if transparent_huge_pages_mode() not in ("always", "madvise"):
        pytest.skip(f"kernel THP mode is {transparent_huge_pages_mode()!r}: no huge pages to get")
    (w,) = gemv_panel_arena([torch.randn(2048, 1536)])  # 12 MiB: whole 2 MiB extents inside
    start = w.data_ptr()
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        lo, _, hi = line.split()[0].partition("-")
        if "-" in line.split()[0] and int(lo, 16) <= start < int(hi, 16):
            entry = lines[i + 1: i + 30]
            flags = next(x for x in entry if x.startswith("VmFlags")).split()
            huge = next(x for x in entry if x.startswith("AnonHugePages")).split()[1]
            assert "hg" in flags and int(huge) > 0
            return
    pytest.fail("the arena's mapping is not in /proc/self/smaps")


@pytest.mark.skipif(load_library() is not None, reason=f"pdserve CPU kernels: {load_library()}")
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_on_panels_equals_the_row_by_row_product(n, k, dtype):
    """The kernel on panels against each row's float64 dot product: every row (panel rows and
    tail rows, chunk columns and last columns) is computed from its own elements."""
    g = torch.Generator().manual_seed(7 * n + k)
    x, w = torch.randn(1, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    got = torch.ops.pdserve_cpu.gemv(x, to_gemv_panels(w), None).double()
    ref = x.double() @ w.double().t()
    tol = (1e-5 if dtype == torch.float32 else 2e-2) * max(1.0, k ** 0.5)
    assert (got - ref).abs().max().item() < tol
