"""pdbench metric arithmetic on a recorded synthetic trace: known timestamps → known numbers."""

from __future__ import annotations

import math

import pytest

from pdbench.datasets import WorkloadSpec, make_workload
from pdbench.metrics import RequestRecord, compute_metrics, parse_goodput, percentile
from pdbench.runner import arrival_gaps

# Three requests over a 2.0 s run (times in seconds on one clock).
TRACE = [
    # sent 0.0, chunks at 0.1 0.2 0.3 0.5: TTFT 100 ms, E2EL 500 ms, 4 tokens -> TPOT 400/3 ms, ITL 100 100 200
    RequestRecord(ok=True, start=0.0, chunk_times=[0.1, 0.2, 0.3, 0.5], prompt_tokens=10, output_tokens=4),
    # sent 0.5, 2 chunks carrying 5 tokens (0.9, 1.3): TTFT 400, E2EL 800, TPOT 400/4 = 100, ITL 400
    RequestRecord(ok=True, start=0.5, chunk_times=[0.9, 1.3], prompt_tokens=20, output_tokens=5),
    # sent 1.0, one token at 1.05: TTFT 50, E2EL 50, no TPOT (0 for goodput), no ITL
    RequestRecord(ok=True, start=1.0, chunk_times=[1.05], prompt_tokens=30, output_tokens=1),
    RequestRecord(ok=False, start=1.5, error="HTTP 503: busy", prompt_tokens=40),
]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def test_per_request_definitions():
    r = TRACE[0]
    assert close(r.ttft, 0.1) and close(r.e2el, 0.5) and close(r.tpot, 0.4 / 3)
    assert all(close(a, b) for a, b in zip(r.itl, [0.1, 0.1, 0.2]))
    assert TRACE[2].tpot is None


def test_aggregates_on_trace():
    m = compute_metrics(TRACE, duration_s=2.0, slos={"ttft": 200.0, "tpot": 150.0})
    assert (m.num_requests, m.completed, m.failed) == (4, 3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 10)  # failed request not counted
    assert close(m.request_throughput, 1.5) and close(m.output_throughput, 5.0)
    assert close(m.total_token_throughput, 35.0)
    # TTFT ms: 100, 400, 50 -> mean 183.33, median 100, p99 = 100 + 0.98 * 300
    assert close(m.ttft_ms["mean"], 550 / 3) and close(m.ttft_ms["median"], 100.0)
    assert close(m.ttft_ms["p99"], 100 + 0.98 * 300) and close(m.ttft_ms["p90"], 100 + 0.8 * 300)
    # TPOT ms over the 2 multi-token requests: 133.33, 100
    assert close(m.tpot_ms["mean"], (400 / 3 + 100) / 2) and close(m.tpot_ms["median"], (400 / 3 + 100) / 2)
    # ITL ms pooled: 100 100 200 400
    assert close(m.itl_ms["mean"], 200.0) and close(m.itl_ms["median"], 150.0)
    assert close(m.e2el_ms["median"], 500.0)
    # Goodput: r0 TTFT 100 ok, TPOT 133 ok -> good; r1 TTFT 400 > 200 -> bad; r2 TTFT 50, TPOT 0 -> good
    assert m.good_requests == 2 and close(m.request_goodput, 1.0) and close(m.slo_attainment, 0.5)


def test_goodput_each_slo_alone():
    assert compute_metrics(TRACE, 2.0, {"tpot": 120.0}).good_requests == 2   # r1 (100) and r2 (0)
    assert compute_metrics(TRACE, 2.0, {"e2el": 600.0}).good_requests == 2   # r0 (500) and r2 (50)
    assert compute_metrics(TRACE, 2.0, {}).request_goodput is None


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for p in (0, 10, 50, 90, 99, 100):
        assert close(percentile(xs, p), float(np.percentile(xs, p)))
    assert math.isnan(percentile([], 50))


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "TPOT:50.5", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 2000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_arrivals_poisson_mean_and_inf():
    gaps = arrival_gaps(4000, 4.0, 1.0, seed=1)
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.02
    assert arrival_gaps(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert arrival_gaps(5, 2.0, 1.0, 7) == arrival_gaps(5, 2.0, 1.0, 7)


def test_workloads_lengths_and_seed():
    s = make_workload(WorkloadSpec(name="random", num_prompts=5, input_len=10, output_len=3))
    assert all(len(x.prompt) == 10 and x.prompt_len == 10 and x.output_len == 3 for x in s)
    r = make_workload(WorkloadSpec(name="random", num_prompts=50, input_len=100, output_len=10, range_ratio=0.5))
    assert all(50 <= x.prompt_len <= 150 and len(x.prompt) == x.prompt_len for x in r)
    p = make_workload(WorkloadSpec(name="prefix", num_prompts=4, input_len=5, prefix_len=20, num_prefixes=2))
    assert p[0].prompt[:20] == p[2].prompt[:20] != p[1].prompt[:20] and len(p[0].prompt) == 25
    m = make_workload(WorkloadSpec(name="mixed", num_prompts=8, long_fraction=0.25, input_len=4, long_input_len=40))
    assert sorted(x.prompt_len for x in m) == [4] * 6 + [40] * 2
    g1 = make_workload(WorkloadSpec(name="sharegpt", num_prompts=200, input_len=100, output_len=50, seed=3))
    g2 = make_workload(WorkloadSpec(name="sharegpt", num_prompts=200, input_len=100, output_len=50, seed=3))
    assert [x.prompt for x in g1] == [x.prompt for x in g2]
    ins = sorted(x.prompt_len for x in g1)
    assert 70 < ins[100] < 140 and max(ins) <= 1024
    t = make_workload(WorkloadSpec(name="random", num_prompts=2, input_len=7, prompt_format="text"))
    assert isinstance(t[0].prompt, str) and len(t[0].prompt.split()) == 7
