"""Local launcher: start every server of a topology as a child process, wait until ready, stop.

Used by ``pdserve up`` and by integration tests::

    launcher = LocalLauncher("configs/local.yaml", log_dir=tmp_path)
    with launcher:                      # start() + wait_ready(); stop() on exit
        httpx.post(launcher.url + "/v1/chat/completions", json=...)

Each child runs in its own process group with stdout+stderr in its own log file. Children are
stopped by PID (SIGTERM to the child's group, then SIGKILL after ``grace_s``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import httpx

from pdserve.config import Topology, load_topology

# (role, index) -> argv; role is "ctx", "gen" or "orchestrator" (index None).
CommandFactory = Callable[[str, "int | None"], list[str]]

_MODULES = {"ctx": "ctx_worker", "gen": "gen_worker", "orchestrator": "orchestrator"}
_POLL_S = 0.2
LOG_TAIL_LINES = 20


class LaunchError(RuntimeError):
    """A child exited early, died while serving, or did not become ready in time.

    The message names the child, its exit code (or that it is still running), its log file and
    the last lines of that log.
    """


def default_commands(config_path: Path) -> CommandFactory:
    """``python -m ctx_worker|gen_worker|orchestrator --config FILE [--index I]``."""

    def command(role: str, index: int | None) -> list[str]:
        argv = [sys.executable, "-m", _MODULES[role], "--config", str(config_path)]
        return argv if index is None else argv + ["--index", str(index)]

    return command


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


@dataclass
class Child:
    """One started server process."""

    name: str  # "ctx[0]", "gen[0]", "orchestrator"
    url: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def failure(self, what: str) -> LaunchError:
        code = self.returncode()
        state = "still running" if code is None else f"exit code {code}"
        tail = log_tail(self.log_path)
        return LaunchError(f"{self.name} ({self.url}) {what} ({state}); log: {self.log_path}\n"
                           f"--- last {LOG_TAIL_LINES} lines of {self.log_path} ---\n{tail}")


class LocalLauncher:
    """Starts a cluster described by a topology file as local child processes.

    Args:
        config_path: the topology YAML (passed to every child).
        topology: the parsed topology (read from ``config_path`` when omitted; TopologyError if bad).
        log_dir: where ``ctx0.log``, ``gen0.log``, ``orchestrator.log`` go (created).
        command: builds each child's argv (tests swap in fake servers).
        env, cwd: for the children (default: inherited, with ``PYTHONUNBUFFERED=1``).
        out: where progress lines go (None: silent).
        grace_s: seconds between SIGTERM and SIGKILL at :meth:`stop`.
    """

    def __init__(self, config_path: str | Path, *, topology: Topology | None = None,
                 log_dir: str | Path = "logs", command: CommandFactory | None = None,
                 env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 out: TextIO | None = sys.stdout, grace_s: float = 10.0) -> None:
        self.config_path = Path(config_path)
        self.topology = topology or load_topology(self.config_path)
        self.log_dir = Path(log_dir)
        self._command = command or default_commands(self.config_path)
        self._env = {**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"}
        self._cwd = cwd
        self._out = out
        self.grace_s = grace_s
        self.children = self._plan()

    @property
    def url(self) -> str:
        """The orchestrator's base URL (``http://host:port``)."""
        s = self.topology.orchestrator
        return f"http://{s.host}:{s.port}"

    def pids(self) -> dict[str, int]:
        return {c.name: c.pid for c in self.children if c.pid is not None}

    def _plan(self) -> list[Child]:
        """Every listed server, then the orchestrator; only the orchestrator when it launches the
        servers itself (``launcher.kind`` local or slurm)."""
        children = []
        for role in ("ctx", "gen") if self.topology.launcher.kind == "external" else ():
            for i in range(len(getattr(self.topology.pools, role).servers)):
                children.append(Child(f"{role}[{i}]", self.topology.server_url(role, i), self._command(role, i),
                                      self.log_dir / f"{role}{i}.log"))
        children.append(Child("orchestrator", self.url, self._command("orchestrator", None),
                              self.log_dir / "orchestrator.log"))
        return children

    def _say(self, line: str) -> None:
        if self._out is not None:
            print(line, file=self._out, flush=True)

    def start(self) -> None:
        """Spawn every child (ctx servers, gen servers, then the orchestrator). Raises OSError."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for child in self.children:
            if child.proc is not None:
                continue
            self._say(f"starting {child.name} on {child.url.removeprefix('http://')} (log: {child.log_path})")
            with open(child.log_path, "wb") as log:
                # Own session/process group: Ctrl-C in the terminal reaches only us, and stop()
                # can signal the child together with anything it spawned (e.g. MPI ranks).
                child.proc = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=self._env, cwd=self._cwd,
                                              start_new_session=True)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every child's ``/health`` answers 200, in start order.

        ``timeout_s`` (default ``orchestrator.startup_timeout_s``) bounds the whole wait.

        Raises:
            LaunchError: a child exited, or was not ready before the deadline.
        """
        timeout_s = self.topology.orchestrator.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            for child in self.children:
                self._wait_one(client, child, deadline, timeout_s)
                self._say(f"{child.name} is ready")

    def _wait_one(self, client: httpx.Client, child: Child, deadline: float, timeout_s: float) -> None:
        while True:
            self.check_alive()
            try:
                if client.get(f"{child.url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not accepting connections yet
            if time.monotonic() >= deadline:
                raise child.failure(f"did not become ready within {timeout_s:g} s")
            time.sleep(_POLL_S)

    def check_alive(self) -> None:
        """Raise LaunchError naming the first started child that has exited."""
        for child in self.children:
            if child.proc is not None and child.returncode() is not None:
                raise child.failure("exited")

    def up(self, timeout_s: float | None = None) -> "LocalLauncher":
        """start() + wait_ready(); on failure stop everything and re-raise."""
        try:
            self.start()
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def serve_forever(self, poll_s: float = 0.5) -> None:
        """Block while every child lives. Raises LaunchError when one dies (the caller stops the rest)."""
        while True:
            self.check_alive()
            time.sleep(poll_s)

    def stop(self) -> dict[str, int | None]:
        """Stop every child: SIGTERM to each group (orchestrator first), SIGKILL after ``grace_s``.

        Returns each child's exit code (None: could not be reaped).
        """
        running = [c for c in reversed(self.children) if c.proc is not None and c.returncode() is None]
        for child in running:
            self._say(f"stopping {child.name} (pid {child.pid})")
            signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in running:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say(f"{child.name} (pid {child.pid}) ignored SIGTERM for {self.grace_s:g} s; killing it")
                signal_group(child.proc, signal.SIGKILL)
                try:
                    child.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    self._say(f"{child.name} (pid {child.pid}) did not exit after SIGKILL")
        return {c.name: c.returncode() for c in self.children if c.proc is not None}

    def __enter__(self) -> "LocalLauncher":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Signal the process group led by ``proc`` (its pid), or just ``proc`` if that fails."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    except PermissionError:
        proc.send_signal(sig)
