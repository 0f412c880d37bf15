"""A server joins its cluster: ``POST /cluster/workers`` to the orchestrator, then heartbeats.

Order matters: the server registers only after its own HTTP port accepts connections, so the
orchestrator never routes to a member that cannot answer yet. It then re-posts the same body every
``heartbeat_ttl_s / 3`` seconds (a heartbeat is an idempotent re-registration, so an orchestrator
that restarted learns the member again), and deregisters at shutdown.

Runs in its own thread, owned by the server process: :meth:`Registrar.start` in ``server_main``,
:meth:`Registrar.stop` from the app's shutdown hooks. Every HTTP call has a short timeout.

Environment (set by launchers): ``PDSERVE_ORCHESTRATOR_URL`` (where to register; default the
topology's orchestrator address), ``PDSERVE_ADVERTISE_HOST`` (the host in the URL others use to
reach this server; default the bind host), ``PDSERVE_INSTANCE_ID`` (the launcher's id for this
server), ``PDSERVE_REGISTER=0`` (do not register), ``SLURM_JOB_ID`` / ``SLURM_STEP_ID``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import httpx

from typing import TYPE_CHECKING

from executor.drain_advice import DrainAdvisor
from pdserve.auth import auth_headers
from pdserve.config import ServerConfig

if TYPE_CHECKING:
    from executor.http_server import ServerState

log = logging.getLogger("pdserve.registration")

CALL_TIMEOUT_S = 2.0


def pick_free_port(host: str) -> int:
    """A port that is free now (``port: 0`` in a topology): bind, read, close."""
    with socket.socket() as s:
        s.bind((host if host not in ("", "0.0.0.0") else "0.0.0.0", 0))
        return s.getsockname()[1]


def advertised_url(cfg: ServerConfig) -> str:
    host = os.environ.get("PDSERVE_ADVERTISE_HOST") or cfg.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{host}:{cfg.port}"


class Registrar:
    """Registers ``cfg``'s server once its port accepts; heartbeats until :meth:`stop`."""

    def __init__(self, cfg: ServerConfig, describe: Callable[[], dict]) -> None:
        self.cfg = cfg
        self.url = advertised_url(cfg)
        self.target = (os.environ.get("PDSERVE_ORCHESTRATOR_URL") or cfg.orchestrator_url).rstrip("/")
        self.enabled = bool(self.target) and os.environ.get("PDSERVE_REGISTER", "1") != "0"
        self.interval_s = max(0.2, cfg.heartbeat_ttl_s / 3)
        self._describe = describe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self.registered = False

    def body(self) -> dict:
        env = os.environ
        return {"role": self.cfg.role, "url": self.url, "index": self.cfg.index,
                "instance_id": env.get("PDSERVE_INSTANCE_ID"), "model": self.cfg.model.name,
                "pid": os.getpid(), "slurm_job_id": env.get("SLURM_JOB_ID"), "slurm_step_id": env.get("SLURM_STEP_ID"),
                "ttl_s": self.cfg.heartbeat_ttl_s, **self._describe()}

    def start(self) -> None:
        if self.enabled:
            self._thread.start()

    def stop(self) -> None:
        """Stop heartbeating and deregister (best effort, bounded)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(CALL_TIMEOUT_S + 1)
        if self.registered:
            try:
                httpx.request("DELETE", f"{self.target}/cluster/workers", params={"url": self.url},
                              headers=auth_headers(self.cfg.admin_token_env), timeout=CALL_TIMEOUT_S, trust_env=False)
            except httpx.HTTPError as err:
                log.info("deregistration from %s failed: %s", self.target, err)

    def _port_accepts(self) -> bool:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "") else self.cfg.host
        try:
            with socket.create_connection((host, self.cfg.port), timeout=1.0):
                return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self._port_accepts():  # register only once our own port accepts
            if self._stop.wait(0.1):
                return
        complained = False
        with httpx.Client(timeout=CALL_TIMEOUT_S, trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    resp = client.post(f"{self.target}/cluster/workers", json=self.body(),
                                       headers=auth_headers(self.cfg.admin_token_env))
                    ok = resp.status_code == 200
                    problem = None if ok else f"HTTP {resp.status_code}: {resp.text[:200]}"
                except httpx.HTTPError as err:
                    ok, problem = False, f"{type(err).__name__}: {err}"
                if ok and not self.registered:
                    log.info("registered %s with %s", self.url, self.target)
                elif not ok and not complained:  # the orchestrator may simply not be up yet
                    log.info("registration with %s failed (will keep trying): %s", self.target, problem)
                complained = complained or not ok
                self.registered = self.registered or ok
                self._stop.wait(self.interval_s if ok else 1.0)


def with_bound_port(cfg: ServerConfig, sock: socket.socket) -> ServerConfig:
    """``cfg`` with the port ``sock`` is bound to (``--port 0``: the kernel picked it)."""
    port = sock.getsockname()[1]
    return cfg if port == cfg.port else cfg.model_copy(update={"port": port})


def attach(state: "ServerState") -> Registrar:
    """The control-plane hook of ``server_main`` (frontend 0: one registration per server): start
    registering (the thread waits until the port accepts) and stop at shutdown."""
    registrar = Registrar(state.config, lambda: {"state": state.client.state.value,
                                                 "kv_layout": state.kv_layout.model_dump(),
                                                 "max_model_len": state.client.max_model_len})
    state.on_shutdown.append(registrar.stop)  # shutdown hooks run in reverse: deregister first
    registrar.start()
    return registrar


def drain_advisor(registrar: Registrar) -> DrainAdvisor:
    """Whom a SIGTERM asks how to drain (:mod:`executor.drain_advice`): the orchestrator this server
    registered with (no notice while it has not registered, or never registers)."""
    return DrainAdvisor(registrar.target, registrar.url, registrar.cfg.admin_token_env,
                        lambda: registrar.enabled and registrar.registered)
