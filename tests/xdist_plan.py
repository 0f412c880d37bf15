"""How ``make test`` spreads the test files over its pytest-xdist workers (``-n 2 --dist loadfile``).

xdist's ``loadfile`` hands out whole files, by default sorted by their number of tests
(``--loadscope-reorder``): a file of one 70 s test (the chaos test) then starts last and one
worker runs it alone at the end while the other idles. Here, instead (tests/conftest.py installs
both hooks):

- :func:`order_items`: the files run longest first (LPT, "longest processing time first": for two
  workers the makespan is within 7/6 of the best possible, Graham 1969, "Bounds on
  multiprocessing timing anomalies"), by :data:`COST_S`; unlisted files follow in collection order.
- :class:`PlannedScheduling`: ``loadfile`` whose work unit is a file, or one group of
  :data:`SHARED` (files sharing an expensive session fixture: on one worker it is built once, not
  once per worker), given out in that order.

:data:`COST_S` is measured, not guessed: seconds of setup + call + teardown per file on 2 cores
(``python -m pytest tests/<dir> -n 0 --junitxml=J.xml``, then ``python -m tests.xdist_plan J.xml ...``
prints each file's total). A file that takes more than ~10 s belongs in it.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter

# Seconds per file (setup + call + teardown; a session fixture counts in the first file using it),
# measured 2026-12-02 in a whole-suite run (-n 2, --junitxml) on this 2-core machine at 1-min load 1.5-20
# (median 13: other sessions' work; 2,620 s, about 3.6x an idle run; only the order matters here).
# Every file of 10 s or more is listed: unlisted files run after all listed ones, and files that
# were missing here (the fuzz, the migration and prefix-cache clusters, ...) had started last.
COST_S: dict[str, float] = {
    "tests/integration/test_structured_output_smollm2.py": 339,
    "tests/integration/test_tp.py": 264,
    "tests/fuzz/test_fuzz_in_process.py": 257,
    "tests/integration/test_disagg_tiny.py": 240,
    "tests/integration/test_migration_tiny.py": 226,
    "tests/integration/test_lattice.py": 213,
    "tests/engine/test_model_vs_hf.py": 205,
    "tests/integration/test_smollm2_e2e.py": 151,  # est.: 248 measured, less half its SmolLM2 requests (now one test)
    "tests/integration/test_prefix_cache_tiny.py": 144,
    "tests/control_plane/test_chaos.py": 137,
    "tests/integration/test_server_lifecycle.py": 134,
    "tests/control_plane/test_launched_cluster.py": 130,
    "tests/control_plane/test_restart.py": 122,
    "tests/engine/test_model_families.py": 108,
    "tests/integration/test_abandoned.py": 107,
    "tests/orchestrator/test_orch_relay.py": 102,
    "tests/kv_transfer/test_ucx_faults.py": 102,
    "tests/engine/test_tp.py": 102,
    "tests/integration/test_kv_faults.py": 98,
    "tests/orchestrator/test_orch_workers.py": 96,
    "tests/integration/test_gen_first.py": 89,
    "tests/engine/test_disagg.py": 87,
    "tests/integration/test_lease_expiry.py": 86,
    "tests/control_plane/test_slurm.py": 84,
    "tests/integration/test_idle_cpu.py": 80,
    "tests/control_plane/test_layout_join.py": 78,
    "tests/orchestrator/test_orch_validation.py": 76,
    "tests/integration/test_sampling_fields.py": 76,
    "tests/orchestrator/test_orch_tools.py": 63,
    "tests/bench/test_gpu_check.py": 63,
    "tests/integration/test_lattice_frontends.py": 62,
    "tests/bench/test_bench_cli.py": 60,
    "tests/engine/test_prefix_cache.py": 58,
    "tests/integration/test_cpu_bind.py": 58,  # measured alone at load ~15 (two servers started at once)
    "tests/integration/test_structured_output_tiny.py": 56,
    "tests/engine/test_choices.py": 54,
    "tests/integration/test_tools_tiny.py": 48,
    "tests/kv_transfer/test_ucx_stress.py": 41,
    "tests/integration/test_drain_move.py": 39,
    "tests/engine/test_choices_interactions.py": 36,
    "tests/engine/test_families_tp.py": 32,
    "tests/engine/test_partial_pull.py": 31,
    "tests/integration/test_choices_tiny.py": 29,
    "tests/engine/test_kv_move.py": 28,
    "tests/orchestrator/test_orch_failures.py": 26,
    "tests/integration/test_kv_routing_tiny.py": 22,
    "tests/engine/test_gguf_tokenizer.py": 19,
    "tests/kv_transfer/test_ucx_processes.py": 17,
    "tests/engine/test_structured_output_engine.py": 17,
    "tests/orchestrator/test_orch_gen_first.py": 16,
    "tests/orchestrator/test_orch_flow.py": 15,
    "tests/executor/test_import_graph.py": 15,
    "tests/orchestrator/test_orch_launcher.py": 13,
    "tests/orchestrator/test_orch_identity.py": 13,
    "tests/bench/test_floor.py": 13,
    "tests/fuzz/test_body_limit.py": 12,
    "tests/orchestrator/test_orch_control.py": 11,
    "tests/integration/test_endpoints.py": 11,
    "tests/engine/test_stops_sampling.py": 11,
    "tests/orchestrator/test_orch_prefix_cache.py": 10,
}

# Groups of files run as one unit on one worker (name -> files), each sharing a session fixture
# that is built once per worker using it (tests/integration/conftest.py, tests/engine/conftest.py).
SHARED: dict[str, tuple[str, ...]] = {
    "tiny_cluster": ("tests/integration/test_disagg_tiny.py", "tests/integration/test_fuzz_keepalive.py",
                     "tests/integration/test_openai_client.py"),
    "smollm2_engine": ("tests/engine/test_disagg.py", "tests/engine/test_model_vs_hf.py", "tests/engine/test_tp.py"),
    "family_dirs": ("tests/engine/test_model_families.py", "tests/engine/test_families_tp.py",
                    "tests/engine/test_sliding_window_cache.py", "tests/engine/test_gemma3.py"),
}



def unit_of(nodeid: str) -> str:
    """The work unit of a test id (``tests/a/test_b.py::test_c[x]``): its :data:`SHARED` group's
    name, else its file."""
    path = nodeid.split("::", 1)[0]
    return next((name for name, paths in SHARED.items() if path in paths), path)


def unit_cost(unit: str) -> float:
    """Seconds of a unit (a file or a :data:`SHARED` group): the sum of its files' :data:`COST_S`."""
    return sum(COST_S.get(path, 0.0) for path in SHARED.get(unit, (unit,)))


def order_items(items: list) -> None:
    """Sort collected pytest items in place: units by cost, longest first; inside a unit and among
    equal costs, the collection order (so a module's tests stay together and in file order)."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(unit_of(item.nodeid), i)
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (-unit_cost(unit_of(it.nodeid)), first[unit_of(it.nodeid)], position[id(it)]))


def make_scheduler(config, log):
    """:class:`PlannedScheduling` for ``--dist loadfile``, else None (xdist's own)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler.loadscope import LoadScopeScheduling

    class PlannedScheduling(LoadScopeScheduling):
        """``loadfile`` with :func:`unit_of`'s units, given out in collection order (which
        :func:`order_items` made longest first) instead of by number of tests."""

        def __init__(self, config, log=None) -> None:
            config.option.loadscopereorder = False
            super().__init__(config, log)

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return PlannedScheduling(config, log)


def file_costs(junit_paths: list[str]) -> Counter:
    """file path -> seconds, summed over the test cases of pytest junit XML reports."""
    costs: Counter = Counter()
    for path in junit_paths:
        for case in ET.parse(path).iter("testcase"):
            costs[case.get("file") or _file_of(case.get("classname", ""))] += float(case.get("time", 0))
    return costs


def _file_of(classname: str) -> str:
    """``tests.integration.test_tp`` -> ``tests/integration/test_tp.py`` (junit's classname)."""
    return classname.replace(".", "/") + ".py"


if __name__ == "__main__":  # python -m tests.xdist_plan J.xml ...: each file's seconds, longest first
    for name, seconds in file_costs(sys.argv[1:]).most_common():
        print(f"    {name!r}: {seconds:.0f},")
