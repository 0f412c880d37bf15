"""KV events produced by the block manager: stored (chained, fused per step), removed on eviction,
cleared on reset, numbered per batch; the snapshot agrees with the batches; the wire round-trips."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.kv_event_log import KVEventLog
from pdserve.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot, KVWireError,
                               batch_line, control_line, parse_line, snapshot_line)

BS = 2


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def cache_chain(bm: BlockManager, first: int, n: int) -> list[int]:
    """Allocate n blocks and cache them as one chain of hashes h(first)..h(first+n-1)."""
    blocks = bm.allocate(n)
    for i, b in enumerate(blocks):
        bm.cache_block(b, h(first + i), [first + i] * BS, h(first + i - 1) if i else None)
    return blocks


def replay(batches: list[KVEventBatch]) -> set[bytes]:
    held: set[bytes] = set()
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                held |= set(ev.hashes)
            elif isinstance(ev, BlockRemoved):
                held -= set(ev.hashes)
            else:
                held.clear()
    return held


def test_stored_blocks_of_one_chain_fuse_into_one_event_with_its_parent():
    log = KVEventLog("e1")
    bm = BlockManager(8, BS, events=log)
    cache_chain(bm, 10, 3)
    batch = log.take()
    assert batch == KVEventBatch("e1", 1, (BlockStored((h(10), h(11), h(12)), None),))
    assert log.take() is None  # nothing new: no empty batch, seq unchanged
    assert log.seq == 1


def test_eviction_removes_reset_clears_and_seq_counts_batches():
    log = KVEventLog("e1")
    bm = BlockManager(4, BS, events=log)
    bm.deallocate(cache_chain(bm, 10, 4))  # all four cached, evictable
    first = log.take()
    bm.allocate(2)  # evicts the two least recently used (the chain's tail goes first)
    second = log.take()
    assert second.seq == 2 and len(second.events) == 1 and isinstance(second.events[0], BlockRemoved)
    assert len(second.events[0].hashes) == 2
    assert replay([first, second]) == set(bm.held_hashes())
    bm.reset_prefix_cache()
    third = log.take()
    assert third == KVEventBatch("e1", 3, (AllBlocksCleared(),))
    assert replay([first, second, third]) == set() == set(bm.held_hashes())


def test_a_duplicate_hash_is_not_announced_and_caching_off_announces_nothing():
    log = KVEventLog()
    bm = BlockManager(4, BS, events=log)
    a, b = bm.allocate(2)
    assert bm.cache_block(a, h(1), [1] * BS)
    assert not bm.cache_block(b, h(1), [1] * BS)  # another copy of the same block stays private
    assert log.take().events == (BlockStored((h(1),), None),)
    off = KVEventLog()
    bm_off = BlockManager(4, BS, enable_caching=False, events=off)
    bm_off.cache_block(bm_off.allocate(1)[0], h(1), [1] * BS)
    assert off.take() is None


def test_snapshot_needs_pending_events_taken_first():
    log = KVEventLog("e1")
    bm = BlockManager(4, BS, events=log)
    cache_chain(bm, 1, 2)
    with pytest.raises(RuntimeError):
        log.snapshot(bm.held_hashes())
    batch = log.take()
    snap = log.snapshot(bm.held_hashes())
    assert snap.seq == batch.seq == 1 and set(snap.hashes) == replay([batch])
    assert KVEventLog().epoch != KVEventLog().epoch  # a new engine, a new epoch


def test_wire_round_trip_and_refusals():
    batch = KVEventBatch("ep", 7, (BlockStored((h(1), h(2)), h(0)), BlockRemoved((h(3),)), AllBlocksCleared()))
    assert parse_line(batch_line(batch)) == batch
    snap = KVSnapshot("ep", 7, (h(1), h(2)))
    assert parse_line(snapshot_line(snap)) == snap
    assert parse_line(control_line("heartbeat", "ep", 7)) == ("heartbeat", "ep", 7)
    for bad in (b"not json", b"[]", b'{"type":"batch","epoch":"e","seq":-1,"events":[]}',
                b'{"type":"batch","epoch":"e","seq":1,"events":[{"kind":"moved"}]}',
                b'{"type":"snapshot","epoch":"e","seq":1,"hashes":["zz"]}', b'{"type":"x","epoch":"e","seq":1}'):
        with pytest.raises(KVWireError):
            parse_line(bad)


def test_a_real_engine_under_memory_pressure_announces_exactly_what_it_holds(tiny_engine_factory):
    """Chat-like traffic on a 12-block cache (block size 4) evicts; replaying every batch taken after
    each step gives exactly the engine's held hashes, and each prompt's blocks are announced."""
    from engine.request import EngineRequest
    from engine_testutil import greedy

    engine = tiny_engine_factory(num_kv_blocks=12, block_size=4)
    batches: list[KVEventBatch] = []
    prompts = [[3 + (5 * i + j) % 700 for j in range(14)] for i in range(6)]
    for i, prompt in enumerate(prompts * 2):  # the second round re-hits what was not evicted
        engine.add_request(EngineRequest(f"r{i}", prompt, greedy(3)))
        while engine.has_work():
            engine.step()
            if (batch := engine.take_kv_events()) is not None:
                batches.append(batch)
        assert replay(batches) == set(engine.block_manager.held_hashes())
        assert set(engine.hasher.hashes(prompt)[:3]) <= replay(batches)  # 14 tokens: 3 full blocks
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    assert any(isinstance(e, BlockRemoved) for b in batches for e in b.events)  # pressure evicted
    snap = engine.kv_snapshot()
    assert snap.seq == batches[-1].seq and set(snap.hashes) == replay(batches)


def test_garbage_a_subscriber_may_read_is_refused_as_a_wire_error_not_another_exception():
    # review2: a bad parent hash raised ValueError and deep nesting RecursionError, which the
    # orchestrator's KV feed does not catch: its subscriber task died with a traceback.
    for bad in (b'{"type":"batch","epoch":"e","seq":1,"events":[{"kind":"stored","hashes":[],"parent":"zz"}]}',
                b'{"type":"batch","epoch":"e","seq":1,"events":[{"kind":"stored","hashes":["00"],"parent":"0"}]}',
                b"[" * 100_000 + b"]" * 100_000, b'{"type":"snapshot","epoch":"e","seq":1,"hashes":' + b"[" * 100_000):
        with pytest.raises(KVWireError):
            parse_line(bad)
