"""Helpers shared by the engine tests (not fixtures)."""
from __future__ import annotations

import inspect

import torch

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from pdserve.config import EngineSettings


def cpu_settings(**kw) -> EngineSettings:
    """Engine settings of a test engine: float32 on the CPU (what the HF references compute in),
    ``kw`` on top (EngineSettings fields; ValidationError for another name)."""
    return EngineSettings(**{"dtype": "float32", "device": "cpu", **kw})


def greedy(max_tokens: int = 32, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_all(engine: LLMEngine, reqs: list[EngineRequest], max_steps: int = 10_000) -> dict:
    """Add reqs, step until idle; return request_id -> dict(tokens, text, outputs)."""
    for r in reqs:
        engine.add_request(r)
    res = {r.request_id: {"tokens": [], "text": "", "outputs": []} for r in reqs}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for o in engine.step().outputs:
            d = res[o.request_id]
            d["tokens"] += o.new_token_ids
            d["text"] += o.new_text
            d["outputs"].append(o)
    assert not engine.has_work(), "engine did not finish"
    assert engine.num_free_blocks == engine.config.num_kv_blocks, "blocks leaked"
    return res


def _cache_kwarg(model) -> str:
    # transformers renamed `past_key_values` to `cache` (5.x deprecation).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decode with HF transformers' own KV cache."""
    out_ids: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_ids.append(tok)
            out = model(torch.tensor([[tok]]), use_cache=True,
                        **{_cache_kwarg(model): out.past_key_values})
    return out_ids


PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "1, 2, 3, 4, 5,",
]
