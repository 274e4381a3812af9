"""Backend discovery on a real GPU (``pytest tests/managers --gpumem-device cuda:0``): NVML lists the GPU
without a CUDA context, the selection picks it, and the memory check opens it."""

from __future__ import annotations

import pytest

from gpumem.discovery import (BackendKind, best_available_backend, discover_backends,
                              init_backend_with_memory_check, select_backend_for_model)

pytestmark = pytest.mark.cuda


def test_real_gpu_is_discovered_and_opened(device):
    backends = discover_backends()
    cuda = backends[0]
    assert cuda.kind is BackendKind.CUDA and cuda.available, cuda.reason
    d0 = cuda.devices[0]
    assert d0.spec == "cuda:0" and 0 < d0.free_nbytes <= d0.total_nbytes
    assert d0.compute_capability is not None and d0.compute_capability >= (3, 0)
    assert best_available_backend(backends).kind is BackendKind.CUDA
    sel = select_backend_for_model(1 << 30, "cuda", backends=backends)
    assert sel.backend is BackendKind.CUDA
    with init_backend_with_memory_check(sel.spec, 1 << 30, backends=backends) as ib:
        assert ib.device is not None and ib.free_nbytes >= 1 << 30
        props = ib.device.properties()
        assert props.compute_capability == d0.compute_capability
        assert isinstance(props.unified_memory, bool)
