"""Helpers of the MultiGpuMemoryManager tests and the soak: which per-device manager to use.

``GpuMemoryManager`` (gpumem.managers.manager) is the real one. ``CachingManager`` implements the same
interface over the CachingAllocator's public interface with a plain limit (90 % of the device) and no
reserve rule, so the placement logic is also tested apart from the manager's own rules (and the tests
ran before the manager existed); :func:`manager_factories` lists both.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from gpumem.allocator import CachingAllocator
from gpumem.errors import InvalidPointerError, OutOfMemoryError


@dataclass(frozen=True)
class StandInAllocation:
    ptr: int
    nbytes: int
    buffer_id: int
    device_index: int


class CachingManager:
    """The agreed manager interface over a CachingAllocator (tests only; see the module docstring)."""

    _ids = itertools.count(1)

    def __init__(self, device, usable_fraction: float = 0.9) -> None:
        self.device = device
        self.total_memory = device.properties().total_nbytes
        self.usable_memory = int(self.total_memory * usable_fraction)
        self.allocator = CachingAllocator(device)
        self._lock = threading.Lock()
        self._live: dict[int, StandInAllocation] = {}
        self._allocated = 0

    def allocate(self, nbytes: int, alignment: int = 256) -> StandInAllocation:
        with self._lock:
            if self._allocated + nbytes > self.usable_memory:
                mem = self.device.mem_info()
                raise OutOfMemoryError(nbytes, mem.free_nbytes, self.total_memory, device=self.device.spec,
                                       limit_nbytes=self.usable_memory)
            ptr = self.allocator.allocate(nbytes)
            a = StandInAllocation(ptr, nbytes, next(self._ids), 0)
            self._live[a.buffer_id] = a
            self._allocated += nbytes
            return a

    def deallocate(self, allocation: StandInAllocation) -> None:
        with self._lock:
            if self._live.get(allocation.buffer_id) is not allocation:
                raise InvalidPointerError(f"{allocation!r} is not live")
            self.allocator.free(allocation.ptr)
            del self._live[allocation.buffer_id]
            self._allocated -= allocation.nbytes

    def get_detailed_stats(self) -> dict:
        return {"allocated": self._allocated, "reserved": self.allocator.reserved_nbytes}

    def empty_cache(self) -> int:
        return self.allocator.empty_cache()

    def close(self) -> None:
        for a in list(self._live.values()):
            self.allocator.free(a.ptr)
        self._live.clear()
        self.allocator.close()


def manager_factories() -> dict:
    """name -> factory(device): the real GpuMemoryManager when it exists, and the stand-in."""
    out = {"caching-stand-in": CachingManager}
    try:
        from gpumem.managers.manager import GpuMemoryManager
    except ImportError:
        pass
    else:
        out["GpuMemoryManager"] = GpuMemoryManager
    return out
