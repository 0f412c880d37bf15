"""Framing of the KV transceiver's control messages: a 4-byte big-endian length, then JSON.

Bulk KV bytes follow a ``pull`` answer unframed (the header says how many). JSON only: nothing
pickled ever crosses a network socket.
"""

from __future__ import annotations

import json
import socket
import struct

MAX_HEADER_BYTES = 1 << 20


class KVTransferError(RuntimeError):
    """A KV pull failed: peer unreachable, refused (lease gone, layout mismatch), or timed out."""


def send_msg(sock: socket.socket, msg: dict) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``. Raises :class:`KVTransferError` if the peer closes early."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise KVTransferError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


def recv_msg(sock: socket.socket) -> dict:
    """Read one framed JSON message. Raises :class:`KVTransferError` on EOF or a bad frame."""
    head = bytearray(4)
    recv_exact_into(sock, memoryview(head))
    (size,) = struct.unpack(">I", head)
    if size > MAX_HEADER_BYTES:
        raise KVTransferError(f"control message of {size} bytes exceeds {MAX_HEADER_BYTES}")
    body = bytearray(size)
    recv_exact_into(sock, memoryview(body))
    try:
        msg = json.loads(body)
    except json.JSONDecodeError as err:
        raise KVTransferError(f"bad control message: {err}") from None
    if not isinstance(msg, dict):
        raise KVTransferError("bad control message: not a JSON object")
    return msg


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` → (host, port). Raises :class:`KVTransferError` for other forms."""
    if not endpoint.startswith("tcp://"):
        raise KVTransferError(f"unsupported KV endpoint {endpoint!r} (this server speaks tcp://)")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit():
        raise KVTransferError(f"malformed KV endpoint {endpoint!r}")
    return host, int(port)
