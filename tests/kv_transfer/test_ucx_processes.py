"""UCX between two processes on loopback (cma zero-copy), and backend selection."""

import multiprocessing as mp
import time

import pytest
import torch

from kv_transfer.factory import make_kv_client, resolve_backend
from kv_transfer.wire import KVTransferError

from .conftest import HAVE_UCXX, CtxSide, cache, layout

pytestmark = pytest.mark.skipif(not HAVE_UCXX, reason="ucxx is not installed (pip install ucxx-cu12): UCX backend untested")

SRC_IDS = [4, 5, 6, 1]


def source_cache() -> torch.Tensor:
    return torch.randn(8, *cache().shape[1:], generator=torch.Generator().manual_seed(7))


def serve_one_lease(to_parent, from_parent) -> None:
    """Child: park one lease, publish the endpoint, report what was freed when told to stop."""
    side = CtxSide("ucx", source_cache(), layout())
    side.leases.park("r", SRC_IDS, 16, ttl_s=30)
    to_parent.put(side.server.endpoint)
    from_parent.get(timeout=30)
    # The client's "done" (release: true) is one-way: the pull returns before this side has
    # handled it, so wait (bounded) for the release rather than reading the list at once.
    deadline = time.monotonic() + 10
    while not side.freed and time.monotonic() < deadline:
        time.sleep(0.01)
    to_parent.put(list(side.freed))
    side.stop()


def test_auto_resolves_to_ucx_when_ucxx_imports():
    assert resolve_backend("auto") == "ucx"
    assert resolve_backend("tcp") == "tcp"


def test_pull_between_processes_then_peer_dies():
    spawn = mp.get_context("spawn")
    to_parent, from_parent = spawn.Queue(), spawn.Queue()
    child = spawn.Process(target=serve_one_lease, args=(to_parent, from_parent), daemon=True)
    child.start()
    client = make_kv_client("ucx", layout())
    try:
        endpoint = to_parent.get(timeout=30)
        dst = cache()
        n = client.pull(endpoint, "r", layout(), dst, [0, 1, 2, 9], timeout_s=10)
        assert n == dst[0].numel() * 4 * 4
        assert torch.equal(dst[[0, 1, 2, 9]], source_cache()[SRC_IDS])
        from_parent.put("stop")
        assert to_parent.get(timeout=30) == [("r", "released")]
        child.join(10)
        assert child.exitcode == 0
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="failed"):
            client.pull(endpoint, "r", layout(), cache(), [0], timeout_s=1.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        client.stop()
        if child.is_alive():
            child.kill()
