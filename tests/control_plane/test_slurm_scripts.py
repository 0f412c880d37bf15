"""``slurm/restart_step.sh`` (the restart loop around each server step of ``slurm/pdserve.sbatch``)
and the plan the script evaluates; no Slurm needed."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from orchestrator.slurm_plan import plan
from pdserve.config import parse_topology
from tests.integration.procs import ROOT

SCRIPT = ROOT / "slurm" / "restart_step.sh"


def flaky(tmp_path, codes: list[int]) -> list[str]:
    """A command that exits with ``codes[i]`` on its i-th run (then 0), counting its runs in a file."""
    runs = tmp_path / "runs"
    script = ("n=$(cat {r} 2>/dev/null || echo 0); echo $((n + 1)) > {r}; codes=({c}); "
              "exit ${{codes[$n]:-0}}").format(r=runs, c=" ".join(map(str, codes)))
    return ["bash", "-c", script]


def runs(tmp_path) -> int:
    return int((tmp_path / "runs").read_text())


@pytest.mark.parametrize("codes,max_restarts,status,n_runs", [
    ([75, 75], 3, 0, 3),      # engine died twice: restarted twice, then stopped cleanly
    ([75, 75, 75], 2, 75, 3),  # out of restarts: the last status comes back
    ([137], 3, 0, 2),          # killed by a signal: restarted
    ([3], 3, 3, 1),            # start-up error: a restart cannot help
    ([2], 3, 2, 1),            # bad configuration: the same
    ([0], 3, 0, 1),            # stopped or drained on purpose: not restarted
])
def test_restart_policy(tmp_path, codes, max_restarts, status, n_runs):
    p = subprocess.run([str(SCRIPT), str(max_restarts), *flaky(tmp_path, codes)], capture_output=True, text=True,
                       timeout=30)
    assert (p.returncode, runs(tmp_path)) == (status, n_runs), p.stderr
    if n_runs > 1:
        assert f"restart 1 of {max_restarts}" in p.stderr


def test_sigterm_reaches_the_server_and_ends_the_loop(tmp_path):
    marker = tmp_path / "got_term"
    child = f"trap 'touch {marker}; exit 0' TERM; sleep 30 & wait"  # a server that drains and exits 0
    p = subprocess.Popen([str(SCRIPT), "3", "bash", "-c", child])
    time.sleep(0.5)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
    assert time.monotonic() - t0 < 5 and marker.exists()


def test_plan_names_each_pools_restart_budget():
    topo = parse_topology({"launcher": {"kind": "slurm"},
                           "pools": {"ctx": {"servers": [{"port": 0}], "max_restarts": 1},
                                     "gen": {"servers": [{"port": 0}, {"port": 0}]}}})
    out = plan(topo, ["n0", "n1"])
    assert out["CTX_MAX_RESTARTS"] == 1 and out["GEN_MAX_RESTARTS"] == 3 and out["GEN_N"] == 2
