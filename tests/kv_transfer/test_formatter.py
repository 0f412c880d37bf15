"""TP-mismatch formatter: re-slicing KV heads reconstructs every rank's blocks exactly."""

import pytest
import torch

from kv_transfer.formatter import HeadSlice, assemble, head_range, pull_plan, reformat, split_heads

H, D = 4, 8


def full_blocks(n=3, layers=2, bs=4) -> torch.Tensor:
    return torch.randn(n, layers, 2, bs, H, D).to(torch.bfloat16)


def shard(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return [split_heads(full, *head_range(H, r, tp)) for r in range(tp)]


@pytest.mark.parametrize("ctx_tp,gen_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (1, 4), (4, 1), (2, 2)])
def test_reformat_reconstructs_the_gen_shards(ctx_tp, gen_tp):
    full = full_blocks()
    got = reformat(shard(full, ctx_tp), gen_tp)
    want = shard(full, gen_tp)
    assert len(got) == gen_tp
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_ctx2_to_gen1_concatenates_heads():
    full = full_blocks()
    plan = pull_plan(H, ctx_tp=2, gen_tp=1, gen_rank=0)
    assert plan == [HeadSlice(0, 0, 2, 0, 2), HeadSlice(1, 0, 2, 2, 4)]
    out = torch.zeros_like(full)
    assemble(dict(enumerate(shard(full, 2))), plan, out=out)  # straight into preallocated blocks
    assert torch.equal(out, full)


def test_ctx1_to_gen2_splits_heads():
    full = full_blocks()
    assert pull_plan(H, 1, 2, 0) == [HeadSlice(0, 0, 2, 0, 2)]
    assert pull_plan(H, 1, 2, 1) == [HeadSlice(0, 2, 4, 0, 2)]
    rank1 = assemble({0: full}, pull_plan(H, 1, 2, 1))
    assert torch.equal(rank1, full[..., 2:4, :])


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="3 KV heads do not split over tp_size=2"):
        pull_plan(3, 1, 2, 0)
