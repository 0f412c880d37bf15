"""generation_only ``disaggregated_params``: the ctx state a gen server trusts must be consistent."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.protocol import DisaggregatedParams

LAYOUT = {"model": "m", "num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "block_size": 16,
          "dtype": "float32", "tp_rank": 0, "tp_size": 1}


def params(**over) -> dict:
    """A consistent generation_only body part: 20 prompt tokens (2 blocks of 16)."""
    return {"request_type": "generation_only", "ctx_request_id": "c1", "first_gen_tokens": [5],
            "prompt_token_ids": list(range(20)), "kv_endpoint": "tcp://127.0.0.1:1", "kv_layout": LAYOUT,
            "kv_block_count": 2, **over}


@pytest.mark.parametrize("cached", [0, 16, 20])
def test_cached_tokens_up_to_the_prompt_length_pass(cached):
    assert DisaggregatedParams.model_validate(params(cached_tokens=cached)).cached_tokens == cached


@pytest.mark.parametrize("cached", [21, 10**9])
def test_more_cached_tokens_than_prompt_tokens_is_refused(cached):
    """A gen server reports cached_tokens in usage: more than the prompt has is a bad body."""
    with pytest.raises(ValidationError, match="cached_tokens"):
        DisaggregatedParams.model_validate(params(cached_tokens=cached))


def test_more_blocks_than_the_prompt_fills_is_refused():
    with pytest.raises(ValidationError, match="kv_block_count 3"):
        DisaggregatedParams.model_validate(params(kv_block_count=3))


def test_a_moved_request_may_name_blocks_past_the_prompt():
    """kv_num_tokens (a request moved off a draining gen server): the lease holds prompt + outputs
    but the last, so its block count and hashes are bounded by those tokens, not the prompt's."""
    moved = params(first_gen_tokens=list(range(20)), kv_num_tokens=39, kv_block_count=3,
                   kv_block_hashes=["00" * 16] * 2)
    assert DisaggregatedParams.model_validate(moved).kv_num_tokens == 39
    with pytest.raises(ValidationError, match="kv_block_count 4"):
        DisaggregatedParams.model_validate({**moved, "kv_block_count": 4})


@pytest.mark.parametrize("kv", [19, 40])  # below the prompt; past prompt + first_gen_tokens - 1
def test_kv_num_tokens_outside_the_moved_tokens_is_refused(kv):
    with pytest.raises(ValidationError, match="kv_num_tokens"):
        DisaggregatedParams.model_validate(params(first_gen_tokens=list(range(20)), kv_num_tokens=kv))
