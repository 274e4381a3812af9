"""Finding the third-party packages a real device needs, with errors that say what to install.

A :class:`~gpumem.cuda.CudaDevice` talks to the GPU through three packages, all
optional dependencies of gpumem (the ``cuda12`` and ``cuda13`` extras):

================  =====================  ==================================================
package           imported as            used for
================  =====================  ==================================================
CuPy              ``cupy.cuda.runtime``  ``cudaMalloc``/``cudaFree``, ``cudaMemGetInfo``,
                                         ``cudaMemcpy``, properties, synchronisation
cuda-bindings     ``cuda.bindings.       the driver's virtual memory management
                  driver`` (older:       (``cuMemCreate``, ``cuMemMap``...); without it a
                  ``cuda.cuda``)         device still works, with ``vmm_supported == False``
nvidia-ml-py      ``pynvml``             other processes on the GPU, NVML's memory figures,
                                         listing GPUs without creating a CUDA context
================  =====================  ==================================================

Nothing here is imported when :mod:`gpumem.cuda` is: only :func:`load_backend`
imports, so ``import gpumem.cuda`` works on a machine without any of them.

A :class:`CudaBackend` is the set of modules one device uses. Tests pass a
backend of fakes to :class:`~gpumem.cuda.CudaDevice` (``backend=``) to exercise
the bookkeeping and the error translation on a machine without a GPU.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from gpumem.errors import BackendUnavailableError

log = logging.getLogger(__name__)

#: What to tell a user whose environment lacks the CUDA packages. Which extra fits depends on
#: the NVIDIA driver: CUDA 13 needs driver 580 or newer; CUDA 12 works from driver 525.
INSTALL_HINT = (
    'install the extra matching your CUDA version: pip install "gpumem[cuda12]" '
    '(CUDA 12.x, NVIDIA driver >= 525) or pip install "gpumem[cuda13]" (CUDA 13.x, driver >= 580)'
)


@dataclass
class CudaBackend:
    """The modules a :class:`~gpumem.cuda.CudaDevice` calls.

    ``runtime`` behaves like ``cupy.cuda.runtime`` and raises ``runtime_error``
    (CuPy's ``CUDARuntimeError``, which has a ``status``) when a call fails.
    ``driver`` behaves like ``cuda.bindings.driver`` (calls return
    ``(CUresult, value...)`` tuples) or is ``None`` when cuda-bindings is
    missing; ``nvml`` behaves like ``pynvml`` or is ``None``. The ``*_missing``
    texts say why a module is ``None``.
    """

    runtime: Any
    runtime_error: type[BaseException]
    driver: Any | None = None
    driver_missing: str = ""
    nvml: Any | None = None
    nvml_missing: str = ""


def import_runtime() -> tuple[Any, type[BaseException]]:
    """``(cupy.cuda.runtime, CUDARuntimeError)``, or :class:`BackendUnavailableError` naming the extras."""
    try:
        from cupy.cuda import runtime  # noqa: PLC0415 - optional dependency, imported on demand
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install failing otherwise
        raise BackendUnavailableError(
            f"CUDA devices need CuPy, which could not be imported ({exc}); {INSTALL_HINT}") from exc
    return runtime, runtime.CUDARuntimeError


def import_driver() -> tuple[Any | None, str]:
    """``(driver module, "")``, or ``(None, why)`` when cuda-bindings is missing.

    cuda-bindings 12.6 and later provide ``cuda.bindings.driver``; older cuda-python
    releases provide the same API as ``cuda.cuda``.
    """
    try:
        from cuda.bindings import driver  # noqa: PLC0415
        return driver, ""
    except Exception as exc:  # noqa: BLE001 - optional: any failure means "not available"
        first = exc
    try:
        from cuda import cuda as driver  # type: ignore[no-redef]  # noqa: PLC0415
        return driver, ""
    except Exception:  # noqa: BLE001
        pass
    why = (f"cuda-bindings is not installed ({first}), so virtual memory management is unavailable; "
           f"{INSTALL_HINT}")
    log.debug(why)
    return None, why


def import_nvml() -> tuple[Any | None, str]:
    """``(pynvml, "")``, or ``(None, why)`` when nvidia-ml-py is missing."""
    try:
        import pynvml  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        why = f"nvidia-ml-py (pynvml) is not installed ({exc}); {INSTALL_HINT}"
        log.debug(why)
        return None, why
    return pynvml, ""


@functools.lru_cache(maxsize=1)
def load_backend() -> CudaBackend:
    """The real backend: CuPy (required), cuda-bindings and nvidia-ml-py (optional).

    Raises :class:`~gpumem.errors.BackendUnavailableError` naming both extras when
    CuPy is missing. Cached: the imports happen once per process (a failure is
    not cached, so installing CuPy and retrying works).
    """
    runtime, runtime_error = import_runtime()
    driver, driver_missing = import_driver()
    nvml, nvml_missing = import_nvml()
    return CudaBackend(runtime, runtime_error, driver, driver_missing, nvml, nvml_missing)


__all__ = ["CudaBackend", "INSTALL_HINT", "load_backend", "import_runtime", "import_driver", "import_nvml"]
