"""Prompt logprobs in the engine: every prompt token's (but the first) equals HF's log-softmax, with
chunked prefill, on a prefix-cache hit (the request skips the cache) and after preemption."""
import pytest
import torch

from engine.request import EngineRequest

from engine_testutil import greedy, run_all


def _hf_rows(tiny_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)


def _check(entries, prompt, ref, k):
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e = entries[i]
        assert e.token_id == prompt[i]
        assert e.logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        assert [t for t, _ in e.top] == ref[i - 1].topk(k).indices.tolist()


def test_prompt_logprobs_chunked_and_on_a_cache_hit(tiny_engine_factory, tiny_dir):
    engine = tiny_engine_factory(num_kv_blocks=64, block_size=4, max_num_tokens=5)
    prompt = list(range(20, 37))  # 17 tokens: 4 full blocks, prefilled in chunks of 5
    ref = _hf_rows(tiny_dir, prompt)
    run_all(engine, [EngineRequest("warm", prompt, greedy(2))])  # caches the prompt's full blocks
    hits = engine.stats()["prefix_cache_hits"]
    res = run_all(engine, [EngineRequest("p", prompt, greedy(3, logprobs=2, prompt_logprobs=2))])["p"]
    assert engine.stats()["prefix_cache_hits"] == hits  # computed, not taken from the cache
    firsts = [o.prompt_logprobs for o in res["outputs"] if o.prompt_logprobs is not None]
    assert len(firsts) == 1
    _check(firsts[0], prompt, ref, 2)
    lps = [e for o in res["outputs"] for e in (o.new_logprobs or [])]
    assert [e.token_id for e in lps] == res["tokens"] and len(lps) == 3
    full = _hf_rows(tiny_dir, prompt + res["tokens"])
    for j, e in enumerate(lps):
        assert e.logprob == pytest.approx(full[len(prompt) - 1 + j, e.token_id].item(), abs=1e-4)


def test_prompt_logprobs_survive_preemption(tiny_engine_factory, tiny_dir):
    # 6 blocks of 4 for two 9-token prompts decoding 8 tokens each: one is preempted and recomputed.
    engine = tiny_engine_factory(num_kv_blocks=6, block_size=4, max_num_tokens=64)
    prompts = [list(range(40, 49)), list(range(60, 69))]
    reqs = [EngineRequest(f"r{i}", p, greedy(8, prompt_logprobs=1)) for i, p in enumerate(prompts)]
    preempted, real = [], engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append(seq.request_id), real(seq))
    res = run_all(engine, reqs)
    assert preempted  # the setup really preempts
    for i, p in enumerate(prompts):
        firsts = [o.prompt_logprobs for o in res[f"r{i}"]["outputs"] if o.prompt_logprobs is not None]
        assert len(firsts) == 1
        _check(firsts[0], p, _hf_rows(tiny_dir, p), 1)
