"""config.json -> ModelConfig for each family: rope scaling forms and refusals, sliding-window
rules as HF transformers reads them, weights the engine would ignore refused at load."""
import dataclasses
import json

import pytest
import torch

from engine.model import LlamaModel
from engine.model_config import model_config_from_hf
from engine.rope import LinearScaling, RopeScaling, inv_freq

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


def test_prefix_reach_is_the_widest_window_or_none_with_a_full_layer(tmp_path):
    # what a prefix-cache hit must cover (Scheduler): a full layer reads every key; else the widest
    c = _read(tmp_path, model_type="mistral", sliding_window=32)
    assert dataclasses.replace(c, layer_windows=(8, 32, 16, 8)).sliding_window == 32
    assert dataclasses.replace(c, layer_windows=(8, None, 8, 8)).sliding_window is None
    assert dataclasses.replace(c, layer_windows=()).sliding_window is None


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


# ---- Gemma 3 (gemma3_text): both file forms, read as HF transformers reads them ---------------
GEMMA3_BASE = dict(model_type="gemma3_text", num_hidden_layers=12, hidden_size=64,
                   intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, vocab_size=256, sliding_window=32)
# the Hub's legacy form (Gemma 3 4B's text config: linear factor 8 on the global layers)
GEMMA3_LEGACY = dict(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=4,
                     rope_scaling={"rope_type": "linear", "factor": 8.0},
                     query_pre_attn_scalar=24, final_logit_softcapping=30.0)


def _gemma3_dir(tmp_path, name, **cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**GEMMA3_BASE, **cfg}))
    return d


def _as_hf_reads_it(model_dir):
    """(windows, full theta, linear factor or None, local theta, attn scale, softcap) by HF."""
    from transformers import Gemma3TextConfig
    hf = Gemma3TextConfig.from_pretrained(str(model_dir))
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert local["rope_type"] == "default"
    windows = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    factor = full.get("factor") if full["rope_type"] == "linear" else None
    return (windows, full["rope_theta"], factor, local["rope_theta"],
            hf.query_pre_attn_scalar ** -0.5, hf.final_logit_softcapping)


def _ours(c):
    factor = None if c.rope_scaling is None else c.rope_scaling.factor
    return (c.layer_windows, c.rope_theta, factor, c.local_rope_theta, c.attn_scale,
            c.final_logit_softcap)


@pytest.mark.parametrize("form", ["legacy", "legacy_defaults", "saved_by_transformers"])
def test_gemma3_config_reads_as_hf_does(tmp_path, form):
    from transformers import Gemma3TextConfig
    if form == "legacy":
        d = _gemma3_dir(tmp_path, form, **GEMMA3_LEGACY)
    elif form == "legacy_defaults":   # no rope keys, no pattern, no scalar: HF's defaults
        d = _gemma3_dir(tmp_path, form)
    else:   # transformers 5 writes per-layer-type rope_parameters and layer_types
        d = tmp_path / form
        Gemma3TextConfig.from_pretrained(str(_gemma3_dir(tmp_path, "src", **GEMMA3_LEGACY))) \
            .save_pretrained(str(d))
        saved = json.loads((d / "config.json").read_text())
        assert "full_attention" in saved["rope_parameters"] and "rope_scaling" not in saved
    c = model_config_from_hf(d)
    assert _ours(c) == _as_hf_reads_it(d)
    assert c.architecture == "gemma3" and c.qk_norm and c.sliding_window is None
    if form != "legacy_defaults":
        assert c.layer_windows == ((32,) * 3 + (None,)) * 3   # every 4th layer full
        assert c.rope_scaling == LinearScaling(8.0) and c.attn_scale == 24 ** -0.5


def test_gemma3_linear_scaling_divides_every_frequency():
    assert torch.equal(inv_freq(16, 1e6, LinearScaling(8.0)), inv_freq(16, 1e6, None) / 8.0)


@pytest.mark.parametrize("change,match", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
    (dict(rope_parameters={"full_attention": {"rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 1e4}}), "sliding layers"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
])
def test_gemma3_options_the_engine_does_not_compute_are_refused(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(_gemma3_dir(tmp_path, "refused", **change))


def test_gemma3_multimodal_config_is_refused_naming_the_text_model(tmp_path):
    with pytest.raises(ValueError, match="gemma3_text"):
        _read(tmp_path, model_type="gemma3")


def _gemma3_gguf(**extra):
    from engine.model_config import model_config_from_gguf
    g = "gemma3."
    fields = {"general.architecture": "gemma3", g + "embedding_length": 64, g + "block_count": 6,
              g + "feed_forward_length": 128, g + "attention.head_count": 4,
              g + "attention.head_count_kv": 2, g + "attention.key_length": 16,
              g + "attention.layer_norm_rms_epsilon": 1e-6, g + "attention.sliding_window": 8,
              "tokenizer.ggml.tokens": ["a"] * 300, **{g + k: v for k, v in extra.items()}}
    return model_config_from_gguf(fields, {"token_embd.weight"})


def test_gemma3_gguf_header_keys():
    c = _gemma3_gguf()   # llama.cpp's fixed values where the header is silent
    assert c.layer_windows == (8,) * 5 + (None,) and c.local_rope_theta == 1e4
    assert (c.rope_theta, c.rope_scaling, c.attn_scale) == (1e6, None, 16 ** -0.5)
    assert c.tie_word_embeddings and c.vocab_size == 300 and c.final_logit_softcap is None
    c = _gemma3_gguf(**{"rope.freq_base_swa": 500.0, "rope.scaling.type": "linear",
                        "rope.scaling.factor": 8.0, "attention.sliding_window_pattern": 3,
                        "final_logit_softcapping": 30.0})
    assert c.layer_windows == (8, 8, None) * 2 and c.local_rope_theta == 500.0
    assert c.rope_scaling == LinearScaling(8.0) and c.final_logit_softcap == 30.0
    flags = [True, False, True, True, False, False]   # one bool per layer: True = sliding
    c = _gemma3_gguf(**{"attention.sliding_window_pattern": flags})
    assert c.layer_windows == (8, None, 8, 8, None, None)
    assert _gemma3_gguf(**{"attention.key_length": 8}).attn_scale == 8 ** -0.5
    big = _gemma3_gguf(**{"block_count": 62, "attention.key_length": 8})   # 27B: hidden / heads
    assert big.attn_scale == (64 / 4) ** -0.5
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        _gemma3_gguf(attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        _gemma3_gguf(**{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0})
