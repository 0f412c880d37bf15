"""slurm/pdserve.sbatch on a real single-node Slurm: orchestrator + 1 ctx + 1 gen (tiny model),
a chat request, gen scaled 1 -> 2 -> 1 through Slurm jobs, and no job left when the test ends, on the
default MPI lattice (mpiexec inside a Slurm step). It once ran with ``engine.executor: inproc`` too: the
sbatch scripts, the launcher and the scaling are the same for both executors, and the MPI run also
covers what only it has (ranks started inside the step), so the inproc run was dropped for time."""

from __future__ import annotations

import os
import sys
import time

import httpx
import pytest
import yaml

from tests.control_plane.conftest import AUTH, TINY, TOKEN, wait_for
from tests.control_plane.slurm_local import LocalSlurm, ensure_installed
from tests.integration.procs import ROOT, free_port


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = ensure_installed()
    if why is not None:
        pytest.skip(why)
    s = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield s
    try:
        for job in s.jobs():
            s.run("scancel", job)
        wait_for(lambda: not s.jobs(), 60, "every Slurm job to end")
    finally:
        s.stop()


def test_sbatch_cluster_chat_and_gen_scaling_through_jobs(slurm, tiny_model_dir, tmp_path):
    port = free_port()
    topo = tmp_path / "slurm.yaml"
    topo.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model_dir), "name": TINY},
        "engine": {"num_threads": 1, "num_kv_blocks": 256, "block_size": 4, "executor": "mpi"},
        "orchestrator": {"port": port, "health_interval_s": 0.3, "heartbeat_ttl_s": 6},
        "launcher": {"kind": "slurm", "log_dir": str(tmp_path / "logs"), "grace_s": 10, "monitor_interval_s": 0.5,
                     "slurm": {"time_limit": "00:10:00"}},
        "pools": {"ctx": {"servers": [{"port": 0}]}, "gen": {"servers": [{"port": 0}], "max_instances": 2}},
    }))
    env = {**slurm.env, "PDSERVE_ADMIN_TOKEN": TOKEN, "PDSERVE_ADVERTISE_HOST": "127.0.0.1",
           "PDSERVE_LOG_DIR": str(tmp_path / "logs"), "PDSERVE_PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "pdserve-%j.log"
    job = slurm.run("sbatch", "--parsable", "--ntasks=1", f"--cpus-per-task={os.cpu_count() or 2}",
                    f"--output={out}", "--time=00:10:00", str(ROOT / "slurm" / "pdserve.sbatch"), str(topo), env=env, cwd=ROOT)
    job = job.strip().split(";")[0]
    url = f"http://127.0.0.1:{port}"

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted([*tmp_path.glob("pdserve-*.log"), *(tmp_path / "logs").glob("*.log")]))

    def healthy() -> bool:
        assert job in slurm.jobs(), f"job {job} ended\n{logs()}"
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 150, f"the Slurm cluster's orchestrator\n(see logs)")
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": TINY, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    status = httpx.get(url + "/cluster/status", timeout=5).json()
    assert [s["source"] for s in status["pools"]["gen"]["servers"]] == ["registered"]  # an srun step of the allocation

    def pool(n: int) -> dict | None:
        p = httpx.get(url + "/cluster/status", timeout=5).json()["pools"]["gen"]
        return p if p["ready"] == n and len(p["servers"]) == n and not p["launching"] and not p["draining"] else None

    assert httpx.post(url + "/cluster/pools/gen/scale", json={"instances": 2}, headers=AUTH, timeout=5).status_code == 202
    grown = wait_for(lambda: pool(2), 150, f"gen to grow to 2 through a Slurm job\n{logs()}")
    jobs = slurm.jobs()
    assert len(jobs) == 2, jobs  # the cluster's allocation + one server job
    (new,) = [s for s in grown["servers"] if s["source"] == "managed"]
    for _ in range(3):  # the new server takes traffic
        r = httpx.post(url + "/v1/completions", timeout=60, json={"model": TINY, "prompt": "once", "max_tokens": 3})
        assert r.status_code == 200, r.text

    assert httpx.post(url + "/cluster/pools/gen/scale", json={"instances": 1}, headers=AUTH, timeout=5).status_code == 202
    shrunk = wait_for(lambda: pool(1), 60, f"gen to shrink to 1\n{logs()}")
    assert shrunk["servers"][0]["url"] != new["url"]
    wait_for(lambda: slurm.jobs() == [job], 60, "the server job to be cancelled")
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": TINY, "messages": [{"role": "user", "content": "again"}], "max_tokens": 4})
    assert r.status_code == 200, r.text

    slurm.run("scancel", job)
    wait_for(lambda: not slurm.jobs(), 60, "the cluster job to end")
    time.sleep(1)
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)
