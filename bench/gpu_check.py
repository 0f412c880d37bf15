"""Issue 12's device check: one JSON line per check, printed as each check ends.

    python bench/gpu_check.py [--device cuda] [--tokenizer-dir DIR]      # the H200 run (bench/gpu_check.sh)
    python bench/gpu_check.py --device cpu --shapes tiny --quick         # the CPU run (a test runs it)

Checks, in order (``"check"`` names each line):
- ``probe``: what this host's sandbox allows (pidfd_open, process_vm_readv, MADV_POPULATE_WRITE) and
  which fallback the check uses;
- ``engine_vs_hf``: engine greedy == HF transformers greedy, fp32 with TF32 off, ``--tokens`` tokens
  for 5 prompts given as token ids, random weights of each ``--shapes`` shape;
- ``throughput``: engine output tok/s at each ``--concurrency`` for the last shape (bf16 on CUDA),
  next to HF ``generate`` on the same batch in the same run, with host syncs per engine step
  (``torch.cuda.set_sync_debug_mode``);
- ``disagg``: a ctx and a gen server behind the orchestrator: disaggregated == colocated (fp32);
- ``kv_pull``: KV pull GB/s for ``--kv-mib`` MiB from another process, next to a same-device copy.
A check that fails prints ``"error"`` and the next one runs; the exit status is 1 if any failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from _gpu_shapes import SHAPES, build_model_dir, random_prompts  # noqa: E402
from pdserve.devices import resolve_device, visible_cuda_devices  # noqa: E402

PROMPT_LENGTHS = [7, 19, 33, 64, 100]


def emit(check: str, t0: float, **fields) -> None:
    """One JSON line for a finished check (``seconds``: how long it took)."""
    print(json.dumps({"check": check, **fields, "seconds": round(time.perf_counter() - t0, 2)}), flush=True)


def probe() -> dict:
    """Which Linux calls of the CPU path this sandbox allows (each may be refused on the GPU host)."""
    import ctypes
    import mmap

    out = {}
    try:
        os.close(os.pidfd_open(os.getpid()))
        out["pidfd_open"] = True
    except (OSError, AttributeError) as err:
        out["pidfd_open"] = f"refused ({err}): process watching falls back to polling"
    try:
        from kv_transfer.cma import read_remote

        src, dst = ctypes.create_string_buffer(b"x" * 64), ctypes.create_string_buffer(64)
        read_remote(os.getpid(), ctypes.addressof(src), ctypes.addressof(dst), 64, time.monotonic() + 5)
        out["process_vm_readv"] = True
    except OSError as err:
        out["process_vm_readv"] = f"refused ({err}): same-host CPU KV reads unavailable (CUDA caches use CUDA IPC)"
    region = mmap.mmap(-1, 1 << 21)
    try:
        region.madvise(23)  # MADV_POPULATE_WRITE
        out["madv_populate_write"] = True
    except OSError as err:
        out["madv_populate_write"] = f"refused ({err}): KV cache committed by writing zeros"
    region.close()
    out["executor"] = "inproc (the GPU host has no MPI launcher wheel; the disagg check uses inproc servers)"
    return out


def device_info(device: str) -> dict:
    if device == "cpu":
        return {"device": "cpu", "torch": torch.__version__}
    props = torch.cuda.get_device_properties(torch.device(device))
    return {"device": device, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "torch": torch.__version__, "cuda": torch.version.cuda}


def run(name: str, fn, failures: list[str]) -> None:
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as err:  # one failed check must not hide the others: reported, then the next runs
        failures.append(name)
        emit(name, t0, error=f"{type(err).__name__}: {err}", trace=traceback.format_exc(limit=4)[-1500:])
        return
    for row in result if isinstance(result, list) else [result]:
        emit(name, t0, **row)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--shapes", default="smollm2,llama1b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--tokenizer-dir", default="smollm2", help="a directory with tokenizer files (or 'smollm2')")
    p.add_argument("--work", default=None, help="where model dirs and logs go (default: a temp dir)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--out-len", type=int, default=128)
    p.add_argument("--kv-mib", type=int, default=256)
    p.add_argument("--skip", default="", help="comma list of checks to skip")
    p.add_argument("--quick", action="store_true", help="CPU test sizes: 4 tokens, c1/c4, 16-token outputs, 16 MiB")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.concurrency, a.prompt_len, a.out_len, a.kv_mib = 4, "1,4", 16, 8, 16
    return a


def main(argv: list[str] | None = None) -> int:
    from _gpu_cluster_checks import check_disagg, check_kv_pull
    from _gpu_engine_checks import check_engine_vs_hf, check_throughput

    a = parse_args(argv)
    device = resolve_device(a.device, visible_cuda_devices() if a.device != "cpu" else 0)
    work = Path(a.work or tempfile.mkdtemp(prefix="gpu_check_"))
    shapes, skip, failures = a.shapes.split(","), set(a.skip.split(",")), []
    t0 = time.perf_counter()
    emit("probe", t0, **device_info(device), **probe())
    dirs = {s: build_model_dir(work, s, a.tokenizer_dir) for s in shapes}
    for s in shapes:
        if "engine_vs_hf" not in skip:
            prompts = random_prompts(int(SHAPES[s].get("vocab_size", 49152)), PROMPT_LENGTHS, seed=1)
            run("engine_vs_hf", lambda: {"shape": s, **check_engine_vs_hf(dirs[s], prompts, a.tokens, device, 256)},
                failures)
    big = shapes[-1]
    vocab = int(SHAPES[big].get("vocab_size", 49152))
    if "throughput" not in skip:
        conc = [int(c) for c in a.concurrency.split(",")]
        blocks = max(conc) * (-(-(a.prompt_len + a.out_len) // 16)) + 16
        dtype = "bfloat16" if device != "cpu" else "float32"
        run("throughput", lambda: [{"shape": big, **r} for r in check_throughput(
            dirs[big], dtype, device, conc, a.prompt_len, a.out_len, blocks, vocab)], failures)
    if "disagg" not in skip:
        prompts = random_prompts(vocab, PROMPT_LENGTHS, seed=2)
        run("disagg", lambda: {"shape": big, **check_disagg(dirs[big], prompts, a.tokens, device, work)}, failures)
    if "kv_pull" not in skip:
        run("kv_pull", lambda: check_kv_pull(device, a.kv_mib), failures)
    emit("summary", t0, failed=failures, ok=not failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
