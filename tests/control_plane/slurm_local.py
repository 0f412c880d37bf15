"""A real single-node Slurm (Debian slurm-wlm + munge) for tests, started and stopped by PID.

No systemd: munged runs as user munge with a fresh key; slurmctld and slurmd run as root with a
minimal slurm.conf whose state, spool, pid and log files live in a temp directory. Everything is
installed with apt-get when missing (CI runs as root with Debian's registry reachable).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurm-wlm", "munge"]


def ensure_installed(timeout_s: float = 300) -> str | None:
    """``None`` when slurmctld/slurmd/munged are installed (installing them if needed), else why not."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and this is not a root Debian machine"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "install", "-y", "-q", *PACKAGES], ["apt-get", "update", "-q"],
                 ["apt-get", "install", "-y", "-q", *PACKAGES]):
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode == 0 and argv[1] == "install":
            return None
    return f"apt-get install {' '.join(PACKAGES)} failed: {r.stderr[-500:]}"


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


class LocalSlurm:
    """munged + slurmctld + slurmd on 127.0.0.1; :meth:`stop` ends exactly those processes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, int] = {}
        self.host = socket.gethostname().split(".")[0]

    def _write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 2
        self.conf.write_text(f"""ClusterName=pdserve-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=5
OverTimeLimit=0
InactiveLimit=0
MinJobAge=5
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
""")

    def _munge(self) -> None:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(os.urandom(1024))
            shutil.chown(key, "munge", "munge")
            key.chmod(0o400)
        subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", "/run/munge"], check=True)
        existing = subprocess.run(["munge", "-n"], capture_output=True)
        if existing.returncode == 0:
            return  # a munged already answers on the default socket (started by an earlier run)
        pidfile = Path("/run/munge/munged.pdserve-test.pid")  # munged (user munge) must write it
        subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force", f"--pid-file={pidfile}"], check=True)
        _wait(lambda: pidfile.exists(), 10, "munged")
        self.procs["munged"] = int(pidfile.read_text().split()[0])
        _wait(lambda: subprocess.run(["munge", "-n"], capture_output=True).returncode == 0, 10, "munge to answer")

    def start(self) -> "LocalSlurm":
        self._write_conf()
        self._munge()
        for name in ("slurmctld", "slurmd"):
            subprocess.run([name, "-f", str(self.conf)], env=self.env, check=True, timeout=30)
            pidfile = self.root / "run" / f"{name}.pid"
            _wait(lambda: pidfile.exists() and pidfile.read_text().strip(), 15, f"{name} pid file")
            self.procs[name] = int(pidfile.read_text().split()[0])
        _wait(self._node_idle, 30, "the node to be idle")
        return self

    def _node_idle(self) -> bool:
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
        return r.returncode == 0 and r.stdout.strip() in ("idle", "mix", "alloc")

    def run(self, *argv: str, timeout_s: float = 30, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        r = subprocess.run(list(argv), env=env or self.env, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
        return r.stdout

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i").split()

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.procs.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
