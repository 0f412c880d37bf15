"""Free TCP ports for servers a process starts (the launcher, tests, benches).

Why not ``bind(0)``: the kernel hands out port 0 from the ephemeral range, the same range outgoing
connections draw their source ports from, and a server binds its port a second or more after the
probe (a Python process starting). In between, any connection on the host may take that port as its
source port; the server then fails with EADDRINUSE, and so does each restart on the same address.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PORT_PROBES = 64


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux; 32768-60999 by default,
    and that default where the file is missing or unreadable)."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return lo, hi


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port nothing is bound to on ``host``, chosen outside the ephemeral range where there is
    room: a port from that range (what binding port 0 gives) can become some outgoing connection's
    source port between this probe and the server's own bind a second later, and then the server
    and each of its restarts, on the same port, fail with EADDRINUSE (seen in the test suite, whose
    processes open thousands of loopback connections). Random probes of 1024..lo-1 (or hi+1..65535),
    each checked with a bind; port 0's pick if none is free."""
    rng = rng or random.Random()
    lo, hi = ephemeral_range()
    span = (1024, lo - 1) if lo - 1024 >= 1024 else (hi + 1, 65535)
    if span[1] - span[0] >= 1024:
        for _ in range(_PORT_PROBES):
            port = rng.randint(*span)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
