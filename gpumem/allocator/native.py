"""The Python side of the native engine (``gpumem._engine``): what its binding calls back for.

The binding (``gpumem/_native/module.cpp``) runs the hot path in C++ and calls these helpers on
slow paths only: argument validation with the very checks (and messages) of
:mod:`gpumem.allocator.caching`, and the :class:`~gpumem.errors.OutOfMemoryError` that the Python
allocator's ``_oom_error`` builds, from the numbers the engine gathered at the same moment.
"""

from __future__ import annotations

from ..validate import STREAM_END, as_int, check_nbytes, check_stream
from ..errors import (DeviceClosedError, DeviceLostError, DoubleFreeError, InternalError, InvalidArgumentError,
                      InvalidPointerError, OutOfMemoryError)
from ..units import format_bytes

__all__ = ["load_engine", "check_alloc_args", "as_ptr", "check_stream", "oom_error"]

# error classes the binding raises (read once when an allocator is created)
INVALID_ARGUMENT = InvalidArgumentError
INVALID_POINTER = InvalidPointerError
DOUBLE_FREE = DoubleFreeError
DEVICE_LOST = DeviceLostError
DEVICE_CLOSED = DeviceClosedError
INTERNAL = InternalError
OUT_OF_MEMORY = OutOfMemoryError

# OomCause in engine.h
_DEVICE, _TOO_LARGE, _LIMIT, _ADDRESS_SPACE = 1, 2, 3, 4


def load_engine():
    """The ``gpumem._engine`` extension module, or None when it was not built (loaded once per
    process by :mod:`gpumem.native`, which also owns the warning)."""
    from ..native import _load

    return _load()[0]


def check_alloc_args(nbytes: object, stream: object) -> tuple[int, int]:
    """``allocate``'s argument checks, as :meth:`CachingAllocator.allocate` makes them."""
    if nbytes.__class__ is not int or nbytes <= 0:  # type: ignore[operator]
        nbytes = check_nbytes(nbytes)
    if stream.__class__ is not int or not 0 <= stream < STREAM_END:  # type: ignore[operator]
        stream = check_stream(stream)
    return nbytes, stream  # type: ignore[return-value]


def as_ptr(ptr: object) -> int:
    """A pointer argument as an int (:func:`gpumem.validate.as_int`)."""
    return as_int(ptr, "ptr")


def bad_pointer(op: str, ptr: int, closed: bool, lost: str | None) -> None:
    """Raise what the Python allocator raises for a pointer outside [0, 2**64) (never a live block)."""
    if lost is not None:
        raise DeviceLostError(f"the device was lost: {lost}")
    if op == "free":
        if closed:
            raise InvalidArgumentError(f"free of {ptr:#x}: the allocator is closed")
        if ptr <= 0:
            raise InvalidArgumentError(f"ptr must be a positive address, got {ptr}")
        raise InvalidPointerError(f"free of {ptr:#x}, which this allocator did not allocate")
    if closed:
        raise InvalidArgumentError(f"record_stream of {ptr:#x}: the allocator is closed")
    raise InvalidPointerError(f"record_stream: {ptr:#x} is not a live allocation")


def oom_error(cause: int, nbytes: int, free_nbytes: int, total_nbytes: int, allocated_nbytes: int,
              cached_nbytes: int, reserved_nbytes: int, limit_nbytes: int, va_nbytes: int, cause_exc: object,
              device: str, round_nbytes: int) -> OutOfMemoryError:
    """The error of ``CachingAllocator._oom_error`` (virtual-memory mode), from the engine's numbers."""
    from .caching import too_large_hint

    limit = limit_nbytes or None
    injected = bool(getattr(cause_exc, "injected", False)) if cause == _DEVICE else False
    rounded = -(-nbytes // round_nbytes) * round_nbytes
    if cause == _TOO_LARGE:
        hint = too_large_hint(nbytes, rounded, total_nbytes)
    elif injected:
        hint = ("The device call failed because of an injected fault (the simulator's fault plan), "
                "not a real shortage of memory.")
    elif cause == _ADDRESS_SPACE:
        hint = (f"The allocator's virtual address range ({format_bytes(va_nbytes)} per pool) is exhausted, not the "
                "device's memory: free blocks of other streams that are still busy, or below live blocks, "
                "hold its address space. Free long-lived blocks, use fewer streams, or raise the policy's "
                "va_reserve_factor.")
    elif cause == _LIMIT:
        hint = (f"The allocator's limit of {format_bytes(limit or 0)} is reached: raise `limit`, "
                "free tensors you no longer need, or use smaller batches.")
    else:
        outside = max(0, total_nbytes - free_nbytes - reserved_nbytes)
        hint = ("Try: free what you no longer need; use smaller batches or shorter sequences. "
                f"{format_bytes(outside)} of this device is held outside this allocator (this process's "
                "CUDA context, other allocators, other processes; see `gpumem devices`).")
    return OutOfMemoryError(nbytes, free_nbytes, total_nbytes, device=device, allocated_nbytes=allocated_nbytes,
                            cached_nbytes=cached_nbytes, limit_nbytes=limit, hint=hint, injected=injected,
                            rounded_nbytes=rounded)
