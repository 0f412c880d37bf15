"""``pdserve`` command line: ``pdserve up FILE``, ``pdserve config check FILE`` and ``pdserve bench ...``."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
from pathlib import Path

import yaml

from pdserve.config import Topology, TopologyError, check_model_files, load_topology
from pdserve.dtypes import describe_resolution, read_cpu_flags

from . import control
from .launcher import LaunchError, LocalLauncher


class _Terminated(Exception):
    """SIGTERM arrived: stop the cluster like on Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


def _self_command() -> str:
    """How to call this CLI again from the user's shell: the venv's script path when not on PATH."""
    argv0 = sys.argv[0]
    if os.path.basename(argv0) == "pdserve" and shutil.which("pdserve") != os.path.abspath(argv0):
        return os.path.relpath(argv0) if not os.path.isabs(argv0) else argv0
    return "pdserve"


def curl_line(topology: Topology, url: str) -> str:
    """A ready-to-paste chat-completion request against the orchestrator (with the API key's
    ``Authorization`` header, read from its variable by the user's shell, when one is set)."""
    body = {"model": topology.model.name, "messages": [{"role": "user", "content": "Hello! Who are you?"}],
            "max_tokens": 32}
    env = topology.orchestrator.api_key_env
    auth = f' -H "Authorization: Bearer ${env}"' if env else ""
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{json.dumps(body)}'"


def ensure_admin_token(topology: Topology, log_dir: str) -> str | None:
    """Where the admin token is: the environment, or a fresh one written to ``LOG_DIR/admin_token``
    (mode 0600) and exported to the children, so ``pdserve scale`` works on a local cluster."""
    env = topology.orchestrator.admin_token_env
    if os.environ.get(env):
        return f"${env}"
    path = Path(log_dir) / "admin_token"
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.environ[env] = token
    return str(path)


def up_log_dir(topology: Topology, flag: str | None) -> Path:
    """Where ``pdserve up`` writes its logs and admin token: ``--log-dir`` when given, else the
    file's ``launcher.log_dir`` (relative to the current directory; default ``logs``)."""
    return Path(flag if flag is not None else topology.launcher.log_dir)


def cmd_up(config: str, log_dir_flag: str | None) -> int:
    """Start the cluster and serve until Ctrl-C/SIGTERM (0) or a child's death (1)."""
    try:
        topology = load_topology(config)
        log_dir = up_log_dir(topology, log_dir_flag)
        token_where = ensure_admin_token(topology, log_dir)
        os.environ["PDSERVE_LOG_DIR"] = str(Path(log_dir).resolve())  # where launched servers log
        launcher = LocalLauncher(config, topology=topology, log_dir=log_dir)
    except TopologyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        launcher.start()
        launcher.wait_ready()
        print(f"\npdserve is ready at {launcher.url}\n  {curl_line(launcher.topology, launcher.url)}\n"
              f"  {_self_command()} status --url {launcher.url}    (admin token: {token_where})\n"
              "Press Ctrl-C (or send SIGTERM) to stop.", flush=True)
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


def cmd_config_check(config: str, check_files: bool = True) -> int:
    """Validate a topology file; print it resolved as YAML (0) or the path-naming error (1)."""
    try:
        topology = load_topology(config)
    except TopologyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    problems = check_model_files(topology) if check_files else []
    if problems:
        print(f"error: {config}: " + "\n".join(problems), file=sys.stderr)
        return 1
    print(yaml.safe_dump(topology.model_dump(mode="json"), sort_keys=False), end="")
    cpu_flags = read_cpu_flags()
    print("# resolved servers (pool engine overrides applied; engine.dtype as a server on this machine resolves it):")
    for role in ("ctx", "gen"):
        print(f"#   {role}: {describe_resolution(topology.pool_engine(role).dtype, cpu_flags)}")
        for i in range(len(getattr(topology.pools, role).servers)):
            engine = topology.server_config(role, i).with_resolved_dtype(cpu_flags).engine.model_dump(mode="json")
            print(f"#   {role}[{i}] {topology.server_url(role, i)} engine: {json.dumps(engine)}")
        p = topology.pool(role)
        print(f"#   {role}: {p.initial_instances} initial instance(s), router {topology.pool_router(role)}, "
              f"min {p.min_instances}, max {p.max_instances}, max_restarts {p.max_restarts}")
    return 0


def cmd_config_schema() -> int:
    """Print the JSON schema of topology files."""
    print(json.dumps(Topology.model_json_schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start every server of a topology and the orchestrator")
    up.add_argument("config", help="topology YAML file")
    up.add_argument("--log-dir", default=None,
                    help="one log file per server (default: the file's launcher.log_dir, ./logs)")
    config = sub.add_parser("config", help="topology file tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a topology file and print it resolved")
    check.add_argument("config", help="topology YAML file")
    check.add_argument("--no-files", action="store_true", help="do not check that model.path exists here")
    config_sub.add_parser("schema", help="print the JSON schema of topology files")
    control.add_parsers(sub)
    sub.add_parser("bench", help="load-test an OpenAI server (pdserve bench --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the load generator owns its arguments (pdbench/cli.py)
        from pdbench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "up":
        return cmd_up(args.config, args.log_dir)
    if args.command in control.COMMANDS:
        return control.run(args)
    if args.config_command == "schema":
        return cmd_config_schema()
    return cmd_config_check(args.config, check_files=not args.no_files)


if __name__ == "__main__":
    sys.exit(main())
