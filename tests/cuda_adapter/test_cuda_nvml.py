"""NVML: listing GPUs without a CUDA context, other processes, NVML's memory figures."""

from __future__ import annotations

import os

import pytest
from cuda_fakes import FakeNvml, Fakes, fake_gpu

from gpumem import BackendUnavailableError, CudaError
from gpumem.cuda import CudaDeviceSummary, GpuProcess, NvmlMemoryInfo, list_cuda_devices
from gpumem.cuda.nvml import NvmlSession, _visible_indices


@pytest.fixture(autouse=True)
def _no_visible_devices_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_list_cuda_devices():
    nvml = FakeNvml([fake_gpu(0), fake_gpu(1, used=10 * 2**30)])
    devices = list_cuda_devices(nvml)
    assert [d.index for d in devices] == [0, 1]
    d1 = devices[1]
    assert isinstance(d1, CudaDeviceSummary)
    assert d1.name == "NVIDIA H200" and d1.uuid.startswith("GPU-00000001")
    assert d1.total_bytes == 150_754_820_096 and d1.free_bytes == 150_754_820_096 - 10 * 2**30
    assert d1.total_nbytes == d1.total_bytes and d1.free_nbytes == d1.free_bytes and d1.spec == "cuda:1"
    assert nvml.inits == 0  # shut down again


def test_list_honours_cuda_visible_devices(monkeypatch):
    nvml = FakeNvml([fake_gpu(i) for i in range(4)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    devices = list_cuda_devices(nvml)
    assert [(d.index, d.uuid[:12]) for d in devices] == [(0, "GPU-00000002"), (1, "GPU-00000000")]


def test_visible_indices():
    uuids = [f"GPU-{i:08x}-x" for i in range(4)]
    assert _visible_indices(None, uuids) == [0, 1, 2, 3]
    assert _visible_indices("", uuids) == []
    assert _visible_indices("-1", uuids) == []
    assert _visible_indices("3, 1", uuids) == [3, 1]
    assert _visible_indices("1,7,2", uuids) == [1]  # CUDA stops at the first bad entry
    assert _visible_indices("1,1", uuids) == [1]
    assert _visible_indices("GPU-00000002,0", uuids) == [2, 0]
    assert _visible_indices("gpu-0000000", uuids) == []  # ambiguous prefix
    assert _visible_indices("MIG-abc", uuids) == []


@pytest.mark.parametrize("error", [12, 9])  # library not found, driver not loaded
def test_list_without_driver_is_empty(error, caplog):
    with caplog.at_level("DEBUG", logger="gpumem.cuda.nvml"):
        assert list_cuda_devices(FakeNvml(init_error=error)) == []
    assert "no CUDA devices listed" in caplog.text


def test_list_without_pynvml_is_empty(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert list_cuda_devices() == []


def test_list_with_no_gpu_is_empty():
    assert list_cuda_devices(FakeNvml([])) == []


def test_list_survives_a_failing_query():
    nvml = FakeNvml([fake_gpu(0)])
    nvml.fail["nvmlDeviceGetMemoryInfo"] = 3
    assert list_cuda_devices(nvml) == []
    assert nvml.inits == 0


def test_nvml_errors_are_cuda_errors_named_by_nvml():
    nvml = FakeNvml()
    with NvmlSession(nvml) as s:
        nvml.fail["nvmlDeviceGetCount"] = 3
        with pytest.raises(CudaError) as info:
            s.device_count()
    assert info.value.error_name == "NVML_ERROR_NOT_SUPPORTED" and info.value.call == "nvmlDeviceGetCount"
    assert nvml.inits == 0


def test_device_processes_and_nvml_memory(dev, fakes):
    procs = dev.processes()
    assert GpuProcess(os.getpid(), 600 * 2**20) in procs and GpuProcess(4242, 2**30) in procs
    assert dev.other_processes() == [GpuProcess(4242, 2**30)]
    info = dev.nvml_memory_info()
    assert info == NvmlMemoryInfo(150_754_820_096, 1_197_342_720, 150_754_820_096 - 1_197_342_720)
    assert fakes.nvml.inits == 1  # one session, kept while the device is open
    dev.close()
    assert fakes.nvml.inits == 0


def test_device_finds_its_gpu_by_pci_bus_id():
    f = Fakes(device_count=2)
    f.nvml.gpus.reverse()  # NVML order differs from CUDA order
    f.nvml.gpus[0]["processes"] = [(99, None)]
    dev = f.open(1)
    assert dev.other_processes() == [GpuProcess(99, None)]


def test_device_falls_back_to_nvml_index(fakes):
    fakes.runtime.deviceGetPCIBusId = None  # an old CuPy without it
    dev = fakes.open()
    assert len(dev.other_processes()) == 1


def test_device_without_pynvml():
    dev = Fakes(nvml=False).open()
    with pytest.raises(BackendUnavailableError, match="nvidia-ml-py"):
        dev.other_processes()


def test_device_nvml_failure_is_a_cuda_error(fakes):
    dev = fakes.open()
    fakes.nvml.fail["nvmlDeviceGetComputeRunningProcesses"] = 3
    with pytest.raises(CudaError, match="NVML_ERROR_NOT_SUPPORTED"):
        dev.other_processes()
    assert dev.other_processes()  # works again


def test_session_without_pynvml(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(BackendUnavailableError, match=r"gpumem\[cuda13\]"):
        NvmlSession()
