"""pdserve.ports.free_port: servers we start get ports outside the kernel's ephemeral range,
which outgoing connections draw their source ports from (a port taken that way between the probe
and the server's bind made the server and all its restarts fail with EADDRINUSE)."""

from __future__ import annotations

import random
import socket

from pdserve import ports as backends


def test_ports_come_from_outside_the_ephemeral_range_and_are_free(tmp_path, monkeypatch):
    lo, hi = backends.ephemeral_range()
    rng = random.Random(7)
    for _ in range(20):
        port = backends.free_port("127.0.0.1", rng)
        assert not lo <= port <= hi
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing holds it


def test_a_taken_port_is_skipped(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]

    class Picks:  # the taken port first, then one outside it
        def __init__(self) -> None:
            self.n = 0

        def randint(self, a: int, b: int) -> int:
            self.n += 1
            return port if self.n == 1 else (a if a != port else a + 1)

    monkeypatch.setattr(backends, "ephemeral_range", lambda: (1, 1023))  # probes above it, as taken's port
    try:
        picks = Picks()
        got = backends.free_port("127.0.0.1", picks)
        assert got != port and picks.n == 2
    finally:
        taken.close()


def test_no_room_outside_the_range_falls_back_to_the_kernels_pick(tmp_path):
    f = tmp_path / "range"
    f.write_text("1024\t65535\n")
    assert backends.ephemeral_range(f) == (1024, 65535)
    assert backends.ephemeral_range(tmp_path / "missing") == (32768, 60999)


def test_without_room_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(backends, "ephemeral_range", lambda: (1024, 65535))
    port = backends.free_port("127.0.0.1")
    assert 1024 <= port <= 65535
