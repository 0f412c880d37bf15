"""Serving metrics from per-request timestamps: pure arithmetic, no I/O (unit-tested on a recorded trace).

Definitions (the same as ``vllm bench serve``):

- **TTFT** (time to first token): first content chunk received − request sent.
- **ITL** (inter-token latency): the gaps between consecutive content chunks of one request, pooled
  over all requests (a chunk carrying several tokens is one gap).
- **E2EL** (end-to-end latency): last content chunk received − request sent.
- **TPOT** (time per output token): ``(E2EL − TTFT) / (output_tokens − 1)`` per request; requests
  with one output token have no TPOT in the TPOT statistics and count as TPOT 0 for goodput.
- **request / output / total throughput**: completed requests, output tokens, and prompt + output
  tokens of completed requests, each divided by the benchmark duration (first request sent → last
  request finished).
- **goodput**: completed requests that meet every given SLO (``ttft``, ``tpot``, ``e2el`` in ms),
  per second of benchmark duration. **SLO attainment** is that count over all requests sent
  (a failed request misses every SLO).
- **prefix-cache hit rate**: prompt tokens the server's prefix cache held
  (``usage.prompt_tokens_details.cached_tokens``, OpenAI's field) over prompt tokens, summed over
  completed requests (a server that does not report the field counts as 0 hits).
- Percentiles: linear interpolation between closest ranks (``numpy.percentile``'s default).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SLO_KEYS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds on one monotonic clock.

    ``chunk_times`` are the arrival times of the streamed chunks that carried generated text
    (for a non-streamed request: one entry, the answer's arrival). ``cached_tokens`` is the answer's
    ``usage.prompt_tokens_details.cached_tokens`` (0 when absent); ``text`` the generated text
    (what a multi-turn conversation sends back as the assistant's message).
    """

    ok: bool
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """``(E2EL − TTFT) / (out − 1)``; None for a single output token."""
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (ms). Raises ValueError."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        key, sep, value = spec.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad --goodput item {spec!r}: use KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput item {spec!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"bad --goodput item {spec!r}: the SLO must be a positive number of milliseconds")
        slos[key] = ms
    return slos


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolation percentile (``numpy.percentile`` default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize_ms(values_s: list[float], percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean/median/std/p<N> of a list of seconds, in milliseconds (NaN when empty)."""
    ms = [v * 1000.0 for v in values_s]
    if ms:
        mean = sum(ms) / len(ms)
        std = math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms))
    else:
        mean = std = math.nan
    out = {"mean": mean, "median": percentile(ms, 50.0), "std": std}
    for p in percentiles:
        out[f"p{p:g}"] = percentile(ms, p)
    return out


def hit_rate(cached_tokens: int, prompt_tokens: int) -> float:
    """Prefix-cache hit rate: cached prompt tokens / prompt tokens (NaN for no prompt tokens)."""
    return cached_tokens / prompt_tokens if prompt_tokens > 0 else math.nan


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (ms). TPOT of a one-token request is 0."""
    if not r.ok or not r.chunk_times:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    return all(values[k] * 1000.0 <= limit for k, limit in slos.items())


@dataclass
class BenchMetrics:
    """Aggregates of one benchmark run (latencies in ms)."""

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    prefix_hit_rate: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput_slos_ms: dict[str, float]
    good_requests: int | None
    request_goodput: float | None
    slo_attainment: float | None
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)


def compute_metrics(records: list[RequestRecord], duration_s: float, slos: dict[str, float] | None = None,
                    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> BenchMetrics:
    """Aggregate ``records`` of a run that lasted ``duration_s`` seconds.

    Raises:
        ValueError: ``duration_s`` is not positive.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.ok and r.chunk_times]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    itls = [g for r in done for g in r.itl]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    slos = dict(slos or {})
    good = sum(1 for r in done if meets_slos(r, slos)) if slos else None
    return BenchMetrics(
        num_requests=len(records), completed=len(done), failed=len(records) - len(done), duration_s=duration_s,
        total_input_tokens=in_tokens, total_output_tokens=out_tokens, total_cached_tokens=cached,
        prefix_hit_rate=hit_rate(cached, in_tokens),
        request_throughput=len(done) / duration_s, output_throughput=out_tokens / duration_s,
        total_token_throughput=(in_tokens + out_tokens) / duration_s,
        goodput_slos_ms=slos, good_requests=good,
        request_goodput=None if good is None else good / duration_s,
        slo_attainment=None if good is None or not records else good / len(records),
        ttft_ms=summarize_ms([r.ttft for r in done], percentiles),
        tpot_ms=summarize_ms(tpots, percentiles),
        itl_ms=summarize_ms(itls, percentiles),
        e2el_ms=summarize_ms([r.e2el for r in done], percentiles),
    )


def per_turn_summary(conversations: list[list[RequestRecord]],
                     percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> list[dict]:
    """One entry per turn (1-based ``turn``) of multi-turn records (``conversations[c][t]`` = turn
    ``t + 1`` of conversation ``c``): completed/failed counts, TTFT and E2EL summaries (ms), mean
    prompt and cached tokens and the prefix-cache hit rate of that turn over the completed requests."""
    num_turns = max((len(c) for c in conversations), default=0)
    turns = []
    for t in range(num_turns):
        recs = [c[t] for c in conversations if len(c) > t]
        done = [r for r in recs if r.ok and r.chunk_times]
        prompt = sum(r.prompt_tokens for r in done)
        cached = sum(r.cached_tokens for r in done)
        turns.append({
            "turn": t + 1, "completed": len(done), "failed": len(recs) - len(done),
            "mean_prompt_tokens": prompt / len(done) if done else math.nan,
            "mean_cached_tokens": cached / len(done) if done else math.nan,
            "prefix_hit_rate": hit_rate(cached, prompt),
            "ttft_ms": summarize_ms([r.ttft for r in done], percentiles),
            "e2el_ms": summarize_ms([r.e2el for r in done], percentiles),
        })
    return turns
