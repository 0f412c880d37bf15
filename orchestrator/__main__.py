"""``python -m orchestrator --config FILE``: serve the orchestrator of a topology with uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from pdserve.api_keys import MissingApiKey, load_api_key
from pdserve.config import TopologyError, load_topology

from .app import create_app
from .serve_options import SERVE_OPTIONS, freeze_startup_heap
from pdserve.request_id import install_log_filter


def main(argv: list[str] | None = None) -> int:
    """Run until SIGINT/SIGTERM. Returns 2 when the topology file is invalid or names an API key
    variable (``api_key_env``) that is unset or empty."""
    parser = argparse.ArgumentParser(prog="python -m orchestrator", description=__doc__)
    parser.add_argument("--config", required=True, help="topology YAML file")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--host", default=None, help="bind host (default: orchestrator.host; Slurm: 0.0.0.0)")
    args = parser.parse_args(argv)
    try:
        topology = load_topology(args.config)
        for env_name in (topology.orchestrator.api_key_env, topology.pool("ctx").api_key_env,
                         topology.pool("gen").api_key_env):
            load_api_key(env_name)  # a key variable exported nowhere is bad configuration, not a traceback
    except (TopologyError, MissingApiKey) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request is too much
    install_log_filter()  # every line names the request it was written for
    if args.host:
        topology = topology.model_copy(update={"orchestrator": topology.orchestrator.model_copy(update={"host": args.host})})
    s = topology.orchestrator
    if s.num_workers > 1:  # K processes on the port; process 0 (this one) owns the control plane
        from .group_main import run_owner

        return run_owner(topology, args.config, args.log_level)
    app = create_app(topology, config_path=args.config)
    freeze_startup_heap()  # see orchestrator/serve_options.py, as for SERVE_OPTIONS
    uvicorn.run(app, host=s.host, port=s.port, log_level=args.log_level, **SERVE_OPTIONS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
