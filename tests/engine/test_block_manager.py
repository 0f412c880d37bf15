import pytest

from engine.block_manager import BlockManager


def test_allocate_and_deallocate_roundtrip():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free_blocks == 8
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a) | set(b)) == 8 and bm.num_free_blocks == 0
    assert not bm.can_allocate(1)
    with pytest.raises(RuntimeError):
        bm.allocate(1)
    bm.deallocate(a)
    assert bm.num_free_blocks == 3 and bm.can_allocate(3) and not bm.can_allocate(4)


def test_blocks_needed_is_ceil():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert [bm.blocks_needed(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_grow_adds_only_missing_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    table: list[int] = []
    bm.grow(table, 1)
    assert len(table) == 1
    bm.grow(table, 4)
    assert len(table) == 1
    bm.grow(table, 5)
    assert len(table) == 2
    assert bm.can_grow(table, 16) and not bm.can_grow(table, 17)


def test_double_free_is_an_error():
    bm = BlockManager(num_blocks=2, block_size=4)
    blocks = bm.allocate(1)
    bm.deallocate(blocks)
    with pytest.raises(ValueError):
        bm.deallocate(blocks)
    with pytest.raises(ValueError):
        bm.deallocate([1])
