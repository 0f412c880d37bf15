"""The stage clocks: a step's and a loop iteration's wall time split by stage and kind."""
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.llm_engine import STEP_STAGES
from engine.step_timing import StageClock, step_kind
from executor.metrics import RoleStatsCollector


def test_laps_go_to_their_stage_and_commits_to_their_kind():
    clock = StageClock(("a", "b"), ("x", "y"))
    clock.start()
    time.sleep(0.02)
    clock.lap("a")
    clock.lap("b")  # nothing happened since the last mark: ~0
    clock.commit("x")
    clock.start()
    time.sleep(0.01)
    clock.lap("b")
    clock.commit("y")
    snap = clock.snapshot("p")
    assert snap["p_x_count"] == 1 and snap["p_y_count"] == 1
    assert 0.02 <= snap["p_x_a_s"] < 0.5 and snap["p_x_b_s"] < 0.005
    assert snap["p_y_a_s"] == 0.0 and 0.01 <= snap["p_y_b_s"] < 0.5


def test_start_forgets_laps_that_were_not_committed_and_unused_kinds_are_absent():
    clock = StageClock(("a",), ("x", "y"))
    clock.start()
    time.sleep(0.01)
    clock.lap("a")
    clock.start()  # the previous iteration was abandoned (e.g. the loop raised)
    clock.lap("a")
    clock.commit("x")
    snap = clock.snapshot("p")
    assert snap["p_x_a_s"] < 0.005 and "p_y_count" not in snap


def test_unknown_stage_or_kind_raises():
    clock = StageClock(("a",), ("x",))
    with pytest.raises(KeyError):
        clock.lap("b")
    with pytest.raises(KeyError):
        clock.commit("y")


@pytest.mark.parametrize("new_tokens, kind", [([], "empty"), ([1], "decode"), ([1, 1, 1], "decode"),
                                              ([1, 5], "prefill"), ([7], "prefill")])
def test_step_kind(new_tokens, kind):
    assert step_kind(new_tokens) == kind


def test_engine_steps_are_clocked_by_kind(tiny_engine):
    before = tiny_engine.stats()
    tiny_engine.add_request(EngineRequest("clock-1", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True)))
    t0 = time.perf_counter()
    kinds = []
    while tiny_engine.has_work():
        kinds.append(tiny_engine.step().kind)
    wall = time.perf_counter() - t0
    after = tiny_engine.stats()
    assert kinds == ["prefill", "decode", "decode", "decode"]
    assert after["step_prefill_count"] - before.get("step_prefill_count", 0) == 1
    assert after["step_decode_count"] - before.get("step_decode_count", 0) == 3
    spent = sum(after[f"step_{k}_{s}_s"] - before.get(f"step_{k}_{s}_s", 0.0)
                for k in ("prefill", "decode") for s in STEP_STAGES)
    assert 0 < spent <= wall + 1e-5  # stages never charge more than the steps took
    assert after["step_decode_forward_s"] > before.get("step_decode_forward_s", 0.0)


def test_metrics_export_the_clocks_by_kind_and_stage():
    stats = {"step_decode_count": 3, "step_decode_forward_s": 0.25, "step_decode_sample_s": 0.01,
             "loop_idle_count": 7, "loop_idle_wait_s": 0.7}
    registry = CollectorRegistry()
    registry.register(RoleStatsCollector(lambda: stats))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert samples[("pdserve_engine_steps_total", (("kind", "decode"),))] == 3
    assert samples[("pdserve_engine_step_stage_seconds_total", (("kind", "decode"), ("stage", "forward")))] == 0.25
    assert samples[("pdserve_engine_loop_iterations_total", (("kind", "idle"),))] == 7
    assert samples[("pdserve_engine_loop_stage_seconds_total", (("kind", "idle"), ("stage", "wait")))] == 0.7
    assert not any(name == "pdserve_engine_steps_total" and labels == (("kind", "prefill"),)
                   for name, labels in samples)


def test_move_recharges_part_of_a_stage_to_another():
    clock = StageClock(("a", "b"), ("x",))
    clock.start()
    time.sleep(0.02)
    clock.lap("b")
    clock.move("b", "a", 0.015)
    clock.commit("x")
    snap = clock.snapshot("p")
    assert snap["p_x_a_s"] == pytest.approx(0.015)
    assert 0.004 < snap["p_x_b_s"] < 0.5


def test_the_plan_stage_holds_the_input_tensors(tiny_engine):
    before_inputs, before = tiny_engine.runner.inputs_s, tiny_engine.stats()
    tiny_engine.add_request(EngineRequest("clock-2", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    while tiny_engine.has_work():
        tiny_engine.step()
    built = tiny_engine.runner.inputs_s - before_inputs
    after = tiny_engine.stats()
    plan = sum(after[f"step_{k}_plan_s"] - before.get(f"step_{k}_plan_s", 0.0) for k in ("prefill", "decode"))
    assert 0 < built <= plan + 1e-6  # the runner's input tensors are charged to the plan, not the forward
