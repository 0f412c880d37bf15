"""Greedy output of the engine must equal HF transformers token for token (fp32)."""
import pytest
import torch

from engine.cpu_ops import load_library
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

from engine_testutil import PROMPTS, greedy, hf_greedy, run_all


def _engine_outputs(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    reqs = [EngineRequest(f"r{i}", p, greedy(n)) for i, p in enumerate(prompts)]
    res = run_all(engine, reqs)
    return [res[f"r{i}"]["tokens"] for i in range(len(prompts))]


def test_tiny_llama_matches_hf(tiny_engine, tiny_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    prompts = [tiny_engine.tokenizer.encode(p) for p in PROMPTS]
    ours = _engine_outputs(tiny_engine, prompts, 32)
    for p, got in zip(prompts, ours):
        assert got == hf_greedy(hf, p, 32)


@pytest.mark.parametrize("cpu_kernels", ["off", "auto"])
def test_tiny_llama_matches_hf_with_and_without_cpu_kernels(tiny_engine_factory, tiny_dir, cpu_kernels):
    """engine.cpu_kernels: the ATen path and pdserve's fused kernels both give HF's tokens, with
    chunked prefills next to decodes (a 7-token step budget). The default engines of this file
    run the kernels whenever `make install` built them."""
    from transformers import AutoModelForCausalLM
    engine = tiny_engine_factory(num_kv_blocks=64, max_num_tokens=7, cpu_kernels=cpu_kernels)
    expected = "pdserve_cpu" if cpu_kernels == "auto" and load_library() is None else "aten"
    assert engine.runner.model.ops.name == expected
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    for p, got in zip(prompts, _engine_outputs(engine, prompts, 12)):
        assert got == hf_greedy(hf, p, 12)


def test_tiny_llama_chunked_prefill_matches_hf(tiny_engine_factory, tiny_engine, tiny_dir):
    # A 7-token step budget: prompts are prefilled in chunks that attend to earlier chunks
    # through the paged cache (the masked path), next to decodes of the other prompts.
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    prompts = [tiny_engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    ours = _engine_outputs(tiny_engine_factory(num_kv_blocks=64, max_num_tokens=7), prompts, 12)
    for p, got in zip(prompts, ours):
        assert got == hf_greedy(hf, p, 12)


def test_smollm2_matches_hf(smollm2_engine, hf_smollm2):
    if load_library() is None:  # built by make install: the oracle covers the kernels' path
        assert smollm2_engine.runner.model.ops.name == "pdserve_cpu"
    tok = smollm2_engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:5]]
    ours = _engine_outputs(smollm2_engine, prompts, 32)
    for p, got in zip(prompts, ours):
        assert got == hf_greedy(hf_smollm2, p, 32)


def test_smollm2_chat_answer(smollm2_engine):
    tok = smollm2_engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    req = EngineRequest("paris", ids, SamplingParams(max_tokens=32, temperature=0))
    res = run_all(smollm2_engine, [req])["paris"]
    assert res["text"] == "The capital of France is Paris."
    last = res["outputs"][-1]
    assert last.finished and last.finish_reason == "stop"
    assert res["tokens"][-1] in tok.eos_token_ids
    assert tok.decode(res["tokens"]) == res["text"]


def test_model_config_of_smollm2(smollm2_engine):
    mc = smollm2_engine.model_config
    assert (mc.num_layers, mc.hidden_size, mc.intermediate_size) == (30, 576, 1536)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size) == (9, 3, 64, 49152)
    assert mc.tie_word_embeddings and mc.eos_token_ids == [2] and mc.bos_token_id == 1
    assert smollm2_engine.kv_cache.shape == (512, 30, 2, 16, 3, 64)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_tiny_bf16_runs_close_to_fp32(tiny_engine_factory, tiny_engine, dtype):
    eng = tiny_engine_factory(num_kv_blocks=64, dtype=dtype)
    assert eng.kv_cache.dtype == torch.bfloat16
    prompt = tiny_engine.tokenizer.encode(PROMPTS[0])
    bf = _engine_outputs(eng, [prompt], 8)[0]
    fp = _engine_outputs(tiny_engine, [prompt], 8)[0]
    assert len(bf) == 8 and bf[:2] == fp[:2]
