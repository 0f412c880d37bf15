"""Allocator of fixed-size KV cache blocks, with a prefix cache of full blocks.

Every block is in one of three states:

* **free**: never held KV anyone can reuse; handed out first;
* **cached, unreferenced** (*evictable*): a full block whose KV and tokens are known by hash but
  that no request uses; kept in LRU order and evicted (its hash forgotten) only when a block is
  needed and no free one is left;
* **referenced**: in one or more block tables (running, pulling or parked requests); ``ref`` counts
  them. Cached referenced blocks are shared read-only: a request only writes the blocks past its
  cached prefix, which are its own (see ``docs/architecture.md``, "Prefix cache").

Under a sliding window a block table may start with ``NULL_BLOCK`` entries (see
``match_prefix(window=...)``): positions no query of that request can read, so no block backs
them; every verb skips them.

``num_free_blocks`` counts free *and* evictable blocks (nobody references them), so "every block
back" still means no request leaked one. The design follows nano-vllm's block manager: hash → block
id map, token ids compared on a hit, reference counts.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence

from engine.kv_event_log import KVEventLog

NULL_BLOCK = -1   # a block-table entry no KV block backs (before a sliding window's reach)


class BlockManager:
    """Hands out block ids 0..num_blocks-1; each block holds block_size tokens of KV.

    Verbs: can_allocate/allocate for fresh blocks, can_grow/grow to extend a block table in place,
    match_prefix/share to reuse cached blocks, cache_block to offer a computed full block to the
    cache, deallocate to drop references, reset_prefix_cache to forget every hash.
    With ``enable_caching`` False nothing is ever cached: the allocator of before the cache.
    ``events`` (optional) records every hash that enters or leaves the cache (KV events).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: KVEventLog | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self.events = events

    # ---- counts ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (free + cached evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose KV is known by hash (referenced or not)."""
        return len(self._by_hash)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold block_id (0: free or evictable)."""
        return self._ref[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    # ---- fresh blocks ---------------------------------------------------------------------
    def can_allocate(self, num_blocks: int, sharing: Sequence[int] = ()) -> bool:
        """Whether num_blocks fresh blocks fit after taking references to ``sharing`` (cached
        blocks about to be shared: an evictable one among them is no longer available)."""
        reclaimed = sum(1 for b in sharing if b != NULL_BLOCK and self._ref[b] == 0)
        return num_blocks <= self.num_free_blocks - reclaimed

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks blocks (ref 1) holding no reusable KV: free ones first, then the least
        recently used evictable ones, whose hashes are forgotten (never a stale hit).
        Raises RuntimeError when too few are unreferenced."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"need {num_blocks} KV blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._forget(b)
            self._ref[b] = 1
            blocks.append(b)
        return blocks

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether block_table can be extended to hold num_tokens tokens."""
        return self.can_allocate(max(0, self.blocks_needed(num_tokens) - len(block_table)))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to block_table (in place) until it holds num_tokens tokens."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing > 0:
            block_table.extend(self.allocate(missing))

    # ---- prefix cache ---------------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[bytes], token_ids: Sequence[int],
                     window: int | None = None) -> list[int]:
        """Cached block ids of the longest usable prefix of full blocks; takes no reference
        (call :meth:`share`). Block i matches when ``hashes[i]`` is cached *and* its stored
        token ids equal ``token_ids`` of block i.

        window None (full attention): the prefix is blocks 0..k-1, all matching.
        window W (every layer slides by W tokens): resuming at position p = k*block_size, no
        query reads a key before p - W + 1, so only blocks from ``(p - W + 1) // block_size`` to
        k-1 must match; the earlier ones come back as NULL_BLOCK (they may have been evicted).
        The KV of a block is still the one the whole prefix gives it: the hash names the whole
        chain of tokens before it, not only the window.
        """
        if not self.enable_caching:
            return []
        bs, ids, run_start, best = self.block_size, [], 0, 0
        for i, h in enumerate(hashes):
            b = self._by_hash.get(h)
            if b is None or self._tokens[b] != tuple(token_ids[i * bs:(i + 1) * bs]):
                if window is None:
                    break
                b, run_start = NULL_BLOCK, i + 1
            ids.append(b)
            if run_start <= _first(i + 1, bs, window):   # blocks the window needs all match
                best = i + 1
        skip = _first(best, bs, window)
        return [NULL_BLOCK] * skip + ids[skip:best]

    def share(self, block_ids: Sequence[int]) -> list[int]:
        """Add a reference to each cached block (an evictable one leaves the LRU); returns them.
        Raises ValueError on a block that is not cached."""
        real = [b for b in block_ids if b != NULL_BLOCK]
        for b in real:
            if self._hash[b] is None:
                raise ValueError(f"KV block {b} is not cached")
        for b in real:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        return list(block_ids)

    def fork(self, block_ids: Sequence[int]) -> list[int]:
        """Add a reference to each referenced block (cached or not): a forked sequence (n > 1,
        engine.choices) shares its parent's full blocks read-only; returns them (NULL_BLOCK kept).
        Raises ValueError on a block nobody references (nothing is changed then)."""
        real = [b for b in block_ids if b != NULL_BLOCK]
        for b in real:
            if self._ref[b] == 0:
                raise ValueError(f"KV block {b} is not allocated")
        for b in real:
            self._ref[b] += 1
        return list(block_ids)

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: Sequence[int],
                    parent_hash: bytes | None = None) -> bool:
        """Offer a referenced, fully computed block to the cache under ``block_hash``
        (``parent_hash``: the block before it in its chain, for the KV event; None at the root).

        False (nothing changes) when caching is off, the block is already cached, or another block
        already holds that hash (two requests computed the same prefix at once: the first stays).
        Raises ValueError when the block is unreferenced or ``token_ids`` is not one full block.
        """
        if self._ref[block_id] == 0:
            raise ValueError(f"KV block {block_id} is not allocated")
        if len(token_ids) != self.block_size:
            raise ValueError(f"a cached block holds {self.block_size} tokens, got {len(token_ids)}")
        if not self.enable_caching or self._hash[block_id] is not None or block_hash in self._by_hash:
            return False
        self._hash[block_id] = block_hash
        self._tokens[block_id] = tuple(token_ids)
        self._by_hash[block_hash] = block_id
        if self.events is not None:
            self.events.stored(block_hash, parent_hash)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every hash. Evictable blocks become free (returned: how many); referenced ones stay
        with their requests but are never a hit again."""
        dropped = len(self._evictable)
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        for b in list(self._by_hash.values()):
            self._forget(b, announce=False)
        if self.events is not None:
            self.events.cleared()
        return dropped

    def held_hashes(self) -> list[bytes]:
        """Every hash the cache holds now (the KV events snapshot)."""
        return list(self._by_hash)

    def _forget(self, block_id: int, announce: bool = True) -> None:
        h = self._hash[block_id]
        if h is not None and self._by_hash.get(h) == block_id:
            del self._by_hash[h]
            if announce and self.events is not None:
                self.events.removed(h)
        self._hash[block_id] = None
        self._tokens[block_id] = None

    # ---- references -----------------------------------------------------------------------
    def deallocate(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. An unreferenced cached block joins the LRU, the
        table's tail first (so a request's last blocks are evicted before its first ones, which
        more requests share); an uncached one is free again.
        Raises ValueError on a block that is not allocated (nothing is changed then)."""
        block_ids = [b for b in block_ids if b != NULL_BLOCK]
        for b, n in Counter(block_ids).items():
            if self._ref[b] < n:
                raise ValueError(f"KV block {b} is not allocated")
        for b in block_ids:
            self._ref[b] -= 1
            if self._ref[b] == 0 and self._hash[b] is None:
                self._free.append(b)
        for b in reversed(block_ids):
            if self._ref[b] == 0 and self._hash[b] is not None and b not in self._evictable:
                self._evictable[b] = None


def _first(num_blocks: int, block_size: int, window: int | None) -> int:
    """Leading blocks of a num_blocks hit that a request resuming after it never reads."""
    return 0 if window is None else max(0, num_blocks * block_size - window + 1) // block_size
