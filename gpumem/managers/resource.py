"""Memory resources for the managers: the contract (re-exported), :class:`DeviceResource` and the old bridge.

The contract, :class:`~gpumem.allocator.resource.MemoryResource`, lives on the allocator floor
(:mod:`gpumem.allocator.resource`) and the allocators are resources themselves, so a pooled
stack starts at ``gpumem.allocator.make_allocator(dev, policy)``. :class:`DeviceResource` takes
memory straight from the device (pooling off). Alignments above 256 B come from
:class:`~gpumem.allocator.resource.AlignmentLayer` (Note [Alignment is a layer]).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from gpumem.allocator.resource import (DEFAULT_ALIGNMENT, MAX_ALIGNMENT, AlignmentLayer, MemoryResource,
                                       check_alignment, check_base_alignment, check_ptr, check_size,
                                       check_stream_arg, find_layer, stack_layers)
from gpumem.device import Device
from gpumem.errors import DeviceClosedError, InvalidArgumentError, InvalidPointerError

from .tracker import BufferId


class DeviceResource(MemoryResource):
    """Memory straight from the device: one ``malloc`` per allocation, ``free`` on deallocate (no pool).

    It keeps the size of each outstanding allocation (to check ``deallocate``'s ``nbytes`` and to
    free what is left on :meth:`close`); the device stays open (its owner closes it).
    """

    def __init__(self, device: Device) -> None:
        if not isinstance(device, Device):
            raise InvalidArgumentError(f"device must be a gpumem.Device, got {type(device).__name__}")
        self.device = device
        self._lock = threading.Lock()
        self._outstanding: dict[int, int] = {}  # guarded by _lock
        self._closed = False

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        if self._closed:
            raise DeviceClosedError(f"{self!r} is closed")
        check_base_alignment(self, alignment)
        ptr = self.device.malloc(nbytes)
        with self._lock:
            self._outstanding[ptr] = nbytes
        return ptr

    def do_deallocate(self, ptr: int, nbytes: int, alignment: int, stream: int) -> None:
        with self._lock:
            have = self._outstanding.get(ptr)
            if have is None:
                raise InvalidPointerError(f"deallocate: {ptr:#x} was not allocated by {self!r} (or was freed already)")
            if have != nbytes:
                raise InvalidArgumentError(f"deallocate: {ptr:#x} was allocated with nbytes={have}; got nbytes={nbytes}")
            del self._outstanding[ptr]
        try:
            self.device.free(ptr)
        except BaseException:
            with self._lock:
                self._outstanding[ptr] = have
            raise

    def outstanding_nbytes(self) -> int:
        """Bytes handed out and not given back."""
        with self._lock:
            return sum(self._outstanding.values())

    def outstanding(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every allocation not given back."""
        with self._lock:
            return list(self._outstanding.items())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            ptrs = list(self._outstanding)
            self._outstanding.clear()
        if not self.device.closed:
            for ptr in ptrs:
                self.device.free(ptr)


__all__ = ["Allocation", "MemoryResource", "DeviceResource", "AlignmentLayer", "DEFAULT_ALIGNMENT",
           "MAX_ALIGNMENT", "check_alignment", "check_size", "check_stream_arg", "check_ptr", "stack_layers",
           "find_layer"]


@dataclass(frozen=True)
class Allocation:
    """One block from :meth:`~gpumem.managers.GpuMemoryManager.allocate`; give it back with its ``deallocate``."""

    ptr: int
    nbytes: int
    buffer_id: BufferId | None
    """The tracker's id (None when tracking is off)."""
    device_index: int
    alignment: int = DEFAULT_ALIGNMENT
    stream: int = 0
