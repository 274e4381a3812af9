"""Streams, events and the memory sanitizer of the simulated GPU.

The regression scenario of issue 6: on an H200, a kernel reading a mapped page followed at
once by ``cuMemUnmap`` returns success and kills the context at the next synchronize. The
simulator refuses the unmap (``MemoryHazardError``, nothing changed) until the kernel's
event has completed.
"""

from __future__ import annotations

import logging
import math

import pytest

from gpumem import (
    CudaError,
    DeviceLostError,
    GiB,
    InvalidArgumentError,
    InvalidPointerError,
    MemoryHazardError,
    MiB,
    open_device,
)
from gpumem.sim import FaultPlan, SimDevice, Step, get_profile

A100 = get_profile("a100-80gb")
G = 2 * MiB
KERNEL_S = 0.010


def _state(dev: SimDevice):
    """Everything a failed call must leave as it was."""
    return (dev.accounting(), sorted(dev.allocation_ranges()), sorted(dev.mapping_ranges()),
            dev.reservation_ranges(), [(w.name, w.state) for w in dev.streams.inflight], sorted(dev._user_streams))


def _mapped(dev: SimDevice, n_gran: int = 1):
    va = dev.address_reserve(4 * G)
    h = dev.mem_create(n_gran * G)
    dev.mem_map(va, n_gran * G, h)
    dev.mem_set_access(va, n_gran * G)
    return va, h


def test_unmap_under_running_kernel_is_a_hazard_until_its_event_completes():
    dev = SimDevice(A100)
    va, h = _mapped(dev)
    dev.write(va, b"payload")
    t0 = dev.now_s
    work = dev.launch(0, KERNEL_S, [(va, 4096)], name="reader")
    done = dev.event_record(0)
    before = _state(dev)
    with pytest.raises(MemoryHazardError) as info:
        dev.mem_unmap(va, G)
    err = info.value
    assert (err.call, err.stream, err.va, err.nbytes, err.work) == ("mem_unmap", 0, va, G, "reader")
    assert "reader" in str(err) and "stream 0" in str(err)
    assert _state(dev) == before
    assert dev.read(va, 7) == b"payload"
    assert not dev.event_query(done) and work.state_name == "running"
    dev.event_synchronize(done)
    assert work.done and dev.event_query(done)
    assert dev.now_s >= t0 + KERNEL_S
    dev.mem_unmap(va, G)
    dev.mem_release(h)
    assert dev.mapping_ranges() == []


@pytest.mark.parametrize("nbytes", [4096, 3 * MiB + 5], ids=["small", "large"])
def test_free_under_queued_kernel_is_a_hazard(nbytes):
    dev = SimDevice(A100)
    ptr = dev.malloc(nbytes)
    dev.launch(5, KERNEL_S, [(ptr + nbytes - 16, 16)], name="tail-writer")
    dev.launch(5, KERNEL_S, [(ptr, 8)], name="queued")     # queued behind the first
    before = _state(dev)
    with pytest.raises(MemoryHazardError) as info:
        dev.free(ptr)
    assert info.value.call == "free" and info.value.stream == 5
    assert _state(dev) == before
    dev.stream_synchronize(5)
    assert dev.now_s >= 2 * KERNEL_S
    dev.free(ptr)
    assert dev.allocation_ranges() == []


def test_release_of_a_mapped_chunk_under_work_is_not_a_hazard_but_the_unmap_is():
    dev = SimDevice(A100)
    va, h = _mapped(dev)
    e = dev.event_record(0)
    assert dev.event_query(e), "an event on an idle stream is complete at once"
    dev.launch(0, KERNEL_S, [(va, G)])
    dev.mem_release(h)                      # memory stays until unmapped
    with pytest.raises(MemoryHazardError):
        dev.mem_unmap(va, G)
    dev.synchronize()
    dev.mem_unmap(va, G)
    assert dev.accounting()[2] == 0


def test_launch_on_memory_not_allocated_or_not_accessible_is_a_hazard():
    dev = SimDevice(A100)
    va = dev.address_reserve(4 * G)
    h = dev.mem_create(G)
    dev.mem_map(va, G, h)                   # mapped, no access yet
    ptr = dev.malloc(4096)
    before = _state(dev)
    for touch in [(va, 16), (va + G, 16), (ptr + 4090, 16), (0x1000, 8)]:
        with pytest.raises(MemoryHazardError) as info:
            dev.launch(3, KERNEL_S, [(ptr, 16), touch], name="bad")
        assert info.value.call == "launch" and info.value.work == "bad" and info.value.va == touch[0]
        assert _state(dev) == before
    assert dev.streams.tail(3) is None, "nothing was queued"


def test_count_mode_records_hazards_and_lets_calls_proceed():
    dev = open_device("sim:a100-80gb?sanitizer=count")
    ptr = dev.malloc(4096)
    dev.launch(0, KERNEL_S, [(ptr, 4096)], name="k")
    dev.free(ptr)
    dev.launch(0, KERNEL_S, [(ptr, 16)], name="after-free")
    assert [(hz.call, hz.work) for hz in dev.hazards] == [("free", "k"), ("launch", "after-free")]
    assert dev.allocation_ranges() == []
    assert open_device("sim:a100-80gb", sanitizer="off").sanitizer == "off"
    with pytest.raises(InvalidArgumentError):
        open_device("sim:a100-80gb?sanitizer=loud")


def test_work_runs_in_fifo_order_per_stream_and_streams_overlap():
    dev = SimDevice(A100)
    a1 = dev.launch(1, 0.004)
    a2 = dev.launch(1, 0.004)
    b1 = dev.launch(2, 0.006)
    dev.synchronize()
    assert a2.start_s == pytest.approx(a1.end_s)
    assert b1.start_s < a1.end_s, "different streams run at the same time"
    assert dev.now_s == pytest.approx(max(a2.end_s, b1.end_s), abs=1e-4)


def test_stream_wait_event_orders_work_across_streams():
    dev = SimDevice(A100)
    first = dev.launch(1, 0.005)
    e = dev.event_record(1)
    dev.stream_wait_event(2, e)
    second = dev.launch(2, 0.001)
    e2 = dev.event_record(2)
    assert not dev.event_query(e2)
    dev.event_synchronize(e2)
    assert second.start_s >= first.end_s
    # waiting on a completed event queues nothing
    dev.stream_wait_event(3, e)
    assert dev.streams.tail(3) is None


def test_time_passes_only_through_calls_so_kernels_stay_in_flight():
    dev = SimDevice(A100)
    ptr = dev.malloc(4096)
    work = dev.launch(0, KERNEL_S, [(ptr, 64)])
    for _ in range(200):
        dev.free(dev.malloc(3 * MiB))       # ~200 x 150 us = 30 ms of calls
        if work.done:
            break
    assert work.done, "calls advance simulated time"
    e = dev.event_record(0)
    assert dev.event_query(e)


def test_foreign_stream_ids_need_no_create_and_create_skips_them():
    dev = SimDevice(A100)
    dev.launch(1, 0.001)
    s = dev.stream_create()
    assert s != 1 and s > 0
    dev.stream_destroy(s)
    with pytest.raises(InvalidArgumentError):
        dev.stream_destroy(s)
    with pytest.raises(InvalidArgumentError):
        dev.stream_destroy(1)               # foreign: not made by stream_create
    with pytest.raises(InvalidArgumentError):
        dev.stream_destroy(0)


def test_destroyed_stream_still_finishes_its_work():
    dev = SimDevice(A100)
    s = dev.stream_create()
    work = dev.launch(s, 0.002)
    dev.stream_destroy(s)
    dev.synchronize()
    assert work.done


@pytest.mark.parametrize("bad", [
    dict(duration_s=-1.0), dict(duration_s=float("inf")), dict(duration_s=float("nan")), dict(duration_s="1"),
    dict(duration_s=10**400), dict(duration_s=True), dict(duration_s=None),
    dict(touches=[(1,)]), dict(touches=[(0, 16)]), dict(touches=[(4096, 0)]), dict(touches=5),
    dict(touches=[(4096.0, 16)]), dict(stream=-1), dict(stream=True), dict(name=3),
], ids=repr)
def test_launch_bad_arguments(bad):
    dev = SimDevice(A100)
    ptr = dev.malloc(4096)
    args = dict(stream=0, duration_s=0.001, touches=[(ptr, 16)], name=None) | bad
    before = _state(dev)
    with pytest.raises(InvalidArgumentError):
        dev.launch(**args)
    assert _state(dev) == before


@pytest.mark.parametrize("bad", [-1, -0.5, float("inf"), float("-inf"), float("nan"), 10**400, True, "1", None],
                         ids=repr)
def test_advance_bad_durations(bad):
    dev = SimDevice(A100)
    dev.launch(0, 1.0)
    before = (_state(dev), dev.now_s, dev.streams.pending_s)
    with pytest.raises(InvalidArgumentError, match="finite number of seconds"):
        dev.advance(bad)
    assert (_state(dev), dev.now_s, dev.streams.pending_s) == before


def test_the_clock_never_reaches_infinity():
    """Review of issue 6: advance(1.7e308) twice, or two such kernels, made the clock inf, and every
    later call raised SimPy's ValueError for ever."""
    dev = SimDevice(A100)
    ptr = dev.malloc(4096)
    dev.advance(1.7e308)
    t = dev.now_s
    with pytest.raises(InvalidArgumentError, match="largest finite time"):
        dev.advance(1.7e308)
    assert dev.now_s == t
    with pytest.raises(InvalidArgumentError, match="largest finite time"):
        dev.launch(0, 1.7e308)
    assert dev.streams.n_busy_streams == 0
    dev.free(ptr)                            # the device still works
    dev.synchronize()

    dev = SimDevice(A100)
    dev.launch(0, 1.7e308)
    before = (_state(dev), dev.now_s, dev.streams.pending_s)
    with pytest.raises(InvalidArgumentError, match="largest finite time"):
        dev.launch(1, 1.7e308)               # could run after the first (stream_wait_event): refused too
    assert (_state(dev), dev.now_s, dev.streams.pending_s) == before
    dev.synchronize()
    assert math.isfinite(dev.now_s) and dev.streams.pending_s == 0.0
    dev.mem_info()


@pytest.mark.parametrize("sanitizer", ["raise", "count"])
def test_close_waits_for_queued_work_before_freeing(sanitizer):
    """Review of issue 6: close() freed and unmapped memory that running work touched, and the work
    stayed queued for ever."""
    dev = SimDevice(A100, sanitizer=sanitizer)
    ptr = dev.malloc(8 * MiB)
    va, h = _mapped(dev)
    w1 = dev.launch(0, 0.050, [(ptr, 8 * MiB)], name="reads ptr")
    w2 = dev.launch(1, 0.050, [(va, G)], name="reads the mapping")
    e = dev.event_record(1)
    dev.stream_wait_event(2, e)
    w3 = dev.launch(2, 0.020, [(ptr, 16)], name="after the mapping's reader")
    dev.close()
    assert (w1.state_name, w2.state_name, w3.state_name) == ("done", "done", "done")
    assert w3.end_s == pytest.approx(w2.end_s + 0.020) and dev.now_s >= w3.end_s
    assert dev.streams.inflight == [] and dev.streams.n_busy_streams == 0 and dev.hazards == []
    assert dev.accounting() == (0, 0, 0)


def test_close_of_a_lost_device_does_not_wait():
    dev = SimDevice(A100, faults=FaultPlan(device_lost_at_s=0.010))
    ptr = dev.malloc(4096)
    dev.launch(0, 1e6, [(ptr, 16)])
    dev.advance(0.020)
    dev.close()
    assert dev.now_s < 1.0 and dev.closed


def test_count_mode_records_a_hazard_only_for_a_call_that_went_ahead():
    """Review of issue 6: in count mode a free that then failed by an injected fault recorded its hazard,
    and the retry recorded it again."""
    dev = SimDevice(A100, sanitizer="count", faults=FaultPlan(fail_calls={"free": {1}, "mem_unmap": {1}}))
    ptr = dev.malloc(4 * MiB)
    va, h = _mapped(dev)
    dev.launch(0, 1.0, [(ptr, 1), (va, 1)])
    before = _state(dev)[:4]             # the work starts meanwhile: time passes
    with pytest.raises(CudaError) as err:
        dev.free(ptr)
    assert err.value.injected and dev.hazards == [] and _state(dev)[:4] == before
    with pytest.raises(CudaError):
        dev.mem_unmap(va, G)
    assert dev.hazards == [] and _state(dev)[:4] == before
    dev.free(ptr)
    dev.mem_unmap(va, G)
    assert [(hz.call, hz.va) for hz in dev.hazards] == [("free", ptr), ("mem_unmap", va)]


def test_count_mode_records_no_hazard_for_a_launch_on_a_lost_device():
    dev = SimDevice(A100, sanitizer="count", faults=FaultPlan(device_lost_at_s=0.001))
    ptr = dev.malloc(4096)
    dev.free(ptr)
    dev.advance(0.002)
    with pytest.raises(DeviceLostError):
        dev.launch(0, 0.001, [(ptr, 16)])
    assert dev.hazards == []


def test_every_call_raises_device_lost_after_a_loss():
    dev = SimDevice(A100, faults=FaultPlan(device_lost_at_s=0.001))
    ptr = dev.malloc(4096)
    va, h = _mapped(dev)
    e = dev.event_record(0)
    destroyed = dev.event_record(0)
    dev.event_destroy(destroyed)
    foreign = SimDevice(A100).event_record(0)
    s = dev.stream_create()
    dev.launch(0, 0.005)                     # the loss happens while this runs
    with pytest.raises(DeviceLostError):
        dev.synchronize()
    calls = [
        lambda: dev.malloc(16), lambda: dev.free(ptr), lambda: dev.mem_info(), lambda: dev.read(ptr, 1),
        lambda: dev.write(ptr, b"x"), lambda: dev.address_reserve(G), lambda: dev.address_free(va, 4 * G),
        lambda: dev.mem_create(G), lambda: dev.mem_release(h), lambda: dev.mem_map(va + G, G, h),
        lambda: dev.mem_set_access(va, G), lambda: dev.mem_unmap(va, G), lambda: dev.synchronize(),
        lambda: dev.stream_create(), lambda: dev.stream_destroy(s), lambda: dev.event_record(0),
        lambda: dev.event_query(e), lambda: dev.event_synchronize(e), lambda: dev.event_destroy(e),
        lambda: dev.stream_synchronize(0), lambda: dev.stream_wait_event(s, e), lambda: dev.launch(0, 0.001),
        # review of issue 6: lookups that depend on the device's state came before the loss check, and
        # the simulator's own calls that act on the device did not check at all
        lambda: dev.stream_destroy(77), lambda: dev.event_query(destroyed), lambda: dev.event_query(foreign),
        lambda: dev.event_synchronize(destroyed), lambda: dev.event_destroy(foreign),
        lambda: dev.stream_wait_event(0, destroyed), lambda: dev.advance(1.0), lambda: dev.advance(0),
        lambda: dev.watch_free_level(GiB), lambda: dev.add_tenant(Step(nbytes=G, at_s=0.0, until_s=1.0)),
    ]
    t = dev.now_s
    for call in calls:
        before = _state(dev)
        with pytest.raises(DeviceLostError):
            call()
        assert _state(dev) == before
    assert dev.now_s == t and not dev._tenants
    # argument TYPE errors still come first, as on a closed device (Note [Validation before any device call])
    with pytest.raises(InvalidArgumentError):
        dev.event_query("not an event")
    with pytest.raises(InvalidArgumentError):
        dev.stream_destroy(-1)
    with pytest.raises(InvalidArgumentError):
        dev.advance(float("nan"))
    sub = dev.subscribe(print)               # allowed: host-side bookkeeping
    sub.cancel()
    dev.check_invariants()
    dev.close()


def test_subscriber_sees_events_only_after_the_call_returned_and_may_reenter():
    dev = SimDevice(A100, pressure=Step(nbytes=4 * G, at_s=0.004, until_s=1.0))
    ptr = dev.malloc(4096)
    work = dev.launch(0, KERNEL_S, [(ptr, 16)])
    e = dev.event_record(0)
    seen = []

    def on_event(ev):
        # delivered inside event_synchronize this would see the kernel still running at t=4 ms
        seen.append((ev.kind.value, work.done, dev.now_s))
        p = dev.malloc(4096)                 # re-entering the device from a callback is safe
        dev.write(p, b"ok")
        dev.free(p)

    dev.subscribe(on_event)
    dev.event_synchronize(e)
    assert seen and seen[0][0] == "tenant_took"
    assert all(done for _, done, _ in seen)
    assert all(t >= KERNEL_S for _, _, t in seen)


def test_deferred_events_deliver_when_the_outermost_block_exits():
    dev = SimDevice(A100, pressure=Step(nbytes=4 * G, at_s=0.001, until_s=1.0))
    seen = []
    dev.subscribe(seen.append)
    with dev.deferred_events():
        with dev.deferred_events():
            dev.advance(0.002)
        assert seen == [], "the inner block is not the outermost"
    assert [ev.kind.value for ev in seen] == ["tenant_took"]


def test_a_deferred_events_block_is_entered_once():
    """Entering one deferred_events() object twice lost the first entry's depth, and events on that thread queued
    for good (attacker 28, once it was a class): the second entry raises, the depth and delivery unchanged."""
    dev = SimDevice(A100, pressure=Step(nbytes=4 * G, at_s=0.001, until_s=1.0))
    seen = []
    dev.subscribe(seen.append)
    block = dev.deferred_events()
    with block:
        with pytest.raises(RuntimeError, match="entered already"):
            block.__enter__()
        dev.advance(0.002)
        assert seen == []
    assert [ev.kind.value for ev in seen] == ["tenant_took"]
    assert dev._tls.depth == 0
    with pytest.raises(RuntimeError, match="entered already"):
        with block:
            pass
    assert dev._tls.depth == 0


def test_event_calls_cost_little_simulated_time():
    dev = SimDevice(A100)
    t0 = dev.now_s
    for _ in range(100):
        dev.event_destroy(dev.event_record(0))
    per_pair_us = (dev.now_s - t0) / 100 * 1e6
    assert per_pair_us == pytest.approx(dev.latency.event_record_us + dev.latency.event_destroy_us)
    assert per_pair_us < 2.5  # about a microsecond each, as measured on the H200 (Note [Latency calibration])


def test_idle_streams_are_forgotten_so_ten_thousand_streams_cost_nothing_after():
    dev = SimDevice(A100)
    ptr = dev.malloc(4096)
    for stream in range(1, 10_001):
        dev.launch(stream * 16, 1.0, [(ptr, 8)])
        dev.event_destroy(dev.event_record(stream * 16))
    assert dev.streams.n_busy_streams > 0
    dev.synchronize()
    assert dev.streams.n_busy_streams == 0 and dev.streams.inflight == []
    dev.free(ptr)


def test_events_published_on_a_thread_are_delivered_on_that_thread_after_its_call():
    import threading

    dev = SimDevice(A100, pressure=Step(nbytes=4 * G, at_s=0.001, until_s=1.0))
    delivered_on = []
    dev.subscribe(lambda ev: delivered_on.append(threading.current_thread().name))
    with dev.deferred_events():              # this thread defers; the other thread's call does not wait for it
        t = threading.Thread(target=dev.advance, args=(0.002,), name="mover")
        t.start()
        t.join()
        assert delivered_on == ["mover"], "the thread whose call published the event delivers it"


def test_a_failing_subscriber_is_logged_and_never_breaks_the_call(caplog):
    """Review of issue 6: a subscriber's exception replaced the result of the call that published the
    event, so a malloc crossing a watched level raised while the device held the allocation."""
    dev = SimDevice(A100)
    dev.watch_free_level(70 * GiB)
    calls = []

    def bad(ev):
        calls.append(ev.kind.value)
        raise RuntimeError("subscriber bug")

    dev.subscribe(bad)
    dev.subscribe(lambda ev: calls.append("second saw " + ev.kind.value))
    with caplog.at_level(logging.ERROR, logger="gpumem.events"):
        ptr = dev.malloc(20 * GiB)           # crosses the level: FREE_BELOW
    assert dev.allocation_ranges() == [(ptr, 20 * GiB)], "the call returned what the device holds"
    assert calls == ["free_below", "second saw free_below"], "every subscriber got the event"
    [record] = [r for r in caplog.records if "subscriber" in r.getMessage()]
    assert "bad" in record.getMessage() and "free_below" in record.getMessage() and record.exc_info
    dev.free(ptr)                            # crosses back: FREE_ABOVE, the subscriber raises again
    assert dev.allocation_ranges() == [] and calls[-2:] == ["free_above", "second saw free_above"]
    with pytest.raises(InvalidPointerError):  # the free happened once: a retry is a double free
        dev.free(ptr)


def test_a_failing_subscriber_inside_deferred_events_does_not_raise_at_the_block_exit():
    dev = SimDevice(A100, pressure=Step(nbytes=4 * G, at_s=0.001, until_s=1.0))
    dev.subscribe(lambda ev: 1 / 0)
    with dev.deferred_events():
        dev.advance(0.002)
        ptr = dev.malloc(4096)
    assert dev.allocation_ranges() == [(ptr, 4096)]


def test_a_base_exception_from_a_subscriber_propagates_and_drops_the_queued_events():
    """Review of issue 6: after a KeyboardInterrupt from a subscriber, the events queued behind it were
    delivered later, inside an unrelated call."""
    dev = SimDevice(A100)
    dev.watch_free_level(70 * GiB)
    dev.watch_free_level(60 * GiB)
    seen = []

    def interrupt_once(ev):
        seen.append(ev.level_nbytes)
        if len(seen) == 1:
            raise KeyboardInterrupt

    dev.subscribe(interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        dev.malloc(30 * GiB)                 # crosses both levels: two FREE_BELOW events
    assert seen == [70 * GiB]
    assert dev.accounting()[2] == 1 and dev.process_used_nbytes == 30 * GiB, "the malloc took effect"
    dev.mem_info()
    dev.check_invariants()
    assert seen == [70 * GiB], "the dropped event is not delivered inside a later call"
    ptr = dev.allocation_ranges()[0][0]
    dev.free(ptr)                            # delivery works again afterwards
    assert seen == [70 * GiB, 70 * GiB, 60 * GiB]


def _aliased(dev: SimDevice):
    """One chunk mapped at two addresses (what a stream-ordered steal makes: the old mapping waits for its work)."""
    va, h = _mapped(dev)
    va2 = dev.address_reserve(4 * G)
    dev.mem_map(va2, G, h)
    dev.mem_set_access(va2, G)
    return va, va2


def test_work_beside_other_work_on_the_same_physical_bytes_is_an_alias():
    """Note [Physical aliasing] in gpumem.sim.streams: the unmap and free checks see addresses only; a chunk
    mapped again elsewhere while its old work runs is caught when new work of another stream starts on it."""
    dev = SimDevice(A100, sanitizer="count")
    va, va2 = _aliased(dev)
    dev.launch(0, KERNEL_S, [(va + 4096, 8192)], name="old")
    dev.launch(1, 0.001, [(va2, 4096)], name="apart")   # other bytes of the chunk: no alias
    dev.launch(2, 0.001, [(va2 + 8192, 4096)], name="new")
    dev.synchronize()
    assert [(h.call, h.stream, h.va, h.nbytes, h.work) for h in dev.hazards] == [("alias", 2, va2 + 8192, 4096, "new")]
    assert "'old' on stream 0" in dev.hazards[0].message


def test_an_alias_raises_from_the_next_call_once_and_changes_nothing():
    dev = SimDevice(A100)
    va, va2 = _aliased(dev)
    dev.launch(0, KERNEL_S, [(va, G)], name="old")
    dev.launch(1, 0.001, [(va2, 4096)], name="new")   # may run beside "old": seen at its launch
    before = _state(dev)
    with pytest.raises(MemoryHazardError) as info:
        dev.launch(1, 0.001, [(va2, 4096)], name="later")
    assert (info.value.call, info.value.stream, info.value.work) == ("alias", 1, "new")
    assert _state(dev) == before and len(dev.hazards) == 1
    dev.synchronize()   # raised once


@pytest.mark.parametrize("call", ["mem_info", "malloc", "event_record", "mem_create", "stream_synchronize"])
def test_an_alias_raises_from_a_fast_path_call_too(call):
    """The calls whose fast path skips the checks of a usable device (attacker review of 2026-12-04: the alias waited
    for a launch or a synchronize, and was blamed on it)."""
    dev = SimDevice(A100)
    va, va2 = _aliased(dev)
    dev.launch(0, KERNEL_S, [(va, G)], name="old")
    dev.launch(1, 0.001, [(va2, 4096)], name="new")
    before = _state(dev)
    args = {"malloc": (4096,), "event_record": (0,), "mem_create": (G,), "stream_synchronize": (0,)}.get(call, ())
    with pytest.raises(MemoryHazardError) as info:
        getattr(dev, call)(*args)
    assert info.value.call == "alias" and _state(dev) == before
    getattr(dev, call)(*args)   # raised once


def test_an_alias_no_call_raised_is_logged_at_close(caplog):
    dev = SimDevice(A100)
    va, va2 = _aliased(dev)
    dev.launch(0, KERNEL_S, [(va, G)], name="old")
    dev.launch(1, 0.001, [(va2, 4096)], name="new")
    with caplog.at_level("WARNING", logger="gpumem.sim.device"):
        dev.close()
    assert "closed with an error no call raised" in caplog.text and dev.hazards


@pytest.mark.parametrize("where", ["old behind other work", "new behind other work"])
def test_unordered_work_is_an_alias_whatever_the_clock_does(where):
    """Attacker review of 2026-12-04: the first version compared running times, so a user queued behind other work
    (which started after the old work ended, in simulated time) passed; on a card nothing orders the two."""
    dev = SimDevice(A100, sanitizer="count")
    va, va2 = _aliased(dev)
    if where == "old behind other work":
        dev.launch(0, 2 * KERNEL_S, name="unrelated")
    dev.launch(0, KERNEL_S, [(va, G)], name="old")
    if where == "new behind other work":
        dev.launch(1, 2 * KERNEL_S, name="unrelated")
    new = dev.launch(1, 0.001, [(va2, 4096)], name="new")
    dev.synchronize()
    assert [(h.call, h.work) for h in dev.hazards] == [("alias", "new")]
    assert where != "new behind other work" or new.start_s >= KERNEL_S   # it never ran beside "old"


def test_work_ordered_through_a_chain_of_waits_is_no_alias():
    """Vector clocks: stream 2 waits for stream 1, which waited for stream 0's queued "old"; and order_streams."""
    dev = SimDevice(A100, sanitizer="count")
    va, va2 = _aliased(dev)
    dev.launch(0, KERNEL_S, name="before")
    dev.launch(0, KERNEL_S, [(va, G)], name="old")
    dev.stream_wait_event(1, dev.event_record(0))
    dev.launch(1, 0.001, name="between")
    dev.stream_wait_event(2, dev.event_record(1))
    dev.launch(2, 0.001, [(va2, G)], name="ordered")
    dev.synchronize()   # (else "old again" would be unordered against "ordered", still queued: an alias)
    dev.launch(3, KERNEL_S, [(va, G)], name="old again")
    dev.order_streams(4, 3)
    dev.launch(4, 0.001, [(va2, G)], name="ordered too")
    dev.synchronize()
    assert not dev.hazards


def test_zero_length_work_beside_other_work_is_an_alias_too():
    dev = SimDevice(A100, sanitizer="count")
    va, va2 = _aliased(dev)
    dev.launch(0, KERNEL_S, [(va, G)], name="old")
    dev.launch(1, 0.0, [(va2, 4096)], name="instant")
    dev.synchronize()
    assert [(h.call, h.work) for h in dev.hazards] == [("alias", "instant")]


def test_ordered_or_same_address_or_same_stream_work_is_no_alias():
    dev = SimDevice(A100)
    va, va2 = _aliased(dev)
    dev.launch(0, KERNEL_S, [(va, G)], name="first")
    dev.launch(2, KERNEL_S, [(va, G)], name="same address")   # the program's own sharing of a block
    dev.synchronize()
    old = dev.launch(0, KERNEL_S, [(va, G)], name="old")
    dev.launch(0, 0.001, [(va2, G)], name="same stream")   # runs after "old"
    e = dev.event_record(0)
    dev.stream_wait_event(1, e)
    new = dev.launch(1, 0.001, [(va2, G)], name="ordered")
    dev.synchronize()
    assert new.start_s >= old.end_s and not dev.hazards
    # work that ends as the other starts does not run beside it
    dev.launch(3, KERNEL_S, [(va, G)])
    dev.advance(KERNEL_S)
    dev.launch(4, KERNEL_S, [(va2, G)])
    dev.synchronize()
    assert not dev.hazards
