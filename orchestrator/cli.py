"""``pdserve`` command line: ``pdserve up FILE`` and ``pdserve config check FILE``."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import yaml

from pdserve.config import Topology, TopologyError, load_topology

from .launcher import LaunchError, LocalLauncher


class _Terminated(Exception):
    """SIGTERM arrived: stop the cluster like on Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


def curl_line(topology: Topology, url: str) -> str:
    """A ready-to-paste chat-completion request against the orchestrator."""
    body = {"model": topology.model.name, "messages": [{"role": "user", "content": "Hello! Who are you?"}],
            "max_tokens": 32}
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'"


def cmd_up(config: str, log_dir: str) -> int:
    """Start the cluster and serve until Ctrl-C/SIGTERM (0) or a child's death (1)."""
    try:
        launcher = LocalLauncher(config, log_dir=log_dir)
    except TopologyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        launcher.start()
        launcher.wait_ready()
        print(f"\npdserve is ready at {launcher.url}\n  {curl_line(launcher.topology, launcher.url)}\n"
              "Press Ctrl-C to stop.", flush=True)
        launcher.serve_forever()
    except (LaunchError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated):
        print("\nstopping the cluster", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
        launcher.stop()
        signal.signal(signal.SIGTERM, previous)
    return 0


def cmd_config_check(config: str) -> int:
    """Validate a topology file; print it resolved as YAML (0) or the path-naming error (1)."""
    try:
        topology = load_topology(config)
    except TopologyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(yaml.safe_dump(topology.model_dump(mode="json"), sort_keys=False), end="")
    print("# resolved servers (pool engine overrides applied):")
    for role in ("ctx", "gen"):
        for i in range(len(getattr(topology.pools, role).servers)):
            engine = topology.server_config(role, i).engine.model_dump(mode="json")
            print(f"#   {role}[{i}] {topology.server_url(role, i)} engine: {json.dumps(engine)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start every server of a topology and the orchestrator")
    up.add_argument("config", help="topology YAML file")
    up.add_argument("--log-dir", default=str(Path.cwd() / "logs"), help="one log file per server (default: ./logs)")
    config = sub.add_parser("config", help="topology file tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a topology file and print it resolved")
    check.add_argument("config", help="topology YAML file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "up":
        return cmd_up(args.config, args.log_dir)
    return cmd_config_check(args.config)


if __name__ == "__main__":
    sys.exit(main())
