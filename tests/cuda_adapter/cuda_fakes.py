"""Fake CuPy runtime, cuda-bindings driver and pynvml modules for testing gpumem.cuda without a GPU.

Deliberately small: they are not a second simulator. They do just enough to
(1) let :class:`gpumem.cuda.CudaDevice` run its bookkeeping and error
translation, and (2) *fail loudly* (``AssertionError``) when the adapter hands
CUDA something a real driver would choke on: a pointer it never returned, an
overlapping mapping, a released handle. "Device memory" is host memory from
``ctypes``, so ``cudaMemcpy`` really copies and a read-after-write round trip
tests the adapter's pointer arithmetic.

Errors are injected one call at a time: ``fake.fail["cudaMalloc"] = "cudaErrorMemoryAllocation"``
makes the next ``malloc`` fail with that error (runtime and driver alike).
"""

from __future__ import annotations

import ctypes
import enum
import os
from types import SimpleNamespace
from typing import Any

from gpumem.cuda import CudaBackend, CudaDevice

MiB = 2**20
GiB = 2**30

H200_PROPS: dict[str, Any] = {
    "name": b"NVIDIA H200",
    "totalGlobalMem": 150_109_880_320,
    "major": 9,
    "minor": 0,
    "multiProcessorCount": 132,
    "integrated": 0,
    "memoryClockRate": 3_201_000,
    "memoryBusWidth": 6016,
}
#: 2 x 3.201 GHz x 6016 bit / 8, as measured on the H200.
H200_BANDWIDTH_GBPS = 2 * 3_201_000 * 1e3 * 6016 / 8 / 1e9

RUNTIME_ERRORS = {
    "cudaErrorInvalidValue": (1, "invalid argument"),
    "cudaErrorMemoryAllocation": (2, "out of memory"),
    "cudaErrorInsufficientDriver": (35, "CUDA driver version is insufficient for CUDA runtime version"),
    "cudaErrorNoDevice": (100, "no CUDA-capable device is detected"),
    "cudaErrorInvalidDevice": (101, "invalid device ordinal"),
    "cudaErrorInvalidResourceHandle": (400, "invalid resource handle"),
    "cudaErrorNotReady": (600, "device not ready"),
    "cudaErrorIllegalAddress": (700, "an illegal memory access was encountered"),
}


class FakeCUDARuntimeError(RuntimeError):
    """Like CuPy's: ``status`` and a message starting with CUDA's name for the error."""

    def __init__(self, name: str) -> None:
        self.status, text = RUNTIME_ERRORS[name]
        super().__init__(f"{name}: {text}")


class _Host:
    """Host memory standing in for device memory, aligned like CUDA's."""

    def __init__(self, nbytes: int, alignment: int) -> None:
        self.buf = ctypes.create_string_buffer(nbytes + alignment)
        base = ctypes.addressof(self.buf)
        self.addr = -(-base // alignment) * alignment
        self.nbytes = nbytes


class FakeRuntime:
    """Stands in for ``cupy.cuda.runtime`` (one process, ``device_count`` identical GPUs)."""

    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2
    cudaDevAttrMemoryClockRate = 36
    cudaDevAttrGlobalMemoryBusWidth = 37
    CUDARuntimeError = FakeCUDARuntimeError

    def __init__(self, device_count: int = 1, total_nbytes: int = 1 * GiB, props: dict | None = None,
                 attributes: dict[int, int] | None = None) -> None:
        self.device_count = device_count
        self.total_nbytes = total_nbytes
        self.props = dict(H200_PROPS if props is None else props, totalGlobalMem=total_nbytes)
        self.attributes = attributes or {}
        self.used_nbytes = 0
        self.current: int | None = None
        self.calls: list[tuple[str, tuple]] = []
        self.fail: dict[str, str] = {}
        self.allocations: dict[int, _Host] = {}
        self.driver: FakeDriver | None = None  # set by FakeDriver, for memcpy into mappings
        # streams and events: work is "queued" on a stream while the stream is in ``busy``; an event
        # recorded then stays pending until that stream (or the device) is synchronized
        self.streams: dict[int, int] = {}     # handle -> flags (streams made by cudaStreamCreateWithFlags)
        self.busy: set[int] = set()           # streams with unfinished work (tests add to it)
        self.events: dict[int, list] = {}     # handle -> [flags, pending, stream recorded on]
        self.waits: list[tuple[int, int]] = []  # (stream, event) of each cudaStreamWaitEvent
        self.query_status: dict[int, int] = {}  # event -> status cudaEventQuery returns instead (e.g. 700)
        self._next_handle = 0x5000

    def _enter(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        error = self.fail.pop(name, None)
        if error is not None:
            raise FakeCUDARuntimeError(error)

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    # device and properties
    def getDeviceCount(self) -> int:
        self._enter("cudaGetDeviceCount")
        return self.device_count

    def setDevice(self, index: int) -> None:
        self._enter("cudaSetDevice", index)
        if not 0 <= index < self.device_count:
            raise FakeCUDARuntimeError("cudaErrorInvalidDevice")
        self.current = index

    def getDeviceProperties(self, index: int) -> dict:
        self._enter("cudaGetDeviceProperties", index)
        return dict(self.props)

    def deviceGetAttribute(self, attr: int, index: int) -> int:
        self._enter("cudaDeviceGetAttribute", attr, index)
        if attr not in self.attributes:
            raise FakeCUDARuntimeError("cudaErrorInvalidValue")
        return self.attributes[attr]

    def deviceGetPCIBusId(self, index: int) -> str:
        self._enter("cudaDeviceGetPCIBusId", index)
        return f"0000:{0x18 + index:02x}:00.0"

    def deviceSynchronize(self) -> None:
        self._enter("cudaDeviceSynchronize")
        self.busy.clear()
        for ev in self.events.values():
            ev[1] = False

    # streams and events (CuPy's signatures; eventQuery returns the status, as CuPy's does)
    def _stream_ok(self, stream: int) -> None:
        assert stream == 0 or stream in self.streams or stream >= 0x1_0000_0000, \
            f"stream {stream:#x} was never created (undefined behaviour)"

    def _event(self, event: int) -> list:
        assert event in self.events, f"event {event:#x} was never created or was destroyed (undefined behaviour)"
        return self.events[event]

    def streamCreateWithFlags(self, flags: int) -> int:
        self._enter("cudaStreamCreateWithFlags", flags)
        self._next_handle += 0x10
        self.streams[self._next_handle] = flags
        return self._next_handle

    def streamDestroy(self, stream: int) -> None:
        self._enter("cudaStreamDestroy", stream)
        assert stream in self.streams, f"cudaStreamDestroy of {stream:#x}, never created"
        del self.streams[stream]
        self.busy.discard(stream)

    def streamSynchronize(self, stream: int) -> None:
        self._enter("cudaStreamSynchronize", stream)
        self._stream_ok(stream)
        self.busy.discard(stream)
        for ev in self.events.values():
            if ev[2] == stream:
                ev[1] = False

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        self._enter("cudaStreamWaitEvent", stream, event, flags)
        self._stream_ok(stream)
        self._event(event)
        self.waits.append((stream, event))

    def eventCreateWithFlags(self, flags: int) -> int:
        self._enter("cudaEventCreateWithFlags", flags)
        self._next_handle += 0x10
        self.events[self._next_handle] = [flags, False, None]
        return self._next_handle

    def eventDestroy(self, event: int) -> None:
        self._enter("cudaEventDestroy", event)
        self._event(event)
        del self.events[event]

    def eventRecord(self, event: int, stream: int) -> None:
        self._enter("cudaEventRecord", event, stream)
        self._stream_ok(stream)
        ev = self._event(event)
        ev[1], ev[2] = stream in self.busy, stream

    def eventQuery(self, event: int) -> int:
        self.calls.append(("cudaEventQuery", (event,)))
        ev = self._event(event)
        if event in self.query_status:
            return self.query_status[event]
        return RUNTIME_ERRORS["cudaErrorNotReady"][0] if ev[1] else 0

    def eventSynchronize(self, event: int) -> None:
        self._enter("cudaEventSynchronize", event)
        ev = self._event(event)
        if ev[1]:
            self.busy.discard(ev[2])
            ev[1] = False

    # memory
    def memGetInfo(self) -> tuple[int, int]:
        self._enter("cudaMemGetInfo")
        return self.total_nbytes - self.used_nbytes, self.total_nbytes

    def malloc(self, nbytes: int) -> int:
        self._enter("cudaMalloc", nbytes)
        assert self.current is not None, "cudaMalloc before cudaSetDevice"
        if self.used_nbytes + nbytes > self.total_nbytes:
            raise FakeCUDARuntimeError("cudaErrorMemoryAllocation")
        host = _Host(nbytes, 256)
        self.allocations[host.addr] = host
        self.used_nbytes += nbytes
        return host.addr

    def free(self, ptr: int) -> None:
        self._enter("cudaFree", ptr)
        if ptr == 0:
            return
        assert ptr in self.allocations, f"cudaFree of {ptr:#x}, which cudaMalloc never returned"
        self.used_nbytes -= self.allocations.pop(ptr).nbytes

    def _device_range_ok(self, ptr: int, nbytes: int) -> bool:
        for host in self.allocations.values():
            if host.addr <= ptr and ptr + nbytes <= host.addr + host.nbytes:
                return True
        return self.driver is not None and self.driver.accessible(ptr, nbytes)

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self._enter("cudaMemcpy", dst, src, nbytes, kind)
        device_ptr = dst if kind == self.memcpyHostToDevice else src
        assert kind in (self.memcpyHostToDevice, self.memcpyDeviceToHost), kind
        assert self._device_range_ok(device_ptr, nbytes), \
            f"cudaMemcpy of {nbytes} bytes at {device_ptr:#x}: not inside an allocation or accessible mapping"
        ctypes.memmove(dst, src, nbytes)


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_SUPPORTED = 801


class _Ptr:
    """Like ``CUdeviceptr`` / ``CUmemGenericAllocationHandle``: a wrapper that ``int()`` unwraps."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


class FakeDriver:
    """Stands in for ``cuda.bindings.driver``: results are ``(CUresult, value...)`` tuples."""

    CUresult = CUresult
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102)

    @staticmethod
    def CUmemAllocationProp() -> SimpleNamespace:  # noqa: N802 - the driver's name
        return SimpleNamespace(type=None, location=SimpleNamespace(type=None, id=None))

    @staticmethod
    def CUmemAccessDesc() -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(flags=None, location=SimpleNamespace(type=None, id=None))

    def __init__(self, runtime: FakeRuntime, *, vmm_supported: bool = True, granularity: int = 2 * MiB) -> None:
        self.runtime = runtime
        runtime.driver = self
        self.vmm_supported = vmm_supported
        self.gran = granularity
        self.calls: list[tuple[str, tuple]] = []
        self.fail: dict[str, str] = {}
        self.reservations: dict[int, _Host] = {}
        self.handles: dict[int, list] = {}  # id -> [nbytes, released, n_mappings]
        self.mappings: dict[int, list] = {}  # va -> [nbytes, handle id, accessible]
        self.no_peer_access: set[tuple[int, int]] = set()   # (dev, peer) pairs cuDeviceCanAccessPeer refuses
        self.access_ids: list[tuple[int, ...]] = []          # the devices each cuMemSetAccess named
        self._next = 100

    def _enter(self, name: str, *args: Any) -> CUresult:
        self.calls.append((name, args))
        error = self.fail.pop(name, None)
        return CUresult[error] if error else CUresult.CUDA_SUCCESS

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    def accessible(self, ptr: int, nbytes: int) -> bool:
        cursor, end = ptr, ptr + nbytes
        while cursor < end:
            hit = [(va, m) for va, m in self.mappings.items() if va <= cursor < va + m[0]]
            if not hit or not hit[0][1][2]:
                return False
            cursor = hit[0][0] + hit[0][1][0]
        return True

    def cuGetErrorName(self, err: CUresult) -> tuple:  # noqa: N802
        return CUresult.CUDA_SUCCESS, err.name.encode()

    def cuGetErrorString(self, err: CUresult) -> tuple:  # noqa: N802
        return CUresult.CUDA_SUCCESS, f"fake {err.name}".encode()

    def cuInit(self, flags: int) -> tuple:  # noqa: N802
        return (self._enter("cuInit", flags),)

    def cuDeviceGet(self, ordinal: int) -> tuple:  # noqa: N802
        return self._enter("cuDeviceGet", ordinal), _Ptr(ordinal)

    def cuDeviceGetCount(self) -> tuple:  # noqa: N802
        return self._enter("cuDeviceGetCount"), self.runtime.device_count

    def cuDeviceCanAccessPeer(self, dev: _Ptr, peer: _Ptr) -> tuple:  # noqa: N802
        """Whether ``dev`` can reach ``peer``'s memory: every pair but those in ``no_peer_access``."""
        err = self._enter("cuDeviceCanAccessPeer", dev, peer)
        return err, int((int(dev), int(peer)) not in self.no_peer_access)

    def cuDeviceGetAttribute(self, attr: int, dev: _Ptr) -> tuple:  # noqa: N802
        return self._enter("cuDeviceGetAttribute", attr, dev), int(self.vmm_supported)

    def cuMemGetAllocationGranularity(self, prop: SimpleNamespace, flag: int) -> tuple:  # noqa: N802
        assert prop.type == 1 and prop.location.type == 1
        return self._enter("cuMemGetAllocationGranularity", prop, flag), self.gran

    def cuMemAddressReserve(self, nbytes: int, alignment: int, addr: int, flags: int) -> tuple:  # noqa: N802
        err = self._enter("cuMemAddressReserve", nbytes, alignment, addr, flags)
        if err:
            return err, _Ptr(0)
        host = _Host(nbytes, max(alignment, self.gran))
        self.reservations[host.addr] = host
        return CUresult.CUDA_SUCCESS, _Ptr(host.addr)

    def cuMemAddressFree(self, va: int, nbytes: int) -> tuple:  # noqa: N802
        err = self._enter("cuMemAddressFree", va, nbytes)
        if err:
            return (err,)
        host = self.reservations.get(va)
        assert host is not None and host.nbytes == nbytes, f"cuMemAddressFree({va:#x}, {nbytes}): no such reservation"
        assert not any(va <= m < va + nbytes for m in self.mappings), "cuMemAddressFree of a mapped reservation"
        del self.reservations[va]
        return (CUresult.CUDA_SUCCESS,)

    def cuMemCreate(self, nbytes: int, prop: SimpleNamespace, flags: int) -> tuple:  # noqa: N802
        err = self._enter("cuMemCreate", nbytes, prop, flags)
        if err:
            return err, _Ptr(0)
        assert nbytes % self.gran == 0
        if self.runtime.used_nbytes + nbytes > self.runtime.total_nbytes:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, _Ptr(0)
        self._next += 1
        self.handles[self._next] = [nbytes, False, 0]
        self.runtime.used_nbytes += nbytes
        return CUresult.CUDA_SUCCESS, _Ptr(self._next)

    def _maybe_drop(self, hid: int) -> None:
        nbytes, released, n_maps = self.handles[hid]
        if released and n_maps == 0:
            del self.handles[hid]
            self.runtime.used_nbytes -= nbytes

    def cuMemRelease(self, handle: _Ptr) -> tuple:  # noqa: N802
        err = self._enter("cuMemRelease", handle)
        if err:
            return (err,)
        h = self.handles.get(int(handle))
        assert h is not None and not h[1], f"cuMemRelease of unknown or released handle {int(handle)} (undefined)"
        h[1] = True
        self._maybe_drop(int(handle))
        return (CUresult.CUDA_SUCCESS,)

    def cuMemMap(self, va: int, nbytes: int, offset: int, handle: _Ptr, flags: int) -> tuple:  # noqa: N802
        err = self._enter("cuMemMap", va, nbytes, offset, handle, flags)
        if err:
            return (err,)
        assert isinstance(va, int) and isinstance(handle, _Ptr), (va, handle)
        h = self.handles.get(int(handle))
        assert h is not None and not h[1] and offset + nbytes <= h[0], "cuMemMap of a bad handle or range"
        assert any(r <= va and va + nbytes <= r + host.nbytes for r, host in self.reservations.items()), \
            "cuMemMap outside any reservation"
        assert not any(m < va + nbytes and va < m + v[0] for m, v in self.mappings.items()), "cuMemMap overlap"
        self.mappings[va] = [nbytes, int(handle), False]
        h[2] += 1
        return (CUresult.CUDA_SUCCESS,)

    def cuMemSetAccess(self, va: int, nbytes: int, descs: list, count: int) -> tuple:  # noqa: N802
        err = self._enter("cuMemSetAccess", va, nbytes, descs, count)
        if err:
            return (err,)
        assert count == len(descs) >= 1 and all(d.flags == 3 and d.location.type == 1 for d in descs)
        self.access_ids.append(tuple(d.location.id for d in descs))
        # the driver accepts any fully mapped range, tiled by one or more whole mappings
        cursor, end = va, va + nbytes
        while cursor < end:
            m = self.mappings.get(cursor)
            assert m is not None, "cuMemSetAccess on a range that is not fully mapped"
            m[2] = True
            cursor += m[0]
        assert cursor == end, "cuMemSetAccess range ends inside a mapping"
        return (CUresult.CUDA_SUCCESS,)

    def cuMemUnmap(self, va: int, nbytes: int) -> tuple:  # noqa: N802
        err = self._enter("cuMemUnmap", va, nbytes)
        if err:
            return (err,)
        m = self.mappings.get(va)
        assert m is not None and m[0] == nbytes, f"cuMemUnmap({va:#x}, {nbytes}) is not one whole mapping"
        del self.mappings[va]
        self.handles[m[1]][2] -= 1
        self._maybe_drop(m[1])
        return (CUresult.CUDA_SUCCESS,)


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        self.value = value
        super().__init__({1: "Uninitialized", 3: "Not Supported", 12: "NVML Shared Library Not Found"}.get(value, "?"))


class FakeNvml:
    """Stands in for ``pynvml``: ``gpus`` is a list of dicts (name, uuid, total, used, pci, processes)."""

    NVML_ERROR_UNINITIALIZED = 1
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_CLOCK_MEM = 2
    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[dict] | None = None, *, init_error: int | None = None) -> None:
        self.gpus = gpus if gpus is not None else [fake_gpu(0)]
        self.init_error = init_error
        self.inits = 0
        self.fail: dict[str, int] = {}

    def _enter(self, name: str) -> None:
        error = self.fail.pop(name, None)
        if error is not None:
            raise FakeNVMLError(error)
        if name != "nvmlInit" and self.inits <= 0:
            raise FakeNVMLError(self.NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:  # noqa: N802
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self._enter("nvmlInit")
        self.inits += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._enter("nvmlShutdown")
        self.inits -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict:  # noqa: N802
        self._enter("nvmlDeviceGetHandleByIndex")
        return self.gpus[i]

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: bytes) -> dict:  # noqa: N802
        self._enter("nvmlDeviceGetHandleByPciBusId")
        assert isinstance(bus_id, bytes)
        for g in self.gpus:
            if g["pci"] == bus_id.decode():
                return g
        raise FakeNVMLError(3)

    def nvmlDeviceGetName(self, h: dict) -> str:  # noqa: N802
        self._enter("nvmlDeviceGetName")
        return h["name"]

    def nvmlDeviceGetUUID(self, h: dict) -> bytes:  # noqa: N802
        self._enter("nvmlDeviceGetUUID")
        return h["uuid"].encode()

    def nvmlDeviceGetMemoryInfo(self, h: dict) -> SimpleNamespace:  # noqa: N802
        self._enter("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=h["total"], used=h["used"], free=h["total"] - h["used"])

    def nvmlDeviceGetComputeRunningProcesses(self, h: dict) -> list:  # noqa: N802
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h["processes"]]

    def nvmlDeviceGetMaxClockInfo(self, h: dict, clock: int) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetMaxClockInfo")
        assert clock == self.NVML_CLOCK_MEM
        return h.get("mem_clock_mhz", 3201)


def fake_gpu(i: int, *, processes: list | None = None, total: int = 150_754_820_096, used: int = 1_197_342_720) -> dict:
    return {"name": "NVIDIA H200", "uuid": f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}", "total": total, "used": used,
            "pci": f"0000:{0x18 + i:02x}:00.0", "processes": processes or []}


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
