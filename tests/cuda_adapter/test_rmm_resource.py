"""gpumem as an RMM memory resource, without a GPU (issue 19, point 4).

RMM's Python package imports and runs its ``CallbackMemoryResource`` without a GPU, so the resource is
tested here over a :class:`CachingAllocator` on a simulated device, called through RMM's own
``allocate``/``deallocate`` (RMM's C++ resource calls gpumem's callbacks with the stream). The runs on a
real device (``rmm.DeviceBuffer``, RMM's CuPy allocator, the native engine) are in
``test_rmm_integration.py``.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpumem
from gpumem.allocator import CachingAllocator
from gpumem.errors import BackendUnavailableError, InvalidArgumentError

grr = pytest.importorskip("gpumem.rmm_resource")


class _Protocol:
    """A CUDA stream by the stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _Stream(handle: int):
    """RMM's Stream over the stream handle ``handle`` (made without a GPU)."""
    from rmm.pylibrmm.stream import Stream

    return Stream(_Protocol(handle))


class _Recording:
    """A gpumem allocator that records the calls the resource makes."""

    def __init__(self, inner: CachingAllocator) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in ("allocate", "free", "record_stream"):
            def call(*args):
                self.calls.append((name, *args))
                return attr(*args)
            return call
        return attr


@pytest.fixture()
def rmm():
    return pytest.importorskip("rmm", reason="RMM (rmm-cu12/rmm-cu13) is not installed here")


@pytest.fixture()
def sim_allocator():
    return CachingAllocator(gpumem.open_device("sim:t4-16gb"), "gpumem")


def test_without_rmm_the_error_says_what_to_install(monkeypatch):
    grr.resource_class.cache_clear()
    monkeypatch.setitem(sys.modules, "rmm", None)
    try:
        with pytest.raises(BackendUnavailableError, match="pip install rmm-cu13") as info:
            grr.make_resource(0)
        assert isinstance(info.value, ImportError)
    finally:
        grr.resource_class.cache_clear()


def test_allocates_and_frees_through_gpumem_on_rmm_stream(rmm, sim_allocator):
    rec = _Recording(sim_allocator)
    mr = grr.make_resource(0, allocator=rec)
    assert isinstance(mr, rmm.mr.CallbackMemoryResource) and mr.device == 0
    ptr = mr.allocate(1000, _Stream(7))
    assert sim_allocator.live_blocks() == [(ptr, sim_allocator.block_size(ptr))]
    assert rec.calls == [("allocate", 1000, 7)]
    mr.deallocate(ptr, 1000, _Stream(7))
    assert rec.calls[1:] == [("record_stream", ptr, 7), ("free", ptr)]
    assert sim_allocator.live_blocks() == [] and sim_allocator.allocated_nbytes == 0
    mr.allocator = sim_allocator             # the consistency check reads the allocator itself
    check = mr.check()
    assert check.ok and check.engine == "python"


def test_default_stream_is_handle_zero(rmm, sim_allocator):
    rec = _Recording(sim_allocator)
    mr = grr.make_resource(0, allocator=rec)
    ptr = mr.allocate(512)                  # RMM's DEFAULT_STREAM
    mr.deallocate(ptr, 512)
    assert rec.calls == [("allocate", 512, 0), ("record_stream", ptr, 0), ("free", ptr)]


def _reused_while_in_use(grr_resource, dev) -> bool:
    """A block of stream 7 still read by a kernel on stream 9 is freed by RMM on stream 9, then a block of
    the same size is allocated on stream 7: is it handed out while the kernel on stream 9 still reads it?"""
    nbytes = 1 << 20
    ptr = grr_resource.allocate(nbytes, _Stream(7))
    work = dev.launch(9, 1.0, touches=[(ptr, nbytes)], name="reads on 9")
    grr_resource.deallocate(ptr, nbytes, _Stream(9))
    again = grr_resource.allocate(nbytes, _Stream(7))
    overlaps = again < ptr + nbytes and ptr < again + grr_resource.allocator.block_size(again)
    return overlaps and not work.done


def test_free_on_another_stream_waits_for_that_stream(rmm):
    """Note [RMM's stream-ordered contract]: freed on stream 9, a block of stream 7 is not handed out on
    stream 7 before stream 9's work at the free has run."""
    dev = gpumem.open_device("sim:t4-16gb")
    mr = grr.make_resource(0, allocator=CachingAllocator(dev, "gpumem"))
    assert not _reused_while_in_use(mr, dev)
    assert mr.check().ok


def test_without_record_stream_the_block_is_reused_too_early(rmm, monkeypatch):
    """The test above catches the bug: a resource that frees without recording the free's stream hands the
    block out on stream 7 while stream 9's kernel still reads it."""
    dev = gpumem.open_device("sim:t4-16gb")
    alloc = CachingAllocator(dev, "gpumem")
    monkeypatch.setattr(alloc, "record_stream", lambda ptr, stream: None)
    assert _reused_while_in_use(grr.make_resource(0, allocator=alloc), dev)


def test_zero_bytes_is_a_null_pointer(rmm, sim_allocator):
    mr = grr.make_resource(0, allocator=sim_allocator)
    assert mr.allocate(0) == 0
    mr.deallocate(0, 0)
    assert sim_allocator.stats.num_allocs == 0 and mr.check().ok


def test_out_of_memory_is_rmm_out_of_memory(rmm, sim_allocator):
    mr = grr.make_resource(0, allocator=sim_allocator)
    with pytest.raises(MemoryError):
        mr.allocate(64 << 30)
    assert sim_allocator.allocated_nbytes == 0 and mr.check().ok


def test_per_thread_default_stream_is_refused_and_changes_nothing(rmm, sim_allocator):
    mr = grr.make_resource(0, allocator=sim_allocator)
    with pytest.raises(RuntimeError, match="per-thread default stream"):
        mr.allocate(4096, _Stream(2))
    assert sim_allocator.stats.num_allocs == 0 and mr.check().ok


@pytest.mark.parametrize("case", ["unknown pointer", "double free", "size above the block", "per-thread stream"])
def test_a_refused_deallocate_is_a_problem_and_changes_nothing(rmm, sim_allocator, case):
    """Note [A deallocate cannot raise through RMM]: kept as a problem, the allocator unchanged."""
    mr = grr.make_resource(0, allocator=sim_allocator)
    ptr = mr.allocate(1000)
    if case == "double free":
        other = mr.allocate(3000)
        mr.deallocate(other, 3000)
        bad_ptr, nbytes, stream = other, 3000, _Stream(0)
    else:
        bad_ptr, nbytes, stream = {"unknown pointer": (ptr + 512, 8, _Stream(0)),
                                   "size above the block": (ptr, 1 << 20, _Stream(0)),
                                   "per-thread stream": (ptr, 1000, _Stream(2))}[case]
    before = (sim_allocator.live_blocks(), sim_allocator.allocated_nbytes, sim_allocator.reserved_nbytes)
    mr.deallocate(bad_ptr, nbytes, stream)
    assert (sim_allocator.live_blocks(), sim_allocator.allocated_nbytes, sim_allocator.reserved_nbytes) == before
    check = mr.check()
    assert not check.ok and len(mr.problems) == 1 and "refused" in check.problems[-1]
    with pytest.raises(gpumem.errors.InternalError, match="refused"):
        mr.check(raise_on_problem=True)
    mr.deallocate(ptr, 1000)                 # the real block is still freed normally
    assert sim_allocator.allocated_nbytes == 0


def test_problems_kept_are_bounded(rmm, sim_allocator):
    mr = grr.make_resource(0, allocator=sim_allocator)
    for i in range(grr.MAX_PROBLEMS_KEPT + 5):
        mr.deallocate(0x1000 + 512 * i, 8)
    assert len(mr.problems) == grr.MAX_PROBLEMS_KEPT + 1
    assert mr.problems[-1] == "... and 5 more refused deallocations"


def test_bad_arguments_are_refused(rmm, sim_allocator):
    with pytest.raises(InvalidArgumentError, match="not both"):
        grr.make_resource(0, "gpumem", allocator=sim_allocator)
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        grr.make_resource(-1, allocator=sim_allocator)
    with pytest.raises(InvalidArgumentError, match="not a CUDA stream"):
        grr.stream_handle(object())
    with pytest.raises(InvalidArgumentError, match="version 3"):
        grr.stream_handle(type("S", (), {"__cuda_stream__": lambda self: (3, 0)})())


def test_one_resource_per_device_is_found_again(rmm, sim_allocator):
    mr = grr.make_resource(5, allocator=sim_allocator)
    previous = rmm.mr.get_per_device_resource(5)
    rmm.mr.set_per_device_resource(5, mr)
    try:
        assert grr.installed_resource(5) is mr
        assert grr.install(5) is mr          # already gpumem's: the same resource, no second engine
    finally:
        rmm.mr.set_per_device_resource(5, previous)
    assert grr.installed_resource(5) is None


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 1 << 22), st.sampled_from([0, 7, 9]),
                              st.integers(0, 10**6)), min_size=1, max_size=60))
def test_any_sequence_keeps_the_allocator_consistent(ops):
    """Property: any interleaving of RMM allocations and frees on several streams (frees on any stream)
    leaves the allocator consistent, its allocated bytes the blocks RMM still holds, nothing refused."""
    pytest.importorskip("rmm")
    alloc = CachingAllocator(gpumem.open_device("sim:t4-16gb"), "gpumem")
    mr = grr.make_resource(0, allocator=alloc)
    live: list[tuple[int, int]] = []
    for is_alloc, nbytes, stream, pick in ops:
        if is_alloc or not live:
            live.append((mr.allocate(nbytes, _Stream(stream)), nbytes))
        else:
            ptr, n = live.pop(pick % len(live))
            mr.deallocate(ptr, n, _Stream(stream))
    assert mr.check().ok
    assert alloc.allocated_nbytes == sum(alloc.block_size(p) for p, _ in live)
    for ptr, n in live:
        mr.deallocate(ptr, n)
    assert alloc.allocated_nbytes == 0 and mr.check().ok
