"""Model families under tensor parallelism 2 (2 KV heads: one per rank): greedy tokens == HF
transformers, with a 16-token step budget (chunked prefills next to decodes)."""
import time

import pytest

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest

from engine_testutil import cpu_settings, greedy
from engine_tp_testutil import run_group
from families import FAMILIES, N_NEW, prompts

TP_KW = dict(num_kv_blocks=64, max_num_tokens=16)


def _run_families(tp, dirs: dict[str, str], prompt_ids: list[list[int]]) -> dict:
    """Each rank: every family in turn; rank 0 drives and returns its tokens, followers follow."""
    out = {}
    for name, path in dirs.items():
        engine = LLMEngine(cpu_settings(**TP_KW), path, tp)
        if tp.rank != 0:
            engine.run_follower()
            out[name] = {"local_kv_heads": engine.local_kv_heads}
            continue
        for i, p in enumerate(prompt_ids):
            engine.add_request(EngineRequest(f"r{i}", p, greedy(N_NEW)))
        tokens = {f"r{i}": [] for i in range(len(prompt_ids))}
        while engine.has_work():
            for o in engine.step().outputs:
                tokens[o.request_id] += o.new_token_ids
        engine.stop_followers()
        out[name] = {"tokens": [tokens[f"r{i}"] for i in range(len(prompt_ids))],
                     "local_kv_heads": engine.local_kv_heads,
                     "free_blocks": engine.num_free_blocks}
    return out


@pytest.fixture(scope="module")
def tp2_families(family_dirs):
    t0 = time.perf_counter()
    res = run_group(_run_families, 2, {n: str(p) for n, p in family_dirs.items()}, prompts(),
                    timeout_s=120.0)
    for rank, (status, value) in res.items():
        assert status == "ok", f"rank {rank} failed:\n{value}"
    print(f"TP=2 families ran in {time.perf_counter() - t0:.1f} s")
    return res[0][1], res[1][1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_family_matches_hf(family, tp2_families, hf_tokens):
    r0, r1 = tp2_families
    assert r0[family]["local_kv_heads"] == r1[family]["local_kv_heads"] == 1
    assert r0[family]["free_blocks"] == TP_KW["num_kv_blocks"]
    assert r0[family]["tokens"] == hf_tokens[family]
