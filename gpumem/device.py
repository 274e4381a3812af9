"""The abstract device: what every gpumem component knows about a GPU.

The caching allocator, the managers and the workspace logic never talk to CUDA
or to the simulator directly: they call a :class:`Device`. Two implementations
exist: :class:`sim.SimDevice` (a SimPy-driven simulated GPU, in the ``sim``
package) and :class:`gpumem.cuda.CudaDevice` (a real GPU through CuPy,
cuda-bindings and NVML). Both pass the same contract suite (``tests/contract``).

The interface mirrors the CUDA calls it stands for:

=======================  ===============================================
``malloc`` / ``free``    ``cudaMalloc`` / ``cudaFree``
``mem_info``             ``cudaMemGetInfo`` (other tenants included)
``address_reserve``      ``cuMemAddressReserve``
``address_free``         ``cuMemAddressFree``
``mem_create``           ``cuMemCreate`` (a physical chunk)
``mem_release``          ``cuMemRelease``
``mem_map``              ``cuMemMap``
``mem_set_access``       ``cuMemSetAccess`` (read-write for this device)
``mem_unmap``            ``cuMemUnmap``
``write`` / ``read``     ``cudaMemcpy`` host-to-device / device-to-host
``synchronize``          ``cudaDeviceSynchronize``
=======================  ===============================================

Note [Validation before any device call]
----------------------------------------
Every implementation validates its arguments with the helpers below *before*
it touches its state or calls CUDA, so that bad input raises a specific
:mod:`gpumem.errors` exception and leaves the accounting unchanged. The checks
live here, once, so both devices reject exactly the same inputs.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Union

from .errors import InvalidArgumentError
from .units import format_bytes

#: Bytes accepted by :meth:`Device.write`.
BytesLike = Union[bytes, bytearray, memoryview]

#: Alignment every ``malloc`` pointer honours (CUDA guarantees at least 256 B).
MIN_POINTER_ALIGNMENT = 256


class DeviceKind(str, enum.Enum):
    """Where a device's memory really is."""

    SIM = "sim"
    CUDA = "cuda"


@dataclass(frozen=True)
class MemInfo:
    """Free and total bytes of a device right now, other tenants included."""

    free_nbytes: int
    total_nbytes: int

    @property
    def used_nbytes(self) -> int:
        """Bytes in use by anyone: this process, its CUDA context and other tenants."""
        return self.total_nbytes - self.free_nbytes

    def __str__(self) -> str:
        return f"{format_bytes(self.free_nbytes)} free of {format_bytes(self.total_nbytes)}"


@dataclass(frozen=True)
class DeviceProperties:
    """What a device is: the fields allocators and estimators size themselves from."""

    name: str
    total_nbytes: int
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    memory_bandwidth_gbps: float
    unified_memory: bool
    vmm_supported: bool
    granularity_nbytes: int


@dataclass(frozen=True)
class PhysicalHandle:
    """A physical memory chunk from :meth:`Device.mem_create` (CUDA's ``CUmemGenericAllocationHandle``)."""

    handle: int
    nbytes: int


def check_nbytes(nbytes: object, *, what: str = "nbytes", allow_zero: bool = False) -> int:
    """Return ``nbytes`` if it is a valid size, else raise :class:`InvalidArgumentError`.

    A size is a plain ``int`` (``bool`` and floats are refused, even ``2.0``),
    positive, or zero when ``allow_zero``.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise InvalidArgumentError(f"{what} must be an int, got {type(nbytes).__name__} {nbytes!r}")
    if nbytes < 0:
        raise InvalidArgumentError(f"{what} must not be negative, got {nbytes}")
    if nbytes == 0 and not allow_zero:
        raise InvalidArgumentError(f"{what} must be positive, got 0")
    return nbytes


def check_pointer(ptr: object, *, what: str = "ptr") -> int:
    """Return ``ptr`` if it is a plausible device address (a positive int), else raise."""
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise InvalidArgumentError(f"{what} must be an int address, got {type(ptr).__name__} {ptr!r}")
    if ptr <= 0:
        raise InvalidArgumentError(f"{what} must be a positive address, got {ptr}")
    return ptr


def check_granular(nbytes: object, granularity: int, *, what: str = "nbytes") -> int:
    """A positive size that is a multiple of the device's allocation granularity."""
    n = check_nbytes(nbytes, what=what)
    if n % granularity:
        raise InvalidArgumentError(
            f"{what}={n} is not a multiple of the allocation granularity {granularity} "
            f"({format_bytes(granularity)})"
        )
    return n


def check_data(data: object) -> memoryview:
    """Bytes-like data for :meth:`Device.write` as a flat byte memoryview."""
    # Any object with the buffer protocol (bytes, numpy arrays, array.array, mmap...): Python 3.12
    # adds __buffer__ to all of them, 3.10/3.11 do not, so just try.
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):  # ValueError: e.g. a numpy array of Python objects
        raise InvalidArgumentError(f"data must be bytes-like, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise InvalidArgumentError("data must be C-contiguous")
    if view.nbytes == 0:
        return memoryview(b"")  # cast() refuses views with a zero in their shape, e.g. np.zeros((0, 3))
    return view.cast("B")


class Device(abc.ABC):
    """A GPU, simulated or real. See the module docstring for the CUDA call each method stands for.

    Devices are context managers: ``with open_device("sim:h200-141gb") as dev: ...``
    closes them (freeing what they still hold) on exit.
    """

    #: The spec this device was opened with, e.g. ``"sim:a100-80gb"`` or ``"cuda:0"``.
    spec: str
    kind: DeviceKind

    # -- what the device is and has -------------------------------------------------
    @abc.abstractmethod
    def properties(self) -> DeviceProperties:
        """Static properties (cached: a real ``cudaGetDeviceProperties`` costs about 1 ms)."""

    @abc.abstractmethod
    def mem_info(self) -> MemInfo:
        """Free and total bytes right now, other processes and tenants included."""

    # -- plain allocation ------------------------------------------------------------
    @abc.abstractmethod
    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (> 0) of device memory; return a pointer aligned to at least 256 B.

        Raises :class:`~gpumem.errors.OutOfMemoryError` when the device cannot.
        """

    @abc.abstractmethod
    def free(self, ptr: int) -> None:
        """Free a pointer from :meth:`malloc`. Unknown or already-freed pointers raise."""

    # -- virtual memory management ----------------------------------------------------
    @abc.abstractmethod
    def address_reserve(self, nbytes: int, alignment: int = 0) -> int:
        """Reserve ``nbytes`` (a granularity multiple) of virtual address space; return its base."""

    @abc.abstractmethod
    def address_free(self, va: int, nbytes: int) -> None:
        """Give back a whole reservation; it must have no mappings left."""

    @abc.abstractmethod
    def mem_create(self, nbytes: int) -> PhysicalHandle:
        """Create a physical chunk of ``nbytes`` (a granularity multiple); takes device memory."""

    @abc.abstractmethod
    def mem_release(self, handle: PhysicalHandle) -> None:
        """Release a physical chunk. Its memory returns once it is also unmapped everywhere."""

    @abc.abstractmethod
    def mem_map(self, va: int, nbytes: int, handle: PhysicalHandle, offset: int = 0) -> None:
        """Map ``nbytes`` of ``handle`` starting at ``offset`` at ``va`` inside a reservation."""

    @abc.abstractmethod
    def mem_set_access(self, va: int, nbytes: int) -> None:
        """Make a mapped range readable and writable by this device."""

    @abc.abstractmethod
    def mem_unmap(self, va: int, nbytes: int) -> None:
        """Unmap a range that was mapped with exactly this base and size."""

    # -- data and ordering --------------------------------------------------------------
    @abc.abstractmethod
    def write(self, ptr: int, data: BytesLike) -> None:
        """Copy host bytes to device memory at ``ptr`` (inside one allocation or accessible mapping)."""

    @abc.abstractmethod
    def read(self, ptr: int, nbytes: int) -> bytes:
        """Copy ``nbytes`` of device memory at ``ptr`` back to the host."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until all work on the device has finished."""

    # -- life cycle ----------------------------------------------------------------------
    @abc.abstractmethod
    def close(self) -> None:
        """Free everything this device object still holds. Idempotent."""

    @property
    def vmm_supported(self) -> bool:
        """Whether :meth:`address_reserve` and friends work on this device."""
        return self.properties().vmm_supported

    @property
    def granularity_nbytes(self) -> int:
        """The physical allocation granularity (2 MiB on CUDA GPUs)."""
        return self.properties().granularity_nbytes

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"
