"""Blocks and free lists: the bookkeeping under every allocator policy.

A *segment* is a stretch of device addresses the allocator owns (a ``malloc``'d
segment, or a virtual range). It is tiled by :class:`Block` objects linked in
address order (``prev``/``next``); a block is either allocated or free. Free
blocks sit in a :class:`FreeList`, one per pool and stream, sorted by
``(size, addr)`` so that best fit is one binary search.
"""

from __future__ import annotations

import bisect
from typing import Iterator


class Block:
    """A tile of a segment: ``[addr, addr + size)``."""

    __slots__ = ("addr", "size", "requested", "stream", "segment", "prev", "next", "allocated", "pending_streams")

    def __init__(self, addr: int, size: int, stream: int, segment: object) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.stream = stream
        self.segment = segment
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.pending_streams: set[int] | None = None

    @property
    def end(self) -> int:
        return self.addr + self.size

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free"
        return f"<Block {self.addr:#x}+{self.size} {state} stream={self.stream}>"


class FreeList:
    """Free blocks of one pool and stream, ordered by ``(size, addr)``."""

    __slots__ = ("_keys", "_blocks", "nbytes")

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._blocks: dict[int, Block] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[Block]:
        return iter(list(self._blocks.values()))

    def __contains__(self, block: Block) -> bool:
        return self._blocks.get(block.addr) is block

    def add(self, block: Block) -> None:
        bisect.insort(self._keys, (block.size, block.addr))
        self._blocks[block.addr] = block
        self.nbytes += block.size

    def remove(self, block: Block) -> None:
        keys = self._keys
        i = bisect.bisect_left(keys, (block.size, block.addr))
        del keys[i]
        del self._blocks[block.addr]
        self.nbytes -= block.size

    def best_fit(self, size: int) -> Block | None:
        """The smallest free block of at least ``size`` bytes (lowest address among equals)."""
        keys = self._keys
        i = bisect.bisect_left(keys, (size, 0))
        if i == len(keys):
            return None
        return self._blocks[keys[i][1]]

    def largest(self) -> int:
        return self._keys[-1][0] if self._keys else 0
