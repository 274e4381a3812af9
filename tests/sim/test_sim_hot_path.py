"""The device calls' fast paths (Note [The hot path of a device call] in gpumem.device) decide exactly as
the full checks do, and the hand-written value objects (Note [Value objects on the hot path]) behave as the
frozen dataclasses they replace."""

from __future__ import annotations

import copy
import enum
import pickle
from dataclasses import FrozenInstanceError

import pytest

from gpumem import DeviceClosedError, InvalidArgumentError, MiB
from gpumem.device import MemInfo, PhysicalHandle
from gpumem.errors import UnsupportedOperationError
from gpumem.sim import SimDevice, Step, get_profile

H200 = get_profile("h200-141gb")


class _Size(enum.IntEnum):
    TWO_MIB = 2 * MiB


def test_physical_handle_is_an_immutable_value():
    h = PhysicalHandle(7, 2 * MiB)
    assert h == PhysicalHandle(handle=7, nbytes=2 * MiB) and hash(h) == hash(PhysicalHandle(7, 2 * MiB))
    assert h != PhysicalHandle(8, 2 * MiB) and h != (7, 2 * MiB)
    assert repr(h) == "PhysicalHandle(handle=7, nbytes=2097152)"
    with pytest.raises(FrozenInstanceError):
        h.handle = 8  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        del h.nbytes
    assert pickle.loads(pickle.dumps(h)) == h and copy.deepcopy(h) == h and copy.copy(h) == h


def test_mem_info_is_an_immutable_value():
    m = MemInfo(3 * MiB, 8 * MiB)
    assert m == MemInfo(free_nbytes=3 * MiB, total_nbytes=8 * MiB) and hash(m) == hash(MemInfo(3 * MiB, 8 * MiB))
    assert m.used_nbytes == 5 * MiB and str(m).endswith(" free of 8.00 MiB")
    assert repr(m) == f"MemInfo(free_nbytes={3 * MiB}, total_nbytes={8 * MiB})"
    with pytest.raises(FrozenInstanceError):
        m.free_nbytes = 0  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(m)) == m


@pytest.mark.parametrize("bad", [True, 2.0 * MiB, -2 * MiB, 0, 3 * MiB, "2MiB", None])
def test_bad_sizes_are_refused_as_before(bad):
    dev = SimDevice(H200)
    before = dev.accounting()
    with pytest.raises(InvalidArgumentError):
        dev.mem_create(bad)
    va = dev.address_reserve(4 * 2 * MiB)
    h = dev.mem_create(2 * MiB)
    for call in (lambda: dev.mem_map(va, bad, h), lambda: dev.mem_map(bad, 2 * MiB, h),
                 lambda: dev.mem_map(va, 2 * MiB, h, bad if bad != 0 else -1),
                 lambda: dev.mem_set_access(va, bad), lambda: dev.mem_unmap(va, bad),
                 lambda: dev.address_reserve(bad)):
        with pytest.raises(InvalidArgumentError):
            call()
    assert dev.mapping_ranges() == [] and dev.accounting()[2] == before[2] + 1
    assert dev.stats.calls.get("mem_map", 0) == 0, "a refused call is not a device call"


def test_int_subclasses_still_pass_the_full_checks():
    dev = SimDevice(H200)
    va = dev.address_reserve(_Size.TWO_MIB * 4, alignment=_Size.TWO_MIB)
    h = dev.mem_create(_Size.TWO_MIB)
    dev.mem_map(va, _Size.TWO_MIB, h)
    dev.mem_set_access(va, _Size.TWO_MIB)
    dev.write(va, b"ok")
    assert dev.read(va, 2) == b"ok"
    dev.mem_unmap(va, _Size.TWO_MIB)
    dev.mem_release(h)
    dev.address_free(va, _Size.TWO_MIB * 4)


def test_a_closed_device_is_refused_before_the_arguments_are_looked_at():
    dev = SimDevice(H200)
    dev.mem_create(2 * MiB)  # the VMM check has passed once (its result is kept)
    dev.close()
    for call in (lambda: dev.mem_create(True), lambda: dev.mem_map(0, 0, None), lambda: dev.mem_release(None),
                 lambda: dev.mem_set_access(-1, 1), lambda: dev.mem_unmap(0, 0), lambda: dev.address_reserve(1),
                 lambda: dev.address_free(0, 0), lambda: dev.mem_info()):
        with pytest.raises(DeviceClosedError):
            call()


def test_a_device_without_vmm_refuses_every_vmm_call_every_time():
    dev = SimDevice(get_profile("jetson-nano-2gb"))
    for _ in range(2):
        with pytest.raises(UnsupportedOperationError):
            dev.mem_create(2 * MiB)
        with pytest.raises(UnsupportedOperationError):
            dev.address_reserve(2 * MiB)


def test_queued_events_are_counted_and_the_count_returns_to_zero():
    dev = SimDevice(H200, pressure=Step(nbytes=4 * 2**30, at_s=0.001, until_s=1.0))
    seen = []
    dev.subscribe(seen.append)
    with dev.deferred_events():
        dev.advance(0.002)
        assert dev._queued_events == 1 and seen == []
    assert [ev.kind.value for ev in seen] == ["tenant_took"] and dev._queued_events == 0
    dev.advance(1.0)  # the tenant gives back, published and delivered within the call
    assert [ev.kind.value for ev in seen] == ["tenant_took", "tenant_returned"] and dev._queued_events == 0
