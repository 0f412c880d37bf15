"""TCP transceiver: bytes land in the right blocks, layouts are checked, failures are explicit."""

import pytest
import torch

from kv_transfer.layout import KVLayout, KVLayoutMismatch, bytes_per_block
from kv_transfer.lease import LeaseTable
from kv_transfer.tcp_backend import TcpKVClient, TcpKVServer
from kv_transfer.wire import KVTransferError

LAYERS, HEADS, DIM, BS = 3, 2, 8, 4


def layout(**kw) -> KVLayout:
    base = dict(model="m", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_size=BS, dtype="float32")
    base.update(kw)
    return KVLayout(**base)


def cache(num_blocks=16, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(num_blocks, LAYERS, 2, BS, HEADS, DIM, dtype=dtype)


@pytest.fixture
def ctx_side():
    freed = []
    leases = LeaseTable(lambda rid, reason: freed.append((rid, reason)))
    leases.start()
    src = cache()
    src.copy_(torch.randn_like(src))
    server = TcpKVServer(src, layout(), leases, "127.0.0.1", 0, timeout_s=5)
    server.start()
    yield server, leases, freed
    server.stop()
    leases.stop()


def test_pull_copies_blocks_in_order_and_releases(ctx_side):
    server, leases, freed = ctx_side
    leases.park("r1", [5, 2, 9], 10, ttl_s=30)
    dst = cache()
    n = TcpKVClient(layout()).pull(server.endpoint, "r1", layout(), dst, [0, 7, 3], timeout_s=5)
    assert n == 3 * bytes_per_block(layout())
    for s, d in zip([5, 2, 9], [0, 7, 3]):
        assert torch.equal(dst[d], server.kv_cache[s])
    assert dst[1].abs().sum() == 0
    assert freed == [("r1", "released")]


def test_bfloat16_blocks():
    leases = LeaseTable(lambda rid, reason: None)
    leases.start()
    src = torch.randn(4, LAYERS, 2, BS, HEADS, DIM).to(torch.bfloat16)
    server = TcpKVServer(src, layout(dtype="bfloat16"), leases, "127.0.0.1", 0, timeout_s=5)
    server.start()
    try:
        leases.park("r", [1, 3], 5, 30)
        dst = torch.zeros_like(src)
        TcpKVClient(layout(dtype="bfloat16")).pull(server.endpoint, "r", layout(dtype="bfloat16"), dst, [0, 2], 5)
        assert torch.equal(dst[0], src[1]) and torch.equal(dst[2], src[3])
    finally:
        server.stop()
        leases.stop()


def test_layout_mismatch_is_refused_with_both_values(ctx_side):
    server, leases, _ = ctx_side
    leases.park("r1", [1], 3, 30)
    with pytest.raises(KVLayoutMismatch, match="block_size gen=8 ctx=4"):
        TcpKVClient(layout(block_size=8)).pull(server.endpoint, "r1", layout(), cache(), [0], 5)


def test_ctx_side_checks_layout_too(ctx_side):
    """A gen side that lies about the remote layout is still refused by the ctx side."""
    server, leases, _ = ctx_side
    leases.park("r1", [1], 3, 30)
    with pytest.raises(KVTransferError, match="KV layout mismatch: head_dim gen=16 ctx=8"):
        TcpKVClient(layout(head_dim=16)).pull(server.endpoint, "r1", layout(head_dim=16), cache(), [0], 5)


def test_unknown_lease_is_refused(ctx_side):
    server, _, _ = ctx_side
    with pytest.raises(KVTransferError, match="no KV lease"):
        TcpKVClient(layout()).pull(server.endpoint, "missing", layout(), cache(), [0], 5)


def test_unreachable_peer_fails_fast():
    with pytest.raises(KVTransferError, match="failed"):
        TcpKVClient(layout()).pull("tcp://127.0.0.1:1", "r", layout(), cache(), [0], 2)


def test_malformed_endpoint():
    with pytest.raises(KVTransferError, match="unsupported KV endpoint"):
        TcpKVClient(layout()).pull("ucx://abc", "r", layout(), cache(), [0], 2)
