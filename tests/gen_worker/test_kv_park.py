"""gen_worker.kv_park: the leases of a draining gen server's moved requests. n > 1: each moved
choice has its own lease (``"<id>-c<i>"``), and an abort of the request frees all of them."""

from __future__ import annotations

import torch

from engine.request import MovedKV, RequestOutput
from executor.kv_role import RankShards
from gen_worker.kv_park import KVParking
from kv_transfer.layout import KVLayout
from pdserve.config import KVTransferSettings

LAYOUT = KVLayout(model="m", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32")
PROMPT = [1, 2, 3, 4, 5, 6]


def moved_output(choice: int | None, blocks: list[int], outputs: list[int]) -> RequestOutput:
    tokens = PROMPT + outputs
    moved = MovedKV(tokens, len(PROMPT), len(tokens) - 1, [], "r", choice)
    return RequestOutput("r", [], "", choice in (None, 1), "moved", len(PROMPT), len(outputs),
                         parked_block_ids=blocks, index=choice or 0, moved=moved)


def test_each_moved_choice_gets_its_own_lease_and_an_abort_frees_them_all():
    freed: list[str] = []
    parking = KVParking(KVTransferSettings(), "127.0.0.1", 0, freed.append)
    shards = RankShards([torch.zeros(8, 1, 2, 4, 1, 8)], [LAYOUT])
    try:
        p0 = parking.park(moved_output(0, [0, 1, 2], [7, 8]), shards)  # block 0: the shared prompt block
        p1 = parking.park(moved_output(1, [0, 3, 4], [9, 10]), shards)
        assert (p0.ctx_request_id, p0.choice_index, p0.first_gen_tokens) == ("r-c0", 0, [7, 8])
        assert (p1.ctx_request_id, p1.choice_index, p1.kv_num_tokens) == ("r-c1", 1, 7)
        assert parking.stats()["moved_leases"] == 2 and parking.stats()["requests_moved"] == 2
        assert parking.release("r") and sorted(freed) == ["r-c0", "r-c1"]  # the request's abort
        assert parking.stats()["moved_leases"] == 0 and not parking.release("r")
    finally:
        parking.stop()


def test_an_n1_moved_request_keeps_its_id_as_the_lease():
    freed: list[str] = []
    parking = KVParking(KVTransferSettings(), "127.0.0.1", 0, freed.append)
    try:
        p = parking.park(moved_output(None, [5, 6], [7]), RankShards([torch.zeros(8, 1, 2, 4, 1, 8)], [LAYOUT]))
        assert p.ctx_request_id == "r" and p.choice_index is None
        assert parking.release("r") and freed == ["r"]
    finally:
        parking.stop()
