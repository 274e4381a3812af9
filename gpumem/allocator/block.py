"""Blocks and free lists: the bookkeeping under every allocator policy.

A *segment* is a stretch of device addresses the allocator owns (a ``malloc``'d
segment, or a virtual range). It is tiled by :class:`Block` objects linked in
address order (``prev``/``next``); a block is either allocated or free. Free
blocks sit in a :class:`FreeList`, one per pool and stream, sorted by
``(size, addr)`` so that best fit is one binary search.

The block chain changes in two ways only, both here and both checked:
:func:`split_block` cuts a block in two and :func:`merge_blocks` joins two
neighbours; :func:`append_block` and :func:`drop_last_block` grow and shrink a
virtual range at its top. The allocator owns blocks and free lists; the backings
(:mod:`.backing`) only make the memory under blocks real.
"""

from __future__ import annotations

import bisect
from typing import Iterator

from ..errors import InternalError


class Block:
    """A tile of a segment: ``[addr, addr + size)``.

    ``pending_streams``: streams other than ``stream`` that used the block
    (:meth:`~gpumem.allocator.CachingAllocator.record_stream`); ``fences``: once such a
    block is freed, ``{stream: fence}`` of the events recorded on those streams, which
    must complete before the block is reused (see Note [Stream-ordered frees] in
    :mod:`.caching`).
    """

    __slots__ = ("addr", "size", "requested", "stream", "segment", "prev", "next", "allocated", "pending_streams",
                 "fences")

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
        self.fences: dict[int, int] | None = None

    @property
    def end(self) -> int:
        return self.addr + self.size

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free"
        return f"<Block {self.addr:#x}+{self.size} {state} stream={self.stream}>"


def split_block(block: Block, size: int) -> Block:
    """Cut ``block`` after its first ``size`` bytes; return the new block holding the rest.

    The rest has the block's stream and segment and is linked after it (and becomes the
    segment's ``last`` if the block was).
    """
    if not 0 < size < block.size:
        raise InternalError(f"cannot split {block!r} at {size}")
    rest = Block(block.addr + size, block.size - size, block.stream, block.segment)
    rest.prev = block
    rest.next = nxt = block.next
    if nxt is not None:
        nxt.prev = rest
    elif getattr(block.segment, "last", None) is block:
        block.segment.last = rest  # type: ignore[attr-defined]
    block.next = rest
    block.size = size
    return rest


def merge_blocks(left: Block, right: Block) -> Block:
    """Join ``right`` into its left neighbour ``left``; return ``left``.

    Both must be free neighbours of one segment and stream.
    """
    if left.next is not right or right.prev is not left or left.addr + left.size != right.addr:
        raise InternalError(f"merge of non-adjacent blocks {left!r} and {right!r}")
    if left.allocated or right.allocated or left.stream != right.stream or left.segment is not right.segment:
        raise InternalError(f"merge of {left!r} and {right!r}: not two free blocks of one stream")
    left.size += right.size
    left.next = nxt = right.next
    if nxt is not None:
        nxt.prev = left
    elif getattr(left.segment, "last", None) is right:
        left.segment.last = left  # type: ignore[attr-defined]
    right.prev = right.next = None
    return left


def append_block(segment: object, block: Block) -> None:
    """Link ``block`` after the segment's last block (it must start where that one ends)."""
    last: Block | None = segment.last  # type: ignore[attr-defined]
    if last is not None and last.addr + last.size != block.addr:
        raise InternalError(f"append of {block!r} after {last!r}: not contiguous")
    block.prev = last
    block.next = None
    if last is not None:
        last.next = block
    segment.last = block  # type: ignore[attr-defined]


def drop_last_block(segment: object) -> Block:
    """Unlink and return the segment's last block."""
    last: Block | None = segment.last  # type: ignore[attr-defined]
    if last is None or last.next is not None:
        raise InternalError("drop of the last block of a segment with none")
    segment.last = prev = last.prev  # type: ignore[attr-defined]
    if prev is not None:
        prev.next = None
    last.prev = None
    return last


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
        if not self.discard(block):
            raise InternalError(f"{block!r} is not in its free list")

    def discard(self, block: Block) -> bool:
        """Take ``block`` out if it is in this list; return whether it was (``in`` and :meth:`remove` in one
        look-up: Note [The hot path, read once] in :mod:`.python_engine`)."""
        return self._take(block, block.addr)

    def _take(self, block: Block, place: int) -> bool:
        """:meth:`discard` of ``block`` filed at ``place`` (the second half of its key)."""
        blocks = self._blocks
        if blocks.get(place) is not block:
            return False
        keys = self._keys
        key = (block.size, place)
        i = bisect.bisect_left(keys, key)
        if i == len(keys) or keys[i] != key:
            raise InternalError(f"{block!r} is in its free list under another size")
        del keys[i]
        del blocks[place]
        self.nbytes -= block.size
        return True

    def best_fit(self, size: int) -> Block | None:
        """The smallest free block of at least ``size`` bytes (lowest address among equals)."""
        keys = self._keys
        i = bisect.bisect_left(keys, (size, 0))
        if i == len(keys):
            return None
        return self._blocks[keys[i][1]]

    def largest(self) -> int:
        return self._keys[-1][0] if self._keys else 0


class TopDownFreeList(FreeList):
    """A :class:`FreeList` of ``malloc``'d segments that orders equal sizes as if every new segment lay
    below the ones made before it (each segment's ``order``: Note [Segments top-down] in
    :mod:`.policy`): among equal sizes, best fit takes the newest segment, and the lowest offset in it."""

    __slots__ = ()

    @staticmethod
    def _key(block: Block) -> tuple[int, int]:
        seg = block.segment
        return block.size, seg.order + block.addr - seg.base  # type: ignore[attr-defined]

    def __contains__(self, block: Block) -> bool:
        return self._blocks.get(self._key(block)[1]) is block

    def add(self, block: Block) -> None:
        seg = block.segment
        key = (block.size, seg.order + block.addr - seg.base)  # type: ignore[attr-defined] # _key(block)
        bisect.insort(self._keys, key)
        self._blocks[key[1]] = block
        self.nbytes += block.size

    def discard(self, block: Block) -> bool:
        seg = block.segment
        return self._take(block, seg.order + block.addr - seg.base)  # type: ignore[attr-defined] # _key(block)[1]
