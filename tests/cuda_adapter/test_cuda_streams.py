"""CudaDevice streams and events over the fake runtime: the CUDA calls made, the event pool,
foreign (CuPy) stream handles, and failed calls that keep the record true."""

from __future__ import annotations

import pytest

from gpumem import CudaError, DeviceClosedError, DeviceLostError, Event, InvalidArgumentError
from gpumem.cuda.device import _EVENT_POOL_SIZE, CudaEvent
from gpumem.sim import SimDevice, get_profile

CUPY_STREAM_PTR = 0x7F12_3456_7000  # what cupy.cuda.Stream().ptr looks like


def _names(fakes, since: int = 0) -> list[str]:
    return [n for n, _ in fakes.runtime.calls[since:] if n != "cudaSetDevice"]


def test_stream_create_and_destroy(dev, fakes):
    s = dev.stream_create()
    assert s in fakes.runtime.streams and fakes.runtime.streams[s] == 1  # cudaStreamNonBlocking
    dev.stream_synchronize(s)
    dev.stream_destroy(s)
    assert s not in fakes.runtime.streams
    mark = len(fakes.runtime.calls)
    with pytest.raises(InvalidArgumentError):
        dev.stream_destroy(s)
    with pytest.raises(InvalidArgumentError):
        dev.stream_destroy(0)
    assert fakes.runtime.calls[mark:] == [], "bad streams never reach CUDA"


def test_event_record_query_synchronize(dev, fakes):
    s = dev.stream_create()
    fakes.runtime.busy.add(s)                  # work queued on s
    e = dev.event_record(s)
    assert isinstance(e, CudaEvent) and e.stream == s
    assert fakes.runtime.events[e.handle][0] == 2  # cudaEventDisableTiming
    assert dev.event_query(e) is False         # cudaErrorNotReady
    dev.event_synchronize(e)
    assert dev.event_query(e) is True
    fakes.runtime.busy.add(s)
    e2 = dev.event_record(s)
    dev.stream_synchronize(s)
    assert dev.event_query(e2)
    dev.event_destroy(e)
    dev.event_destroy(e2)


def test_destroyed_events_are_pooled_and_reused(dev, fakes):
    events = [dev.event_record(0) for _ in range(_EVENT_POOL_SIZE + 3)]
    assert fakes.runtime.count("cudaEventCreateWithFlags") == _EVENT_POOL_SIZE + 3
    handles = {e.handle for e in events}
    for e in events:
        dev.event_destroy(e)
    assert fakes.runtime.count("cudaEventDestroy") == 3, "beyond the pool, events are destroyed"
    again = dev.event_record(0)
    assert again.handle in handles and fakes.runtime.count("cudaEventCreateWithFlags") == _EVENT_POOL_SIZE + 3
    with pytest.raises(InvalidArgumentError):
        dev.event_query(events[0])             # the old object is dead even though its handle lives on
    dev.event_destroy(again)


def test_foreign_stream_handles_need_no_create(dev, fakes):
    e = dev.event_record(CUPY_STREAM_PTR)
    assert ("cudaEventRecord", (e.handle, CUPY_STREAM_PTR)) in fakes.runtime.calls
    dev.stream_wait_event(CUPY_STREAM_PTR, e)
    assert fakes.runtime.waits == [(CUPY_STREAM_PTR, e.handle)]
    dev.stream_synchronize(CUPY_STREAM_PTR)
    with pytest.raises(InvalidArgumentError):
        dev.stream_destroy(CUPY_STREAM_PTR)    # not ours to destroy
    dev.event_destroy(e)


def test_bad_events_never_reach_cuda(dev, fakes):
    sim_event = SimDevice(get_profile("h200-141gb")).event_record(0)
    destroyed = dev.event_record(0)
    dev.event_destroy(destroyed)
    mark = len(fakes.runtime.calls)
    for bad in (sim_event, destroyed, Event(dev, 0), None, 5):
        for call in (dev.event_query, dev.event_synchronize, dev.event_destroy):
            with pytest.raises(InvalidArgumentError):
                call(bad)
        with pytest.raises(InvalidArgumentError):
            dev.stream_wait_event(0, bad)
    for bad_stream in (-1, 1.0, "0", True):
        with pytest.raises(InvalidArgumentError):
            dev.event_record(bad_stream)
    assert fakes.runtime.calls[mark:] == []


@pytest.mark.parametrize("call, fail", [
    ("stream_create", "cudaStreamCreateWithFlags"), ("stream_destroy", "cudaStreamDestroy"),
    ("event_record", "cudaEventRecord"), ("event_record_new", "cudaEventCreateWithFlags"),
    ("event_synchronize", "cudaEventSynchronize"), ("stream_synchronize", "cudaStreamSynchronize"),
    ("stream_wait_event", "cudaStreamWaitEvent"),
])
def test_failed_calls_keep_the_record_true(dev, fakes, call, fail):
    s = dev.stream_create()
    e = dev.event_record(s)
    if call != "event_record_new":
        dev.event_destroy(dev.event_record(0))  # one event in the pool
    pool_before = list(dev._event_pool)
    streams_before = set(dev._user_streams)
    fakes.runtime.fail[fail] = "cudaErrorInvalidValue"
    thunk = {
        "stream_create": dev.stream_create, "stream_destroy": lambda: dev.stream_destroy(s),
        "event_record": lambda: dev.event_record(s), "event_record_new": lambda: dev.event_record(s),
        "event_synchronize": lambda: dev.event_synchronize(e), "stream_synchronize": lambda: dev.stream_synchronize(s),
        "stream_wait_event": lambda: dev.stream_wait_event(0, e),
    }[call]
    with pytest.raises(CudaError) as info:
        thunk()
    assert info.value.call == fail and not info.value.injected
    assert dev._event_pool == pool_before, "an event whose record failed goes back to the pool"
    assert dev._user_streams == streams_before
    thunk()                                    # and the call works next time
    dev.check_invariants()


def test_event_query_error_status_raises(dev, fakes):
    e = dev.event_record(0)
    fakes.runtime.query_status[e.handle] = 400
    with pytest.raises(CudaError) as info:
        dev.event_query(e)
    assert info.value.error_name == "cudaErrorInvalidResourceHandle"


def test_a_sticky_error_loses_the_device_and_keeps_the_record(dev, fakes):
    """The H200 scenario's end: the context dies with cudaErrorIllegalAddress; every later call says so."""
    p = dev.malloc(4096)
    e = dev.event_record(0)
    ranges = dev.allocation_ranges()
    fakes.runtime.query_status[e.handle] = 700
    with pytest.raises(DeviceLostError) as info:
        dev.event_query(e)
    assert "cudaErrorIllegalAddress" in str(info.value)
    mark = len(fakes.runtime.calls)
    for call in (lambda: dev.malloc(16), lambda: dev.free(p), lambda: dev.read(p, 1), dev.mem_info,
                 dev.synchronize, dev.stream_create, lambda: dev.event_record(0), lambda: dev.event_query(e),
                 lambda: dev.stream_synchronize(0), lambda: dev.address_reserve(2 * 2**20)):
        with pytest.raises(DeviceLostError):
            call()
    assert fakes.runtime.calls[mark:] == [], "a lost device calls CUDA no more"
    assert dev.allocation_ranges() == ranges
    dev.check_invariants()
    dev.close()                                # calls no CUDA: the context is dead
    assert fakes.runtime.calls[mark:] == []


def test_sticky_error_from_synchronize_loses_the_device(dev, fakes):
    fakes.runtime.fail["cudaDeviceSynchronize"] = "cudaErrorIllegalAddress"
    with pytest.raises(DeviceLostError):
        dev.synchronize()
    with pytest.raises(DeviceLostError):
        dev.malloc(64)


def test_close_destroys_streams_and_pooled_events(fakes):
    dev = fakes.open()
    streams = [dev.stream_create() for _ in range(2)]
    dev.event_destroy(dev.event_record(streams[0]))
    live = dev.event_record(0)
    dev.close()
    assert not fakes.runtime.streams
    assert fakes.runtime.events == {}, "pooled events and the one the caller still holds are destroyed"
    with pytest.raises(DeviceClosedError):
        dev.stream_create()
    with pytest.raises(DeviceClosedError):
        dev.event_query(live)
