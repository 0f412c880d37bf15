"""Start pdserve processes on 127.0.0.1 for integration tests; stop exactly those, by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from pdserve.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def write_topology(path: Path, model_path: str, model_name: str, *, num_ctx: int = 1, num_gen: int = 1,
                   engine: dict | None = None, kv_transfer: dict | None = None,
                   orchestrator: dict | None = None) -> Path:
    """A topology YAML with free ports for every server."""
    doc = {
        "model": {"path": model_path, "name": model_name},
        "engine": {"num_threads": 1, "num_kv_blocks": 256, "block_size": 4, "dtype": "float32",  # exact oracles: fp32
                   **(engine or {})},
        "kv_transfer": {"lease_ms": 30000, "timeout_ms": 10000, **(kv_transfer or {})},
        "orchestrator": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 0.2,
                         "startup_timeout_s": 120, **(orchestrator or {})},
        "pools": {
            "ctx": {"servers": [{"host": "127.0.0.1", "port": free_port()} for _ in range(num_ctx)]},
            "gen": {"servers": [{"host": "127.0.0.1", "port": free_port()} for _ in range(num_gen)]},
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return path


class Procs:
    """Processes started by one test module; :meth:`stop_all` ends them (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def wait_healthy(self, name: str, url: str, timeout_s: float = 240.0) -> None:
        """Poll ``url/health`` until 200. Raises RuntimeError (with the log tail) on exit or timeout.

        The default bound is a cold start on a 2-core machine at load ~20 (the import alone took
        60 s there, the MPI ranks 40 s more: 120 s failed); an idle machine needs ~10 s, and the
        poll returns as soon as the server answers."""
        deadline = time.monotonic() + timeout_s
        proc = self.procs[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{name} not healthy after {timeout_s} s:\n{self.log(name)[-3000:]}")

    def stop(self, *names: str, timeout_s: float = 10.0) -> None:
        """Stop ``names`` at once: SIGTERM to each first, so their shutdowns overlap (one after
        another, a module's 3-5 servers had cost it the sum of their exit times), then wait up to
        ``timeout_s`` from the signal for each exit, and SIGKILL one that is still running."""
        procs = [self.procs.pop(name) for name in names]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """:meth:`stop` every process this object started and has not stopped yet."""
        self.stop(*self.procs, timeout_s=timeout_s)


class Cluster:
    """ctx + gen servers + orchestrator of one topology file, started as separate processes."""

    def __init__(self, topo_path: Path, procs: Procs) -> None:
        self.topo_path, self.procs = topo_path, procs
        self.doc = yaml.safe_load(topo_path.read_text())
        o = self.doc["orchestrator"]
        self.url = f"http://{o['host']}:{o['port']}"
        self.model = self.doc["model"]["name"]

    def server_url(self, role: str, i: int = 0) -> str:
        s = self.doc["pools"][role]["servers"][i]
        return f"http://{s['host']}:{s['port']}"

    def start(self, env: dict[str, dict[str, str]] | None = None) -> "Cluster":
        """Start every server, then the orchestrator; ``env`` adds variables per role ("ctx", "gen")."""
        cfg = str(self.topo_path)
        names = []
        for role in ("ctx", "gen"):
            for i in range(len(self.doc["pools"][role]["servers"])):
                name = f"{role}{i}"
                self.procs.start(name, "-m", f"{role}_worker", "--config", cfg, "--index", str(i),
                                 "--log-dir", str(self.procs.log_dir), env=(env or {}).get(role))
                names.append((name, self.server_url(role, i)))
        self.procs.start("orchestrator", "-m", "orchestrator", "--config", cfg)
        names.append(("orchestrator", self.url))
        for name, url in names:
            self.procs.wait_healthy(name, url)
        return self
