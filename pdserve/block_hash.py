"""Content hashes of full KV blocks: the names of a prefix cache's blocks (no torch).

A full block of ``block_size`` token ids is named by a hash chained from its parent block's hash,
so one hash stands for the whole token prefix up to the end of that block (as in vLLM's automatic
prefix caching and nano-vllm's block manager). The engine's block manager, the orchestrator's
``kv_cache_aware`` router and (later) the KV-event stream all call this module, so every side
names the same tokens with the same bytes. The TP layout is *not* in the hash: a TP-2 ctx server,
a TP-1 gen server and the orchestrator agree.

Encoding (version 1; every integer little-endian; BLAKE2b from :mod:`hashlib`, 16-byte digests):

* ``field(s)`` = ``u32(len(utf8(s))) || utf8(s)``
* root = ``BLAKE2b-128(b"pdserve-kv-block-v1" || field(model) || field(dtype) || u32(block_size)
  || salt)`` where salt = ``b"\\x00"`` without a ``cache_salt`` and ``b"\\x01" || field(cache_salt)``
  with one (requests with different salts never share a block);
* block *i* = ``BLAKE2b-128(hash(block i-1) || u32(t_0) || ... || u32(t_{block_size-1}))`` with
  ``hash(block -1)`` = root and ``t`` the block's token ids (each in ``[0, 2**32)``).

Python's ``hash()`` is never used: it is salted per process (``PYTHONHASHSEED``). A hit must still
compare the token ids (the engine does): a 128-bit hash makes a collision unlikely, not impossible.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

VERSION_TAG = b"pdserve-kv-block-v1"
DIGEST_BYTES = 16
_MAX_TOKEN = 2**32


def _field(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<I", len(data)) + data


def root_hash(model: str, dtype: str, block_size: int, cache_salt: str | None = None) -> bytes:
    """The parent hash of a sequence's first block (16 bytes; see the module docstring).

    Raises ValueError when ``block_size`` is not in ``[1, 2**32)``.
    """
    if not 0 < block_size < _MAX_TOKEN:
        raise ValueError(f"block_size must be in [1, 2**32), got {block_size}")
    salt = b"\x00" if cache_salt is None else b"\x01" + _field(cache_salt)
    data = VERSION_TAG + _field(model) + _field(dtype) + struct.pack("<I", block_size) + salt
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block (16 bytes) chained from ``parent``.

    Raises ValueError when a token id is outside ``[0, 2**32)``.
    """
    try:
        packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as err:
        raise ValueError(f"token ids must be in [0, 2**32): {err}") from None
    return hashlib.blake2b(parent + packed, digest_size=DIGEST_BYTES).digest()


@dataclass(frozen=True)
class BlockHasher:
    """Names full blocks of one model's KV: ``model`` (the served model id, as in the KV layout),
    ``dtype`` of the KV cache and ``block_size`` in tokens."""

    model: str
    dtype: str
    block_size: int

    def root(self, cache_salt: str | None = None) -> bytes:
        """The parent hash of block 0 for ``cache_salt`` (see :func:`root_hash`)."""
        return root_hash(self.model, self.dtype, self.block_size, cache_salt)

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
        chain = self.chain(cache_salt)
        chain.extend(token_ids)
        return chain.hashes

    def chain(self, cache_salt: str | None = None) -> "HashChain":
        """An empty chain for one sequence (extend it as its tokens grow)."""
        return HashChain(self.root(cache_salt), self.block_size)


@dataclass
class HashChain:
    """The block hashes of one growing token sequence: ``hashes[i]`` names full block ``i``.

    ``extend(token_ids)`` takes the *whole* token list seen so far (it only appends) and hashes the
    full blocks not hashed yet, so each block is hashed once however often it is called.
    """

    root: bytes
    block_size: int
    hashes: list[bytes] = field(default_factory=list)

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        bs = self.block_size
        for i in range(len(self.hashes), len(token_ids) // bs):
            parent = self.hashes[-1] if self.hashes else self.root
            self.hashes.append(block_hash(parent, token_ids[i * bs:(i + 1) * bs]))
        return self.hashes
