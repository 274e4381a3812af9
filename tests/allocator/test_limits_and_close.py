"""Limits the two engines take alike, segments larger than any device, and the counters after close (attacker
review, 2026-12-05)."""

from __future__ import annotations

import dataclasses

import pytest

from gpumem.allocator import CachingAllocator
from gpumem.allocator.policy import get_policy
from gpumem.errors import InvalidArgumentError, OutOfMemoryError
from gpumem.specs import open_device

ENGINES = ("python", "native")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("limit", [2**63, 2**63 + 1, 2**64 - 1])
def test_a_limit_of_2_63_bytes_or_more_is_refused(engine: str, limit: int) -> None:
    """The native engine's slack arithmetic is signed 64-bit: such a limit turned negative there and the engines
    decided apart (194 of 300 reserved figures of a random program differed)."""
    with pytest.raises(InvalidArgumentError, match=r"2\*\*63 - 1 at most"):
        CachingAllocator(open_device("sim:h200-141gb"), "gpumem", engine=engine, limit=limit)


def test_the_largest_limit_decides_as_no_limit_in_both_engines() -> None:
    got = []
    for limit in (None, 2**63 - 1):
        for engine in ENGINES:
            a = CachingAllocator(open_device("sim:h200-141gb"), "gpumem", engine=engine, limit=limit)
            p = a.allocate(2815721)
            a.free(p)
            a.allocate(1964158, 1)
            got.append(a.reserved_nbytes)
            a.close()
    assert len(set(got)) == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_a_segment_larger_than_the_device_is_out_of_memory_top_down_too(engine: str) -> None:
    """The native engine checked its top-down order keys before asking the device, and raised an internal
    error ("the order keys ran out") where Python's device refused the segment: out of memory in both now."""
    pol = dataclasses.replace(get_policy("bestfit"), segments_top_down=True, small_segment_nbytes=2**63 - 1)
    a = CachingAllocator(open_device("sim:h200-141gb"), pol, engine=engine)
    with pytest.raises(OutOfMemoryError, match="tried to allocate 1000 B"):
        a.allocate(1000)
    a.check_consistency()
    assert a.reserved_nbytes == 0 and a.allocated_nbytes == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_closed_allocator_counts_no_live_bytes(engine: str) -> None:
    a = CachingAllocator(open_device("sim:h200-141gb"), "gpumem", engine=engine)
    a.allocate(1000)
    a.close()
    st = a.stats
    assert a.live_blocks() == [] and a.reserved_nbytes == 0
    assert st.allocated_nbytes == 0 and st.requested_nbytes == 0 and st.active_nbytes == 0
    assert st.peak_allocated_nbytes == 1024   # the peak stays what it was
