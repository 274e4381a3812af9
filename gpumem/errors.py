"""The gpumem exception hierarchy.

Every error gpumem raises derives from :class:`GpumemError`, so ``except
GpumemError`` catches all of them. Errors that are also a kind of standard
error (a bad argument, an unknown key) derive from that builtin too, so code
that already catches ``ValueError`` keeps working.

Invariant (tested): an operation that raises one of these leaves the device's
and the allocator's accounting exactly as it was before the call.
"""

from __future__ import annotations

from .units import format_bytes


class GpumemError(Exception):
    """Root of every error raised by gpumem."""


class InvalidArgumentError(GpumemError, ValueError):
    """A size, pointer, index or option that cannot be valid (negative, zero, wrong type...)."""


class InvalidPointerError(GpumemError, ValueError):
    """A pointer that the device or allocator does not know (never allocated, or already freed)."""


class DoubleFreeError(InvalidPointerError):
    """A pointer freed a second time."""


class MappingError(GpumemError, ValueError):
    """A virtual-memory operation that does not fit the current mappings."""


class MappingOverlapError(MappingError):
    """A mapping or reservation that overlaps an existing one."""


class UnsupportedOperationError(GpumemError, NotImplementedError):
    """The device cannot do this at all (for example virtual memory management on a part without it)."""


class DeviceNotFoundError(GpumemError, LookupError):
    """A device spec that names no device: an unknown profile or an index out of range."""


class BackendUnavailableError(GpumemError, ImportError):
    """A backend whose Python packages are missing; the message says which extra to install."""


class CudaError(GpumemError, RuntimeError):
    """A CUDA runtime, driver or NVML call failed; ``error_name`` is CUDA's name for the error."""

    def __init__(self, call: str, error_name: str, detail: str = "", *, injected: bool = False) -> None:
        self.call = call
        self.error_name = error_name
        self.detail = detail
        self.injected = injected
        """True when the simulator injected this failure on purpose (:class:`gpumem.sim.FaultPlan`)."""
        msg = f"{call} failed: {error_name}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class TransientDeviceError(GpumemError, RuntimeError):
    """A device call failed in a way that may succeed if retried."""


class DeviceLostError(GpumemError, RuntimeError):
    """The device is gone (fell off the bus, was reset); every later call fails too."""


class DeviceClosedError(GpumemError, RuntimeError):
    """A call on a device object after :meth:`~gpumem.device.Device.close`."""


class TraceFormatError(GpumemError, ValueError):
    """A trace file that cannot be read: wrong format, truncated, malformed entry or forbidden pickle content."""

    def __init__(self, path: str, message: str, entry: int | None = None) -> None:
        self.path = path
        self.entry = entry
        where = f"{path}" if entry is None else f"{path}, entry {entry}"
        super().__init__(f"{where}: {message}")


class OutOfMemoryError(GpumemError, MemoryError):
    """An allocation the device (or allocator limit) cannot satisfy.

    Carries the requested size and the device's free and total bytes at the time
    of the failure; an allocator adds what it holds and what to try in ``hint``.
    """

    def __init__(
        self,
        requested_nbytes: int,
        free_nbytes: int,
        total_nbytes: int,
        *,
        device: str = "",
        allocated_nbytes: int | None = None,
        cached_nbytes: int | None = None,
        limit_nbytes: int | None = None,
        hint: str = "",
        injected: bool = False,
        rounded_nbytes: int | None = None,
    ) -> None:
        self.requested_nbytes = requested_nbytes
        self.rounded_nbytes = rounded_nbytes if rounded_nbytes is not None else requested_nbytes
        """What the allocator needed for the request: its size rounded up by the allocator's policy."""
        self.free_nbytes = free_nbytes
        self.total_nbytes = total_nbytes
        self.device = device
        self.allocated_nbytes = allocated_nbytes
        self.cached_nbytes = cached_nbytes
        self.limit_nbytes = limit_nbytes
        self.hint = hint
        self.injected = injected
        """True when the simulator injected this failure on purpose: nothing was really out of memory."""
        on = f" on {device}" if device else ""
        parts = [f"out of memory{on}: tried to allocate {format_bytes(requested_nbytes)} ({requested_nbytes} bytes)"]
        if self.rounded_nbytes != requested_nbytes:  # what the allocator really needed
            parts.append(f"rounded up to {format_bytes(self.rounded_nbytes)} ({self.rounded_nbytes} bytes) by "
                         "the allocator's policy")
        parts.append(f"the device has {format_bytes(free_nbytes)} free of {format_bytes(total_nbytes)} total")
        if allocated_nbytes is not None:
            parts.append(f"this allocator has {format_bytes(allocated_nbytes)} allocated")
        if cached_nbytes is not None:
            parts.append(f"{format_bytes(cached_nbytes)} reserved but unused")
        if limit_nbytes is not None:
            parts.append(f"its limit is {format_bytes(limit_nbytes)}")
        msg = "; ".join(parts) + "."
        if injected:
            msg += " (This failure was an injected fault, not a real shortage.)"
        if hint:
            msg += " " + hint
        super().__init__(msg)


class MemoryHazardError(GpumemError, RuntimeError):
    """Memory that queued or running GPU work still touches was unmapped, released or freed, or work
    was launched on memory that is not mapped or not allocated (the simulator's sanitizer).

    On a real GPU such a call returns success and the context dies later with
    ``CUDA_ERROR_ILLEGAL_ADDRESS``; the simulator refuses it and changes nothing.
    """

    def __init__(self, call: str, message: str, *, stream: int | None = None, va: int = 0, nbytes: int = 0,
                 work: str = "") -> None:
        self.call = call
        self.stream = stream
        self.va = va
        self.nbytes = nbytes
        self.work = work
        super().__init__(f"{call}: {message}")


class InternalError(GpumemError, RuntimeError):
    """gpumem's own bookkeeping is inconsistent (a bug): raised by consistency checks instead of ``assert``."""
