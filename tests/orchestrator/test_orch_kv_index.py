"""The orchestrator's per-server KV index and the kv_cache_aware router on it: routing follows
injected stored/removed events, a sequence gap (or another epoch) drops the server to load-only
scoring until a snapshot resynchronizes it, and the feeds follow membership (a restart rebuilds the
index, a member that leaves loses it, stop ends every subscriber)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from orchestrator.kv_feed import KVEventFeeds
from orchestrator.kv_index import KVIndexes, KVStreamGap, ServerKVIndex
from orchestrator.pools import ClusterPools, Pool, Server, ServerState
from orchestrator.router import KVCacheAwareRouter, RouteHint, block_hashes
from pdserve.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot, batch_line,
                               control_line, snapshot_line)

BS = 4
SHARED = list(range(100, 140))  # 10 blocks


def pool_of(n: int) -> Pool:
    return Pool("ctx", [Server("ctx", i, f"http://s{i}", state=ServerState.READY) for i in range(n)])


def hint(tokens: list[int]) -> RouteHint:
    return RouteHint(block_hashes(tokens, BS), len(tokens))


def synced(indexes: KVIndexes, url: str, hashes=(), epoch: str = "e", seq: int = 0) -> ServerKVIndex:
    index = indexes.get(url)
    index.load_snapshot(KVSnapshot(epoch, seq, tuple(hashes)))
    return index


def test_index_applies_batches_in_order_and_drops_on_gap_or_epoch_change():
    index = ServerKVIndex("http://s0")
    with pytest.raises(KVStreamGap):
        index.apply(KVEventBatch("e", 1, ()))  # before any snapshot
    index.load_snapshot(KVSnapshot("e", 3, (b"a",)))
    index.apply(KVEventBatch("e", 2, (AllBlocksCleared(),)))  # covered by the snapshot: skipped
    index.apply(KVEventBatch("e", 4, (BlockStored((b"b", b"c"), b"a"), BlockRemoved((b"a",)))))
    assert index.hashes == {b"b", b"c"} and index.seq == 4 and index.matched_blocks([b"b", b"c", b"d"]) == 2
    with pytest.raises(KVStreamGap):
        index.apply(KVEventBatch("e", 6, ()))  # batch 5 is missing
    assert not index.synced and index.hashes == set() and index.matched_blocks([b"b"]) is None
    assert "gap" in index.reason
    index.load_snapshot(KVSnapshot("e", 6, (b"b",)))
    with pytest.raises(KVStreamGap):
        index.apply(KVEventBatch("restarted", 1, (BlockStored((b"z",)),)))
    assert not index.synced and "epoch" in index.reason


def test_index_is_bounded():
    index = ServerKVIndex("http://s0", max_blocks=3)
    with pytest.raises(KVStreamGap):
        index.load_snapshot(KVSnapshot("e", 0, (b"a", b"b", b"c", b"d")))
    index.load_snapshot(KVSnapshot("e", 0, (b"a",)))
    with pytest.raises(KVStreamGap):
        index.apply(KVEventBatch("e", 1, (BlockStored((b"b", b"c", b"d")),)))
    assert not index.synced and index.hashes == set()


def test_routing_follows_injected_stored_and_removed_events():
    p, indexes = pool_of(3), KVIndexes()
    router = KVCacheAwareRouter(indexes, balance_threshold=2)
    prompt = hint(SHARED + [1, 2, 3, 4])
    blocks = prompt.block_hashes
    for s in p.servers:
        synced(indexes, s.url)
    indexes.get("http://s2").apply(KVEventBatch("e", 1, (BlockStored(blocks[:8]),)))
    assert all(router.pick(p, set(), prompt).url == "http://s2" for _ in range(5))
    # s1 stores more of the prefix: it wins; then it evicts the head of the chain: s2 again
    indexes.get("http://s1").apply(KVEventBatch("e", 1, (BlockStored(blocks),)))
    assert router.pick(p, set(), prompt).url == "http://s1"
    indexes.get("http://s1").apply(KVEventBatch("e", 2, (BlockRemoved(blocks[:1]),)))
    assert router.pick(p, set(), prompt).url == "http://s2"
    # the holder is too busy: load wins; excluded (already tried): the next best holder
    p.servers[2].in_flight = 3
    assert router.pick(p, set(), prompt).url in {"http://s0", "http://s1"}
    p.servers[2].in_flight = 0
    indexes.get("http://s0").apply(KVEventBatch("e", 1, (BlockStored(blocks[:6]),)))
    assert router.pick(p, {"http://s2"}, prompt).url == "http://s0"
    # nobody holds an unrelated prompt: least loaded, spread
    picks = {router.pick(p, set(), hint([7] * 40)).url for _ in range(6)}
    assert picks == {s.url for s in p.servers}


def test_a_gap_means_load_only_scoring_for_that_server_until_it_resyncs():
    p, indexes = pool_of(2), KVIndexes()
    router = KVCacheAwareRouter(indexes, balance_threshold=4)
    prompt = hint(SHARED)
    synced(indexes, "http://s0")
    holder = synced(indexes, "http://s1", prompt.block_hashes, seq=5)
    p.servers[0].in_flight = 1  # s1 is also the busier one: only its index can make it win ...
    p.servers[1].in_flight = 2
    assert router.pick(p, set(), prompt).url == "http://s1"
    with pytest.raises(KVStreamGap):
        holder.apply(KVEventBatch("e", 7, ()))  # batch 6 lost
    # ... so with its index dropped the less loaded s0 wins every time, although s1 may still hold it
    assert all(router.pick(p, set(), prompt).url == "http://s0" for _ in range(5))
    holder.load_snapshot(KVSnapshot("e", 7, prompt.block_hashes))  # resynchronized
    assert router.pick(p, set(), prompt).url == "http://s1"


class ScriptedStreams:
    """A fake ``StreamOpener``: each connection to a URL reads lines from that URL's current queue;
    ``None`` in a queue ends the stream (the server closed it)."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.opened: list[str] = []

    def feed(self, url: str, *lines: bytes | None) -> None:
        q = self.queues.setdefault(url, asyncio.Queue())
        for line in lines:
            q.put_nowait(line)

    @contextlib.asynccontextmanager
    async def __call__(self, url: str):
        self.opened.append(url)
        q = self.queues.setdefault(url, asyncio.Queue())

        async def lines():
            while (line := await asyncio.wait_for(q.get(), 5)) is not None:
                yield line.decode().rstrip("\n")

        yield lines()


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_feeds_resync_after_a_gap_rebuild_on_restart_and_follow_membership():
    async def main():
        ctx, gen = pool_of(2), Pool("gen", [Server("gen", 0, "http://g0", state=ServerState.READY)])
        indexes, streams = KVIndexes(), ScriptedStreams()
        feeds = KVEventFeeds(ClusterPools(ctx, gen), indexes, streams, interval_s=0.02, retry_s=0.02)
        s0 = "http://s0"
        streams.feed(s0, snapshot_line(KVSnapshot("e1", 2, (b"a",))),
                     batch_line(KVEventBatch("e1", 3, (BlockStored((b"b",)),))), control_line("heartbeat", "e1", 3))
        feeds.start()
        try:
            await until(lambda: indexes.find(s0) is not None and indexes.find(s0).seq == 3)
            assert indexes.find(s0).hashes == {b"a", b"b"} and indexes.find(s0).synced
            assert set(feeds.subscribed()) == {"http://s0", "http://s1", "http://g0"}
            # batch 4 is lost: the index drops at once, the feed reconnects and loads a new snapshot
            streams.feed(s0, batch_line(KVEventBatch("e1", 5, ())), snapshot_line(KVSnapshot("e1", 5, (b"c",))))
            await until(lambda: indexes.find(s0).hashes == {b"c"} and indexes.find(s0).synced)
            assert streams.opened.count(s0) == 2 and indexes.find(s0).resyncs == 2
            # the server restarts: its stream breaks (dropped at once), the new one has a new epoch
            streams.feed(s0, None)
            await until(lambda: not indexes.find(s0).synced)
            streams.feed(s0, snapshot_line(KVSnapshot("e2", 0, ())),
                         batch_line(KVEventBatch("e2", 1, (BlockStored((b"x",)),))))
            await until(lambda: indexes.find(s0).epoch == "e2" and indexes.find(s0).seq == 1)
            assert indexes.find(s0).hashes == {b"x"}
            # a gap line (the server's buffer overflowed for this reader) drops it too
            streams.feed(s0, control_line("gap", "e2", 1))
            await until(lambda: not indexes.find(s0).synced)
            # a member that leaves loses its subscriber and its index; an unhealthy one too
            ctx.remove(ctx.servers[0], "test")
            ctx.servers[0].mark_unhealthy("test")
            await until(lambda: feeds.subscribed() == ["http://g0"])
            assert indexes.find(s0) is None and indexes.find("http://s1") is None
        finally:
            await feeds.stop(timeout_s=2)
        assert feeds.subscribed() == [] and len(feeds._tasks) == 0

    asyncio.run(main())
