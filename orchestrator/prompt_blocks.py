"""A prompt's KV block hashes for routing, computed only as far as a router reads them.

The ``kv_cache_aware`` router asks each candidate server's KV index for the longest prefix of the
prompt's blocks it holds (:meth:`orchestrator.kv_index.ServerKVIndex.matched_blocks`), and that
walk stops at the first block the server lacks. So no block past the longest prefix any server
holds (plus one) is ever needed: :class:`PromptBlocks` hashes block *i* when someone first reads
it and keeps it for the next reader (the other pool's router, the self-check, a migration). Its
length, the number of full blocks, costs nothing. An 8,000-token prompt no server has seen costs
one block hash instead of 500.

The hashes are exactly :mod:`pdserve.block_hash`'s (version 1: BLAKE2b-128 chained from the
root of model, dtype, block size and cache salt), so they name the blocks the servers' prefix
caches report; ``tests/orchestrator/test_orch_prompt_blocks.py`` checks them against
:meth:`pdserve.block_hash.BlockHasher.hashes`.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterator, Sequence

from pdserve.block_hash import DIGEST_BYTES, root_hash


@functools.lru_cache(maxsize=16)
def _packer(block_size: int) -> struct.Struct:
    return struct.Struct(f"<{block_size}I")


@functools.lru_cache(maxsize=64)
def cached_root(model: str, dtype: str, block_size: int) -> bytes:
    """:func:`pdserve.block_hash.root_hash` without a cache salt, computed once per layout."""
    return root_hash(model, dtype, block_size)


class PromptBlocks(Sequence[bytes]):
    """The chained hashes (16 bytes each) of the full ``block_size``-token blocks of ``token_ids``
    under ``root``; block *i* is hashed when first read (index or iteration) and kept.

    ``token_ids`` is read, never copied or changed: do not change it afterwards.
    Reading a block whose token ids fall outside ``[0, 2**32)`` raises ValueError.
    """

    __slots__ = ("_ids", "_size", "_root", "_hashes", "_count", "_pack")

    def __init__(self, token_ids: Sequence[int], block_size: int, root: bytes) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._ids = token_ids
        self._size = block_size
        self._root = root
        self._hashes: list[bytes] = []
        self._count = len(token_ids) // block_size
        self._pack = _packer(block_size)

    @property
    def hashed(self) -> int:
        """How many blocks were hashed so far (the rest were never needed)."""
        return len(self._hashes)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"block {i} of a prompt with {self._count} full blocks")
        if i >= len(self._hashes):
            self._hash_upto(i + 1)
        return self._hashes[i]

    def __iter__(self) -> Iterator[bytes]:
        hashes = self._hashes
        for i in range(self._count):
            if i >= len(hashes):
                self._hash_upto(i + 1)
            yield hashes[i]

    def _hash_upto(self, n: int) -> None:
        hashes, ids, size, pack = self._hashes, self._ids, self._size, self._pack
        parent = hashes[-1] if hashes else self._root
        for i in range(len(hashes), n):
            try:
                packed = pack.pack(*ids[i * size:(i + 1) * size])
            except struct.error as err:
                raise ValueError(f"token ids must be in [0, 2**32): {err}") from None
            parent = hashlib.blake2b(parent + packed, digest_size=DIGEST_BYTES).digest()
            hashes.append(parent)


def prompt_blocks(token_ids: Sequence[int], block_size: int, model: str, dtype: str,
                  cache_salt: str | None = None) -> PromptBlocks:
    """The lazily hashed blocks of a prompt as the servers' prefix caches name them
    (:mod:`pdserve.block_hash`). Raises ValueError for a ``block_size`` outside ``[1, 2**32)``."""
    root = cached_root(model, dtype, block_size) if cache_salt is None else root_hash(model, dtype, block_size,
                                                                                       cache_salt)
    return PromptBlocks(token_ids, block_size, root)
