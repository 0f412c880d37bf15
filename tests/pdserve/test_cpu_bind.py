"""``engine.cpu_bind``: its syntax, its config errors and each rank's plan (pdserve.cpu_bind)."""

from __future__ import annotations

import pytest

from pdserve.config import EngineSettings, TopologyError, parse_topology
from pdserve.cpu_bind import fmt, omp_env, parse_cpu_list, plan_rank

SERVERS = {"ctx": {"servers": [{"port": 8001}]}, "gen": {"servers": [{"port": 8002}]}}


@pytest.mark.parametrize("text,cores", [("0", (0,)), ("0-1", (0, 1)), ("3,0-1", (0, 1, 3)), (" 2 , 2-3", (2, 3))])
def test_cpu_lists_parse_as_taskset_reads_them(text, cores):
    assert parse_cpu_list(text) == cores
    assert parse_cpu_list(fmt(cores)) == cores


@pytest.mark.parametrize("engine,message", [
    ({"cpu_bind": "0-x"}, "engine.cpu_bind: Value error, bad CPU list '0-x'"),
    ({"cpu_bind": "2-1"}, "'2-1' is not a range of core numbers"),
    ({"cpu_bind": ""}, "bad CPU list ''"),
    ({"cpu_bind": "0-1", "num_threads": 1}, "names 2 core(s); tp_size 1 × num_threads 1 needs exactly 1"),
    ({"cpu_bind": "0-2", "tp_size": 2}, "do not split evenly over tp_size 2 ranks"),
    ({"cpu_bind": "0", "executor": "inproc"}, "executor 'inproc' has no worker ranks"),
])
def test_a_bad_cpu_bind_is_a_config_error_that_says_why(engine, message):
    with pytest.raises(TopologyError) as err:
        parse_topology({"engine": engine, "pools": SERVERS})
    assert message in str(err.value)


def test_a_pool_override_is_checked_against_the_settings_it_inherits():
    doc = {"engine": {"num_threads": 1}, "pools": {**SERVERS, "gen": {**SERVERS["gen"], "engine": {"cpu_bind": "0-1"}}}}
    with pytest.raises(TopologyError) as err:
        parse_topology(doc)
    assert "pools.gen.engine (merged with the top-level engine): Value error, cpu_bind '0-1' names 2" in str(err.value)


def test_yaml_integers_and_the_modes_are_accepted():
    assert EngineSettings().cpu_bind == "auto"
    assert EngineSettings(cpu_bind=1, num_threads=1).cpu_bind == "1"  # `cpu_bind: 1` in YAML
    assert EngineSettings(cpu_bind="off", executor="inproc").cpu_bind == "off"


def test_auto_pins_only_a_process_whose_mask_is_narrower_than_the_host():
    whole = plan_rank("auto", 2, 1, 0, {0, 1}, host_cpus=2)
    assert whole.cores == () and "all 2 CPUs" in whole.reason  # side by side servers: never the same core
    part = plan_rank("auto", 2, 1, 0, {4, 5}, host_cpus=8)
    assert part.cores == (4, 5) and part.threads == 2


@pytest.mark.parametrize("threads,mask", [(4, {4, 5}), (1, {4, 5}), (None, {4, 5})])
def test_auto_does_not_pin_a_mask_not_sized_for_this_server(threads, mask):
    # a mask shared by several servers (the whole cluster under one taskset) would pin them all to its first cores
    plan = plan_rank("auto", threads, 1, 0, mask, host_cpus=8)
    assert plan.cores == () and "not exactly" in plan.reason


def test_tp_ranks_take_disjoint_slices():
    assert [plan_rank("0-3", 2, 2, r, {0, 1, 2, 3}, 4).cores for r in (0, 1)] == [(0, 1), (2, 3)]
    assert [plan_rank("auto", 1, 2, r, {2, 6}, 8).cores for r in (0, 1)] == [(2,), (6,)]


def test_an_explicit_core_outside_the_mask_is_refused():
    with pytest.raises(ValueError, match=r"core\(s\) 1 are outside this process's affinity mask 0"):
        plan_rank("0-1", 2, 1, 0, {0}, 2)
    assert plan_rank("off", 2, 1, 0, {0, 1}, 2).cores == ()


def test_the_openmp_environment_places_thread_i_on_core_i():
    assert omp_env((2, 5)) == {"OMP_PLACES": "{2},{5}", "OMP_PROC_BIND": "close", "OMP_NUM_THREADS": "2"}
    assert omp_env(()) == {}


# engine.openmp_wait (omp_wait_env): what a rank's idle OpenMP threads do between parallel regions

def test_openmp_wait_auto_spins_only_on_pinned_threads():
    from pdserve.cpu_bind import SPIN_COUNT, omp_wait_env

    env, why = omp_wait_env("auto", True, {})
    assert env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)} and "spin" in why and "pinned" in why
    env, why = omp_wait_env("auto", False, {})
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"} and "passive" in why


@pytest.mark.parametrize("given", [{"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "5"}])
def test_openmp_wait_auto_keeps_the_operators_environment(given):
    from pdserve.cpu_bind import omp_wait_env

    env, why = omp_wait_env("auto", True, {"PATH": "/bin", **given})
    assert env == {} and "kept the environment's" in why and next(iter(given)) in why


def test_openmp_wait_explicit_overrides_the_environment():
    from pdserve.cpu_bind import SPIN_COUNT, omp_wait_env

    # GOMP_SPINCOUNT takes precedence over OMP_WAIT_POLICY in libgomp: 'spin' beats an inherited PASSIVE
    assert omp_wait_env("spin", False, {"OMP_WAIT_POLICY": "PASSIVE"})[0] == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    assert omp_wait_env("passive", True, {"GOMP_SPINCOUNT": "99"})[0] == {"OMP_WAIT_POLICY": "PASSIVE",
                                                                          "GOMP_SPINCOUNT": "0"}


def test_openmp_wait_setting_is_checked():
    from pdserve.config import EngineSettings

    assert EngineSettings().openmp_wait == "auto"
    with pytest.raises(ValueError, match="openmp_wait"):
        EngineSettings(openmp_wait="busy")


def test_openmp_wait_needs_worker_ranks():
    from pdserve.config import EngineSettings

    assert EngineSettings(executor="inproc").openmp_wait == "auto"
    with pytest.raises(ValueError, match="openmp_wait 'spin' is set by worker ranks"):
        EngineSettings(executor="inproc", openmp_wait="spin")
