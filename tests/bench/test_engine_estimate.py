"""bench/_engine_estimate.py: the run-time estimate bench/engine_throughput.py prints first."""

from __future__ import annotations

import sys

import pytest

from tests.integration.procs import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from _engine_estimate import SPEEDS, estimate_line, estimate_s, request_s, tpot_s  # noqa: E402
from engine_throughput import parse_args  # noqa: E402


def _estimate(argv: list[str]) -> float:
    a = parse_args(argv)
    return estimate_s(a.num_prompts, a.input_len, a.output_len, a.concs, a.repeats, not a.no_vllm, a.pair)


@pytest.mark.parametrize("engine,conc,tok_s", [("pdserve", 1, 17.5), ("pdserve", 8, 58.6),
                                                ("vllm", 1, 21.2), ("vllm", 8, 78.9)])
def test_the_request_model_reproduces_the_idle_table_it_comes_from(engine, conc, tok_s):
    """Issue 11's idle-machine output tok/s (128 words -> 64 tokens) within 15%."""
    modelled = conc * 64 / request_s(engine, conc, 128, 64)
    assert modelled == pytest.approx(tok_s, rel=0.15)


def test_tpot_is_linear_through_c1_and_c8():
    _, one, eight = SPEEDS["pdserve"]
    assert tpot_s("pdserve", 1) == one and tpot_s("pdserve", 8) == pytest.approx(eight)
    assert one < tpot_s("pdserve", 4) < eight


def test_quick_is_estimated_under_six_minutes_and_the_full_run_far_longer():
    quick, full = _estimate(["--quick"]), _estimate([])
    assert quick < 6 * 60
    assert full > 5 * quick
    assert _estimate(["--quick", "--pair"]) > quick > _estimate(["--quick", "--no-vllm"])
    assert _estimate(["--repeats", "4"]) > full


def test_the_line_names_the_options():
    line = estimate_line(parse_args(["--quick", "--no-vllm", "--concurrencies", "1,4"]))
    assert line.startswith("estimate: ~") and "pdserve," in line and "c1/c4 x 8 requests" in line
