"""Launcher backends of the :class:`~orchestrator.fleet.Fleet`: local child processes, Slurm jobs.

Both start ``python -m ctx_worker|gen_worker --config FILE --index SLOT`` with the environment a
server needs to join (``PDSERVE_ORCHESTRATOR_URL``, ``PDSERVE_INSTANCE_ID``), and stop exactly the
process or job they started: by PID (process group) or by job id, never by name.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from pdserve.config import Topology
from pdserve.ports import free_port
from pdserve.exit_codes import describe

from .fleet import Instance
from .launcher import signal_group
from .pools import Server

_MODULES = {"ctx": "ctx_worker", "gen": "gen_worker"}
_PR_SET_PDEATHSIG = 1
SLURM_CMD_TIMEOUT_S = 30.0
_SLURM_GONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
               "BOOT_FAIL", "DEADLINE"}


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM this child when the orchestrator dies, so a crashed orchestrator leaves no
    orphan servers. (Popen must then be called from a thread that lives as long as the child: the
    event loop thread.)"""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class LocalBackend:
    """Servers as child processes of the orchestrator, each in its own process group."""

    kind = "local"

    def __init__(self, topology: Topology, config_path: Path, *, env: dict[str, str] | None = None,
                 python: str = sys.executable) -> None:
        self.topology = topology
        self.config_path = Path(config_path).resolve()
        self.log_dir = Path(os.environ.get("PDSERVE_LOG_DIR") or topology.launcher.log_dir)  # `pdserve up --log-dir`
        self._env = {**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1",
                     "PDSERVE_ORCHESTRATOR_URL": topology.orchestrator_url}
        self._python = python

    def address(self, inst: Instance) -> tuple[str, int]:
        """Listed servers keep their address; extra instances get a free port on the pool's host."""
        specs = self.topology.pool(inst.role).servers
        if inst.url is not None:
            host, port = inst.url.removeprefix("http://").rsplit(":", 1)
            return host, int(port)
        if inst.slot < len(specs) and specs[inst.slot].port:
            return specs[inst.slot].host, specs[inst.slot].port
        host = specs[0].host if specs else "127.0.0.1"
        return host, free_port(host)

    def argv(self, inst: Instance, host: str, port: int) -> list[str]:
        return [self._python, "-m", _MODULES[inst.role], "--config", str(self.config_path), "--index", str(inst.slot),
                "--host", host, "--port", str(port), "--log-dir", str(self.log_dir)]

    async def launch(self, inst: Instance) -> None:
        host, port = self.address(inst)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{inst.role}{inst.slot}.log"
        with open(log_path, "ab") as log:
            # Called on the event loop thread on purpose (see _die_with_parent).
            inst.handle = subprocess.Popen(self.argv(inst, host, port), stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True,
                                           env={**self._env, "PDSERVE_INSTANCE_ID": inst.instance_id},
                                           preexec_fn=_die_with_parent)
        inst.url = f"http://{host}:{port}"

    async def exited(self, inst: Instance) -> str | None:
        proc: subprocess.Popen = inst.handle
        code = proc.poll()
        return None if code is None else describe(code)

    async def stop(self, inst: Instance, grace_s: float) -> None:
        proc: subprocess.Popen | None = inst.handle
        if proc is None or proc.poll() is not None:
            return
        signal_group(proc, signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            await asyncio.to_thread(proc.wait, 5.0)

    def adopt(self, member: Server) -> Instance | None:
        return None  # a registered stranger is not ours to stop

    def pid(self, inst: Instance) -> int | None:
        return None if inst.handle is None else inst.handle.pid


async def _run(argv: list[str]) -> str:
    """Run a Slurm command; its stdout. Raises RuntimeError on failure or timeout."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as err:
        raise RuntimeError(f"{argv[0]}: {err}") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), SLURM_CMD_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"{' '.join(argv)} did not answer within {SLURM_CMD_TIMEOUT_S:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {err.decode(errors='replace').strip()}")
    return out.decode()


class SlurmBackend:
    """Servers as Slurm jobs: ``sbatch`` the server script to add one, ``scancel JOBID`` to stop it.

    A job's server picks a free port on its node and registers; the registration carries the
    instance id, which is how the fleet learns the job's URL. Servers started by
    ``slurm/pdserve.sbatch`` inside the cluster's allocation are registered members; the fleet can
    retire them too (``scancel JOBID.STEPID``, both ids come with the registration).
    """

    kind = "slurm"

    def __init__(self, topology: Topology, config_path: Path, *, orchestrator_url: str | None = None,
                 repo_dir: Path | None = None) -> None:
        self.topology = topology
        self.config_path = Path(config_path).resolve()
        self.repo_dir = repo_dir or Path(__file__).resolve().parents[1]
        self.orchestrator_url = orchestrator_url or os.environ.get("PDSERVE_ORCHESTRATOR_URL") or topology.orchestrator_url
        self.log_dir = Path(topology.launcher.log_dir).resolve()

    def sbatch_argv(self, inst: Instance) -> list[str]:
        s = self.topology.launcher.slurm
        tp = self.topology.pool_engine(inst.role).tp_size
        argv = ["sbatch", "--parsable", f"--job-name=pdserve-{inst.role}{inst.slot}",
                f"--output={self.log_dir}/%x-%j.log", "--ntasks=1", f"--cpus-per-task={tp * s.cpus_per_server}",
                f"--time={s.time_limit}", f"--chdir={self.repo_dir}",
                f"--export=ALL,PDSERVE_INSTANCE_ID={inst.instance_id},PDSERVE_ORCHESTRATOR_URL={self.orchestrator_url}"]
        if s.partition:
            argv.append(f"--partition={s.partition}")
        if s.account:
            argv.append(f"--account={s.account}")
        script = Path(s.server_script)
        script = script if script.is_absolute() else self.repo_dir / script
        return [*argv, *s.extra_args, str(script), str(self.config_path), inst.role, str(inst.slot)]

    async def launch(self, inst: Instance) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = await _run(self.sbatch_argv(inst))
        inst.handle = out.strip().split(";")[0]  # --parsable: "JOBID[;CLUSTER]"
        inst.url = None  # known once the job's server registers

    async def state(self, job: str) -> str | None:
        """The job's (or step's) Slurm state, None when Slurm no longer lists it."""
        if "." in job:
            out = await _run(["squeue", "-h", "-s", "-j", job.split(".")[0], "-o", "%i"])
            return "RUNNING" if job in out.split() else None
        out = await _run(["squeue", "-h", "-j", job, "-o", "%T"])
        return out.strip() or None

    async def exited(self, inst: Instance) -> str | None:
        try:
            st = await self.state(str(inst.handle))
        except RuntimeError as err:
            if "Invalid job id" in str(err):
                return "job is gone"
            return None  # Slurm did not answer: assume alive, ask again next round
        if st is None or st in _SLURM_GONE:
            return f"job {inst.handle} {st or 'is gone'}"
        return None

    async def stop(self, inst: Instance, grace_s: float) -> None:
        job = str(inst.handle)
        await _run(["scancel", job])  # Slurm sends SIGTERM, then SIGKILL after its KillWait
        deadline = asyncio.get_running_loop().time() + grace_s
        while asyncio.get_running_loop().time() < deadline:
            if await self.exited(inst) is not None:
                return
            await asyncio.sleep(0.5)
        await _run(["scancel", "--signal=KILL", job])  # still there after the grace period

    def adopt(self, member: Server) -> Instance | None:
        job, step = member.info.get("slurm_job_id"), member.info.get("slurm_step_id")
        if not job:
            return None
        handle = f"{job}.{step}" if step not in (None, "") else str(job)
        return Instance(member.role, -1, instance_id=member.instance_id or member.url, url=member.url, handle=handle)
