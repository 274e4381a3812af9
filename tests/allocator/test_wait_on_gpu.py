"""``AllocatorPolicy.wait_on_gpu``: past the ``busy_slack`` bound, a chunk busy on another stream is waited for on
the GPU (``stream_wait_event``), not the host (Note [Wait on the GPU, not the host] in gpumem.allocator.backing)."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.allocator.policy import get_policy
from gpumem.errors import InvalidArgumentError
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
