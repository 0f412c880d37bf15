"""TP-mismatch formatter: re-slicing KV heads reconstructs every rank's blocks exactly."""

import pytest
import torch

from kv_transfer.formatter import HEADS_AXIS, HeadSlice, assemble, head_range, pull_plan, reformat, split_heads

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


def test_uneven_split_like_smollm2():
    """SmolLM2 has 3 KV heads: TP=2 ranks hold 1 + 2 (the engine's partition); the plan follows it."""
    full = torch.arange(2 * 1 * 2 * 1 * 3 * 1, dtype=torch.float32).reshape(2, 1, 2, 1, 3, 1)
    ranks = [assemble({0: full}, pull_plan(3, 1, 2, g)) for g in range(2)]
    assert sum(r.shape[HEADS_AXIS] for r in ranks) == 3
    assert torch.equal(torch.cat(ranks, dim=HEADS_AXIS), full)
    # ... and back: ctx TP=2 (uneven) -> gen TP=1 reconstructs every head in order.
    assert torch.equal(assemble(dict(enumerate(ranks)), pull_plan(3, 2, 1, 0)), full)


def test_more_ranks_than_heads_are_refused():
    with pytest.raises(ValueError, match="cannot be split"):
        pull_plan(2, 1, 3, 0)
