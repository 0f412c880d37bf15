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


# ---- prefix cache ---------------------------------------------------------------------------
from pdserve.block_hash import BlockHasher  # noqa: E402

BS = 4
HASHER = BlockHasher("tiny", "float32", BS)


def _cache_table(bm, tokens):
    """Allocate blocks for tokens and offer every full one to the cache (as the scheduler does)."""
    table = bm.allocate(bm.blocks_needed(len(tokens)))
    for i, h in enumerate(HASHER.hashes(tokens)):
        bm.cache_block(table[i], h, tokens[i * BS:(i + 1) * BS])
    return table


def test_hit_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))                      # 2 full blocks + 2 tokens
    table = _cache_table(bm, tokens)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 5
    hit = bm.match_prefix(HASHER.hashes(tokens), tokens)
    assert hit == table[:2]
    assert bm.can_allocate(5, sharing=hit)        # referenced hits cost nothing
    bm.share(hit)
    assert [bm.ref_count(b) for b in table] == [2, 2, 1]
    bm.deallocate(table)
    assert [bm.ref_count(b) for b in table] == [1, 1, 0] and bm.num_free_blocks == 6
    bm.deallocate(hit)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2   # unreferenced, still cached
    assert bm.match_prefix(HASHER.hashes(tokens), tokens) == table[:2]


def test_evictable_hits_count_against_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    tokens = list(range(8))
    bm.deallocate(_cache_table(bm, tokens))        # 2 cached evictable + 2 free
    hit = bm.match_prefix(HASHER.hashes(tokens), tokens)
    assert len(hit) == 2
    assert bm.can_allocate(2, sharing=hit) and not bm.can_allocate(3, sharing=hit)
    assert bm.can_allocate(4)                      # without sharing, all 4 may be taken (evicting)


def test_hit_compares_token_ids_not_only_hashes():
    bm = BlockManager(num_blocks=4, block_size=BS)
    tokens = [1, 2, 3, 4]
    table = bm.allocate(1)
    forged = HASHER.hashes([9, 9, 9, 9])[0]
    bm.cache_block(table[0], forged, tokens)         # a hash that does not belong to these tokens
    assert bm.match_prefix([forged], [9, 9, 9, 9]) == []
    assert bm.match_prefix([forged], tokens) == table


def test_prefix_stops_at_first_miss():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(12))
    table = _cache_table(bm, tokens)
    other = tokens[:4] + [99] + tokens[5:]
    assert bm.match_prefix(HASHER.hashes(other), other) == table[:1]
    assert bm.match_prefix(HASHER.hashes(tokens, "salt"), tokens) == []     # another salt: no hit


def test_lru_eviction_order_tail_first_and_never_referenced():
    bm = BlockManager(num_blocks=6, block_size=BS)
    old = list(range(100, 108))
    new = list(range(200, 208))
    t_old = _cache_table(bm, old)
    t_new = _cache_table(bm, new)
    held = bm.allocate(1)                           # referenced, uncached
    bm.deallocate(t_old)
    bm.deallocate(t_new)
    assert bm.num_free_blocks == 5
    assert bm.allocate(1) == [5]                     # a never-used block goes before any cached one
    # Then LRU: the older request's tail block, then its head, then the newer request's tail.
    assert bm.allocate(1) == [t_old[1]]
    assert bm.match_prefix(HASHER.hashes(old), old) == [t_old[0]]   # its head survives
    assert bm.allocate(1) == [t_old[0]] and bm.match_prefix(HASHER.hashes(old), old) == []
    assert bm.match_prefix(HASHER.hashes(new), new) == t_new
    assert bm.allocate(2) == [t_new[1], t_new[0]]
    assert bm.ref_count(held[0]) == 1                # a referenced block is never evicted
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 0 and not bm.can_allocate(1)


def test_reused_block_id_is_never_a_hit():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = list(range(8))
    table = _cache_table(bm, a)
    bm.deallocate(table)
    reused = _cache_table(bm, [7] * 8)              # evicts both cached blocks, same ids
    assert sorted(reused) == sorted(table)
    assert bm.match_prefix(HASHER.hashes(a), a) == []
    bm.deallocate(reused)
    b = bm.allocate(2)                              # fresh blocks: hashes forgotten on eviction
    assert bm.num_cached_blocks == 0 and bm.match_prefix(HASHER.hashes([7] * 8), [7] * 8) == []
    bm.deallocate(b)


def test_duplicate_content_keeps_the_first_block():
    bm = BlockManager(num_blocks=4, block_size=BS)
    tokens = [1, 2, 3, 4]
    first, second = bm.allocate(1), bm.allocate(1)
    h = HASHER.hashes(tokens)[0]
    assert bm.cache_block(first[0], h, tokens) and not bm.cache_block(second[0], h, tokens)
    bm.deallocate(second)                          # uncached: plainly free
    assert bm.num_cached_blocks == 1 and bm.match_prefix([h], tokens) == first
    with pytest.raises(ValueError):
        bm.cache_block(second[0], h, tokens)       # not allocated
    with pytest.raises(ValueError):
        bm.cache_block(first[0], HASHER.hashes([5] * 4)[0], [5, 5])   # not a full block


def test_share_refuses_uncached_and_deallocate_checks_before_changing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    table = bm.allocate(2)
    with pytest.raises(ValueError):
        bm.share(table)
    with pytest.raises(ValueError):
        bm.deallocate([table[0], 3])                # 3 is free: nothing changes
    assert bm.ref_count(table[0]) == 1 and bm.num_free_blocks == 2


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = list(range(8)), list(range(50, 58))
    ta = _cache_table(bm, a)
    tb = _cache_table(bm, b)
    bm.deallocate(ta)                               # a: evictable; b: still referenced
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 6
    assert bm.match_prefix(HASHER.hashes(a), a) == [] and bm.match_prefix(HASHER.hashes(b), b) == []
    bm.deallocate(tb)
    assert bm.num_free_blocks == 8 and bm.reset_prefix_cache() == 0


def test_caching_disabled_is_the_plain_allocator():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_caching=False)
    tokens = list(range(8))
    table = _cache_table(bm, tokens)
    assert bm.num_cached_blocks == 0 and bm.match_prefix(HASHER.hashes(tokens), tokens) == []
    bm.deallocate(table)
    assert bm.allocate(4)[:2] == [2, 3]             # FIFO free list, as before the cache
