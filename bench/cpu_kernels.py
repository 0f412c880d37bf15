"""Experiment (issue 11): the decode step with and without pdserve's fused CPU kernels, one process.

    GOMP_SPINCOUNT=10000 taskset -c 0,1 .venv/bin/python bench/cpu_kernels.py [--batches 1 8]
        [--steps 144] [--context 128] [--threads 2] [--dtype float32|bfloat16] [--arms NAME ...]

One SmolLM2 engine (``--dtype``, float32 by default) (``engine.cpu_kernels: on``, so its linear weights are DualWeights)
runs B decoding requests; consecutive ``LLMEngine.step()`` calls rotate over four arms, so load
drifts on a shared machine hit all four alike:

- ``aten+onednn``: ATen ops around oneDNN's packed products (what ran before the kernels);
- ``kernels+onednn``: the fused kernels (engine.cpu_ops) around the same packed products;
- ``kernels+gemv``: the fused kernels, and one-row products on the GEMV kernel, one op at a time;
- ``fused``: as kernels+gemv, but a step of one decode token runs every decoder layer in one
  kernel call (``decode_layers``, KernelOps.fuse_decode_layers: the default; the same bits; at
  batch 2+ it is kernels+gemv).

Every arm writes the same cache layout, so switching between steps is exact. Prints the median
step per arm (ms) and its ratio to the first, with the load average and the CPU's AVX flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine.cpu_linear import DualWeight  # noqa: E402
from engine.cpu_ops import TORCH_OPS, KernelOps  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import EngineRequest  # noqa: E402
from engine_step import params, prompt  # noqa: E402
from pdserve.config import EngineSettings  # noqa: E402


def cpu_flags() -> str:
    """The AVX flags of this CPU that the kernels and oneDNN care about."""
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    return ", ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


ARMS = ("aten+onednn", "kernels+onednn", "kernels+gemv", "fused")


def arms(engine: LLMEngine) -> dict[str, tuple]:
    """name -> (ops, layers, lm_head) for the model's forward."""
    m = engine.runner.model

    def onednn(w):
        return w.packed if isinstance(w, DualWeight) else w

    packed = [dataclasses.replace(w, qkv=onednn(w.qkv), o_proj=onednn(w.o_proj), gate_up=onednn(w.gate_up),
                                  down=onednn(w.down)) for w in m.layers]
    return {"aten+onednn": (TORCH_OPS, packed, onednn(m.lm_head)),
            "kernels+onednn": (KernelOps(fuse_decode_layers=False), packed, onednn(m.lm_head)),
            "kernels+gemv": (KernelOps(fuse_decode_layers=False), m.layers, m.lm_head),
            "fused": (KernelOps(fuse_decode_layers=True), m.layers, m.lm_head)}


def measure(engine: LLMEngine, batch: int, context: int, steps: int,
            names: list[str] | None = None) -> dict[str, float]:
    """Median step ms per arm (names: these arms of arms(), in this order; None: all) at `batch`
    decoding requests of `context` prompt tokens."""
    m, choices = engine.runner.model, arms(engine)
    names = names or list(choices)
    for i in range(batch):
        engine.add_request(EngineRequest(f"b{batch}-{i}", prompt(engine, context, i), params(steps + 16, False)))
    for _ in range(1000):  # prefill (untimed)
        engine.step()
        if len(engine.scheduler.running) == batch and all(
                s.num_computed + 1 >= s.num_tokens for s in engine.scheduler.running):
            break
    times: dict[str, list[float]] = {n: [] for n in names}
    for s in range(steps):
        name = names[s % len(names)]
        m.ops, m.layers, m.lm_head = choices[name]
        t0 = time.perf_counter()
        engine.step()
        times[name].append((time.perf_counter() - t0) * 1e3)
    m.ops, m.layers, m.lm_head = choices["fused"]
    while engine.has_work():
        engine.step()
    return {n: statistics.median(v) for n, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=144, help="timed steps per batch size (all arms together)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS),
                   help="the arms to rotate over, in this order (ratios are to the first)")
    a = p.parse_args()
    engine = LLMEngine(EngineSettings(dtype=a.dtype, device="cpu", num_threads=a.threads, num_kv_blocks=1024,
                                      max_num_tokens=2048, cpu_kernels="on"), "smollm2")
    print(f"SmolLM2 {a.dtype}; CPU flags: {cpu_flags()}; {a.threads} threads; load average {os.getloadavg()[0]:.2f} at start")
    print("| batch | " + " | ".join(a.arms) + " |\n|---:|" + "---:|" * len(a.arms))
    for b in a.batches:
        ms = measure(engine, b, a.context, a.steps, a.arms)
        base = ms[a.arms[0]]
        print(f"| {b} | " + " | ".join(f"{v:.2f} ms ({v / base:.2f}×)" for v in ms.values()) + " |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
