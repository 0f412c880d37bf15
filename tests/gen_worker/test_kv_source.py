"""When a generation_only request's pull may start: at once (context_first), or once both its blocks
and its ctx source are there, in either order (generation_first)."""

from __future__ import annotations

import pytest

from engine.request import KVPull
from gen_worker.kv_source import KVSources
from pdserve.protocol import DisaggregatedParams

LAYOUT = {"model": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 4, "dtype": "float32"}
SOURCE = DisaggregatedParams(request_type="generation_only", disagg_request_id="d", ctx_request_id="ctx-1",
                             first_gen_tokens=[5], prompt_token_ids=[1, 2, 3], kv_endpoint="tcp://127.0.0.1:1",
                             kv_layout=LAYOUT)
AWAITS = DisaggregatedParams(request_type="generation_only", disagg_request_id="d", ctx_url="http://127.0.0.1:9")
PULL = KVPull("r", [0], 3)


def test_awaiting_form_validates_and_says_so():
    assert AWAITS.awaits_ctx and not SOURCE.awaits_ctx
    with pytest.raises(ValueError, match="disagg_request_id"):
        DisaggregatedParams(request_type="generation_only", ctx_url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="ctx_request_id"):  # neither the ctx state nor a ctx to wait on
        DisaggregatedParams(request_type="generation_only", disagg_request_id="d")


def test_context_first_pull_starts_when_allocated():
    s = KVSources()
    s.submitted("r", SOURCE)
    assert s.allocated(PULL) == (PULL, SOURCE) and len(s) == 0


def test_generation_first_allocated_first_is_held_until_the_source():
    s = KVSources()
    s.submitted("r", AWAITS)
    assert s.allocated(PULL) is None
    assert s.source_ready("r", SOURCE) == (PULL, SOURCE) and len(s) == 0


def test_generation_first_source_first_is_kept_until_allocated():
    s = KVSources()
    s.submitted("r", AWAITS)
    assert s.source_ready("r", SOURCE) is None
    assert s.allocated(PULL) == (PULL, SOURCE)


def test_forgotten_and_unknown_requests():
    s = KVSources()
    s.submitted("r", AWAITS)
    s.forget("r")  # aborted while waiting
    assert s.source_ready("r", SOURCE) is None and len(s) == 0
    with pytest.raises(KeyError):
        s.allocated(PULL)
