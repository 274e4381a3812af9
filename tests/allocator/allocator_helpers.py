"""Helpers shared by the allocator tests: small simulated devices, data patterns, invariant checks.

``check_allocator`` asserts everything that must hold between any two public calls of a
:class:`~gpumem.allocator.CachingAllocator`; besides the public API it walks the block
chains of the backing (private state) so that a corrupted free list or a lost block is
caught at the step that caused it, not many steps later.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.allocator.backing import SegmentBacking, VirtualBacking
from gpumem.units import MiB

GRANULE = 2 * MiB


def small_profile(total_mib: int = 384, *, vmm: bool = True, name: str | None = None) -> sim.DeviceProfile:
    """A small simulated card (``total_mib`` MiB, 32 MiB of it taken by the CUDA context).

    ``vmm=False`` derives it from the Jetson Nano 2 GB, which has no virtual memory management.
    """
    if vmm:
        return sim.custom_profile(name or f"test-{total_mib}mb", total_mib * MiB, context_nbytes=32 * MiB)
    return sim.custom_profile(name or f"test-nano-{total_mib}mb", total_mib * MiB, base="jetson-nano-2gb",
                              context_nbytes=32 * MiB, host_reserved_nbytes=0)


def small_device(total_mib: int = 384, *, vmm: bool = True, **kwargs) -> sim.SimDevice:
    return sim.SimDevice(small_profile(total_mib, vmm=vmm), **kwargs)


def pattern(tag: int, nbytes: int) -> bytes:
    """``nbytes`` of bytes that depend on ``tag`` and on the position (a shift would show)."""
    return random.Random(tag).randbytes(nbytes)


@dataclass
class LiveBlock:
    """What the test model knows about one live allocation."""

    ptr: int
    requested: int
    stream: int
    tag: int
    regions: list[tuple[int, bytes]] = field(default_factory=list)
    """``(offset, bytes)`` written into the block and expected back."""
    recorded_streams: set[int] = field(default_factory=set)


def sample_offsets(ptr: int, nbytes: int, granule: int = GRANULE) -> list[tuple[int, int]]:
    """Non-overlapping ``(offset, length)`` regions covering the start, end, middle and a page boundary."""
    if nbytes <= 384:
        return [(0, nbytes)]
    wanted = [(0, 128), (nbytes - 128, 128), (nbytes // 2 - 64, 128)]
    boundary = (ptr // granule + 1) * granule - ptr  # first page boundary inside the block
    if boundary < nbytes:
        wanted.append((boundary - 64, 128))
    out: list[tuple[int, int]] = []
    for off, n in wanted:
        off = max(0, min(off, nbytes - n))
        if all(off + n <= o or o + m <= off for o, m in out):
            out.append((off, n))
    return out


def write_pattern(device, block: LiveBlock) -> None:
    block.regions = []
    for i, (off, n) in enumerate(sample_offsets(block.ptr, block.requested)):
        data = pattern(block.tag * 8 + i, n)
        device.write(block.ptr + off, data)
        block.regions.append((off, data))


def check_pattern(device, block: LiveBlock) -> None:
    for off, data in block.regions:
        got = device.read(block.ptr + off, len(data))
        assert got == data, f"block {block.ptr:#x} (+{off}, {len(data)} B) lost its data"


def round_up(n: int, r: int = 512) -> int:
    return -(-n // r) * r


def pages_of(ptr: int, nbytes: int, granule: int = GRANULE) -> range:
    return range(ptr // granule, (ptr + nbytes - 1) // granule + 1)


def mapped_pages(device, granule: int = GRANULE) -> set[int]:
    pages: set[int] = set()
    for va, n, _handle in device.mapping_ranges():
        assert va % granule == 0 and n % granule == 0
        pages.update(range(va // granule, (va + n) // granule))
    return pages


def page_handles(device, granule: int = GRANULE) -> dict[int, int]:
    """Page index -> physical handle mapped there."""
    out: dict[int, int] = {}
    for va, n, handle in device.mapping_ranges():
        for p in range(va // granule, (va + n) // granule):
            out[p] = handle
    return out


def _chain_blocks(alloc: CachingAllocator) -> list[tuple[object, list]]:
    """``(segment, [blocks in address order])`` for every segment of the backing (private state)."""
    backing = alloc.backing
    out = []
    if isinstance(backing, SegmentBacking):
        for seg in backing.segments.values():
            blocks = []
            b = seg.last
            while b is not None:
                blocks.append(b)
                b = b.prev
            blocks.reverse()
            assert blocks and blocks[0].addr == seg.base
            out.append((seg, blocks))
    else:
        assert isinstance(backing, VirtualBacking)
        for seg in backing.vsegments.values():
            blocks = []
            b = seg.last
            while b is not None:
                blocks.append(b)
                b = b.prev
            blocks.reverse()
            out.append((seg, blocks))
    return out


def check_structure(alloc: CachingAllocator, pending: set[int] = frozenset()) -> None:
    """Blocks tile their segments; every block is live, pending or in exactly its free list; free
    neighbours are merged; the free lists hold nothing else."""
    live = dict(alloc.live_blocks())
    free_lists = alloc._engine._free_lists  # noqa: SLF001
    in_lists = {id(b): key for key, fl in free_lists.items() for b in fl}
    assert sum(len(fl) for fl in free_lists.values()) == len(in_lists)
    seen_free = 0
    for seg, blocks in _chain_blocks(alloc):
        cursor = seg.base
        for b in blocks:
            assert b.addr == cursor, f"gap or overlap in the block chain at {b.addr:#x} (expected {cursor:#x})"
            assert b.segment is seg
            assert b.size > 0
            cursor = b.addr + b.size
            if b.allocated:
                assert live.get(b.addr) == b.size, f"allocated block {b!r} is not live"
                assert id(b) not in in_lists
            elif b.fences:
                assert b.addr in pending, f"unexpected pending block {b!r}"
                assert id(b) not in in_lists
            else:
                key = in_lists.get(id(b))
                assert key is not None, f"free block {b!r} is in no free list (lost)"
                assert key[1] == b.stream
                seen_free += 1
        if isinstance(alloc.backing, SegmentBacking):
            assert cursor == seg.base + seg.nbytes, "blocks do not tile their segment"
        else:
            assert cursor == seg.base + seg.top, "blocks do not reach the top of the virtual range"
        for a, b in zip(blocks, blocks[1:]):
            if not (a.allocated or a.fences or b.allocated or b.fences) and a.stream == b.stream:
                raise AssertionError(f"adjacent free blocks {a!r} and {b!r} were not merged")
    assert seen_free == len(in_lists), "a free list holds blocks that belong to no segment"


def check_allocator(alloc: CachingAllocator, model: dict[int, LiveBlock], pending: dict[int, int] | None = None,
                    *, exact_device_accounting: bool = True) -> None:
    """Every invariant of the allocator against the test's model of live blocks.

    ``pending``: ptr -> size of blocks freed with other-stream uses not yet synchronized.
    """
    pending = pending or {}
    dev = alloc.device
    g = dev.granularity_nbytes
    blocks = sorted(alloc.live_blocks())
    # the live blocks are exactly the model's, with rounded sizes, aligned, and disjoint
    assert {p for p, _ in blocks} == set(model)
    pol = alloc.policy
    for p, size in blocks:
        rounded = round_up(model[p].requested, pol.round_nbytes)
        small = pol.separate_small_pool and rounded <= pol.small_max_nbytes
        # a block is the rounded request, or larger by a remainder too small to split off
        assert rounded <= size < rounded + (pol.min_split_small_nbytes if small else pol.min_split_large_nbytes)
        assert size % pol.round_nbytes == 0
        assert p % alloc.policy.round_nbytes == 0
        assert alloc.block_size(p) == size
    for (a, na), (b, _) in zip(blocks, blocks[1:]):
        assert a + na <= b, f"live blocks overlap: {a:#x}+{na} and {b:#x}"
    # every live (and pending) block lies in memory the allocator holds
    if alloc.uses_vmm:
        mapped = mapped_pages(dev, g)
        for p, size in blocks + sorted(pending.items()):
            missing = [pg for pg in pages_of(p, size, g) if pg not in mapped]
            assert not missing, f"block {p:#x}+{size} has unmapped pages {missing[:4]}"
        assert len(mapped) * g <= alloc.reserved_nbytes
    else:
        segs = sorted((s.base, s.nbytes) for s in alloc.backing.segments.values())
        for p, size in blocks:
            assert any(base <= p and p + size <= base + n for base, n in segs), f"block {p:#x}+{size} in no segment"
        assert sum(n for _, n in segs) == alloc.reserved_nbytes
    # the stats add up
    st = alloc.snapshot_stats()
    assert st.allocated_nbytes == sum(s for _, s in blocks) == alloc.allocated_nbytes
    assert st.requested_nbytes == sum(b.requested for b in model.values())
    assert st.reserved_nbytes == alloc.backing.reserved_nbytes == alloc.reserved_nbytes
    assert st.reserved_nbytes >= st.allocated_nbytes
    assert st.active_nbytes == st.allocated_nbytes + sum(pending.values())
    assert st.num_live_blocks == len(model)
    assert st.peak_allocated_nbytes >= st.allocated_nbytes
    assert st.peak_requested_nbytes >= st.requested_nbytes
    assert st.peak_reserved_nbytes >= st.reserved_nbytes
    assert st.allocated_nbytes >= st.requested_nbytes
    assert 0 <= st.largest_free_nbytes <= max(0, st.free_nbytes)
    assert 0.0 <= st.external_fragmentation <= 1.0
    assert st.num_allocs - st.num_frees == len(model)  # every free matches an allocation
    if exact_device_accounting and isinstance(dev, sim.SimDevice):
        assert dev.process_used_nbytes == st.reserved_nbytes
    if isinstance(dev, sim.SimDevice):
        dev.check_invariants()
    check_structure(alloc, set(pending))
    alloc.check_consistency()
