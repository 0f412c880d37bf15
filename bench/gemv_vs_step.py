"""Experiment (issue 11): a batch-1 decode step next to its matrix products alone, in one process.

    GOMP_SPINCOUNT=10000 OMP_WAIT_POLICY=ACTIVE taskset -c 0,1 .venv/bin/python bench/gemv_vs_step.py \
        [--rounds 3] [--passes 30] [--steps 32] [--context 128]

Loads SmolLM2 (float32, ``engine.cpu_kernels: on``, so every linear weight is a DualWeight), then
per round: ``--passes`` passes over the 121 one-row products of a step (every layer's qkv, o_proj,
gate_up and down, then lm_head) on ``torch.ops.pdserve_cpu.gemv``, one after another; then
``--steps`` engine decode steps at batch 1 (``bench/engine_step.py``'s loop, ``--context`` prompt
tokens). Prints per round the median pass (ms, and the weight bytes it read per second) and the
median step (ms): the step minus the products is what the rest of a step costs (norms, RoPE,
attention, plan, sampling, outputs). The memory bandwidth of a shared VM drifts by 10-20% within
minutes, so only the two numbers of one round compare.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from engine.cpu_linear import DualWeight  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine_step import decode_step_ms  # noqa: E402
from pdserve.config import EngineSettings  # noqa: E402


def dense_weights(engine: LLMEngine) -> list[torch.Tensor]:
    """The row-major weights of every one-row product of a decode step, in the forward's order."""
    model = engine.runner.model
    linears = [m for w in model.layers for m in (w.qkv, w.o_proj, w.gate_up, w.down)] + [model.lm_head]
    return [m.panels if isinstance(m, DualWeight) else m for m in linears]


def products_ms(dense: list[torch.Tensor], inputs: list[torch.Tensor], passes: int) -> float:
    """Median ms of one pass over every product."""
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for x, w in zip(inputs, dense):
            torch.ops.pdserve_cpu.gemv(x, w, None)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=30)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    engine = LLMEngine(EngineSettings(dtype="float32", device="cpu", num_threads=a.threads, num_kv_blocks=512,
                                      cpu_kernels="on", max_num_tokens=2048), "smollm2")
    dense = dense_weights(engine)
    inputs = [torch.randn(1, w.shape[1]) for w in dense]
    total = sum(w.numel() * w.element_size() for w in dense)
    decode_step_ms(engine, 1, 16, 4, False)  # warm-up
    print(f"{len(dense)} products, {total / 1e6:.1f} MB per pass; load {os.getloadavg()[0]:.2f}")
    for r in range(a.rounds):
        g = products_ms(dense, inputs, a.passes)
        step, _ = decode_step_ms(engine, 1, a.context, a.steps, False)
        print(f"round {r}: products {g:.2f} ms ({total / g / 1e6:.1f} GB/s), step {step:.2f} ms, "
              f"rest {step - g:.2f} ms; load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
