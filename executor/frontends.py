"""HTTP frontends of the lattice: building a frontend's state, and frontend 0's attached frontends.

Frontend 0 re-execs ``num_frontends - 1`` attached frontends (``python -m executor.frontend_main``)
that get the attach info (addresses, key, rank pids) through the ``PDSERVE_ATTACH`` environment
variable, which they remove on read. They bind the same port with SO_REUSEPORT, never launch ranks
and never send the engine-shutdown sentinel.

Restart policy: an attached frontend that dies is restarted after ``RESTART_BACKOFF_S``, at most
``MAX_RESTARTS`` times per frontend slot; after that its slot stays empty (logged) and the other
frontends keep serving. Stopping frontend 0 stops them (SIGTERM, SIGKILL after a grace period).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from executor.http_server import ServerState
from executor.lattice_client import LatticeClient
from executor.proxy import ATTACH_ENV, AttachInfo
from executor.server_setup import make_state
from pdserve.config import ServerConfig
from pdserve.protocol import KVLayoutModel

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_RESTARTS = 5
RESTART_BACKOFF_S = 1.0
STOP_GRACE_S = 5.0


def load_tokenizer(cfg: ServerConfig) -> "Tokenizer":
    """The model's tokenizer alone (no EOS ids from the ranks yet): seconds of transformers import
    and file reads, which frontend 0 overlaps with its ranks' start-up. Raises OSError if absent."""
    from engine.model_files import resolve_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_model_path(resolve_model_path(cfg.model.path))


def lattice_state(cfg: ServerConfig, info: AttachInfo,
                  preloaded: "Tokenizer | None" = None) -> tuple[ServerState, LatticeClient]:
    """State of one frontend: its tokenizer (no weights), its lattice client, the role's handlers.
    ``preloaded``: :func:`load_tokenizer`'s result, if frontend 0 loaded it already; the ranks' EOS
    ids come first in its EOS list, as :meth:`Tokenizer.from_model_path` would put them."""
    from engine.tokenizer import Tokenizer

    wi = info.worker_info
    eos = [int(e) for e in wi["eos_token_ids"]]
    tok = preloaded if preloaded is not None else load_tokenizer(cfg)
    tokenizer = Tokenizer(tok.hf, eos + [e for e in tok.eos_token_ids if e not in eos], tok.source)
    client = LatticeClient(info, tokenizer)
    client.start()
    layouts = [KVLayoutModel.model_validate(x) for x in wi.get("kv_layouts") or [wi["kv_layout"]]]
    state = make_state(cfg, client, layouts[0], int(wi["vocab_size"]), layouts)
    state.frontend_id = info.frontend_id
    state.on_startup.append(client.attach_loop)  # the server's loop reads the lane from now on
    state.on_shutdown.append(client.shutdown)
    return state, client


def mark_ready(info: AttachInfo) -> None:
    """An attached frontend says it is about to accept connections (a file in the IPC directory)."""
    (Path(info.ipc_dir) / f"frontend{info.frontend_id}.ready").touch()


class AttachedFrontends:
    """Frontends 1..K-1 of one server, owned by frontend 0 (a watcher thread restarts them)."""

    def __init__(self, info: AttachInfo, cfg: ServerConfig, log_dir: Path) -> None:
        self.info, self.cfg, self.log_dir = info, cfg, log_dir
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarts: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="frontend-watch", daemon=True)

    def start(self) -> None:
        for fid in range(1, self.cfg.engine.num_frontends):
            self._spawn(fid)
        if self.procs:
            self._thread.start()

    def wait_ready(self, timeout_s: float) -> None:
        """Wait (bounded) until every attached frontend serves, so the server's readiness covers all K.

        A frontend that exits or is late is logged and left to the restart policy; frontend 0 serves
        anyway rather than failing the whole server.
        """
        deadline = time.monotonic() + timeout_s
        pending = set(self.procs)
        while pending and time.monotonic() < deadline:
            for fid in list(pending):
                if (Path(self.info.ipc_dir) / f"frontend{fid}.ready").exists():
                    pending.discard(fid)
                elif self.procs[fid].poll() is not None:
                    log.error("attached frontend %d exited during start-up (code %s)", fid, self.procs[fid].returncode)
                    pending.discard(fid)
            time.sleep(0.05)
        if pending:
            log.error("attached frontend(s) %s not ready within %.0f s", sorted(pending), timeout_s)

    def _spawn(self, fid: int) -> None:
        env = {**os.environ, ATTACH_ENV: self.info.to_env(fid)}
        path = self.log_dir / f"{self.cfg.role}{self.cfg.index}.frontend{fid}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as out:
            self.procs[fid] = subprocess.Popen([sys.executable, "-m", "executor.frontend_main"], env=env,
                                               stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.info("started attached frontend %d (pid %d, log %s)", fid, self.procs[fid].pid, path)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            for fid, proc in list(self.procs.items()):
                if proc.poll() is None or self._stop.is_set():
                    continue
                n = self.restarts.get(fid, 0)
                if n >= MAX_RESTARTS:
                    log.error("attached frontend %d exited (%s) and used up its %d restarts", fid, proc.returncode, MAX_RESTARTS)
                    del self.procs[fid]
                    continue
                log.warning("attached frontend %d exited with %s; restarting (%d/%d)", fid, proc.returncode, n + 1, MAX_RESTARTS)
                self.restarts[fid] = n + 1
                if self._stop.wait(RESTART_BACKOFF_S):
                    return
                self._spawn(fid)

    def pids(self) -> dict[int, int]:
        return {fid: p.pid for fid, p in self.procs.items()}

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for fid, proc in self.procs.items():
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("attached frontend %d ignored SIGTERM; killing it", fid)
                proc.kill()
                proc.wait(5)
