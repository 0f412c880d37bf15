"""KV cache memory: huge-page-advised anonymous mappings, 4 KiB fallback, shared files."""
from __future__ import annotations

import pytest
import torch

from engine.huge_pages import HUGE_PAGE_BYTES, transparent_huge_pages_mode
from engine.kv_memory import allocate_kv_cache

SHAPE = (6, 2, 2, 16, 3, 64)  # blocks, layers, K/V, block_size, kv heads, head_dim: 1.1 MiB of float32


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that contains ``address``."""
    entry: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    return entry


def test_huge_page_cache_is_zeroed_aligned_and_advised():
    cache = allocate_kv_cache(SHAPE, torch.float32)
    assert cache.shape == SHAPE and cache.dtype == torch.float32 and cache.is_contiguous()
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    assert cache.abs().sum() == 0
    assert "hg" in _smaps_entry(cache.data_ptr())["VmFlags"].split()  # MADV_HUGEPAGE applied


def test_huge_page_cache_is_backed_by_huge_pages_once_touched():
    if transparent_huge_pages_mode() not in ("always", "madvise"):
        pytest.skip(f"kernel THP mode is {transparent_huge_pages_mode()!r}: no huge pages to get")
    cache = allocate_kv_cache((64, 1, 2, 16, 8, 64), torch.float16)  # 16 MiB
    cache.fill_(1.5)
    anon_huge_kib = int(_smaps_entry(cache.data_ptr())["AnonHugePages"].split()[0])
    assert anon_huge_kib >= 2048
    assert cache.float().sum().item() == 1.5 * cache.numel()


def test_views_keep_the_mapping_alive():
    view = allocate_kv_cache(SHAPE, torch.bfloat16)[2:4]
    view.fill_(3)  # the full tensor is gone: its mapping must still be there
    assert view.float().mean().item() == 3


def test_small_pages_and_shared_file(tmp_path):
    small = allocate_kv_cache(SHAPE, torch.float32, huge_pages=False)
    assert "hg" not in _smaps_entry(small.data_ptr()).get("VmFlags", "").split()
    path = tmp_path / "kv.bin"
    shared = allocate_kv_cache(SHAPE, torch.float32, path=str(path))
    shared[1].fill_(7)
    again = torch.from_file(str(path), shared=True, size=shared.numel(), dtype=torch.float32).view(SHAPE)
    assert torch.equal(again, shared)


def test_engine_cache_follows_its_config(tiny_engine_factory):
    on = tiny_engine_factory(num_kv_blocks=8)
    off = tiny_engine_factory(num_kv_blocks=8, kv_cache_huge_pages=False)
    assert "hg" in _smaps_entry(on.kv_cache.data_ptr())["VmFlags"].split()
    assert "hg" not in _smaps_entry(off.kv_cache.data_ptr()).get("VmFlags", "").split()


def test_cache_is_committed_at_allocation():
    """A cache too big for the host must fail at start, not under load: every page is backed now."""
    cache = allocate_kv_cache((16, 1, 2, 16, 8, 64), torch.float16)  # 4 MiB, never written here
    rss_kib = int(_smaps_entry(cache.data_ptr())["Rss"].split()[0])
    assert rss_kib * 1024 >= cache.numel() * cache.element_size()


def test_kernel_without_thp_falls_back_to_small_pages(monkeypatch, caplog):
    """madvise(MADV_HUGEPAGE) fails with EINVAL on kernels built without THP: warn and go on."""
    import mmap

    from engine import huge_pages

    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)  # an advice every kernel refuses
    with caplog.at_level("WARNING", logger=huge_pages.__name__):
        cache = allocate_kv_cache(SHAPE, torch.float32)
    assert "4 KiB pages" in caplog.text
    assert cache.abs().sum() == 0 and "hg" not in _smaps_entry(cache.data_ptr())["VmFlags"].split()
    cache.fill_(2)
    assert cache.mean().item() == 2
