"""Contract: malloc/free and moving data in and out of device memory."""

from __future__ import annotations

import array

import numpy as np
import pytest

from gpumem import KiB, MiB

ALIGNMENT_SIZES = [1, 255, 512, 1 * MiB, 1 * MiB + 1, 64 * MiB]


@pytest.mark.parametrize("nbytes", ALIGNMENT_SIZES, ids=str)
def test_malloc_alignment(device, nbytes):
    ptr = device.malloc(nbytes)
    try:
        assert isinstance(ptr, int) and ptr > 0
        assert ptr % 256 == 0, hex(ptr)
    finally:
        device.free(ptr)


def test_live_allocations_do_not_overlap(device):
    sizes = [1, 255, 512, 513, 4 * KiB, 1 * MiB, 1 * MiB + 1, 3 * MiB, 64 * MiB] * 2
    ptrs = [device.malloc(n) for n in sizes]
    try:
        ranges = sorted(zip(ptrs, sizes))
        for (a, na), (b, _) in zip(ranges, ranges[1:]):
            assert a + na <= b, f"[{a:#x}, {a + na:#x}) overlaps {b:#x}"
        assert all(p % 256 == 0 for p in ptrs)
    finally:
        for p in ptrs:
            device.free(p)


def test_malloc_free_many_times(device, slack):
    before = device.mem_info().free_nbytes
    for _ in range(50):
        ptrs = [device.malloc(n) for n in (512, 100 * KiB, 1 * MiB, 5 * MiB)]
        for p in reversed(ptrs):
            device.free(p)
    assert abs(device.mem_info().free_nbytes - before) <= slack


ROUND_TRIP_SIZES = [1, 3, 255, 4096, 65_537, 1 * MiB + 7, 3 * MiB]


@pytest.mark.parametrize("nbytes", ROUND_TRIP_SIZES, ids=str)
def test_write_read_round_trip(device, rng, nbytes):
    capacity = nbytes + 3 * KiB + 5
    ptr = device.malloc(capacity)
    try:
        for offset in (0, (capacity - nbytes) // 2, capacity - nbytes):
            data = rng.randbytes(nbytes)
            device.write(ptr + offset, data)
            assert device.read(ptr + offset, nbytes) == data
    finally:
        device.free(ptr)


def test_partial_overwrite(device, rng):
    ptr = device.malloc(10_000)
    try:
        base = rng.randbytes(10_000)
        patch = rng.randbytes(777)
        device.write(ptr, base)
        device.write(ptr + 1234, patch)
        expected = base[:1234] + patch + base[1234 + 777:]
        assert device.read(ptr, 10_000) == expected
        assert device.read(ptr + 1000, 500) == expected[1000:1500]
    finally:
        device.free(ptr)


def test_allocations_keep_their_own_data(device, rng):
    a, b = device.malloc(4096), device.malloc(4096)
    try:
        da, db = rng.randbytes(4096), rng.randbytes(4096)
        device.write(a, da)
        device.write(b, db)
        device.write(a, db[:100])
        assert device.read(b, 4096) == db
        assert device.read(a, 4096) == db[:100] + da[100:]
    finally:
        device.free(a)
        device.free(b)


def test_bytes_like_inputs(device, rng):
    ptr = device.malloc(1 * MiB)
    try:
        raw = rng.randbytes(1000)
        for data in (raw, bytearray(raw), memoryview(raw), memoryview(bytearray(raw))[10:900],
                     array.array("B", raw), array.array("i", range(250))):
            expected = memoryview(data).tobytes()
            device.write(ptr, data)
            assert device.read(ptr, len(expected)) == expected
    finally:
        device.free(ptr)


def test_numpy_arrays_as_data(device):
    np_rng = np.random.default_rng(1234)
    arrays = [
        np_rng.standard_normal(10_000).astype(np.float32),
        np_rng.integers(-2**15, 2**15, size=(64, 33), dtype=np.int16),
        np.arange(3 * 5 * 7, dtype=np.float64).reshape(3, 5, 7),
        np.frombuffer(b"\x01\x02\x03", dtype=np.uint8),
    ]
    ptr = device.malloc(1 * MiB)
    try:
        for arr in arrays:
            device.write(ptr + 512, arr)
            back = np.frombuffer(device.read(ptr + 512, arr.nbytes), dtype=arr.dtype).reshape(arr.shape)
            np.testing.assert_array_equal(back, arr)
    finally:
        device.free(ptr)


def test_zero_length_write_and_read(device, rng):
    ptr = device.malloc(4096)
    try:
        data = rng.randbytes(4096)
        device.write(ptr, data)
        for empty in (b"", bytearray(), memoryview(b""), np.zeros(0, dtype=np.float32), np.zeros((0, 3))):
            assert device.write(ptr + 100, empty) is None
        assert device.read(ptr, 0) == b""
        assert device.read(ptr + 4096 - 1, 0) == b""
        assert device.read(ptr, 4096) == data
    finally:
        device.free(ptr)


def test_read_returns_bytes(device):
    ptr = device.malloc(64)
    try:
        device.write(ptr, bytearray(b"a" * 64))
        out = device.read(ptr, 64)
        assert type(out) is bytes and out == b"a" * 64
    finally:
        device.free(ptr)
