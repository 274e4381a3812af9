"""Allocation tracking: who holds which buffer, since when, where it was made, and what leaked.

:class:`AllocationTracker` keeps one :class:`AllocationInfo` per live buffer (size, elements, GPU
or CPU, time, tag, region, optionally the Python stack that made it), totals and peaks (overall,
per location and per region, each resettable), and answers "what is old enough to be a leak?"
(:meth:`AllocationTracker.find_old_allocations`). With ``report_leaks_at_exit=True`` it logs a
leak report when the interpreter exits, unless it was closed first.

Note [Region totals count their sub-regions]
--------------------------------------------
A buffer made in ``"step/forward"`` counts towards ``"step/forward"`` and ``"step"``: a region's
live bytes and peak are what was made inside it, nested regions included, which is what "how much
does the forward pass hold" means. Peaks per region are reset with ``reset_peak(region="step")``
(that region only) or ``reset_peak()`` (the overall peak and every region's).
"""

from __future__ import annotations

import atexit
import functools
import enum
import itertools
import logging
import sys
import threading
import time
import os
from dataclasses import dataclass, replace
from typing import Callable, NewType

from gpumem.errors import InvalidArgumentError
from gpumem.units import format_bytes

from .regions import current_region, region_ancestors

log = logging.getLogger(__name__)

#: A tracked buffer's identity: unique within its tracker, never reused.
BufferId = NewType("BufferId", int)


class Location(str, enum.Enum):
    """Where a buffer's bytes are."""

    GPU = "gpu"
    CPU = "cpu"


class UnknownBufferError(InvalidArgumentError):
    """A :data:`BufferId` the tracker does not hold (never registered, or already unregistered)."""


@dataclass(frozen=True)
class StackFrame:
    """One frame of the Python stack that made a buffer (PyTorch's snapshot frame fields)."""

    filename: str
    line: int
    name: str


@dataclass(frozen=True)
class AllocationInfo:
    """What the tracker knows about one live buffer."""

    buffer_id: BufferId
    nbytes: int
    location: Location
    created_s: float
    """When it was registered, on the tracker's clock (``time.monotonic`` by default)."""
    wall_time_s: float
    """When it was registered, ``time.time()``."""
    n_elements: int | None = None
    tag: str | None = None
    region: str | None = None
    ptr: int | None = None
    """The device pointer while on the GPU (None on the CPU, or when the caller gave none)."""
    device: str = ""
    stack: tuple[StackFrame, ...] | None = None
    """Innermost frame last; None unless stacks are captured."""

    def site(self) -> str:
        """Where it was made: the innermost captured frame outside the gpumem package, ``"?"`` when every
        captured frame is gpumem's, or :data:`NO_STACK_SITE` without a stack.

        gpumem's frames are told apart by the package's own directory, not by a ``gpumem`` in the path:
        a user's program in a folder named ``gpumem`` (what ``git clone`` of this project makes) keeps
        its sites."""
        if self.stack is None:
            return NO_STACK_SITE
        for f in reversed(self.stack):
            if not _in_package(f.filename):
                return f"{f.filename}:{f.line} in {f.name}"
        return "?"


@dataclass(frozen=True)
class RegionStats:
    """A region's figures, its sub-regions included (Note [Region totals count their sub-regions])."""

    region: str
    live_nbytes: int
    live_count: int
    peak_nbytes: int
    total_allocs: int


@dataclass(frozen=True)
class TrackerStats:
    """The tracker's totals at one moment."""

    live_nbytes: int
    live_count: int
    peak_nbytes: int
    gpu_nbytes: int
    cpu_nbytes: int
    total_allocs: int
    total_frees: int
    regions: tuple[RegionStats, ...] = ()


@dataclass(frozen=True)
class LeakReport:
    """Buffers still live (at least ``min_age_s`` old), with totals by region and tag."""

    entries: tuple[AllocationInfo, ...]
    total_nbytes: int
    by_region: tuple[tuple[str, int, int], ...]
    """``(region or "(none)", bytes, count)``, largest first."""
    by_tag: tuple[tuple[str, int, int], ...]
    min_age_s: float = 0.0

    @property
    def empty(self) -> bool:
        """Whether nothing leaked."""
        return not self.entries

    def format(self, *, limit: int = 20) -> str:
        """A readable report: totals, then by region, by tag and the largest buffers."""
        if not self.entries:
            return "no live buffers"
        lines = [f"{len(self.entries)} live buffer(s), {format_bytes(self.total_nbytes)}"
                 + (f" (older than {self.min_age_s:g} s)" if self.min_age_s else "")]
        lines.append("by region:")
        lines += [f"  {name:<30} {format_bytes(n):>12} in {c} buffer(s)" for name, n, c in self.by_region[:limit]]
        lines.append("by tag:")
        lines += [f"  {name:<30} {format_bytes(n):>12} in {c} buffer(s)" for name, n, c in self.by_tag[:limit]]
        lines.append("largest:")
        for e in sorted(self.entries, key=lambda e: -e.nbytes)[:limit]:
            lines.append(f"  #{e.buffer_id} {format_bytes(e.nbytes):>12} {e.location.value} region={e.region} "
                         f"tag={e.tag} made at {e.site()}")
        return "\n".join(lines)


def _group(entries: list[AllocationInfo], key: Callable[[AllocationInfo], str | None]) -> tuple[tuple[str, int, int], ...]:
    acc: dict[str, list[int]] = {}
    for e in entries:
        k = key(e) or "(none)"
        slot = acc.setdefault(k, [0, 0])
        slot[0] += e.nbytes
        slot[1] += 1
    return tuple(sorted(((k, n, c) for k, (n, c) in acc.items()), key=lambda x: (-x[1], x[0])))


@dataclass
class _RegionCounters:
    live_nbytes: int = 0
    live_count: int = 0
    peak_nbytes: int = 0
    total_allocs: int = 0


#: Note [Stacks start at the user's code]: the directory of gpumem's manager modules (the layers,
#: forensics, resources, the manager, the tracker, fallback buffers). Their frames are the same
#: plumbing under every allocation: recorded, they filled most of ``stack_depth`` and pushed the
#: caller's frames out, and a snapshot viewer showed gpumem first. They are left out, and
#: ``stack_depth`` counts the frames that remain.
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
#: The resource contract's module (the public ``allocate`` of every layer), on the allocator floor.
_CONTRACT_FILE = os.path.join(os.path.dirname(_OWN_DIR), "allocator", "resource.py")

#: The gpumem package's directory, resolved: frames of files under it are gpumem's own.
_PACKAGE_DIR = os.path.realpath(os.path.dirname(_OWN_DIR))

#: What :meth:`AllocationInfo.site` says of a buffer registered without its stack.
NO_STACK_SITE = "? (stacks not captured: set capture_stacks=True or GPUMEM_CAPTURE_STACKS=1)"


@functools.lru_cache(maxsize=4096)
def _in_package(filename: str) -> bool:
    """Whether ``filename`` is a file of the gpumem package (by its resolved directory)."""
    return os.path.realpath(filename).startswith(_PACKAGE_DIR + os.sep)


@functools.lru_cache(maxsize=4096)
def _is_own_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    return os.path.dirname(path) == _OWN_DIR or path == _CONTRACT_FILE


def _capture_stack(depth: int) -> tuple[StackFrame, ...]:
    """The ``depth`` innermost frames of the caller outside gpumem's manager modules, innermost last
    (Note [Stacks start at the user's code])."""
    out: list[StackFrame] = []
    frame = sys._getframe(1)
    while frame is not None and len(out) < depth:
        code = frame.f_code
        if not _is_own_frame(code.co_filename):
            out.append(StackFrame(code.co_filename, frame.f_lineno or 0, code.co_name))
        frame = frame.f_back
    out.reverse()
    return tuple(out)


class AllocationTracker:
    """A thread-safe record of live buffers (module docstring).

    ``capture_stacks``: keep the Python stack (``stack_depth`` innermost frames) of each
    registration; costs a few microseconds per buffer. ``clock``: the time source for ages
    (``time.monotonic``; tests pass a fake). ``report_leaks_at_exit``: log a leak report (warning)
    at interpreter exit if buffers are still live; :meth:`close` cancels it.
    """

    def __init__(self, *, capture_stacks: bool = False, stack_depth: int = 16,
                 clock: Callable[[], float] = time.monotonic, report_leaks_at_exit: bool = False,
                 name: str = "") -> None:
        if type(stack_depth) is not int or stack_depth <= 0:
            raise InvalidArgumentError(f"stack_depth must be a positive int, got {stack_depth!r}")
        if not callable(clock):
            raise InvalidArgumentError("clock must be callable")
        self.capture_stacks = bool(capture_stacks)
        self.stack_depth = stack_depth
        self.name = name
        self._clock = clock
        # Note: ``_lock`` guards every field below.
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._live: dict[BufferId, AllocationInfo] = {}
        self._live_nbytes = 0
        self._by_location = {Location.GPU: 0, Location.CPU: 0}
        self._peak_nbytes = 0
        self._total_allocs = 0
        self._total_frees = 0
        self._regions: dict[str, _RegionCounters] = {}
        self._atexit: Callable[[], None] | None = None
        self._closed = False
        if report_leaks_at_exit:
            self.report_leaks_at_exit(True)

    # -- registering ----------------------------------------------------------------------------
    def register(self, nbytes: int, *, location: Location = Location.GPU, n_elements: int | None = None,
                 tag: str | None = None, ptr: int | None = None, device: str = "",
                 region: str | None = None) -> BufferId:
        """Record a new live buffer; return its id. ``region`` defaults to :func:`current_region`."""
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be an int >= 0, got {nbytes!r}")
        if not isinstance(location, Location):
            raise InvalidArgumentError(f"location must be a Location, got {location!r}")
        if n_elements is not None and (type(n_elements) is not int or n_elements < 0):
            raise InvalidArgumentError(f"n_elements must be None or an int >= 0, got {n_elements!r}")
        if tag is not None and not isinstance(tag, str):
            raise InvalidArgumentError(f"tag must be None or a str, got {type(tag).__name__}")
        if ptr is not None and (type(ptr) is not int or ptr <= 0):
            raise InvalidArgumentError(f"ptr must be None or a positive int, got {ptr!r}")
        if region is None:
            region = current_region()
        stack = _capture_stack(self.stack_depth) if self.capture_stacks else None
        now, wall = self._clock(), time.time()
        with self._lock:
            buffer_id = BufferId(next(self._ids))
            info = AllocationInfo(buffer_id, nbytes, location, now, wall, n_elements, tag, region, ptr, device, stack)
            self._live[buffer_id] = info
            self._live_nbytes += nbytes
            self._by_location[location] += nbytes
            self._total_allocs += 1
            if self._live_nbytes > self._peak_nbytes:
                self._peak_nbytes = self._live_nbytes
            for r in region_ancestors(region):
                c = self._regions.get(r)
                if c is None:
                    c = self._regions[r] = _RegionCounters()
                c.live_nbytes += nbytes
                c.live_count += 1
                c.total_allocs += 1
                if c.live_nbytes > c.peak_nbytes:
                    c.peak_nbytes = c.live_nbytes
        return buffer_id

    def unregister(self, buffer_id: BufferId) -> AllocationInfo:
        """Forget a buffer (it was freed); return what was known. Unknown ids raise :class:`UnknownBufferError`."""
        with self._lock:
            info = self._live.pop(buffer_id, None)
            if info is None:
                raise UnknownBufferError(f"buffer {buffer_id!r} is not live in this tracker "
                                         "(never registered, or already unregistered)")
            self._live_nbytes -= info.nbytes
            self._by_location[info.location] -= info.nbytes
            self._total_frees += 1
            for r in region_ancestors(info.region):
                c = self._regions[r]
                c.live_nbytes -= info.nbytes
                c.live_count -= 1
            return info

    def relocate(self, buffer_id: BufferId, location: Location, ptr: int | None = None) -> AllocationInfo:
        """Record that a buffer moved (GPU <-> CPU); same id, same age."""
        if not isinstance(location, Location):
            raise InvalidArgumentError(f"location must be a Location, got {location!r}")
        if ptr is not None and (type(ptr) is not int or ptr <= 0):
            raise InvalidArgumentError(f"ptr must be None or a positive int, got {ptr!r}")
        with self._lock:
            info = self._get(buffer_id)
            new = replace(info, location=location, ptr=ptr)
            self._by_location[info.location] -= info.nbytes
            self._by_location[location] += info.nbytes
            self._live[buffer_id] = new
            return new

    def annotate(self, buffer_id: BufferId, *, tag: str | None = None, n_elements: int | None = None) -> AllocationInfo:
        """Set a live buffer's tag and/or element count (those given)."""
        if tag is not None and not isinstance(tag, str):
            raise InvalidArgumentError(f"tag must be None or a str, got {type(tag).__name__}")
        if n_elements is not None and (type(n_elements) is not int or n_elements < 0):
            raise InvalidArgumentError(f"n_elements must be None or an int >= 0, got {n_elements!r}")
        with self._lock:
            info = self._get(buffer_id)
            new = replace(info, tag=tag if tag is not None else info.tag,
                          n_elements=n_elements if n_elements is not None else info.n_elements)
            self._live[buffer_id] = new
            return new

    def _get(self, buffer_id: BufferId) -> AllocationInfo:
        info = self._live.get(buffer_id)
        if info is None:
            raise UnknownBufferError(f"buffer {buffer_id!r} is not live in this tracker")
        return info

    # -- reading --------------------------------------------------------------------------------------
    def get(self, buffer_id: BufferId) -> AllocationInfo:
        """What is known about a live buffer."""
        with self._lock:
            return self._get(buffer_id)

    def __contains__(self, buffer_id: object) -> bool:
        with self._lock:
            return buffer_id in self._live

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def live(self) -> list[AllocationInfo]:
        """Every live buffer, oldest first."""
        with self._lock:
            return list(self._live.values())

    @property
    def live_nbytes(self) -> int:
        """Bytes in live buffers (GPU and CPU)."""
        return self._live_nbytes

    @property
    def peak_nbytes(self) -> int:
        """The most :attr:`live_nbytes` has been since the tracker started or the last :meth:`reset_peak`."""
        return self._peak_nbytes

    def nbytes_at(self, location: Location) -> int:
        """Live bytes on the GPU or on the CPU."""
        with self._lock:
            return self._by_location[location]

    def region_stats(self, region: str) -> RegionStats:
        """A region's live bytes, count, peak and allocations (sub-regions included); zeros if never seen."""
        if not isinstance(region, str) or not region:
            raise InvalidArgumentError(f"region must be a non-empty str, got {region!r}")
        with self._lock:
            c = self._regions.get(region, _RegionCounters())
            return RegionStats(region, c.live_nbytes, c.live_count, c.peak_nbytes, c.total_allocs)

    def stats(self) -> TrackerStats:
        """All the totals, with every region seen."""
        with self._lock:
            regions = tuple(RegionStats(r, c.live_nbytes, c.live_count, c.peak_nbytes, c.total_allocs)
                            for r, c in sorted(self._regions.items()))
            return TrackerStats(self._live_nbytes, len(self._live), self._peak_nbytes,
                                self._by_location[Location.GPU], self._by_location[Location.CPU],
                                self._total_allocs, self._total_frees, regions)

    def reset_peak(self, *, region: str | None = None) -> None:
        """Set a peak to the current live bytes: the overall one and every region's, or one region's."""
        if region is not None and (not isinstance(region, str) or not region):
            raise InvalidArgumentError(f"region must be None or a non-empty str, got {region!r}")
        with self._lock:
            if region is None:
                self._peak_nbytes = self._live_nbytes
                for c in self._regions.values():
                    c.peak_nbytes = c.live_nbytes
            else:
                c = self._regions.get(region)
                if c is not None:
                    c.peak_nbytes = c.live_nbytes

    def find_old_allocations(self, age_s: float) -> list[AllocationInfo]:
        """Live buffers registered at least ``age_s`` seconds ago (leak candidates), oldest first."""
        if isinstance(age_s, bool) or not isinstance(age_s, (int, float)) or not age_s >= 0 or age_s == float("inf"):
            raise InvalidArgumentError(f"age_s must be a finite number >= 0, got {age_s!r}")
        now = self._clock()
        with self._lock:
            return [i for i in self._live.values() if now - i.created_s >= age_s]

    def leak_report(self, *, min_age_s: float = 0.0) -> LeakReport:
        """The live buffers at least ``min_age_s`` old, grouped by region and tag."""
        entries = self.find_old_allocations(min_age_s)
        return LeakReport(tuple(entries), sum(e.nbytes for e in entries), _group(entries, lambda e: e.region),
                          _group(entries, lambda e: e.tag), float(min_age_s))

    # -- exit report and life cycle -------------------------------------------------------------
    def report_leaks_at_exit(self, enabled: bool = True) -> None:
        """Log (warning, logger ``gpumem.managers.tracker``) a leak report at interpreter exit, or stop doing so."""
        with self._lock:
            if enabled and self._atexit is None and not self._closed:
                self._atexit = self._exit_report
                atexit.register(self._atexit)
            elif not enabled and self._atexit is not None:
                atexit.unregister(self._atexit)
                self._atexit = None

    @property
    def reports_at_exit(self) -> bool:
        """Whether a leak report is registered for interpreter exit."""
        return self._atexit is not None

    def _exit_report(self) -> None:
        report = self.leak_report()
        if not report.empty:
            log.warning("gpumem leak report%s at exit:\n%s", f" ({self.name})" if self.name else "", report.format())
            if not log.isEnabledFor(logging.WARNING):  # pragma: no cover - logging switched off
                print(report.format(), file=sys.stderr)

    def close(self) -> None:
        """Cancel the exit report. The records stay readable. Idempotent."""
        self.report_leaks_at_exit(False)
        self._closed = True

    def __enter__(self) -> "AllocationTracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["AllocationTracker", "AllocationInfo", "BufferId", "Location", "StackFrame", "RegionStats",
           "TrackerStats", "LeakReport", "UnknownBufferError"]
