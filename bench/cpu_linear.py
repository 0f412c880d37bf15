"""Micro-benchmark: the linear products of one SmolLM2 decode step, F.linear vs oneDNN-packed.

    .venv/bin/python bench/cpu_linear.py [--rows 1 8] [--threads 2] [--steps 10]

Builds random weights of SmolLM2-135M's shapes (30 layers of qkv [960, 576], o_proj [576, 576],
gate_up [3072, 576], down [576, 1536], and lm_head [49152, 576]: 540 MB in fp32, far more than the
caches, as in the real model) and times one "step" = every product once, for ``rows`` input rows,
with ``F.linear`` on the plain weights and with ``engine.cpu_linear`` on weights packed once.
Prints ms per step (median of ``--steps``) and the weight bytes read per ms.

    .venv/bin/python bench/cpu_linear.py --hints 1 8 [--rows 1 2 8 150]

instead compares fp32 packings with the given ``pack_weight`` batch hints: the passes over each
layout alternate (one pass each, ``--steps`` rounds, so load drifts hit all alike), and each row
also says whether the products give the same bits as the first hint's. Spinning OpenMP threads
need ``GOMP_SPINCOUNT=10000`` in the environment (issue 11).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.cpu_linear import pack_weight, packing_available  # noqa: E402
from engine.layers import linear  # noqa: E402

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [N, K] per layer
LM_HEAD = (49152, 576)
NUM_LAYERS = 30


def weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """Every linear weight of one step, in order."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(*s, generator=gen).to(dtype) for _ in range(NUM_LAYERS) for s in LAYER_SHAPES]
    return ws + [torch.randn(*LM_HEAD, generator=gen).to(dtype)]


def step_ms(ws: list[torch.Tensor], rows: int, dtype: torch.dtype, steps: int) -> float:
    """Median ms of one pass over every weight."""
    xs = {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w in ws}}
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        for w in ws:
            linear(xs[w.shape[1]], w)
        if i >= 2:  # two warm-up passes
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def hint_table(rows_list: list[int], hints: list[int], steps: int) -> None:
    """fp32: ms per pass (median) over the layouts of each hint, alternating, plus a bit check."""
    plain = weights(torch.float32)
    nbytes = sum(w.numel() * w.element_size() for w in plain)
    packed = {h: [pack_weight(w, h) for w in plain] for h in hints}
    print("| rows | hint | ms | GB/s | same bits as hint %d |\n|---:|---:|---:|---:|---|" % hints[0])
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in plain}}
        times: dict[int, list[float]] = {h: [] for h in hints}
        for i in range(steps + 2):
            for h in hints:
                t0 = time.perf_counter()
                for w in packed[h]:
                    linear(xs[w.shape[1]], w)
                if i >= 2:  # two warm-up passes
                    times[h].append((time.perf_counter() - t0) * 1e3)
        first = [linear(xs[w.shape[1]], w) for w in packed[hints[0]]]
        for h in hints:
            same = all(torch.equal(a, linear(xs[w.shape[1]], w)) for a, w in zip(first, packed[h]))
            ms = statistics.median(times[h])
            print(f"| {rows} | {h} | {ms:.1f} | {nbytes / ms / 1e6:.1f} | {same} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hints", type=int, nargs="+", help="fp32 only: compare these batch hints")
    a = p.parse_args()
    if not packing_available():
        sys.exit("this torch build has no oneDNN linear: nothing to compare")
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} threads, load average {os.getloadavg()[0]:.2f}")
    if a.hints:
        hint_table(a.rows, a.hints, a.steps)
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
        return
    print("| dtype | rows | F.linear ms | packed ms | packed / F.linear | packed GB/s |\n|---|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        plain = weights(dtype)
        nbytes = sum(w.numel() * w.element_size() for w in plain)
        packed = [pack_weight(w) for w in plain]
        for rows in a.rows:
            base, fast = step_ms(plain, rows, dtype, a.steps), step_ms(packed, rows, dtype, a.steps)
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} | {base:.1f} | {fast:.1f} | "
                  f"{fast / base:.2f}x | {nbytes / fast / 1e6:.1f} |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
