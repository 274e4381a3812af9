"""NVML (through nvidia-ml-py's ``pynvml``): what the driver knows about a GPU, without a CUDA context.

Why NVML and not just ``cudaMemGetInfo``? Two reasons:

* **No context.** Creating a CUDA context costs about 500 MiB of device memory
  and a second or so; NVML costs neither. ``gpumem devices`` lists GPUs with
  :func:`list_cuda_devices` without touching CUDA at all.
* **Who else is there.** ``cudaMemGetInfo`` says how much is free; NVML also
  says which *processes* hold memory (``nvmlDeviceGetComputeRunningProcesses``),
  which is what a user wants to know when an allocation fails on a shared GPU.

NVML's figures differ from CUDA's: its ``total`` is the whole framebuffer
(150,754,820,096 bytes on our H200, where ``cudaMemGetInfo`` says
150,109,880,320) and its ``used`` includes memory the driver reserves. Use
:meth:`~gpumem.cuda.CudaDevice.mem_info` for allocation decisions and NVML to
explain them.

Indices: NVML numbers GPUs in PCI bus order and ignores ``CUDA_VISIBLE_DEVICES``;
CUDA numbers only the visible GPUs, by default fastest first (the same order as
PCI on machines with identical GPUs). :func:`list_cuda_devices` applies
``CUDA_VISIBLE_DEVICES`` so that its ``index`` is the ``N`` of ``"cuda:N"``;
:class:`~gpumem.cuda.CudaDevice` finds its NVML handle by PCI bus id, which is
exact.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from gpumem.errors import BackendUnavailableError, CudaError

from .backend import import_nvml
from .errors import from_nvml_error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NvmlMemoryInfo:
    """NVML's view of a GPU's memory (``nvmlDeviceGetMemoryInfo``), every process and the driver included."""

    total_nbytes: int
    used_nbytes: int
    free_nbytes: int


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU (from ``nvmlDeviceGetComputeRunningProcesses``).

    ``used_nbytes`` is ``None`` where NVML cannot tell (under some virtualisation
    or without permission). ``pid`` is in the host's PID namespace, so inside a
    container it may not match ``os.getpid()``.
    """

    pid: int
    used_nbytes: int | None


@dataclass(frozen=True)
class CudaDeviceSummary:
    """One line of ``gpumem devices``: a GPU as NVML sees it, without creating a CUDA context.

    ``index`` is the ``N`` of ``"cuda:N"`` (see the module docstring about
    ``CUDA_VISIBLE_DEVICES``); ``total_bytes`` and ``free_bytes`` are NVML's.
    """

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    uuid: str

    @property
    def spec(self) -> str:
        """The device spec that opens this GPU: ``"cuda:<index>"``."""
        return f"cuda:{self.index}"

    @property
    def total_nbytes(self) -> int:
        """Same as ``total_bytes`` (gpumem's ``_nbytes`` naming)."""
        return self.total_bytes

    @property
    def free_nbytes(self) -> int:
        """Same as ``free_bytes``."""
        return self.free_bytes


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlSession:
    """``nvmlInit`` ... ``nvmlShutdown``, with every NVML error turned into :class:`~gpumem.errors.CudaError`.

    NVML counts initialisations, so sessions may overlap. Use as a context
    manager or call :meth:`close`. ``nvml`` is the ``pynvml`` module (or a
    fake); by default it is imported, and a missing nvidia-ml-py raises
    :class:`~gpumem.errors.BackendUnavailableError` naming the extras.
    """

    def __init__(self, nvml: Any | None = None) -> None:
        if nvml is None:
            nvml, why = import_nvml()
            if nvml is None:
                raise BackendUnavailableError(why)
        self.nvml = nvml
        self._open = False
        self.call("nvmlInit")
        self._open = True

    def call(self, name: str, *args: Any) -> Any:
        """``nvml.<name>(*args)``, raising :class:`CudaError` (``error_name`` like ``NVML_ERROR_NOT_SUPPORTED``)."""
        try:
            return getattr(self.nvml, name)(*args)
        except Exception as exc:  # noqa: BLE001 - NVMLError, or the library failing to load
            raise from_nvml_error(self.nvml, name, exc) from exc

    def device_count(self) -> int:
        return int(self.call("nvmlDeviceGetCount"))

    def device(self, index: int) -> "NvmlDevice":
        """The GPU with NVML index ``index`` (PCI bus order, all GPUs)."""
        return NvmlDevice(self, self.call("nvmlDeviceGetHandleByIndex", index))

    def device_by_pci_bus_id(self, pci_bus_id: str) -> "NvmlDevice":
        """The GPU at ``pci_bus_id`` (``"0000:18:00.0"``, as ``cudaDeviceGetPCIBusId`` gives it)."""
        return NvmlDevice(self, self.call("nvmlDeviceGetHandleByPciBusId", pci_bus_id.encode()))

    def close(self) -> None:
        """``nvmlShutdown``; idempotent, never raises (a failure is logged at debug level)."""
        if not self._open:
            return
        self._open = False
        try:
            self.call("nvmlShutdown")
        except CudaError as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    def __enter__(self) -> "NvmlSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NvmlDevice:
    """One GPU's NVML handle, valid while its :class:`NvmlSession` is open."""

    def __init__(self, session: NvmlSession, handle: Any) -> None:
        self.session = session
        self.handle = handle

    def _call(self, name: str, *args: Any) -> Any:
        return self.session.call(name, self.handle, *args)

    def name(self) -> str:
        return _text(self._call("nvmlDeviceGetName"))

    def uuid(self) -> str:
        """``"GPU-8f1c..."``: the identifier ``CUDA_VISIBLE_DEVICES`` also accepts."""
        return _text(self._call("nvmlDeviceGetUUID"))

    def memory_info(self) -> NvmlMemoryInfo:
        """``nvmlDeviceGetMemoryInfo``: total, used and free bytes of the whole GPU."""
        info = self._call("nvmlDeviceGetMemoryInfo")
        return NvmlMemoryInfo(int(info.total), int(info.used), int(info.free))

    def processes(self) -> list[GpuProcess]:
        """``nvmlDeviceGetComputeRunningProcesses``: every process with a CUDA context here, this one included."""
        procs = self._call("nvmlDeviceGetComputeRunningProcesses")
        out = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            out.append(GpuProcess(int(p.pid), None if used is None else int(used)))
        return out

    def max_memory_clock_khz(self) -> int:
        """``nvmlDeviceGetMaxClockInfo(NVML_CLOCK_MEM)`` in kHz (NVML reports MHz), as CUDA's ``memoryClockRate``."""
        return int(self._call("nvmlDeviceGetMaxClockInfo", self.session.nvml.NVML_CLOCK_MEM)) * 1000


def _visible_indices(env_value: str | None, uuids: list[str]) -> list[int]:
    """NVML indices of the GPUs CUDA makes visible, in CUDA's order, under ``CUDA_VISIBLE_DEVICES=env_value``.

    Entries are NVML/PCI indices or (prefixes of) ``GPU-`` UUIDs. Like CUDA, the
    list stops at the first entry that names no GPU (``"-1"`` hides them all);
    entries this function cannot map (MIG instances) also stop it, with a
    debug message.
    """
    if env_value is None:
        return list(range(len(uuids)))
    out: list[int] = []
    for raw in env_value.split(","):
        token = raw.strip()
        if token.isdigit():
            i = int(token)
            if i >= len(uuids):
                break
        elif token.upper().startswith("GPU-"):
            matches = [i for i, u in enumerate(uuids) if u.lower().startswith(token.lower())]
            if len(matches) != 1:
                break
            i = matches[0]
        else:
            if token and not token.lstrip("-").isdigit():
                log.debug("CUDA_VISIBLE_DEVICES entry %r is not an index or a GPU UUID; stopping there", token)
            break
        if i in out:
            break
        out.append(i)
    return out


def list_cuda_devices(nvml: Any | None = None) -> list[CudaDeviceSummary]:
    """The GPUs ``"cuda:N"`` can open, with NVML's total and free bytes; no CUDA context is created.

    Returns ``[]`` (and logs why at debug level) when nvidia-ml-py is not
    installed, when there is no NVIDIA driver or no GPU: "no GPU" is an answer,
    not an error. ``nvml`` replaces the ``pynvml`` module (tests).
    """
    try:
        session = NvmlSession(nvml)
    except (BackendUnavailableError, CudaError) as exc:
        log.debug("no CUDA devices listed: %s", exc)
        return []
    with session:
        try:
            devices = [session.device(i) for i in range(session.device_count())]
            uuids = [d.uuid() for d in devices]
            out = []
            for cuda_index, nvml_index in enumerate(_visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)):
                dev = devices[nvml_index]
                mem = dev.memory_info()
                out.append(CudaDeviceSummary(cuda_index, dev.name(), mem.total_nbytes, mem.free_nbytes,
                                             uuids[nvml_index]))
            return out
        except CudaError as exc:
            log.debug("listing CUDA devices through NVML failed: %s", exc)
            return []


__all__ = [
    "NvmlMemoryInfo", "GpuProcess", "CudaDeviceSummary", "NvmlSession", "NvmlDevice", "list_cuda_devices",
]
