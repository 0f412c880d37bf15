"""The c1 decode floor of this machine: how fast one decode step could possibly be.

At concurrency 1 a decode step computes little and reads every weight once, so its time is bounded
below by ``floor_ms = weight bytes read per step / memory read bandwidth``:

- bytes: the parameters of every layer, the final norm and the lm_head in the served dtype
  (:func:`decode_weight_bytes`). Tied embeddings are counted once, as the lm_head read; an untied
  embedding table is not counted (a step gathers one row of it).
- bandwidth: a reduction (``torch.sum``) over a buffer of at least 1 GiB, far past every cache,
  with the engine's thread count, best of a few repeats (:func:`read_bandwidth`), measured in the
  same run as the engine it is compared with.

    taskset -c 0,1 .venv/bin/python bench/_floor.py --threads 2 --model smollm2 --dtype float32

prints one JSON line (bandwidth in bytes/s, weight bytes, floor in ms).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.model_config import ModelConfig  # noqa: E402

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30


def decode_parameters(mc: ModelConfig) -> int:
    """Parameters (elements) one decode step reads: layers + final norm + lm_head.

    Per layer: 2 RMSNorm weights [H]; q [heads*hd, H]; k, v [kv_heads*hd, H] each (+ their biases
    with ``attention_bias``); o [H, heads*hd]; gate, up [I, H] each; down [H, I].
    """
    h, hd = mc.hidden_size, mc.head_dim
    q, kv = mc.num_heads * hd, mc.num_kv_heads * hd
    attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if mc.attention_bias else 0)
    mlp = 3 * h * mc.intermediate_size
    return mc.num_layers * (2 * h + attn + mlp) + h + mc.vocab_size * h


def decode_weight_bytes(mc: ModelConfig, dtype: str) -> int:
    """Bytes one decode step reads from the weights in ``dtype``. Raises KeyError for an unknown dtype."""
    return decode_parameters(mc) * DTYPE_BYTES[dtype]


def floor_ms(weight_bytes: int, bandwidth_bytes_s: float) -> float:
    """The decode floor in ms: ``weight_bytes / bandwidth``. Raises ValueError for bandwidth <= 0."""
    if bandwidth_bytes_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_s}")
    return 1000.0 * weight_bytes / bandwidth_bytes_s


def read_bandwidth(threads: int, nbytes: int = GIB, repeats: int = 5) -> float:
    """Memory read bandwidth in bytes/s: best of ``repeats`` ``torch.sum`` over ``nbytes`` of fp32.

    The buffer is written once first (so its pages exist) and summed once unmeasured.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        torch.sum(buf)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.sum(buf)
            best = min(best, time.perf_counter() - t0)
        return buf.numel() * 4 / best
    finally:
        torch.set_num_threads(previous)


def model_config_of(spec: str) -> ModelConfig:
    """Hyper-parameters of a model spec ('smollm2', a .gguf file, an HF directory) without loading weights."""
    from engine.gguf_reader import read_gguf
    from engine.model_config import model_config_from_gguf, model_config_from_hf
    from engine.model_files import is_gguf, resolve_model_path

    path = resolve_model_path(spec)
    if is_gguf(path):
        fields, infos, _ = read_gguf(path)
        return model_config_from_gguf(fields, {i.name for i in infos})
    return model_config_from_hf(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads (the engine's engine.num_threads)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    p.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB (>= 1 so caches do not flatter it)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    weights = decode_weight_bytes(model_config_of(a.model), a.dtype)
    bw = read_bandwidth(a.threads, int(a.gib * GIB), a.repeats)
    print(json.dumps({"threads": a.threads, "buffer_bytes": int(a.gib * GIB), "bandwidth_bytes_s": bw,
                      "weight_bytes": weights, "dtype": a.dtype, "floor_ms": floor_ms(weights, bw)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
