"""pdserve's fused float32/bfloat16 CPU kernels (engine/csrc/cpu_ops.cpp): build once, load, or say why not.

``make install`` builds the library into the virtual environment (``python -m engine.cpu_ops
build``, ~25 s on 2 cores with the C++ compiler and torch's headers); an engine only loads what
was built, never compiles (no compiler, lock file or wait at start-up). ``engine.cpu_kernels``
(pdserve.config) chooses: ``auto`` uses them for a float32 or bfloat16 CPU model when the built library
matches this source and torch, ``on`` requires them (an error names the reason otherwise),
``off`` runs ATen ops only. :class:`TorchOps` is the reference every kernel is tested against
(tests/engine/test_cpu_ops.py) and the path taken without them.

A batch-1 SmolLM2 decode step runs ~40 small ATen ops per layer around its four matrix products
(RMSNorm alone is five passes, ~13 us at [1, 576]); see docs/benchmarks.md (issue 11) for the
step times with and without.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.layers import rms_norm, swiglu

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_ops.cpp"
LIB_NAME = "pdserve_cpu_ops"


def build_dir() -> Path:
    """Where ``build`` writes the library: <the running Python's prefix>/pdserve-cpu-ops (the venv)."""
    return Path(sys.prefix) / "pdserve-cpu-ops"


def fingerprint() -> str:
    """sha256 of the kernel source, its compiler flags and the torch version it is built
    against (a build is used only when all three still match)."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(cflags()).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def cflags() -> list[str]:
    """Compiler flags: -O3; OpenMP, because at::parallel_for is an inline `omp parallel` in
    torch's headers (without it every kernel runs on one thread; the library then needs
    libgomp.so.1, which the loader resolves to the copy libtorch_cpu already loaded: one thread
    pool); no FP traps or errno (so that loops with exp, floor and min/max vectorize; results
    unchanged); on x86-64 the v3 level (AVX2 + FMA: every CPU this engine targets; AVX-512
    machines run it too)."""
    flags = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=x86-64-v3")
    return flags


def build(out: Path | None = None, verbose: bool = False) -> Path:
    """Compile engine/csrc/cpu_ops.cpp into ``out`` (default build_dir()) and record its
    fingerprint. Returns the library path. Raises RuntimeError/OSError when the compiler fails
    (torch.utils.cpp_extension needs g++ and ninja)."""
    from torch.utils.cpp_extension import load  # imports setuptools: only when building

    out = out or build_dir()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load(name=LIB_NAME, sources=[str(SOURCE)], extra_cflags=cflags(), extra_ldflags=["-fopenmp"],
         build_directory=str(out),
         is_python_module=False, verbose=verbose)
    lib = out / f"{LIB_NAME}.so"
    (out / "fingerprint.json").write_text(json.dumps({"fingerprint": fingerprint(),
                                                      "torch": torch.__version__}))
    log.info("built %s in %.1f s", lib, time.perf_counter() - t0)
    return lib


_loaded: dict[Path, str | None] = {}


def missing_cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The x86-64-v3 features the library needs (avx2, fma) that this CPU lacks; [] when it has
    them or is not x86-64 (other machines build without -march: cflags)."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        return []
    text = cpuinfo.read_text()
    flags = set(text.split("flags", 1)[1].split("\n", 1)[0].split()) if "flags" in text else set()
    return [f for f in ("avx2", "fma") if f not in flags]


def load_library(directory: Path | None = None) -> str | None:
    """Load the built kernels into torch.ops.pdserve_cpu once per process. Returns None when
    loaded, else the reason they are not (not built, stale build, not loadable)."""
    directory = directory or build_dir()
    if directory in _loaded:
        return _loaded[directory]
    lib, stamp = directory / f"{LIB_NAME}.so", directory / "fingerprint.json"
    reason: str | None = None
    missing = missing_cpu_features()
    if missing:
        reason = f"this CPU lacks {', '.join(missing)} (the library is built for x86-64-v3)"
    elif not lib.exists() or not stamp.exists():
        reason = f"not built ({lib} missing: run `make install` or `python -m engine.cpu_ops build`)"
    elif json.loads(stamp.read_text()).get("fingerprint") != fingerprint():
        reason = f"stale build in {directory} (source or torch changed: run `make install`)"
    else:
        try:
            if not hasattr(torch.ops.pdserve_cpu, "silu_mul"):
                torch.ops.load_library(str(lib))
        except (OSError, RuntimeError) as e:
            reason = f"{lib} does not load: {e}"
    _loaded[directory] = reason
    return reason


@dataclass(frozen=True)
class TorchOps:
    """The decoder's fusable steps on ATen ops (the path without kernels; bit for bit what the
    engine ran before the kernels existed)."""

    name = "aten"

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, delta [T, H] -> (x + delta, RMSNorm of it) (delta None: x itself)."""
        if delta is not None:
            x = x + delta
        return x, rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> [T, I]."""
        return swiglu(gate_up)


@dataclass(frozen=True)
class KernelOps:
    """The same steps on the fused kernels (float32 or bfloat16 CPU tensors); plus the decode-only
    rope_store_kv and decode_attention, which the model calls when ``kernels`` is set.

    fuse_decode_layers: a step of exactly one decode token runs every decoder layer in one
    kernel call (decode_layers; engine.model.LlamaModel decides when it applies), bit for bit the
    per-op kernels' result; False keeps the per-op path (the A/B arm of bench/cpu_kernels.py)."""

    fuse_decode_layers: bool = True
    name = "pdserve_cpu"

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """As TorchOps.add_rms_norm, but x is updated in place (the caller owns it)."""
        return x, torch.ops.pdserve_cpu.add_rms_norm(x, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> [T, I]."""
        return torch.ops.pdserve_cpu.silu_mul(gate_up)

    def rope_store_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                      slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, num_heads: int) -> None:
        """RoPE on qkv's q and k heads in place (tables [P, hd], positions [T]) and the K/V
        write of every token into layer `layer` of kv_cache."""
        torch.ops.pdserve_cpu.rope_store_kv(qkv, cos, sin, positions, kv_cache, layer,
                                            slot_blocks, slot_offsets, num_heads)

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                         tables: torch.Tensor, key_ranges: torch.Tensor, scale: float) -> torch.Tensor:
        """q [D, heads, hd] against keys [lo, hi) of each row's block table -> [D, heads, hd]."""
        return torch.ops.pdserve_cpu.decode_attention(q, kv_cache, layer, tables, key_ranges, scale)

    def decode_layers(self, x: torch.Tensor, weights: list[torch.Tensor], qkv_biases: list[torch.Tensor],
                      kv_cache: torch.Tensor, rope: tuple[torch.Tensor, ...], slot_blocks: torch.Tensor,
                      slot_offsets: torch.Tensor, tables: torch.Tensor, key_ranges: torch.Tensor,
                      eps: float, scale: float, num_heads: int) -> torch.Tensor:
        """All decoder layers for one decode token: x [1, H] (its embedding; updated in place into
        the residual stream before the last MLP), weights 6 per layer (attn_norm, dense qkv,
        o_proj, mlp_norm, gate_up, down), qkv_biases [] or one per layer, rope (cos, sin tables
        [P, hd], positions [1]), its KV slot [1] + [1], its block table [1, nb] and key range
        [1, 2]. Writes layer l's K/V into kv_cache. Returns the last MLP output [1, H] (not yet
        added to x). Raises RuntimeError on shapes or dtypes that disagree."""
        cos, sin, positions = rope
        return torch.ops.pdserve_cpu.decode_layers(x, weights, qkv_biases, kv_cache, cos, sin, positions,
                                                   slot_blocks, slot_offsets, tables, key_ranges, eps, scale,
                                                   num_heads)


TORCH_OPS = TorchOps()
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def select_ops(setting: str, dtype: torch.dtype, device: str) -> TorchOps | KernelOps:
    """The ops object for ``engine.cpu_kernels`` = setting ("auto" | "on" | "off").

    Raises RuntimeError with ``on`` when the kernels cannot be used (names the reason)."""
    if setting == "off":
        return TORCH_OPS
    reason = None
    if device != "cpu" or dtype not in KERNEL_DTYPES:
        reason = f"they run float32 or bfloat16 on the CPU only (this engine: {dtype} on {device})"
    else:
        reason = load_library()
    if reason is None:
        return KernelOps()
    if setting == "on":
        raise RuntimeError(f"engine.cpu_kernels: on, but pdserve's CPU kernels cannot be used: {reason}")
    log.info("engine.cpu_kernels: auto, ATen ops only: %s", reason)
    return TORCH_OPS


def main() -> None:
    p = argparse.ArgumentParser(description="Build pdserve's fused CPU kernels (engine/csrc/cpu_ops.cpp).")
    p.add_argument("command", choices=["build", "status"])
    p.add_argument("--out", type=Path, help=f"build directory (default {build_dir()})")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.command == "build":
        print(f">> building pdserve's CPU kernels into {a.out or build_dir()} (~25 s)", flush=True)
        build(a.out, a.verbose)
    reason = load_library(a.out)
    print("pdserve CPU kernels: " + ("loaded" if reason is None else reason))
    if reason is not None and a.command == "build":
        sys.exit(1)


if __name__ == "__main__":
    main()
