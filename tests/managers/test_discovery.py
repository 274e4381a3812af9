"""Backend discovery: CUDA through a fake NVML (the injection gpumem.cuda.nvml supports), the real no-GPU path
of this machine, the simulator, host memory, selection and its refusals, init with a memory check."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cuda_adapter"))

from cuda_fakes import Fakes, FakeNvml, fake_gpu  # noqa: E402

from gpumem import sim  # noqa: E402
from gpumem.errors import DeviceNotFoundError, InvalidArgumentError  # noqa: E402
from gpumem.discovery import (BackendDevice, BackendInfo, BackendKind, NoSuitableBackendError,  # noqa: E402
                              backends_as_json, best_available_backend, discover_backends, format_backend_summary,
                              host_memory, init_backend_with_memory_check, parse_meminfo, print_backend_summary,
                              select_backend_for_model)

GiB = 2**30


class CcNvml(FakeNvml):
    """The fake NVML with ``nvmlDeviceGetCudaComputeCapability`` (what discovery reads as the compute capability)."""

    def nvmlDeviceGetCudaComputeCapability(self, h: dict):  # noqa: N802
        self._enter("nvmlDeviceGetCudaComputeCapability")
        return h.get("cc", (9, 0))


@pytest.fixture(autouse=True)
def _no_visible_devices_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _cuda(backends):
    return next(b for b in backends if b.kind is BackendKind.CUDA)


def _two_gpus():
    small = {**fake_gpu(0, total=24 * GiB, used=2 * GiB), "name": "NVIDIA L4", "cc": (8, 9)}
    big = fake_gpu(1, used=10 * GiB)
    return CcNvml([small, big])


def test_cuda_devices_through_fake_nvml():
    nvml = _two_gpus()
    backends = discover_backends(nvml=nvml, cupy_available=True)
    assert [b.kind for b in backends] == [BackendKind.CUDA, BackendKind.SIM, BackendKind.CPU]
    cuda = _cuda(backends)
    assert cuda.available and cuda.reason == "" and cuda.real_compute
    d0, d1 = cuda.devices
    assert (d0.spec, d0.name, d0.total_nbytes, d0.free_nbytes, d0.compute_capability) == (
        "cuda:0", "NVIDIA L4", 24 * GiB, 22 * GiB, (8, 9))
    assert d1.spec == "cuda:1" and d1.free_nbytes == 150_754_820_096 - 10 * GiB and d1.compute_capability == (9, 0)
    assert d0.unified_memory is None and d0.vmm_supported is None  # unknown without a CUDA context
    assert nvml.inits == 0  # NVML shut down again


def test_discovery_creates_no_cuda_context(monkeypatch):
    """Only NVML is used: the CUDA runtime (CuPy), which would create a context, is never loaded."""
    import gpumem.cuda.backend as backend

    def refuse(*args, **kwargs):
        raise AssertionError("discovery must not load the CUDA runtime")

    monkeypatch.setattr(backend, "load_backend", refuse)
    monkeypatch.setattr(backend, "import_runtime", refuse)
    cuda = _cuda(discover_backends(nvml=_two_gpus(), cupy_available=True))
    assert cuda.available and len(cuda.devices) == 2


def test_compute_capability_missing_from_old_nvml_is_none():
    cuda = _cuda(discover_backends(nvml=FakeNvml([fake_gpu(0)]), cupy_available=True))
    assert cuda.available and cuda.devices[0].compute_capability is None


class DriverNvml(FakeNvml):
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_NO_PERMISSION = 4


@pytest.mark.parametrize("error, reason", [
    (12, "no NVIDIA driver (libnvidia-ml not found)"),
    (9, "the NVIDIA driver is not loaded"),
    (4, "no permission to use the NVIDIA driver"),
    (3, "NVML could not start"),
])
def test_cuda_unavailable_says_why(error, reason):
    cuda = _cuda(discover_backends(nvml=DriverNvml(init_error=error), cupy_available=True))
    assert not cuda.available and cuda.devices == () and reason in cuda.reason


def test_cuda_no_gpu_and_hidden_gpus(monkeypatch):
    assert "found no GPU" in _cuda(discover_backends(nvml=CcNvml([]), cupy_available=True)).reason
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    cuda = _cuda(discover_backends(nvml=_two_gpus(), cupy_available=True))
    assert not cuda.available and "CUDA_VISIBLE_DEVICES='-1' hides every GPU (2 found" in cuda.reason


def test_cuda_visible_devices_renumbers(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cuda = _cuda(discover_backends(nvml=_two_gpus(), cupy_available=True))
    assert [(d.spec, d.name) for d in cuda.devices] == [("cuda:0", "NVIDIA H200")]


def test_gpus_without_cupy_are_listed_but_unavailable():
    cuda = _cuda(discover_backends(nvml=_two_gpus(), cupy_available=False))
    assert not cuda.available and len(cuda.devices) == 2
    assert "needs CuPy" in cuda.reason and "gpumem[cuda12]" in cuda.reason


def test_nvml_failing_mid_listing_is_a_reason():
    nvml = _two_gpus()
    nvml.fail["nvmlDeviceGetCount"] = 3
    cuda = _cuda(discover_backends(nvml=nvml, cupy_available=True))
    assert not cuda.available and "could not list" in cuda.reason and nvml.inits == 0


def test_real_path_on_this_machine():
    """Whatever this machine has: a consistent answer, and a reason whenever CUDA is unavailable."""
    backends = discover_backends()
    cuda = _cuda(backends)
    assert cuda.available or cuda.reason
    if not cuda.available and "pynvml" not in sys.modules:
        assert "nvidia-ml-py" in cuda.reason or "driver" in cuda.reason or "GPU" in cuda.reason
    simb = next(b for b in backends if b.kind is BackendKind.SIM)
    assert simb.available and not simb.real_compute
    assert [d.spec for d in simb.devices] == [p.spec for p in sim.BUILTIN_PROFILES]
    h200 = next(d for d in simb.devices if d.spec == "sim:h200-141gb")
    assert h200.compute_capability == (9, 0) and h200.unified_memory is False and h200.vmm_supported
    nano = simb.devices[0]
    assert nano.unified_memory is True and nano.free_nbytes < nano.total_nbytes
    cpu = next(b for b in backends if b.kind is BackendKind.CPU)
    assert cpu.available and 0 < cpu.devices[0].free_nbytes <= cpu.devices[0].total_nbytes


def test_parse_meminfo():
    text = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\nHugePages_Total: 0\n"
    assert parse_meminfo(text) == (16_000_000 * 1024, 8_000_000 * 1024)
    old = "MemTotal: 100 kB\nMemFree: 10 kB\nBuffers: 5 kB\nCached: 20 kB\n"
    assert parse_meminfo(old) == (100 * 1024, 35 * 1024)
    with pytest.raises(InvalidArgumentError, match="MemTotal"):
        parse_meminfo("nothing here")


def test_host_memory_falls_back_to_sysconf(tmp_path):
    total, free = host_memory(str(tmp_path / "missing"))
    assert total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") and 0 <= free <= total


# -- best available and selection --------------------------------------------------------------------------
def _backends(cuda_free=(22 * GiB, 140 * GiB), cpu_free=8 * GiB, cuda_ok=True):
    # each GPU: 2 GiB used by others, the rest free (the selection applies the reserve rule to these)
    devs = tuple(BackendDevice(f"cuda:{i}", f"GPU {i}", f + 2 * GiB, f, (9, 0)) for i, f in enumerate(cuda_free))
    cuda = BackendInfo(BackendKind.CUDA, cuda_ok, devs if cuda_ok else (), "" if cuda_ok else "no NVIDIA driver")
    simb = discover_backends(nvml=FakeNvml(init_error=12))[1]
    cpu = BackendInfo(BackendKind.CPU, True, (BackendDevice("cpu", "host", 16 * GiB, cpu_free),))
    return [cuda, simb, cpu]


def test_best_available_is_a_gpu_then_the_cpu_never_the_simulator():
    assert best_available_backend(_backends()).kind is BackendKind.CUDA
    assert best_available_backend(_backends(cuda_ok=False)).kind is BackendKind.CPU
    no_cpu = [b for b in _backends(cuda_ok=False) if b.kind is not BackendKind.CPU]
    with pytest.raises(NoSuitableBackendError, match="no NVIDIA driver"):
        best_available_backend(no_cpu)


def test_select_prefers_the_gpu_with_most_free_memory():
    sel = select_backend_for_model(20 * GiB, backends=_backends())
    assert sel.backend is BackendKind.CUDA and sel.spec == "cuda:1" and sel.required_nbytes == 20 * GiB
    # ties go to the lower index
    assert select_backend_for_model(GiB, backends=_backends(cuda_free=(5 * GiB, 5 * GiB))).spec == "cuda:0"


def test_select_falls_back_to_cpu_and_names_what_was_tried():
    sel = select_backend_for_model(7 * GiB, backends=_backends(cuda_free=(4 * GiB, 6 * GiB)))
    assert sel.backend is BackendKind.CPU
    with pytest.raises(NoSuitableBackendError) as info:
        select_backend_for_model(9 * GiB, backends=_backends(cuda_free=(4 * GiB, 6 * GiB)))
    err = info.value
    assert [a.spec for a in err.attempts] == ["cuda:1", "cuda:0", "cpu"]
    assert "6.00 GiB free" in err.attempts[0].reason and "9.00 GiB needed" in err.attempts[0].reason
    assert "cuda:1" in str(err) and "cpu" in str(err) and err.required_nbytes == 9 * GiB


def test_select_never_picks_the_simulator_unasked():
    with pytest.raises(NoSuitableBackendError) as info:
        select_backend_for_model(100 * GiB, backends=_backends(cuda_ok=False))
    assert not any(a.spec.startswith("sim") for a in info.value.attempts)
    assert info.value.attempts[0].spec == "cuda" and "no NVIDIA driver" in info.value.attempts[0].reason


def test_select_sim_gives_the_smallest_profile_with_room():
    sel = select_backend_for_model(13 * GiB, "sim", backends=_backends())
    assert sel.spec == "sim:t4-16gb"  # 13.03 GiB usable there (Note [Selection by usable memory])
    sel = select_backend_for_model(GiB, ["cuda:0", "sim:a100-80gb"], backends=_backends(cuda_free=(GiB // 2, 0)))
    assert sel.spec == "sim:a100-80gb"
    assert select_backend_for_model(GiB, "sim:h200", backends=_backends()).spec == "sim:h200-141gb"
    with pytest.raises(NoSuitableBackendError, match=r"sim:h200-141gb: 125\.31 GiB usable \(139"):
        select_backend_for_model(200 * GiB, "sim", backends=_backends())


def test_select_a_device_that_does_not_exist():
    with pytest.raises(NoSuitableBackendError, match="cuda:7: no such device; cuda has cuda:0, cuda:1"):
        select_backend_for_model(GiB, "cuda:7", backends=_backends())


@pytest.mark.parametrize("required", [0, -1, 1.5, True, "1GiB", None])
def test_select_bad_size(required):
    with pytest.raises(InvalidArgumentError, match="required_bytes"):
        select_backend_for_model(required, backends=_backends())


@pytest.mark.parametrize("preference, error", [
    ("tpu", InvalidArgumentError), ([], InvalidArgumentError), (3, InvalidArgumentError), ([1], InvalidArgumentError),
    ("cuda:x", InvalidArgumentError), ("sim:nope-1gb", DeviceNotFoundError),
    ("sim:t4-16gb?pressure=step", InvalidArgumentError),
])
def test_select_bad_preference(preference, error):
    backends = _backends()
    before = [b.as_json() for b in backends]
    with pytest.raises(error):
        select_backend_for_model(GiB, preference, backends=backends)
    assert [b.as_json() for b in backends] == before


def test_preference_as_backend_kind():
    assert select_backend_for_model(GiB, BackendKind.CPU, backends=_backends()).spec == "cpu"


# -- init with a memory check -------------------------------------------------------------------------------
def test_init_opens_a_simulated_device_and_checks_memory():
    with init_backend_with_memory_check("sim", 3 * GiB) as ib:
        assert ib.backend is BackendKind.SIM and ib.device is not None
        assert ib.selection.spec == "sim:gtx-1650-4gb" and ib.device.spec == "sim:gtx-1650-4gb"
        assert ib.free_nbytes == ib.device.mem_info().free_nbytes >= 3 * GiB
        # the skipped smaller profiles are named with their reasons
        assert [a.spec for a in ib.refused] == ["sim:jetson-nano-2gb", "sim:gtx-1050-2gb", "sim:jetson-nano-4gb"]
    assert ib.device.closed


def test_init_tries_the_next_gpu_when_the_context_leaves_too_little():
    """cuda:0 looks big enough through NVML, but once open (context created) it is not: cuda:1 is used."""
    busy = Fakes(device_count=2, total_nbytes=8 * GiB)
    busy.runtime.used_nbytes = 7 * GiB  # another process took memory since NVML was read
    idle = Fakes(device_count=2, total_nbytes=8 * GiB)
    opened: list[str] = []

    def opener(spec: str):
        opened.append(spec)
        return (busy if spec == "cuda:0" else idle).open(int(spec.partition(":")[2]))

    backends = _backends(cuda_free=(6 * GiB, 5 * GiB))
    ib = init_backend_with_memory_check("cuda", 4 * GiB, backends=backends, opener=opener)
    try:
        assert opened == ["cuda:0", "cuda:1"] and ib.selection.spec == "cuda:1"
        assert ib.refused[0].spec == "cuda:0" and "once open" in ib.refused[0].reason
    finally:
        ib.close()


def test_init_names_a_device_that_fails_to_open():
    from gpumem.errors import BackendUnavailableError

    def opener(spec: str):
        raise BackendUnavailableError("CUDA devices need CuPy")

    with pytest.raises(NoSuitableBackendError, match="cuda:1: could not be opened: BackendUnavailableError"):
        init_backend_with_memory_check(None, 100 * GiB, backends=_backends(), opener=opener)


def test_init_cpu_opens_nothing():
    ib = init_backend_with_memory_check("cpu", 1024, backends=_backends())
    assert ib.device is None and ib.backend is BackendKind.CPU and ib.free_nbytes >= 1024
    ib.close()


def test_init_bad_input():
    with pytest.raises(InvalidArgumentError):
        init_backend_with_memory_check("sim", 0)
    with pytest.raises(InvalidArgumentError):
        init_backend_with_memory_check("gpu", GiB)


# -- the summary ---------------------------------------------------------------------------------------------
def test_summary_text_and_json():
    backends = discover_backends(nvml=_two_gpus(), cupy_available=True)
    out = io.StringIO()
    print_backend_summary(out, backends=backends)
    text = out.getvalue()
    assert text == format_backend_summary(backends) + "\n"
    assert "cuda: available" in text and "cuda:1" in text and "NVIDIA L4" in text and " 8.9 " in text
    assert "sim: available (memory only, no compute" in text and "sim:jetson-nano-2gb" in text
    assert "best available: cuda (cuda:0 and 1 more)" in text
    data = backends_as_json(backends)
    json.dumps(data)
    assert data["best_available"] == "cuda"
    assert data["backends"][0]["devices"][0]["compute_capability"] == [8, 9]
    no_gpu = discover_backends(nvml=FakeNvml(init_error=12))
    text = format_backend_summary(no_gpu)
    assert "cuda: unavailable: no NVIDIA driver (libnvidia-ml not found)" in text
    assert "best available: cpu" in text


# -- Note [Selection by usable memory] --------------------------------------------------------------
@pytest.mark.parametrize("spec", ["sim:t4-16gb", "sim:gtx-1050-2gb", "sim:h200-141gb"])
def test_selection_uses_the_managers_usable_memory_at_the_edge(spec):
    """Selected for exactly the manager's usable memory, refused one byte above: the raw free memory
    (what it compared before) selected sim:t4-16gb for 14.2 GiB, which its manager refuses."""
    from gpumem.discovery import select_backend_for_model
    from gpumem.managers import GpuMemoryManager

    with GpuMemoryManager(spec) as m:
        usable = m.usable_memory
        assert m.allocate(usable) is not None  # the manager accepts it
    assert select_backend_for_model(usable, spec).spec == spec
    with pytest.raises(NoSuitableBackendError, match="usable"):
        select_backend_for_model(usable + 1, spec)


def test_14_2_gib_does_not_select_the_t4():
    import gpumem
    from gpumem.discovery import select_backend_for_model

    assert select_backend_for_model(int(14.2 * gpumem.GiB), "sim").spec != "sim:t4-16gb"
