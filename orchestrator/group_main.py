"""How the processes of an orchestrator group are run (``orchestrator.num_workers`` > 1).

``run_owner`` is what ``python -m orchestrator`` does then; ``run_worker`` is
``python -m orchestrator.worker_main``, which only an owner starts. Each binds its own public
``SO_REUSEPORT`` socket and its unix socket, and runs uvicorn on both with the same options as a
single orchestrator (uvloop + httptools, no access log, 5 s graceful shutdown).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys

import uvicorn

from pdserve.config import Topology
from pdserve.request_id import install_log_filter

from .process_group import ProcessSpec, bind_public, bind_unix, check_port_free
from .serve_options import SERVE_OPTIONS, freeze_startup_heap

log = logging.getLogger("orchestrator.group")


STARTUP_FAILURE = 3  # as uvicorn.run: the app's lifespan start failed (e.g. no view from the owner)


def _serve(app, sockets: list, log_level: str) -> int:
    """Run uvicorn on ``sockets`` until it stops; 0, or :data:`STARTUP_FAILURE` when it never started."""
    config = uvicorn.Config(app, log_level=log_level, **SERVE_OPTIONS)
    server = uvicorn.Server(config)
    freeze_startup_heap()  # see orchestrator/serve_options.py
    server.run(sockets=sockets)
    return 0 if server.started else STARTUP_FAILURE


def run_owner(topology: Topology, config_path: str, log_level: str) -> int:
    """Serve as process 0 of ``orchestrator.num_workers`` until SIGINT/SIGTERM; the workers are
    started by the app's lifespan and stopped with it. Returns 0, 1 when the port is taken, 3 when
    the app's start failed."""
    from .app import create_app

    s = topology.orchestrator
    spec = ProcessSpec.new_owner(s.num_workers)
    try:
        # Bound before any worker starts: a taken port fails here, once, not in K processes.
        try:
            check_port_free(s.host, s.port)
            sockets = [bind_public(s.host, s.port), bind_unix(spec.socket_path(0))]
        except OSError as err:
            print(f"error: cannot listen on {s.host}:{s.port}: {err}", file=sys.stderr)
            return 1
        payload = {"topology": topology.model_dump(mode="json"), "log_level": log_level}
        log.info("orchestrator owner pid %d: %d processes on %s:%d", os.getpid(), s.num_workers, s.host, s.port)
        return _serve(create_app(topology, config_path=config_path, group=spec, group_payload=payload), sockets,
                      log_level)
    finally:
        shutil.rmtree(spec.ipc_dir, ignore_errors=True)


def run_worker() -> int:
    """Serve as one worker (started by the owner, the attach info in the environment). Returns 0
    when stopped, 1 when the owner is already gone, 2 when not started by an owner, 3 when its
    start failed (no view from the owner in time: the owner restarts it)."""
    try:
        spec, payload = ProcessSpec.pop_from_env()
    except KeyError:
        print("error: orchestrator.worker_main is started by the orchestrator's owner process, not by hand",
              file=sys.stderr)
        return 2
    log_level = payload["log_level"]
    logging.basicConfig(level=log_level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # The owner's log file is this worker's too: each line names its process.
    install_log_filter(f"%(asctime)s orch[{spec.index}] %(levelname)s %(name)s [%(request_id)s]: %(message)s")
    if os.getppid() != spec.owner_pid:  # the owner died before PR_SET_PDEATHSIG was armed
        log.error("the owner (pid %d) is gone; not starting", spec.owner_pid)
        return 1
    from .app import create_app  # imported after the checks above: a refused start stays cheap

    topology = Topology.model_validate(payload["topology"])
    s = topology.orchestrator
    sockets = [bind_public(s.host, s.port), bind_unix(spec.socket_path(spec.index))]
    return _serve(create_app(topology, group=spec), sockets, log_level)
