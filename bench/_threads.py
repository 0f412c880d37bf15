"""Threads of a running process, read from ``/proc``: name, CPU seconds, last core, allowed cores.

    .venv/bin/python bench/_threads.py PID [PID ...]   # one line per thread

Used by ``bench/server_overhead.py`` to say which threads of the rank and of the frontend ran
during a measurement and where the kernel let them run (issue 11: OpenMP thread placement).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ThreadInfo:
    """One thread: ``cpu_s`` user + system seconds, ``core`` the CPU it last ran on (stat field 39),
    ``allowed`` its affinity (``Cpus_allowed_list``), ``nice`` its niceness (stat field 19)."""

    tid: int
    name: str
    cpu_s: float
    core: int
    allowed: str
    nice: int


def threads(pid: int) -> list[ThreadInfo]:
    """Every thread of ``pid`` (threads that exit while being read are skipped). Raises OSError
    (FileNotFoundError) when the process is gone."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name)):
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat[stat.rindex(")") + 2:].split()  # f[0] is field 3 (state)
        allowed = next((ln.split(":", 1)[1].strip() for ln in status.splitlines()
                        if ln.startswith("Cpus_allowed_list:")), "?")
        out.append(ThreadInfo(int(task.name), name, (int(f[11]) + int(f[12])) * TICK_S, int(f[36]), allowed,
                              int(f[16])))
    return out


def cpu_by_thread(before: list[ThreadInfo], after: list[ThreadInfo]) -> dict[str, dict]:
    """CPU seconds each thread spent between two readings, keyed ``name/tid``, with its placement
    (threads born in between count from 0)."""
    start = {t.tid: t.cpu_s for t in before}
    return {f"{t.name}/{t.tid}": {"cpu_s": round(t.cpu_s - start.get(t.tid, 0.0), 3), "allowed": t.allowed,
                                  "core": t.core, "nice": t.nice}
            for t in after}


def main(argv: list[str]) -> int:
    for pid in argv:
        for t in threads(int(pid)):
            print(f"{pid} {t.tid:>7} {t.name:<16} cpu {t.cpu_s:8.2f} s  core {t.core}  allowed {t.allowed}  "
                  f"nice {t.nice}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
