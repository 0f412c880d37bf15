"""Loopback delayed ACKs, and why a router bench must turn them off.

A server that leaves Nagle's algorithm on (no ``TCP_NODELAY``: sglang-router 0.3.2's HTTP server)
writes a streamed response's head and its first body chunk as two small segments; the second
waits for the ACK of the first, and a client that delays its ACKs (Linux does, up to 40 ms, on a
connection that looks interactive; wrk and this project's raw c1 client do not ask otherwise)
sends it only when its delayed-ACK timer fires. Measured here (2026-12-04, `bench/_c1.py` without
``TCP_QUICKACK``): sglang-router's TTFT p50 43.9 ms instead of 0.6 ms, and wrk at 32 connections
capped at ~32 / 44 ms = 711 req/s instead of 2,730 — a client artifact, not the router's speed.
pdserve's servers and orchestrator set ``TCP_NODELAY`` (uvloop's default), so they never stall.

The route attribute ``quickack 1`` (iproute2, ``ip-route(8)``) makes the kernel ACK at once on
every connection over that route: with it on the loopback routes, every client of a bench sees
every router without this artifact. Setting it needs root (``CAP_NET_ADMIN``).
"""

from __future__ import annotations

import os
import subprocess

# The two local routes 127.0.0.1 uses (longest prefix first); their attributes as the kernel made them.
ROUTES = (("local", "127.0.0.1"), ("local", "127.0.0.0/8"))
_ROUTE_TAIL = ("dev", "lo", "proto", "kernel", "scope", "host", "src", "127.0.0.1", "table", "local")


def quickack_on() -> bool | None:
    """Whether the route to 127.0.0.1 ACKs at once (None: ``ip`` is missing or failed)."""
    try:
        out = subprocess.run(["ip", "route", "get", "127.0.0.1"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return None if out.returncode else "quickack 1" in out.stdout


def _set(value: int) -> None:
    for kind, prefix in ROUTES:
        subprocess.run(["ip", "route", "change", kind, prefix, *_ROUTE_TAIL, "quickack", str(value)],
                       check=True, capture_output=True, timeout=10)


class LoopbackQuickAck:
    """Context manager: ``quickack 1`` on the loopback routes for its duration where it was off and
    this process is root (then put back as found); :attr:`state` says what held during the run:
    ``"on"`` (already), ``"set"`` (set here), or ``"off: <why>"`` (a bench then notes that routers
    without TCP_NODELAY were measured with the delayed-ACK stall)."""

    def __init__(self) -> None:
        self.state = ""
        self._restore = False

    def __enter__(self) -> "LoopbackQuickAck":
        now = quickack_on()
        if now:
            self.state = "on"
        elif now is None:
            self.state = "off: `ip route get 127.0.0.1` failed"
        elif os.geteuid() != 0:
            self.state = "off: not root (run `ip route change local 127.0.0.1 dev lo ... quickack 1` as root)"
        else:
            try:
                _set(1)
                self._restore, self.state = True, "set"
            except (OSError, subprocess.SubprocessError) as err:
                self.state = f"off: setting it failed ({err})"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._restore:
            _set(0)

    def note(self) -> str:
        """One sentence for a bench's section."""
        if self.state in ("on", "set"):
            return ("Loopback delayed ACKs were off for the run (`quickack 1` on the 127.0.0.1 routes, "
                    + ("set by the bench and restored after" if self.state == "set" else "already set")
                    + "; bench/_loopback.py: without it sglang-router, which leaves Nagle on, stalls ~40 ms "
                    "per streamed answer under wrk).")
        return (f"**Loopback delayed ACKs were on** ({self.state}): sglang-router leaves Nagle on, so under "
                "wrk and the raw c1 client each of its streamed answers waits ~40 ms for a delayed ACK "
                "(bench/_loopback.py); its rows here are that artifact, not its speed.")
