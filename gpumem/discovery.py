"""Backend discovery: which memory backends this machine has, and which one a model fits on.

>>> from gpumem.discovery import discover_backends, select_backend_for_model, print_backend_summary
>>> print_backend_summary()                         # the table `gpumem info` prints
>>> sel = select_backend_for_model(6 * 2**30)       # a real GPU with 6 GiB free, else the CPU
>>> sel.spec, sel.device.free_nbytes

Three backends:

``cuda``
    Real NVIDIA GPUs, listed through NVML (:mod:`gpumem.cuda.nvml`) **without creating a CUDA context**
    (a context costs about 500 MiB of the GPU and a second). Opening one (``"cuda:N"``) needs CuPy
    (``gpumem[cuda12]`` or ``gpumem[cuda13]``). When the backend is unavailable,
    :attr:`BackendInfo.reason` says why: nvidia-ml-py missing, no NVIDIA driver (libnvidia-ml not
    found), the driver not loaded, no GPU, ``CUDA_VISIBLE_DEVICES`` hiding every GPU, CuPy missing.
``sim``
    Every simulated profile (:mod:`gpumem.sim`), 2 GB to 141 GB: always available, **opt-in**.
``cpu``
    Host memory: total from ``os.sysconf`` and free from ``MemAvailable`` in ``/proc/meminfo``
    (``os.sysconf("SC_AVPHYS_PAGES")`` where that file is missing). gpumem has no CPU
    :class:`~gpumem.Device`: choosing the CPU means "keep the data in host memory" (as a CPU fallback
    does), so :func:`init_backend_with_memory_check` opens nothing for it.

Note [Which backend is best]
----------------------------
:func:`best_available_backend` and :func:`select_backend_for_model` without a preference try a real GPU
first and the CPU last, and never pick the simulator on their own: the simulator models a GPU's memory
faithfully (sizes, limits, pressure, faults) but runs no kernels, so a program that asked for "the best
backend" and got a simulated H200 would seem to run on a GPU it does not have. Ask for it by name
(``preference="sim"``, or a spec such as ``"sim:t4-16gb"``). Among several GPUs the one with the most
free memory wins (ties: the lowest index), so that a model goes where it has the most headroom; among
simulated profiles the *smallest* one with room wins, which answers "what is the smallest card this
model fits on?".

Note [NVML's free memory is before the context]
------------------------------------------------
NVML's free memory of a GPU is measured before this process creates its CUDA context (about 500 MiB,
more on large parts) and includes memory the driver would give others. :func:`select_backend_for_model`
takes the context's estimate off that figure (``estimate_context_nbytes``) before applying the reserve
rule; :func:`init_backend_with_memory_check` opens the device (creating the context) and checks again
with the device's own ``mem_info()``, trying the next candidate when the first has no room after all.

Note [Selection by usable memory]
---------------------------------
A GPU (real or simulated) is selected for ``required_bytes`` only when a ``GpuMemoryManager`` with
the default ``MemoryConfig`` would make that much usable: the reserve (context plus emergency part)
and ``gpu_memory_fraction`` come off the free memory by the manager's own function
(:func:`gpumem.managers.reserve.manager_usable_nbytes`), not a copy of it. Comparing with raw free
memory selected ``sim:t4-16gb`` for 14.2 GiB, where the manager has 13.03 GiB usable and refuses.
The CPU has no reserve rule: its available memory is compared as it is.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TextIO

from .device import Device
from .errors import BackendUnavailableError, CudaError, GpumemError, InvalidArgumentError
from .hostmem import MEMINFO_PATH, host_memory, parse_meminfo
from .units import format_bytes

log = logging.getLogger(__name__)



class BackendKind(str, enum.Enum):
    """A kind of memory backend, in the order :func:`discover_backends` lists them."""

    CUDA = "cuda"
    """Real NVIDIA GPUs (``"cuda:N"``)."""
    SIM = "sim"
    """Simulated GPUs (``"sim:<profile>"``): faithful memory, no compute; opt-in."""
    CPU = "cpu"
    """Host memory."""


@dataclass(frozen=True)
class BackendDevice:
    """One device of a backend, as discovery sees it (without opening it).

    ``compute_capability`` is ``None`` for the CPU; ``unified_memory`` and ``vmm_supported`` are ``None``
    where they cannot be known without opening the device (a CUDA GPU seen through NVML: opening it
    creates a CUDA context, which discovery avoids; :func:`init_backend_with_memory_check` reads them).
    """

    spec: str
    """What opens it: ``"cuda:0"``, ``"sim:h200-141gb"``, ``"cpu"``."""
    name: str
    total_nbytes: int
    free_nbytes: int
    compute_capability: tuple[int, int] | None = None
    unified_memory: bool | None = None
    vmm_supported: bool | None = None

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``gpumem info --json``)."""
        return {"spec": self.spec, "name": self.name, "total_bytes": self.total_nbytes,
                "free_bytes": self.free_nbytes,
                "compute_capability": None if self.compute_capability is None else list(self.compute_capability),
                "unified_memory": self.unified_memory, "vmm_supported": self.vmm_supported}


@dataclass(frozen=True)
class BackendInfo:
    """A backend, its devices, and whether it can be used (``reason`` says why not)."""

    kind: BackendKind
    available: bool
    devices: tuple[BackendDevice, ...] = ()
    reason: str = ""
    """Why the backend is unavailable ("" when it is available)."""
    real_compute: bool = True
    """False for the simulator: it has memory but runs no kernels (Note [Which backend is best])."""

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``gpumem info --json``)."""
        return {"backend": self.kind.value, "available": self.available, "reason": self.reason or None,
                "real_compute": self.real_compute, "devices": [d.as_json() for d in self.devices]}


@dataclass(frozen=True)
class BackendSelection:
    """What :func:`select_backend_for_model` chose: a backend and one of its devices."""

    backend: BackendKind
    device: BackendDevice
    required_nbytes: int

    @property
    def spec(self) -> str:
        """The device spec (``"cuda:0"``, ``"sim:t4-16gb"``, ``"cpu"``)."""
        return self.device.spec


@dataclass(frozen=True)
class SelectionAttempt:
    """One candidate that was tried and refused, and why."""

    spec: str
    """A device spec, or a backend name when the whole backend was refused."""
    reason: str


@dataclass
class InitializedBackend:
    """What :func:`init_backend_with_memory_check` opened: the selection, the open device (``None`` for the
    CPU, which has no :class:`~gpumem.Device`) and the free bytes measured after opening it.
    Close it (or use it as a context manager) to close the device."""

    selection: BackendSelection
    device: Device | None
    free_nbytes: int
    total_nbytes: int
    refused: tuple[SelectionAttempt, ...] = ()
    """Candidates tried before this one, and why each was refused."""

    @property
    def backend(self) -> BackendKind:
        """The chosen backend."""
        return self.selection.backend

    def close(self) -> None:
        """Close the device (nothing to do for the CPU). Idempotent."""
        if self.device is not None:
            self.device.close()

    def __enter__(self) -> "InitializedBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoSuitableBackendError(GpumemError, LookupError):
    """No backend could hold the request: the message (and :attr:`attempts`) names every candidate tried
    and why it was refused."""

    def __init__(self, required_nbytes: int, attempts: Sequence[SelectionAttempt], preference: str) -> None:
        self.required_nbytes = required_nbytes
        self.attempts = tuple(attempts)
        self.preference = preference
        tried = "; ".join(f"{a.spec}: {a.reason}" for a in self.attempts) or "no candidate"
        super().__init__(f"no backend can hold {format_bytes(required_nbytes)} ({required_nbytes:,} bytes) "
                         f"with preference {preference}: tried {tried}")


# -- discovery ---------------------------------------------------------------------------------------------
_NVML_INIT_REASONS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "no NVIDIA driver (libnvidia-ml not found)",
    "NVML_ERROR_DRIVER_NOT_LOADED": "the NVIDIA driver is not loaded (is there a GPU, and is the kernel module in?)",
    "NVML_ERROR_NO_PERMISSION": "no permission to use the NVIDIA driver (NVML)",
}


def _cuda_backend(nvml: Any | None, cupy_available: bool | None) -> BackendInfo:
    from .cuda.backend import import_nvml
    from .cuda.nvml import NvmlSession, _visible_indices

    if nvml is None:
        nvml, why = import_nvml()
        if nvml is None:
            return BackendInfo(BackendKind.CUDA, False, reason=why)
    try:
        session = NvmlSession(nvml)
    except CudaError as exc:
        reason = _NVML_INIT_REASONS.get(exc.error_name, f"NVML could not start: {exc}")
        return BackendInfo(BackendKind.CUDA, False, reason=reason)
    with session:
        try:
            count = session.device_count()
            handles = [session.device(i) for i in range(count)]
            uuids = [d.uuid() for d in handles]
        except CudaError as exc:
            return BackendInfo(BackendKind.CUDA, False, reason=f"NVML could not list the GPUs: {exc}")
        if not count:
            return BackendInfo(BackendKind.CUDA, False, reason="the NVIDIA driver is there but found no GPU")
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = _visible_indices(env, uuids)
        if not visible:
            return BackendInfo(BackendKind.CUDA, False, reason=f"CUDA_VISIBLE_DEVICES={env!r} hides every GPU "
                                                             f"({count} found by NVML)")
        devices = []
        for cuda_index, nvml_index in enumerate(visible):
            dev = handles[nvml_index]
            try:
                mem = dev.memory_info()
                name = dev.name()
            except CudaError as exc:
                log.warning("cuda:%d: NVML could not read its memory (%s); it is left out", cuda_index, exc)
                continue
            try:
                cc = session.call("nvmlDeviceGetCudaComputeCapability", dev.handle)
                capability: tuple[int, int] | None = (int(cc[0]), int(cc[1]))
            except CudaError as exc:  # an old driver or a fake without the call
                log.debug("cuda:%d: no compute capability from NVML: %s", cuda_index, exc)
                capability = None
            devices.append(BackendDevice(f"cuda:{cuda_index}", name, mem.total_nbytes, mem.free_nbytes, capability))
    if not devices:
        return BackendInfo(BackendKind.CUDA, False, reason="NVML could not read the memory of any GPU")
    if cupy_available is None:
        cupy_available = importlib.util.find_spec("cupy") is not None
    if not cupy_available:
        from .cuda.backend import INSTALL_HINT

        return BackendInfo(BackendKind.CUDA, False, tuple(devices),
                           reason=f"{len(devices)} GPU(s) found, but opening one needs CuPy, which is not "
                                  f"installed; {INSTALL_HINT}")
    return BackendInfo(BackendKind.CUDA, True, tuple(devices))


def _sim_backend() -> BackendInfo:
    try:
        from . import sim
    except ImportError as exc:  # simpy is a dependency; this guards broken installs
        return BackendInfo(BackendKind.SIM, False, reason=f"the simulator cannot be imported: {exc}",
                           real_compute=False)
    devices = []
    for profile in sim.BUILTIN_PROFILES:
        dev = sim.SimDevice(profile)
        try:
            info = dev.mem_info()
            props = dev.properties()
        finally:
            dev.close()
        devices.append(BackendDevice(profile.spec, props.name, info.total_nbytes, info.free_nbytes,
                                     tuple(props.compute_capability), props.unified_memory, props.vmm_supported))
    return BackendInfo(BackendKind.SIM, True, tuple(devices), real_compute=False)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _cpu_backend(meminfo_path: str) -> BackendInfo:
    try:
        total, free = host_memory(meminfo_path)
    except BackendUnavailableError as exc:
        return BackendInfo(BackendKind.CPU, False, reason=str(exc))
    return BackendInfo(BackendKind.CPU, True, (BackendDevice("cpu", _cpu_name(),
                                                             total, free),))


def discover_backends(*, nvml: Any | None = None, cupy_available: bool | None = None,
                      meminfo_path: str = MEMINFO_PATH) -> list[BackendInfo]:
    """Every backend, available or not: CUDA, simulated, CPU (:class:`BackendInfo`, in that order).

    No CUDA context is created. ``nvml`` replaces the ``pynvml`` module and ``cupy_available`` the check
    that CuPy is installed (tests); ``meminfo_path`` where host memory is read from.
    """
    return [_cuda_backend(nvml, cupy_available), _sim_backend(), _cpu_backend(meminfo_path)]


def best_available_backend(backends: Sequence[BackendInfo] | None = None) -> BackendInfo:
    """The best usable backend: CUDA when a GPU can be opened, else the CPU (Note [Which backend is best]:
    the simulator is never chosen on its own). ``backends``: a :func:`discover_backends` result to choose
    from (default: discover now). Raises :class:`NoSuitableBackendError` when neither is usable."""
    backends = discover_backends() if backends is None else backends
    by_kind = {b.kind: b for b in backends}
    for kind in (BackendKind.CUDA, BackendKind.CPU):
        b = by_kind.get(kind)
        if b is not None and b.available and b.devices:
            return b
    attempts = [SelectionAttempt(k.value, by_kind[k].reason if k in by_kind else "not discovered")
                for k in (BackendKind.CUDA, BackendKind.CPU)]
    raise NoSuitableBackendError(0, attempts, "none (best available)")


# -- selection ---------------------------------------------------------------------------------------------
def _check_required(required_nbytes: object) -> int:
    if isinstance(required_nbytes, bool) or not isinstance(required_nbytes, int):
        raise InvalidArgumentError(f"required_bytes must be an int (bytes), got {type(required_nbytes).__name__} "
                                   f"{required_nbytes!r:.60}")
    if required_nbytes <= 0:
        raise InvalidArgumentError(f"required_bytes must be positive, got {required_nbytes}")
    return int(required_nbytes)


def _preference_items(preference: object) -> list[str]:
    """The preference as a list of backend names or device specs, checked."""
    if preference is None:
        return [BackendKind.CUDA.value, BackendKind.CPU.value]
    items: Iterable[object]
    if isinstance(preference, (str, BackendKind)):
        items = [preference]
    elif isinstance(preference, (list, tuple)):
        items = preference
        if not items:
            raise InvalidArgumentError("preference is an empty list; give backend names or device specs, or None")
    else:
        raise InvalidArgumentError(f"preference must be None, a backend name ('cuda', 'sim', 'cpu'), a device "
                                   f"spec ('cuda:0', 'sim:t4-16gb') or a list of them; got "
                                   f"{type(preference).__name__}")
    out = []
    for item in items:
        if isinstance(item, BackendKind):
            out.append(item.value)
            continue
        if not isinstance(item, str):
            raise InvalidArgumentError(f"preference entries must be str or BackendKind, got {type(item).__name__}")
        text = item.strip().lower()
        if text in {k.value for k in BackendKind}:
            out.append(text)
        elif text.startswith(("cuda:", "sim:")):
            # a malformed spec raises InvalidArgumentError, an unknown profile DeviceNotFoundError
            out.append(_canonical(item.strip()))
        else:
            raise InvalidArgumentError(f"unknown backend preference {item!r}; use 'cuda', 'sim', 'cpu', or a device "
                                       "spec such as 'cuda:0' or 'sim:t4-16gb'")
    return out


def _candidates(items: list[str], backends: Sequence[BackendInfo],
                attempts: list[SelectionAttempt]) -> list[tuple[BackendKind, BackendDevice]]:
    """The devices to try, in order, for the preference ``items``; refusals of whole backends (or of
    specs naming no device) go to ``attempts``."""
    by_kind = {b.kind: b for b in backends}
    out: list[tuple[BackendKind, BackendDevice]] = []
    for item in items:
        kind_text, _, target = item.partition(":")
        kind = BackendKind(kind_text.lower())
        info = by_kind.get(kind)
        if info is None or not info.available:
            attempts.append(SelectionAttempt(item, "backend unavailable: "
                                             + (info.reason if info is not None else "not discovered")))
            continue
        if target:
            spec = item
            match = [d for d in info.devices if d.spec == spec]
            if not match:
                attempts.append(SelectionAttempt(item, f"no such device; {kind.value} has "
                                                 + (", ".join(d.spec for d in info.devices) or "none")))
                continue
            out.append((kind, match[0]))
        elif kind is BackendKind.CUDA:
            # Note [Which backend is best]: the most free memory first, ties by index
            order = sorted(info.devices, key=lambda d: (-d.free_nbytes, int(d.spec.partition(":")[2])))
            out.extend((kind, d) for d in order)
        elif kind is BackendKind.SIM:
            out.extend((kind, d) for d in sorted(info.devices, key=lambda d: d.free_nbytes))  # smallest first
        else:
            out.extend((kind, d) for d in info.devices)
    return out


def _canonical(spec: str) -> str:
    from .specs import parse_spec

    parsed = parse_spec(spec)
    if parsed.options:
        raise InvalidArgumentError(f"preference {spec!r}: options (?...) are for open_device; a preference names "
                                   "a device only, such as 'sim:t4-16gb'")
    if parsed.kind.value == "sim":
        from .sim import get_profile

        return get_profile(parsed.target).spec
    return f"cuda:{parsed.index}"


def _pref_text(preference: object) -> str:
    return "none (a real GPU, else the CPU)" if preference is None else repr(preference)


def manager_usable_nbytes_of(kind: "BackendKind", total_nbytes: int, free_nbytes: int, *,
                             before_context: bool | None = None) -> int:
    """What a ``GpuMemoryManager`` with the default :class:`~gpumem.managers.config.MemoryConfig`
    would make usable on a device with these figures (Note [Selection by usable memory]); the CPU's
    available memory as it is. ``before_context`` (default: ``kind is CUDA``): the figures were taken
    before this process's CUDA context existed (NVML), so the context's estimate is taken off first."""
    if kind is BackendKind.CPU:
        return free_nbytes
    from .device import MemInfo
    from .managers.config import MemoryConfig
    from .managers.reserve import estimate_context_nbytes, manager_usable_nbytes, reserve_for_mem

    if before_context is None:
        before_context = kind is BackendKind.CUDA
    if before_context:
        free_nbytes = max(free_nbytes - estimate_context_nbytes(total_nbytes), 0)
    mem = MemInfo(free_nbytes, total_nbytes)
    config = MemoryConfig()
    reserve = reserve_for_mem(mem, min_free_bytes=config.min_free_bytes)
    return max(manager_usable_nbytes(mem, reserve, config.gpu_memory_fraction), 0)


def _usable(kind: "BackendKind", d: BackendDevice) -> int:
    return manager_usable_nbytes_of(kind, d.total_nbytes, d.free_nbytes)


def _refusal(required: int, d: BackendDevice, kind: "BackendKind | None" = None) -> str:
    if kind is None or kind is BackendKind.CPU:
        return (f"{format_bytes(d.free_nbytes)} free of {format_bytes(d.total_nbytes)}, "
                f"{format_bytes(required)} needed")
    return (f"{format_bytes(_usable(kind, d))} usable ({format_bytes(d.free_nbytes)} free of "
            f"{format_bytes(d.total_nbytes)}, less the reserve), {format_bytes(required)} needed")


def select_backend_for_model(required_bytes: int, preference: object = None, *,
                             backends: Sequence[BackendInfo] | None = None) -> BackendSelection:
    """A backend and device with at least ``required_bytes`` free.

    ``preference``: ``None`` (a real GPU, else the CPU: Note [Which backend is best]), a backend name
    (``"cuda"``, ``"sim"``, ``"cpu"``), a device spec (``"cuda:1"``, ``"sim:t4-16gb"``) or a list of
    them, tried in order. ``backends``: a :func:`discover_backends` result (default: discover now).

    Raises :class:`~gpumem.errors.InvalidArgumentError` for a bad size or preference, and
    :class:`NoSuitableBackendError` naming every candidate tried and why it was refused (unavailable,
    or not enough free memory: Note [NVML's free memory is before the context]).
    """
    required = _check_required(required_bytes)
    items = _preference_items(preference)
    backends = discover_backends() if backends is None else backends
    attempts: list[SelectionAttempt] = []
    for kind, dev in _candidates(items, backends, attempts):
        usable = _usable(kind, dev)
        if usable >= required:
            log.info("selected %s (%s usable) for %s", dev.spec, format_bytes(usable), format_bytes(required))
            return BackendSelection(kind, dev, required)
        attempts.append(SelectionAttempt(dev.spec, _refusal(required, dev, kind)))
    raise NoSuitableBackendError(required, attempts, _pref_text(preference))


def init_backend_with_memory_check(preference: object, required_bytes: int, *,
                                   backends: Sequence[BackendInfo] | None = None,
                                   opener: Callable[[str], Device] | None = None) -> InitializedBackend:
    """Select a backend as :func:`select_backend_for_model` does, open its device and check that it really
    has ``required_bytes`` free once open (with its CUDA context); a candidate that has not, or that
    fails to open, is closed and the next one is tried. For the CPU the host's available memory is read
    again and nothing is opened (``device`` is ``None``).

    ``opener`` opens a spec (default :func:`gpumem.open_device`; tests pass fakes). Raises
    :class:`NoSuitableBackendError` naming every candidate and why it was refused.
    """
    required = _check_required(required_bytes)
    items = _preference_items(preference)
    backends = discover_backends() if backends is None else backends
    if opener is None:
        from .specs import open_device as opener  # type: ignore[assignment]
    attempts: list[SelectionAttempt] = []
    for kind, dev in _candidates(items, backends, attempts):
        if _usable(kind, dev) < required:
            attempts.append(SelectionAttempt(dev.spec, _refusal(required, dev, kind)))
            continue
        selection = BackendSelection(kind, dev, required)
        if kind is BackendKind.CPU:
            try:
                total, free = host_memory()
            except BackendUnavailableError as exc:
                attempts.append(SelectionAttempt(dev.spec, str(exc)))
                continue
            if free < required:
                attempts.append(SelectionAttempt(dev.spec, f"now {format_bytes(free)} available, "
                                                 f"{format_bytes(required)} needed"))
                continue
            return InitializedBackend(selection, None, free, total, tuple(attempts))
        try:
            device = opener(dev.spec)  # type: ignore[misc]
        except (GpumemError, OSError) as exc:  # BackendUnavailableError, DeviceNotFoundError, CudaError...
            attempts.append(SelectionAttempt(dev.spec, f"could not be opened: {type(exc).__name__}: {exc}"))
            continue
        try:
            info = device.mem_info()
        except GpumemError as exc:
            device.close()
            attempts.append(SelectionAttempt(dev.spec, f"opened, but mem_info failed: {exc}"))
            continue
        usable_open = manager_usable_nbytes_of(kind, info.total_nbytes, info.free_nbytes, before_context=False)
        if usable_open < required:
            device.close()
            attempts.append(SelectionAttempt(dev.spec, f"opened: {format_bytes(usable_open)} usable "
                                             f"({format_bytes(info.free_nbytes)} free of "
                                             f"{format_bytes(info.total_nbytes)} once open, less the reserve), "
                                             f"{format_bytes(required)} needed"))
            continue
        log.info("opened %s: %s", dev.spec, info)
        return InitializedBackend(selection, device, info.free_nbytes, info.total_nbytes, tuple(attempts))
    raise NoSuitableBackendError(required, attempts, _pref_text(preference))


# -- the summary -------------------------------------------------------------------------------------------
def _cc(d: BackendDevice) -> str:
    return "-" if d.compute_capability is None else f"{d.compute_capability[0]}.{d.compute_capability[1]}"


def _flag(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def format_backend_summary(backends: Sequence[BackendInfo] | None = None) -> str:
    """The text :func:`print_backend_summary` prints."""
    backends = discover_backends() if backends is None else backends
    lines: list[str] = []
    for b in backends:
        state = "available" if b.available else f"unavailable: {b.reason}"
        note = "" if b.real_compute else " (memory only, no compute: opt-in with --device sim:<profile>)"
        lines.append(f"{b.kind.value}: {state}{note}")
        if b.devices:
            lines.append(f"  {'SPEC':<22} {'NAME':<44} {'TOTAL':>11} {'FREE':>11} {'CC':>4} {'UNIFIED':>7}")
            for d in b.devices:
                lines.append(f"  {d.spec:<22} {d.name[:44]:<44} {format_bytes(d.total_nbytes):>11} "
                             f"{format_bytes(d.free_nbytes):>11} {_cc(d):>4} "
                             f"{'-' if b.kind is BackendKind.CPU else _flag(d.unified_memory):>7}")
    try:
        best = best_available_backend(backends)
        lines.append(f"best available: {best.kind.value} ({best.devices[0].spec}"
                     + (f" and {len(best.devices) - 1} more" if len(best.devices) > 1 else "") + ")")
    except NoSuitableBackendError as exc:
        lines.append(f"best available: none ({exc})")
    return "\n".join(lines)


def print_backend_summary(file: TextIO | None = None, *, backends: Sequence[BackendInfo] | None = None) -> None:
    """Print every backend, why an unavailable one is, its devices (total and free memory, compute
    capability, unified memory; ``?`` where unknown without opening the device) and the best available
    one, to ``file`` (default ``sys.stdout``)."""
    print(format_backend_summary(backends), file=sys.stdout if file is None else file)


def backends_as_json(backends: Sequence[BackendInfo] | None = None) -> dict[str, Any]:
    """The ``gpumem info --json`` object: ``{"backends": [...], "best_available": "cuda"|"cpu"|None}``."""
    backends = discover_backends() if backends is None else backends
    try:
        best: str | None = best_available_backend(backends).kind.value
    except NoSuitableBackendError:
        best = None
    return {"backends": [b.as_json() for b in backends], "best_available": best}


__all__ = [
    "BackendKind", "BackendDevice", "BackendInfo", "BackendSelection", "SelectionAttempt", "InitializedBackend",
    "NoSuitableBackendError", "discover_backends", "best_available_backend", "select_backend_for_model",
    "init_backend_with_memory_check", "print_backend_summary", "format_backend_summary", "backends_as_json",
    "host_memory", "parse_meminfo",
]
