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
# measured 2026-12-01 with -n 0 on this 2-core machine at load 13-21 (other sessions' work: about
# 3-4x an idle run; only the order matters here). "est.": not measured that day; the suite's own
# durations on a clean clone (README, Tests) times the same factor.
COST_S: dict[str, float] = {
    "tests/integration/test_kv_faults.py": 380,
    "tests/integration/test_lattice_frontends.py": 375,  # the K-frontends half of the old test_lattice.py
    "tests/control_plane/test_launched_cluster.py": 305,
    "tests/integration/test_lattice.py": 295,
    "tests/control_plane/test_layout_join.py": 295,
    "tests/integration/test_disagg_tiny.py": 255,
    "tests/engine/test_model_families.py": 220,
    "tests/control_plane/test_chaos.py": 210,
    "tests/control_plane/test_restart.py": 195,
    "tests/engine/test_choices.py": 195,
    "tests/engine/test_model_vs_hf.py": 175,
    "tests/integration/test_abandoned.py": 155,
    "tests/engine/test_families_tp.py": 145,
    "tests/engine/test_gguf_tokenizer.py": 145,
    "tests/engine/test_disagg.py": 145,
    "tests/integration/test_idle_cpu.py": 135,
    "tests/control_plane/test_slurm.py": 95,
    "tests/integration/test_gen_first.py": 80,
    "tests/engine/test_tp.py": 75,
    "tests/engine/test_choices_interactions.py": 55,
    "tests/engine/test_prefix_cache.py": 40,
    "tests/integration/test_kv_routing_tiny.py": 30,
    "tests/engine/test_kv_move.py": 30,
    "tests/engine/test_partial_pull.py": 20,
    "tests/engine/test_cpu_linear.py": 20,
    "tests/engine/test_kv_memory.py": 15,
    "tests/integration/test_drain_move.py": 15,
    "tests/integration/test_endpoints.py": 15,
    "tests/integration/test_choices_tiny.py": 15,
    "tests/engine/test_prefix_cache_random.py": 10,
    "tests/engine/test_grammar_mask.py": 10,
    "tests/engine/test_scheduler.py": 10,
    "tests/integration/test_structured_output_smollm2.py": 450,  # est.: 145 s in the README's -n 2 run
    "tests/integration/test_tp.py": 250,  # est.: 55 s of setup in the README's run, plus its calls
    "tests/integration/test_smollm2_e2e.py": 150,  # est.: a SmolLM2 `pdserve up`, then 12 requests
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
