"""The one allocation contract, RMM style: :class:`MemoryResource`, the layer base and the alignment layer.

A :class:`MemoryResource` hands out device memory with ``allocate(nbytes, alignment=256,
stream=0)`` and takes it back with ``deallocate(ptr, nbytes, alignment=256, stream=0)``. As in RMM
(``device_memory_resource::allocate`` / ``do_allocate``), the public methods are concrete: they
validate the arguments the same way for every resource and call the protected
:meth:`~MemoryResource.do_allocate` / :meth:`~MemoryResource.do_deallocate` an implementation
provides (Note [Public methods check, implementations do] in :mod:`gpumem.device`).

The allocators (:class:`~gpumem.allocator.CachingAllocator`,
:class:`~gpumem.allocator.bucket.BucketAllocator`) are resources themselves; so is
:class:`~gpumem.managers.resource.DeviceResource` (no pool). The layers wrap any resource and are
one (:class:`ResourceLayer`; :class:`AlignmentLayer` here, statistics, tracking, limits, logging
and failure callbacks in :mod:`gpumem.managers.layers`), so they stack.

This module sits on the allocator floor (it imports only device, errors and units) so that the
allocators can subclass :class:`MemoryResource` without importing the managers.

Note [Alignment is a layer]
---------------------------
Every gpumem device and allocator returns pointers aligned to at least 256 B (CUDA's guarantee),
so a base resource honours ``alignment <= 256`` for free and refuses a larger one with
:class:`~gpumem.errors.InvalidArgumentError` naming :class:`AlignmentLayer`. The layer (RMM's
``aligned_resource_adaptor``) asks its upstream for ``nbytes + alignment - 256`` bytes and returns
the first aligned address inside; only those padded allocations enter its map (aligned pointer to
the upstream's pointer and size), so an ordinary allocation passes through without one. Before,
the padding lived inside the manager's bridge resource and every allocation entered its map.
"""

from __future__ import annotations

from .. import validate as _validate

import abc
import threading
from dataclasses import dataclass
from typing import Any

from gpumem.device import MIN_POINTER_ALIGNMENT, Device, MemInfo
from gpumem.errors import InvalidArgumentError, InvalidPointerError
from gpumem.units import align_up

#: The alignment every resource guarantees without padding (CUDA's ``cudaMalloc`` guarantee).
DEFAULT_ALIGNMENT = MIN_POINTER_ALIGNMENT
#: The largest alignment accepted (1 GiB): larger ones are certainly a mistake.
MAX_ALIGNMENT = _validate.MAX_ALIGNMENT


def check_alignment(alignment: object) -> int:
    """``alignment`` as an int if it is a power of two in [1, MAX_ALIGNMENT] (:mod:`gpumem.validate`)."""
    return _validate.check_alignment(alignment)


def check_size(nbytes: object) -> int:
    """``nbytes`` as an int if it is > 0 (:mod:`gpumem.validate`: any integer type, bools refused)."""
    return _validate.check_nbytes(nbytes)


def check_stream_arg(stream: object) -> int:
    """``stream`` as an int in [0, 2**64) (:mod:`gpumem.validate`)."""
    return _validate.check_stream(stream)


def check_ptr(ptr: object) -> int:
    """``ptr`` as an int if it is a valid device pointer (:mod:`gpumem.validate`)."""
    return _validate.check_pointer(ptr)


def check_base_alignment(resource: object, alignment: int) -> None:
    """Refuse an alignment above 256 B at a base resource (Note [Alignment is a layer])."""
    if alignment > DEFAULT_ALIGNMENT:
        raise InvalidArgumentError(f"{type(resource).__name__} aligns to {DEFAULT_ALIGNMENT} B, not {alignment}: "
                                   f"wrap it in gpumem.allocator.resource.AlignmentLayer for larger alignments")


class MemoryResource(abc.ABC):
    """The interface every resource, allocator and layer shares (module docstring).

    A subclass provides :attr:`device` (a property or an attribute set in ``__init__``),
    :meth:`do_allocate` and :meth:`do_deallocate`.
    """

    device: Device
    """The device the memory comes from."""

    def allocate(self, nbytes: int, alignment: int = DEFAULT_ALIGNMENT, stream: int = 0) -> int:
        """Allocate ``nbytes`` (> 0) aligned to ``alignment`` (a power of two) for use on ``stream``.

        Raises :class:`~gpumem.errors.InvalidArgumentError` on bad arguments (nothing changes) and
        :class:`~gpumem.errors.OutOfMemoryError` when the memory cannot be had (nothing changes).
        """
        nbytes = check_size(nbytes)   # gpumem.validate: any integer type, as a plain int
        alignment = check_alignment(alignment)
        stream = check_stream_arg(stream)
        return self.do_allocate(nbytes, alignment, stream)

    def deallocate(self, ptr: int, nbytes: int, alignment: int = DEFAULT_ALIGNMENT, stream: int = 0) -> None:
        """Give back ``ptr`` from :meth:`allocate` with the same ``nbytes`` and ``alignment``."""
        ptr = check_ptr(ptr)
        nbytes = check_size(nbytes)
        alignment = check_alignment(alignment)
        stream = check_stream_arg(stream)
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


class ResourceLayer(MemoryResource):
    """A resource that forwards to ``upstream``; subclasses add one concern."""

    def __init__(self, upstream: MemoryResource) -> None:
        if not isinstance(upstream, MemoryResource):
            raise InvalidArgumentError(f"upstream must be a MemoryResource, got {type(upstream).__name__}")
        self.upstream = upstream

    @property  # type: ignore[override]
    def device(self) -> Device:
        return self.upstream.device

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        return self.upstream.do_allocate(nbytes, alignment, stream)

    def do_deallocate(self, ptr: int, nbytes: int, alignment: int, stream: int) -> None:
        self.upstream.do_deallocate(ptr, nbytes, alignment, stream)

    def empty_cache(self) -> int:
        return self.upstream.empty_cache()

    def memory_info(self) -> MemInfo:
        return self.upstream.memory_info()

    def close(self) -> None:
        self.upstream.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} over {self.upstream!r}>"


@dataclass(frozen=True)
class _Padded:
    """What the upstream handed out for one padded allocation (Note [Alignment is a layer])."""

    raw_ptr: int
    raw_nbytes: int
    alignment: int


class AlignmentLayer(ResourceLayer):
    """Honours any power-of-two alignment over an upstream that aligns to 256 B (Note [Alignment is a layer]).

    ``alignment`` (default 256) is the least alignment of every allocation through the layer;
    a larger one per call wins. ``deallocate`` must be given the ``alignment`` given to ``allocate``.
    """

    def __init__(self, upstream: MemoryResource, alignment: int = DEFAULT_ALIGNMENT) -> None:
        super().__init__(upstream)
        self.alignment = check_alignment(alignment)
        self._lock = threading.Lock()
        self._padded: dict[int, _Padded] = {}  # guarded by _lock; only allocations aligned above 256 B

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        alignment = max(alignment, self.alignment)
        if alignment <= DEFAULT_ALIGNMENT:
            return self.upstream.do_allocate(nbytes, DEFAULT_ALIGNMENT, stream)
        raw_nbytes = nbytes + alignment - DEFAULT_ALIGNMENT
        raw = self.upstream.do_allocate(raw_nbytes, DEFAULT_ALIGNMENT, stream)
        ptr = align_up(raw, alignment)
        with self._lock:
            self._padded[ptr] = _Padded(raw, raw_nbytes, alignment)
        return ptr

    def do_deallocate(self, ptr: int, nbytes: int, alignment: int, stream: int) -> None:
        alignment = max(alignment, self.alignment)
        if alignment <= DEFAULT_ALIGNMENT:
            if self._padded:  # a padded pointer given back with a small alignment is refused, not leaked
                with self._lock:
                    rec = self._padded.get(ptr)
                if rec is not None:
                    raise InvalidArgumentError(f"deallocate: {ptr:#x} was allocated with alignment={rec.alignment}; "
                                               f"got alignment={alignment}")
            self.upstream.do_deallocate(ptr, nbytes, DEFAULT_ALIGNMENT, stream)
            return
        with self._lock:
            rec = self._padded.get(ptr)
            if rec is None:
                raise InvalidPointerError(f"deallocate: {ptr:#x} was not allocated by {self!r} with alignment "
                                          f"{alignment} (or was freed already)")
            if rec.alignment != alignment or rec.raw_nbytes != nbytes + alignment - DEFAULT_ALIGNMENT:
                raise InvalidArgumentError(f"deallocate: {ptr:#x} was allocated with nbytes="
                                           f"{rec.raw_nbytes - rec.alignment + DEFAULT_ALIGNMENT}, alignment="
                                           f"{rec.alignment}; got nbytes={nbytes}, alignment={alignment}")
            del self._padded[ptr]
        try:
            self.upstream.do_deallocate(rec.raw_ptr, rec.raw_nbytes, DEFAULT_ALIGNMENT, stream)
        except BaseException:
            with self._lock:
                self._padded[ptr] = rec
            raise

    def padded_count(self) -> int:
        """Allocations live through this layer that it padded (alignment above 256 B)."""
        with self._lock:
            return len(self._padded)


class AllocatorContract(MemoryResource):
    """The contract as the allocators keep it (:class:`~gpumem.allocator.CachingAllocator`,
    :class:`~gpumem.allocator.bucket.BucketAllocator`).

    Note [The allocators' allocate takes the stream second]
    -------------------------------------------------------
    The allocators' ``allocate(nbytes, stream=0)`` predates the contract and every replay, hook
    and benchmark calls it positionally, so it stays: it validates and runs the allocator's own
    path. Under the contract an allocator is a base resource: :meth:`do_allocate` honours
    ``alignment <= 256`` (every block is 256-aligned) and refuses more (Note [Alignment is a
    layer]); :meth:`deallocate` is the contract's (validates, then :meth:`do_deallocate`, which is
    the allocator's ``free``: the block it finds knows its size, so the contract's ``nbytes`` adds
    no map). Call ``allocate(nbytes, stream=s)`` by keyword where the resource may be any.
    """

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        check_base_alignment(self, alignment)
        return self.allocate(nbytes, stream)  # type: ignore[call-arg]

    def do_deallocate(self, ptr: int, nbytes: int, alignment: int, stream: int) -> None:
        self.free(ptr)  # type: ignore[attr-defined]


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


__all__ = ["MemoryResource", "ResourceLayer", "AlignmentLayer", "AllocatorContract", "DEFAULT_ALIGNMENT", "MAX_ALIGNMENT",
           "check_alignment", "check_size", "check_stream_arg", "check_ptr", "check_base_alignment",
           "stack_layers", "find_layer"]
