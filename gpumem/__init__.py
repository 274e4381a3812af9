"""gpumem: GPU memory management, simulation first.

The pieces, each in its own module:

* :mod:`gpumem.device` - the abstract :class:`Device` and its value types;
* :mod:`gpumem.specs` - :func:`open_device` for ``"sim:<profile>"`` and ``"cuda:<index>"``;
* :mod:`gpumem.cuda` - the real-device adapter (CuPy, cuda-bindings, NVML), imported on demand;
* :mod:`gpumem.errors` - the exception hierarchy rooted in :class:`GpumemError`;
* the :mod:`gpumem.sim` package - the SimPy-driven simulated GPU;
* :func:`engine` - ``"native"`` (the C++ allocator engine is built) or ``"python"``;
* :mod:`gpumem.torch` - PyTorch on gpumem (imported on demand).
"""

from .device import Device, DeviceKind, DeviceProperties, Event, MemInfo, PhysicalHandle
from .errors import (
    BackendUnavailableError,
    CudaError,
    DeviceClosedError,
    DeviceLostError,
    DeviceNotFoundError,
    DoubleFreeError,
    GpumemError,
    InternalError,
    InvalidArgumentError,
    InvalidPointerError,
    MappingError,
    MemoryHazardError,
    MappingOverlapError,
    OutOfMemoryError,
    TraceFormatError,
    TransientDeviceError,
    UnsupportedOperationError,
)
from .native import engine
from .specs import DeviceSpec, open_device, parse_spec
from .units import GiB, KiB, MiB, format_bytes

__version__ = "0.1.0"

__all__ = [
    "Device", "DeviceKind", "DeviceProperties", "Event", "MemInfo", "PhysicalHandle",
    "open_device", "parse_spec", "DeviceSpec", "engine",
    "GpumemError", "InvalidArgumentError", "InvalidPointerError", "DoubleFreeError", "MappingError",
    "MappingOverlapError", "UnsupportedOperationError", "DeviceNotFoundError", "BackendUnavailableError",
    "CudaError", "TransientDeviceError", "DeviceLostError", "DeviceClosedError", "OutOfMemoryError",
    "TraceFormatError", "MemoryHazardError", "InternalError", "KiB", "MiB", "GiB", "format_bytes", "__version__",
]
