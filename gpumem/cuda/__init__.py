"""gpumem on a real NVIDIA GPU: :class:`CudaDevice` and friends.

Install the extra that matches your CUDA version (the NVIDIA driver decides):

.. code-block:: console

    pip install "gpumem[cuda12]"   # CUDA 12.x: cupy-cuda12x, cuda-bindings 12, nvidia-ml-py
    pip install "gpumem[cuda13]"   # CUDA 13.x (driver >= 580): cupy-cuda13x, cuda-bindings 13, nvidia-ml-py

Importing this package needs none of them: the third-party libraries are
imported when a device is opened (:mod:`gpumem.cuda.backend`), and a missing
one raises :class:`~gpumem.errors.BackendUnavailableError` saying which extra
to install. :func:`list_cuda_devices` never raises for "no GPU here": it
returns an empty list.

The modules:

* :mod:`~gpumem.cuda.device` - :class:`CudaDevice`, the :class:`gpumem.Device` for ``"cuda:<index>"``;
* :mod:`~gpumem.cuda.vmm` - the driver's virtual memory calls (``cuMemCreate``, ``cuMemMap``...);
* :mod:`~gpumem.cuda.nvml` - NVML: memory per GPU and per process, listing GPUs without a CUDA context;
* :mod:`~gpumem.cuda.errors` - CUDA, driver and NVML errors as :mod:`gpumem.errors` exceptions;
* :mod:`~gpumem.cuda.backend` - importing CuPy, cuda-bindings and nvidia-ml-py.
"""

from .backend import INSTALL_HINT, CudaBackend, load_backend
from .device import CudaDevice
from .errors import VmmUnavailableError
from .nvml import CudaDeviceSummary, GpuProcess, NvmlMemoryInfo, list_cuda_devices

__all__ = [
    "CudaDevice", "CudaBackend", "load_backend", "INSTALL_HINT", "VmmUnavailableError",
    "list_cuda_devices", "CudaDeviceSummary", "GpuProcess", "NvmlMemoryInfo",
]
