"""Entry point of an attached frontend (1..K-1): ``python -m executor.frontend_main``.

Started only by frontend 0 (``executor.frontends.AttachedFrontends``), with the attach info in the
``PDSERVE_ATTACH`` environment variable, which is removed on read so that nothing this process
starts inherits the key.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading

from executor.frontends import lattice_state, mark_ready
from executor.proxy import AttachInfo
from executor.server_main import bind_socket, serve
from pdserve.config import ServerConfig


def exit_with_parent() -> None:
    """SIGTERM ourselves (a graceful uvicorn shutdown) when frontend 0 exits, even by kill -9."""
    parent = os.getppid()
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGTERM)
        return

    def wait() -> None:
        select.select([fd], [], [])  # readable when the parent exits; no timeout needed
        logging.getLogger(__name__).error("frontend 0 (pid %d) exited; stopping this frontend", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="parent-watch", daemon=True).start()


def main() -> int:
    try:
        info = AttachInfo.pop_from_env()
    except KeyError:
        print("error: executor.frontend_main is started by a server's frontend 0, not by hand", file=sys.stderr)
        return 2
    cfg = ServerConfig.model_validate(info.server)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {cfg.role}[{cfg.index}].fe{info.frontend_id} "
                        "%(levelname)s %(name)s: %(message)s")
    exit_with_parent()
    sock = bind_socket(cfg.host, cfg.port)
    state, _ = lattice_state(cfg, info)
    state.on_startup.append(lambda: mark_ready(info))
    return serve(state, sock, exit_when_dead=False)  # frontend 0 exits for a dead engine; we stop with it


if __name__ == "__main__":
    sys.exit(main())
