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
CUDA's answer to a bad pointer ranges from an error code to undefined behaviour (``cuMemRelease`` of
an invalid handle) to a corrupted context (a ``cudaMemcpy`` past the end of an allocation). So
everything this device hands out is recorded in the :class:`~gpumem.device.Device` base class's book
(:class:`~gpumem.vmm_book.MemoryBook`, the simulator's too), and every call is checked against it
*before* CUDA is called:

* live ``malloc`` pointers and their sizes (and a bounded memory of freed ones, so a second ``free``
  is a :class:`~gpumem.errors.DoubleFreeError` rather than an ``InvalidPointerError``);
* address reservations and their mappings, so an overlapping ``mem_map`` raises
  :class:`~gpumem.errors.MappingOverlapError` instead of reaching ``cuMemMap``;
* physical chunks, released or not, with the number of mappings of each.

``read`` and ``write`` only copy inside one live allocation or inside contiguous mappings with access
set. The base class validates, checks the book, calls this class's ``_do_`` method (which calls CUDA),
and updates the book only when CUDA succeeded: a failing call changes nothing; where one request takes
several CUDA calls, the book follows each one that succeeded. Because the checks live in the base
class, the simulator and this device reject the same inputs in the same order
(``tests/cuda_adapter/test_cuda_sim_parity.py`` compares them call by call). After
:meth:`CudaDevice.close` every call with valid arguments except :meth:`~CudaDevice.properties` raises
:class:`~gpumem.errors.DeviceClosedError`; after a sticky CUDA error, :class:`~gpumem.errors.DeviceLostError`.

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

import logging
import os
from typing import Any, Callable, TypeVar

import numpy as np

from gpumem.device import (
    Device,
    DeviceKind,
    DeviceProperties,
    Event,
    MemInfo,
)
from gpumem.errors import (
    BackendUnavailableError,
    CudaError,
    DeviceLostError,
    DeviceNotFoundError,
    InternalError,
    InvalidArgumentError,
    OutOfMemoryError,
    UnsupportedOperationError,
)
from gpumem.units import CUDA_GRANULARITY_NBYTES
from gpumem.vmm_book import Allocation, Mapping, Physical, Reservation

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
        self._lost: CudaError | None = None  # the sticky error that lost the device
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
        # the record (Note [Bookkeeping keeps bad input away from CUDA]) is the base class's book
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
        self._check_usable()

    def _lost_message(self) -> str:
        return f"{self.spec} is lost: {self._lost}"

    def _lose(self, err: CudaError) -> DeviceLostError:
        """Note [A sticky error loses the device]: after ``cudaErrorIllegalAddress`` and its kin the
        context is dead and every later call fails; the record is left as it is (nothing more can be
        freed) and every later call raises :class:`~gpumem.errors.DeviceLostError` at once."""
        if not self._lost:
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

    def _check_vmm(self, call: str) -> None:
        """Refuse a device without VMM (the base class refused a closed or lost one already)."""
        if self._vmm_ok and self._vmm is not None:
            return
        if self._backend.driver is None:
            raise VmmUnavailableError(f"{call}: {self._vmm_missing}")
        msg = f"{call}: {self.spec} ({self._props.name}) does not support virtual memory management"
        if self._vmm_missing and "does not support" not in self._vmm_missing:
            msg += f" ({self._vmm_missing})"  # the driver could not be used: say why
        raise UnsupportedOperationError(msg)

    @property
    def _vmm_driver(self) -> VmmDriver:
        vmm = self._vmm
        if vmm is None:  # never: _check_vmm refused already
            raise InternalError(f"{self.spec}: VMM call without a VMM driver")
        return vmm

    def _close_nvml(self) -> None:
        if self._nvml_session is not None:
            self._nvml_session.close()
            self._nvml_session = self._nvml_device = None

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
        self._activate()
        free, total = self._runtime("cudaMemGetInfo", self._rt.memGetInfo)
        return MemInfo(int(free), int(total))

    # -- Device: malloc and free ----------------------------------------------------------------------
    def _do_malloc(self, nbytes: int) -> Allocation:
        if nbytes > _SIZE_MAX:
            raise self._oom(nbytes, why="larger than CUDA's size_t")
        self._activate()
        ptr = int(self._runtime("cudaMalloc", self._rt.malloc, nbytes, oom_nbytes=nbytes, memory_nbytes=nbytes))
        return Allocation(ptr, nbytes)

    def _do_free(self, alloc: Allocation) -> None:
        self._activate()
        self._runtime("cudaFree", self._rt.free, alloc.start)

    # -- Device: virtual memory management -----------------------------------------------------------
    def _do_address_reserve(self, nbytes: int, alignment: int) -> int:
        vmm = self._vmm_driver
        if nbytes > _SIZE_MAX:
            raise self._oom(nbytes, why="larger than CUDA's size_t")
        va = self._driver("cuMemAddressReserve", vmm.address_reserve, nbytes, alignment, oom_nbytes=nbytes)
        if va % max(alignment, self._gran):
            # never seen: the driver aligns to the granularity at least. Refuse rather than hand it out.
            self._driver("cuMemAddressFree", vmm.address_free, va, nbytes)
            raise CudaError("cuMemAddressReserve", "misaligned",
                            f"{va:#x} is not aligned to {max(alignment, self._gran)}")
        return va

    def _do_address_free(self, va: int, nbytes: int) -> None:
        self._driver("cuMemAddressFree", self._vmm_driver.address_free, va, nbytes)

    def _do_mem_create(self, nbytes: int) -> Any:
        vmm = self._vmm_driver
        if nbytes > _SIZE_MAX:
            raise self._oom(nbytes, why="larger than CUDA's size_t")
        return self._driver("cuMemCreate", vmm.create, nbytes, oom_nbytes=nbytes, memory_nbytes=nbytes)

    def _do_mem_release(self, phys: Physical) -> None:
        self._driver("cuMemRelease", self._vmm_driver.release, phys.native)

    def _do_mem_map(self, va: int, nbytes: int, phys: Physical, offset: int) -> None:
        self._driver("cuMemMap", self._vmm_driver.map, va, nbytes, phys.native, offset, oom_nbytes=nbytes)

    def _do_mem_set_access(self, va: int, nbytes: int, maps: list[Mapping]) -> None:
        # One driver call for the whole range: cuMemSetAccess accepts any fully mapped range,
        # and each call costs ~27 us on an H200 whatever its size (sim/calibrate.py).
        self._driver("cuMemSetAccess", self._vmm_driver.set_access, va, nbytes)

    def _do_mem_unmap(self, r: Reservation, maps: list[Mapping]) -> None:
        """One ``cuMemUnmap`` per mapping, as the driver requires; the book follows each one that succeeded."""
        vmm = self._vmm_driver
        for m in maps:
            self._driver("cuMemUnmap", vmm.unmap, m.va, m.nbytes)
            self._unmapped(r, m)

    # -- Device: data ------------------------------------------------------------------------------------
    def _do_write(self, ptr: int, view: memoryview, pieces: list[tuple[Any, int, int]]) -> None:
        host = np.frombuffer(view, dtype=np.uint8)  # no copy; keeps the buffer alive during the call
        kind = getattr(self._rt, "memcpyHostToDevice", _MEMCPY_HOST_TO_DEVICE)
        self._activate()
        self._runtime("cudaMemcpy", self._rt.memcpy, ptr, host.ctypes.data, len(view), kind)

    def _do_read(self, ptr: int, nbytes: int, pieces: list[tuple[Any, int, int]]) -> bytes:
        host = np.empty(nbytes, dtype=np.uint8)
        kind = getattr(self._rt, "memcpyDeviceToHost", _MEMCPY_DEVICE_TO_HOST)
        self._activate()
        self._runtime("cudaMemcpy", self._rt.memcpy, host.ctypes.data, ptr, nbytes, kind)
        return host.tobytes()

    def _do_synchronize(self) -> None:
        self._activate()
        self._runtime("cudaDeviceSynchronize", self._rt.deviceSynchronize)

    # -- Device: streams and events (Note [Streams and events on CUDA]) -------------------------------------
    def _do_stream_create(self) -> int:
        self._activate()
        return int(self._runtime("cudaStreamCreateWithFlags", self._rt.streamCreateWithFlags, _STREAM_NON_BLOCKING))

    def _do_stream_destroy(self, stream: int) -> None:
        self._activate()
        self._runtime("cudaStreamDestroy", self._rt.streamDestroy, stream)

    def _do_event_record(self, stream: int) -> CudaEvent:
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
        self._activate()
        self._runtime("cudaEventSynchronize", self._rt.eventSynchronize, event.handle)

    def _do_event_destroy(self, event: CudaEvent) -> None:
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
        self._activate()
        self._runtime("cudaStreamSynchronize", self._rt.streamSynchronize, stream)

    def _do_stream_wait_event(self, stream: int, event: CudaEvent) -> None:
        self._activate()
        self._runtime("cudaStreamWaitEvent", self._rt.streamWaitEvent, stream, event.handle, 0)

    # -- life cycle ------------------------------------------------------------------------------------------
    def _do_close(self) -> None:
        """Free everything still held (mappings, chunks, reservations, allocations), then refuse further calls.

        Idempotent and never raises: a CUDA error while cleaning up is logged as
        a warning and cleaning goes on (what CUDA refused to free is reclaimed
        when the process exits).
        """
        failures: list[str] = []

        def attempt(call: str, fn: Callable[..., Any], *args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - keep cleaning up
                failures.append(f"{call}: {exc}")

        book = self._book
        if self._lost:
            # the context is dead: every CUDA call would fail; the driver frees it all with the process
            log.debug("closed lost %s without freeing (%d records dropped)", self.spec,
                      len(book.allocations) + len(book.physicals) + len(book.reservations))
            self._event_pool.clear()
            self._live_events.clear()
            self._close_nvml()
            return
        attempt("cudaSetDevice", self._rt.setDevice, self.index)
        attempt("cudaDeviceSynchronize", self._rt.deviceSynchronize)
        vmm = self._vmm
        if vmm is not None:
            for r in book.reservations.values():
                for m in r.mappings.values():
                    attempt("cuMemUnmap", vmm.unmap, m.va, m.nbytes)
            for phys in book.physicals.values():
                if not phys.released:
                    attempt("cuMemRelease", vmm.release, phys.native)
            for r in book.reservations.values():
                attempt("cuMemAddressFree", vmm.address_free, r.start, r.nbytes)
        for alloc in book.allocations.values():
            attempt("cudaFree", self._rt.free, alloc.start)
        for handle in [*self._event_pool, *sorted(self._live_events)]:
            attempt("cudaEventDestroy", self._rt.eventDestroy, handle)
        self._event_pool.clear()
        self._live_events.clear()
        for stream in sorted(self._user_streams):
            attempt("cudaStreamDestroy", self._rt.streamDestroy, stream)
        n_held = len(book.allocations) + len(book.physicals) + len(book.reservations)
        self._close_nvml()
        for failure in failures:
            log.warning("%s: while closing: %s", self.spec, failure)
        log.debug("closed %s (released %d allocations, chunks and reservations)", self.spec, n_held)

__all__ = ["CudaDevice"]
