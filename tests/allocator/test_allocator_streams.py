"""Stream-ordered frees (issue 6, point 3) and streams at scale (point 6), on the simulator's sanitizer.

A kernel queued with ``SimDevice.launch(stream, 0.01, touches=[(ptr, n)])`` reads and writes its
block for 10 ms of simulated time, across any number of allocator calls. The sanitizer raises
:class:`~gpumem.errors.MemoryHazardError` when memory that work still touches is unmapped or freed,
which on a real GPU returns success and kills the context (``CUDA_ERROR_ILLEGAL_ADDRESS``).

The allocator before issue 6 unmapped and freed without looking at in-flight work: ``_old_behaviour``
reproduces that by making every fence look complete, and each scenario checks that the sanitizer
then raises, so the tests are known to catch the bug they guard against.
"""

from __future__ import annotations

import dataclasses

import pytest

from gpumem.allocator import CachingAllocator
from gpumem.allocator.fences import StreamFences
from gpumem.allocator.policy import get_policy
from gpumem.errors import MemoryHazardError
from gpumem.trace import Trace, build_trace
from gpumem.trace.builder import ALLOC_CODE, FREE_CODE
from gpumem.units import KiB, MiB

from allocator_helpers import small_device

KERNEL_S = 0.01


@pytest.fixture
def dev():
    d = small_device(384)
    yield d
    d.close()


def _old_behaviour(monkeypatch) -> None:
    """Every fence looks complete and nothing is waited for: the allocator before issue 6."""
    monkeypatch.setattr(StreamFences, "done", lambda self, stream, number: True)
    monkeypatch.setattr(StreamFences, "wait", lambda self, stream, number: None)


#: the default policy with the stream-ordered steal on (off by default: Note [Stream-ordered steal])
ORDERED_DEFAULT = dataclasses.replace(get_policy("gpumem"), name="ordered-default", stream_ordered_steal=True,
                                      page_slack_min_nbytes=0)
#: the default policy without the slack's floor: on these few-page devices every page past the peak is stolen
#: (Note [A slack of at least one page]); the steal before a warm-up (on by default) off, so that the policy's own
#: rules decide (Note [The ordered steal before a warm-up])
STEAL_NOW = dataclasses.replace(get_policy("gpumem"), name="steal-now", page_slack_min_nbytes=0, steal_before_warmup=False)


def _steal_scenario(dev, stream: int, policy=STEAL_NOW) -> tuple[object, int, int, CachingAllocator]:
    """A kernel reads block A on ``stream``; A is freed; an allocation on ``stream`` then needs a
    page, and the only empty page to steal is A's; the limit leaves no room for a new chunk instead.
    Returns (work, A, the new block, the allocator)."""
    alloc = CachingAllocator(dev, policy, limit=6 * MiB)
    a = alloc.allocate(2 * MiB, stream)  # page 0
    x = alloc.allocate(2 * MiB, stream)  # page 1, stays live: A's free block is not the range's tail
    work = dev.launch(stream, KERNEL_S, touches=[(a, 2 * MiB)], name="reads A")
    alloc.free(a)
    # 4 MiB at the top: 2 new pages; peak live was 2 pages, so one is created and one stolen (A's)
    b = alloc.allocate(4 * MiB, stream)
    assert alloc.backing.n_steals == 1
    alloc.free(x)
    alloc.free(b)
    return work, a, b, alloc


@pytest.mark.parametrize("stream", [0, 7])
def test_steal_waits_for_a_kernel_still_reading_the_page(dev, stream):
    policy = dataclasses.replace(STEAL_NOW, name="no-ordered-steal", stream_ordered_steal=False)
    work, a, _, _ = _steal_scenario(dev, stream, policy)
    # the steal waited (event_synchronize) until the kernel was done, then unmapped A's page
    assert work.done and dev.now_s >= work.end_s
    assert not dev.hazards


@pytest.mark.parametrize("stream", [0, 7])
def test_stream_ordered_steal_unmaps_once_the_kernel_is_done(dev, stream):
    """With the stream-ordered steal on: the steal did not wait (A's chunk is mapped under the new block, after the kernel on
    the stream); A's old mapping goes when the kernel is done (here: empty_cache waits for it)."""
    work, a, _, alloc = _steal_scenario(dev, stream, ORDERED_DEFAULT)
    assert not work.done and not dev.hazards
    assert any(va == a for va, _, _ in dev.mapping_ranges())
    alloc.empty_cache()
    assert work.done and not dev.hazards and not dev.mapping_ranges()


@pytest.mark.parametrize("stream", [0, 7])
def test_steal_under_a_running_kernel_is_a_hazard_with_the_old_behaviour(dev, stream, monkeypatch):
    _old_behaviour(monkeypatch)
    with pytest.raises(MemoryHazardError) as info:
        _steal_scenario(dev, stream)
    assert info.value.call == "mem_unmap" and info.value.work == "reads A"


@pytest.mark.parametrize("policy", ["gpumem", "bestfit", "pytorch", "cupy"])
def test_empty_cache_waits_for_a_kernel_still_reading_freed_memory(dev, policy):
    alloc = CachingAllocator(dev, policy)
    p = alloc.allocate(3 * MiB, 5)
    work = dev.launch(5, KERNEL_S, touches=[(p, 3 * MiB)], name="reads p")
    alloc.free(p)
    released = alloc.empty_cache()
    assert work.done and dev.now_s >= work.end_s, "memory went back before the kernel was done"
    assert released > 0 and alloc.reserved_nbytes == 0 and dev.process_used_nbytes == 0
    alloc.check_consistency()


@pytest.mark.parametrize("policy", ["gpumem", "bestfit"])
def test_empty_cache_under_a_running_kernel_is_a_hazard_with_the_old_behaviour(dev, policy, monkeypatch):
    _old_behaviour(monkeypatch)
    alloc = CachingAllocator(dev, policy)
    p = alloc.allocate(3 * MiB, 5)
    dev.launch(5, KERNEL_S, touches=[(p, 3 * MiB)], name="reads p")
    alloc.free(p)
    with pytest.raises(MemoryHazardError) as info:
        alloc.empty_cache()
    assert info.value.call in ("mem_unmap", "free")
    alloc.check_consistency()  # the refused call changed nothing, on either side


GROW_PAST_BUSY = dataclasses.replace(get_policy("gpumem"), name="grow-past-busy", busy_slack=float("inf"),
                                     stream_ordered_steal=False, steal_before_warmup=False)


def _past_a_running_kernel(dev, alloc, stream: int = 0):
    """Blocks ``a`` (on ``stream``) and ``x``; a kernel on ``stream`` still reading ``a`` when ``a`` is freed and a
    block ``b`` twice its size is asked for on stream 0. Returns the kernel's work, ``b`` and ``x``."""
    a = alloc.allocate(2 * MiB, stream)
    x = alloc.allocate(2 * MiB)
    work = dev.launch(stream, KERNEL_S, touches=[(a, 2 * MiB)])
    alloc.free(a)
    return work, alloc.allocate(4 * MiB), x


def test_a_busy_page_is_not_waited_for_when_a_new_chunk_fits(dev):
    """With busy_slack=inf (the rule before issue 18) wait only when the memory is needed: with room on the
    device, a steal that would have to wait for a running kernel creates a chunk instead, and the kernel
    keeps running."""
    alloc = CachingAllocator(dev, GROW_PAST_BUSY)
    work, b, x = _past_a_running_kernel(dev, alloc)
    assert alloc.backing.n_steals == 0 and not work.done and not dev.hazards
    alloc.free(b)
    alloc.free(x)
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_busy_page_is_waited_for_past_the_busy_slack(dev, engine):
    """Note [Wait, do not grow, behind the GPU]: past page_slack + busy_slack the steal waits for the
    running kernel instead of creating a chunk (before issue 18 it grew: the test above)."""
    policy = dataclasses.replace(get_policy("gpumem"), name="wait-busy", busy_slack=0.0, page_slack=0.0, page_slack_min_nbytes=0,
                                 stream_ordered_steal=False, steal_before_warmup=False)
    alloc = CachingAllocator(dev, policy, engine=engine)
    work, b, x = _past_a_running_kernel(dev, alloc)
    assert work.done and not dev.hazards and alloc.reserved_nbytes == 6 * MiB
    alloc.free(b)
    alloc.free(x)
    alloc.check_consistency()


WAIT_OWN = dataclasses.replace(GROW_PAST_BUSY, name="wait-own-stream", wait_own_stream=True, page_slack=0.0,
                               page_slack_min_nbytes=0)


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_chunk_busy_on_the_own_stream_is_waited_for_rather_than_grown_past(dev, engine):
    """Note [Wait for the program's own stream]: with wait_own_stream, a chunk whose queued work is all on the
    stream of the block that needs it is waited for and stolen, even where the busy_slack rule (here inf)
    would create a chunk."""
    alloc = CachingAllocator(dev, WAIT_OWN, engine=engine)
    work, b, x = _past_a_running_kernel(dev, alloc)
    assert work.done and not dev.hazards and alloc.reserved_nbytes == 6 * MiB
    assert _stats(alloc)["n_steals"] == 1 and _stats(alloc)["n_waits"] == 1
    alloc.free(b)
    alloc.free(x)
    alloc.check_consistency()
    alloc.close()


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("pages", [1, 2, 4])
def test_the_wait_for_the_own_stream_takes_the_chunk_whose_fence_is_oldest(dev, engine, pages):
    """Note [Wait for the oldest fence]: of two idle chunks busy on the own stream, the wait takes the one whose
    fence the GPU reaches first: ``a``'s, recorded at an earlier steal, not ``c``'s, recorded at this one after all
    the queued work, which the steal's order (highest address first) would have taken; the kernel on ``c`` is still
    running after the steal. With chunks of several pages (attacker 40 F1) the steal that meets ``a``'s busy
    fences all its pages then, not only the first (whose query stops the pass); else the others took the newest
    fence at the next steal, and the wait drained the queue as the steal's order did."""
    policy = dataclasses.replace(WAIT_OWN, chunk_max_fraction=1.0)
    alloc = CachingAllocator(dev, policy, engine=engine)
    n = pages * 2 * MiB
    held = alloc.allocate(40 * MiB)   # memory held, so that a new chunk may have several pages
    d = alloc.allocate(n, 7)   # no work on stream 7: its chunk is ready
    a = alloc.allocate(n)
    y = alloc.allocate(2 * MiB)
    c = alloc.allocate(n)
    z = alloc.allocate(2 * MiB)
    first = dev.launch(0, KERNEL_S, touches=[(a, n)], name="reads a")
    alloc.free(a)
    alloc.free(d)
    s1 = alloc.allocate(n, 5)   # d's chunk stolen; a's met busy on the way
    assert not first.done and _stats(alloc)["n_waits"] == 0
    second = dev.launch(0, KERNEL_S, touches=[(c, n)], name="reads c")
    alloc.free(c)
    # on stream 0, a's chunk or c's, both busy there: the small pool's first page, or a run past both holes
    s3 = alloc.allocate(1 * MiB if pages == 1 else n + 2 * MiB)
    assert first.done and not second.done and not dev.hazards
    assert _stats(alloc)["n_waits"] == 1
    for p in (held, s1, y, z, s3):
        alloc.free(p)
    alloc.empty_cache()
    assert second.done and not dev.hazards
    alloc.check_consistency()
    alloc.close()


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("busy_slack", [0.0, float("inf")])
def test_the_oldest_fence_is_chosen_among_the_largest_chunks_only(dev, engine, busy_slack):
    """Note [Wait for the oldest fence], attacker 40 F2: a run of four pages to back, a one-page chunk with an old
    fence and a four-page one with a new fence, both busy on the own stream: the wait takes the four-page chunk (as
    the steal's order did). Taking the older one-page chunk first left three pages the four-page chunk no longer
    fitted, and they were created: 58 -> 64 MiB held, busy_slack=0 or not."""
    policy = dataclasses.replace(WAIT_OWN, chunk_max_fraction=1.0, busy_slack=busy_slack)
    alloc = CachingAllocator(dev, policy, engine=engine)
    held = alloc.allocate(40 * MiB)
    d = alloc.allocate(2 * MiB, 7)
    a = alloc.allocate(2 * MiB)
    y = alloc.allocate(2 * MiB)
    c = alloc.allocate(8 * MiB)
    z = alloc.allocate(2 * MiB)
    top = alloc.allocate(2 * MiB)
    first = dev.launch(0, KERNEL_S, touches=[(a, 2 * MiB)], name="reads a")
    alloc.free(a)
    alloc.free(d)
    s1 = alloc.allocate(1 * MiB)   # d's chunk stolen; a's (one page) met busy: the older fence
    second = dev.launch(0, KERNEL_S, touches=[(c, 8 * MiB)], name="reads c")
    alloc.free(c)   # four pages, the newer fence
    alloc.free(top)   # an idle mapped page at the top, where b starts
    reserved = alloc.reserved_nbytes
    b = alloc.allocate(10 * MiB)   # five pages on stream 0: the top page and four more
    assert alloc.reserved_nbytes == reserved == 58 * MiB
    assert second.done and _stats(alloc)["n_waits"] == 1 and not dev.hazards
    for p in (held, s1, y, z, b):
        alloc.free(p)
    alloc.check_consistency()
    alloc.close()


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("wait_own_stream", [True, False])
def test_a_chunk_busy_on_another_stream_is_left_to_the_busy_slack_rule(dev, engine, wait_own_stream):
    """Work of another stream is not waited for by that rule: past it, busy_slack=inf creates a chunk and the
    kernel keeps running, with the rule on or off (off: also for the own stream, the default)."""
    alloc = CachingAllocator(dev, dataclasses.replace(WAIT_OWN, wait_own_stream=wait_own_stream), engine=engine)
    # the freed block's and its kernel's stream; the new block's is 0
    work, b, x = _past_a_running_kernel(dev, alloc, stream=5 if wait_own_stream else 0)
    assert not work.done and not dev.hazards and alloc.reserved_nbytes == 8 * MiB
    assert _stats(alloc)["n_steals"] == 0 and _stats(alloc)["n_waits"] == 0
    alloc.free(b)
    alloc.free(x)
    alloc.empty_cache()
    assert work.done and not dev.hazards
    alloc.check_consistency()
    alloc.close()


ORDERED = dataclasses.replace(get_policy("gpumem"), name="ordered-steal", busy_slack=0.0, page_slack=0.0, page_slack_min_nbytes=0,
                              stream_ordered_steal=True)


def _stats(alloc) -> dict:
    if alloc.engine == "native":
        return alloc._engine._ext.backing_stats()  # noqa: SLF001
    b = alloc.backing
    return {"n_steals": b.n_steals, "n_waits": b.n_waits}


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_chunk_busy_on_the_same_stream_is_stolen_at_once(dev, engine):
    """Note [Stream-ordered steal]: the chunk under a kernel still queued on stream 0 is mapped under a new
    block of stream 0 at once (no wait, no growth); its old mapping goes only once the kernel is done, and
    the sanitizer sees no hazard throughout (the new block's work runs after the old on the stream)."""
    alloc = CachingAllocator(dev, ORDERED, engine=engine)
    a = alloc.allocate(2 * MiB)
    x = alloc.allocate(2 * MiB)
    work = dev.launch(0, KERNEL_S, touches=[(a, 2 * MiB)])
    alloc.free(a)
    b = alloc.allocate(4 * MiB)
    assert not work.done and alloc.reserved_nbytes == 6 * MiB
    assert _stats(alloc)["n_steals"] == 1 and _stats(alloc)["n_waits"] == 0
    assert sum(1 for _, _, h in dev.mapping_ranges()) == 4  # the stolen chunk is mapped twice for now
    alloc.check_consistency()
    later = dev.launch(0, KERNEL_S, touches=[(b, 4 * MiB)])
    alloc.free(b)
    alloc.free(x)
    alloc.empty_cache()  # waits for both kernels, unmaps the old mapping, gives everything back
    assert work.done and later.done and not dev.hazards
    assert alloc.reserved_nbytes == 0 and not dev.mapping_ranges()
    alloc.check_consistency()
    alloc.close()


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_chunk_busy_on_another_stream_is_waited_for(dev, engine):
    """The stream-ordered steal orders work on one stream only: the chunk of a kernel on stream 5 is waited
    for when a block of stream 0 needs it (past busy_slack=0)."""
    alloc = CachingAllocator(dev, ORDERED, engine=engine)
    a = alloc.allocate(2 * MiB, 5)
    x = alloc.allocate(2 * MiB)
    work = dev.launch(5, KERNEL_S, touches=[(a, 2 * MiB)])
    alloc.free(a)
    b = alloc.allocate(4 * MiB)
    assert work.done and not dev.hazards and alloc.reserved_nbytes == 6 * MiB
    assert _stats(alloc)["n_waits"] == 1
    alloc.free(b)
    alloc.free(x)
    alloc.check_consistency()
    alloc.close()


def test_the_old_mapping_of_a_stream_ordered_steal_must_wait_for_its_work(dev, monkeypatch):
    """The test above catches an engine that unmaps the stolen chunk's old mapping at once: the sanitizer
    raises, as a real GPU would fault."""
    from gpumem.allocator.backing import VirtualBacking

    def unmap_at_once(self, seg, s, pending):
        handle = seg.chunks[s]
        self.device.mem_unmap(seg.base + s * self.granularity, handle.nbytes)
        return handle

    monkeypatch.setattr(VirtualBacking, "_defer_unmap", unmap_at_once)
    alloc = CachingAllocator(dev, ORDERED, engine="python")
    a = alloc.allocate(2 * MiB)
    alloc.allocate(2 * MiB)
    dev.launch(0, KERNEL_S, touches=[(a, 2 * MiB)])
    alloc.free(a)
    with pytest.raises(MemoryHazardError):
        alloc.allocate(4 * MiB)


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_block_over_an_old_mapping_waits_for_it(dev, engine):
    """A block that needs the pages of an old mapping not yet unmapped (its kernel still queued) waits for
    that kernel and unmaps it first: a page is never mapped twice at one address."""
    alloc = CachingAllocator(dev, ORDERED, engine=engine)
    a = alloc.allocate(2 * MiB)
    x = alloc.allocate(2 * MiB)
    work = dev.launch(0, KERNEL_S, touches=[(a, 2 * MiB)])
    alloc.free(a)
    b = alloc.allocate(4 * MiB)  # takes a's chunk, stream-ordered
    alloc.free(x)
    c = alloc.allocate(2 * MiB)  # best fit: a's old address, whose mapping is still there
    assert work.done and not dev.hazards
    alloc.check_consistency()
    for p in (b, c):
        alloc.free(p)
    alloc.close()
    assert dev.process_used_nbytes == 0


def _fail_first_unmap(dev) -> list[int]:
    """Make the device's next ``mem_unmap`` raise (once); returns the addresses every unmap was asked for."""
    calls: list[int] = []
    unmap = dev.mem_unmap

    def failing(va, nbytes):
        calls.append(va)
        if len(calls) == 1:
            raise RuntimeError("injected mem_unmap failure")
        return unmap(va, nbytes)

    dev.mem_unmap = failing
    return calls


@pytest.mark.parametrize("engine", ["python", "native"])
def test_close_keeps_a_chunk_whose_old_mapping_it_could_not_unmap(dev, engine):
    """close unmaps the old mapping of a stream-ordered steal first; when that unmap fails the chunk is still
    mapped there, so it is not released (the device would keep the memory until an unmap that never comes)
    and close reports it held. Before the fix: released, the allocator said 0 B held, the device 2 MiB."""
    alloc = CachingAllocator(dev, ORDERED, engine=engine, limit=6 * MiB)
    a = alloc.allocate(2 * MiB)
    x = alloc.allocate(2 * MiB)
    dev.launch(0, KERNEL_S, touches=[(a, 2 * MiB)])
    alloc.free(a)
    b = alloc.allocate(4 * MiB)  # takes a's chunk, stream-ordered: a's old mapping is deferred
    alloc.free(b)
    alloc.free(x)
    calls = _fail_first_unmap(dev)
    alloc.close()
    assert calls[0] == a  # the old mapping went first, and failed
    assert dev.mapping_ranges() and [va for va, _, _ in dev.mapping_ranges()] == [a]
    assert alloc.reserved_nbytes == dev.process_used_nbytes == 2 * MiB
    assert not dev.hazards


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("fail", ["mem_map", "mem_set_access"])
def test_a_failed_map_after_a_stream_ordered_steal_puts_the_chunk_back(dev, engine, fail):
    """A chunk stolen stream-ordered is still mapped at its old address under work queued on its stream; when
    the allocation fails after the steal (its map or access call), the chunk goes back where it was, with its
    fences (Note [Failure atomicity]). Before the fix it went to the cache of unmapped chunks: the next block,
    of any stream, took it at once (a kernel on stream 5 would run on memory stream 0's kernel still used),
    and the gc, which never waits, waited for the kernel to give it back. (busy_slack=inf: a busy chunk
    is not waited for while a new one can be made.)"""
    policy = dataclasses.replace(ORDERED, busy_slack=float("inf"))
    alloc = CachingAllocator(dev, policy, engine=engine, gc_threshold=0.01)
    a = alloc.allocate(2 * MiB)
    x = alloc.allocate(2 * MiB)
    work = dev.launch(0, KERNEL_S, touches=[(a, 2 * MiB)])
    alloc.free(a)
    before = sorted(dev.mapping_ranges())
    real = getattr(dev, fail)
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == (2 if fail == "mem_map" else 1):  # the stolen chunk's map, or the access of both
            raise RuntimeError(f"injected {fail} failure")
        return real(*args)

    setattr(dev, fail, failing)
    with pytest.raises(RuntimeError, match="injected"):
        alloc.allocate(4 * MiB)  # one page created, a's chunk stolen stream-ordered, then the failure
    setattr(dev, fail, real)
    alloc.check_consistency()
    assert sorted(dev.mapping_ranges()) == before and alloc.reserved_nbytes == 4 * MiB
    b = alloc.allocate(2 * MiB, 5)  # another stream: gc (no wait), then a chunk that no queued work uses
    assert not work.done and not dev.hazards
    a_chunk = next(h for va, _, h in before if va == a)
    assert all(h != a_chunk for va, _, h in dev.mapping_ranges() if b <= va < b + 2 * MiB), \
        "a block of stream 5 was given memory a kernel of stream 0 still uses"
    alloc.check_consistency()
    for p in (b, x):
        alloc.free(p)
    alloc.close()
    assert work.done and not dev.hazards and dev.process_used_nbytes == 0


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_stolen_chunk_whose_new_mapping_cannot_be_undone_keeps_its_fences(dev, engine):
    """The access call after a stream-ordered steal fails, and so does the unmap of the stolen chunk's new
    mapping in the rollback: the chunk stays mapped at its new address too, idle there. Its pages there carry
    the fences of its old work, so the next steal (for a block of stream 5) does not take it as done and map
    it under that block while stream 0's kernel still uses it through the old mapping."""
    policy = dataclasses.replace(ORDERED, busy_slack=float("inf"))
    alloc = CachingAllocator(dev, policy, engine=engine)
    # stream 5 has memory from the start: its first block later would wait for every deferred mapping on the
    # host (Note [One stream needs no whole pages]), and this test is about the fences of the rollback
    s5 = alloc.allocate(512, 5)
    a = alloc.allocate(2 * MiB)
    x = alloc.allocate(2 * MiB)
    work = dev.launch(0, KERNEL_S, touches=[(a, 2 * MiB)])
    alloc.free(a)
    a_chunk = next(h for va, _, h in dev.mapping_ranges() if va == a)
    access, unmap = dev.mem_set_access, dev.mem_unmap

    def failing_access(*args):
        raise RuntimeError("injected mem_set_access failure")

    def failing_unmap(va, nbytes):
        if any(v == va and h == a_chunk for v, _, h in dev.mapping_ranges()) and va != a:
            raise RuntimeError("injected mem_unmap failure")
        return unmap(va, nbytes)

    dev.mem_set_access, dev.mem_unmap = failing_access, failing_unmap
    with pytest.raises(RuntimeError, match="injected mem_set_access"):
        alloc.allocate(4 * MiB)  # one page created, a's chunk stolen stream-ordered, the access fails
    dev.mem_set_access, dev.mem_unmap = access, unmap
    alloc.check_consistency()
    b = alloc.allocate(2 * MiB, 5)  # past the slack: a steal, for stream 5
    assert not work.done and not dev.hazards
    assert all(h != a_chunk for va, _, h in dev.mapping_ranges() if b <= va < b + 2 * MiB), \
        "a block of stream 5 was given memory a kernel of stream 0 still uses"
    alloc.check_consistency()
    for p in (b, x, s5):
        alloc.free(p)
    alloc.close()
    assert work.done and not dev.hazards


class _InjectedInterrupt(KeyboardInterrupt):
    """Ctrl-C raised from inside a device call."""


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_ctrl_c_in_the_rollback_still_puts_the_stolen_chunk_back(dev, engine):
    """The map of a chunk stolen stream-ordered fails, and a Ctrl-C ends the rollback (in the unmap of the
    chunk created before it): the stolen chunk still goes back where it is mapped, not to the cache, from
    which the next block of stream 5 would take it while stream 0's kernel still uses it."""
    policy = dataclasses.replace(ORDERED, busy_slack=float("inf"))
    alloc = CachingAllocator(dev, policy, engine=engine)
    a = alloc.allocate(2 * MiB)
    x = alloc.allocate(2 * MiB)
    work = dev.launch(0, KERNEL_S, touches=[(a, 2 * MiB)])
    alloc.free(a)
    a_chunk = next(h for va, _, h in dev.mapping_ranges() if va == a)
    mem_map, unmap = dev.mem_map, dev.mem_unmap
    maps: list[int] = []

    def failing_map(va, nbytes, handle, offset):
        maps.append(va)
        if len(maps) == 2:  # the stolen chunk's
            raise RuntimeError("injected mem_map failure")
        return mem_map(va, nbytes, handle, offset)

    def interrupted_unmap(va, nbytes):
        raise _InjectedInterrupt("injected into mem_unmap")

    dev.mem_map, dev.mem_unmap = failing_map, interrupted_unmap
    with pytest.raises(_InjectedInterrupt):
        alloc.allocate(4 * MiB)
    dev.mem_map, dev.mem_unmap = mem_map, unmap
    alloc.check_consistency()
    b = alloc.allocate(2 * MiB, 5)
    assert not work.done and not dev.hazards
    assert all(h != a_chunk for va, _, h in dev.mapping_ranges() if b <= va < b + 2 * MiB), \
        "a block of stream 5 was given memory a kernel of stream 0 still uses"
    alloc.check_consistency()
    for p in (b, x):
        alloc.free(p)
    alloc.close()
    assert work.done and not dev.hazards


def test_memory_a_kernel_uses_is_not_given_back_early_by_gc(dev):
    """The gc threshold releases only memory whose work is done (it queries, never waits)."""
    alloc = CachingAllocator(dev, GROW_PAST_BUSY, gc_threshold=0.01)
    p = alloc.allocate(8 * MiB)
    work = dev.launch(0, KERNEL_S, touches=[(p, 8 * MiB)])
    alloc.free(p)
    q = alloc.allocate(3 * MiB, 1)  # past the threshold: gc runs, must skip p's pages
    assert not dev.hazards and not work.done
    alloc.free(q)
    alloc.empty_cache()
    assert work.done and alloc.reserved_nbytes == 0


def test_pending_record_stream_blocks_do_not_cause_an_oom(dev):
    """Issue 6: three 100 MiB blocks freed after record_stream made a 200 MiB request fail on a
    384 MiB card (352 MiB usable) until synchronize() was called by hand."""
    for policy in ("gpumem", "bestfit"):
        alloc = CachingAllocator(dev, policy)
        works = []
        for _ in range(3):
            p = alloc.allocate(100 * MiB)
            alloc.record_stream(p, 3)
            works.append(dev.launch(3, KERNEL_S, touches=[(p, 100 * MiB)]))
            alloc.free(p)
        q = alloc.allocate(200 * MiB)  # the OOM path waits for the pending blocks' events
        assert all(w.done for w in works)
        assert not dev.hazards
        alloc.free(q)
        alloc.check_consistency()
        alloc.close()
        assert dev.process_used_nbytes == 0


def test_pending_blocks_without_work_are_reused_at_once(dev):
    alloc = CachingAllocator(dev, "gpumem")
    for _ in range(3):
        p = alloc.allocate(100 * MiB)
        alloc.record_stream(p, 3)
        alloc.free(p)
    q = alloc.allocate(200 * MiB)
    assert alloc.stats.num_ooms == 0
    alloc.free(q)


# -- streams at scale (point 6) ---------------------------------------------------------------------


def test_ten_thousand_streams_on_the_default_policy():
    """Issue 6: each (pool, stream) reserved twice the device in address space; stream 832 failed
    on an 80 GB device. All streams now share one range per pool."""
    from gpumem import open_device

    with open_device("sim:a100-80gb") as dev:
        alloc = CachingAllocator(dev)
        for s in range(1, 10_001):
            p = alloc.allocate(512 if s % 2 else 3 * MiB, s)
            q = alloc.allocate(64 * KiB, s)
            alloc.free(p)
            alloc.free(q)
        assert len(alloc.backing.vsegments) == 2  # one range per pool
        assert len(dev.reservation_ranges()) == 2
        alloc.check_consistency()
        alloc.empty_cache()
        assert alloc.reserved_nbytes == 0 and dev.process_used_nbytes == 0
        assert len(alloc._engine._free_lists) == 0  # noqa: SLF001 - idle streams keep no host memory
        alloc.close()


def _rmm_like_trace(n_streams: int, n_events: int) -> Trace:
    """An RMM-log-like trace: address-keyed allocations and frees interleaved over ``n_streams``
    streams (odd numbers, like ``cudaStream_t`` handles), 512 B to 8 MiB, built as the RMM reader
    builds its traces."""
    import random

    rng = random.Random(6)
    codes, addrs, sizes, streams = [], [], [], []
    live: dict[int, list[int]] = {}
    next_addr = 1 << 32
    for i in range(n_events):
        s = (i if i < 2 * n_streams else rng.randrange(n_streams)) % n_streams * 2 + 1
        mine = live.setdefault(s, [])
        if mine and rng.random() < 0.45:
            codes.append(FREE_CODE)
            addrs.append(mine.pop(rng.randrange(len(mine))))
            sizes.append(0)
        else:
            n = rng.choice([512, 4 * KiB, 100 * KiB, 1 * MiB + 1, 8 * MiB])
            codes.append(ALLOC_CODE)
            addrs.append(next_addr)
            mine.append(next_addr)
            next_addr += n + 256
            sizes.append(n)
        streams.append(s)
    return build_trace("rmm-1000-streams", "rmm", codes, addrs, sizes, streams, [float(i) for i in range(len(codes))])


def test_a_trace_with_a_thousand_streams_replays():
    """Issue 6: a 42 KB RMM log with 1,000 streams failed at a 512 B allocation."""
    from gpumem.replay import replay_trace

    trace = _rmm_like_trace(1000, 6000)
    assert len(set(trace.streams.tolist())) == 1000
    result = replay_trace(trace, "sim:a100-80gb", "gpumem")
    assert result.ooms == 0 and result.completed_ops == trace.n_ops
    assert result.overhead < 0.5


def test_address_space_trimmed_from_one_stream_is_reused_by_another_only_after_its_work(dev):
    """Note [One range per pool]: a free block at the top of the shared range is trimmed off when
    the cache is released; a stream that grows over it waits for the fence of the stream that used
    it. Here A shares its page with a live block, so releasing the page cannot have waited."""
    alloc = CachingAllocator(dev, "gpumem")
    keep = alloc.allocate(512 * KiB, 1)
    a = alloc.allocate(512 * KiB, 1)  # same page as keep, at the top of the small pool's range
    work = dev.launch(1, KERNEL_S, touches=[(a, 512 * KiB)], name="reads A")
    alloc.free(a)
    alloc.empty_cache()  # trims A's block off the top; its page stays (keep lives there)
    assert not work.done
    b = alloc.allocate(512 * KiB, 2)
    assert b == a, "the scenario did not reuse A's addresses"
    assert work.done, "stream 2 got stream 1's memory while stream 1's kernel still used it"
    assert not dev.hazards
    alloc.free(b)
    alloc.free(keep)
    alloc.check_consistency()


# -- close() waits for the streams that used the memory (review finding F1) ----------------------------
@pytest.mark.parametrize("policy", ["gpumem", "bestfit", "pytorch", "cupy"])
@pytest.mark.parametrize("sync_fails", [(), ("synchronize",), ("synchronize", "stream_synchronize")])
def test_close_waits_for_streams_and_keeps_what_it_cannot_wait_for(policy, sync_fails, caplog):
    from gpumem import sim

    from allocator_helpers import small_profile

    dev = sim.SimDevice(small_profile(384, vmm=(policy == "gpumem")),
                        faults=sim.FaultPlan(fail_calls={c: frozenset({1}) for c in sync_fails}))
    alloc = CachingAllocator(dev, policy, record_history=True)
    a = alloc.allocate(4 * MiB, 0)
    dev.launch(0, 0.5, touches=[(a, 4 * MiB)], name="reads a")
    alloc.free(a)
    with caplog.at_level("WARNING"):
        alloc.close()  # the sanitizer is on (raise): giving the memory back under the kernel would raise
    assert alloc.reserved_nbytes == alloc.leaked_nbytes == dev.process_used_nbytes
    sign = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    if len(sync_fails) == 2:  # neither the stream nor the device could be waited for: kept, and said so
        assert alloc.leaked_nbytes > 0
        assert "still held" in caplog.text
    else:
        assert alloc.leaked_nbytes == 0
        # the export sees the memory go back at close (finding F4a)
        assert sum(sign[e[0]] * e[2] for e in alloc.history().segment_events) == 0


# -- address space of idle streams (review finding F3) --------------------------------------------------
def test_idle_streams_address_space_is_reused_by_another_stream(dev):
    """Seven streams each used 100 MiB once, then went idle below a live block: their free blocks held
    the shared range's address space for good and a new stream got a persistent OOM on an almost empty
    card. Out of memory, free blocks of idle streams are re-owned by the requesting stream."""
    alloc = CachingAllocator(dev, "gpumem")
    for s in range(1, 8):
        alloc.free(alloc.allocate(100 * MiB, s))
    keep = alloc.allocate(2 * MiB, 50)
    alloc.empty_cache()
    p = alloc.allocate(100 * MiB, 99)
    q = alloc.allocate(100 * MiB, 0)
    alloc.check_consistency()
    for x in (p, q, keep):
        alloc.free(x)
    alloc.check_consistency()
    alloc.close()


def test_address_space_exhaustion_is_named_in_the_oom_error(dev, monkeypatch):
    from gpumem.errors import OutOfMemoryError

    from gpumem.allocator.python_engine import PythonEngine

    monkeypatch.setattr(PythonEngine, "_reown_idle", lambda self, stream, free_list: False)
    alloc = CachingAllocator(dev, "gpumem")
    for s in range(1, 8):
        alloc.free(alloc.allocate(100 * MiB, s))
    alloc.allocate(2 * MiB, 50)
    alloc.empty_cache()
    with pytest.raises(OutOfMemoryError, match="virtual address range"):
        alloc.allocate(100 * MiB, 99)
    alloc.close()


# -- no needless waiting on the out-of-memory path (review finding F6) -----------------------------------
@pytest.mark.parametrize("policy", ["gpumem", "bestfit", "pytorch", "cupy"])
def test_oom_retry_releases_idle_cache_before_waiting_for_pending_blocks(policy):
    """A record_stream block behind a 10 s kernel made an unrelated allocation wait 10 s although the
    idle cache it released anyway was enough."""
    from gpumem import sim

    from allocator_helpers import small_profile

    dev = sim.SimDevice(small_profile(384, vmm=(policy == "gpumem")))
    alloc = CachingAllocator(dev, policy)
    p = alloc.allocate(8 * MiB, 0)
    alloc.record_stream(p, 5)
    dev.launch(5, 10.0, touches=[(p, 8 * MiB)], name="10 s kernel on stream 5")
    alloc.free(p)
    alloc.free(alloc.allocate(300 * MiB, 0))
    t0 = dev.now_s
    q = alloc.allocate(300 * MiB, 1)
    assert dev.now_s - t0 < 1.0
    alloc.free(q)
    alloc.check_consistency()
    alloc.close()


@pytest.mark.parametrize("policy", ["gpumem", "bestfit"])
@pytest.mark.parametrize("request_nbytes, kwargs", [(2**64, {}), (200 * MiB, {"limit": 100 * MiB})])
def test_impossible_request_is_refused_at_once(policy, request_nbytes, kwargs):
    from gpumem import sim
    from gpumem.errors import OutOfMemoryError

    from allocator_helpers import small_profile

    dev = sim.SimDevice(small_profile(384, vmm=(policy == "gpumem")))
    alloc = CachingAllocator(dev, policy, **kwargs)
    a = alloc.allocate(8 * MiB)
    b = alloc.allocate(8 * MiB)
    dev.launch(0, 2.0, touches=[(a, 8 * MiB)], name="2 s kernel")
    alloc.free(a)
    alloc.free(b)
    t0, r0 = dev.now_s, alloc.reserved_nbytes
    with pytest.raises(OutOfMemoryError):
        alloc.allocate(request_nbytes)
    assert dev.now_s - t0 < 0.1 and alloc.reserved_nbytes == r0  # no wait, cache kept
    alloc.close()


# -- a steal takes an idle empty page before waiting for busy ones (review finding F5) --------------------
def test_steal_takes_any_idle_empty_page_before_waiting(dev):
    alloc = CachingAllocator(dev, "gpumem", limit=10 * MiB)   # the slack's floor stops at the limit
    a0 = alloc.allocate(2 * MiB, 7)  # page 0: no work ever
    rest = [alloc.allocate(2 * MiB, 0) for _ in range(4)]  # pages 1-4
    for p in rest:
        dev.launch(0, 1.0, touches=[(p, 2 * MiB)], name="1 s kernel")
    for p in [a0] + rest:
        alloc.free(p)
    t0 = dev.now_s
    q = alloc.allocate(2 * MiB, 9)  # at the limit: one empty page is stolen
    assert dev.now_s - t0 < 0.1 and alloc.backing.n_waits == 0
    assert alloc.backing.vsegments[False].chunks[0] is None  # the idle page was the one taken
    alloc.free(q)
    alloc.check_consistency()
    alloc.close()


# -- pending blocks: one query per busy stream per miss (review finding F7) --------------------------------
def test_cache_miss_queries_each_busy_stream_once_not_each_pending_block():
    from gpumem import sim

    from allocator_helpers import small_profile

    dev = sim.SimDevice(small_profile(2048))
    alloc = CachingAllocator(dev, "gpumem")
    ps = [alloc.allocate(4 * KiB, 0) for _ in range(300)]
    for p in ps:
        alloc.record_stream(p, 5)
    dev.launch(5, 100.0, touches=[], name="long kernel on stream 5")
    for p in ps:
        alloc.free(p)
    q0 = dev.stats.calls.get("event_query", 0)
    for i in range(20):
        alloc.allocate(64 * KiB + i * 512, 1 + i)  # cache misses
    assert dev.stats.calls.get("event_query", 0) - q0 <= 20
    alloc.close()


# -- idle streams' events and fence entries go back on empty_cache (review finding F8) --------------------
@pytest.mark.parametrize("policy", ["gpumem", "bestfit"])
def test_empty_cache_destroys_idle_streams_events_and_forgets_them(policy):
    from gpumem import sim

    from allocator_helpers import small_profile

    dev = sim.SimDevice(small_profile(1024, vmm=(policy == "gpumem")))
    alloc = CachingAllocator(dev, policy)
    for s in range(1, 601):
        alloc.free(alloc.allocate(4096 if s % 2 else 3 * MiB, s))
        if s % 100 == 0:
            alloc.empty_cache()
    alloc.empty_cache()
    assert alloc._engine.fences.outstanding == 0
    assert alloc._engine.fences.n_records == alloc._engine.fences.n_destroys
    assert len(alloc._engine.fences._done) == 0 and not alloc._engine._free_lists
    # a busy stream's events are kept
    p = alloc.allocate(3 * MiB, 7)
    dev.launch(7, 1.0, touches=[(p, 3 * MiB)], name="busy")
    alloc.free(p)
    alloc.empty_cache()  # waits for the page's fence: then stream 7 is idle and forgotten as well
    assert alloc._engine.fences.outstanding == 0
    alloc.check_consistency()
    alloc.close()


def test_reowned_address_space_tracks_both_streams_work(dev):
    """Only stream 1 ever grew the range, then stream 99 is served from stream 1's re-owned free blocks,
    on a page where stream 1 still holds live data: that page's fence must cover stream 99's work too."""
    alloc = CachingAllocator(dev, "gpumem")
    a = alloc.allocate(299 * MiB, 1)
    k1 = alloc.allocate(1 * MiB + 512, 1)  # large pool; shares a's last page
    alloc.free(a)
    b = alloc.allocate(340 * MiB, 1)  # a is too small: the range grows
    k2 = alloc.allocate(2 * MiB, 1)
    alloc.free(b)
    p = alloc.allocate(200 * MiB, 99)  # no address space left at the top: re-owned from stream 1
    assert alloc.backing.multi_stream  # pages now note each stream whose blocks used them
    dev.launch(99, KERNEL_S, touches=[(p, 200 * MiB)], name="new owner's kernel")
    alloc.free(p)
    alloc.free(k1)
    alloc.empty_cache()  # must wait for stream 99's kernel on the shared page: the sanitizer raises otherwise
    alloc.free(k2)
    alloc.check_consistency()
    alloc.close()
