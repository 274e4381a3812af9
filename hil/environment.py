"""What a HIL record says about the machine: the device, its driver and CUDA versions, package versions.

:func:`probe` runs in a process of its own (``python -m hil env --device SPEC --json``), so the
runner never holds a CUDA context itself: a context in the runner would take about half a GiB of the
card from every suite and every peer it measures (Note [The runner holds no CUDA context] in
:mod:`hil.runner`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import platform
import socket
from importlib import metadata
from typing import Any

__all__ = ["DISTRIBUTIONS", "EnvironmentReport", "package_versions", "probe", "sim_profile_for"]

#: Distributions whose versions a record names (those installed).
DISTRIBUTIONS: tuple[str, ...] = (
    "gpumem", "numpy", "simpy", "pytest", "hypothesis", "cupy-cuda13x", "cupy-cuda12x", "cuda-bindings",
    "cuda-python", "nvidia-ml-py", "torch", "rmm-cu13", "rmm-cu12", "librmm-cu13", "rapids-logger", "transformers",
)


def package_versions() -> dict[str, str]:
    """Python's version and every installed distribution of :data:`DISTRIBUTIONS`."""
    out = {"python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


@dataclasses.dataclass
class EnvironmentReport:
    """One device as the record names it, and the software around it."""

    spec: str
    kind: str
    name: str | None
    properties: dict[str, Any] | None
    total_nbytes: int | None
    free_nbytes_at_open: int | None
    driver_version: str | None
    cuda_driver_version: str | None
    cuda_runtime_version: str | None
    torch_cuda_version: str | None
    engine: str
    compute_sanitizer: str | None
    versions: dict[str, str]
    host: str
    platform: str
    probed_utc: str
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _cuda_version(number: int) -> str:
    """CUDA's encoded version (13000) as text (``13.0``)."""
    return f"{number // 1000}.{(number % 1000) // 10}"


def _nvml_driver_version() -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver: the record says unknown
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def _cuda_versions() -> tuple[str | None, str | None]:
    try:
        import cupy
    except ImportError:
        return None, None
    try:
        return (_cuda_version(cupy.cuda.runtime.driverGetVersion()), _cuda_version(cupy.cuda.runtime.runtimeGetVersion()))
    except Exception:  # noqa: BLE001 - no driver: unknown
        return None, None


def _torch_cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return getattr(torch.version, "cuda", None)


def _sanitizer_text() -> str | None:
    from hil.sanitizer import find_compute_sanitizer, sanitizer_version

    exe = find_compute_sanitizer()
    if exe is None:
        return None
    return sanitizer_version(exe) or "installed (version unknown)"


def probe(spec: str) -> EnvironmentReport:
    """Open ``spec`` once and describe it; ``error`` says why when it cannot be opened."""
    import gpumem
    from gpumem.native import engine

    kind = "sim" if spec.startswith("sim:") else "cuda" if spec.startswith("cuda") else "other"
    name = props = total = free = None
    error = None
    try:
        with gpumem.open_device(spec) as dev:
            p = dev.properties()
            props = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
            name = p.name
            info = dev.mem_info()
            total, free = info.total_nbytes, info.free_nbytes
    except Exception as exc:  # noqa: BLE001 - reported, the runner stops with it
        error = f"{type(exc).__name__}: {exc}"
    driver = cuda_drv = cuda_rt = None
    if kind == "cuda":
        driver = _nvml_driver_version()
        cuda_drv, cuda_rt = _cuda_versions()
    return EnvironmentReport(
        spec=spec, kind=kind, name=name, properties=props, total_nbytes=total, free_nbytes_at_open=free,
        driver_version=driver, cuda_driver_version=cuda_drv, cuda_runtime_version=cuda_rt,
        torch_cuda_version=_torch_cuda() if kind == "cuda" else None, engine=engine(),
        compute_sanitizer=_sanitizer_text() if kind == "cuda" else None, versions=package_versions(),
        host=socket.gethostname(), platform=platform.platform(),
        probed_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), error=error)


def sim_profile_for(name: str | None, total_nbytes: int | None) -> str:
    """The simulated profile that models a real device: the one with its name (and the nearest total),
    else ``sim:h200-141gb``, the card the simulator is calibrated on."""
    from gpumem.sim.profiles import BUILTIN_PROFILES

    if name:
        same = [p for p in BUILTIN_PROFILES if p.display_name == name]
        if same:
            best = min(same, key=lambda p: abs(p.total_nbytes - (total_nbytes or p.total_nbytes)))
            return f"sim:{best.name}"
    return "sim:h200-141gb"
