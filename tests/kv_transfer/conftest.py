"""Shared fixtures: a ctx-side transceiver of either backend, serving a random cache."""

import importlib.util

import pytest
import torch

from kv_transfer.factory import make_kv_client, make_kv_server
from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable

LAYERS, HEADS, DIM, BS = 3, 2, 8, 4

HAVE_UCXX = importlib.util.find_spec("ucxx") is not None
needs_ucx = pytest.mark.skipif(not HAVE_UCXX, reason="ucxx is not installed (pip install ucxx-cu12): UCX backend untested")
BACKENDS = ["tcp", pytest.param("ucx", marks=needs_ucx)]


def layout(**kw) -> KVLayout:
    base = dict(model="m", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_size=BS, dtype="float32")
    base.update(kw)
    return KVLayout(**base)


def cache(num_blocks=16, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(num_blocks, LAYERS, 2, BS, HEADS, DIM, dtype=dtype)


class CtxSide:
    """A started lease table + transceiver; ``stop()`` tears both down."""

    def __init__(self, backend: str, src: torch.Tensor, lay: KVLayout, port: int = 0, timeout_s: float = 5):
        self.freed: list[tuple[str, str]] = []
        self.sent: list[int] = []
        self.leases = LeaseTable(lambda rid, reason: self.freed.append((rid, reason)))
        self.leases.start()
        self.server = make_kv_server(backend, src, lay, self.leases, "127.0.0.1", port, timeout_s,
                                     on_sent=lambda n, s: self.sent.append(n))
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        self.leases.stop()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def ctx_side(backend):
    src = cache()
    src.copy_(torch.randn_like(src))
    side = CtxSide(backend, src, layout())
    yield side
    side.stop()


@pytest.fixture
def client_factory(backend):
    made = []

    def make(lay: KVLayout | None = None):
        made.append(make_kv_client(backend, lay or layout()))
        return made[-1]

    yield make
    for c in made:
        c.stop()
