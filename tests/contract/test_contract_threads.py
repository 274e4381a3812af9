"""Contract: a device shared by threads loses no write and raises nothing spurious.

Issue 6: the simulated device's ``write`` could drop a concurrent write (two threads
materialising the same 64 KiB chunk) and ``Reservation.covering`` could index a list
another thread was changing. A tiny switch interval makes such races likely.
"""

from __future__ import annotations

import random
import sys
import threading

from gpumem import MiB

N_THREADS = 8


def _run_threads(target) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=guarded, args=(i,)) for i in range(N_THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    return errors


def test_threads_writing_one_allocation_lose_no_write(device):
    slice_nbytes = 512
    rounds = 20
    ptr = device.malloc(N_THREADS * slice_nbytes * rounds)  # slices interleave within the same chunks

    def work(i: int) -> None:
        rng = random.Random(i)
        for r in range(rounds):
            at = ptr + (r * N_THREADS + i) * slice_nbytes
            data = rng.randbytes(slice_nbytes)
            device.write(at, data)
            assert device.read(at, slice_nbytes) == data

    assert _run_threads(work) == []
    for i in range(N_THREADS):
        rng = random.Random(i)
        for r in range(rounds):
            at = ptr + (r * N_THREADS + i) * slice_nbytes
            assert device.read(at, slice_nbytes) == rng.randbytes(slice_nbytes), (i, r)
    device.free(ptr)


def test_threads_allocating_mapping_and_recording_events(device):
    gran = device.granularity_nbytes

    def work(i: int) -> None:
        rng = random.Random(100 + i)
        s = device.stream_create()
        for _ in range(10):
            n = rng.choice([700, 64 * 1024, 3 * MiB])
            p = device.malloc(n)
            data = rng.randbytes(min(n, 4096))
            device.write(p + n - len(data), data)
            e = device.event_record(s)
            assert device.read(p + n - len(data), len(data)) == data
            device.event_synchronize(e)
            device.event_destroy(e)
            device.free(p)
            if device.vmm_supported:
                va = device.address_reserve(2 * gran)
                h = device.mem_create(gran)
                device.mem_map(va, gran, h)
                device.mem_set_access(va, gran)
                device.write(va + 100, data[:64])
                assert device.read(va + 100, len(data[:64])) == data[:64]
                device.mem_unmap(va, gran)
                device.mem_release(h)
                device.address_free(va, 2 * gran)
        device.stream_destroy(s)

    before = device.mem_info().free_nbytes
    assert _run_threads(work) == []
    device.synchronize()
    if device.kind.value == "sim":
        assert device.mem_info().free_nbytes == before
        assert device.allocation_ranges() == [] and device.mapping_ranges() == []
