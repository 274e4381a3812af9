"""Adaptor layers: each wraps ANY upstream :class:`~gpumem.managers.resource.MemoryResource` and is one.

As RMM's resource adaptors (``statistics_resource_adaptor``, ``tracking_resource_adaptor``,
``limiting_resource_adaptor``, ``logging_resource_adaptor``, ``failure_callback_resource_adaptor``),
each adds one concern and forwards the rest, so a user stacks what they need::

    base = make_allocator(dev)                          # or DeviceResource(dev): no pool
    mr = StatisticsLayer(LimitingLayer(FailureCallbackLayer(base, [base.empty_cache]), 8 * GiB))
    p = mr.allocate(1 << 20)
    mr.deallocate(p, 1 << 20)
    mr.statistics().peak_nbytes

Every layer validates through the base class before it acts, and a refusal (bad argument, limit,
upstream out of memory) leaves its own counters and the upstream unchanged. Layers forward
``empty_cache``, ``memory_info`` and ``close`` to their upstream (a stack is closed from the top).

Note [Layers count requested bytes]
-----------------------------------
Statistics, tracking and limits count the ``nbytes`` a caller asked for, not what the upstream
rounded it to or padded it with: they describe the program's use. What the pool holds beyond it
(rounding, cached free blocks) is the allocator's ``reserved_nbytes``, which a manager reports
beside them.

Note [No device call under a layer's lock]
------------------------------------------
A layer's ``_lock`` (a plain, non-re-entrant ``threading.Lock``) guards only its own counters and
maps, and no layer holds it across a call upstream, a device call (``memory_info``, ``malloc``...),
a logger or a callback. A device call may deliver queued memory events to their subscribers in the
calling thread, and a subscriber (a ``PressureMonitor`` whose callback allocates through this very
stack) would then wait for the lock its own thread holds: the ``LimitingLayer`` built its refusal's
figures with ``memory_info()`` under its lock, and deadlocked so. Each layer therefore reads and
changes its state under the lock, releases it, and only then calls out.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import threading
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable

from gpumem.device import Device, MemInfo
from gpumem.errors import InternalError, InvalidArgumentError, InvalidPointerError, OutOfMemoryError
from gpumem.trace.rmm import RMM_HEADER
from gpumem.units import format_bytes

from gpumem.allocator.resource import DEFAULT_ALIGNMENT, AlignmentLayer, MemoryResource, ResourceLayer

from .tracker import AllocationTracker, BufferId, Location

log = logging.getLogger(__name__)


# -- statistics ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResourceStatistics:
    """Counters of a :class:`StatisticsLayer` (requested bytes: Note [Layers count requested bytes])."""

    current_nbytes: int
    peak_nbytes: int
    total_nbytes: int
    """Bytes ever allocated."""
    current_count: int
    peak_count: int
    total_count: int
    n_deallocations: int
    n_failures: int
    """Allocations the upstream refused (out of memory)."""


@dataclass
class Counter:
    """One statistic as RMM's ``statistics_resource_adaptor`` keeps it: ``value`` now, its ``peak``
    and the ``total`` ever added. Not thread-safe alone: its owner guards it."""

    value: int = 0
    peak: int = 0
    total: int = 0

    def add(self, n: int) -> None:
        """``value += n`` (n >= 0), raising ``peak`` and ``total``."""
        self.value += n
        self.total += n
        if self.value > self.peak:
            self.peak = self.value

    def sub(self, n: int) -> None:
        """``value -= n``; a value below 0 is an :class:`~gpumem.errors.InternalError` (nothing changes)."""
        if n > self.value:
            raise InternalError(f"counter would go below 0: {self.value} - {n}")
        self.value -= n

    def reset_peak(self) -> None:
        """``peak := value``."""
        self.peak = self.value


class StatisticsLayer(ResourceLayer):
    """Counts bytes and allocations (current, peak, total), and refusals; peaks are resettable.

    As RMM's ``statistics_resource_adaptor``: the upstream is called first, then two :class:`Counter`
    s change under a short lock; no per-pointer map, since ``deallocate`` is given ``nbytes``
    (the contract: the same ``nbytes`` as ``allocate``, which the base resource checks).
    """

    def __init__(self, upstream: MemoryResource) -> None:
        super().__init__(upstream)
        self._lock = threading.Lock()
        # guarded by _lock:
        self._bytes = Counter()
        self._count = Counter()
        self._n_free = self._n_fail = 0

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        try:
            ptr = self.upstream.do_allocate(nbytes, alignment, stream)
        except OutOfMemoryError:
            with self._lock:
                self._n_fail += 1
            raise
        with self._lock:
            self._bytes.add(nbytes)
            self._count.add(1)
        return ptr

    def do_deallocate(self, ptr: int, nbytes: int, alignment: int, stream: int) -> None:
        self.upstream.do_deallocate(ptr, nbytes, alignment, stream)
        with self._lock:
            self._bytes.sub(nbytes)
            self._count.sub(1)
            self._n_free += 1

    def statistics(self) -> ResourceStatistics:
        """The counters now."""
        with self._lock:
            b, c = self._bytes, self._count
            return ResourceStatistics(b.value, b.peak, b.total, c.value, c.peak, c.total, self._n_free, self._n_fail)

    def reset_peak(self) -> None:
        """Peaks := current values."""
        with self._lock:
            self._bytes.reset_peak()
            self._count.reset_peak()


# -- tracking --------------------------------------------------------------------------------------------
class TrackingLayer(ResourceLayer):
    """Registers every allocation in an :class:`~gpumem.managers.tracker.AllocationTracker` (region, stack...).

    ``buffer_id(ptr)`` finds the id of a live pointer (to annotate it, e.g. with a tag).
    """

    def __init__(self, upstream: MemoryResource, tracker: AllocationTracker | None = None, *,
                 capture_stacks: bool = False) -> None:
        super().__init__(upstream)
        if tracker is not None and not isinstance(tracker, AllocationTracker):
            raise InvalidArgumentError(f"tracker must be an AllocationTracker, got {type(tracker).__name__}")
        self.tracker = tracker if tracker is not None else AllocationTracker(capture_stacks=capture_stacks)
        self._lock = threading.Lock()
        self._ids: dict[int, BufferId] = {}  # guarded by _lock

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        ptr = self.upstream.do_allocate(nbytes, alignment, stream)
        try:
            bid = self.tracker.register(nbytes, location=Location.GPU, ptr=ptr, device=self.device.spec)
        except BaseException:
            self.upstream.do_deallocate(ptr, nbytes, alignment, stream)
            raise
        with self._lock:
            self._ids[ptr] = bid
        return ptr

    def do_deallocate(self, ptr: int, nbytes: int, alignment: int, stream: int) -> None:
        # the entry goes before the memory does: once upstream has it back, another thread may be handed the same
        # pointer and record it here, and removing the entry after would remove that thread's
        with self._lock:
            bid = self._ids.pop(ptr, None)
        if bid is None:
            raise InvalidPointerError(f"deallocate: {ptr:#x} is not tracked by {self!r}")
        try:
            self.upstream.do_deallocate(ptr, nbytes, alignment, stream)
        except BaseException:
            with self._lock:   # not freed: still tracked
                self._ids[ptr] = bid
            raise
        self.tracker.unregister(bid)

    def buffer_id(self, ptr: int) -> BufferId:
        """The tracker's id of a live pointer allocated through this layer."""
        with self._lock:
            bid = self._ids.get(ptr)
        if bid is None:
            raise InvalidPointerError(f"{ptr!r} is not a live pointer of {self!r}")
        return bid


# -- limiting -----------------------------------------------------------------------------------------------
class LimitingLayer(ResourceLayer):
    """Refuses an allocation that would take the bytes allocated through it past ``limit_nbytes``.

    The refusal is an :class:`~gpumem.errors.OutOfMemoryError` raised before the upstream is asked:
    nothing changes.
    """

    def __init__(self, upstream: MemoryResource, limit_nbytes: int, *, what: str = "the limit") -> None:
        super().__init__(upstream)
        if type(limit_nbytes) is not int or limit_nbytes <= 0:
            raise InvalidArgumentError(f"limit_nbytes must be an int > 0, got {limit_nbytes!r}")
        self.limit_nbytes = limit_nbytes
        self.what = what
        """How the refusal names the limit (a manager says "the usable memory")."""
        self._lock = threading.Lock()
        self._used = 0  # guarded by _lock; no per-pointer map: deallocate is given nbytes

    @property
    def used_nbytes(self) -> int:
        """Bytes allocated through this layer and not given back."""
        return self._used

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        with self._lock:
            used = self._used
            refused = used + nbytes > self.limit_nbytes
            if not refused:
                self._used += nbytes  # claimed before the upstream call, so concurrent callers cannot both pass
        if refused:
            # Note [No device call under a layer's lock]: memory_info() may deliver queued memory
            # events to subscribers (a PressureMonitor whose callback allocates through this very
            # layer), so the refusal is built after the lock is released.
            mem = self.memory_info()
            raise OutOfMemoryError(
                nbytes, mem.free_nbytes, mem.total_nbytes, device=self.device.spec,
                allocated_nbytes=used, limit_nbytes=self.limit_nbytes,
                hint=f"Refused by {self.what} ({format_bytes(self.limit_nbytes)}): "
                     f"{format_bytes(self.limit_nbytes - used)} of it is left.")
        try:
            ptr = self.upstream.do_allocate(nbytes, alignment, stream)
        except BaseException:
            with self._lock:
                self._used -= nbytes
            raise
        return ptr

    def do_deallocate(self, ptr: int, nbytes: int, alignment: int, stream: int) -> None:
        self.upstream.do_deallocate(ptr, nbytes, alignment, stream)
        with self._lock:
            self._used -= nbytes


# -- logging ------------------------------------------------------------------------------------------------
class LoggingLayer(ResourceLayer):
    """Logs every allocation, deallocation and refusal through ``logging`` (``logger``, at ``level``),
    and optionally as an RMM ``logging_resource_adaptor`` CSV log.

    Messages: ``allocate <nbytes> align=<a> stream=<s> -> <ptr>``, ``deallocate <ptr> <nbytes>``,
    ``allocate <nbytes> failed: <error>`` (at least INFO). ``csv_path``: also write RMM's format
    (``Thread,Time,Action,Pointer,Size,Stream``; actions ``allocate``, ``free``, ``allocate failure``),
    which ``gpumem replay`` and :func:`gpumem.trace.load_trace` read; the file is closed by :meth:`close`.
    """

    def __init__(self, upstream: MemoryResource, *, logger: logging.Logger | None = None,
                 level: int = logging.DEBUG, csv_path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(upstream)
        if logger is not None and not isinstance(logger, logging.Logger):
            raise InvalidArgumentError(f"logger must be a logging.Logger, got {type(logger).__name__}")
        if type(level) is not int:
            raise InvalidArgumentError(f"level must be a logging level (int), got {level!r}")
        if csv_path is not None and not isinstance(csv_path, (str, os.PathLike)):
            raise InvalidArgumentError(f"csv_path must be None or a path, got {type(csv_path).__name__}")
        self.logger = logger or log
        self.level = level
        self._lock = threading.Lock()
        self._csv: IO[str] | None = None  # guarded by _lock
        if csv_path is not None:
            self._csv = open(csv_path, "w", encoding="ascii", newline="")
            self._csv.write(",".join(RMM_HEADER) + "\n")

    def _row(self, action: str, ptr: int, nbytes: int, stream: int) -> None:
        if self._csv is None:
            return
        now = datetime.datetime.now().strftime("%H:%M:%S.%f")
        with self._lock:
            if self._csv is not None:
                self._csv.write(f"{threading.get_native_id()},{now},{action},{ptr:#x},{nbytes},{stream}\n")

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        try:
            ptr = self.upstream.do_allocate(nbytes, alignment, stream)
        except Exception as exc:
            self.logger.log(max(self.level, logging.INFO), "%s: allocate %d align=%d stream=%d failed: %s",
                            self.device.spec, nbytes, alignment, stream, exc)
            if isinstance(exc, OutOfMemoryError):
                self._row("allocate failure", 0, nbytes, stream)
            raise
        self.logger.log(self.level, "%s: allocate %d align=%d stream=%d -> %#x", self.device.spec, nbytes, alignment,
                        stream, ptr)
        self._row("allocate", ptr, nbytes, stream)
        return ptr

    def do_deallocate(self, ptr: int, nbytes: int, alignment: int, stream: int) -> None:
        self.upstream.do_deallocate(ptr, nbytes, alignment, stream)
        self.logger.log(self.level, "%s: deallocate %#x %d stream=%d", self.device.spec, ptr, nbytes, stream)
        self._row("free", ptr, nbytes, stream)

    def flush(self) -> None:
        """Flush the CSV log to disk."""
        with self._lock:
            if self._csv is not None:
                self._csv.flush()

    def close(self) -> None:
        with self._lock:
            csv, self._csv = self._csv, None
        if csv is not None:
            csv.close()
        super().close()


# -- failure callbacks ----------------------------------------------------------------------------------------
#: A failure callback: called with the requested bytes and the error; its return value is ignored.
FailureCallback = Callable[[int, OutOfMemoryError], Any]


class FailureCallbackLayer(ResourceLayer):
    """On an out-of-memory error from upstream, calls each callback (e.g. ``empty_cache``), then retries.

    Callbacks are called as ``cb(nbytes, error)``; a callable taking no argument
    (``resource.empty_cache``) is called without them. ``max_retries`` (1) bounds the retries per
    allocation; when the last one fails too, that error propagates. A callback that raises is
    logged and the others still run. :attr:`n_failures` and :attr:`n_recovered` count the
    allocations that failed first and those a retry saved.
    """

    def __init__(self, upstream: MemoryResource, callbacks: Iterable[Callable[..., Any]] = (), *,
                 max_retries: int = 1) -> None:
        super().__init__(upstream)
        cbs = list(callbacks)
        for cb in cbs:
            if not callable(cb):
                raise InvalidArgumentError(f"callbacks must be callable, got {type(cb).__name__}")
        if type(max_retries) is not int or max_retries < 0:
            raise InvalidArgumentError(f"max_retries must be an int >= 0, got {max_retries!r}")
        self.callbacks = cbs
        self.max_retries = max_retries
        self._lock = threading.Lock()
        self.n_failures = 0  # guarded by _lock
        self.n_recovered = 0  # guarded by _lock

    def add_callback(self, callback: Callable[..., Any]) -> None:
        """Add a callback (called after those already there)."""
        if not callable(callback):
            raise InvalidArgumentError(f"callback must be callable, got {type(callback).__name__}")
        self.callbacks.append(callback)

    def _call(self, cb: Callable[..., Any], nbytes: int, exc: OutOfMemoryError) -> None:
        try:
            try:
                n_params = len(inspect.signature(cb).parameters)
            except (TypeError, ValueError):
                n_params = 2
            cb(nbytes, exc) if n_params >= 2 else cb()
        except Exception as cb_exc:  # noqa: BLE001 - Note in the class docstring: the others still run
            log.warning("failure callback %r raised %s: %s", cb, type(cb_exc).__name__, cb_exc)

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        try:
            return self.upstream.do_allocate(nbytes, alignment, stream)
        except OutOfMemoryError as exc:
            with self._lock:
                self.n_failures += 1
            last = exc
        for attempt in range(self.max_retries):
            for cb in list(self.callbacks):
                self._call(cb, nbytes, last)
            try:
                ptr = self.upstream.do_allocate(nbytes, alignment, stream)
            except OutOfMemoryError as exc:
                last = exc
                continue
            with self._lock:
                self.n_recovered += 1
            log.info("%s: allocation of %s succeeded on retry %d after the failure callbacks", self.device.spec,
                     format_bytes(nbytes), attempt + 1)
            return ptr
        raise last


__all__ = ["ResourceLayer", "AlignmentLayer", "Counter", "StatisticsLayer", "ResourceStatistics", "TrackingLayer", "LimitingLayer",
           "LoggingLayer", "FailureCallbackLayer", "FailureCallback", "DEFAULT_ALIGNMENT"]
