"""Model families (Llama 3.x llama3 rope, Qwen2.5, Qwen3, Qwen3 with windows, Mistral sliding
window, Gemma 3): greedy tokens == HF transformers on random-weight checkpoints built here, fp32,
5 prompts x 32 tokens, colocated (one batch; chunked prefill) and disaggregated; and one
negative control per feature: the engine with that feature switched off must NOT match.
"""
import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.layers import RotaryTable

from engine_testutil import cpu_settings, greedy, run_all
from families import FAMILIES, N_NEW, WINDOW, prompts
from test_disagg import _ctx, _gen

ENGINE_KW = dict(num_kv_blocks=64)


def _engine(path, **kw) -> LLMEngine:
    """An engine on a family checkpoint (fixtures family_dirs / hf_tokens: conftest.py)."""
    return LLMEngine(cpu_settings(**{**ENGINE_KW, **kw}), str(path))


def _colocated(engine: LLMEngine) -> list[list[int]]:
    ps = prompts()
    res = run_all(engine, [EngineRequest(f"r{i}", p, greedy(N_NEW)) for i, p in enumerate(ps)])
    return [res[f"r{i}"]["tokens"] for i in range(len(ps))]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_hf(family, family_dirs, hf_tokens):
    assert _colocated(_engine(family_dirs[family])) == hf_tokens[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_chunked_prefill_matches_hf(family, family_dirs, hf_tokens):
    # a 7-token budget: every prompt is prefilled in chunks that reach back into the paged cache
    # (across the window's edge), next to decodes of the other prompts
    assert _colocated(_engine(family_dirs[family], max_num_tokens=7)) == hf_tokens[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_disaggregated_matches_hf(family, family_dirs, hf_tokens):
    ctx_eng, gen_eng = _engine(family_dirs[family]), _engine(family_dirs[family])
    for i, p in enumerate(prompts()):
        out = _ctx(ctx_eng, f"d{i}", p, N_NEW)
        tokens, _ = _gen(gen_eng, ctx_eng, f"d{i}", p, out.new_token_ids,
                         out.parked_block_ids, N_NEW)
        assert tokens == hf_tokens[family][i], f"prompt {i}"
        assert ctx_eng.release_parked(f"d{i}")
    assert ctx_eng.num_free_blocks == gen_eng.num_free_blocks == ENGINE_KW["num_kv_blocks"]


# ---- negative controls: each feature, switched off in the engine, changes the tokens ----------
def _windows(w):
    def ablate(model):
        model.windows = tuple(w for _ in model.windows)
    return ablate


def _layers(**changes):
    def ablate(model):
        for layer in model.layers:
            for name, change in changes.items():
                setattr(layer, name, change(getattr(layer, name)))
    return ablate


def _no_rope_scaling(model):
    model.rope = RotaryTable(model.config.head_dim, model.config.rope_theta, model.dtype)


def _set(name, value):
    """Replace model.<name> by value(model)."""
    def ablate(model):
        setattr(model, name, value(model))
    return ablate


def _unscaled_full_rope(model):
    c = model.config
    return RotaryTable(c.head_dim, c.rope_theta, model.dtype)


_ONES, _NONE = torch.ones_like, (lambda t: None)
_W_NOT_1_PLUS_W = (lambda t: t - 1)   # Gemma stores 1 + w: this leaves w
ABLATIONS = {
    ("llama3", "rope scaling ignored"): _no_rope_scaling,
    ("qwen2.5", "disabled window applied anyway"): _windows(WINDOW),
    ("qwen2.5", "q/k/v bias dropped"): _layers(qkv_bias=_NONE),
    ("qwen2.5", "norm weights left at HF's init"): _layers(attn_norm=_ONES, mlp_norm=_ONES),
    ("qwen3", "q/k norm skipped"): _layers(q_norm=_NONE, k_norm=_NONE),
    ("qwen3", "q/k norm weights left at HF's init"): _layers(q_norm=_ONES, k_norm=_ONES),
    ("qwen3_window", "window ignored"): _windows(None),
    ("qwen3_window", "window on every layer"): _windows(WINDOW),
    ("mistral", "window ignored"): _windows(None),
    ("mistral", "window one token wider"): _windows(WINDOW + 1),
    ("mistral", "window one token narrower"): _windows(WINDOW - 1),
    ("gemma3", "layer norms scale by w, not 1 + w"): _layers(
        input_norm=_W_NOT_1_PLUS_W, post_attn_norm=_W_NOT_1_PLUS_W,
        pre_ffn_norm=_W_NOT_1_PLUS_W, post_ffn_norm=_W_NOT_1_PLUS_W),
    ("gemma3", "q/k norms scale by w, not 1 + w"): _layers(q_norm=_W_NOT_1_PLUS_W,
                                                           k_norm=_W_NOT_1_PLUS_W),
    ("gemma3", "embeddings not scaled by sqrt(hidden)"): _set(
        "embed_scale", lambda m: torch.ones_like(m.embed_scale)),
    ("gemma3", "local rope theta ignored"): _set("local_rope", lambda m: m.full_rope),
    ("gemma3", "linear rope scaling ignored"): _set("full_rope", _unscaled_full_rope),
    ("gemma3", "query_pre_attn_scalar ignored"): _set("attn_scale", lambda m: None),
    ("gemma3", "window ignored"): _windows(None),
    ("gemma3", "window on every layer"): _windows(WINDOW),
}


@pytest.mark.parametrize("family,ablation", list(ABLATIONS),
                         ids=[f"{f}: {a}" for f, a in ABLATIONS])
def test_feature_negative_control(family, ablation, family_dirs, hf_tokens):
    engine = _engine(family_dirs[family], enable_prefix_caching=False)
    ABLATIONS[(family, ablation)](engine.runner.model)
    got = _colocated(engine)
    assert len(got) == len(hf_tokens[family])
    assert got != hf_tokens[family], f"{family}: tokens unchanged with the {ablation}"
