"""The engine checks of bench/gpu_check.py: engine == HF greedy, and tok/s next to HF ``generate``."""
from __future__ import annotations

import time
import warnings

import torch

from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from pdserve.config import EngineSettings


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(torch.device(device))


def engine_generate(engine: LLMEngine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
    """Greedy ``n`` tokens (EOS ignored) for every prompt at once; (token ids per prompt, steps)."""
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_work() and steps < 100_000:
        for o in engine.step().outputs:
            out[o.request_id] += o.new_token_ids
        steps += 1
    return [out[f"r{i}"] for i in range(len(prompts))], steps


def hf_model(model_dir, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa").to(device).eval()


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    """HF ``generate``, greedy, exactly ``n`` new tokens, one batch (prompts of one length: no padding)."""
    ids = torch.tensor(prompts, device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def check_engine_vs_hf(model_dir, prompts: list[list[int]], n: int, device: str, num_kv_blocks: int) -> dict:
    """Engine greedy == HF greedy in fp32 with TF32 off; one HF ``generate`` per prompt."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = hf_model(model_dir, torch.float32, device)
    want = [hf_generate(hf, [p], n, device)[0] for p in prompts]
    del hf
    engine = LLMEngine(EngineSettings(dtype="float32", device=device, num_kv_blocks=num_kv_blocks), str(model_dir))
    got, _ = engine_generate(engine, prompts, n)
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    first = None
    if bad:
        g, w = got[bad[0]], want[bad[0]]
        first = {"prompt": bad[0], "at": next(j for j in range(n) if g[j] != w[j]), "engine": g[:8], "hf": w[:8]}
    return {"match": not bad, "prompts": len(prompts), "tokens": n, "mismatched_prompts": bad, "first_mismatch": first}


def _count_syncs(fn) -> tuple[object, int]:
    """Run ``fn`` with torch.cuda.set_sync_debug_mode("warn"); (its result, host syncs warned about)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


def check_throughput(model_dir, dtype: str, device: str, concurrency: list[int], prompt_len: int, n: int,
                     num_kv_blocks: int, vocab: int) -> list[dict]:
    """Engine output tok/s at each concurrency next to HF ``generate`` of the same batch (same run)."""
    from _gpu_shapes import random_prompts

    tdtype = getattr(torch, dtype)
    engine = LLMEngine(EngineSettings(dtype=dtype, device=device, num_kv_blocks=num_kv_blocks,
                                      max_batch_size=max(concurrency), max_num_tokens=max(2048, prompt_len)), str(model_dir))
    engine_generate(engine, random_prompts(vocab, [prompt_len], seed=99), 4)  # warm-up
    hf = hf_model(model_dir, tdtype, device)
    hf_generate(hf, random_prompts(vocab, [prompt_len], seed=99), 4, device)
    rows = []
    for c in concurrency:
        prompts = random_prompts(vocab, [prompt_len] * c, seed=c)
        _sync(device)
        t0 = time.perf_counter()
        if device == "cpu":
            (_, steps), syncs = engine_generate(engine, prompts, n), None
        else:
            (_, steps), syncs = _count_syncs(lambda: engine_generate(engine, prompts, n))
        _sync(device)
        t_engine = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_generate(hf, prompts, n, device)
        _sync(device)
        t_hf = time.perf_counter() - t0
        rows.append({"concurrency": c, "prompt_len": prompt_len, "output_len": n, "dtype": dtype,
                     "engine_tok_s": round(c * n / t_engine, 1), "hf_generate_tok_s": round(c * n / t_hf, 1),
                     "ratio": round(t_hf / t_engine, 2), "engine_steps": steps,
                     "host_syncs_per_step": None if syncs is None else round(syncs / max(steps, 1), 2)})
    return rows
