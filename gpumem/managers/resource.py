"""Memory resources, RMM style: one small interface that allocators and the layers over them share.

A :class:`MemoryResource` hands out device memory with ``allocate(nbytes, alignment=256,
stream=0)`` and takes it back with ``deallocate(ptr, nbytes, alignment=256, stream=0)``. As in RMM
(``device_memory_resource::allocate`` / ``do_allocate``), the public methods are concrete: they
validate the arguments the same way for every resource and call the protected
:meth:`~MemoryResource.do_allocate` / :meth:`~MemoryResource.do_deallocate` an implementation
provides (Note [Public methods check, implementations do] in :mod:`gpumem.device`).

Two resources take memory from a device:

* :class:`AllocatorResource`: through a :class:`~gpumem.allocator.CachingAllocator` (pooling on),
  using only its public interface (``allocate``, ``free``, ``empty_cache``, ``stats``,
  ``reserved_nbytes``, ``allocated_nbytes``, ``close``);
* :class:`DeviceResource`: straight from the device, one ``malloc`` per allocation (pooling off).

The layers in :mod:`gpumem.managers.layers` wrap any resource (statistics, tracking, limits,
logging, failure callbacks) and are resources themselves, so they stack.

Note [Alignment above 256 bytes]
--------------------------------
Every gpumem device and the caching allocator return pointers aligned to at least 256 B (CUDA's
guarantee), so ``alignment <= 256`` costs nothing. A larger power of two is honoured by asking the
source for ``nbytes + alignment - 256`` bytes and returning the first aligned address inside; the
resource remembers the source's pointer to give it back. ``deallocate`` must be called with the
``nbytes`` and ``alignment`` given to ``allocate`` (as in RMM); a mismatch is refused.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import Any

from gpumem.device import MIN_POINTER_ALIGNMENT, Device, MemInfo
from gpumem.errors import DeviceClosedError, InvalidArgumentError, InvalidPointerError
from gpumem.units import align_up
from gpumem.validate import MAX_ALIGNMENT, check_alignment, check_nbytes, check_pointer, check_stream

#: The alignment every resource guarantees without padding (CUDA's ``cudaMalloc`` guarantee).
DEFAULT_ALIGNMENT = MIN_POINTER_ALIGNMENT


class MemoryResource(abc.ABC):
    """The interface every resource and layer shares (module docstring)."""

    @property
    @abc.abstractmethod
    def device(self) -> Device:
        """The device the memory comes from."""

    def allocate(self, nbytes: int, alignment: int = DEFAULT_ALIGNMENT, stream: int = 0) -> int:
        """Allocate ``nbytes`` (> 0) aligned to ``alignment`` (a power of two) for use on ``stream``.

        Raises :class:`~gpumem.errors.InvalidArgumentError` on bad arguments (nothing changes) and
        :class:`~gpumem.errors.OutOfMemoryError` when the memory cannot be had (nothing changes).
        """
        nbytes = check_nbytes(nbytes)  # gpumem.validate: the checks of every entry point
        alignment = check_alignment(alignment)
        stream = check_stream(stream)
        return self.do_allocate(nbytes, alignment, stream)

    def deallocate(self, ptr: int, nbytes: int, alignment: int = DEFAULT_ALIGNMENT, stream: int = 0) -> None:
        """Give back ``ptr`` from :meth:`allocate` with the same ``nbytes`` and ``alignment``."""
        ptr = check_pointer(ptr)
        nbytes = check_nbytes(nbytes)
        alignment = check_alignment(alignment)
        stream = check_stream(stream)
        self.do_deallocate(ptr, nbytes, alignment, stream)

    @abc.abstractmethod
    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        """Allocate (arguments already validated)."""

    @abc.abstractmethod
    def do_deallocate(self, ptr: int, nbytes: int, alignment: int, stream: int) -> None:
        """Deallocate (arguments already validated)."""

    def empty_cache(self) -> int:
        """Give cached, unused memory back to the device; return the bytes given back (0 without a cache)."""
        return 0

    def memory_info(self) -> MemInfo:
        """The device's free and total bytes right now (other tenants included)."""
        return self.device.mem_info()

    def close(self) -> None:
        """Release what the resource holds (idempotent)."""

    def __enter__(self) -> "MemoryResource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} on {self.device.spec}>"


@dataclass(frozen=True)
class _Raw:
    """What the source handed out for one allocation (Note [Alignment above 256 bytes])."""

    raw_ptr: int
    raw_nbytes: int
    nbytes: int
    alignment: int


class _SourceResource(MemoryResource):
    """A resource that takes memory from a source (device or allocator), padding for large alignments."""

    def __init__(self, device: Device) -> None:
        if not isinstance(device, Device):
            raise InvalidArgumentError(f"device must be a gpumem.Device, got {type(device).__name__}")
        self._device = device
        self._lock = threading.Lock()
        self._outstanding: dict[int, _Raw] = {}  # guarded by _lock
        self._closed = False

    @property
    def device(self) -> Device:
        return self._device

    @abc.abstractmethod
    def _take(self, nbytes: int, stream: int) -> int: ...

    @abc.abstractmethod
    def _give(self, ptr: int) -> None: ...

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        if self._closed:
            raise DeviceClosedError(f"{self!r} is closed")
        raw_nbytes = nbytes if alignment <= DEFAULT_ALIGNMENT else nbytes + alignment - DEFAULT_ALIGNMENT
        raw = self._take(raw_nbytes, stream)
        ptr = align_up(raw, alignment) if alignment > DEFAULT_ALIGNMENT else raw
        with self._lock:
            self._outstanding[ptr] = _Raw(raw, raw_nbytes, nbytes, alignment)
        return ptr

    def do_deallocate(self, ptr: int, nbytes: int, alignment: int, stream: int) -> None:
        with self._lock:
            rec = self._outstanding.get(ptr)
            if rec is None:
                raise InvalidPointerError(f"deallocate: {ptr:#x} was not allocated by {self!r} (or was freed already)")
            if rec.nbytes != nbytes or rec.alignment != alignment:
                raise InvalidArgumentError(f"deallocate: {ptr:#x} was allocated with nbytes={rec.nbytes}, "
                                           f"alignment={rec.alignment}; got nbytes={nbytes}, alignment={alignment}")
            del self._outstanding[ptr]
        try:
            self._give(rec.raw_ptr)
        except BaseException:
            with self._lock:
                self._outstanding[ptr] = rec
            raise

    def outstanding_nbytes(self) -> int:
        """Bytes handed out and not given back (as requested, padding excluded)."""
        with self._lock:
            return sum(r.nbytes for r in self._outstanding.values())

    def outstanding(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every allocation not given back."""
        with self._lock:
            return [(p, r.nbytes) for p, r in self._outstanding.items()]


class DeviceResource(_SourceResource):
    """Memory straight from the device: one ``malloc`` per allocation, ``free`` on deallocate (no pool).

    ``close()`` frees what is still outstanding; the device stays open (its owner closes it).
    """

    def _take(self, nbytes: int, stream: int) -> int:
        return self._device.malloc(nbytes)

    def _give(self, ptr: int) -> None:
        self._device.free(ptr)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            raws = [r.raw_ptr for r in self._outstanding.values()]
            self._outstanding.clear()
        if not self._device.closed:
            for raw in raws:
                self._device.free(raw)


class AllocatorResource(_SourceResource):
    """Memory from a :class:`~gpumem.allocator.CachingAllocator` or a size-bucket pool
    (:class:`~gpumem.allocator.bucket.BucketAllocator`, which has the caching allocator's public
    interface): freed blocks are cached and reused.

    Pass an allocator, or a device and the allocator's keyword arguments (``policy``, ``limit``,
    ``gc_threshold``, ``engine``; with ``policy="bucket"``: ``limit``, ``max_pooled_per_bucket``); a
    resource that built its allocator closes it on :meth:`close`.
    """

    def __init__(self, allocator: Any, **allocator_kwargs: Any) -> None:
        from gpumem.allocator import CachingAllocator
        from gpumem.allocator.bucket import BUCKET_POLICY_NAME, BucketAllocator

        if isinstance(allocator, (CachingAllocator, BucketAllocator)):
            if allocator_kwargs:
                raise InvalidArgumentError("allocator keyword arguments apply only when a device is given")
            self.allocator = allocator
            self._owns = False
        elif isinstance(allocator, Device):
            policy = allocator_kwargs.pop("policy", "gpumem")
            if policy == BUCKET_POLICY_NAME:
                unknown = set(allocator_kwargs) - {"limit", "max_pooled_per_bucket"}
                if unknown:
                    raise InvalidArgumentError(f"the size-bucket pool takes limit and max_pooled_per_bucket, "
                                               f"not {', '.join(sorted(unknown))}")
                self.allocator = BucketAllocator(allocator, BUCKET_POLICY_NAME, **allocator_kwargs)
            else:
                allocator_kwargs.pop("max_pooled_per_bucket", None)  # the caching allocator has no buckets
                self.allocator = CachingAllocator(allocator, policy, **allocator_kwargs)
            self._owns = True
        else:
            raise InvalidArgumentError(f"AllocatorResource needs a CachingAllocator, a BucketAllocator or a "
                                       f"Device, got {type(allocator).__name__}")
        super().__init__(self.allocator.device)

    def _take(self, nbytes: int, stream: int) -> int:
        return self.allocator.allocate(nbytes, stream)

    def _give(self, ptr: int) -> None:
        self.allocator.free(ptr)

    def empty_cache(self) -> int:
        return self.allocator.empty_cache()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            raws = [r.raw_ptr for r in self._outstanding.values()]
            self._outstanding.clear()
        if self._owns:
            self.allocator.close()
        elif not self._device.closed:
            for raw in raws:
                self.allocator.free(raw)


def stack_layers(resource: MemoryResource) -> list[MemoryResource]:
    """``resource`` and every upstream under it, top first."""
    out = [resource]
    while (up := getattr(out[-1], "upstream", None)) is not None:
        out.append(up)
    return out


def find_layer(resource: MemoryResource, kind: type) -> Any:
    """The topmost layer of type ``kind`` in ``resource``'s stack, or None."""
    for r in stack_layers(resource):
        if isinstance(r, kind):
            return r
    return None


__all__ = ["MemoryResource", "DeviceResource", "AllocatorResource", "DEFAULT_ALIGNMENT", "MAX_ALIGNMENT",
           "check_alignment", "stack_layers", "find_layer"]
