"""Memory pressure: how full a device is, and a monitor that gives cached memory back before it fills.

:class:`MemoryPressure` turns a used fraction into a level (LOW < 60 %, MEDIUM 60-80 %, HIGH 80-95 %,
CRITICAL > 95 %). :class:`PressureMonitor` samples a device, tracks its level, calls registered
callbacks when the level changes and, at HIGH or CRITICAL, calls ``empty_cache()`` on the registered
*releasers* (a :class:`~gpumem.allocator.CachingAllocator`, a ``GpuMemoryManager``, anything with
``empty_cache() -> int``), so that memory this process caches but does not use goes back to the device
before an allocation, here or in another process, fails.

Where the figures come from (Note [What a sample measures])
-----------------------------------------------------------
A sample is the *whole device's* used fraction, not this process's: pressure is what everyone does.

* On a real GPU (``cuda:N``) the monitor asks NVML (``nvmlDeviceGetMemoryInfo`` through
  :meth:`gpumem.cuda.CudaDevice.nvml_memory_info`): it needs no CUDA call, does not synchronise
  anything, and counts every process on the GPU and the driver's own reservations. Where NVML is not
  installed it falls back to ``device.mem_info()`` (``cudaMemGetInfo``, device-wide as well) and logs
  that once.
* On a simulated GPU it uses ``device.mem_info()``, which counts the CUDA context, this process's
  pages and every simulated tenant (:mod:`gpumem.sim.pressure`).

Simulated time (Note [Polling a simulated device])
--------------------------------------------------
A :class:`~gpumem.sim.SimDevice`'s clock moves only when the device is called (each call costs its
simulated latency) or :meth:`~gpumem.sim.SimDevice.advance` is called; wall-clock time means nothing
to it. The background thread therefore samples the device as it is whenever it wakes up; what a
tenant did in simulated time is seen at the next poll after the call that moved the clock. Three ways
to make this deterministic:

* tests call :meth:`PressureMonitor.poll_once` directly, between ``device.advance(...)`` steps
  (no thread at all);
* ``react_to_events=True`` (the default) subscribes to the device's memory events: on the simulator
  every tenant take, return or refusal re-evaluates the level at once from the event's free bytes, in
  the thread whose device call moved the clock, after that call returned (events are delivered outside
  the device's and the allocator's locks: Note [Event delivery after the call] in
  :mod:`gpumem.device`). Memory is then given back *before the next allocation* of that thread runs.
  Events are delivered when the device call that moved the clock returns, so within one long call
  (``advance(0.3)``) tenants act without the monitor seeing them; a program that makes device calls
  or advances in steps (as one computing between allocations does) gets a reaction per step;
* ``sim_advance_s``: each poll of the thread first lets that much simulated time pass, so the monitor
  itself drives the tenants (demos and soaks).

Real devices publish no memory events; there the thread's poll is what sees other processes.

Hysteresis (Note [Pressure hysteresis])
---------------------------------------
A level rises as soon as the used fraction reaches its threshold, but falls only once the fraction is
``hysteresis`` (default 0.02, 2 % of the device) below the threshold it crossed: a device hovering at
80 % does not flap between MEDIUM and HIGH, calling callbacks and emptying caches at every poll.
``hysteresis=0`` gives the plain :meth:`MemoryPressure.from_used_fraction` levels.

Releasing (Note [When cache is given back])
-------------------------------------------
Releasers are called at *every* evaluation at HIGH or CRITICAL, not only when the level first rises:
an allocator may cache memory again after the first release while the device stays full, and
``empty_cache()`` with nothing cached makes no device memory call. Releasers run before the
callbacks of the same evaluation, so a callback's own look at the device sees it after the release.
When they gave anything back, the monitor samples once more at once: the level follows the release
(a HIGH that the release resolved is followed by a change back down, in that order).

Locks (Note [Callbacks outside every lock])
-------------------------------------------
``PressureMonitor._lock`` guards the level, the statistics and the registration lists; it is held
only to read or update them. Releasers and callbacks are called with no lock of the monitor's state
held and, on the simulator, from event delivery that runs after the device and allocator locks were
released. A callback or releaser that raises is logged and counted (``stats().callback_errors`` /
``release_errors``); it never stops the monitor.

One evaluation at a time (Note [One evaluation at a time])
----------------------------------------------------------
Three threads may evaluate: the poll thread, a thread whose device call delivered a memory event, and
a caller of :meth:`PressureMonitor.poll_once` / :meth:`~PressureMonitor.observe`. When each changed the
level under ``_lock`` and then released and called back with nothing held, the poll thread could sample
*in the middle of* another thread's release and deliver its own, later change first: callbacks heard
"LOW -> CRITICAL" after "CRITICAL -> LOW", and the last change delivered disagreed with ``level``.
So a whole evaluation (sample, level update, release, re-sample, delivery) holds
``_eval_lock``, a re-entrant lock that is never held with ``_lock`` waited for and that no allocator
ever takes: another thread that wants to evaluate waits until a release in progress and its callbacks
are done, and then samples the device as the release left it. The poll thread waits in short steps,
so :meth:`~PressureMonitor.stop` still ends it. Changes are queued in sequence order and delivered by
one loop: a callback or releaser that causes a nested evaluation on the same thread (the lock is
re-entrant) only queues its change, which the outer loop delivers after the one in progress. Hence
every change is delivered exactly once, in ``sequence`` order, and once the device is quiet the last
change delivered is the current ``level``.

An event delivered after a newer sample was taken (its simulated time is older than the sample's) is
stale: its free bytes describe the device before that sample, so it is ignored rather than allowed to
set the level back (``stats().events_seen`` counts the events that were evaluated).
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import numbers
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from gpumem.device import Device, DeviceKind
from gpumem.errors import (
    BackendUnavailableError,
    CudaError,
    DeviceClosedError,
    DeviceLostError,
    GpumemError,
    InvalidArgumentError,
)
from gpumem.events import MemoryEvent, MemoryEventKind, Subscription
from gpumem.validate import check_duration

log = logging.getLogger(__name__)

#: The used fractions at which MEDIUM, HIGH and CRITICAL begin (CRITICAL: strictly above).
MEDIUM_FROM = 0.60
HIGH_FROM = 0.80
CRITICAL_ABOVE = 0.95


def _fraction(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{what} must be a number in [0, 1], got {type(value).__name__} {value!r}"[:200])
    f = float(value)
    if not math.isfinite(f) or not 0.0 <= f <= 1.0:
        raise InvalidArgumentError(f"{what} must be a number in [0, 1], got {value!r}")
    return f


class MemoryPressure(enum.IntEnum):
    """How full a device is, by the fraction of its memory in use (by anyone).

    LOW: < 60 %; MEDIUM: 60 % to < 80 %; HIGH: 80 % to 95 %; CRITICAL: > 95 %.
    Levels compare by severity (``MemoryPressure.HIGH > MemoryPressure.MEDIUM``).
    """

    LOW = 0
    MEDIUM = 1
    HIGH = 2
    CRITICAL = 3

    @classmethod
    def from_used_fraction(cls, fraction: float) -> "MemoryPressure":
        """The level of a device with ``fraction`` (in [0, 1]) of its memory used.

        Raises :class:`~gpumem.errors.InvalidArgumentError` for anything else (NaN, < 0, > 1, text).
        """
        f = _fraction(fraction, "used fraction")
        if f > CRITICAL_ABOVE:
            return cls.CRITICAL
        if f >= HIGH_FROM:
            return cls.HIGH
        if f >= MEDIUM_FROM:
            return cls.MEDIUM
        return cls.LOW

    def __str__(self) -> str:
        return self.name

    @property
    def lower_bound(self) -> float:
        """The used fraction at which this level begins (CRITICAL: just above it)."""
        return _LOWER_BOUNDS[self]


_LOWER_BOUNDS = {MemoryPressure.LOW: 0.0, MemoryPressure.MEDIUM: MEDIUM_FROM, MemoryPressure.HIGH: HIGH_FROM,
                 MemoryPressure.CRITICAL: CRITICAL_ABOVE}


@runtime_checkable
class Releaser(Protocol):
    """Something that can give cached memory back: ``empty_cache()`` returns the bytes released."""

    def empty_cache(self) -> int:  # pragma: no cover - a protocol
        ...


class SampleSource(str, enum.Enum):
    """Where a sample's figures came from (Note [What a sample measures])."""

    NVML = "nvml"
    MEM_INFO = "mem_info"
    EVENT = "event"
    """A simulated device's memory event (its ``free_nbytes``), under ``react_to_events``."""
    EXTERNAL = "external"
    """Figures a caller passed to :meth:`PressureMonitor.observe`."""


@dataclass(frozen=True)
class PressureSample:
    """One look at the device: bytes used by anyone, its total, the level after hysteresis."""

    used_nbytes: int
    total_nbytes: int
    level: MemoryPressure
    source: SampleSource
    wall_time_s: float
    """``time.monotonic()`` when taken."""
    sim_time_s: float | None = None
    """The simulated clock, on a simulated device."""

    @property
    def used_fraction(self) -> float:
        """``used_nbytes / total_nbytes``."""
        return self.used_nbytes / self.total_nbytes if self.total_nbytes else 0.0


@dataclass(frozen=True)
class PressureChange:
    """A level change, as callbacks receive it."""

    old: MemoryPressure
    new: MemoryPressure
    sample: PressureSample
    sequence: int
    """1 for the first change this monitor saw, then 2, 3...: orders changes seen on different threads."""


@dataclass(frozen=True)
class PressureMonitorStats:
    """What a monitor did so far."""

    polls: int
    """Samples taken by :meth:`PressureMonitor.poll_once` (thread or caller)."""
    events_seen: int
    """Memory events that re-evaluated the level (``react_to_events``)."""
    level_changes: int
    releases: int
    """Evaluations at HIGH or CRITICAL that called the releasers."""
    released_nbytes: int
    """What the releasers' ``empty_cache()`` said they gave back, in total."""
    callback_errors: int
    release_errors: int
    poll_errors: int
    level: MemoryPressure
    peak_level: MemoryPressure
    last_sample: PressureSample | None
    peak_used_fraction: float
    """The highest used fraction any sample showed."""
    samples_by_source: dict[str, int]
    """How many samples came from each :class:`SampleSource` (by its value)."""


PressureCallback = Callable[[PressureChange], Any]


class PressureMonitor:
    """Watch a device's memory pressure; call callbacks on level changes; give cache back when it is high.

    ``device``: a :class:`gpumem.Device`. ``interval_s``: seconds between the thread's polls (> 0).
    ``releasers``: objects with ``empty_cache() -> int``, called at HIGH and CRITICAL
    (Note [When cache is given back]). ``callbacks``: callables taking a :class:`PressureChange`.
    ``hysteresis``: Note [Pressure hysteresis]. ``react_to_events`` and ``sim_advance_s``: Note
    [Polling a simulated device]. ``use_nvml``: on a CUDA device, sample through NVML (the default)
    rather than ``cudaMemGetInfo``.

    Use as a context manager (``with PressureMonitor(dev, interval_s=0.1, releasers=[alloc]):``) or
    with :meth:`start` / :meth:`stop`; :meth:`poll_once` samples once without any thread.
    """

    def __init__(
        self,
        device: Device,
        *,
        interval_s: float = 0.5,
        releasers: Iterable[Releaser] = (),
        callbacks: Iterable[PressureCallback] = (),
        hysteresis: float = 0.02,
        react_to_events: bool = True,
        sim_advance_s: float | None = None,
        use_nvml: bool = True,
    ) -> None:
        if not isinstance(device, Device):
            raise InvalidArgumentError(f"device must be a gpumem.Device, got {type(device).__name__}")
        if isinstance(interval_s, bool) or not isinstance(interval_s, numbers.Real) \
                or not math.isfinite(float(interval_s)) or float(interval_s) <= 0:
            raise InvalidArgumentError(f"interval_s must be a finite number of seconds > 0, got {interval_s!r}"[:200])
        hysteresis = _fraction(hysteresis, "hysteresis")
        if hysteresis >= MEDIUM_FROM:
            raise InvalidArgumentError(f"hysteresis must be below {MEDIUM_FROM}, got {hysteresis!r}")
        if sim_advance_s is not None:
            if device.kind is not DeviceKind.SIM:
                raise InvalidArgumentError("sim_advance_s applies to simulated devices only, "
                                           f"{device.spec} is {device.kind.value}")
            sim_advance_s = check_duration(sim_advance_s, what="sim_advance_s")
        releasers = list(releasers)
        callbacks = list(callbacks)
        for r in releasers:
            _check_releaser(r)
        for c in callbacks:
            _check_callback(c)
        self.device = device
        self.interval_s = float(interval_s)
        self.hysteresis = hysteresis
        self.react_to_events = bool(react_to_events)
        self.sim_advance_s = sim_advance_s
        self.use_nvml = bool(use_nvml)
        self._lock = threading.Lock()
        # guarded by _lock:
        self._releasers: list[Releaser] = releasers
        self._callbacks: list[PressureCallback] = callbacks
        self._level = MemoryPressure.LOW
        self._peak = MemoryPressure.LOW
        self._sampled = False
        self._last: PressureSample | None = None
        self._sequence = 0
        self._peak_fraction = 0.0
        self._by_source: dict[str, int] = {}
        self._polls = self._events_seen = self._releases = self._released_nbytes = 0
        self._callback_errors = self._release_errors = self._poll_errors = 0
        self._thread: threading.Thread | None = None
        self._subscription: Subscription | None = None
        self._starting = False  # guarded by _lock; Note [One start wins]
        self._nvml_failed = False
        # not guarded (set/read by one thread at a time, or thread-safe by themselves):
        self._stop_event = threading.Event()
        self._total_nbytes = device.properties().total_nbytes
        self._in_release = threading.local()
        # Note [One evaluation at a time]; guarded by _eval_lock:
        self._eval_lock = threading.RLock()
        self._pending: collections.deque[tuple[PressureChange, list[PressureCallback]]] = collections.deque()
        self._delivering = False
        self._measured_sim_s: float | None = None

    # -- registration ------------------------------------------------------------------------------
    def add_releaser(self, releaser: Releaser) -> None:
        """Call ``releaser.empty_cache()`` at HIGH and CRITICAL from now on."""
        _check_releaser(releaser)
        with self._lock:
            self._releasers.append(releaser)

    def remove_releaser(self, releaser: Releaser) -> None:
        """Stop calling ``releaser``; :class:`InvalidArgumentError` if it was not registered."""
        with self._lock:
            if not any(r is releaser for r in self._releasers):
                raise InvalidArgumentError(f"{releaser!r} is not a registered releaser")
            self._releasers = [r for r in self._releasers if r is not releaser]

    def add_callback(self, callback: PressureCallback) -> None:
        """Call ``callback(change)`` at every level change from now on."""
        _check_callback(callback)
        with self._lock:
            self._callbacks.append(callback)

    def remove_callback(self, callback: PressureCallback) -> None:
        """Stop calling ``callback`` (compared with ``==``, so a bound method ``obj.m`` matches another
        ``obj.m``); :class:`InvalidArgumentError` if it was not registered."""
        with self._lock:
            if not any(c == callback for c in self._callbacks):
                raise InvalidArgumentError(f"{callback!r} is not a registered callback")
            self._callbacks = [c for c in self._callbacks if c != callback]

    # -- state -----------------------------------------------------------------------------------------
    @property
    def level(self) -> MemoryPressure:
        """The level after the last evaluation. It starts at LOW, so a first sample at another level is a
        change (callbacks hear of it)."""
        with self._lock:
            return self._level

    @property
    def running(self) -> bool:
        """Whether the polling thread is alive."""
        t = self._thread
        return t is not None and t.is_alive()

    def stats(self) -> PressureMonitorStats:
        """A snapshot of the counters."""
        with self._lock:
            return PressureMonitorStats(
                polls=self._polls, events_seen=self._events_seen, level_changes=self._sequence,
                releases=self._releases, released_nbytes=self._released_nbytes,
                callback_errors=self._callback_errors, release_errors=self._release_errors,
                poll_errors=self._poll_errors, level=self._level, peak_level=self._peak, last_sample=self._last,
                peak_used_fraction=self._peak_fraction, samples_by_source=dict(self._by_source))

    # -- sampling --------------------------------------------------------------------------------------
    def _measure(self) -> tuple[int, int, SampleSource]:
        """(used, total, source) of the whole device right now (Note [What a sample measures])."""
        dev = self.device
        if dev.kind is DeviceKind.CUDA and self.use_nvml and not self._nvml_failed:
            nvml_info = getattr(dev, "nvml_memory_info", None)
            if nvml_info is not None:
                try:
                    info = nvml_info()
                    return int(info.used_nbytes), int(info.total_nbytes), SampleSource.NVML
                except BackendUnavailableError as exc:
                    self._nvml_failed = True
                    log.info("%s: NVML unavailable (%s); sampling cudaMemGetInfo instead", dev.spec, exc)
                except CudaError as exc:  # this sample only: NVML may answer next time
                    log.warning("%s: NVML failed (%s); this sample comes from cudaMemGetInfo", dev.spec, exc)
        mem = dev.mem_info()
        return mem.used_nbytes, mem.total_nbytes, SampleSource.MEM_INFO

    def _level_for(self, fraction: float, current: MemoryPressure) -> MemoryPressure:
        """The level for ``fraction`` coming from ``current`` (Note [Pressure hysteresis])."""
        raw = MemoryPressure.from_used_fraction(min(max(fraction, 0.0), 1.0))
        if raw >= current or not self.hysteresis:
            return raw
        # falling: stay at a level until the fraction is hysteresis below the bound of the level above
        level = current
        while level > raw and fraction < level.lower_bound - self.hysteresis:
            level = MemoryPressure(level - 1)
        return level

    def poll_once(self) -> PressureSample:
        """Sample the device now, update the level, release and call callbacks as needed; return the sample.

        On a simulated device with ``sim_advance_s``, that much simulated time passes first.
        Errors of the device (lost, closed) propagate; the thread logs them.
        """
        with self._eval_lock:  # Note [One evaluation at a time]
            if self.sim_advance_s:
                self.device.advance(self.sim_advance_s)  # type: ignore[attr-defined]
            used, total, source = self._measure_now()
            with self._lock:
                self._polls += 1
            return self._evaluate(used, total, source)

    def _measure_now(self) -> tuple[int, int, SampleSource]:
        """:meth:`_measure`, remembering the simulated time of the figures (stale events: Note [One
        evaluation at a time]). Called with ``_eval_lock`` held."""
        measured = self._measure()
        now = getattr(self.device, "now_s", None)
        if isinstance(now, (int, float)) and not isinstance(now, bool):
            self._measured_sim_s = float(now)
        return measured

    def observe(self, used_nbytes: int, total_nbytes: int | None = None) -> PressureSample:
        """Evaluate figures measured elsewhere (another monitoring system, a test): ``used_nbytes`` of
        ``total_nbytes`` (default: the device's total) in use. Levels, releases and callbacks follow as
        for a poll. :class:`InvalidArgumentError` unless ``0 <= used_nbytes <= total_nbytes`` and
        ``total_nbytes > 0`` (nothing changes)."""
        total = self._total_nbytes if total_nbytes is None else total_nbytes
        for what, v in (("used_nbytes", used_nbytes), ("total_nbytes", total)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise InvalidArgumentError(f"{what} must be an int, got {type(v).__name__} {v!r}"[:200])
        if total <= 0 or not 0 <= used_nbytes <= total:
            raise InvalidArgumentError(f"need 0 <= used_nbytes <= total_nbytes and total_nbytes > 0, got "
                                       f"used_nbytes={used_nbytes}, total_nbytes={total}")
        with self._eval_lock:  # Note [One evaluation at a time]
            return self._evaluate(int(used_nbytes), int(total), SampleSource.EXTERNAL, resample=False)

    def _evaluate(self, used: int, total: int, source: SampleSource, *, resample: bool = True) -> PressureSample:
        """Update the level from ``used`` of ``total``, release, deliver the changes in order.
        The caller holds ``_eval_lock`` (Note [One evaluation at a time])."""
        sim_now = getattr(self.device, "now_s", None)
        with self._lock:
            old = self._level
            fraction = used / total if total else 0.0
            new = self._level_for(fraction, old) if self._sampled else MemoryPressure.from_used_fraction(
                min(max(fraction, 0.0), 1.0))
            self._sampled = True
            self._peak_fraction = max(self._peak_fraction, fraction)
            self._by_source[source.value] = self._by_source.get(source.value, 0) + 1
            sample = PressureSample(used, total, new, source, time.monotonic(),
                                    float(sim_now) if isinstance(sim_now, (int, float)) else None)
            self._last = sample
            change = None
            if new != old:
                self._sequence += 1
                self._level = new
                self._peak = max(self._peak, new)
                change = PressureChange(old, new, sample, self._sequence)
            releasers = list(self._releasers) if new >= MemoryPressure.HIGH else []
            if change is not None:  # queued in sequence order (Note [One evaluation at a time])
                self._pending.append((change, list(self._callbacks)))
        # Note [Callbacks outside every lock]: the monitor's state lock is not held from here on
        if change is not None:
            log.info("%s: memory pressure %s -> %s (%.1f %% used, from %s)", self.device.spec, change.old.name,
                     change.new.name, 100 * sample.used_fraction, source.value)
        released = self._release(releasers, new) if releasers else 0
        self._deliver_pending()
        if released and resample:
            # Note [When cache is given back]: look again, so the level (and the callbacks) follow the release
            used, total, source = self._measure_now()
            return self._evaluate(used, total, source, resample=False)
        return sample

    def _deliver_pending(self) -> None:
        """Call back every queued change, oldest first, each exactly once. A nested call (a callback or
        releaser that caused an evaluation on this thread) returns at once: the outer loop delivers
        what it queued, after the change in progress (Note [One evaluation at a time])."""
        if self._delivering:
            return
        self._delivering = True
        try:
            while self._pending:
                change, callbacks = self._pending.popleft()
                for cb in callbacks:
                    try:
                        cb(change)
                    except Exception:  # noqa: BLE001 - Note [Callbacks outside every lock]: logged, never fatal
                        with self._lock:
                            self._callback_errors += 1
                        log.exception("%s: pressure callback %r raised", self.device.spec, cb)
        finally:
            self._delivering = False

    def _release(self, releasers: list[Releaser], level: MemoryPressure) -> int:
        """Call every releaser's ``empty_cache()``; return the bytes they gave back."""
        # a releaser's empty_cache moves the simulated clock, which may deliver events to us again on
        # this thread: do not release recursively
        if getattr(self._in_release, "active", False):
            return 0
        self._in_release.active = True
        try:
            total = 0
            for r in releasers:
                try:
                    n = r.empty_cache()
                except Exception:  # noqa: BLE001 - logged and counted, the others still release
                    with self._lock:
                        self._release_errors += 1
                    log.exception("%s: releaser %r raised in empty_cache() at %s pressure", self.device.spec, r,
                                  level.name)
                    continue
                if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                    total += n
            with self._lock:
                self._releases += 1
                self._released_nbytes += total
            if total:
                log.info("%s: %s pressure: %d bytes of cache given back", self.device.spec, level.name, total)
            return total
        finally:
            self._in_release.active = False

    def _on_event(self, event: MemoryEvent) -> None:
        """A device memory event (simulator): re-evaluate from its free bytes (Note [Polling a simulated device])."""
        if event.kind not in (MemoryEventKind.TENANT_TOOK, MemoryEventKind.TENANT_RETURNED,
                              MemoryEventKind.TENANT_DENIED):
            return
        if self._stop_event.is_set() and self._thread is None:
            return
        with self._eval_lock:  # Note [One evaluation at a time]
            measured = self._measured_sim_s
            if measured is not None and event.time_s < measured:
                return  # stale: a newer sample already saw the device after this event
            self._measured_sim_s = float(event.time_s)
            with self._lock:
                self._events_seen += 1
            total = self._total_nbytes
            self._evaluate(total - event.free_nbytes, total, SampleSource.EVENT)

    # -- the thread -----------------------------------------------------------------------------------
    def start(self) -> "PressureMonitor":
        """Take a first sample (errors propagate), then start the polling thread; return self.

        :class:`InvalidArgumentError` if it is already running.
        """
        # Note [One start wins]: the check and the claim are one lock section (``_starting``), so of
        # concurrent start() calls exactly one starts a thread and subscribes; the others raise. The
        # first sample and the subscription (device calls that may run callbacks) happen outside _lock.
        with self._lock:
            if self._thread is not None or self._starting:
                raise InvalidArgumentError("this PressureMonitor is already running")
            self._starting = True
            self._stop_event.clear()
        sub = None
        try:
            self.poll_once()
            if self.react_to_events:
                sub = self.device.subscribe(self._on_event)
            thread = threading.Thread(target=self._run, name=f"gpumem-pressure[{self.device.spec}]", daemon=True)
            with self._lock:
                self._subscription = sub
                self._thread = thread
            thread.start()
        except BaseException:
            with self._lock:
                if self._subscription is sub:
                    self._subscription = None
                self._thread = None
            if sub is not None:
                sub.cancel()
            raise
        finally:
            with self._lock:
                self._starting = False
        return self

    def _run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            # wait for an evaluation in progress elsewhere (a release, its callbacks), in steps so that
            # stop() is heard meanwhile (Note [One evaluation at a time])
            while not self._eval_lock.acquire(timeout=0.05):
                if self._stop_event.is_set():
                    return
            try:
                self.poll_once()
            except (DeviceLostError, DeviceClosedError) as exc:
                with self._lock:
                    self._poll_errors += 1
                log.warning("%s: pressure monitor stops: %s", self.device.spec, exc)
                return
            except GpumemError as exc:
                with self._lock:
                    self._poll_errors += 1
                log.warning("%s: pressure poll failed: %s", self.device.spec, exc)
            except Exception:  # noqa: BLE001 - a monitor thread must not die silently
                with self._lock:
                    self._poll_errors += 1
                log.exception("%s: pressure poll failed", self.device.spec)
            finally:
                self._eval_lock.release()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop polling and join the thread (idempotent); stop reacting to events.

        Must not be called from a callback or releaser running on the monitor's own thread
        (:class:`InvalidArgumentError`: it would wait for itself).
        """
        with self._lock:
            thread = self._thread
            if thread is not None and thread is threading.current_thread():
                # checked before anything changes: the monitor keeps running and keeps its subscription
                raise InvalidArgumentError("PressureMonitor.stop() called from the monitor's own thread")
            sub, self._subscription = self._subscription, None
        self._stop_event.set()
        if sub is not None:
            sub.cancel()
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("%s: pressure monitor thread did not stop within %s s", self.device.spec, timeout_s)
                return
        with self._lock:
            if self._thread is thread:
                self._thread = None

    def __enter__(self) -> "PressureMonitor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"PressureMonitor({self.device.spec}, level={self.level.name}, interval_s={self.interval_s}, "
                f"running={self.running})")


def _check_releaser(releaser: object) -> None:
    if not callable(getattr(releaser, "empty_cache", None)):
        raise InvalidArgumentError(f"a releaser needs an empty_cache() method, got {type(releaser).__name__}")


def _check_callback(callback: object) -> None:
    if not callable(callback):
        raise InvalidArgumentError(f"a pressure callback must be callable, got {type(callback).__name__}")


__all__ = ["MemoryPressure", "PressureMonitor", "PressureSample", "PressureChange", "PressureMonitorStats",
           "Releaser", "SampleSource", "PressureCallback"]
