"""Contract: what a device is (properties, mem_info), synchronize, and its life cycle."""

from __future__ import annotations

import pytest

import gpumem
from gpumem import (
    DeviceClosedError,
    DeviceKind,
    DeviceProperties,
    MemInfo,
    MiB,
    PhysicalHandle,
)


def test_properties_sanity(device):
    props = device.properties()
    assert isinstance(props, DeviceProperties)
    assert isinstance(props.name, str) and props.name.strip()
    assert isinstance(props.total_nbytes, int) and props.total_nbytes > 0
    gran = props.granularity_nbytes
    assert isinstance(gran, int) and gran > 0 and gran & (gran - 1) == 0, gran
    cc = props.compute_capability
    assert isinstance(cc, tuple) and len(cc) == 2 and all(isinstance(x, int) for x in cc), cc
    assert cc[0] >= 1 and cc[1] >= 0
    assert isinstance(props.multiprocessor_count, int) and props.multiprocessor_count > 0
    assert props.memory_bandwidth_gbps > 0
    assert isinstance(props.unified_memory, bool) and isinstance(props.vmm_supported, bool)
    assert device.properties() == props, "properties() must be stable"
    assert device.vmm_supported is props.vmm_supported
    assert device.granularity_nbytes == gran


def test_identity(device, device_spec):
    assert isinstance(device, gpumem.Device)
    assert isinstance(device.kind, DeviceKind)
    assert device.kind.value == device_spec.partition(":")[0]
    assert isinstance(device.spec, str) and device.spec.startswith(device.kind.value + ":")
    assert device.spec in repr(device)


def test_mem_info_bounds(device):
    info = device.mem_info()
    assert isinstance(info, MemInfo)
    assert isinstance(info.free_nbytes, int) and isinstance(info.total_nbytes, int)
    assert 0 <= info.free_nbytes <= info.total_nbytes
    assert info.total_nbytes == device.properties().total_nbytes
    assert info.used_nbytes == info.total_nbytes - info.free_nbytes
    assert str(info)


def test_mem_info_follows_malloc_and_free(device, slack):
    size = 64 * MiB
    before = device.mem_info().free_nbytes
    ptr = device.malloc(size)
    during = device.mem_info().free_nbytes
    device.free(ptr)
    after = device.mem_info().free_nbytes
    assert before - during >= size - slack, (before, during)
    assert abs(after - before) <= slack, (before, after)


@pytest.mark.sim_only
def test_mem_info_exact_on_sim(device):
    before = device.mem_info().free_nbytes
    ptr = device.malloc(64 * MiB)
    assert device.mem_info().free_nbytes == before - 64 * MiB
    device.free(ptr)
    assert device.mem_info().free_nbytes == before


def test_synchronize(device):
    assert device.synchronize() is None
    ptr = device.malloc(4096)
    device.write(ptr, b"x" * 4096)
    device.synchronize()
    assert device.read(ptr, 4096) == b"x" * 4096
    device.free(ptr)


def test_close_is_idempotent(device):
    device.close()
    device.close()
    with pytest.raises(DeviceClosedError):
        device.mem_info()


def test_calls_after_close_raise(device):
    ptr = device.malloc(4096)
    freed = device.malloc(4096)
    device.free(freed)
    vmm = device.vmm_supported
    if vmm:
        gran = device.granularity_nbytes
        va = device.address_reserve(2 * gran)
        handle = device.mem_create(gran)
        device.mem_map(va, gran, handle)
        device.mem_set_access(va, gran)
    device.close()
    calls = {
        "mem_info": lambda: device.mem_info(),
        "malloc": lambda: device.malloc(4096),
        "free": lambda: device.free(ptr),
        "free(freed)": lambda: device.free(freed),
        "write": lambda: device.write(ptr, b"abc"),
        "read": lambda: device.read(ptr, 3),
        "synchronize": lambda: device.synchronize(),
    }
    if vmm:
        calls.update({
            "address_reserve": lambda: device.address_reserve(gran),
            "mem_create": lambda: device.mem_create(gran),
            "mem_map": lambda: device.mem_map(va + gran, gran, handle),
            "mem_set_access": lambda: device.mem_set_access(va, gran),
            "read(mapped)": lambda: device.read(va, 16),
            "mem_unmap": lambda: device.mem_unmap(va, gran),
            "mem_release": lambda: device.mem_release(handle),
            "address_free": lambda: device.address_free(va, 2 * gran),
        })
    wrong = {}
    for name, call in calls.items():
        try:
            call()
        except DeviceClosedError:
            continue
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            wrong[name] = f"{type(exc).__name__}: {exc}"
        else:
            wrong[name] = "no exception"
    assert not wrong, f"calls after close must raise DeviceClosedError: {wrong}"


def test_context_manager_closes(device):
    with gpumem.open_device(device.spec) as other:
        ptr = other.malloc(1 * MiB)
        other.write(ptr, b"context")
        assert other.read(ptr, 7) == b"context"
    with pytest.raises(DeviceClosedError):
        other.malloc(16)
    with pytest.raises(DeviceClosedError):
        other.read(ptr, 7)


@pytest.mark.cuda
def test_close_frees_what_it_holds(device, slack):
    """Another device object on the same GPU: its memory comes back when it is closed."""
    before = device.mem_info().free_nbytes
    other = gpumem.open_device(device.spec)
    try:
        other.malloc(64 * MiB)
        other.malloc(4096)
        if other.vmm_supported:
            other.mem_create(other.granularity_nbytes)
        assert before - device.mem_info().free_nbytes >= 64 * MiB - slack
    finally:
        other.close()
    assert abs(device.mem_info().free_nbytes - before) <= slack


def test_physical_handle_is_a_value():
    h = PhysicalHandle(handle=7, nbytes=2 * MiB)
    assert h == PhysicalHandle(7, 2 * MiB) and hash(h) == hash(PhysicalHandle(7, 2 * MiB))
