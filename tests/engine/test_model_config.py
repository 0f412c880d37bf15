"""config.json -> ModelConfig for each family: rope scaling forms and refusals, sliding-window
rules as HF transformers reads them, weights the engine would ignore refused at load."""
import json

import pytest
import torch

from engine.model import LlamaModel
from engine.model_config import model_config_from_hf
from engine.rope import RopeScaling, inv_freq

BASE = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _read(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **cfg}))
    return model_config_from_hf(tmp_path)


def test_llama3_rope_scaling_legacy_and_rope_parameters_forms_agree(tmp_path):
    legacy = _read(tmp_path, model_type="llama", rope_theta=500000.0, rope_scaling=LLAMA3)
    new = _read(tmp_path, model_type="llama",
                rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    assert legacy == new
    assert legacy.rope_theta == 500000.0
    assert legacy.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    old_style = _read(tmp_path, model_type="llama", rope_scaling={**LLAMA3, "rope_type": None,
                                                                  "type": "llama3"})
    assert old_style.rope_scaling == legacy.rope_scaling


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "linear", "longrope", "su"])
def test_other_rope_scaling_types_are_refused_by_name(tmp_path, kind):
    with pytest.raises(ValueError, match=f"rope_scaling type '{kind}'"):
        _read(tmp_path, model_type="llama", rope_scaling={"rope_type": kind, "factor": 4.0})


def test_llama3_without_a_field_and_partial_rotary_are_refused(tmp_path):
    with pytest.raises(ValueError, match="low_freq_factor"):
        _read(tmp_path, rope_scaling={k: v for k, v in LLAMA3.items() if k != "low_freq_factor"})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        _read(tmp_path, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5})


def test_llama3_frequencies_follow_the_three_bands():
    s = RopeScaling(8.0, 1.0, 4.0, 64)      # wavelengths 6.3, 19.9, 62.8, 199, ... tokens
    base, scaled = inv_freq(16, 10000.0, None), inv_freq(16, 10000.0, s)
    wavelen = 2 * torch.pi / base
    high, low = wavelen < 64 / 4, wavelen > 64 / 1
    assert torch.equal(scaled[high], base[high]) and high.any()
    assert torch.allclose(scaled[low], base[low] / 8) and low.any()
    mid = ~high & ~low
    assert mid.any() and ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all()


def test_qwen25_window_switched_off_is_full_attention(tmp_path):
    c = _read(tmp_path, model_type="qwen2", sliding_window=131072, use_sliding_window=False,
              max_window_layers=2)
    assert c.layer_windows == () and c.sliding_window is None and not c.qk_norm
    assert c.attention_bias


def test_qwen_window_switched_on_follows_max_window_layers_or_layer_types(tmp_path):
    c = _read(tmp_path, model_type="qwen3", sliding_window=64, use_sliding_window=True,
              max_window_layers=2)
    assert c.layer_windows == (None, None, 64, 64) and c.sliding_window is None and c.qk_norm
    c = _read(tmp_path, model_type="qwen2", sliding_window=64, use_sliding_window=True,
              layer_types=["sliding_attention"] * 4)
    assert c.sliding_window == 64
    with pytest.raises(ValueError, match="layer_types"):
        _read(tmp_path, model_type="qwen2", sliding_window=64, use_sliding_window=True,
              layer_types=["chunked_attention"] * 4)


def test_mistral_window_on_every_layer(tmp_path):
    assert _read(tmp_path, model_type="mistral", sliding_window=32).sliding_window == 32
    assert _read(tmp_path, model_type="mistral", sliding_window=None).layer_windows == ()
    assert _read(tmp_path, model_type="llama", sliding_window=32).layer_windows == ()


def test_unsupported_model_type_and_per_layer_rope_are_refused(tmp_path):
    with pytest.raises(ValueError, match="gemma3"):
        _read(tmp_path, model_type="gemma3")
    with pytest.raises(ValueError, match="per-layer-type rope"):
        _read(tmp_path, rope_parameters={"full_attention": {"rope_theta": 1e6},
                                         "sliding_attention": {"rope_theta": 1e4}})


def test_weights_the_forward_would_ignore_are_refused(tiny_dir):
    from engine.hf_files import load_hf_dir
    config, state = load_hf_dir(tiny_dir)
    LlamaModel(config, dict(state), torch.float32)           # as saved: loads
    extra = {**state, "model.layers.0.mlp.down_proj.bias": torch.zeros(config.hidden_size)}
    with pytest.raises(ValueError, match="down_proj.bias"):
        LlamaModel(config, extra, torch.float32)
    derived = {**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}
    LlamaModel(config, derived, torch.float32)                # recomputed buffers are fine
