"""Micro-benchmark: one engine step in ms — decode at batch 1 and 8, a 512-token prefill.

    .venv/bin/python bench/engine_step.py [--model smollm2] [--dtype float32 bfloat16]
        [--threads 2] [--steps 32] [--repeats 3] [--sampled] [--json out.json]

Engine level only (no HTTP, IPC or lattice): ``LLMEngine.step()`` timed with ``perf_counter``,
so the numbers include scheduling, the plan, attention metadata, the forward, sampling and
detokenization. Decode: B requests of ``--context`` prompt tokens are prefilled first (untimed),
then ``--steps`` decode steps are timed; the median step is reported, in wall time and in CPU time
of the process (``process_time``: all its threads; steadier than wall time on a loaded machine). Prefill: one request of
``--prefill-len`` tokens with ``max_tokens=1`` (one step: the whole prefill plus the first
token). ``--sampled`` uses temperature 0.8 / top-p 0.9 / top-k 50 instead of greedy. Each cell is
the median over ``--repeats`` runs. Prints one JSON line per (dtype, case) and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning OpenMP threads
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import EngineRequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.config import EngineSettings  # noqa: E402


def params(max_tokens: int, sampled: bool) -> SamplingParams:
    """Fixed-length output: ignore_eos, greedy or a typical sampled setting (seeded)."""
    if sampled:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, top_k=50,
                              seed=1, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(engine: LLMEngine, n: int, salt: int) -> list[int]:
    """n token ids, different per salt (no two requests share a prefix)."""
    vocab = engine.model_config.vocab_size
    return [(7919 * (i + 1) + 104729 * salt) % (vocab - 10) + 5 for i in range(n)]


def decode_step_ms(engine: LLMEngine, batch: int, context: int, steps: int,
                   sampled: bool) -> tuple[float, float]:
    """Median (wall ms, CPU ms) of one decode step with `batch` sequences of ~`context` tokens."""
    for b in range(batch):
        engine.add_request(EngineRequest(f"d{b}", prompt(engine, context, b),
                                         params(steps + 4, sampled)))
    for _ in range(1000):  # prefill every sequence (untimed)
        engine.step()
        if all(s.num_computed + 1 >= s.num_tokens for s in engine.scheduler.running) \
                and len(engine.scheduler.running) == batch:
            break
    walls, cpus = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        walls.append((time.perf_counter() - t0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
    while engine.has_work():
        engine.step()
    return statistics.median(walls), statistics.median(cpus)


def prefill_ms(engine: LLMEngine, length: int, sampled: bool) -> tuple[float, float]:
    """(wall ms, CPU ms) of the step that prefills `length` tokens and samples the first one."""
    engine.add_request(EngineRequest("p", prompt(engine, length, 99), params(1, sampled)))
    t0, c0 = time.perf_counter(), time.process_time()
    engine.step()
    wall, cpu = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
    while engine.has_work():
        engine.step()
    return wall, cpu


def run(a: argparse.Namespace, dtype: str) -> list[dict]:
    """Every case for one dtype; each the median over a.repeats."""
    engine = LLMEngine(EngineSettings(dtype=dtype, device="cpu", num_threads=a.threads, num_kv_blocks=512, cpu_kernels=a.cpu_kernels,
                                      max_num_tokens=max(2048, a.prefill_len)), a.model)
    decode_step_ms(engine, 1, 16, 4, a.sampled)  # warm-up
    prefill_ms(engine, 64, a.sampled)
    cases = {f"decode_b{b}": lambda b=b: decode_step_ms(engine, b, a.context, a.steps, a.sampled)
             for b in a.batches}
    if a.prefill_len:
        cases[f"prefill_{a.prefill_len}"] = lambda: prefill_ms(engine, a.prefill_len, a.sampled)
    rows = []
    for name, fn in cases.items():
        runs = [fn() for _ in range(a.repeats)]
        row = {"dtype": dtype, "case": name, "ms": round(statistics.median(r[0] for r in runs), 2),
               "cpu_ms": round(statistics.median(r[1] for r in runs), 2), "threads": a.threads,
               "sampled": a.sampled, "load1": round(os.getloadavg()[0], 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    p.add_argument("--context", type=int, default=128, help="prompt tokens of each decode request")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    p.add_argument("--prefill-len", type=int, default=512, help="0 = no prefill case")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sampled", action="store_true")
    p.add_argument("--cpu-kernels", default="auto", choices=["auto", "on", "off"],
                   help="engine.cpu_kernels (pdserve's fused float32 CPU kernels)")
    p.add_argument("--json", type=Path, help="also write every row to this file")
    a = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    rows = [r for dtype in a.dtype for r in run(a, dtype)]
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print("| dtype | case | wall ms | CPU ms |\n|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['case']} | {r['ms']:.1f} | {r['cpu_ms']:.1f} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
