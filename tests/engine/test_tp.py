"""Tensor parallel: TP=2 greedy == TP=1 greedy (even and uneven head splits), follower protocol.

The TP=2 groups are spawned processes on loopback (gloo); the TP=1 references run in pytest.
"""
import os
import time

import pytest

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.tiny import make_tiny_llama
from engine.tp import TPContext, kv_head_range, split_range

from engine_testutil import PROMPTS, cpu_settings, greedy, run_all
from engine_tp_testutil import run_group

N_NEW = 24
TINY_KW = dict(num_kv_blocks=64, max_num_tokens=48)   # 48-token budget: chunked prefills
SMOL_KW = dict(num_kv_blocks=512)                     # == the smollm2_engine fixture


# ---- partition ---------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,size,expected", [
    (2, 2, [(0, 1), (1, 2)]), (3, 2, [(0, 1), (1, 3)]), (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (8, 3, [(0, 2), (2, 5), (5, 8)]), (5, 1, [(0, 5)]),
    (32, 4, [(0, 8), (8, 16), (16, 24), (24, 32)]),
])
def test_kv_head_range(heads, size, expected):
    assert [kv_head_range(heads, r, size) for r in range(size)] == expected


def test_kv_head_range_rejects():
    with pytest.raises(ValueError):
        kv_head_range(2, 0, 3)          # a rank would hold no head
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError):
            kv_head_range(4, rank, size)
    with pytest.raises(ValueError):
        TPContext(rank=1, size=1)


def test_split_range_covers_everything():
    for n in (1, 99, 128, 1536):
        for size in (1, 2, 3, 4):
            parts = [split_range(n, r, size) for r in range(size)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


def test_no_tp_engine_is_unchanged(tiny_engine):
    assert tiny_engine.tp.size == 1 and tiny_engine.local_kv_heads == 2
    assert tiny_engine.kv_cache.shape[4] == 2
    tiny_engine.broadcast_extra("nobody listens")   # no-ops without TP
    tiny_engine.stop_followers()
    with pytest.raises(RuntimeError):
        tiny_engine.run_follower()


# ---- TP=2 group ----------------------------------------------------------------------------------
def _drive(engine: LLMEngine, name: str, prompts: list[list[int]]) -> dict:
    """Rank 0: run prompts concurrently, one extra per step; record what was sent."""
    forwards = _count_forwards(engine)
    sent = [(("begin", name), 0)]
    engine.broadcast_extra(("begin", name))
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, greedy(N_NEW)))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while engine.has_work():
        extra = ("step", name, step)
        sent.append((extra, forwards[0]))
        for o in engine.step(extra=extra).outputs:
            tokens[o.request_id] += o.new_token_ids
        step += 1
    sent.append((("idle", name), forwards[0]))
    engine.step(extra=("idle", name))     # no model run: an extra-only broadcast
    assert engine.num_free_blocks == engine.config.num_kv_blocks
    return {"tokens": [tokens[f"r{i}"] for i in range(len(prompts))], "sent": sent,
            "local_kv_heads": engine.local_kv_heads, "kv_shape": tuple(engine.kv_cache.shape),
            "prefix_cache_hits": engine.stats()["prefix_cache_hits"]}


def _count_forwards(engine: LLMEngine) -> list[int]:
    """Wrap engine.runner.forward; the returned one-item list counts its calls."""
    count, run = [0], engine.runner.forward

    def counting_forward(*a, **kw):
        count[0] += 1
        return run(*a, **kw)
    engine.runner.forward = counting_forward
    return count


def _follow(engine: LLMEngine) -> dict:
    """Ranks > 0: record each extra with the number of forwards run before it."""
    got, forwards = [], _count_forwards(engine)
    engine.run_follower(on_extra=lambda e: got.append((e, forwards[0])))
    return {"sent": got, "stopped": True, "local_kv_heads": engine.local_kv_heads,
            "kv_shape": tuple(engine.kv_cache.shape)}


def _tp_scenarios(tp, scenarios):
    """Each rank: for every (name, model, engine kwargs, prompts) build an engine and run it."""
    out = {}
    for name, model, kw, prompts in scenarios:
        engine = LLMEngine(cpu_settings(**kw), model, tp)
        out[name] = _drive(engine, name, prompts) if tp.rank == 0 else _follow(engine)
        if tp.rank == 0:
            engine.stop_followers()
    return out


def _prompts(tok, n_min_tokens: int) -> list[list[int]]:
    texts = [PROMPTS[1] + " " + PROMPTS[0] * 12, PROMPTS[2] + "\n    " + PROMPTS[4] * 9,
             PROMPTS[5] * 16]
    out = [tok.encode(t) for t in texts]
    assert all(len(p) > n_min_tokens for p in out)
    return out


@pytest.fixture(scope="module")
def uneven_tiny_dir(tmp_path_factory, tiny_dir):
    # 3 KV heads (2 q heads each, head_dim 16) and an odd FFN width: both split unevenly over TP=2
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_uneven") / "llama", seed=1,
                           tokenizer_from=str(tiny_dir), num_attention_heads=6,
                           num_key_value_heads=3, hidden_size=96,
                           intermediate_size=99)


@pytest.fixture(scope="module")
def tp2_run(tiny_dir, uneven_tiny_dir, smollm2_engine):
    tok = smollm2_engine.tokenizer
    prompts = _prompts(tok, 3 * 16)
    # Prompts sharing a 3-block head: with the 48-token budget the later ones are admitted after
    # the first one's head is computed, so they start after its cached blocks.
    shared = [prompts[0][:48] + p[:20] for p in prompts]
    scenarios = [("tiny_even", str(tiny_dir), TINY_KW, prompts),
                 ("tiny_uneven", str(uneven_tiny_dir), TINY_KW, prompts),
                 ("smollm2", "smollm2", SMOL_KW, prompts),
                 ("tiny_uneven_shared", str(uneven_tiny_dir), TINY_KW, shared)]
    t0 = time.perf_counter()
    res = run_group(_tp_scenarios, 2, scenarios, timeout_s=60.0)
    for rank, (status, value) in res.items():
        assert status == "ok", f"rank {rank} failed:\n{value}"
    print(f"TP=2 group ran in {time.perf_counter() - t0:.1f} s")
    return {name: (res[0][1][name], res[1][1][name]) for name, *_ in scenarios}, prompts, shared


def _tp1_tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    res = run_all(engine, [EngineRequest(f"r{i}", p, greedy(N_NEW)) for i, p in enumerate(prompts)])
    return [res[f"r{i}"]["tokens"] for i in range(len(prompts))]


def test_tp2_tiny_even_matches_tp1(tp2_run, tiny_engine_factory):
    runs, prompts, _ = tp2_run
    r0, r1 = runs["tiny_even"]
    assert (r0["local_kv_heads"], r1["local_kv_heads"]) == (1, 1)
    assert r0["kv_shape"] == r1["kv_shape"] == (64, 2, 2, 16, 1, 16)
    assert r0["tokens"] == _tp1_tokens(tiny_engine_factory(**TINY_KW), prompts)


def test_tp2_tiny_uneven_matches_tp1(tp2_run, uneven_tiny_dir):
    runs, prompts, _ = tp2_run
    r0, r1 = runs["tiny_uneven"]
    assert (r0["local_kv_heads"], r1["local_kv_heads"]) == (1, 2)
    assert (r0["kv_shape"][4], r1["kv_shape"][4]) == (1, 2)
    ref = LLMEngine(cpu_settings(**TINY_KW), str(uneven_tiny_dir))
    assert r0["tokens"] == _tp1_tokens(ref, prompts)


def test_tp2_smollm2_matches_tp1(tp2_run, smollm2_engine):
    runs, prompts, _ = tp2_run
    r0, r1 = runs["smollm2"]
    assert (r0["local_kv_heads"], r1["local_kv_heads"]) == (1, 2)
    assert r0["kv_shape"] == (512, 30, 2, 16, 1, 64) and r1["kv_shape"][4] == 2
    assert r0["tokens"] == _tp1_tokens(smollm2_engine, prompts)


def test_tp2_prefix_cache_hits_match_tp1_uncached(tp2_run, uneven_tiny_dir):
    runs, _, shared = tp2_run
    r0, _ = runs["tiny_uneven_shared"]
    assert r0["prefix_cache_hits"] >= 2 * 48, "the later prompts should start after the cached head"
    ref = LLMEngine(cpu_settings(enable_prefix_caching=False, **TINY_KW), str(uneven_tiny_dir))
    assert r0["tokens"] == _tp1_tokens(ref, shared)


@pytest.mark.parametrize("name", ["tiny_even", "tiny_uneven", "smollm2", "tiny_uneven_shared"])
def test_extras_arrive_in_order_before_their_step(tp2_run, name):
    r0, r1 = tp2_run[0][name]
    assert r1["stopped"]
    # same extras, same order, each seen after exactly the forwards rank 0 ran before it
    assert r1["sent"] == r0["sent"]
    assert len(r0["sent"]) > N_NEW


# ---- liveness ------------------------------------------------------------------------------------
def _idle_then_hang(tp, model, timeout_s):
    if tp.rank == 0:  # a slow start-up (a loaded machine) past the collective timeout is not a hang:
        time.sleep(timeout_s + 1.0)  # the start-up barriers are bounded by the rendezvous timeout
    engine = LLMEngine(cpu_settings(num_kv_blocks=8), model, tp)
    if tp.rank == 0:
        time.sleep(1.5 * timeout_s)         # idle, no step(): the keepalive thread speaks
        engine.broadcast_extra("hang")
        engine._plans._stop.set()           # simulate a hung rank 0: keepalives stop
        time.sleep(timeout_s + 1.5)
        return "done"
    marks = []
    try:
        engine.run_follower(on_extra=lambda e: marks.append((e, time.monotonic())))
    except RuntimeError as e:
        return {"error": str(e)[:200], "waited": time.monotonic() - marks[-1][1],
                "extras": [m[0] for m in marks]}
    return {"error": None}


def test_follower_survives_idle_rank0_and_times_out_on_hung_one(tiny_dir):
    timeout_s = 3.0
    res = run_group(_idle_then_hang, 2, str(tiny_dir), timeout_s, timeout_s=timeout_s)
    assert res[0] == ("ok", "done"), res
    status, value = res[1]
    assert status == "ok" and value["error"], value
    assert value["extras"] == ["hang"]        # keepalives are invisible to on_extra
    assert timeout_s * 0.9 <= value["waited"] <= timeout_s * 1.25 + 3


def _rank0_dies(tp, model):
    engine = LLMEngine(cpu_settings(num_kv_blocks=8), model, tp)
    if tp.rank == 0:
        engine.broadcast_extra("bye")
        time.sleep(0.5)
        os._exit(3)                         # no STOP, no clean shutdown
    t0 = []
    try:
        engine.run_follower(on_extra=lambda e: t0.append(time.monotonic()))
    except RuntimeError as e:
        return {"error": str(e)[:200], "waited": time.monotonic() - t0[0]}
    return {"error": None}


def test_follower_fails_fast_when_rank0_dies(tiny_dir):
    res = run_group(_rank0_dies, 2, str(tiny_dir), timeout_s=30.0, wait_s=60.0, expect=[1])
    status, value = res[1]
    assert status == "ok" and value["error"], value
    assert value["waited"] < 10       # the broken connection is seen long before the 30 s timeout
