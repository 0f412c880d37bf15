"""Allocator of fixed-size KV cache blocks."""
from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out block ids 0..num_blocks-1; each block holds block_size tokens of KV.

    Verbs: can_allocate/allocate for new block tables, can_grow/grow to extend one in place,
    deallocate to give blocks back.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks free blocks. Raises RuntimeError when too few are free."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"need {num_blocks} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        self._used.update(blocks)
        return blocks

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether block_table can be extended to hold num_tokens tokens."""
        return self.can_allocate(max(0, self.blocks_needed(num_tokens) - len(block_table)))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to block_table (in place) until it holds num_tokens tokens."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing > 0:
            block_table.extend(self.allocate(missing))

    def deallocate(self, block_ids: list[int]) -> None:
        """Return blocks to the free list. Raises ValueError on a block that is not allocated."""
        for b in block_ids:
            if b not in self._used:
                raise ValueError(f"KV block {b} is not allocated")
            self._used.remove(b)
            self._free.append(b)
