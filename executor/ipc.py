"""IPC wire of the executor lattice: HMAC-signed pickles and client-id namespacing.

Messages between frontends and the rank-0 worker are ``tag || pickle`` where ``tag`` is
HMAC-SHA256 (RFC 2104) of the pickle under a per-server 32-byte key. A message whose tag does not
verify is dropped and counted, **never unpickled** (unpickling runs code). These sockets are
``ipc://`` files in a private (0700) directory; nothing pickled ever crosses a network socket.

Client ids are uint64: bits 57..62 hold the frontend id (6 bits: up to 64 frontends, just below the
sign bit) and bits 0..56 a per-frontend sequence number. The response lane of a request is
``client_id >> 57``; ``None``, negative or out-of-range ids go to lane 0.
"""

from __future__ import annotations

import hmac
import logging
import pickle
import secrets
import threading

log = logging.getLogger(__name__)

KEY_BYTES = 32
TAG_BYTES = 32
FRONTEND_SHIFT = 57
MAX_FRONTENDS = 64
SEQ_MASK = (1 << FRONTEND_SHIFT) - 1
MAX_BATCH = 100  # outputs fused into one zmq message per lane


def new_key() -> bytes:
    """A fresh 32-byte HMAC key."""
    return secrets.token_bytes(KEY_BYTES)


def make_client_id(frontend_id: int, seq: int) -> int:
    """uint64 id: frontend id in bits 57..62, ``seq`` (mod 2**57) below. Raises ValueError."""
    if not 0 <= frontend_id < MAX_FRONTENDS:
        raise ValueError(f"frontend id {frontend_id} out of range [0, {MAX_FRONTENDS})")
    return (frontend_id << FRONTEND_SHIFT) | (seq & SEQ_MASK)


def lane_of(client_id: int | None, num_lanes: int = MAX_FRONTENDS) -> int:
    """The response lane (frontend id) of ``client_id``; lane 0 for None, negative or out-of-range."""
    if client_id is None or client_id < 0 or client_id >= 1 << 63:
        return 0
    lane = client_id >> FRONTEND_SHIFT
    return lane if lane < num_lanes else 0


class ForgedMessage(ValueError):
    """A message whose HMAC tag does not verify (or that is too short to carry one)."""


class Codec:
    """Signs and verifies IPC messages with one key; counts rejected messages (thread-safe)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"HMAC key must be {KEY_BYTES} bytes, got {len(key)}")
        self._key = key
        self._lock = threading.Lock()
        self.rejected = 0

    def encode(self, obj: object) -> bytes:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return hmac.digest(self._key, payload, "sha256") + payload  # one-shot C HMAC (RFC 2104)

    def decode(self, data: bytes) -> object:
        """Verify, then unpickle. Raises :class:`ForgedMessage` (counted) when the tag is wrong."""
        tag, payload = data[:TAG_BYTES], data[TAG_BYTES:]
        expected = hmac.digest(self._key, payload, "sha256")
        if len(data) <= TAG_BYTES or not hmac.compare_digest(tag, expected):
            with self._lock:
                self.rejected += 1
            raise ForgedMessage(f"dropped an IPC message of {len(data)} bytes with a bad HMAC tag")
        return pickle.loads(payload)

    def try_decode(self, data: bytes) -> object | None:
        """Like :meth:`decode`, but logs and returns None for a forged message."""
        try:
            return self.decode(data)
        except ForgedMessage as err:
            log.warning("%s (rejected so far: %d)", err, self.rejected)
            return None
