"""Which device a server runs on: ``engine.device: auto | cpu | cuda | cuda:N``, resolved once at start.

``auto`` is ``cuda:0`` where torch sees a CUDA device and ``cpu`` elsewhere; ``cuda`` means
``cuda:0``. Under Slurm a server gets its GPU from the allocation (``--gpus-per-task=1`` or
``CUDA_VISIBLE_DEVICES``): the process then sees exactly that GPU, as ``cuda:0``.

A server resolves its device once (``executor.server_main``, like its dtype: the dtype ``auto``
depends on the device) and only the concrete value (``cpu`` or ``cuda:N``) travels on to the
ranks and the engine (:func:`engine.config.check_engine_config` refuses ``auto``).

Torch-free (the orchestrator imports it): the number of visible CUDA devices is a parameter of
:func:`resolve_device`; :func:`visible_cuda_devices` is the only place that asks torch.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["DEVICE_PATTERN", "check_device_setting", "resolve_device", "is_cuda", "visible_cuda_devices",
           "tp_rank_device", "tp_backend"]

# auto | cpu | cuda | cuda:N (the config schema's pattern and this module's parser agree)
DEVICE_PATTERN = r"^(auto|cpu|cuda|cuda:[0-9]+)$"
_DEVICE_RE = re.compile(DEVICE_PATTERN)


def check_device_setting(setting: str) -> str:
    """``setting`` unchanged when it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: any other string.
    """
    if not isinstance(setting, str) or not _DEVICE_RE.match(setting):
        raise ValueError(f"engine.device must be auto, cpu, cuda or cuda:N; got {setting!r}")
    return setting


def resolve_device(setting: str, num_cuda_devices: int) -> str:
    """The concrete device (``cpu`` or ``cuda:N``) that ``setting`` means with ``num_cuda_devices`` visible.

    Raises:
        ValueError: ``setting`` is not a device setting; ``cuda``/``cuda:N`` asked for where no
            (or too few) CUDA devices are visible (the message names ``CUDA_VISIBLE_DEVICES``).
    """
    check_device_setting(setting)
    if setting == "auto":
        return "cuda:0" if num_cuda_devices > 0 else "cpu"
    if setting == "cpu":
        return "cpu"
    index = 0 if setting == "cuda" else int(setting.split(":")[1])
    if index >= num_cuda_devices:
        raise ValueError(f"engine.device {setting} needs CUDA device {index}, but this process sees "
                         f"{num_cuda_devices} (check CUDA_VISIBLE_DEVICES / the Slurm GPU allocation)")
    return f"cuda:{index}"


def is_cuda(device: str) -> bool:
    """Whether a concrete device string names a CUDA device."""
    return device.startswith("cuda")


def visible_cuda_devices(driver_paths: tuple[Path, ...] = (Path("/dev/nvidiactl"), Path("/dev/dxg"),
                                                           Path("/proc/driver/nvidia"))) -> int:
    """How many CUDA devices torch sees in this process (0 without torch's CUDA build or a GPU).

    Where none of ``driver_paths`` exists (the NVIDIA driver's control node, WSL's GPU node, the
    driver's /proc entry) no CUDA device can be visible, so the answer is 0 without importing
    torch (1-2 s a CPU server would otherwise spend before it launches its ranks)."""
    if not any(p.exists() for p in driver_paths):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def tp_rank_device(device: str, rank: int) -> str:
    """The device of TP rank ``rank`` of a server on ``device``: ``cpu`` stays ``cpu``; ``cuda:N``
    gives rank r ``cuda:N+r`` (one GPU per rank: NCCL refuses two ranks on one GPU)."""
    if not is_cuda(device):
        return device
    return f"cuda:{int(device.split(':')[1]) + rank}"


def tp_backend(device: str) -> str:
    """The torch.distributed backend of a TP group on ``device``: ``nccl`` on CUDA, else ``gloo``."""
    return "nccl" if is_cuda(device) else "gloo"
