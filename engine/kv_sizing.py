"""How many KV blocks fit on a GPU: ``engine.gpu_memory_utilization`` (vLLM's meaning).

The engine may use ``utilization * total`` bytes of the device for everything it holds: weights,
activations and the KV cache. So after the weights are loaded the KV budget is

    budget = utilization * total - allocated_now - activation_reserve

capped by what the device still has free (another server on the same GPU holds the rest) and
divided by the bytes of one block. This follows vLLM's ``gpu_memory_utilization`` ("the fraction
of GPU memory to be used for the model executor", vllm/config EngineArgs docs); vLLM measures the
activation peak with a profile run, here it is :func:`activation_reserve_bytes`'s estimate.

Everything is a plain function of numbers, so the arithmetic is tested without a GPU; only
:func:`device_memory` asks torch (``torch.cuda.mem_get_info``: free and total bytes of a device).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["DeviceMemory", "kv_block_bytes", "activation_reserve_bytes", "blocks_for_budget",
           "device_memory", "resolve_num_kv_blocks", "MIN_KV_BLOCKS"]

log = logging.getLogger(__name__)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

MIN_KV_BLOCKS = 2  # the block manager needs at least two blocks (the topology's lower bound too)


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory in bytes: ``free`` and ``total`` (cudaMemGetInfo) and ``allocated``
    (what this process's torch allocator holds: weights so far)."""

    free: int
    total: int
    allocated: int


def kv_block_bytes(num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one block of the block-major cache ``[layers, 2 (K, V), block_size, kv_heads, head_dim]``."""
    return num_layers * 2 * block_size * kv_heads * head_dim * dtype_bytes


def activation_reserve_bytes(max_num_tokens: int, max_batch_size: int, hidden: int, intermediate: int,
                             vocab: int, dtype_bytes: int) -> int:
    """Bytes kept free for one step's activations (an estimate in place of vLLM's profile run).

    Per token of the step budget: the residual stream and a normed copy (2 x hidden), the fused
    q/k/v and attention output (<= 3 x hidden), gate/up and the SwiGLU product (3 x intermediate);
    doubled for temporaries that live at once. Plus float32 logits of every sampled row, twice
    (the sampler's scaled copy). Attention gathers of long contexts are not counted: keep
    utilization below 1.
    """
    per_token = (5 * hidden + 3 * intermediate) * dtype_bytes * 2
    return max_num_tokens * per_token + max_batch_size * vocab * 4 * 2


def blocks_for_budget(mem: DeviceMemory, utilization: float, reserve: int, block_bytes: int) -> int:
    """KV blocks that fit (see the module docstring).

    Raises:
        ValueError: utilization outside (0, 1], block_bytes <= 0, or fewer than MIN_KV_BLOCKS fit
            (the message gives the numbers in MiB).
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if block_bytes <= 0:
        raise ValueError(f"KV block bytes must be positive, got {block_bytes}")
    budget = int(utilization * mem.total) - mem.allocated - reserve
    usable = min(budget, mem.free - reserve)
    blocks = max(usable, 0) // block_bytes
    if blocks < MIN_KV_BLOCKS:
        mib = 1 << 20
        raise ValueError(
            f"no room for the KV cache: gpu_memory_utilization {utilization} of {mem.total // mib} MiB, "
            f"{mem.allocated // mib} MiB already allocated (weights), {reserve // mib} MiB kept for "
            f"activations, {mem.free // mib} MiB free on the device; a block needs {block_bytes / mib:.2f} MiB. "
            "Raise engine.gpu_memory_utilization or set engine.num_kv_blocks")
    return blocks


def device_memory(device: str) -> DeviceMemory:
    """The memory of CUDA device ``device`` (``cuda:N``) now, as seen by this process."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return DeviceMemory(free=int(free), total=int(total),
                        allocated=int(torch.cuda.memory_allocated(torch.device(device))))


def resolve_num_kv_blocks(config, model_config, local_kv_heads: int) -> int:
    """``config.num_kv_blocks`` where it is set; else, on a CPU, the default
    (engine.config.CPU_DEFAULT_KV_BLOCKS) and on CUDA the blocks that fit (:func:`blocks_for_budget`).

    config: pdserve.config.EngineSettings (device and dtype resolved); model_config: engine.model_config.ModelConfig.
    Raises ValueError as :func:`blocks_for_budget`.
    """
    from engine.config import CPU_DEFAULT_KV_BLOCKS

    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.device == "cpu":
        return CPU_DEFAULT_KV_BLOCKS
    mc = model_config
    dtype_bytes = _DTYPE_BYTES[config.dtype]
    block = kv_block_bytes(mc.num_layers, local_kv_heads, mc.head_dim, config.block_size, dtype_bytes)
    reserve = activation_reserve_bytes(config.max_num_tokens, config.max_batch_size, mc.hidden_size,
                                       mc.intermediate_size, mc.vocab_size, dtype_bytes)
    mem = device_memory(config.device)
    blocks = blocks_for_budget(mem, config.gpu_memory_utilization, reserve, block)
    log.info("KV cache sized from %s memory: %d blocks (%.1f MiB) at gpu_memory_utilization %.2f "
             "(free %.0f MiB of %.0f MiB)", config.device, blocks, blocks * block / 2**20,
             config.gpu_memory_utilization, mem.free / 2**20, mem.total / 2**20)
    return blocks
