"""``AllocatorPolicy.wait_on_gpu``: past the ``busy_slack`` bound, a chunk busy on another stream is waited for on
the GPU (``stream_wait_event``), not the host (Note [Wait on the GPU, not the host] in gpumem.allocator.backing)."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.allocator.policy import get_policy
from gpumem.errors import InvalidArgumentError, TransientDeviceError
from gpumem.native import load_engine
from gpumem.units import MiB

from allocator_helpers import small_profile

ENGINES = ["python"] + (["native"] if load_engine() is not None else [])
# no slack of any kind: the second stream's block must take the first stream's busy chunk
TIGHT = dataclasses.replace(get_policy("gpumem"), page_slack=0.0, page_slack_min_nbytes=0, busy_slack=0.0,
                            chunk_max_fraction=1.0)
A, B = 7, 9
KERNEL_S = 0.01


class CountingDevice(sim.SimDevice):
    """A simulated device that counts the calls the allocator makes that wait, on the host or on the GPU."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counts: collections.Counter[str] = collections.Counter()

    def event_synchronize(self, event):
        self.counts["event_synchronize"] += 1
        return super().event_synchronize(event)

    def stream_wait_event(self, stream, event):
        self.counts["stream_wait_event"] += 1
        return super().stream_wait_event(stream, event)


def _busy_chunk_then_other_stream(engine: str, wait_on_gpu: bool, second_stream: int = B):
    """Stream A's 8 MiB block freed under a queued 10 ms kernel; then 8 MiB on ``second_stream``, which can only
    take A's chunk. Returns the device, the allocator, A's kernel and the second block."""
    dev = CountingDevice(small_profile(384))
    alloc = CachingAllocator(dev, dataclasses.replace(TIGHT, wait_on_gpu=wait_on_gpu), engine=engine)
    a = alloc.allocate(8 * MiB, A)
    kernel = dev.launch(A, KERNEL_S, touches=[(a, 8 * MiB)])
    alloc.free(a)
    before_s = dev.now_s
    b = alloc.allocate(8 * MiB, second_stream)
    return dev, alloc, kernel, b, dev.now_s - before_s


@pytest.mark.parametrize("engine", ENGINES)
def test_the_other_streams_busy_chunk_is_waited_for_on_the_gpu(engine):
    dev, alloc, kernel, b, host_s = _busy_chunk_then_other_stream(engine, True)
    assert set(dev.counts) == {"stream_wait_event"}   # no host wait (one per chunk taken)
    assert host_s < KERNEL_S / 10 and not kernel.done   # the host went on while A's kernel runs
    assert alloc.stats.reserved_nbytes == 8 * MiB   # A's chunk, not a new one
    # B's work runs after A's: the chunk's old work is done before B's kernel on the new mapping starts
    work = dev.launch(B, 1e-3, touches=[(b, 8 * MiB)])
    dev.synchronize()
    assert work.start_s >= kernel.end_s
    alloc.free(b)
    alloc.empty_cache()   # the old mapping, deferred, goes once A's fence has completed
    assert alloc.stats.reserved_nbytes == 0
    assert not alloc.check_consistency()
    alloc.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_off_the_host_waits_for_the_same_chunk(engine):
    dev, alloc, kernel, _, host_s = _busy_chunk_then_other_stream(engine, False)
    assert set(dev.counts) == {"event_synchronize"}
    assert host_s >= KERNEL_S * 0.9 and kernel.done
    assert alloc.stats.reserved_nbytes == 8 * MiB   # the same memory either way
    alloc.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_chunk_busy_on_the_own_stream_needs_no_wait(engine):
    """The stream that takes the chunk runs its own queued work first anyway: nothing to wait for."""
    dev, alloc, kernel, b, host_s = _busy_chunk_then_other_stream(engine, True, second_stream=A)
    assert dev.counts == {} and not kernel.done and host_s < KERNEL_S / 10
    assert alloc.stats.reserved_nbytes == 8 * MiB
    alloc.close()


def test_both_engines_make_the_same_calls():
    if len(ENGINES) < 2:
        pytest.skip("the native engine is not built")
    seen = []
    for engine in ENGINES:
        dev, alloc, _, _, host_s = _busy_chunk_then_other_stream(engine, True)
        seen.append((dict(dev.counts), alloc.stats.device_calls, alloc.stats.event_calls, host_s))
        alloc.close()
    assert seen[0] == seen[1]


def test_wait_on_gpu_is_a_bool_and_off_by_default():
    assert get_policy("gpumem").wait_on_gpu is False
    for bad in (1, "yes", None):
        with pytest.raises(InvalidArgumentError, match="wait_on_gpu must be a bool"):
            dataclasses.replace(get_policy("gpumem"), wait_on_gpu=bad)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("knobs", [{"wait_on_gpu": True}, {"stream_ordered_steal": True}],
                         ids=["wait-on-gpu", "ordered-steal"])
def test_no_block_of_a_third_stream_shares_a_chunk_its_old_work_still_uses(engine, knobs):
    """Note [No other stream on a deferred chunk] (attacker review, 2026-12-03): A's 2 MiB freed under a queued
    kernel; a 512 B block of B on it (a small-pool page, shared by any stream) and then one of C. Taken without a
    host wait, C's kernel ran on the bytes A's old kernel still used. Now the chunk is waited for on the host."""
    C = 11
    dev = CountingDevice(small_profile(384))
    alloc = CachingAllocator(dev, dataclasses.replace(TIGHT, **knobs), engine=engine)
    x = alloc.allocate(2 * MiB, A)
    kernel = dev.launch(A, KERNEL_S, touches=[(x, 2 * MiB)])
    alloc.free(x)
    b = alloc.allocate(512, B if "wait_on_gpu" in knobs else A)
    c = alloc.allocate(512, C)
    work = dev.launch(C, 1e-3, touches=[(c, 512)])
    dev.synchronize()
    assert kernel.done and work.start_s >= kernel.end_s   # C's work never ran beside A's old work
    assert "stream_wait_event" not in dev.counts   # the shared page's chunk was waited for on the host
    for p in (b, c):
        alloc.free(p)
    assert not alloc.check_consistency()
    alloc.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_chunk_under_the_blocks_partial_last_page_is_waited_for_on_the_host(engine):
    """A block that ends mid-page: the chunk for its last page could be shared by the next block of any stream,
    so it is not taken without a host wait; the pages it covers whole are."""
    dev = CountingDevice(small_profile(384))
    alloc = CachingAllocator(dev, dataclasses.replace(TIGHT, wait_on_gpu=True, chunk_max_fraction=1 / 1024), engine=engine)
    x = alloc.allocate(8 * MiB, A)   # four one-page chunks
    kernel = dev.launch(A, KERNEL_S, touches=[(x, 8 * MiB)])
    alloc.free(x)
    b = alloc.allocate(6 * MiB + 512, B)   # three whole pages and a partial fourth
    assert dev.counts["stream_wait_event"] >= 1 and dev.counts["event_synchronize"] >= 1
    assert kernel.done   # the host waited for the partial page's chunk
    c = alloc.allocate(512 * 1024, 11)   # may share the fourth page
    work = dev.launch(11, 1e-3, touches=[(c, 512 * 1024)])
    dev.synchronize()
    assert work.start_s >= kernel.end_s
    for p in (b, c):
        alloc.free(p)
    assert not alloc.check_consistency()
    alloc.close()


@pytest.mark.parametrize("knobs", [{"wait_on_gpu": True}, {"stream_ordered_steal": True}],
                         ids=["wait-on-gpu", "ordered-steal"])
@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "as-before"])
def test_the_simulators_sanitizer_sees_the_third_streams_alias(monkeypatch, knobs, fixed):
    """Note [Physical aliasing] in gpumem.sim.streams: the bug of Note [No other stream on a deferred chunk] passed
    every check of the simulator until work carried its physical pieces; with the chunk taken as before the fix
    (any size, shared pages too), the sanitizer now records the alias; with the fix, none."""
    from gpumem.allocator.backing import VirtualBacking

    if not fixed:   # any chunk, and no wait where a second stream first gets memory
        steal = VirtualBacking._steal_chunk
        monkeypatch.setattr(VirtualBacking, "_steal_chunk",
                            lambda self, *args: steal(self, *args[:-1], 1 << 40))
        monkeypatch.setattr(VirtualBacking, "begin_multi_stream", lambda self: setattr(self, "multi_stream", True))
    dev = CountingDevice(small_profile(384), sanitizer="count")
    alloc = CachingAllocator(dev, dataclasses.replace(TIGHT, **knobs), engine="python")
    x = alloc.allocate(2 * MiB, A)
    dev.launch(A, KERNEL_S, touches=[(x, 2 * MiB)])
    alloc.free(x)
    b = alloc.allocate(512, B if "wait_on_gpu" in knobs else A)
    c = alloc.allocate(512, 11)
    dev.launch(11, 1e-3, touches=[(c, 512)], name="third")
    dev.synchronize()
    assert [(h.call, h.work) for h in dev.hazards] == ([] if fixed else [("alias", "third")])
    for p in (b, c):
        alloc.free(p)
    alloc.close()


def _one_stream_partial_page(engine: str):
    """Stream A's two one-page blocks freed under a queued kernel between live ones, then 2 MiB + 512 B on A at the
    top: a whole page and a partial one, each needing a chunk, and the two idle chunks busy on A the only ones.
    Returns the device, the allocator, the kernel and the new block."""
    dev = CountingDevice(small_profile(384), sanitizer="count")
    alloc = CachingAllocator(dev, dataclasses.replace(TIGHT, stream_ordered_steal=True, chunk_max_fraction=1 / 1024),
                             engine=engine)
    x1, g1, x2, g2 = (alloc.allocate(2 * MiB, A) for _ in range(4))
    kernel = dev.launch(A, KERNEL_S, touches=[(x1, 2 * MiB), (x2, 2 * MiB)])
    alloc.free(x1)
    alloc.free(x2)
    b = alloc.allocate(2 * MiB + 512, A)
    return dev, alloc, kernel, b, (g1, g2)


@pytest.mark.parametrize("engine", ENGINES)
def test_one_stream_takes_the_chunk_under_its_partial_page_without_a_wait(engine):
    """Note [One stream needs no whole pages]: while every block is of one stream, the chunk under a block's partial
    page is taken in stream order (under Note [No other stream on a deferred chunk] alone, the host waited); the
    first block of a second stream waits for the old work on the host, once, and runs after it."""
    dev, alloc, kernel, b, guards = _one_stream_partial_page(engine)
    assert dev.counts == {} and not kernel.done   # both chunks taken in stream order: no wait of any kind
    assert alloc.stats.reserved_nbytes == 8 * MiB
    work = dev.launch(A, 1e-3, touches=[(b, 2 * MiB + 512)])
    c = alloc.allocate(512 * 1024, 11)   # the first block of another stream
    assert dev.counts["event_synchronize"] >= 1 and "stream_wait_event" not in dev.counts and kernel.done
    late = dev.launch(11, 1e-3, touches=[(c, 512 * 1024)], name="other")
    d = alloc.allocate(512 * 1024, 11)
    dev.synchronize()
    assert late.start_s >= kernel.end_s and work.done and not dev.hazards
    for p in (b, c, d) + guards:
        alloc.free(p)
    assert not alloc.check_consistency()
    alloc.close()


def test_one_stream_both_engines_make_the_same_calls():
    if len(ENGINES) < 2:
        pytest.skip("the native engine is not built")
    seen = []
    for engine in ENGINES:
        dev, alloc, _, b, _ = _one_stream_partial_page(engine)
        c = alloc.allocate(512 * 1024, 11)
        seen.append((b, c, dict(dev.counts), alloc.stats.device_calls, alloc.stats.event_calls,
                     alloc.stats.reserved_nbytes))
        alloc.close()
    assert seen[0] == seen[1]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("error", [TransientDeviceError("event sync failed"), KeyboardInterrupt()],
                         ids=["device-error", "ctrl-c"])
def test_a_failed_wait_at_the_second_stream_runs_again(monkeypatch, engine, error):
    """Attacker review of 2026-12-04: the second stream's first allocation set the flag, then its host wait failed;
    the next allocation, flag set, waited for nothing, and its block on the partial page ran beside the old work."""
    dev, alloc, kernel, b, guards = _one_stream_partial_page(engine)
    work = dev.launch(A, 1e-3, touches=[(b, 2 * MiB + 512)])
    real = CountingDevice.event_synchronize
    calls = []

    def flaky(self, event):
        calls.append(event)
        if len(calls) == 1:
            raise error
        return real(self, event)

    monkeypatch.setattr(CountingDevice, "event_synchronize", flaky)
    with pytest.raises(type(error)):
        alloc.allocate(3 * MiB, 11)   # the large pool: grows from b's end, on b's partial page
    assert not kernel.done and not alloc.check_consistency()
    c = alloc.allocate(3 * MiB, 11)   # waits again, for real
    assert kernel.done
    dev.launch(11, 1e-3, touches=[(c, 3 * MiB)], name="other")
    dev.synchronize()
    assert not dev.hazards and work.done
    for p in (b, c) + guards:
        alloc.free(p)
    assert not alloc.check_consistency()
    alloc.close()
