"""Pulls into and out of KV caches that are not plain contiguous tensors: a slice with a storage
offset, every other block of a bigger tensor (block stride of two blocks), a head slice (a block
is not contiguous), a layer-major tensor seen block-major; in float32, bfloat16 and float16;
scattered block ids, partial pulls (``src_first`` > 0) and one segment per block.

The UCX backend is pulled twice by a fresh client: the first pull asks over UCX, the second over
the ctx server's same-host control socket, and both read the bytes with ``process_vm_readv`` by
address arithmetic; a wrong address would land the bytes in another block of the *parent* tensor,
so every check compares the whole parent (nothing outside the pulled blocks may change).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kv_transfer.factory import make_kv_client

from .conftest import BS, DIM, HEADS, LAYERS, CtxSide, layout, needs_ucx

N = 16  # blocks in every cache seen by a transceiver
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
KINDS = ["contiguous", "offset", "block-stride", "head-slice", "layer-major"]
# (lease block ids, src_first, destination ids): scattered runs, then one segment per block
PLANS = {
    "scattered": ([7, 8, 9, 2, 3, 12, 0, 5, 6], 2, [1, 2, 3, 10, 11, 4, 15]),
    "per-block": (list(range(N - 1, -1, -1)), 1, list(range(N - 1))),
}
_seeds = itertools.count(1)


def parent_and_view(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, callable]:
    """A random parent tensor and ``view(parent)``: the ``[N, layers, 2, bs, heads, dim]`` cache of
    ``kind`` inside it (the same function applied to a copy of the parent gives the same view)."""
    g = torch.Generator().manual_seed(next(_seeds))
    block = (LAYERS, 2, BS, HEADS, DIM)
    shapes = {"contiguous": (N, *block), "offset": (N + 5, *block), "block-stride": (2 * N, *block),
              "head-slice": (N, LAYERS, 2, BS, 2 * HEADS + 1, DIM), "layer-major": (LAYERS, N, 2, BS, HEADS, DIM)}
    views = {"contiguous": lambda t: t, "offset": lambda t: t[3:3 + N], "block-stride": lambda t: t[::2],
             "head-slice": lambda t: t[..., 1:1 + HEADS, :], "layer-major": lambda t: t.transpose(0, 1)}
    parent = torch.randn(shapes[kind], generator=g).to(dtype)
    view = views[kind]
    assert view(parent).shape == (N, *block)
    assert view(parent).is_contiguous() == (kind in ("contiguous", "offset"))
    return parent, view


def check_pull(client, side: CtxSide, src: torch.Tensor, dst_parent: torch.Tensor, dst_view, rid: str,
               plan: str, lay) -> None:
    lease, first, dst_ids = PLANS[plan]
    side.leases.park(rid, lease, len(lease) * BS, ttl_s=30)
    expected = dst_parent.clone()
    dst_view(expected)[dst_ids] = src[lease[first:first + len(dst_ids)]]
    n = client.pull(side.server.endpoint, rid, lay, dst_view(dst_parent), dst_ids, timeout_s=5, src_first=first)
    assert n == len(dst_ids) * src[0].numel() * src.element_size()
    assert torch.equal(dst_parent, expected), f"{rid}: wrong bytes, or bytes outside the pulled blocks changed"


@pytest.fixture(scope="module")
def ctx_sides():
    """One UCX ctx side per dtype, serving a plain contiguous cache (the engine's kind)."""
    sides = {}
    yield lambda dtype: sides.get(dtype) or sides.setdefault(
        dtype, CtxSide("ucx", parent_and_view("contiguous", dtype)[0], layout(dtype=DTYPES[dtype])))
    for side in sides.values():
        side.stop()


@needs_ucx
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES.values()))
@pytest.mark.parametrize("kind", KINDS)
def test_same_host_pulls_land_in_destination_views(ctx_sides, kind, dtype):
    """The gen side's cache is a view: each segment lands in place or through a staging copy."""
    side = ctx_sides(dtype)
    lay = layout(dtype=DTYPES[dtype])
    client = make_kv_client("ucx", lay)
    try:
        for i, plan in enumerate(PLANS):
            parent, view = parent_and_view(kind, dtype)
            check_pull(client, side, side.server.kv_cache, parent, view, f"dst-{kind}-{dtype}-{i}", plan, lay)
        assert (client.same_host_reads, client.local_control_pulls) == (2, 1)  # UCX, then the control socket
    finally:
        client.stop()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_pulls_out_of_source_views(backend, kind, dtype):
    """The ctx side's cache is a view. UCX: a cache whose blocks do not sit one block apart in
    memory cannot be read by address arithmetic, so its bytes come as messages instead."""
    src_parent, src_view = parent_and_view(kind, dtype)
    src = src_view(src_parent)
    lay = layout(dtype=DTYPES[dtype])
    side = CtxSide(backend, src, lay)
    client = make_kv_client(backend, lay)
    try:
        for i, plan in enumerate(PLANS):
            parent, view = parent_and_view("block-stride", dtype)
            check_pull(client, side, src, parent, view, f"src-{kind}-{i}", plan, lay)
        if backend == "ucx":
            readable = src.is_contiguous()
            assert client.same_host_reads == (2 if readable else 0)
            assert client.local_control_pulls == (1 if readable else 0)
    finally:
        client.stop()
        side.stop()
