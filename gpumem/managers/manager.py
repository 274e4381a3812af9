"""GpuMemoryManager: one GPU's memory behind a reserve, a limit, statistics, tracking and forensics.

The manager reads the device's real total and free memory and its properties, computes the
reserve and the usable memory (Note [The reserve rule] in :mod:`gpumem.managers.reserve`, capped
by ``MemoryConfig.gpu_memory_fraction``), and builds a stack of memory resources
(:mod:`gpumem.managers.resource`, :mod:`gpumem.managers.layers`), bottom to top:

1. a caching allocator (:func:`gpumem.allocator.make_allocator`, a memory resource) limited to the
   usable memory (``enable_pooling=True``) or :class:`~gpumem.managers.resource.DeviceResource`
   (straight from the device);
2. with pooling, :class:`~gpumem.managers.layers.FailureCallbackLayer` calling ``empty_cache``
   and retrying once on out of memory;
3. :class:`~gpumem.managers.layers.LimitingLayer` at the usable memory: a request that would pass
   it is refused with :class:`~gpumem.errors.OutOfMemoryError` before anything changes;
4. :class:`~gpumem.managers.layers.StatisticsLayer`;
5. :class:`~gpumem.managers.layers.TrackingLayer` (``track_allocations``): regions, tags, stacks;
6. :class:`~gpumem.managers.forensics.ForensicsLayer` (``oom_forensics_dir``).

:attr:`GpuMemoryManager.resource` is the top of that stack, itself a memory resource.

Note [Fallbacks move back by themselves]
---------------------------------------
A :class:`~gpumem.managers.FallbackBuffer` that fell back to the CPU because the GPU was full moves
back to the GPU when memory frees up, as issue 8 promises, without the program asking: after every
:meth:`GpuMemoryManager.deallocate` and :meth:`~GpuMemoryManager.empty_cache`, the manager tries the
buffers that fell back, smallest first, as long as the usable memory's headroom (usable minus
allocated) covers them. It stays cheap: with no buffer on the CPU it is one check of an empty set, and
a buffer larger than the headroom is not tried. A buffer that is busy on another thread (its lock held)
is skipped rather than waited for, so a free never blocks on, or deadlocks with, another buffer's
operation. A buffer moved with ``move_to_cpu()`` stays there: the program asked for it. When the
device is full for other reasons (other processes) the attempt fails quietly and the buffer stays on
the CPU. :meth:`~GpuMemoryManager.restore_fallbacks` does the same on demand for every CPU buffer (a
pressure monitor's callback at LOW is a good place: see docs/managers.md).

Note [Usable memory and the fraction]
-------------------------------------
``usable_memory = min(free_at_start - emergency, fraction * total - used_at_start)``: the reserve
rule keeps headroom for what allocates outside the manager, and ``gpu_memory_fraction`` caps the
share of the card this process holds, counting what was already in use when the manager started
(as vLLM's ``gpu_memory_utilization`` does). ``reserved_memory = total_memory - usable_memory``,
so the three attributes always add up; :attr:`GpuMemoryManager.reserve` keeps the rule's parts.
"""

from __future__ import annotations

import logging
import sys
import os
import threading
import weakref
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from gpumem.device import Device, DeviceKind, MemInfo
from gpumem.errors import (DeviceClosedError, DeviceNotFoundError, InvalidArgumentError, InvalidPointerError,
                           OutOfMemoryError)
from gpumem.units import format_bytes

from .config import MemoryConfig
from .fallback import FallbackBuffer
from .layers import FailureCallbackLayer, LimitingLayer, StatisticsLayer, TrackingLayer
from .reserve import Reserve, compute_reserve, manager_usable_nbytes, usable_nbytes
from gpumem.allocator import AlignmentLayer, make_allocator
from gpumem.allocator.bucket import is_bucket_policy
from gpumem.allocator.resource import AllocatorContract

from .resource import DEFAULT_ALIGNMENT, Allocation, DeviceResource, MemoryResource
from .tracker import AllocationTracker, RegionStats


log = logging.getLogger(__name__)

#: Note [The pool's limit]: the limiting layer keeps the bytes *requested* within the usable memory;
#: the caching allocator under it rounds blocks up (512 B, and pages of 2 MiB in virtual-memory mode)
#: and caches freed blocks, so what it *holds* runs a little above what was requested (0.5-0.7 % on
#: the recorded traces). Its own limit is therefore the usable memory plus a slack of 1/64 of it
#: (at least 4 pages), taken from the reserve's emergency part and never more than that part: a
#: request that fits the usable memory is not refused for rounding, and the pool never eats the
#: context or more than the headroom. A pool can still refuse a request the usable memory has room
#: for: without virtual memory (segments from ``malloc``), a cached segment split by a live block
#: cannot serve a request of its own size, and a new segment would pass the pool's limit. Before
#: that error propagates the allocator and the failure-callback layer give the cache back and retry.
POOL_SLACK_DENOMINATOR = 64
POOL_SLACK_PAGES = 4

#: Note [When fragmentation is worth a warning]: only when the pool's free cached bytes are at least
#: 1/100 of the usable memory. The ratio of a tiny cache says nothing: the unused tail of one 2 MiB
#: page under a live block is "100 % fragmented" (no free block at all) and costs nothing.
FRAGMENTATION_MIN_CACHED_DENOMINATOR = 100


@dataclass(frozen=True)
class PoolStats:
    """The caching allocator's figures (pooling on)."""

    policy: str
    reserved_nbytes: int
    """What the pool holds from the device."""
    cached_nbytes: int
    """Held but not in live blocks (rounding included)."""
    cache_hits: int
    cache_misses: int
    num_segments: int

    @property
    def hit_rate(self) -> float:
        """Hits / (hits + misses), 0 before any allocation."""
        n = self.cache_hits + self.cache_misses
        return self.cache_hits / n if n else 0.0


@dataclass(frozen=True)
class MemoryStats:
    """:meth:`GpuMemoryManager.get_detailed_stats`: the manager and its device at one moment."""

    device: str
    device_name: str
    total_nbytes: int
    reserved_nbytes: int
    """Kept out of reach: the reserve and the fraction's cap (Note [Usable memory and the fraction])."""
    usable_nbytes: int
    allocated_nbytes: int
    """Live bytes handed out (as requested)."""
    peak_allocated_nbytes: int
    held_nbytes: int
    """What the manager holds from the device (the pool's reserved bytes; the allocations without a pool)."""
    free_nbytes: int
    """The device's free bytes right now (other processes and tenants included)."""
    utilisation: float
    """``allocated / usable``."""
    fragmentation_ratio: float
    """The pool's external fragmentation: ``1 - largest free block / free cached bytes`` (0 without a pool)."""
    largest_free_block_nbytes: int
    """The largest free block cached in the pool (0 without a pool)."""
    n_allocations: int
    n_ooms: int
    cpu_fallbacks: int
    """Buffers placed on the CPU because the GPU could not hold them (ever)."""
    cpu_fallback_nbytes: int
    """Bytes of fallback buffers on the CPU now."""
    pool: PoolStats | None = None
    regions: tuple[RegionStats, ...] = ()
    """Per region (sub-regions included), from the tracker; empty when tracking is off."""


def _resolve_device(device: Any) -> tuple[Device, bool]:
    """``(device, owned)`` from a Device, a spec string or a CUDA index."""
    if isinstance(device, Device):
        if device.closed:
            raise DeviceClosedError(f"{device.spec} is closed")
        return device, False
    if isinstance(device, str):
        from gpumem.specs import open_device

        return open_device(device), True
    if isinstance(device, int) and not isinstance(device, bool):
        from gpumem.cuda.nvml import list_cuda_devices

        found = list_cuda_devices()
        if not 0 <= device < len(found):
            listing = ", ".join(f"{d.spec} ({d.name})" for d in found)
            raise DeviceNotFoundError(
                f"CUDA device index {device} does not exist: {len(found)} CUDA device(s) found"
                + (f" ({listing})" if found else " (no NVIDIA driver, no GPU, or nvidia-ml-py not installed)")
                + "; a simulated GPU is GpuMemoryManager('sim:<profile>') (`gpumem devices` lists them)")
        from gpumem.specs import open_device

        return open_device(f"cuda:{device}"), True
    raise InvalidArgumentError(f"device must be a gpumem.Device, a spec such as 'sim:a100-80gb' or a CUDA index, "
                               f"got {type(device).__name__}")


class GpuMemoryManager:
    """One GPU's memory under a reserve and a limit (module docstring).

    ``device``: a :class:`gpumem.Device` (the caller keeps owning it), a spec (``"sim:a100-80gb"``,
    ``"cuda:0"``) or a CUDA index (both opened and closed by the manager). ``enable_pooling``: a
    caching allocator (True) or one device allocation per request (False). ``config``: a
    :class:`~gpumem.managers.MemoryConfig` (default ``MemoryConfig()``). ``device_index``: what
    :class:`Allocation` reports (default: the CUDA index, 0 for a simulated device).

    Thread-safe: the layers lock their own state; ``_lock`` guards ``_live``, ``_fallbacks``
    and the fallback counters.
    """

    def __init__(self, device: Device | str | int, enable_pooling: bool = True, config: MemoryConfig | None = None,
                 *, device_index: int | None = None) -> None:
        if config is None:
            config = MemoryConfig()
        if not isinstance(config, MemoryConfig):
            raise InvalidArgumentError(f"config must be a MemoryConfig, got {type(config).__name__}")
        if not isinstance(enable_pooling, bool):
            raise InvalidArgumentError(f"enable_pooling must be a bool, got {enable_pooling!r}")
        if device_index is not None and (type(device_index) is not int or device_index < 0):
            raise InvalidArgumentError(f"device_index must be None or an int >= 0, got {device_index!r}")
        self.config = config
        self.enable_pooling = enable_pooling
        self.device, self._owns_device = _resolve_device(device)
        self._lock = threading.Lock()
        self._live: dict[int, Allocation] = {}
        self._fallbacks: dict[int, FallbackBuffer] = {}
        self._cpu_fallbacks = 0
        self._cpu_fallback_nbytes = 0
        self._fell_back: set[int] = set()
        self._buffers: "weakref.WeakSet[FallbackBuffer]" = weakref.WeakSet()
        """Every FallbackBuffer made on this manager, wherever it lives, so close() can mark each freed
        (a GPU-resident one would otherwise keep a pointer into memory the close gave back)."""
        """ids of the buffers in ``_fallbacks`` that fell back (Note [Fallbacks move back by themselves])."""
        self._restoring = threading.local()
        self._closed = False
        self.tracker: AllocationTracker | None = None
        self.resource: MemoryResource
        try:
            self._setup(device_index)
        except BaseException:
            self._undo_setup()
            raise

    def _undo_setup(self) -> None:
        """A failed constructor gives back what it built (pool, exit report, the device it opened)."""
        try:
            top = getattr(self, "resource", None) or getattr(self, "_base", None)
            if top is not None:
                top.close()
            if self.tracker is not None:
                self.tracker.close()
        finally:
            if self._owns_device:
                self.device.close()

    def _setup(self, device_index: int | None) -> None:
        dev, config = self.device, self.config
        if device_index is None:
            device_index = int(dev.spec.split(":", 1)[1]) if dev.kind is DeviceKind.CUDA else 0
        self.device_index = device_index
        self.properties = dev.properties()
        mem = dev.mem_info()
        self.reserve: Reserve = compute_reserve(self.properties, mem, min_free_bytes=config.min_free_bytes)
        """The reserve rule's parts (Note [The reserve rule])."""
        usable_nbytes(self.properties, mem, reserve=self.reserve)  # raises when the rule leaves nothing
        usable = manager_usable_nbytes(mem, self.reserve, config.gpu_memory_fraction)
        if usable <= 0:
            raise OutOfMemoryError(1, mem.free_nbytes, mem.total_nbytes, device=dev.spec,
                                   hint=f"gpu_memory_fraction={config.gpu_memory_fraction} of the device is "
                                        f"{format_bytes(int(mem.total_nbytes * config.gpu_memory_fraction))}, "
                                        f"less than the {format_bytes(self.reserve.context_nbytes)} already in use: "
                                        "nothing is usable.")
        self.total_memory: int = mem.total_nbytes
        """The device's total bytes."""
        self.usable_memory: int = usable
        """The most this manager hands out (Note [Usable memory and the fraction])."""
        self.reserved_memory: int = mem.total_nbytes - usable
        """``total_memory - usable_memory``: what stays out of reach."""

        if self.enable_pooling:
            self.pool_limit_nbytes = usable + min(max(usable // POOL_SLACK_DENOMINATOR,
                                                      POOL_SLACK_PAGES * self.properties.granularity_nbytes),
                                                  self.reserve.emergency_nbytes)
            bucket_options = ({"max_pooled_per_bucket": config.max_pooled_per_bucket}
                              if is_bucket_policy(config.pool_policy) else {})
            self._base: MemoryResource = make_allocator(dev, config.pool_policy, limit=self.pool_limit_nbytes,
                                                        **bucket_options)
            below: MemoryResource = FailureCallbackLayer(self._base, [self._base.empty_cache])
        else:
            self.pool_limit_nbytes = 0
            self._base = DeviceResource(dev)
            below = self._base
        below = AlignmentLayer(below)  # Note [Alignment is a layer]
        self._limit = LimitingLayer(below, usable, what="the manager's usable memory")
        self._stats = StatisticsLayer(self._limit)
        top: MemoryResource = self._stats
        self._tracking: TrackingLayer | None = None
        if config.track_allocations:
            self.tracker = AllocationTracker(capture_stacks=config.capture_stacks,
                                             report_leaks_at_exit=config.leak_report_at_exit, name=dev.spec)
            self._tracking = top = TrackingLayer(top, self.tracker)
        self._quiet = top
        """The stack without the forensics layer: what a fallback buffer tries first (a fallback is no failure)."""
        if config.oom_forensics_dir is not None:
            from .forensics import ForensicsLayer

            top = ForensicsLayer(top, config.oom_forensics_dir, tracker=self.tracker)
        self.resource = top
        for n in config.preallocate_nbytes:
            if not self.enable_pooling:
                log.info("preallocation of %s ignored: pooling is off", format_bytes(n))
                continue
            if n > usable:
                raise InvalidArgumentError(f"MemoryConfig.preallocate_nbytes: {format_bytes(n)} is more than the "
                                           f"usable memory, {format_bytes(usable)}")
            p = self._base.allocate(n)
            self._base.deallocate(p, n)
        log.info("%s: %s total, %s usable, %s", dev.spec, format_bytes(self.total_memory),
                 format_bytes(self.usable_memory), self.reserve)

    # -- allocation ---------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise DeviceClosedError(f"the GpuMemoryManager of {self.device.spec} is closed")

    def allocate(self, size: int, alignment: int = DEFAULT_ALIGNMENT, *, stream: int = 0, tag: str | None = None,
                 n_elements: int | None = None) -> Allocation:
        """Allocate ``size`` bytes aligned to ``alignment``; ``tag`` and ``n_elements`` go to the tracker.

        Raises :class:`~gpumem.errors.OutOfMemoryError` when it would pass :attr:`usable_memory` or the
        device cannot, :class:`~gpumem.errors.InvalidArgumentError` on bad arguments; either way
        nothing changes.
        """
        return self._allocate(size, alignment, stream, tag, n_elements, self.resource)

    def _allocate(self, size: int, alignment: int, stream: int, tag: str | None, n_elements: int | None,
                  resource: MemoryResource) -> Allocation:
        self._check_open()
        if tag is not None and not isinstance(tag, str):
            raise InvalidArgumentError(f"tag must be None or a str, got {type(tag).__name__}")
        if n_elements is not None and (type(n_elements) is not int or n_elements < 0):
            raise InvalidArgumentError(f"n_elements must be None or an int >= 0, got {n_elements!r}")
        ptr = resource.allocate(size, alignment, stream)
        bid = None
        if self._tracking is not None:
            bid = self._tracking.buffer_id(ptr)
            if tag is not None or n_elements is not None:
                self._tracking.tracker.annotate(bid, tag=tag, n_elements=n_elements)
        a = Allocation(ptr, size, bid, self.device_index, alignment, stream)
        with self._lock:
            self._live[ptr] = a
        return a

    def _allocate_for_fallback(self, size: int, tag: str | None) -> Allocation:
        """:meth:`allocate` without OOM forensics, for a buffer that may fall back to the CPU."""
        return self._allocate(size, DEFAULT_ALIGNMENT, 0, tag, None, self._quiet)

    def deallocate(self, allocation: Allocation) -> None:
        """Give back the :class:`Allocation` object :meth:`allocate` returned (a second time, another
        manager's, or an equal-looking copy raises
        :class:`~gpumem.errors.InvalidPointerError`; nothing changes)."""
        self._check_open()
        if not isinstance(allocation, Allocation):
            raise InvalidArgumentError(f"deallocate takes an Allocation, got {type(allocation).__name__}")
        with self._lock:
            if self._live.get(allocation.ptr) is not allocation:  # the object allocate() returned, not a look-alike
                raise InvalidPointerError(f"{allocation} is not live in this manager ({self.device.spec}): "
                                          "freed already, or from another manager")
            del self._live[allocation.ptr]
        try:
            self.resource.deallocate(allocation.ptr, allocation.nbytes, allocation.alignment, allocation.stream)
        except BaseException:
            with self._lock:
                self._live[allocation.ptr] = allocation
            raise
        self._move_fallbacks_back()

    def live_allocations(self) -> list[Allocation]:
        """Every allocation not given back."""
        with self._lock:
            return list(self._live.values())

    def create_buffer(self, nbytes: int, *, data: Any = None, tag: str | None = None,
                      allow_cpu: bool | None = None) -> FallbackBuffer:
        """A :class:`~gpumem.managers.FallbackBuffer` of ``nbytes`` (on the CPU if the GPU cannot hold it and
        ``allow_cpu``, default ``config.cpu_fallback_enabled``)."""
        return FallbackBuffer(self, nbytes, data=data, tag=tag, allow_cpu=allow_cpu)

    def restore_fallbacks(self) -> int:
        """Try to move every fallback buffer on the CPU back to the GPU; return how many moved."""
        with self._lock:
            bufs = list(self._fallbacks.values())
        return sum(1 for b in bufs if not b.on_gpu and b.try_move_to_gpu())

    def _move_fallbacks_back(self) -> int:
        """Note [Fallbacks move back by themselves]: after memory was freed, move the buffers that fell
        back to the CPU back to the GPU, smallest first, while the usable memory's headroom covers them.
        Never raises; returns how many moved."""
        if not self._fell_back or getattr(self._restoring, "active", False):
            return 0  # the common case costs one check
        self._restoring.active = True
        try:
            with self._lock:
                bufs = sorted((self._fallbacks[i] for i in self._fell_back if i in self._fallbacks),
                              key=lambda b: b.nbytes)
            headroom = self.usable_memory - self.allocated_nbytes
            moved = 0
            for b in bufs:
                if b.nbytes > headroom:
                    break
                if b._move_back_quietly():
                    moved += 1
                    headroom -= b.nbytes
            return moved
        finally:
            self._restoring.active = False

    # bookkeeping called by FallbackBuffer
    def _buffer_created(self, buf: FallbackBuffer) -> None:
        with self._lock:
            self._buffers.add(buf)

    def _fallback_placed(self, buf: FallbackBuffer, *, counted: bool) -> None:
        with self._lock:
            self._fallbacks[id(buf)] = buf
            if counted:  # fell back (not moved by move_to_cpu()): moves back by itself
                self._cpu_fallbacks += 1
                self._fell_back.add(id(buf))
            self._cpu_fallback_nbytes += buf.nbytes

    def _fallback_left(self, buf: FallbackBuffer) -> None:
        with self._lock:
            self._fell_back.discard(id(buf))
            if self._fallbacks.pop(id(buf), None) is not None:
                self._cpu_fallback_nbytes -= buf.nbytes

    def export_snapshot(self, path: str | os.PathLike[str]) -> Path:
        """Write a memory snapshot of the live tracked buffers now, in PyTorch's format (the one OOM
        forensics write: pytorch.org/memory_viz, or :func:`gpumem.trace.read_pytorch_snapshot`), each
        buffer with its region, tag and (with ``capture_stacks``) Python stack as frames; return the path.

        Raises :class:`~gpumem.errors.InvalidArgumentError` when tracking is off
        (``MemoryConfig.track_allocations``): without the tracker there are no regions or stacks to
        export. Nothing changes in the manager either way.
        """
        self._check_open()
        if self.tracker is None:
            raise InvalidArgumentError("export_snapshot needs MemoryConfig.track_allocations=True: the "
                                       "snapshot's regions, tags and stacks come from the tracker")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise InvalidArgumentError(f"path must be a non-empty path, got {path!r}")
        from .forensics import write_snapshot

        return write_snapshot(path, self.tracker, name=f"gpumem-{self.device.spec}")

    # -- cache and device -------------------------------------------------------------------------------
    def empty_cache(self) -> int:
        """Give cached, unused memory back to the device; return the bytes given back (0 without pooling)."""
        self._check_open()
        released = self.resource.empty_cache()
        self._move_fallbacks_back()
        return released

    def memory_info(self) -> MemInfo:
        """The device's total, free and used bytes right now (``.used_nbytes``), other tenants included."""
        self._check_open()
        return self.device.mem_info()

    @property
    def allocated_nbytes(self) -> int:
        """Live bytes handed out (0 once closed: close() gave everything back)."""
        if self._closed:
            return 0
        return self._stats.statistics().current_nbytes

    def reset_peak(self) -> None:
        """Reset the peaks (statistics, and the tracker's overall and per-region peaks)."""
        self._stats.reset_peak()
        if self.tracker is not None:
            self.tracker.reset_peak()

    def get_detailed_stats(self) -> MemoryStats:
        """The manager and its device now (:class:`MemoryStats`)."""
        self._check_open()
        s = self._stats.statistics()
        mem = self.device.mem_info()
        pool = None
        frag, largest, held = 0.0, 0, s.current_nbytes
        if isinstance(self._base, AllocatorContract):
            a = self._base
            ms = a.memory_stats()
            held = int(ms["reserved_nbytes"])
            pool = PoolStats(a.policy.name, held, held - int(ms["allocated_nbytes"]), int(ms["cache_hits"]),
                             int(ms["cache_misses"]), int(ms["num_segments"]))
            frag, largest = float(ms["external_fragmentation"]), int(ms["largest_free_nbytes"])
        with self._lock:
            fallbacks, fb_nbytes = self._cpu_fallbacks, self._cpu_fallback_nbytes
        return MemoryStats(
            device=self.device.spec, device_name=self.properties.name, total_nbytes=self.total_memory,
            reserved_nbytes=self.reserved_memory, usable_nbytes=self.usable_memory,
            allocated_nbytes=s.current_nbytes, peak_allocated_nbytes=s.peak_nbytes, held_nbytes=held,
            free_nbytes=mem.free_nbytes, utilisation=s.current_nbytes / self.usable_memory,
            fragmentation_ratio=frag, largest_free_block_nbytes=largest, n_allocations=s.current_count,
            n_ooms=s.n_failures, cpu_fallbacks=fallbacks, cpu_fallback_nbytes=fb_nbytes, pool=pool,
            regions=self.tracker.stats().regions if self.tracker is not None else ())

    def log_memory_usage(self, level: int = logging.INFO) -> MemoryStats:
        """Log one line of :meth:`get_detailed_stats` (at ``level``), and a warning when the pool's
        fragmentation passes ``config.fragmentation_warning`` (30 %) while its free cached memory is
        at least 1 % of the usable memory (Note [When fragmentation is worth a warning]). Returns the stats.

        The line goes to the ``gpumem.managers.manager`` logger; where logging is not configured (no handler
        anywhere up the logger's tree, so Python would drop an INFO line), it is printed on stderr instead,
        so that a call never shows nothing."""
        st = self.get_detailed_stats()
        args = (st.device, format_bytes(st.allocated_nbytes), format_bytes(st.usable_nbytes), 100 * st.utilisation,
                format_bytes(st.held_nbytes), format_bytes(st.free_nbytes), format_bytes(st.total_nbytes),
                100 * st.fragmentation_ratio, format_bytes(st.largest_free_block_nbytes), st.cpu_fallbacks)
        fmt = ("%s: %s allocated of %s usable (%.1f%%), pool holds %s, device %s free of %s, "
               "fragmentation %.1f%%, largest free block %s, %d CPU fallback(s)")
        if log.hasHandlers():
            log.log(level, fmt, *args)
        else:
            print("gpumem: " + fmt % args, file=sys.stderr)
        cached = st.pool.cached_nbytes if st.pool else 0
        if st.fragmentation_ratio > self.config.fragmentation_warning and \
                cached * FRAGMENTATION_MIN_CACHED_DENOMINATOR >= st.usable_nbytes:
            log.warning("%s: the pool is %.1f%% fragmented (over %.0f%%): its largest free block is %s of %s "
                        "cached; empty_cache() gives the cache back", st.device, 100 * st.fragmentation_ratio,
                        100 * self.config.fragmentation_warning, format_bytes(st.largest_free_block_nbytes),
                        format_bytes(cached))
        return st

    # -- life cycle ---------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Give everything back (live allocations become invalid), stop the exit leak report, and close the
        device if the manager opened it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            bufs = list(self._fallbacks.values()) + [b for b in list(self._buffers) if id(b) not in self._fallbacks]
            self._fallbacks.clear()
            self._buffers.clear()
            self._live.clear()
        for b in bufs:
            b._forget()
        try:
            self.resource.close()
        finally:
            if self.tracker is not None:
                self.tracker.close()
            if self._owns_device:
                self.device.close()

    def __enter__(self) -> "GpuMemoryManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<GpuMemoryManager {self.device.spec} usable {format_bytes(self.usable_memory)} of "
                f"{format_bytes(self.total_memory)}{' (closed)' if self._closed else ''}>")


__all__ = ["GpuMemoryManager", "Allocation", "MemoryStats", "PoolStats"]
