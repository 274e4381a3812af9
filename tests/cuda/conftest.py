"""Fixtures: a CudaDevice over fake CUDA libraries (see cuda_fakes.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cuda_fakes import FakeDriver, FakeNvml, FakeRuntime, fake_gpu  # noqa: E402

from gpumem.cuda import CudaBackend, CudaDevice  # noqa: E402


class Fakes:
    """The fake modules behind one device, for tests to inspect and to inject failures into."""

    def __init__(self, *, device_count: int = 1, vmm: bool | None = True, nvml: bool = True, **runtime_kw) -> None:
        self.runtime = FakeRuntime(device_count=device_count, **runtime_kw)
        self.driver = FakeDriver(self.runtime, vmm_supported=bool(vmm)) if vmm is not None else None
        self.nvml = FakeNvml([fake_gpu(i, processes=[(os.getpid(), 600 * 2**20), (4242, 2**30)])
                              for i in range(device_count)]) if nvml else None

    def backend(self) -> CudaBackend:
        return CudaBackend(
            runtime=self.runtime,
            runtime_error=FakeRuntime.CUDARuntimeError,
            driver=self.driver,
            driver_missing="" if self.driver else 'cuda-bindings is not installed; pip install "gpumem[cuda12]"',
            nvml=self.nvml,
            nvml_missing="" if self.nvml else "nvidia-ml-py is not installed",
        )

    def open(self, index: int = 0) -> CudaDevice:
        return CudaDevice(index, backend=self.backend())

    def device_calls(self) -> int:
        """How many calls reached CUDA (runtime and driver), to check that bad input reached none."""
        return len(self.runtime.calls) + (len(self.driver.calls) if self.driver else 0)


@pytest.fixture
def fakes() -> Fakes:
    return Fakes()


@pytest.fixture
def dev(fakes: Fakes):
    d = fakes.open()
    yield d
    d.close()
