"""KV events between rank 0's engine loop and a frontend's ``GET /kv_events`` stream, on both
transports (queue and zmq lanes): batches arrive in order, a snapshot follows every batch it covers,
the stream opens with the snapshot, sends heartbeats while idle, and ends with a gap for a reader
that fell behind the frontend's bounded buffer."""

from __future__ import annotations

import asyncio

import pytest

from executor.kv_event_hub import FellBehind, KVEventHub
from executor.kv_event_routes import event_lines
from pdserve.kv_events import AllBlocksCleared, KVEventBatch, KVSnapshot, parse_line
from tests.executor.fake_engine import Harness

TRANSPORTS = ["queue", "lanes"]


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def run(kind: str, scenario) -> None:
    async def main():
        async with Harness(kind) as harness:
            await asyncio.wait_for(scenario(harness), 20)

    asyncio.run(main())


def store(harness: Harness, *ids: int) -> None:
    """Record stored blocks on the engine-loop thread (as the block manager does during a step)."""
    def record(engine):
        for i in ids:
            engine.kv_events.stored(h(i), None)
            engine.held_hashes.append(h(i))
    harness.role.ops.post(record)


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_batches_reach_the_frontend_in_order_and_the_snapshot_covers_them(kind):
    async def scenario(harness):
        hub = harness.client.kv_events
        for i in range(5):
            store(harness, i)
        await until(lambda: len(hub.read_after("fake-epoch", 0)) >= 1 and
                    sum(b.num_events for b in hub.read_after("fake-epoch", 0)) == 5)
        batches = hub.read_after("fake-epoch", 0)
        assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
        snap = await harness.client.kv_snapshot()
        assert set(snap.hashes) == {h(i) for i in range(5)} and snap.seq == batches[-1].seq
        stats = harness.client.stats()  # exported in /metrics as pdserve_kv_events_dropped_batches_total
        assert stats["kv_events_dropped_batches"] == 0 and stats["kv_events_buffered_batches"] == len(batches)

    run(kind, scenario)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_events_pending_at_a_snapshot_are_pushed_before_its_reply(kind):
    async def scenario(harness):
        hub = harness.client.kv_events
        store(harness, 1)
        await until(lambda: bool(hub.read_after("fake-epoch", 0)))
        for _ in range(20):  # a reset and a snapshot applied in the same iteration: the cleared event
            freed, snap = await asyncio.gather(harness.client.reset_prefix_cache(), harness.client.kv_snapshot())
            # ... is in a batch at or below the snapshot's seq, which reached the hub before the reply
            assert snap.hashes == () and hub.read_after("fake-epoch", 0)[-1].seq >= snap.seq
            seen = [b for b in hub.read_after("fake-epoch", 0) if b.seq <= snap.seq]
            assert isinstance(seen[-1].events[-1], AllBlocksCleared)

    run(kind, scenario)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_the_stream_opens_with_the_snapshot_then_batches_then_heartbeats(kind):
    async def scenario(harness):
        store(harness, 1)
        await until(lambda: bool(harness.client.kv_events.read_after("fake-epoch", 0)))
        snap = await harness.client.kv_snapshot()
        lines = event_lines(harness.client, harness.client.kv_events, snap, heartbeat_s=0.1)
        first = parse_line(await lines.__anext__())
        assert isinstance(first, KVSnapshot) and first.hashes == (h(1),)
        store(harness, 2)
        second = parse_line(await lines.__anext__())
        assert isinstance(second, KVEventBatch) and second.seq == first.seq + 1
        assert second.events[0].hashes == (h(2),)
        assert parse_line(await lines.__anext__()) == ("heartbeat", "fake-epoch", second.seq)
        harness.client.kv_events.close()  # the server stops: the stream ends
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(lines.__anext__(), 2)

    run(kind, scenario)


def test_the_hub_is_bounded_and_a_reader_behind_it_gets_a_gap():
    hub = KVEventHub(max_events=10)
    for seq in range(1, 31):
        hub.publish(KVEventBatch("e", seq, ()))  # empty batches count nothing: bounded by events below
    for seq in range(31, 61):
        hub.publish(KVEventBatch("e", seq, (object(),) * 1))  # type: ignore[arg-type]
    assert [b.seq for b in hub.read_after("e", 50)] == list(range(51, 61))  # the newest 10 events
    assert hub.dropped_batches >= 40
    with pytest.raises(FellBehind):
        hub.read_after("e", 5)
    with pytest.raises(FellBehind):
        hub.read_after("another-epoch", 59)  # the server restarted under this reader
    assert [b.seq for b in hub.read_after("e", 58)] == [59, 60]


def test_a_slow_stream_ends_with_a_gap_line():
    async def main():
        hub = KVEventHub(max_events=3)

        class Client:
            state = None

        lines = event_lines(Client(), hub, KVSnapshot("e", 0, ()), heartbeat_s=0.05)
        assert isinstance(parse_line(await lines.__anext__()), KVSnapshot)
        for seq in range(1, 8):  # the reader does not read meanwhile: batch 1 falls off
            hub.publish(KVEventBatch("e", seq, (object(),)))  # type: ignore[arg-type]
        kind, epoch, seq = parse_line(await lines.__anext__())
        assert (kind, seq) == ("gap", 0)

    asyncio.run(main())
