"""Entry point of an attached frontend (1..K-1): ``python -m executor.frontend_main``.

Started only by frontend 0 (``executor.frontends.AttachedFrontends``), with the attach info in the
``PDSERVE_ATTACH`` environment variable, which is removed on read so that nothing this process
starts inherits the key.
"""

from __future__ import annotations

import logging
import sys

from executor.frontends import lattice_state, mark_ready
from executor.proxy import AttachInfo
from executor.server_main import bind_socket, serve
from pdserve.config import ServerConfig


def main() -> int:
    try:
        info = AttachInfo.pop_from_env()
    except KeyError:
        print("error: executor.frontend_main is started by a server's frontend 0, not by hand", file=sys.stderr)
        return 2
    cfg = ServerConfig.model_validate(info.server)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {cfg.role}[{cfg.index}].fe{info.frontend_id} "
                        "%(levelname)s %(name)s: %(message)s")
    sock = bind_socket(cfg.host, cfg.port)
    state, _ = lattice_state(cfg, info)
    state.on_startup.append(lambda: mark_ready(info))
    serve(state, sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
