"""KV cache sizing from device memory (engine.kv_sizing), with torch.cuda's memory calls mocked."""
from types import SimpleNamespace
from unittest import mock

import pytest

from engine.config import CPU_DEFAULT_KV_BLOCKS
from engine.kv_sizing import (DeviceMemory, activation_reserve_bytes, blocks_for_budget, kv_block_bytes,
                              resolve_num_kv_blocks)
from pdserve.config import EngineSettings

GIB = 1 << 30
MIB = 1 << 20


def test_block_bytes_of_smollm2_fp32():
    # 30 layers x K,V x 16 tokens x 3 KV heads x 64 dims x 4 bytes = 45 KiB per token x 16
    assert kv_block_bytes(30, 3, 64, 16, 4) == 30 * 2 * 16 * 3 * 64 * 4 == 16 * 46080


def test_budget_is_the_fraction_of_total_minus_weights_and_reserve():
    mem = DeviceMemory(free=100 * GIB, total=140 * GIB, allocated=2 * GIB)
    # 0.4 * 140 GiB = 56 GiB; minus 2 GiB weights, 1 GiB reserve = 53 GiB of 1 MiB blocks
    assert blocks_for_budget(mem, 0.4, GIB, MIB) == 53 * 1024


def test_budget_is_capped_by_free_memory():
    mem = DeviceMemory(free=10 * GIB, total=140 * GIB, allocated=2 * GIB)  # another server holds the rest
    assert blocks_for_budget(mem, 0.9, GIB, MIB) == 9 * 1024


def test_no_room_names_the_numbers():
    mem = DeviceMemory(free=140 * GIB, total=140 * GIB, allocated=60 * GIB)
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.4 of 143360 MiB, 61440 MiB already"):
        blocks_for_budget(mem, 0.4, GIB, MIB)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        blocks_for_budget(mem, 1.5, GIB, MIB)


def test_reserve_grows_with_the_step_budget():
    small = activation_reserve_bytes(256, 16, 576, 1536, 49152, 4)
    assert activation_reserve_bytes(2048, 16, 576, 1536, 49152, 4) > small > 16 * 49152 * 8


def _mc() -> SimpleNamespace:
    """The fields of engine.model_config.ModelConfig that the sizing reads."""
    return SimpleNamespace(num_layers=4, hidden_size=64, intermediate_size=128, num_kv_heads=2,
                           head_dim=16, vocab_size=1000)


def test_unset_on_cpu_is_the_default_and_set_wins():
    assert resolve_num_kv_blocks(EngineSettings(dtype="float32", device="cpu"), _mc(), 2) == CPU_DEFAULT_KV_BLOCKS
    assert resolve_num_kv_blocks(EngineSettings(dtype="float32", device="cuda:0", num_kv_blocks=7), _mc(), 2) == 7


def test_unset_on_cuda_asks_mem_get_info():
    cfg = EngineSettings(dtype="float32", device="cuda:0", gpu_memory_utilization=0.5, max_num_tokens=64,
                         max_batch_size=4)
    block = kv_block_bytes(4, 2, 16, 16, 4)
    reserve = activation_reserve_bytes(64, 4, 64, 128, 1000, 4)
    with mock.patch("torch.cuda.mem_get_info", return_value=(8 * GIB, 10 * GIB)) as info, \
            mock.patch("torch.cuda.memory_allocated", return_value=GIB):
        blocks = resolve_num_kv_blocks(cfg, _mc(), 2)
    info.assert_called_once()
    assert blocks == (5 * GIB - GIB - reserve) // block
