"""The real GPU: a :class:`gpumem.Device` backed by CUDA through CuPy, cuda-bindings and NVML.

>>> from gpumem import open_device
>>> with open_device("cuda:0") as dev:          # needs gpumem[cuda12] or gpumem[cuda13]
...     p = dev.malloc(64 * 2**20); dev.write(p, b"hello"); dev.read(p, 5)
b'hello'

Which library does what
    ``cudaMalloc``/``cudaFree``/``cudaMemGetInfo``/``cudaMemcpy``/properties go
    through ``cupy.cuda.runtime``; virtual memory management through the driver
    API of cuda-bindings (:mod:`gpumem.cuda.vmm`); "who else is on this GPU"
    through NVML (:mod:`gpumem.cuda.nvml`). Only CuPy is required: without
    cuda-bindings ``vmm_supported`` is ``False``; without nvidia-ml-py
    :meth:`CudaDevice.other_processes` raises.

Note [Bookkeeping keeps bad input away from CUDA]
--------------------------------------------------
CUDA's answer to a bad pointer ranges from an error code to undefined behaviour
(``cuMemRelease`` of an invalid handle) to a corrupted context (a ``cudaMemcpy``
past the end of an allocation). So this device remembers everything it handed
out, exactly as :class:`sim.SimDevice` does, and checks every call against that
record *before* calling CUDA:

* live ``malloc`` pointers and their sizes (and a bounded memory of freed ones,
  so a second ``free`` is a :class:`~gpumem.errors.DoubleFreeError` rather
  than an :class:`~gpumem.errors.InvalidPointerError`);
* address reservations, and per reservation its mappings sorted by address, so
  an overlapping ``mem_map`` raises :class:`~gpumem.errors.MappingOverlapError`
  instead of reaching ``cuMemMap``;
* physical chunks, released or not, with the number of mappings of each.

``read`` and ``write`` only copy inside one live allocation or inside
contiguous mappings that have access set. Each call validates its arguments,
then refuses if the device is closed (virtual memory calls refuse first, before
validating), then checks the record, then calls CUDA, and only when CUDA
succeeded updates the record: a failing call changes nothing.
Where one request takes several CUDA calls (unmapping several mappings), the
record follows each call that succeeded, so it stays true even then.

The checks mirror :mod:`sim.device` one for one, in the same order (same
exceptions for the same inputs), because one contract suite runs against both
devices; ``tests/cuda_adapter/test_cuda_sim_parity.py`` compares them call by call.
After :meth:`CudaDevice.close` every call with valid arguments except
:meth:`~CudaDevice.properties` raises :class:`~gpumem.errors.DeviceClosedError`.

Note [Streams and events on CUDA]
---------------------------------
``stream_create`` makes a non-blocking stream (``cudaStreamNonBlocking``: it
does not synchronise with the legacy default stream, as on the simulator where
stream 0 is a stream like any other); its id is the ``cudaStream_t`` value, so
CuPy's ``Stream.ptr`` can be passed wherever a stream is taken, without
``stream_create``. Events are created with ``cudaEventDisableTiming`` (the
cheapest kind: no timestamp) and destroyed events are kept in a small pool for
the next ``event_record``, because an allocator records one per free.
``event_query`` turns ``cudaErrorNotReady`` into ``False``.

Threads: every public call holds the device's lock (:class:`gpumem.Device`) and
makes this device current on the calling thread before it calls CUDA.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np

from gpumem.device import (
    BytesLike,
    Device,
    DeviceKind,
    DeviceProperties,
    Event,
    MemInfo,
    PhysicalHandle,
    check_data,
    check_granular,
    check_nbytes,
    check_pointer,
)
from gpumem.errors import (
    BackendUnavailableError,
    CudaError,
    DeviceClosedError,
    DeviceLostError,
    DeviceNotFoundError,
    DoubleFreeError,
    InternalError,
    InvalidArgumentError,
    InvalidPointerError,
    MappingError,
    OutOfMemoryError,
    UnsupportedOperationError,
)
from gpumem.units import CUDA_GRANULARITY_NBYTES
from gpumem.vmm_book import Mapping as _Mapping
from gpumem.vmm_book import Reservation as _Reservation

from .backend import INSTALL_HINT, CudaBackend, load_backend
from .errors import (
    CUDA_ERROR_NOT_READY,
    CUDA_SUCCESS,
    VmmUnavailableError,
    from_runtime_error,
    is_out_of_memory,
    is_sticky,
    runtime_status_name,
)
from .nvml import GpuProcess, NvmlDevice, NvmlMemoryInfo, NvmlSession
from .vmm import VmmDriver, open_vmm

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How many freed pointers are remembered to tell a double free from a wild pointer (as in the simulator).
_FREED_MEMORY = 65_536
#: Sizes above this cannot be passed to CUDA (``size_t``); the device cannot have that much anyway.
_SIZE_MAX = 2**64 - 1
#: ``cudaMemcpyKind`` values (CuPy exports them as ``runtime.memcpyHostToDevice``...).
_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2
#: ``cudaDeviceAttr`` values used when ``cudaDeviceProp`` lacks the memory clock (CUDA 13 removed it).
_ATTR_MEMORY_CLOCK_RATE = 36
_ATTR_GLOBAL_MEMORY_BUS_WIDTH = 37
#: ``cudaStreamNonBlocking`` and ``cudaEventDisableTiming`` (flags CuPy also exports under these names).
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
#: How many destroyed events are kept for reuse by ``event_record``.
_EVENT_POOL_SIZE = 64


class CudaEvent(Event):
    """An event of a :class:`CudaDevice`: ``handle`` is the ``cudaEvent_t``."""

    __slots__ = ("handle",)

    def __init__(self, device: "CudaDevice", stream: int, handle: int) -> None:
        super().__init__(device, stream)
        self.handle = handle


@dataclass
class _Physical:
    """A ``cuMemCreate`` chunk: our handle, the driver's, and how many mappings use it."""

    handle: PhysicalHandle
    driver_handle: Any
    released: bool = False
    map_count: int = 0


def _decode(value: object) -> str:
    if isinstance(value, bytes):
        return value.split(b"\0", 1)[0].decode(errors="replace")
    return str(value)


class CudaDevice(Device):
    """CUDA device number ``index`` (as in ``"cuda:<index>"``), through CuPy and cuda-bindings.

    Opening the device makes its primary CUDA context (about 500 MiB of device
    memory) and reads its properties once. ``backend`` replaces the imported
    libraries (see :class:`~gpumem.cuda.backend.CudaBackend`; tests pass fakes).

    Raises :class:`~gpumem.errors.BackendUnavailableError` (naming the
    ``gpumem[cuda12]`` and ``gpumem[cuda13]`` extras) without CuPy,
    :class:`~gpumem.errors.DeviceNotFoundError` when there is no such GPU, and
    :class:`~gpumem.errors.InvalidArgumentError` for an index that is not a
    non-negative int.
    """

    kind = DeviceKind.CUDA
    event_type = CudaEvent

    def __init__(self, index: int, *, backend: CudaBackend | None = None) -> None:
        super().__init__()
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidArgumentError(f"CUDA device index must be a non-negative int, got {index!r}")
        self.index = index
        self.spec = f"cuda:{index}"
        self._closed = True  # until fully opened: close() then has nothing to do
        self._lost: CudaError | None = None
        self._backend = backend if backend is not None else load_backend()
        self._rt = self._backend.runtime
        self._total_nbytes = 0
        self._nvml_session: NvmlSession | None = None
        self._nvml_device: NvmlDevice | None = None
        count = self._count_devices()
        if index >= count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
            if count:
                which = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
                raise DeviceNotFoundError(
                    f"{self.spec}: no such CUDA device; this machine has {count} ({which}){where}")
            raise DeviceNotFoundError(f"{self.spec}: this machine has no CUDA device{where}")
        self._runtime("cudaSetDevice", self._rt.setDevice, index)
        self._runtime("cudaFree", self._rt.free, 0)  # cudaFree(NULL): makes sure the primary context exists
        raw = self._runtime("cudaGetDeviceProperties", self._rt.getDeviceProperties, index)
        self._total_nbytes = int(raw["totalGlobalMem"])
        self._vmm, vmm_ok, gran, self._vmm_missing = open_vmm(
            self._backend.driver, index, self._backend.driver_missing)
        self._vmm_ok = vmm_ok
        self._gran = gran or CUDA_GRANULARITY_NBYTES
        self._props = DeviceProperties(
            name=_decode(raw.get("name", b"")),
            total_nbytes=self._total_nbytes,
            compute_capability=(int(raw["major"]), int(raw["minor"])),
            multiprocessor_count=int(raw.get("multiProcessorCount", 0)),
            memory_bandwidth_gbps=self._bandwidth_gbps(raw),
            unified_memory=bool(raw.get("integrated", 0)),
            vmm_supported=vmm_ok,
            granularity_nbytes=self._gran,
        )
        # the record (Note [Bookkeeping keeps bad input away from CUDA])
        self._allocations: dict[int, int] = {}
        self._alloc_starts: list[int] = []
        self._freed: OrderedDict[int, None] = OrderedDict()
        self._reservations: dict[int, _Reservation] = {}
        self._res_starts: list[int] = []
        self._physicals: dict[int, _Physical] = {}
        self._next_handle = 1
        self._event_pool: list[int] = []
        self._live_events: set[int] = set()  # handles of events handed out and not destroyed
        self._closed = False
        log.debug("opened %s: %s", self.spec, self._props)

    # -- calling CUDA ----------------------------------------------------------------------------------
    def _runtime(self, call: str, fn: Callable[..., T], *args: Any, oom_nbytes: int | None = None,
                 memory_nbytes: int | None = None) -> T:
        """``fn(*args)`` with CuPy's ``CUDARuntimeError`` turned into a gpumem error.

        ``oom_nbytes`` is the size an allocating call asked for: CUDA's
        out-of-memory errors then become :class:`OutOfMemoryError`. An
        allocation of device memory passes its size as ``memory_nbytes`` too:
        when that exceeds the device's total memory, *any* failure is an
        out-of-memory error (the request could never succeed, whichever error
        code CUDA chose for it).
        """
        try:
            return fn(*args)
        except self._backend.runtime_error as exc:
            raise self._translate(from_runtime_error(call, exc), oom_nbytes, memory_nbytes) from exc

    def _driver(self, call: str, fn: Callable[..., T], *args: Any, oom_nbytes: int | None = None,
                memory_nbytes: int | None = None) -> T:
        """``fn(*args)`` of :class:`VmmDriver` with the device current; errors as in :meth:`_runtime`."""
        self._activate()
        try:
            return fn(*args)
        except CudaError as err:
            raise self._translate(err, oom_nbytes, memory_nbytes) from err

    def _translate(self, err: CudaError, oom_nbytes: int | None, memory_nbytes: int | None) -> Exception:
        if is_sticky(err.error_name):
            return self._lose(err)
        if oom_nbytes is not None and (is_out_of_memory(err.error_name)
                                       or (memory_nbytes is not None and memory_nbytes > self._total_nbytes)):
            return self._oom(oom_nbytes, err)
        return err

    def _oom(self, nbytes: int, err: CudaError | None = None, why: str = "") -> OutOfMemoryError:
        try:
            free, total = self._rt.memGetInfo()
        except Exception:  # noqa: BLE001 - the OOM is the news; report what we know
            free, total = 0, self._total_nbytes
        hint = f"({err.error_name} from {err.call})" if err is not None else f"({why})"
        return OutOfMemoryError(nbytes, int(free), int(total), device=self.spec, hint=hint)

    def _activate(self) -> None:
        """Make this device's primary context current on the calling thread (``cudaSetDevice``)."""
        self._runtime("cudaSetDevice", self._rt.setDevice, self.index)

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceClosedError(f"{self.spec} is closed")
        if self._lost is not None:
            raise DeviceLostError(f"{self.spec} is lost: {self._lost}")

    def _lose(self, err: CudaError) -> DeviceLostError:
        """Note [A sticky error loses the device]: after ``cudaErrorIllegalAddress`` and its kin the
        context is dead and every later call fails; the record is left as it is (nothing more can be
        freed) and every later call raises :class:`~gpumem.errors.DeviceLostError` at once."""
        if self._lost is None:
            self._lost = err
            log.error("%s: the CUDA context is dead: %s", self.spec, err)
        return DeviceLostError(f"{self.spec} is lost: {err}")

    def _count_devices(self) -> int:
        try:
            return int(self._rt.getDeviceCount())
        except self._backend.runtime_error as exc:
            err = from_runtime_error("cudaGetDeviceCount", exc)
            if err.error_name == "cudaErrorNoDevice":
                return 0
            if err.error_name == "cudaErrorInsufficientDriver":
                raise CudaError(err.call, err.error_name,
                                f"{err.detail}; either no NVIDIA driver is installed, or it is older than the CUDA "
                                f"version this CuPy was built for: {INSTALL_HINT}") from exc
            raise err from exc

    def _bandwidth_gbps(self, raw: dict[str, Any]) -> float:
        """Peak memory bandwidth: 2 (double data rate) x clock x bus width, in GB/s.

        CUDA 13 dropped ``memoryClockRate`` from ``cudaDeviceProp``; then the
        clock comes from ``cudaDeviceGetAttribute`` or, failing that, NVML's
        maximum memory clock. Without any of them the bandwidth is 0.0 (logged).
        """
        clock_khz = int(raw.get("memoryClockRate") or 0)
        bus_bits = int(raw.get("memoryBusWidth") or 0)
        if not clock_khz:
            clock_khz = self._attribute(_ATTR_MEMORY_CLOCK_RATE, "cudaDevAttrMemoryClockRate")
        if not bus_bits:
            bus_bits = self._attribute(_ATTR_GLOBAL_MEMORY_BUS_WIDTH, "cudaDevAttrGlobalMemoryBusWidth")
        if not clock_khz:
            try:
                nvml = self._nvml()
                clock_khz = nvml.max_memory_clock_khz()
            except (CudaError, BackendUnavailableError) as exc:
                log.debug("%s: NVML memory clock unavailable: %s", self.spec, exc)
        if not clock_khz or not bus_bits:
            log.warning("%s: memory clock or bus width unknown; memory_bandwidth_gbps is 0.0", self.spec)
            return 0.0
        return 2.0 * clock_khz * 1e3 * (bus_bits / 8) / 1e9

    def _attribute(self, default_attr: int, name: str) -> int:
        attr = getattr(self._rt, name, default_attr)
        try:
            return int(self._rt.deviceGetAttribute(attr, self.index))
        except Exception as exc:  # noqa: BLE001 - optional information
            log.debug("%s: cudaDeviceGetAttribute(%s) failed: %s", self.spec, name, exc)
            return 0

    def _require_vmm(self, call: str) -> VmmDriver:
        """Refuse on a closed device, then on one without VMM; both before any argument check (as the simulator)."""
        self._check_open()
        if self._vmm_ok and self._vmm is not None:
            return self._vmm
        if self._backend.driver is None:
            raise VmmUnavailableError(f"{call}: {self._vmm_missing}")
        msg = f"{call}: {self.spec} ({self._props.name}) does not support virtual memory management"
        if self._vmm_missing and "does not support" not in self._vmm_missing:
            msg += f" ({self._vmm_missing})"  # the driver could not be used: say why
        raise UnsupportedOperationError(msg)

    # -- NVML ---------------------------------------------------------------------------------------------
    def _nvml(self) -> NvmlDevice:
        """This GPU's NVML handle, opened on first use (found by PCI bus id, which is exact)."""
        if self._nvml_device is not None:
            return self._nvml_device
        if self._backend.nvml is None:
            raise BackendUnavailableError(self._backend.nvml_missing
                                          or f"nvidia-ml-py is not installed; {INSTALL_HINT}")
        session = NvmlSession(self._backend.nvml)
        try:
            device: NvmlDevice | None = None
            get_bus_id = getattr(self._rt, "deviceGetPCIBusId", None)
            if get_bus_id is not None:
                try:
                    device = session.device_by_pci_bus_id(_decode(get_bus_id(self.index)))
                except (CudaError, self._backend.runtime_error) as exc:
                    log.debug("%s: NVML lookup by PCI bus id failed: %s", self.spec, exc)
            if device is None:  # NVML's index is CUDA's only when the orders agree (see gpumem.cuda.nvml)
                log.debug("%s: using NVML index %d", self.spec, self.index)
                device = session.device(self.index)
        except BaseException:
            session.close()
            raise
        self._nvml_session, self._nvml_device = session, device
        return device

    def nvml_memory_info(self) -> NvmlMemoryInfo:
        """NVML's total, used and free bytes for this GPU (see :mod:`gpumem.cuda.nvml` for how they differ)."""
        self._check_open()
        return self._nvml().memory_info()

    def processes(self) -> list[GpuProcess]:
        """Every process with a CUDA context on this GPU and the bytes it uses, this one included."""
        self._check_open()
        return self._nvml().processes()

    def other_processes(self) -> list[GpuProcess]:
        """The processes other than this one using this GPU (by PID; see :class:`~gpumem.cuda.nvml.GpuProcess`)."""
        me = os.getpid()
        return [p for p in self.processes() if p.pid != me]

    # -- Device: what it is and has -------------------------------------------------------------------
    def properties(self) -> DeviceProperties:
        return self._props

    def _do_mem_info(self) -> MemInfo:
        self._check_open()
        self._activate()
        free, total = self._runtime("cudaMemGetInfo", self._rt.memGetInfo)
        return MemInfo(int(free), int(total))

    # -- Device: malloc and free ----------------------------------------------------------------------
    def _do_malloc(self, nbytes: int) -> int:
        check_nbytes(nbytes)
        self._check_open()
        if nbytes > _SIZE_MAX:
            raise self._oom(nbytes, why="larger than CUDA's size_t")
        self._activate()
        ptr = int(self._runtime("cudaMalloc", self._rt.malloc, nbytes, oom_nbytes=nbytes, memory_nbytes=nbytes))
        self._allocations[ptr] = nbytes
        bisect.insort(self._alloc_starts, ptr)
        self._freed.pop(ptr, None)
        return ptr

    def _do_free(self, ptr: int) -> None:
        check_pointer(ptr)
        self._check_open()
        if ptr not in self._allocations:
            if ptr in self._freed:
                raise DoubleFreeError(f"double free of {ptr:#x} on {self.spec}")
            raise InvalidPointerError(f"free of {ptr:#x}, which {self.spec} never allocated (or not its start)")
        self._activate()
        self._runtime("cudaFree", self._rt.free, ptr)
        self._forget_allocation(ptr)

    def _forget_allocation(self, ptr: int) -> None:
        del self._allocations[ptr]
        del self._alloc_starts[bisect.bisect_left(self._alloc_starts, ptr)]
        self._freed[ptr] = None
        if len(self._freed) > _FREED_MEMORY:
            self._freed.popitem(last=False)

    # -- Device: virtual memory management -----------------------------------------------------------
    def _do_address_reserve(self, nbytes: int, alignment: int = 0) -> int:
        vmm = self._require_vmm("address_reserve")
        check_granular(nbytes, self._gran)
        check_nbytes(alignment, what="alignment", allow_zero=True)
        if alignment and (alignment & (alignment - 1) or alignment % self._gran):
            raise InvalidArgumentError(f"alignment {alignment} must be 0 or a power-of-two multiple of the granularity")
        if nbytes > _SIZE_MAX:
            raise self._oom(nbytes, why="larger than CUDA's size_t")
        va = self._driver("cuMemAddressReserve", vmm.address_reserve, nbytes, alignment, oom_nbytes=nbytes)
        if va % max(alignment, self._gran):
            # never seen: the driver aligns to the granularity at least. Refuse rather than hand it out.
            self._driver("cuMemAddressFree", vmm.address_free, va, nbytes)
            raise CudaError("cuMemAddressReserve", "misaligned",
                            f"{va:#x} is not aligned to {max(alignment, self._gran)}")
        self._reservations[va] = _Reservation(va, nbytes)
        bisect.insort(self._res_starts, va)
        return va

    def _reservation_at(self, ptr: int) -> _Reservation | None:
        i = bisect.bisect_right(self._res_starts, ptr) - 1
        if i < 0:
            return None
        r = self._reservations[self._res_starts[i]]
        return r if ptr < r.start + r.nbytes else None

    def _reservation(self, va: int, nbytes: int, call: str) -> _Reservation:
        r = self._reservation_at(va)
        if r is None:
            raise MappingError(f"{call}: {va:#x} is not inside an address reservation on {self.spec}")
        r.check_inside(va, nbytes, call)
        return r

    def _do_address_free(self, va: int, nbytes: int) -> None:
        vmm = self._require_vmm("address_free")
        check_pointer(va, what="va")
        check_granular(nbytes, self._gran)
        r = self._reservations.get(va)
        if r is None:
            raise MappingError(f"address_free: {va:#x} is not the base of a reservation on {self.spec}")
        if r.nbytes != nbytes:
            raise MappingError(f"address_free: reservation at {va:#x} is {r.nbytes} bytes, not {nbytes}")
        if r.mappings:
            raise MappingError(f"address_free: reservation at {va:#x} still has {len(r.mappings)} mapping(s)")
        self._driver("cuMemAddressFree", vmm.address_free, va, nbytes)
        del self._reservations[va]
        del self._res_starts[bisect.bisect_left(self._res_starts, va)]

    def _do_mem_create(self, nbytes: int) -> PhysicalHandle:
        vmm = self._require_vmm("mem_create")
        check_granular(nbytes, self._gran)
        if nbytes > _SIZE_MAX:
            raise self._oom(nbytes, why="larger than CUDA's size_t")
        driver_handle = self._driver("cuMemCreate", vmm.create, nbytes, oom_nbytes=nbytes, memory_nbytes=nbytes)
        handle = PhysicalHandle(self._next_handle, nbytes)
        self._next_handle += 1
        self._physicals[handle.handle] = _Physical(handle, driver_handle)
        return handle

    def _physical(self, handle: PhysicalHandle, call: str) -> _Physical:
        phys = self._physicals.get(handle.handle)
        if phys is None or phys.handle != handle or phys.released:
            raise InvalidPointerError(f"{call}: unknown or released physical handle {handle.handle}")
        return phys

    @staticmethod
    def _check_handle_type(handle: object, call: str) -> None:
        if not isinstance(handle, PhysicalHandle):
            raise InvalidArgumentError(f"{call}: handle must be a PhysicalHandle, got {type(handle).__name__}")

    def _do_mem_release(self, handle: PhysicalHandle) -> None:
        vmm = self._require_vmm("mem_release")
        self._check_handle_type(handle, "mem_release")
        phys = self._physical(handle, "mem_release")
        self._driver("cuMemRelease", vmm.release, phys.driver_handle)
        phys.released = True
        if phys.map_count == 0:
            del self._physicals[handle.handle]

    def _do_mem_map(self, va: int, nbytes: int, handle: PhysicalHandle, offset: int = 0) -> None:
        vmm = self._require_vmm("mem_map")
        check_pointer(va, what="va")
        check_granular(nbytes, self._gran)
        check_nbytes(offset, what="offset", allow_zero=True)
        if va % self._gran or offset % self._gran:
            raise InvalidArgumentError(f"mem_map: va and offset must be multiples of the granularity {self._gran}")
        self._check_handle_type(handle, "mem_map")
        phys = self._physical(handle, "mem_map")
        if offset + nbytes > phys.handle.nbytes:
            raise InvalidArgumentError(f"mem_map: offset {offset} + nbytes {nbytes} exceeds the chunk's "
                                       f"{phys.handle.nbytes} bytes")
        r = self._reservation(va, nbytes, "mem_map")
        r.check_unmapped(va, nbytes, "mem_map")
        self._driver("cuMemMap", vmm.map, va, nbytes, phys.driver_handle, offset, oom_nbytes=nbytes)
        r.add(va, nbytes, phys, offset)

    def _mappings_covering(self, va: int, nbytes: int, call: str) -> list[_Mapping]:
        """The mappings that tile ``[va, va + nbytes)`` from ``va`` without holes, or :class:`MappingError`."""
        return self._reservation(va, nbytes, call).covering(va, nbytes, call)

    def _do_mem_set_access(self, va: int, nbytes: int) -> None:
        """Make the mappings covering ``[va, va + nbytes)`` readable and writable.

        One ``cuMemSetAccess`` covers the whole range, which must be fully mapped
        (possibly by several mappings); every mapping it touches is recorded as accessible.
        """
        vmm = self._require_vmm("mem_set_access")
        check_pointer(va, what="va")
        check_granular(nbytes, self._gran)
        maps = self._mappings_covering(va, nbytes, "mem_set_access")
        # One driver call for the whole range: cuMemSetAccess accepts any fully mapped range,
        # and each call costs ~27 us on an H200 whatever its size (hil/probes/calibrate.py).
        self._driver("cuMemSetAccess", vmm.set_access, va, nbytes)
        for m in maps:
            m.accessible = True

    def _do_mem_unmap(self, va: int, nbytes: int) -> None:
        """Unmap whole mappings tiling ``[va, va + nbytes)`` (one ``cuMemUnmap`` each, as the driver requires)."""
        vmm = self._require_vmm("mem_unmap")
        check_pointer(va, what="va")
        check_granular(nbytes, self._gran)
        r = self._reservation(va, nbytes, "mem_unmap")
        maps = r.whole_mappings(va, nbytes, "mem_unmap")
        for m in maps:
            self._driver("cuMemUnmap", vmm.unmap, m.va, m.nbytes)
            self._forget_mapping(r, m)

    def _forget_mapping(self, r: _Reservation, m: _Mapping) -> None:
        r.remove(m)
        if m.physical.released and m.physical.map_count == 0:
            del self._physicals[m.physical.handle.handle]

    # -- Device: data ------------------------------------------------------------------------------------
    def _check_range(self, ptr: int, nbytes: int, call: str) -> None:
        """Raise :class:`InvalidPointerError` unless ``[ptr, ptr + nbytes)`` may be copied (see the Note)."""
        i = bisect.bisect_right(self._alloc_starts, ptr) - 1
        if i >= 0:
            start = self._alloc_starts[i]
            size = self._allocations[start]
            if ptr < start + size:
                if ptr + nbytes > start + size:
                    raise InvalidPointerError(f"{call}: [{ptr:#x}, {ptr + nbytes:#x}) runs past the end of the "
                                              f"{size}-byte allocation at {start:#x}")
                return
        if self._reservation_at(ptr) is not None:
            try:
                maps = self._mappings_covering(ptr, nbytes, call)
            except MappingError as exc:
                raise InvalidPointerError(str(exc)) from None
            for m in maps:
                if not m.accessible:
                    raise InvalidPointerError(f"{call}: mapping at {m.va:#x} has no access set (mem_set_access)")
            return
        raise InvalidPointerError(f"{call}: {ptr:#x} is not inside any allocation or mapping on {self.spec}")

    def _do_write(self, ptr: int, data: BytesLike) -> None:
        check_pointer(ptr)
        view = check_data(data)
        self._check_open()
        if len(view) == 0:
            return
        self._check_range(ptr, len(view), "write")
        host = np.frombuffer(view, dtype=np.uint8)  # no copy; keeps the buffer alive during the call
        kind = getattr(self._rt, "memcpyHostToDevice", _MEMCPY_HOST_TO_DEVICE)
        self._activate()
        self._runtime("cudaMemcpy", self._rt.memcpy, ptr, host.ctypes.data, len(view), kind)

    def _do_read(self, ptr: int, nbytes: int) -> bytes:
        check_pointer(ptr)
        check_nbytes(nbytes, allow_zero=True)
        self._check_open()
        if nbytes == 0:
            return b""
        self._check_range(ptr, nbytes, "read")
        host = np.empty(nbytes, dtype=np.uint8)
        kind = getattr(self._rt, "memcpyDeviceToHost", _MEMCPY_DEVICE_TO_HOST)
        self._activate()
        self._runtime("cudaMemcpy", self._rt.memcpy, host.ctypes.data, ptr, nbytes, kind)
        return host.tobytes()

    def _do_synchronize(self) -> None:
        self._check_open()
        self._activate()
        self._runtime("cudaDeviceSynchronize", self._rt.deviceSynchronize)

    # -- Device: streams and events (Note [Streams and events on CUDA]) -------------------------------------
    def _do_stream_create(self) -> int:
        self._check_open()
        self._activate()
        return int(self._runtime("cudaStreamCreateWithFlags", self._rt.streamCreateWithFlags, _STREAM_NON_BLOCKING))

    def _do_stream_destroy(self, stream: int) -> None:
        self._check_open()
        self._activate()
        self._runtime("cudaStreamDestroy", self._rt.streamDestroy, stream)

    def _do_event_record(self, stream: int) -> CudaEvent:
        self._check_open()
        self._activate()
        if self._event_pool:
            handle = self._event_pool.pop()
        else:
            handle = int(self._runtime("cudaEventCreateWithFlags", self._rt.eventCreateWithFlags,
                                       _EVENT_DISABLE_TIMING))
        try:
            self._runtime("cudaEventRecord", self._rt.eventRecord, handle, stream)
        except CudaError:
            self._give_back_event(handle)  # the event is still good; only the record failed
            raise
        self._live_events.add(handle)
        return CudaEvent(self, stream, handle)

    def _do_event_query(self, event: CudaEvent) -> bool:
        self._check_open()
        self._activate()
        # CuPy's eventQuery returns cudaEventQuery's status instead of raising; accept both forms
        try:
            status = self._rt.eventQuery(event.handle)
        except self._backend.runtime_error as exc:
            err = from_runtime_error("cudaEventQuery", exc)
            if err.error_name == "cudaErrorNotReady":
                return False
            raise self._translate(err, None, None) from exc
        status = int(status or CUDA_SUCCESS)
        if status == CUDA_SUCCESS:
            return True
        if status == CUDA_ERROR_NOT_READY:
            return False
        err = CudaError("cudaEventQuery", runtime_status_name(status))
        raise self._translate(err, None, None)

    def _do_event_synchronize(self, event: CudaEvent) -> None:
        self._check_open()
        self._activate()
        self._runtime("cudaEventSynchronize", self._rt.eventSynchronize, event.handle)

    def _do_event_destroy(self, event: CudaEvent) -> None:
        self._check_open()
        self._give_back_event(event.handle)
        self._live_events.discard(event.handle)

    def _give_back_event(self, handle: int) -> None:
        """Pool ``handle`` for the next ``event_record`` (a recorded event may be recorded again), or
        destroy it when the pool is full."""
        if len(self._event_pool) < _EVENT_POOL_SIZE:
            self._event_pool.append(handle)
            return
        self._activate()
        self._runtime("cudaEventDestroy", self._rt.eventDestroy, handle)

    def _do_stream_synchronize(self, stream: int) -> None:
        self._check_open()
        self._activate()
        self._runtime("cudaStreamSynchronize", self._rt.streamSynchronize, stream)

    def _do_stream_wait_event(self, stream: int, event: CudaEvent) -> None:
        self._check_open()
        self._activate()
        self._runtime("cudaStreamWaitEvent", self._rt.streamWaitEvent, stream, event.handle, 0)

    # -- life cycle ------------------------------------------------------------------------------------------
    def _do_close(self) -> None:
        """Free everything still held (mappings, chunks, reservations, allocations), then refuse further calls.

        Idempotent and never raises: a CUDA error while cleaning up is logged as
        a warning and cleaning goes on (what CUDA refused to free is reclaimed
        when the process exits).
        """
        if self._closed:
            return
        self._closed = True
        failures: list[str] = []

        def attempt(call: str, fn: Callable[..., Any], *args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - keep cleaning up
                failures.append(f"{call}: {exc}")

        attempt("cudaSetDevice", self._rt.setDevice, self.index)
        attempt("cudaDeviceSynchronize", self._rt.deviceSynchronize)
        vmm = self._vmm
        if vmm is not None:
            for r in list(self._reservations.values()):
                for m in list(r.mappings.values()):
                    attempt("cuMemUnmap", vmm.unmap, m.va, m.nbytes)
            for phys in self._physicals.values():
                if not phys.released:
                    attempt("cuMemRelease", vmm.release, phys.driver_handle)
            for r in self._reservations.values():
                attempt("cuMemAddressFree", vmm.address_free, r.start, r.nbytes)
        for ptr in self._alloc_starts:
            attempt("cudaFree", self._rt.free, ptr)
        for handle in [*self._event_pool, *sorted(self._live_events)]:
            attempt("cudaEventDestroy", self._rt.eventDestroy, handle)
        self._event_pool.clear()
        self._live_events.clear()
        for stream in sorted(self._user_streams):
            attempt("cudaStreamDestroy", self._rt.streamDestroy, stream)
        self._user_streams.clear()
        n_held = len(self._allocations) + len(self._physicals) + len(self._reservations)
        self._allocations.clear()
        self._alloc_starts.clear()
        self._freed.clear()
        self._reservations.clear()
        self._res_starts.clear()
        self._physicals.clear()
        if self._nvml_session is not None:
            self._nvml_session.close()
            self._nvml_session = self._nvml_device = None
        for failure in failures:
            log.warning("%s: while closing: %s", self.spec, failure)
        log.debug("closed %s (released %d allocations, chunks and reservations)", self.spec, n_held)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    # -- introspection for tests and reports (same names as on sim.SimDevice) ---------------------------------
    @property
    def n_allocations(self) -> int:
        """Live ``malloc`` allocations."""
        return len(self._allocations)

    def allocation_ranges(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every live ``malloc`` allocation."""
        return [(p, self._allocations[p]) for p in self._alloc_starts]

    def mapping_ranges(self) -> list[tuple[int, int, int]]:
        """``(va, nbytes, handle)`` of every live mapping."""
        return [(m.va, m.nbytes, m.physical.handle.handle)
                for r in self._reservations.values() for m in r.mappings.values()]

    def reservation_ranges(self) -> list[tuple[int, int]]:
        """``(va, nbytes)`` of every live address reservation."""
        return [(va, self._reservations[va].nbytes) for va in self._res_starts]

    def check_invariants(self) -> None:
        """Raise :class:`~gpumem.errors.InternalError` if the record is inconsistent (used by tests)."""
        with self._lock:
            self._check_invariants()

    def _check_invariants(self) -> None:
        def require(ok: bool, what: str) -> None:
            if not ok:
                raise InternalError(f"{self.spec}: {what}")

        require(self._alloc_starts == sorted(self._allocations), "allocation index out of sync")
        require(self._res_starts == sorted(self._reservations), "reservation index out of sync")
        counts: dict[int, int] = {}
        for r in self._reservations.values():
            require(r.starts == sorted(r.mappings), "mapping index out of sync")
            prev_end = r.start
            for s in r.starts:
                m = r.mappings[s]
                require(s >= prev_end and s + m.nbytes <= r.start + r.nbytes, f"mapping at {s:#x} overlaps or escapes")
                prev_end = s + m.nbytes
                counts[m.physical.handle.handle] = counts.get(m.physical.handle.handle, 0) + 1
        for hid, phys in self._physicals.items():
            require(phys.map_count == counts.get(hid, 0),
                    f"chunk {hid}: {phys.map_count} mappings counted, {counts.get(hid, 0)} found")
            require(not (phys.released and phys.map_count == 0), f"released, unmapped chunk {hid} kept")


__all__ = ["CudaDevice"]
