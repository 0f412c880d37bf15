"""bench/_harness.py: the hypervisor's CPU steal between two /proc/stat readings."""

from __future__ import annotations

import sys

from tests.integration.procs import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from _harness import cpu_jiffies, steal_share  # noqa: E402


def test_steal_share_is_the_steal_column_over_all_time(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 20 300 0 0 0 10 0 0\ncpu0 50 0 10 150 0 0 0 5 0 0\n")
    before = cpu_jiffies(stat)
    stat.write_text("cpu  160 0 30 330 0 0 0 30 5 0\n")  # 60 user + 10 sys + 30 idle + 20 steal
    assert before == [100, 0, 20, 300, 0, 0, 0, 10, 0, 0]
    assert steal_share(before, cpu_jiffies(stat)) == 20 / 120  # guest (col 9) is inside user already


def test_no_reading_no_share(tmp_path):
    assert cpu_jiffies(tmp_path / "absent") == []
    (tmp_path / "odd").write_text("intr 1 2 3\n")
    assert cpu_jiffies(tmp_path / "odd") == []
    assert steal_share([], [1] * 10) is None
    assert steal_share([1] * 10, [1] * 10) is None  # no time passed


def test_this_machine_has_a_cpu_line():
    jiffies = cpu_jiffies()
    assert len(jiffies) >= 8 and sum(jiffies) > 0
