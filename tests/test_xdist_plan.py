"""tests/xdist_plan.py: the suite's files run longest first, SHARED groups as one unit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import xdist_plan
from tests.integration.procs import ROOT


@dataclass
class Item:
    nodeid: str


@pytest.fixture
def plan(monkeypatch):
    monkeypatch.setattr(xdist_plan, "COST_S", {"tests/a.py": 5, "tests/b.py": 30, "tests/c.py": 20, "tests/d.py": 1})
    monkeypatch.setattr(xdist_plan, "SHARED", {"pair": ("tests/c.py", "tests/d.py")})


def ids(items: list[Item]) -> list[str]:
    return [i.nodeid for i in items]


def test_units_run_longest_first_and_keep_their_tests_in_file_order(plan):
    items = [Item(n) for n in ("tests/a.py::t1", "tests/d.py::t1", "tests/new.py::t1", "tests/b.py::t1",
                               "tests/a.py::t2", "tests/c.py::t1", "tests/b.py::t2[x]", "tests/old.py::t1")]
    xdist_plan.order_items(items)
    # b (30 s), then the pair c + d (21 s, d first: it was collected first), a (5 s), then the
    # unlisted files in collection order
    assert ids(items) == ["tests/b.py::t1", "tests/b.py::t2[x]", "tests/d.py::t1", "tests/c.py::t1",
                          "tests/a.py::t1", "tests/a.py::t2", "tests/new.py::t1", "tests/old.py::t1"]


def test_a_shared_group_is_one_unit(plan):
    assert xdist_plan.unit_of("tests/c.py::t[1]") == xdist_plan.unit_of("tests/d.py::t") == "pair"
    assert xdist_plan.unit_of("tests/a.py::t") == "tests/a.py"
    assert xdist_plan.unit_cost("pair") == 21 and xdist_plan.unit_cost("tests/new.py") == 0


def test_the_scheduler_is_loadfile_with_the_plans_units_and_order(plan, pytestconfig, monkeypatch):
    pytest.importorskip("xdist")
    monkeypatch.setattr(pytestconfig.option, "dist", "loadfile")
    monkeypatch.setattr(pytestconfig.option, "loadscopereorder", True)
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"])  # what -n 2 sets
    sched = xdist_plan.make_scheduler(pytestconfig, None)
    assert pytestconfig.option.loadscopereorder is False  # the collection order (order_items') is kept
    assert sched._split_scope("tests/c.py::t") == "pair" and sched._split_scope("tests/a.py::t[2]") == "tests/a.py"
    monkeypatch.setattr(pytestconfig.option, "dist", "load")
    assert xdist_plan.make_scheduler(pytestconfig, None) is None


def test_every_file_the_plan_names_exists():
    named = set(xdist_plan.COST_S) | {p for paths in xdist_plan.SHARED.values() for p in paths}
    assert [p for p in sorted(named) if not (ROOT / p).is_file()] == []


def test_junit_totals_per_file(tmp_path: Path):
    report = tmp_path / "j.xml"
    report.write_text('<testsuites><testsuite><testcase classname="tests.x.test_a" name="t1" time="1.5"/>'
                      '<testcase classname="tests.x.test_a" name="t2[p]" time="2"/>'
                      '<testcase classname="tests.test_b" name="t" time="0.25"/></testsuite></testsuites>')
    assert xdist_plan.file_costs([str(report)]) == {"tests/x/test_a.py": 3.5, "tests/test_b.py": 0.25}
