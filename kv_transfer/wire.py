"""Framing of the KV transceivers' control messages: a 4-byte big-endian length, then JSON.

Both backends use the same frames (TCP over a socket, UCX as tagged messages). Bulk KV bytes
follow a ``pull`` answer unframed (the header says how many). JSON only: nothing pickled ever
crosses the wire. Encoded with orjson (already the orchestrator's JSON library): a same-host pull
sends four frames, and the stdlib's ``json`` cost ~5 us more per frame.
"""

from __future__ import annotations

import socket
import struct
import time

import orjson

MAX_HEADER_BYTES = 1 << 20


class KVTransferError(RuntimeError):
    """A KV pull failed: peer unreachable, refused (lease gone, layout mismatch), or timed out."""


def pack_msg(msg: dict) -> bytes:
    """One control frame: 4-byte big-endian length, then the JSON body."""
    try:
        data = orjson.dumps(msg)
    except TypeError as err:  # orjson.JSONEncodeError: a value JSON cannot carry (e.g. an int past 64 bits)
        raise KVTransferError(f"control message cannot be encoded: {err}") from None
    if len(data) > MAX_HEADER_BYTES:
        raise KVTransferError(f"control message of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    return struct.pack(">I", len(data)) + data


def unpack_msg(frame: bytes | memoryview) -> dict:
    """Parse a frame made by :func:`pack_msg` (trailing bytes after the body are ignored)."""
    if len(frame) < 4:
        raise KVTransferError("bad control message: shorter than its length prefix")
    (size,) = struct.unpack(">I", bytes(frame[:4]))
    if size > min(MAX_HEADER_BYTES, len(frame) - 4):
        raise KVTransferError(f"bad control message: length {size} exceeds the {len(frame) - 4} bytes received")
    return _decode(bytes(frame[4:4 + size]))


def _decode(body: bytes | bytearray) -> dict:
    try:
        msg = orjson.loads(body)
    except ValueError as err:  # orjson.JSONDecodeError (invalid JSON or UTF-8)
        raise KVTransferError(f"bad control message: {err}") from None
    if not isinstance(msg, dict):
        raise KVTransferError("bad control message: not a JSON object")
    return msg


def send_msg(sock: socket.socket, msg: dict) -> None:
    sock.sendall(pack_msg(msg))


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``, by ``deadline`` (``time.monotonic``) when given.

    Raises:
        KVTransferError: the peer closed early.
        socket.timeout: the socket's timeout or ``deadline`` passed.
    """
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"deadline passed after {got} of {len(view)} bytes")
            sock.settimeout(left)
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
    return _decode(body)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` → (host, port). Raises :class:`KVTransferError` for other forms."""
    if not endpoint.startswith("tcp://"):
        raise KVTransferError(f"unsupported KV endpoint {endpoint!r} (this server speaks tcp://)")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit():
        raise KVTransferError(f"malformed KV endpoint {endpoint!r}")
    return host, int(port)
