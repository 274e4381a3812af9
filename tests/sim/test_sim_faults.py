"""Injected faults: seeded failure rates, failures at given calls, transient errors, a lost device."""

from __future__ import annotations

import pytest

from gpumem import (
    CudaError,
    DeviceLostError,
    InvalidArgumentError,
    MiB,
    OutOfMemoryError,
    TransientDeviceError,
)
from gpumem import open_device
from gpumem.sim import CALL_NAMES, FaultPlan, MemoryEventKind, SimDevice, get_profile

A100 = get_profile("a100-80gb")


def _failing_calls(plan: FaultPlan, seed: int, n: int = 60) -> list[int]:
    dev = SimDevice(A100, faults=plan, seed=seed)
    failed = []
    for i in range(1, n + 1):
        acc = dev.accounting()
        try:
            ptr = dev.malloc(1 * MiB + 1) if i % 3 else dev.mem_create(2 * MiB)
        except OutOfMemoryError as exc:
            assert exc.requested_nbytes in (1 * MiB + 1, 2 * MiB)
            assert dev.accounting() == acc
            failed.append(i)
            continue
        if isinstance(ptr, int):
            dev.free(ptr)
        else:
            dev.mem_release(ptr)
    return failed


def test_failure_rate_is_deterministic_under_a_seed():
    plan = FaultPlan(malloc_failure_rate=0.3)
    first = _failing_calls(plan, seed=7)
    assert first == _failing_calls(plan, seed=7)
    assert 5 < len(first) < 35
    assert _failing_calls(plan, seed=8) != first
    assert _failing_calls(FaultPlan(malloc_failure_rate=1.0), seed=1) == list(range(1, 61))
    assert _failing_calls(FaultPlan(), seed=1) == []


def test_fail_at_given_calls():
    assert _failing_calls(FaultPlan(fail_allocation_calls={1, 4, 5}), seed=0, n=10) == [1, 4, 5]


def test_only_allocation_calls_count():
    dev = SimDevice(A100, faults=FaultPlan(fail_allocation_calls={2}))
    p = dev.malloc(4096)                       # allocation call 1
    dev.write(p, b"x")
    dev.read(p, 1)
    dev.mem_info()
    dev.free(p)
    va = dev.address_reserve(2 * MiB)          # reservations take no memory: not counted
    with pytest.raises(OutOfMemoryError):
        dev.mem_create(2 * MiB)                # allocation call 2
    dev.address_free(va, 2 * MiB)
    assert dev.faults.allocation_calls == 2 and dev.stats.injected_faults == 1


def test_transient_error_then_success_on_retry():
    dev = SimDevice(A100, faults=FaultPlan(transient_error_calls={2}))
    a = dev.malloc(64 * MiB)
    acc = dev.accounting()
    with pytest.raises(TransientDeviceError):
        dev.malloc(64 * MiB)
    assert dev.accounting() == acc
    b = dev.malloc(64 * MiB)  # the retry works
    dev.write(b, b"retry")
    assert dev.read(b, 5) == b"retry"
    dev.free(a)
    dev.free(b)


def test_injected_faults_publish_events():
    dev = SimDevice(A100, faults=FaultPlan(fail_allocation_calls={1}, transient_error_calls={2}))
    seen = []
    dev.subscribe(seen.append)
    for exc in (OutOfMemoryError, TransientDeviceError):
        with pytest.raises(exc):
            dev.malloc(4096)
    injected = [e for e in seen if e.kind is MemoryEventKind.FAULT_INJECTED]
    assert [e.source for e in injected] == ["oom", "transient"]
    assert dev.stats.injected_faults == 2


def test_device_lost_at_a_time():
    dev = SimDevice(A100, faults=FaultPlan(device_lost_at_s=0.01))
    gran = dev.granularity_nbytes
    ptr = dev.malloc(4096)
    dev.write(ptr, b"before")
    va = dev.address_reserve(2 * gran)
    h = dev.mem_create(gran)
    dev.mem_map(va, gran, h)
    dev.mem_set_access(va, gran)
    acc = dev.accounting()
    dev.advance(0.02)
    lost = [e for e in dev.events.history if e.kind is MemoryEventKind.DEVICE_LOST]
    assert len(lost) == 1 and lost[0].time_s == pytest.approx(0.01)
    calls = [
        lambda: dev.mem_info(), lambda: dev.malloc(4096), lambda: dev.free(ptr), lambda: dev.free(0x1234000),
        lambda: dev.write(ptr, b"after"), lambda: dev.read(ptr, 6), lambda: dev.read(ptr, 0),
        lambda: dev.synchronize(), lambda: dev.address_reserve(gran), lambda: dev.mem_create(gran),
        lambda: dev.mem_map(va + gran, gran, h), lambda: dev.mem_set_access(va, gran),
        lambda: dev.mem_unmap(va, gran), lambda: dev.mem_release(h), lambda: dev.address_free(va, 2 * gran),
        lambda: dev.read(va, 4),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(DeviceLostError):
            call()
        assert dev.accounting() == acc, i
    dev.close()
    dev.close()


def test_device_lost_during_a_call():
    """A call whose simulated time runs past the loss fails, and changes nothing."""
    dev = SimDevice(A100, faults=FaultPlan(device_lost_at_s=50e-6))
    acc = dev.accounting()
    with pytest.raises(DeviceLostError):
        dev.malloc(64 * MiB)  # costs 91.8 µs
    assert dev.accounting() == acc and dev.n_allocations == 0


def test_device_lost_on_a_shared_environment_says_when_it_was():
    """Review rv21a: device_lost_at_s counts from the device's creation (its SimPy timeout is relative), so
    on an environment already at t=100 the device is lost at t=105; the error said "lost at t=5.0s",
    a time the device never had."""
    import simpy

    dev = SimDevice(A100, env=simpy.Environment(initial_time=100.0), faults=FaultPlan(device_lost_at_s=5.0))
    dev.advance(4.0)
    dev.mem_info()
    dev.advance(2.0)
    with pytest.raises(DeviceLostError, match=r"lost at t=105\.0 ?s"):
        dev.mem_info()
    lost = [e for e in dev.events.history if e.kind is MemoryEventKind.DEVICE_LOST]
    assert [e.time_s for e in lost] == [105.0]


@pytest.mark.parametrize("kwargs", [
    dict(malloc_failure_rate=-0.1), dict(malloc_failure_rate=1.5), dict(malloc_failure_rate=float("nan")),
    dict(malloc_failure_rate="0.5"), dict(malloc_failure_rate=True), dict(malloc_failure_rate=10**400),
    dict(device_lost_at_s=-1.0), dict(device_lost_at_s=float("nan")), dict(device_lost_at_s=float("inf")),
    dict(device_lost_at_s="5"), dict(device_lost_at_s=True), dict(device_lost_at_s=10**400),
    dict(fail_allocation_calls={"1", "2"}), dict(fail_allocation_calls="12"), dict(fail_allocation_calls={-1, 0}),
    dict(fail_allocation_calls={1.0}), dict(fail_allocation_calls=3), dict(transient_error_calls={0}),
    dict(transient_error_calls={"1"}), dict(transient_error_calls={True}),
], ids=repr)
def test_fault_plan_validation(kwargs):
    """Review of issue 6: text values raised TypeError, NaN was accepted as a loss time, and strings or
    non-positive numbers were accepted as call indices."""
    with pytest.raises(InvalidArgumentError):
        FaultPlan(**kwargs)


def test_spec_refuses_a_nan_or_infinite_loss_time():
    for bad in ("nan", "inf", "-1"):
        with pytest.raises(InvalidArgumentError):
            open_device(f"sim:a100-80gb?lost_at_s={bad}")


def test_fault_plan_values():
    assert not FaultPlan().injects_anything
    assert FaultPlan(malloc_failure_rate=0.1).injects_anything
    assert FaultPlan(transient_error_calls=[3]).transient_error_calls == frozenset({3})
    assert FaultPlan(device_lost_at_s=0.0).injects_anything


# -- faults per call type -------------------------------------------------------------------------------------
def _setup_for(dev: SimDevice, call: str):
    """Prepare state in which ``call`` can succeed; return a thunk making exactly one such call."""
    G = 2 * MiB
    ptr = dev.malloc(4096)
    va = dev.address_reserve(4 * G)
    h = dev.mem_create(G)
    dev.mem_map(va, G, h)
    dev.mem_set_access(va, G)
    spare = dev.address_reserve(2 * G)
    h2 = dev.mem_create(G)
    s = dev.stream_create()
    dev.launch(s, 0.001, [(ptr, 16)])
    e = dev.event_record(s)
    return {
        "malloc": lambda: dev.malloc(4096),
        "free": lambda: dev.free(ptr),
        "address_reserve": lambda: dev.address_reserve(G),
        "address_free": lambda: dev.address_free(spare, 2 * G),
        "mem_create": lambda: dev.mem_create(G),
        "mem_release": lambda: dev.mem_release(h2),
        "mem_map": lambda: dev.mem_map(va + G, G, h2),
        "mem_set_access": lambda: dev.mem_set_access(va, G),
        "mem_unmap": lambda: dev.mem_unmap(va, G),
        "stream_create": lambda: dev.stream_create(),
        "stream_destroy": lambda: dev.stream_destroy(s),
        "event_record": lambda: dev.event_record(s),
        "event_query": lambda: dev.event_query(e),
        "event_synchronize": lambda: dev.event_synchronize(e),
        "event_destroy": lambda: dev.event_destroy(e),
        "stream_synchronize": lambda: dev.stream_synchronize(s),
        "stream_wait_event": lambda: dev.stream_wait_event(0, e),
        "synchronize": lambda: dev.synchronize(),
    }[call]


def _device_state(dev: SimDevice):
    return (dev.accounting(), sorted(dev.allocation_ranges()), sorted(dev.mapping_ranges()), dev.reservation_ranges(),
            sorted(dev._user_streams), [(w.name, w.stream) for w in dev.streams.inflight], dev.streams.tail(0))


@pytest.mark.parametrize("call", CALL_NAMES)
def test_each_call_type_fails_on_purpose_and_changes_nothing(call):
    probe = SimDevice(A100)
    _setup_for(probe, call)
    n_before = probe.stats.calls.get(call, 0)
    # sanitizer off: the setup's kernel may still touch what "free" and "mem_unmap" release
    dev = SimDevice(A100, faults=FaultPlan(fail_calls={call: {n_before + 1}}), sanitizer="off")
    thunk = _setup_for(dev, call)
    before = _device_state(dev)
    expected = OutOfMemoryError if call in ("malloc", "mem_create") else CudaError
    with pytest.raises(expected) as info:
        thunk()
    assert info.value.injected is True and "injected fault" in str(info.value)
    if expected is CudaError:
        assert (info.value.call, info.value.error_name) == (call, "CUDA_ERROR_UNKNOWN")
    assert _device_state(dev) == before
    assert [e.source for e in dev.events.history if e.kind is MemoryEventKind.FAULT_INJECTED] == [call]
    dev.check_invariants()
    thunk()                                   # the next call of the same type succeeds
    dev.check_invariants()


def test_call_failure_rates_are_seeded_and_spec_options_set_them():
    def failures(seed):
        dev = SimDevice(A100, faults=FaultPlan(call_failure_rates={"event_record": 0.5}), seed=seed)
        out = []
        for i in range(40):
            try:
                dev.event_record(0)
            except CudaError:
                out.append(i)
        return out

    assert failures(3) == failures(3) and 5 < len(failures(3)) < 35
    dev = open_device("sim:a100-80gb?fail.mem_unmap=1&fail.malloc=0")
    assert dev.faults.plan.call_failure_rates == {"mem_unmap": 1.0}


@pytest.mark.parametrize("plan", [
    dict(fail_calls={"cudaMalloc": {1}}), dict(fail_calls={"malloc": {0}}), dict(fail_calls={"malloc": {True}}),
    dict(fail_calls={"malloc": 3}), dict(call_failure_rates={"free": 1.5}), dict(call_failure_rates={"write": 0.1}),
    dict(fail_calls={"free": "12"}), dict(fail_calls={"free": {-1}}), dict(fail_calls={"free": {1.5}}),
    dict(fail_calls=[("free", {1})]), dict(fail_calls=5), dict(call_failure_rates={"free": "0.5"}),
    dict(call_failure_rates={"free": float("nan")}), dict(call_failure_rates={"free": True}),
    dict(call_failure_rates=[("free", 0.5)]),
], ids=repr)
def test_bad_call_fault_plans(plan):
    with pytest.raises(InvalidArgumentError):
        FaultPlan(**plan)
    with pytest.raises(InvalidArgumentError):
        open_device("sim:a100-80gb?fail.launch=0.5")
