"""Continuous batching must not change greedy results; budgets and preemption hold."""
import time

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from engine.model_runner import ModelRunner
from pdserve.config import EngineSettings

from engine_testutil import PROMPTS, greedy, run_all

LONG = " ".join(["alpha beta gamma delta"] * 30)


def _prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    ps = [tok.encode(p) for p in PROMPTS] + [tok.encode(LONG), [tok.encode("Hi")[0]]]
    assert len(ps) == 8
    return ps


def _alone(engine, prompts, n=24):
    return [run_all(engine, [EngineRequest("solo", p, greedy(n))])["solo"]["tokens"]
            for p in prompts]


def test_concurrent_equals_alone(tiny_engine):
    prompts = _prompts(tiny_engine)
    res = run_all(tiny_engine, [EngineRequest(f"c{i}", p, greedy(24))
                                for i, p in enumerate(prompts)])
    assert [res[f"c{i}"]["tokens"] for i in range(8)] == _alone(tiny_engine, prompts)


def _record_steps(engine) -> list[list[int]]:
    steps: list[list[int]] = []
    orig = ModelRunner.plan

    def spy(items):
        steps.append([k for _, k in items])
        return orig(engine.runner, items)
    engine.runner.plan = spy
    return steps


def test_token_budget_and_batch_size(tiny_engine_factory, tiny_engine):
    eng = tiny_engine_factory(num_kv_blocks=128, max_num_tokens=40, max_batch_size=3)
    steps = _record_steps(eng)
    prompts = _prompts(tiny_engine)
    res = run_all(eng, [EngineRequest(f"b{i}", p, greedy(24)) for i, p in enumerate(prompts)])
    assert steps and all(sum(s) <= 40 and len(s) <= 3 for s in steps)
    assert any(k == 40 for s in steps for k in s), "long prompt should be chunked at the budget"
    assert [res[f"b{i}"]["tokens"] for i in range(8)] == _alone(tiny_engine, prompts)


def test_preemption_gives_identical_output(tiny_engine_factory, tiny_engine):
    # 12 blocks * 4 tokens: eight sequences growing to ~40 tokens cannot all fit.
    eng = tiny_engine_factory(num_kv_blocks=12, block_size=4, max_batch_size=8)
    preempts = []
    orig = eng.scheduler.preempt
    eng.scheduler.preempt = lambda seq: (preempts.append(seq.request_id), orig(seq))
    prompts = [tiny_engine.tokenizer.encode(p) for p in PROMPTS] * 2
    res = run_all(eng, [EngineRequest(f"p{i}", p, greedy(20)) for i, p in enumerate(prompts)])
    assert preempts, "the tiny cache should force preemption"
    alone = _alone(tiny_engine, prompts[:len(PROMPTS)], n=20) * 2
    for i in range(len(prompts)):
        outs = res[f"p{i}"]["outputs"]
        assert res[f"p{i}"]["tokens"] == alone[i]
        assert sum(len(o.new_token_ids) for o in outs) == 20       # nothing emitted twice
        assert outs[-1].num_output_tokens == 20 and outs[-1].finish_reason == "length"


def test_engine_config_defaults(tiny_engine):
    cfg = tiny_engine.config
    assert isinstance(cfg, EngineSettings) and cfg.num_kv_blocks == 256  # the settings it was given, sized
    assert tiny_engine.max_model_len == min(2048, cfg.num_kv_blocks * cfg.block_size)
    assert isinstance(tiny_engine, LLMEngine)


def test_queue_time_reported_once_and_grows_with_the_queue(tiny_engine_factory, tiny_engine):
    """max_batch_size=1: the second request waits for the whole first one; each reports its queue time once."""
    eng = tiny_engine_factory(num_kv_blocks=64, max_batch_size=1)
    prompts = _prompts(tiny_engine)[:2]
    first_done = {}
    orig = eng.scheduler.finish

    def finish(seq):
        first_done[seq.request_id] = time.monotonic() - seq.arrival_s  # its time in the engine
        return orig(seq)

    eng.scheduler.finish = finish
    res = run_all(eng, [EngineRequest(f"q{i}", p, greedy(12)) for i, p in enumerate(prompts)])
    reported = {rid: [o.queue_time_s for o in r["outputs"] if o.queue_time_s is not None] for rid, r in res.items()}
    assert [len(v) for v in reported.values()] == [1, 1]
    assert 0 <= reported["q0"][0] < reported["q1"][0]
    assert reported["q1"][0] >= 0.9 * first_done["q0"]  # q1 was admitted only after q0 finished
    stats = eng.stats()
    assert {k: stats[k] for k in ("free_blocks", "total_blocks", "waiting_requests", "scheduled_requests",
                                  "pulling_requests", "parked_requests")} == {
        "free_blocks": 64, "total_blocks": 64, "waiting_requests": 0, "scheduled_requests": 0,
        "pulling_requests": 0, "parked_requests": 0}
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts) and stats["prefix_cache_hits"] == 0
