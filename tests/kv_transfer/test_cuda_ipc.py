"""The CUDA IPC KV backend's protocol and failure paths, on CPU with the CUDA calls mocked.

What truly needs a GPU (exporting a real cudaIpcMemHandle, opening it in another process, the
device-to-device copy and its speed) is run by bench/gpu_check.py on a GPU host; the one test here
that needs CUDA is skipped with that reason.
"""
from unittest import mock

import pytest
import torch

from kv_transfer import cuda_ipc_backend
from kv_transfer.cuda_ipc import CudaIpcError, export_handle, open_handle
from kv_transfer.cuda_ipc_backend import CudaIpcKVClient, CudaIpcKVServer
from kv_transfer.lease import LeaseTable
from kv_transfer.wire import KVTransferError

from .conftest import cache, layout

FAKE = {"fake": "handle"}


class IpcOnCpuClient(CudaIpcKVClient):
    """Takes the IPC path with CPU caches: the 'mapped' peer cache is the server's tensor itself."""

    @staticmethod
    def _uses_ipc(kv_cache):
        return True


@pytest.fixture
def ctx():
    src = cache()
    src.copy_(torch.randn_like(src))
    leases = LeaseTable(lambda rid, reason: None)
    leases.start()
    with mock.patch.object(cuda_ipc_backend, "export_handle", return_value=FAKE) as exported:
        server = CudaIpcKVServer(src, layout(), leases, "127.0.0.1", 0, 5.0)
        server.start()
        yield server, leases, exported
        server.stop()
    leases.stop()


def _client(server):
    opened = mock.Mock(side_effect=lambda desc: server.kv_cache)
    return IpcOnCpuClient(layout(), opener=opened), opened


def test_pull_copies_blocks_releases_and_opens_the_handle_once(ctx):
    server, leases, exported = ctx
    client, opened = _client(server)
    dst = cache()
    for rid, src_ids, dst_ids in (("a", [3, 4, 9], [0, 5, 1]), ("b", [7], [2])):
        leases.park(rid, src_ids, num_tokens=4 * len(src_ids), ttl_s=30)
        nbytes = client.pull(server.endpoint, rid, layout(), dst, dst_ids, timeout_s=5)
        assert nbytes == len(src_ids) * dst[0].nbytes
        assert torch.equal(dst[dst_ids], server.kv_cache[src_ids])
    assert opened.call_count == 1 and exported.call_count == 1  # mapped once per peer
    assert opened.call_args.args[0] == FAKE
    with pytest.raises(KVTransferError, match="refused"):  # released after the pull
        client.pull(server.endpoint, "a", layout(), dst, [0, 5, 1], timeout_s=5)


def test_peer_gone_is_a_clear_error_and_drops_the_mapping(ctx):
    server, leases, _ = ctx
    client, opened = _client(server)
    leases.park("a", [1], num_tokens=4, ttl_s=30)
    client.pull(server.endpoint, "a", layout(), cache(), [0], timeout_s=5)
    server.stop()
    with pytest.raises(KVTransferError, match="is the ctx server gone"):
        client.pull(server.endpoint, "b", layout(), cache(), [0], timeout_s=2)
    assert server.endpoint not in client._mapped


def test_a_restarted_peer_is_mapped_anew(ctx):
    server, leases, _ = ctx
    client, opened = _client(server)
    leases.park("a", [1], num_tokens=4, ttl_s=30)
    client.pull(server.endpoint, "a", layout(), cache(), [0], timeout_s=5)
    server.cache_id = "restarted"  # what a new ctx process on the same port has
    leases.park("b", [2], num_tokens=4, ttl_s=30)
    client.pull(server.endpoint, "b", layout(), cache(), [0], timeout_s=5)
    assert opened.call_count == 2


def test_other_host_and_unopenable_handle_are_refused(ctx):
    server, leases, _ = ctx
    leases.park("a", [1], num_tokens=4, ttl_s=30)
    client, _ = _client(server)
    with mock.patch.object(cuda_ipc_backend, "host_identity", side_effect=["other-host", "this-host", "this-host"]):
        with pytest.raises(KVTransferError, match="on this host"):
            client.pull(server.endpoint, "a", layout(), cache(), [0], timeout_s=5)
    broken = IpcOnCpuClient(layout(), opener=mock.Mock(side_effect=CudaIpcError("cannot open: exited")))
    with pytest.raises(KVTransferError, match="cannot open"):
        broken.pull(server.endpoint, "a", layout(), cache(), [0], timeout_s=5)
    assert leases.begin_pull("a") is not None  # a failed pull leaves the lease to its timer
    leases.end_pull("a")


def test_a_cpu_cache_pulls_over_tcp_from_the_same_server(ctx):
    server, leases, _ = ctx
    leases.park("a", [2, 3], num_tokens=8, ttl_s=30)
    dst = cache()
    CudaIpcKVClient(layout()).pull(server.endpoint, "a", layout(), dst, [4, 6], timeout_s=5)
    assert torch.equal(dst[[4, 6]], server.kv_cache[[2, 3]])


def test_handle_description_round_trip_and_errors():
    with pytest.raises(CudaIpcError, match="needs a CUDA tensor"):
        export_handle(torch.zeros(2))
    storage = torch.arange(24, dtype=torch.float32).untyped_storage()
    desc = {"share": [0, "aGFuZGxl", 96, 0, None, 0, None, False], "shape": [2, 3], "stride": [3, 1],
            "storage_offset": 6, "dtype": "float32"}
    opener = mock.Mock(return_value=storage)
    assert torch.equal(open_handle(desc, opener), torch.arange(6, 12, dtype=torch.float32).view(2, 3))
    assert opener.call_args.args[1] == b"handle"
    with pytest.raises(CudaIpcError, match="has it exited"):
        open_handle(desc, mock.Mock(side_effect=RuntimeError("cudaErrorInvalidValue")))
    with pytest.raises(CudaIpcError, match="malformed"):
        open_handle({"share": []}, opener)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: exports a real CUDA IPC handle")
def test_export_handle_of_a_cuda_cache():
    desc = export_handle(torch.zeros(4, 8, device="cuda"))
    assert desc["shape"] == [4, 8] and isinstance(desc["share"][1], str)
