"""Importing the CUDA libraries, and translating their errors."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from cuda_fakes import CUresult, FakeCUDARuntimeError, FakeDriver, FakeNvml, FakeNVMLError, FakeRuntime

from gpumem import BackendUnavailableError, CudaError, open_device
from gpumem.cuda import backend as backend_mod
from gpumem.cuda.errors import (
    check_driver,
    driver_call,
    driver_error_name,
    from_runtime_error,
    is_out_of_memory,
    nvml_error_name,
    runtime_error_name,
)


@pytest.fixture
def no_cuda_packages(monkeypatch):
    """Make CuPy, cuda-bindings and pynvml unimportable, whatever is installed."""
    for name in ("cupy", "cupy.cuda", "cuda", "cuda.bindings", "cuda.cuda", "pynvml"):
        monkeypatch.setitem(sys.modules, name, None)
    backend_mod.load_backend.cache_clear()
    yield
    backend_mod.load_backend.cache_clear()


def test_import_needs_no_cuda_packages():
    code = ("import sys; sys.modules.update(cupy=None, pynvml=None, cuda=None); "
            "import gpumem.cuda, gpumem.cuda.device; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cuda', 'pynvml') "
            "and sys.modules[m] is not None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": ".", "PATH": ""}, cwd=_repo_root())
    assert out.stdout.strip() == "[]"


def _repo_root() -> str:
    import os

    import gpumem

    return os.path.dirname(os.path.dirname(gpumem.__file__))


def test_missing_cupy_names_both_extras(no_cuda_packages):
    with pytest.raises(BackendUnavailableError) as info:
        backend_mod.load_backend()
    msg = str(info.value)
    assert 'pip install "gpumem[cuda12]"' in msg and 'pip install "gpumem[cuda13]"' in msg
    assert "CUDA 12" in msg and "CUDA 13" in msg and "CuPy" in msg
    assert isinstance(info.value, ImportError)


def test_open_device_without_cupy(no_cuda_packages):
    with pytest.raises(BackendUnavailableError, match=r"gpumem\[cuda12\].*gpumem\[cuda13\]"):
        open_device("cuda:0")


def test_missing_driver_and_nvml_are_optional(no_cuda_packages):
    driver, why = backend_mod.import_driver()
    assert driver is None and "cuda-bindings" in why and "gpumem[cuda12]" in why
    nvml, why = backend_mod.import_nvml()
    assert nvml is None and "nvidia-ml-py" in why


def test_load_backend_with_only_cupy(no_cuda_packages, monkeypatch):
    fake_cupy_cuda = SimpleNamespace(runtime=FakeRuntime())
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=fake_cupy_cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake_cupy_cuda)
    b = backend_mod.load_backend()
    assert b.runtime is fake_cupy_cuda.runtime and b.runtime_error is FakeCUDARuntimeError
    assert b.driver is None and b.nvml is None and "cuda-bindings" in b.driver_missing


def test_legacy_cuda_python_module_is_used(no_cuda_packages, monkeypatch):
    legacy = SimpleNamespace(cuda=object())
    monkeypatch.setitem(sys.modules, "cuda", legacy)
    monkeypatch.setitem(sys.modules, "cuda.cuda", legacy.cuda)
    driver, why = backend_mod.import_driver()
    assert driver is legacy.cuda and why == ""


# -- error translation ---------------------------------------------------------------------------------------


def test_runtime_error_names():
    assert runtime_error_name(FakeCUDARuntimeError("cudaErrorMemoryAllocation")) == "cudaErrorMemoryAllocation"
    odd = RuntimeError("something unexpected")
    odd.status = 2
    assert runtime_error_name(odd) == "cudaErrorMemoryAllocation"
    odd.status = 999
    assert runtime_error_name(odd) == "cudaError(999)"
    assert runtime_error_name(ValueError("x")) == "ValueError"
    err = from_runtime_error("cudaMalloc", FakeCUDARuntimeError("cudaErrorMemoryAllocation"))
    assert err.call == "cudaMalloc" and err.error_name == "cudaErrorMemoryAllocation"
    assert str(err) == "cudaMalloc failed: cudaErrorMemoryAllocation (cudaErrorMemoryAllocation: out of memory)"


def test_out_of_memory_names():
    assert is_out_of_memory("cudaErrorMemoryAllocation") and is_out_of_memory("CUDA_ERROR_OUT_OF_MEMORY")
    assert not is_out_of_memory("cudaErrorInvalidValue")


def test_check_driver():
    d = FakeDriver(FakeRuntime())
    assert check_driver(d, "cuInit", (CUresult.CUDA_SUCCESS,)) is None
    assert check_driver(d, "cuX", (CUresult.CUDA_SUCCESS, 7)) == 7
    assert check_driver(d, "cuX", (CUresult.CUDA_SUCCESS, 7, 8)) == (7, 8)
    assert check_driver(d, "cuX", CUresult.CUDA_SUCCESS) is None
    with pytest.raises(CudaError) as info:
        check_driver(d, "cuMemCreate", (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None))
    assert info.value.error_name == "CUDA_ERROR_OUT_OF_MEMORY" and info.value.call == "cuMemCreate"
    assert "fake CUDA_ERROR_OUT_OF_MEMORY" in str(info.value)


def test_driver_error_name_falls_back_to_the_enum():
    broken = SimpleNamespace(CUresult=CUresult, cuGetErrorName=lambda e: (CUresult.CUDA_ERROR_INVALID_VALUE, None))
    assert driver_error_name(broken, CUresult.CUDA_ERROR_NOT_SUPPORTED) == "CUDA_ERROR_NOT_SUPPORTED"
    assert driver_error_name(broken, 12345) == "CUresult(12345)"


def test_driver_call_wraps_exceptions():
    def boom(*args):
        raise TypeError("bad argument")

    d = SimpleNamespace(CUresult=CUresult, cuMemMap=boom)
    with pytest.raises(CudaError, match="cuMemMap failed: TypeError"):
        driver_call(d, "cuMemMap", 1, 2)


def test_nvml_error_name():
    assert nvml_error_name(FakeNvml, FakeNVMLError(3)) == "NVML_ERROR_NOT_SUPPORTED"
    assert nvml_error_name(FakeNvml, FakeNVMLError(77)) == "NVML error 77"
    assert nvml_error_name(None, OSError("x")) == "OSError"
