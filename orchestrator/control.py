"""``pdserve status`` and ``pdserve scale``: the operator's view of a running cluster.

Both talk to the orchestrator over HTTP (``--url``, or the address in ``--config FILE``).
``scale`` needs the admin token: ``$PDSERVE_ADMIN_TOKEN`` (or the variable ``--token-env`` names),
else the file ``--token-file`` (``pdserve up`` writes ``logs/admin_token`` when it made one).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from pdserve.config import TopologyError, load_topology

COMMANDS = ("status", "scale")
DEFAULT_URL = "http://127.0.0.1:8000"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser("status", help="print each pool's servers, state and load")
    _add_target(status)
    status.add_argument("--json", action="store_true", help="print /cluster/status as JSON")
    scale = sub.add_parser("scale", help="resize pools: pdserve scale ctx=2 gen=3")
    scale.add_argument("sizes", nargs="+", metavar="POOL=N", help="target size per pool (ctx, gen)")
    _add_target(scale)
    scale.add_argument("--token-env", default="PDSERVE_ADMIN_TOKEN", help="variable holding the admin token")
    scale.add_argument("--token-file", default=str(Path.cwd() / "logs" / "admin_token"),
                       help="file holding the admin token (when the variable is unset)")
    scale.add_argument("--no-wait", action="store_true", help="return once the orchestrator accepted the targets")
    scale.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the pools to settle")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"orchestrator URL (default {DEFAULT_URL})")
    p.add_argument("--config", default=None, help="topology YAML: take the orchestrator URL from it")


def orchestrator_url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url.rstrip("/")
    if args.config:
        return load_topology(args.config).orchestrator_url
    return os.environ.get("PDSERVE_ORCHESTRATOR_URL", DEFAULT_URL).rstrip("/")


def run(args: argparse.Namespace) -> int:
    try:
        url = orchestrator_url(args)
        return cmd_status(url, args.json) if args.command == "status" else cmd_scale(url, args)
    except TopologyError as err:
        print(f"error: {err}", file=sys.stderr)
    except httpx.HTTPError as err:
        print(f"error: cannot reach the orchestrator: {type(err).__name__}: {err}", file=sys.stderr)
    return 1


def fetch_status(url: str) -> dict:
    resp = httpx.get(f"{url}/cluster/status", timeout=5.0, trust_env=False)
    resp.raise_for_status()
    return resp.json()


def status_table(status: dict) -> Table:
    """Pools and servers; a "kv index" column and a "prefix hits" line per pool (the caption) when
    the orchestrator follows KV events (a ``kv_cache_aware`` pool)."""
    table = Table(title=f"pdserve cluster: {status['model']} ({'ready' if status['ready'] else 'NOT READY'}, "
                        f"launcher {status['launcher']})")
    kv = any(s.get("kv_index") is not None for pool in status["pools"].values() for s in pool["servers"])
    cols = ("pool", "server", "url", "source", "state", "in flight", "served") + (("kv index",) if kv else ()) \
        + ("last error",)
    for col in cols:
        table.add_column(col, overflow="fold")
    for role, pool in status["pools"].items():
        size = f"target {pool['target']}" if "target" in pool else f"min {pool['min_instances']}"
        head = f"{role} ({pool['ready']} ready, {size}, {pool['router']})"
        if not pool["servers"]:
            table.add_row(head, "-", "-", "-", "no members", "0", "0", *([""] if kv else []), "")
        for i, s in enumerate(pool["servers"]):
            table.add_row(head if i == 0 else "", s["name"], s["url"], s["source"], s["state"], str(s["in_flight"]),
                          str(s["served"]), *([kv_index_cell(s.get("kv_index"))] if kv else []), s["last_error"] or "")
        table.add_section()
    if kv:
        table.caption = "\n".join(f"{role} prefix hits: {kv_hits_cell(pool['kv_hits'])}"
                                   for role, pool in status["pools"].items() if pool.get("kv_hits", {}).get("requests"))
    return table


def kv_index_cell(index: dict | None) -> str:
    """``synced 42 blocks (seq 7)``, ``load-only: <why>``, or empty when KV events are not followed."""
    if index is None:
        return ""
    if index["synced"]:
        return f"synced {index['blocks']} blocks (seq {index['seq']})"
    return f"load-only: {index['reason']}"


def kv_hits_cell(hits: dict) -> str:
    """The router's self-check of one pool: predicted vs reported prefix-cache hit tokens."""
    return (f"predicted {hits['predicted_hit_tokens']} / reported {hits['reported_hit_tokens']} hit tokens "
            f"of {hits['prompt_tokens']} prompt tokens ({hits['requests']} requests, "
            f"{hits['unindexed']} routed without an index)")


def processes_line(status: dict) -> str | None:
    """One line naming the orchestrator's processes (``orchestrator.num_workers`` > 1), else None."""
    if not status.get("processes"):
        return None
    return "orchestrator processes: " + "; ".join(
        f"{p['index']} {p['role']} pid {p['pid']}" + ("" if p["alive"] else " DEAD")
        + (f" ({p['restarts']} restarts, {p.get('in_flight', 0)} in flight)" if p["role"] == "worker" else "")
        for p in status["processes"])


def cmd_status(url: str, as_json: bool) -> int:
    status = fetch_status(url)
    if as_json:
        import json

        print(json.dumps(status, indent=2))
    else:
        console = Console(width=160)
        console.print(status_table(status))
        if (line := processes_line(status)) is not None:
            console.print(line)
    return 0 if status["ready"] else 3


def read_token(args: argparse.Namespace) -> str | None:
    token = os.environ.get(args.token_env)
    if token:
        return token
    try:
        return Path(args.token_file).read_text().strip() or None
    except OSError:
        return None


def parse_sizes(items: list[str]) -> dict[str, int]:
    sizes = {}
    for item in items:
        pool, _, n = item.partition("=")
        if pool not in ("ctx", "gen") or not n.isdigit():
            raise SystemExit(f"error: {item!r}: expected ctx=N or gen=N")
        sizes[pool] = int(n)
    return sizes


def settled(status: dict, sizes: dict[str, int]) -> bool:
    for pool, n in sizes.items():
        p = status["pools"][pool]
        if p.get("launching", 0) or p.get("draining", 0) or p["ready"] != n or len(p["servers"]) != n:
            return False
    return True


def cmd_scale(url: str, args: argparse.Namespace) -> int:
    sizes = parse_sizes(args.sizes)
    token = read_token(args)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for pool, n in sizes.items():
        resp = httpx.post(f"{url}/cluster/pools/{pool}/scale", json={"instances": n}, headers=headers, timeout=10.0,
                          trust_env=False)
        if resp.status_code != 202:
            message = resp.json().get("error", {}).get("message", resp.text)
            print(f"error: scaling {pool} to {n}: HTTP {resp.status_code}: {message}", file=sys.stderr)
            return 1
        print(f"{pool}: target {n} (was {resp.json()['size']})", flush=True)
    if args.no_wait:
        return 0
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        status = fetch_status(url)
        if settled(status, sizes):
            console = Console(width=160)
        console.print(status_table(status))
        if (line := processes_line(status)) is not None:
            console.print(line)
            return 0
        time.sleep(0.5)
    print(f"error: the pools did not settle within {args.timeout:g} s", file=sys.stderr)
    Console(width=160, stderr=True).print(status_table(fetch_status(url)))
    return 1
