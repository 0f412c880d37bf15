"""bench/_floor.py: the weight bytes of one decode step and the floor arithmetic."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import pytest

from tests.integration.procs import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from _floor import (decode_parameters, decode_weight_bytes, floor_ms, model_config_of,  # noqa: E402
                    read_bandwidth)


def test_smollm2_reads_its_134_5_million_parameters_once_per_step():
    mc = model_config_of("smollm2")  # the GGUF header only
    assert mc.tie_word_embeddings
    # 30 layers x 3,540,096 + final norm 576 + tied embedding/lm_head 49,152 x 576 (HF: 134,515,008 params)
    assert decode_parameters(mc) == 30 * 3_540_096 + 576 + 49_152 * 576 == 134_515_008
    assert decode_weight_bytes(mc, "float32") == 538_060_032  # 513 MiB
    assert decode_weight_bytes(mc, "bfloat16") == 269_030_016
    with_bias = replace(mc, attention_bias=True)  # q, k, v biases: (9 + 2*3) * 64 per layer
    assert decode_parameters(with_bias) - decode_parameters(mc) == 30 * 15 * 64


@pytest.mark.parametrize("tied", [True, False])
def test_parameters_match_a_real_checkpoint(tmp_path, tied):
    from safetensors import safe_open

    from engine.tiny import make_tiny_llama

    path = make_tiny_llama(tmp_path / "m", seed=0, tie_word_embeddings=tied, num_key_value_heads=1)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    total = sum(math.prod(s) for s in shapes.values())
    embed = math.prod(shapes["model.embed_tokens.weight"])
    # tied: the embedding is the lm_head read (counted once); untied: the embedding table is not read
    assert decode_parameters(model_config_of(str(path))) == (total if tied else total - embed)


def test_floor_is_bytes_over_bandwidth():
    assert floor_ms(538_060_032, 12.8e9) == pytest.approx(42.036, abs=1e-3)
    assert floor_ms(1_000_000_000, 1e10) == pytest.approx(100.0)
    with pytest.raises(ValueError):
        floor_ms(1, 0.0)


def test_read_bandwidth_is_a_plausible_rate():
    bw = read_bandwidth(threads=1, nbytes=16 * 2**20, repeats=2)  # small buffer: only the plumbing
    assert 1e8 < bw < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s
