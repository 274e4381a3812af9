"""gpumem: GPU memory management, simulation first.

The pieces, each in its own module:

* :mod:`gpumem.device` - the abstract :class:`Device` and its value types;
* :mod:`gpumem.specs` - :func:`open_device` for ``"sim:<profile>"`` and ``"cuda:<index>"``;
* :mod:`gpumem.cuda` - the real-device adapter (CuPy, cuda-bindings, NVML), imported on demand;
* :mod:`gpumem.errors` - the exception hierarchy rooted in :class:`GpumemError`;
* the :mod:`gpumem.sim` package - the SimPy-driven simulated GPU;
* :func:`engine` - ``"native"`` (the C++ allocator engine is built) or ``"python"``;
* :mod:`gpumem.torch` - PyTorch on gpumem (imported on demand);
* :mod:`gpumem.managers` - memory managers: reserve and usable memory, layers, tracking, regions,
  OOM forensics, CPU fallback, pressure monitoring, multi-GPU placement;
* :mod:`gpumem.discovery` - which backends (CUDA, simulated, CPU) this machine has;
* :mod:`gpumem.workspace` - workspace sizing from the real device;
* :mod:`gpumem.estimate` - memory estimates for decoder LLMs (inference and training) and batch fitting;
* :mod:`gpumem.report` - fragmentation reports with figures, and sweeps over traces, devices and policies;
* :mod:`gpumem.recording` - :func:`record` a PyTorch program's memory snapshot, :func:`snapshot_on_oom`.

The names of the last six (and the size-bucket pool) are importable from ``gpumem`` itself; they are
loaded on first use, so ``import gpumem`` stays light.
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

# Note [Lazy exports]: the managers, discovery, workspace and estimation pull in the allocator and the
# simulator; `import gpumem` (and so every `gpumem` command's start-up) should not pay for them. The names
# below resolve on first access (PEP 562), each from the module named beside it.
_LAZY_EXPORTS: "dict[str, str]" = {
    **{name: ".managers" for name in (
        "GpuMemoryManager", "MemoryConfig", "Allocation", "MemoryStats", "AllocationTracker", "BufferId",
        "Location", "FallbackBuffer", "Reserve", "compute_reserve", "usable_nbytes", "region",
        "MemoryPressure", "PressureMonitor", "MultiGpuMemoryManager", "MultiGpuOutOfMemoryError")},
    **{name: ".discovery" for name in (
        "BackendDevice", "BackendInfo", "BackendKind", "BackendSelection", "InitializedBackend",
        "NoSuitableBackendError", "SelectionAttempt", "best_available_backend", "discover_backends",
        "init_backend_with_memory_check", "print_backend_summary", "select_backend_for_model")},
    **{name: ".workspace" for name in (
        "InsufficientWorkspaceMemoryError", "QType", "Workspace", "WorkspaceDeviceQueryError", "WorkspaceSet",
        "WorkspaceSize", "calculate_gpu_workspace_size")},
    **{name: ".estimate" for name in (
        "MemoryEstimate", "TrainingEstimate", "FitResult", "ModelShape", "estimate_inference_memory",
        "estimate_kv_cache_memory", "estimate_model_memory", "estimate_training_memory", "estimate_peak_reserved",
        "find_max_batch", "from_hf_config")},
    **{name: ".report" for name in (
        "ReportOptions", "ReportResult", "build_report", "SweepResult", "SweepRow", "run_sweep", "write_sweep")},
    **{name: ".allocator.bucket" for name in ("BucketAllocator", "BucketPolicy", "BucketPoolStats")},
    **{name: ".recording" for name in ("record", "Recording", "RecordResult", "snapshot_on_oom")},
}


def __getattr__(name: str) -> object:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpumem' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> "list[str]":
    return sorted({*globals(), *_LAZY_EXPORTS})

__all__ = [
    "Device", "DeviceKind", "DeviceProperties", "Event", "MemInfo", "PhysicalHandle",
    "open_device", "parse_spec", "DeviceSpec", "engine",
    "GpumemError", "InvalidArgumentError", "InvalidPointerError", "DoubleFreeError", "MappingError",
    "MappingOverlapError", "UnsupportedOperationError", "DeviceNotFoundError", "BackendUnavailableError",
    "CudaError", "TransientDeviceError", "DeviceLostError", "DeviceClosedError", "OutOfMemoryError",
    "TraceFormatError", "MemoryHazardError", "InternalError", "KiB", "MiB", "GiB", "format_bytes", "__version__",
    *_LAZY_EXPORTS,
]
