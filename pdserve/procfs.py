"""Process identity from ``/proc``: a pid plus its start time names one process, even after the
kernel recycles the pid (proc(5), ``/proc/PID/stat`` field 22, clock ticks since boot)."""

from __future__ import annotations

from pathlib import Path


def proc_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks), None if the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])  # fields[0] is field 3 (state), so field 22 is fields[19]
