"""The CuPy hook without a GPU: a fake ``cupy`` module over simulated devices (issue 19).

CuPy calls the installed allocator for every device; the hook must choose the allocator by CuPy's current
device at each call, and hand CuPy the block's size (a multiple of 512 B), as CuPy's own pool does.
"""

from __future__ import annotations

import sys
import threading
import types

import pytest

import gpumem
from gpumem.allocator import CachingAllocator
from gpumem.errors import BackendUnavailableError


class _FakeCuda:
    def __init__(self) -> None:
        self.current = 0
        self.installed = None
        outer = self

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id):
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id

        class OutOfMemoryError(Exception):
            pass

        self.memory = types.SimpleNamespace(UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
                                            OutOfMemoryError=OutOfMemoryError)
        self.runtime = types.SimpleNamespace(getDevice=lambda: outer.current)
        self.Device = lambda i=None: types.SimpleNamespace(id=outer.current if i is None else i)
        self.get_current_stream = lambda: types.SimpleNamespace(ptr=0)
        self.set_allocator = lambda f: setattr(outer, "installed", f)
        self.get_allocator = lambda: outer.installed


@pytest.fixture()
def fake_cupy(monkeypatch):
    cuda = _FakeCuda()
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    return cuda


def _sim_factory(made: list[int]):
    def factory(device_id: int) -> CachingAllocator:
        made.append(device_id)
        return CachingAllocator(gpumem.open_device("sim:t4-16gb"), "gpumem")
    return factory


def test_each_device_gets_its_own_allocator_chosen_at_call_time(fake_cupy):
    from gpumem.cupy_allocator import CupyMalloc

    made: list[int] = []
    malloc = CupyMalloc(_sim_factory(made))
    p0 = malloc(1000)
    fake_cupy.current = 1          # cupy.cuda.Device(1).use()
    p1 = malloc(1000)
    assert (p0.device_id, p1.device_id) == (0, 1) and made == [0, 1]
    assert malloc.allocator(0) is not malloc.allocator(1)
    assert malloc.allocator(1).allocated_nbytes == p1.mem.size
    assert malloc.allocator(0).allocated_nbytes == p0.mem.size


def test_mem_size_is_the_blocks_size_a_multiple_of_512(fake_cupy):
    """CuPy's test_percentile_memory_access read mem.size == 16 where CuPy's pool gives 512."""
    from gpumem.cupy_allocator import CupyMalloc

    malloc = CupyMalloc(_sim_factory([]))
    for n in (1, 16, 511, 513, 4097, 3 << 20):
        p = malloc(n)
        assert p.mem.size >= n and p.mem.size % 512 == 0
        assert p.mem.size == malloc.allocator().block_size(p.ptr)


def test_an_allocator_for_one_device_refuses_another(fake_cupy):
    from gpumem.cupy_allocator import make_malloc

    alloc = CachingAllocator(gpumem.open_device("sim:t4-16gb"), "gpumem")
    malloc = make_malloc(alloc)
    kept = malloc(4096)
    fake_cupy.current = 1
    with pytest.raises(BackendUnavailableError, match="serves CUDA device 0, and CuPy allocated on device 1"):
        malloc(4096)
    assert alloc.allocated_nbytes == kept.mem.size == 4096  # nothing changed on device 0


def test_threads_make_one_allocator_per_device(fake_cupy):
    from gpumem.cupy_allocator import CupyMalloc

    made: list[int] = []
    malloc = CupyMalloc(_sim_factory(made))
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        malloc.allocator(0)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [0]
