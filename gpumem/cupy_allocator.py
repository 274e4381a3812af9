"""Make CuPy allocate through a gpumem :class:`~gpumem.allocator.CachingAllocator`.

One line::

    import gpumem.cupy_allocator as gca
    allocator = gca.install()          # every CuPy array now lives in gpumem's allocator

or, scoped (the previous CuPy allocator comes back on exit)::

    with gca.using(policy="gpumem") as allocator:
        x = cupy.arange(10**8)
        print(allocator.memory_summary())

CuPy calls the installed function with a byte count and expects a
``cupy.cuda.MemoryPointer``; gpumem hands it an ``UnownedMemory`` whose *owner*
returns the block to the allocator when CuPy drops the last reference, so the
block is freed exactly when CuPy would have freed its own. Blocks are allocated on
CuPy's current stream (its handle is the stream id), so gpumem never hands a
block freed on one stream to another (Note [Streams] in
:mod:`gpumem.allocator.caching`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

from .allocator import CachingAllocator
from .allocator.policy import DEFAULT_POLICY, AllocatorPolicy
from .errors import BackendUnavailableError, OutOfMemoryError

log = logging.getLogger(__name__)


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            "CuPy is not installed: pip install 'gpumem[cuda12]' (CUDA 12) or 'gpumem[cuda13]' (CUDA 13)"
        ) from exc
    return cupy


class _BlockOwner:
    """Keeps a gpumem block alive while CuPy references it; frees it when CuPy lets go."""

    __slots__ = ("allocator", "ptr")

    def __init__(self, allocator: CachingAllocator, ptr: int) -> None:
        self.allocator = allocator
        self.ptr = ptr

    def __del__(self) -> None:
        try:
            self.allocator.free(self.ptr)
        except Exception as exc:  # noqa: BLE001 - never raise from a finaliser
            log.debug("could not free %#x: %s", self.ptr, exc)


class CupyMalloc:
    """The function given to ``cupy.cuda.set_allocator``: one gpumem allocator per device, chosen at each
    call by CuPy's current device (as CuPy's own ``MemoryPool`` keeps one pool per device).

    Note [One allocator per device, chosen at call time]: CuPy calls the installed function for every
    device; a function bound to the device that was current at install time handed device 0's memory to
    an array made after ``cupy.cuda.Device(1).use()``. The allocator of a device is made on its first
    allocation there (by ``factory(device_id)``), under ``_lock``; the hot path after that is a dict read.

    The ``MemoryPointer`` CuPy gets has the block's size (``mem.size``: the request rounded as the
    allocator rounds it, a multiple of 512 B as CuPy's pool gives), since CuPy code reads it as the
    allocation's size (CuPy's ``test_percentile_memory_access`` does).
    """

    def __init__(self, factory: Callable[[int], CachingAllocator],
                 allocators: "dict[int, CachingAllocator] | None" = None) -> None:
        self._cupy = _cupy()
        self._factory = factory
        self._lock = threading.Lock()
        self._allocators: dict[int, CachingAllocator] = dict(allocators or {})  # written under _lock

    def allocator(self, device_id: int | None = None) -> CachingAllocator:
        """The allocator of ``device_id`` (default: CuPy's current device), made on first use."""
        dev = self._cupy.cuda.runtime.getDevice() if device_id is None else int(device_id)
        alloc = self._allocators.get(dev)
        if alloc is None:
            with self._lock:
                alloc = self._allocators.get(dev)
                if alloc is None:
                    alloc = self._allocators[dev] = self._factory(dev)
        return alloc

    @property
    def allocators(self) -> "dict[int, CachingAllocator]":
        """The allocators made so far, by device id (a copy)."""
        with self._lock:
            return dict(self._allocators)

    def __call__(self, nbytes: int) -> Any:
        cupy = self._cupy
        memory = cupy.cuda.memory
        device_id = cupy.cuda.runtime.getDevice()
        if nbytes == 0:
            return memory.MemoryPointer(memory.UnownedMemory(0, 0, None, device_id), 0)
        allocator = self.allocator(device_id)
        stream = cupy.cuda.get_current_stream().ptr
        try:
            ptr = allocator.allocate(nbytes, stream)
        except OutOfMemoryError as exc:
            # CuPy's own OutOfMemoryError lets CuPy code that catches it keep working
            raise memory.OutOfMemoryError(nbytes, allocator.allocated_nbytes) from exc
        mem = memory.UnownedMemory(ptr, allocator.block_size(ptr), _BlockOwner(allocator, ptr), device_id)
        return memory.MemoryPointer(mem, 0)


def make_malloc(allocator: CachingAllocator) -> Callable[[int], Any]:
    """The function to give ``cupy.cuda.set_allocator`` for ``allocator``'s device alone: an allocation on
    any other device is refused (:class:`CupyMalloc` serves every device)."""
    cupy = _cupy()
    own = cupy.cuda.Device().id

    def refuse(device_id: int) -> CachingAllocator:
        raise BackendUnavailableError(f"this gpumem allocator serves CUDA device {own}, and CuPy allocated on "
                                      f"device {device_id}: use gpumem.cupy_allocator.install(), which keeps "
                                      "one allocator per device")

    return CupyMalloc(refuse, {own: allocator})


def install(allocator: CachingAllocator | None = None, *, policy: str | AllocatorPolicy = DEFAULT_POLICY,
            **allocator_options: Any) -> CachingAllocator:
    """Route CuPy's allocations through gpumem, one allocator per device (Note [One allocator per device,
    chosen at call time]); return the current device's allocator (``allocator`` when given: it serves the
    current device, and the others get new ones with ``policy`` and ``allocator_options``)."""
    cupy = _cupy()
    from .specs import open_device

    def factory(device_id: int) -> CachingAllocator:
        return CachingAllocator(open_device(f"cuda:{device_id}"), policy, **allocator_options)

    current = cupy.cuda.Device().id
    malloc = CupyMalloc(factory, {current: allocator} if allocator is not None else None)
    cupy.cuda.set_allocator(malloc)
    return malloc.allocator(current)


@contextlib.contextmanager
def using(allocator: CachingAllocator | None = None, *, policy: str | AllocatorPolicy = DEFAULT_POLICY,
          **allocator_options: Any) -> Iterator[CachingAllocator]:
    """Like :func:`install` for the duration of a ``with`` block; the previous allocator comes back after."""
    cupy = _cupy()
    previous = cupy.cuda.get_allocator()
    alloc = install(allocator, policy=policy, **allocator_options)
    try:
        yield alloc
    finally:
        cupy.cuda.set_allocator(previous)
