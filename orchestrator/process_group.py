"""``orchestrator.num_workers: K``: K orchestrator processes on one public port.

Process 0, the one ``python -m orchestrator`` started, is the **owner**: it holds membership,
health polls, the launcher and scaling, exactly as a single orchestrator does, and it starts,
watches and restarts processes 1..K-1, the **workers** (``python -m orchestrator.worker_main``).
Every process binds the public port with its own ``SO_REUSEPORT`` socket, so the kernel spreads
new connections over K independent listeners (one socket inherited by all balances badly:
Megatron-LM #6223), and a private unix socket ``orch<i>.sock`` in a 0700 directory for the
internal routes (:mod:`orchestrator.feed`, :mod:`orchestrator.owner`, :mod:`orchestrator.worker`).

Lifetimes: a worker gets ``PR_SET_PDEATHSIG`` = SIGTERM (it stops, gracefully, when the owner's
main thread exits, even by ``kill -9``) and checks at start that its parent is still the owner
(a death before the ``prctl`` would send no signal). A worker that dies (a signal, a non-zero
exit) is restarted after :data:`RESTART_BACKOFF_S`, at most ``orchestrator.worker_max_restarts``
times per slot; one that exits 0 was stopped on purpose (SIGTERM, as when ``pdserve up`` stops the
orchestrator's process group) and is not.
"""

from __future__ import annotations

import asyncio
import ctypes
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from .tasks import LoopTask

log = logging.getLogger("orchestrator.process_group")

ATTACH_ENV = "PDSERVE_ORCH_ATTACH"
TOKEN_HEADER = "x-pdserve-internal-token"
WORKER_HEADER = b"x-pdserve-orchestrator-worker"  # on every answer: which process the client reached
RESTART_BACKOFF_S = 1.0
WATCH_INTERVAL_S = 0.25
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcessSpec:
    """Who one orchestrator process is in its group of ``count`` (index 0 = the owner)."""

    index: int
    count: int
    ipc_dir: str     # private 0700 directory holding every process's unix socket
    token: str       # secret of the internal routes (hex, 32 bytes)
    owner_pid: int

    @property
    def is_owner(self) -> bool:
        return self.index == 0

    def socket_path(self, index: int) -> str:
        return os.path.join(self.ipc_dir, f"orch{index}.sock")

    @classmethod
    def new_owner(cls, count: int) -> "ProcessSpec":
        """The owner's spec: a fresh private directory and token."""
        return cls(0, count, tempfile.mkdtemp(prefix="pdserve-orch-"), secrets.token_hex(32), os.getpid())

    def for_worker(self, index: int) -> "ProcessSpec":
        return replace(self, index=index)

    def to_env(self, payload: dict) -> str:
        return json.dumps({"spec": asdict(self), **payload})

    @classmethod
    def pop_from_env(cls) -> tuple["ProcessSpec", dict]:
        """The spec and payload a worker was started with; removed from the environment so that
        nothing it starts inherits the token. Raises KeyError when not started by an owner."""
        doc = json.loads(os.environ.pop(ATTACH_ENV))
        return cls(**doc.pop("spec")), doc


def check_port_free(host: str, port: int) -> None:
    """Raise OSError (EADDRINUSE) when something listens on ``host:port`` already. A plain bind
    conflicts with any listener, while ``SO_REUSEPORT`` binds of the same user would silently
    share the port with, say, a second orchestrator group; the owner checks once, before binding."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are no conflict
        probe.bind((host, port))


def bind_public(host: str, port: int) -> socket.socket:
    """The public TCP socket of one process (``SO_REUSEPORT``: each process binds its own).
    Raises OSError (e.g. the port is taken by something that does not set ``SO_REUSEPORT``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def bind_unix(path: str) -> socket.socket:
    """The internal unix socket of one process (a stale file from a killed predecessor is removed)."""
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.set_inheritable(False)
    return sock


def internal_allowed(scope: dict, spec: ProcessSpec) -> bool:
    """An internal route may answer: the connection came in on a unix socket (uvicorn gives such a
    scope no server port) and carries the group's token."""
    server = scope.get("server")
    if server is None or server[1] is not None:
        return False
    token = next((v for k, v in scope["headers"] if k == TOKEN_HEADER.encode()), b"")
    return hmac.compare_digest(token, spec.token.encode())


def tag_answers(send: Callable, index: int) -> Callable:
    """``send`` with :data:`WORKER_HEADER` (this process's index) added to the response head."""
    value = str(index).encode()

    async def tagged(message: dict) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), (WORKER_HEADER, value)]
        await send(message)

    return tagged


def _die_with_owner() -> None:  # pragma: no cover - runs in the child between fork and exec
    """SIGTERM this worker when the owner's spawning thread (its main thread) exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        # No logging is safe between fork and exec; without the death signal the worker still
        # exits when its start-up check finds the owner is no longer its parent.
        pass


@dataclass
class _Slot:
    index: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    restart_at_s: float | None = None  # when a dead worker is started again
    given_up: bool = False


class WorkerSupervisor:
    """Starts workers 1..K-1, restarts dead ones, stops them all (owned by the owner's app).

    ``payload`` travels to each worker with its spec (the topology, the log level);
    ``on_exit(index)`` is called when a worker is found dead (its reported load is then
    dropped); ``on_tick()`` runs every :data:`WATCH_INTERVAL_S`. Popen runs on the event-loop
    thread, the main thread, which lives as long as the process: ``PR_SET_PDEATHSIG`` fires when
    the *thread* that forked the child exits.
    """

    def __init__(self, spec: ProcessSpec, payload: dict, max_restarts: int,
                 on_exit: Callable[[int], None], on_tick: Callable[[], None]) -> None:
        self.spec, self.payload, self.max_restarts = spec, payload, max_restarts
        self._on_exit, self._on_tick = on_exit, on_tick
        self.slots = [_Slot(i) for i in range(1, spec.count)]
        self._loop = LoopTask("orchestrator-worker-supervisor")

    def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)
        self._loop.start(self._watch())

    def _spawn(self, slot: _Slot) -> None:
        env = {**os.environ, ATTACH_ENV: self.spec.for_worker(slot.index).to_env(self.payload)}
        # stdout/stderr are the owner's: one log file for the whole orchestrator, lines named orch[i].
        slot.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.worker_main"], env=env,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_owner)
        slot.restart_at_s = None
        log.info("started orchestrator worker %d (pid %d)", slot.index, slot.proc.pid)

    async def _watch(self) -> None:
        while True:
            now = time.monotonic()
            for slot in self.slots:
                self._check(slot, now)
            try:
                self._on_tick()
            except Exception:  # noqa: BLE001 - the supervisor must outlive a bad tick
                log.exception("supervisor tick failed")
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _check(self, slot: _Slot, now: float) -> None:
        if slot.restart_at_s is not None and now >= slot.restart_at_s:
            self._spawn(slot)
            return
        if slot.proc is None or slot.restart_at_s is not None or slot.proc.poll() is None:
            return
        code = slot.proc.returncode
        self._on_exit(slot.index)
        if code == 0:  # stopped on purpose (a SIGTERM to the whole group, e.g. `pdserve up` stopping)
            if not slot.given_up:
                log.info("orchestrator worker %d stopped (exit 0); not restarting it", slot.index)
                slot.given_up = True
            return
        if slot.restarts >= self.max_restarts:
            if not slot.given_up:
                log.error("orchestrator worker %d exited (%s) and used up its %d restarts", slot.index, code,
                          self.max_restarts)
                slot.given_up = True
            return
        slot.restarts += 1
        log.warning("orchestrator worker %d (pid %d) exited with %s; restarting (%d/%d)", slot.index,
                    slot.proc.pid, code, slot.restarts, self.max_restarts)
        slot.restart_at_s = now + RESTART_BACKOFF_S

    def status(self) -> list[dict]:
        """Per worker: index, pid, alive, restarts."""
        return [{"index": s.index, "pid": s.proc.pid if s.proc else None,
                 "alive": s.proc is not None and s.proc.poll() is None, "restarts": s.restarts} for s in self.slots]

    def live_indices(self) -> list[int]:
        return [s.index for s in self.slots if s.proc is not None and s.proc.poll() is None]

    async def stop(self, grace_s: float) -> None:
        """SIGTERM every worker, wait up to ``grace_s`` (bounded polling), then SIGKILL the rest."""
        await self._loop.stop()
        procs = [s.proc for s in self.slots if s.proc is not None and s.proc.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for proc in procs:
            if proc.poll() is None:
                log.warning("orchestrator worker pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, grace_s)
                proc.kill()
                proc.wait(5)
