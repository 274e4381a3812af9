"""The multi-GPU suite on real GPUs (and the monitor on every device the suite runs on).

Run on a machine with two GPUs::

    python3 -m pytest -p no:cacheprovider tests/managers/test_multi_cuda.py --gpumem-device cuda:0 \
        --gpumem-record "$OUT"

Tests marked ``cuda`` are skipped unless ``--gpumem-device cuda:N`` is given; the two-GPU tests skip
with the number of GPUs found when there are fewer than two. The ``device``-fixture tests also run on
the default simulated profiles.
"""

from __future__ import annotations

import pytest

import gpumem
from gpumem.device import DeviceKind
from gpumem.managers.multi import MultiGpuMemoryManager, MultiGpuOutOfMemoryError
from gpumem.managers.pressure import MemoryPressure, PressureMonitor, SampleSource

MiB = gpumem.MiB
GiB = gpumem.GiB


def test_monitor_samples_every_device_from_the_right_source(device):
    mon = PressureMonitor(device, interval_s=1.0)
    s = mon.poll_once()
    expected = SampleSource.NVML if device.kind is DeviceKind.CUDA else SampleSource.MEM_INFO
    assert s.source is expected
    assert 0 < s.used_nbytes < s.total_nbytes
    assert s.level is MemoryPressure.from_used_fraction(s.used_fraction)
    with mon:
        assert mon.running
    assert not mon.running


def _cuda_count() -> int:
    try:
        from gpumem.cuda.nvml import list_cuda_devices

        return len(list_cuda_devices())
    except Exception:  # noqa: BLE001 - no NVML: count as none
        return 0


@pytest.fixture
def two_gpus():
    n = _cuda_count()
    if n < 2:
        pytest.skip(f"the multi-GPU suite needs 2 CUDA GPUs, found {n}")
    devs = [gpumem.open_device("cuda:0"), gpumem.open_device("cuda:1")]
    yield devs
    for d in devs:
        d.close()


def _pattern(k: int, n: int) -> bytes:
    return bytes((k * 31 + i) % 251 for i in range(n))


@pytest.mark.cuda
def test_two_gpus_place_by_headroom_keep_affinity_and_keep_data(two_gpus):
    with MultiGpuMemoryManager(two_gpus) as multi:
        placed = []
        for k in range(16):
            i, a = multi.allocate_on_best_device(64 * MiB, f"t{k % 4}")
            two_gpus[i].write(a.ptr, _pattern(k, 4096))
            placed.append((k, i, a))
        for k, i, a in placed:
            assert multi.affinity(f"t{k % 4}") == i  # a name stays on its device (64 MiB always fits)
            assert two_gpus[i].read(a.ptr, 4096) == _pattern(k, 4096)
        u0, u1 = multi.manager(0).usable_memory, multi.manager(1).usable_memory
        if abs(u0 - u1) < 64 * MiB:  # equal cards: new names alternate between them
            assert {i for _, i, _ in placed} == {0, 1}
        stats = multi.get_memory_stats()
        assert stats.allocated_nbytes == 16 * 64 * MiB and stats.n_allocations == 16
        for _, _, a in placed:
            multi.deallocate(a)
        assert multi.get_memory_stats().allocated_nbytes == 0


@pytest.mark.cuda
def test_two_gpus_spill_and_refuse_with_every_device_named(two_gpus):
    with MultiGpuMemoryManager(two_gpus) as multi:
        chunk = max(GiB, min(m.usable_memory for m in multi.managers) // 8)
        held = []
        for _ in range(20):  # "big" fills its device, then spills to the other
            i, a = multi.allocate_on_best_device(chunk, "big")
            held.append(a)
            if i != multi.device_of(held[0]):
                break
        assert {multi.device_of(a) for a in held} == {0, 1} and multi.get_memory_stats().spills >= 1
        before = multi.get_memory_stats()
        with pytest.raises(MultiGpuOutOfMemoryError) as info:
            multi.allocate_on_best_device(before.usable_nbytes, "huge")
        assert "device 0 (cuda:0)" in str(info.value) and "device 1 (cuda:1)" in str(info.value)
        assert multi.get_memory_stats().allocated_nbytes == before.allocated_nbytes
        for a in held:
            multi.deallocate(a)


@pytest.mark.cuda
def test_two_gpus_each_monitor_sees_its_own_gpu_through_nvml(two_gpus):
    with MultiGpuMemoryManager(two_gpus) as multi:
        monitors = [PressureMonitor(d, interval_s=0.05, releasers=[multi.manager(k)])
                    for k, d in enumerate(two_gpus)]
        samples = [m.poll_once() for m in monitors]
        assert all(s.source is SampleSource.NVML for s in samples)
        i, a = multi.allocate_on_best_device(4 * GiB)
        after = monitors[i].poll_once()
        assert after.used_nbytes >= samples[i].used_nbytes + 4 * GiB - 64 * MiB
        multi.deallocate(a)
