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


def make_malloc(allocator: CachingAllocator) -> Callable[[int], Any]:
    """The function to give ``cupy.cuda.set_allocator``."""
    cupy = _cupy()
    memory = cupy.cuda.memory
    device_id = cupy.cuda.Device().id

    def malloc(nbytes: int) -> Any:
        if nbytes == 0:
            return memory.MemoryPointer(memory.UnownedMemory(0, 0, None, device_id), 0)
        stream = cupy.cuda.get_current_stream().ptr
        try:
            ptr = allocator.allocate(nbytes, stream)
        except OutOfMemoryError as exc:
            # CuPy's own OutOfMemoryError lets CuPy code that catches it keep working
            raise memory.OutOfMemoryError(nbytes, allocator.allocated_nbytes) from exc
        mem = memory.UnownedMemory(ptr, nbytes, _BlockOwner(allocator, ptr), device_id)
        return memory.MemoryPointer(mem, 0)

    return malloc


def install(allocator: CachingAllocator | None = None, *, policy: str | AllocatorPolicy = DEFAULT_POLICY,
            **allocator_options: Any) -> CachingAllocator:
    """Route CuPy's allocations on the current device through ``allocator`` (a new one on
    ``cuda:<current device>`` with ``policy`` when None) and return it."""
    cupy = _cupy()
    if allocator is None:
        from .specs import open_device

        allocator = CachingAllocator(open_device(f"cuda:{cupy.cuda.Device().id}"), policy, **allocator_options)
    cupy.cuda.set_allocator(make_malloc(allocator))
    return allocator


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
