"""Turning CUDA's errors into gpumem's.

Three libraries report failures three ways:

* CuPy's runtime wrapper raises ``CUDARuntimeError``; its ``status`` is the
  ``cudaError_t`` number and its message starts with CUDA's name for it:
  ``"cudaErrorMemoryAllocation: out of memory"``.
* cuda-bindings returns a tuple whose first element is a ``CUresult`` enum
  member (``CUresult.CUDA_ERROR_OUT_OF_MEMORY``); nothing is raised.
* pynvml raises ``NVMLError`` subclasses carrying the ``nvmlReturn_t`` in ``value``.

Each becomes a :class:`~gpumem.errors.CudaError` whose ``error_name`` is CUDA's
own name (``cudaErrorInvalidValue``, ``CUDA_ERROR_INVALID_VALUE``,
``NVML_ERROR_NOT_SUPPORTED``), so a message can be searched for in NVIDIA's
documentation. Out-of-memory errors are recognised by :func:`is_out_of_memory`;
:class:`~gpumem.cuda.CudaDevice` turns them into
:class:`~gpumem.errors.OutOfMemoryError` with the device's free and total bytes,
because only the device knows the size that was asked for.
"""

from __future__ import annotations

from typing import Any

from gpumem.errors import BackendUnavailableError, CudaError, UnsupportedOperationError

#: Names CUDA uses for "not enough device memory" (runtime API, driver API, NVML).
OUT_OF_MEMORY_NAMES = frozenset({"cudaErrorMemoryAllocation", "CUDA_ERROR_OUT_OF_MEMORY", "NVML_ERROR_MEMORY"})

#: ``cudaError_t`` values this package treats specially, for messages that do not carry the name.
_RUNTIME_ERROR_NAMES = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    35: "cudaErrorInsufficientDriver",
    100: "cudaErrorNoDevice",
    101: "cudaErrorInvalidDevice",
    400: "cudaErrorInvalidResourceHandle",
    214: "cudaErrorECCUncorrectable",
    600: "cudaErrorNotReady",
    700: "cudaErrorIllegalAddress",
    714: "cudaErrorHardwareStackError",
    715: "cudaErrorIllegalInstruction",
    716: "cudaErrorMisalignedAddress",
    717: "cudaErrorInvalidAddressSpace",
    718: "cudaErrorInvalidPc",
    719: "cudaErrorLaunchFailure",
}

#: Errors after which the CUDA context is dead: every later call in the process fails with them
#: ("sticky" errors in NVIDIA's documentation). gpumem reports them as a lost device.
STICKY_ERROR_NAMES = frozenset({
    "cudaErrorECCUncorrectable", "cudaErrorIllegalAddress", "cudaErrorHardwareStackError",
    "cudaErrorIllegalInstruction", "cudaErrorMisalignedAddress", "cudaErrorInvalidAddressSpace",
    "cudaErrorInvalidPc", "cudaErrorLaunchFailure",
    "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC", "CUDA_ERROR_LAUNCH_FAILED",
})


def is_sticky(error_name: str) -> bool:
    """Whether ``error_name`` leaves the CUDA context unusable (see :data:`STICKY_ERROR_NAMES`)."""
    return error_name in STICKY_ERROR_NAMES

#: ``cudaSuccess`` and ``cudaErrorNotReady``: what ``cudaEventQuery`` returns for a complete and a pending event.
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600


def runtime_status_name(status: int) -> str:
    """CUDA's name for a ``cudaError_t`` number (``"cudaError(123)"`` for ones this package does not list)."""
    return _RUNTIME_ERROR_NAMES.get(status, f"cudaError({status})")


class VmmUnavailableError(UnsupportedOperationError, BackendUnavailableError):
    """Virtual memory management was called but cuda-bindings is missing.

    Both an :class:`~gpumem.errors.UnsupportedOperationError` (what a device
    without VMM raises, so callers that fall back to ``malloc`` keep working)
    and a :class:`~gpumem.errors.BackendUnavailableError` (an ``ImportError``:
    the fix is to install a package).
    """


def is_out_of_memory(error_name: str) -> bool:
    """Whether ``error_name`` is one of CUDA's out-of-memory errors."""
    return error_name in OUT_OF_MEMORY_NAMES


def runtime_error_name(exc: BaseException) -> str:
    """CUDA's name for the error in a CuPy ``CUDARuntimeError`` (``"cudaErrorMemoryAllocation"``)."""
    head = str(exc).split(":", 1)[0].strip()
    if head.startswith(("cudaError", "hipError")) and " " not in head:
        return head
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return runtime_status_name(status)
    return f"cudaError({status})" if status is not None else type(exc).__name__


def from_runtime_error(call: str, exc: BaseException) -> CudaError:
    """A :class:`CudaError` for a failed CuPy runtime call named ``call`` (``"cudaMalloc"``)."""
    return CudaError(call, runtime_error_name(exc), str(exc))


def driver_error_name(driver: Any, result: Any) -> str:
    """CUDA's name for a ``CUresult`` (``"CUDA_ERROR_OUT_OF_MEMORY"``)."""
    try:
        err, name = driver.cuGetErrorName(result)
        if err == driver.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - fall back to the enum's own name
        pass
    name = getattr(result, "name", None)
    return name if isinstance(name, str) else f"CUresult({int(result)})"


def check_driver(driver: Any, call: str, result: Any) -> Any:
    """Unpack a cuda-bindings result tuple, raising :class:`CudaError` unless it is ``CUDA_SUCCESS``.

    ``(CUDA_SUCCESS,)`` gives ``None``, ``(CUDA_SUCCESS, x)`` gives ``x`` and longer
    tuples give the tuple of values.
    """
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    if status != driver.CUresult.CUDA_SUCCESS:
        name = driver_error_name(driver, status)
        detail = ""
        try:
            err, text = driver.cuGetErrorString(status)
            if err == driver.CUresult.CUDA_SUCCESS and text:
                detail = text.decode() if isinstance(text, bytes) else str(text)
        except Exception:  # noqa: BLE001 - the name alone is enough
            pass
        raise CudaError(call, name, detail)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def driver_call(driver: Any, call: str, *args: Any) -> Any:
    """Call ``driver.<call>(*args)`` and :func:`check_driver` the result.

    Exceptions the bindings raise themselves (a missing ``libcuda.so``, a bad
    argument type) become :class:`CudaError` too, named after the exception.
    """
    try:
        result = getattr(driver, call)(*args)
    except CudaError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the bindings raise is a failed CUDA call to us
        raise CudaError(call, type(exc).__name__, str(exc)) from exc
    return check_driver(driver, call, result)


def nvml_error_name(nvml: Any, exc: BaseException) -> str:
    """NVML's name for the error in an ``NVMLError`` (``"NVML_ERROR_NOT_SUPPORTED"``)."""
    value = getattr(exc, "value", None)
    if value is not None and nvml is not None:
        for attr in dir(nvml):
            if attr.startswith("NVML_ERROR_") and getattr(nvml, attr) == value:
                return attr
    return f"NVML error {value}" if value is not None else type(exc).__name__


def from_nvml_error(nvml: Any, call: str, exc: BaseException) -> CudaError:
    """A :class:`CudaError` for a failed NVML call."""
    return CudaError(call, nvml_error_name(nvml, exc), str(exc))


__all__ = [
    "STICKY_ERROR_NAMES", "is_sticky", "runtime_status_name",
    "OUT_OF_MEMORY_NAMES", "VmmUnavailableError", "is_out_of_memory", "runtime_error_name", "from_runtime_error",
    "driver_error_name", "check_driver", "driver_call", "nvml_error_name", "from_nvml_error",
]
