"""Both transceivers (tcp, ucx): bytes land in the right blocks, layouts are checked, failures are explicit."""

import time

import pytest
import torch

from kv_transfer.layout import KVLayoutMismatch, bytes_per_block
from kv_transfer.wire import KVTransferError

from .conftest import CtxSide, cache, layout


def test_pull_copies_blocks_in_order_and_releases(ctx_side, client_factory):
    ctx_side.leases.park("r1", [5, 2, 9], 10, ttl_s=30)
    dst = cache()
    n = client_factory().pull(ctx_side.server.endpoint, "r1", layout(), dst, [0, 7, 3], timeout_s=5)
    for s, d in zip([5, 2, 9], [0, 7, 3]):
        assert torch.equal(dst[d], ctx_side.server.kv_cache[s])
    assert dst[1].abs().sum() == 0
    # The ctx side accounts for the send and applies the release once its own sends complete, which
    # may be a moment after the gen side has its bytes (the release then waits for the pin to drop).
    deadline = time.monotonic() + 2
    while (not ctx_side.sent or not ctx_side.freed) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert n == 3 * bytes_per_block(layout()) == ctx_side.sent[0]
    assert ctx_side.freed == [("r1", "released")]


def test_contiguous_runs_and_partial_pull(ctx_side, client_factory):
    """Runs on both sides (coalesced into few messages for ucx); only the first blocks of a lease."""
    ctx_side.leases.park("r", [3, 4, 5, 6, 10, 11], 24, ttl_s=30)
    dst = cache()
    client_factory().pull(ctx_side.server.endpoint, "r", layout(), dst, [8, 9, 1, 2, 3], timeout_s=5)
    assert torch.equal(dst[8:10], ctx_side.server.kv_cache[3:5])
    assert torch.equal(dst[1:4], ctx_side.server.kv_cache[[5, 6, 10]])
    assert dst[0].abs().sum() == 0 and dst[4:8].abs().sum() == 0


def test_bfloat16_blocks(backend, client_factory):
    src = torch.randn(4, *cache().shape[1:]).to(torch.bfloat16)
    side = CtxSide(backend, src, layout(dtype="bfloat16"))
    try:
        side.leases.park("r", [1, 3], 5, 30)
        dst = torch.zeros_like(src)
        client_factory(layout(dtype="bfloat16")).pull(side.server.endpoint, "r", layout(dtype="bfloat16"), dst, [0, 2], 5)
        assert torch.equal(dst[0], src[1]) and torch.equal(dst[2], src[3])
    finally:
        side.stop()


def test_layout_mismatch_is_refused_with_both_values(ctx_side, client_factory):
    ctx_side.leases.park("r1", [1], 3, 30)
    with pytest.raises(KVLayoutMismatch, match="block_size gen=8 ctx=4"):
        client_factory(layout(block_size=8)).pull(ctx_side.server.endpoint, "r1", layout(), cache(), [0], 5)


def test_ctx_side_checks_layout_too(ctx_side, client_factory):
    """A gen side that lies about the remote layout is still refused by the ctx side."""
    ctx_side.leases.park("r1", [1], 3, 30)
    with pytest.raises(KVTransferError, match="KV layout mismatch: head_dim gen=16 ctx=8"):
        client_factory(layout(head_dim=16)).pull(ctx_side.server.endpoint, "r1", layout(head_dim=16), cache(), [0], 5)
    assert ctx_side.freed == []  # the lease stays parked for a correct puller


def test_unknown_lease_is_refused(ctx_side, client_factory):
    with pytest.raises(KVTransferError, match="no KV lease"):
        client_factory().pull(ctx_side.server.endpoint, "missing", layout(), cache(), [0], 5)


def test_unreachable_peer_fails_within_timeout(backend, client_factory):
    """tcp: nothing listens; ucx: a stopped server's worker never answers."""
    if backend == "tcp":
        endpoint = "tcp://127.0.0.1:1"
    else:
        side = CtxSide(backend, cache(), layout())
        side.leases.park("r", [0], 1, 30)
        endpoint = side.server.endpoint
        side.stop()
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="failed"):
        client_factory().pull(endpoint, "r", layout(), cache(), [0], 1.0)
    assert time.monotonic() - t0 < 2.5


def test_malformed_endpoint(backend, client_factory):
    other = "ucx://abc" if backend == "tcp" else "tcp://127.0.0.1:5"
    with pytest.raises(KVTransferError, match="unsupported KV endpoint"):
        client_factory().pull(other, "r", layout(), cache(), [0], 2)


def test_endpoint_cached_and_replaced_when_peer_restarts(backend, client_factory):
    """Same peer name (host:port), new server object: the client drops the old endpoint for the new one."""
    client = client_factory()
    for generation in range(2):
        src = torch.randn(8, *cache().shape[1:])
        side = CtxSide(backend, src, layout(), port=47001)
        try:
            for i in range(2):
                side.leases.park(f"r{i}", [i, 5], 8, 30)
                dst = cache()
                client.pull(side.server.endpoint, f"r{i}", layout(), dst, [1, 2], 5)
                assert torch.equal(dst[1:3], src[[i, 5]])
        finally:
            side.stop()
        if backend == "ucx":
            assert (client.connects, client.cached_endpoints) == (generation + 1, 1)


def test_multi_piece_pull_then_one_release(ctx_side, client_factory):
    """Tensor-parallel style: several pulls of one lease with release=False, then one release."""
    ctx_side.leases.park("r", [1, 2, 3], 12, ttl_s=30)
    client = client_factory()
    a, b = cache(), cache()
    client.pull(ctx_side.server.endpoint, "r", layout(), a, [0, 1, 2], 5, release=False)
    client.pull(ctx_side.server.endpoint, "r", layout(), b, [4, 5], 5, release=False)
    assert ctx_side.freed == []
    client.release(ctx_side.server.endpoint, "r", 5)
    # ucx: the pieces' "done"s are fire-and-forget; a release that overtakes the last one is applied
    # when that pin ends, a moment after the release's answer
    deadline = time.monotonic() + 2
    while not ctx_side.freed and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ctx_side.freed == [("r", "released")]
    assert torch.equal(a[0:3], ctx_side.server.kv_cache[1:4]) and torch.equal(b[4:6], ctx_side.server.kv_cache[1:3])


def test_release_of_a_vanished_lease_fails_the_pull(ctx_side, client_factory):
    """A lease that expired between the pieces of a pull must not pass for a good one."""
    ctx_side.leases.park("r", [1], 4, ttl_s=30)
    client = client_factory()
    client.pull(ctx_side.server.endpoint, "r", layout(), cache(), [0], 5, release=False)
    ctx_side.leases.release("r")  # e.g. expired meanwhile
    with pytest.raises(KVTransferError, match="gone when released"):
        client.release(ctx_side.server.endpoint, "r", 5)


def test_a_partial_pull_copies_the_lease_blocks_from_src_first_on(ctx_side, client_factory):
    """Partial pulls (the gen side's prefix cache held the first blocks): only lease blocks
    src_first.. are copied, and asking past the lease's end is refused."""
    ctx_side.leases.park("r", [5, 2, 9, 11], 16, ttl_s=30)
    client = client_factory()
    with pytest.raises(KVTransferError, match="from block 3"):
        client.pull(ctx_side.server.endpoint, "r", layout(), cache(), [0, 1], timeout_s=5, release=False, src_first=3)
    dst = cache()
    n = client.pull(ctx_side.server.endpoint, "r", layout(), dst, [6, 7], timeout_s=5, src_first=2)
    assert n == 2 * bytes_per_block(layout())
    assert torch.equal(dst[6], ctx_side.server.kv_cache[9]) and torch.equal(dst[7], ctx_side.server.kv_cache[11])
    assert dst[:6].abs().sum() == 0 and dst[8:].abs().sum() == 0
