"""The simulated GPU: a :class:`gpumem.Device` that lives in a SimPy environment.

Time
    Every call costs simulated time (:mod:`gpumem.sim.latency`): the device advances its
    ``simpy.Environment`` by that much, and whatever other tenants (SimPy
    processes, :mod:`gpumem.sim.pressure`) and scheduled faults do meanwhile happens
    before the call completes. ``advance(seconds)`` lets time pass without a
    call, as a program computing between allocations would. The clock (:mod:`gpumem.sim.clock`)
    uses SimPy's public API only and moves SimPy only when an event is due.

Memory
    Physical memory is counted in the profile's granularity (2 MiB on CUDA), the
    way the H200 was measured to behave (``sim/calibrate.py``): a
    ``cudaMalloc`` above 1 MiB takes whole 2 MiB pages of its own; smaller ones
    are packed, 512-byte aligned, into shared 2 MiB pages that return to the
    device when their last allocation is freed; a ``cuMemCreate`` chunk takes
    exactly its (granular) size. ``mem_info().free_nbytes`` is what is left after
    the CUDA context, this process's pages and other tenants.

Addresses
    One virtual address space (from ``0x7f00_0000_0000`` to 2**48, 129 TiB, so
    that 1 TiB reservations fit as on the H200) holds ``malloc`` ranges, small
    pages and address reservations, so nothing can overlap by construction.
    What was handed out (allocations, reservations and their mappings, chunks)
    is recorded once, in the :class:`gpumem.Device` base class's book
    (:mod:`gpumem.vmm_book`), which also checks every call's arguments; this
    class adds time, pages, bytes, streams and the sanitizer.

Streams and the sanitizer
    Work queued with :meth:`SimDevice.launch` runs on its stream's SimPy process
    (:mod:`gpumem.sim.streams`). Freeing or unmapping memory that queued or running work
    touches, or launching work on memory that is not allocated or not mapped with
    access, is what kills a real context (``CUDA_ERROR_ILLEGAL_ADDRESS``, later):
    the simulator's sanitizer raises :class:`~gpumem.errors.MemoryHazardError`
    instead and changes nothing (``sanitizer="raise"``, the default), or records a
    :class:`Hazard` in :attr:`SimDevice.hazards` and lets the call proceed
    (``"count"``, for replays), or looks away (``"off"``). In ``count`` mode a hazard
    is recorded only for a call that goes ahead (not for one an injected fault fails).
    :meth:`~gpumem.Device.close` first runs simulated time until every stream is
    idle (as ``cudaDeviceSynchronize`` before teardown), then frees.

Note [A failed call changes nothing]
------------------------------------
Each call is validated (by the base class), then advances time, checks for a
lost device, decides injected faults and checks capacity *before* it mutates
any state, so every exception leaves the accounting as it was. The stateful property tests in
``tests/sim`` check this after every step.

Threads: every public call holds the device's lock (:class:`gpumem.Device`), so
threads may share a device; SimPy tenants run inside whichever call moves time.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import simpy

from gpumem.intervals import IntervalMap
from gpumem.vmm_book import Allocation, Mapping, Physical, Reservation
from gpumem.device import (
    Device,
    DeviceKind,
    DeviceProperties,
    Event,
    MemInfo,
    check_nbytes,
    check_pointer,
    check_stream,
)
from gpumem.errors import (
    CudaError,
    DeviceLostError,
    InternalError,
    InvalidArgumentError,
    InvalidPointerError,
    MemoryHazardError,
    OutOfMemoryError,
    TransientDeviceError,
    UnsupportedOperationError,
)
from gpumem.units import MiB, align_up
from gpumem.validate import check_duration

from ..events import MemoryEvent, MemoryEventKind
from .clock import SimClock
from .faults import FaultInjector, FaultKind, FaultPlan
from .pressure import Scenario, TenantContext
from .profiles import DeviceProfile
from .slots import Slot as _Slot, SlotIndex
from .storage import SparseStore
from .streams import DONE, PhysicalPiece, StreamEngine, Work

log = logging.getLogger(__name__)

#: ``cudaMalloc`` requests up to this size are packed into shared pages (measured on the H200).
SMALL_MALLOC_MAX_NBYTES = 1 * MiB
SMALL_MALLOC_ALIGNMENT = 512
#: A shared page of small ``malloc``'s is this large, or one granularity page where that is larger (a page of a
#: granularity under 1 MiB could not hold a small request: attacker 26).
SMALL_PAGE_NBYTES = 2 * MiB
_VA_BASE = 0x7F00_0000_0000
_VA_LIMIT = 1 << 48
#: ``cudaMalloc`` puts a segment of more than :data:`SMALL_MALLOC_MAX_NBYTES` in slots of this size (Note [Where the
#: driver places a segment]).
SEGMENT_SLOT_NBYTES = 32 * MiB


# Note [Where the driver places a segment]
# ----------------------------------------
# Among equal free blocks PyTorch's caching allocator takes the one at the lowest address (``get_free_block``'s
# ``lower_bound`` over ``(stream, size, address)``), so where ``cudaMalloc`` puts segments decides which block a
# request gets. On the H200 (driver 580, CUDA 13) a 7B decode's segments, read with ``torch.cuda.memory_snapshot()``
# at eight tokens (``reports/hil/long-decode-check-h200-2026-11-29.md``), lie in 32 MiB-aligned slots handed out
# downwards, each new slot below all earlier ones; a segment that fits the room left in a slot goes there, right
# above what the slot holds (12 + 12, 14 + 14, 16 + 16, 20 + 12 MiB); a segment over 32 MiB takes whole slots (86
# MiB in 96, 250 in 256). This device places segments so: the newest slot with room first, the lowest gap in it;
# else a new slot, from the highest range that slots emptied and gave back, else below every slot. Replayed on
# it with ties by address, the ``pytorch`` model gives the recorded decode's peak reserved to the byte where the
# earlier model (addresses upwards, each new segment sorted below the earlier ones) was 0.21 % under, and the
# corpus's ``llama_varlen_train_h200`` exactly (-2.49 % before); ``moe_train_h200`` goes +0.96 % over (exact
# before): that process's driver filled holes left before its recording began and let a segment straddle slots,
# which this model does not know. Reservations for virtual memory and small mallocs keep their own range, upwards
# from ``_VA_BASE``. The slots are found by their largest gaps (:mod:`.slots`, Note [Finding the newest slot with
# room]).


#: What the sanitizer does about a hazard (Note [What the sanitizer looks at] in :mod:`gpumem.sim.streams`).
SANITIZER_MODES = ("raise", "count", "off")


# Note [The clock stays finite]
# -----------------------------
# SimPy refuses to run once its clock is infinite, so a clock at ``inf`` would make every later call
# fail. Durations are finite, but two finite ones can add up to ``inf`` (``advance(1.7e308)`` twice,
# or two such kernels queued one after the other). ``advance`` and ``launch`` therefore refuse a
# duration for which now + all queued work + the duration is not finite: the clock can never pass
# that bound, since queued work ends at the latest when all of it has run back to back.


@dataclass(frozen=True)
class Hazard:
    """A memory hazard the sanitizer saw in ``count`` mode (what ``raise`` mode would have raised)."""

    time_s: float
    call: str
    """The device call: ``free``, ``mem_unmap`` or ``launch``; ``alias`` for work launched unordered beside unfinished work of
    another stream on the same physical bytes (Note [Physical aliasing] in :mod:`gpumem.sim.streams`)."""
    stream: int
    va: int
    nbytes: int
    work: str
    """The name of the work that touches the range (or of the work being launched)."""
    message: str

    def to_error(self) -> MemoryHazardError:
        return MemoryHazardError(self.call, self.message, stream=self.stream, va=self.va, nbytes=self.nbytes,
                                 work=self.work)


class SimEvent(Event):
    """An event of a :class:`SimDevice`: the last work on its stream when it was recorded
    (Note [Events are a pointer to the stream's tail] in :mod:`gpumem.sim.streams`)."""

    __slots__ = ("work",)

    def __init__(self, device: "SimDevice", stream: int, work: Work | None) -> None:
        # Event.__init__ inlined: event_record is on the allocator's hot path
        self.stream = stream
        self._device = device
        self._destroyed = False
        self.work = work

    @property
    def complete(self) -> bool:
        """Whether the event has completed (no device call, no simulated time)."""
        return self.work is None or self.work.state == DONE


class _Allocation(Allocation):
    """A ``malloc``'d range (``native``: its :class:`SparseStore`); ``page`` is the shared small page
    it lives in, if any, and ``span_nbytes`` what it occupies there (512-byte aligned) or in pages."""

    __slots__ = ("page", "span_nbytes", "slot")

    def __init__(self, start: int, nbytes: int, span_nbytes: int, page: "_SmallPage | None",
                 slot: "_Slot | None" = None) -> None:
        super().__init__(start, nbytes, SparseStore(nbytes))
        self.span_nbytes = span_nbytes
        self.page = page
        self.slot = slot
        """A segment's slot (Note [Where the driver places a segment]); None for a small malloc."""


class _SmallPage:
    """A page (:data:`SMALL_PAGE_NBYTES`, at least one granularity page) that packs small ``malloc``'s, like the
    CUDA driver does."""

    __slots__ = ("start", "nbytes", "subs")

    def __init__(self, start: int, nbytes: int) -> None:
        self.start = start
        self.nbytes = nbytes
        self.subs: IntervalMap[_Allocation] = IntervalMap()
        """The allocations in the page, each over its 512-byte aligned span."""

    def find_gap(self, span: int) -> int | None:
        """First fit: the lowest address in the page with ``span`` free bytes."""
        return self.subs.find_gap(self.start, self.start + self.nbytes, span)


#: What the simulator's address space holds at a reservation (the reservation itself is in the book).
_RESERVED = "reservation"


@dataclass
class SimCallStats:
    """How many calls the device served and how much simulated time they took."""

    calls: dict[str, int] = field(default_factory=dict)
    busy_us: float = 0.0
    injected_faults: int = 0
    device_waits: int = 0
    """VMM calls that waited for queued work (:attr:`LatencyModel.waits_for_device`; Note [Does a VMM call
    wait for the GPU?]); a call that found the device idle is not counted."""
    device_wait_s: float = 0.0
    """Simulated seconds those calls waited."""
    cost_us: dict[str, float] = field(default_factory=dict)
    """Simulated µs each kind of call cost in all (what :attr:`busy_us` sums)."""
    busy_priced_calls: int = 0
    """Calls of :data:`~gpumem.sim.latency.BUSY_PRICED_CALLS` made while the device had unfinished work:
    priced higher where the latency model's busy terms are on (Note [A busy device prices VMM calls higher]
    in :mod:`gpumem.sim.latency`)."""

    def count(self, name: str, cost_us: float) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.cost_us[name] = self.cost_us.get(name, 0.0) + cost_us
        self.busy_us += cost_us


class _Tenant(TenantContext):
    def __init__(self, device: "SimDevice", name: str, rng: random.Random) -> None:
        self.device = device
        self.env = device._clock.env  # scenarios use it inside SimPy processes, at SimPy's time
        self.name = name
        self.rng = rng
        self._held = 0
        self._held_pages = 0

    @property
    def held_nbytes(self) -> int:
        return self._held

    def take(self, nbytes: int) -> bool:
        # a Scenario of the caller's own calls these: whole bytes only (take(-4 GiB) added free memory)
        return self.device._tenant_take(self, check_nbytes(nbytes, what="take: nbytes", allow_zero=True))

    def give(self, nbytes: int) -> None:
        self.device._tenant_give(self, check_nbytes(nbytes, what="give: nbytes", allow_zero=True))


class SimDevice(Device):
    """A simulated GPU of a given :class:`~gpumem.sim.profiles.DeviceProfile`.

    >>> from gpumem.sim import SimDevice, get_profile
    >>> dev = SimDevice(get_profile("a100-80gb"))
    >>> p = dev.malloc(64 * 2**20); dev.write(p, b"hello"); dev.read(p, 5)
    b'hello'

    ``env`` is a SimPy environment to share with other devices or your own processes (the device
    then hands every move of its clock to it at once); without one the device makes its own and
    moves it lazily (Note [A lazy clock over SimPy] in :mod:`gpumem.sim.clock`).
    ``pressure`` scenarios run as other tenants from time 0; ``faults`` injects
    failures (per call type too: :class:`~gpumem.sim.faults.FaultPlan`); ``seed`` makes
    every random choice repeatable; ``sanitizer`` is ``"raise"`` (the default),
    ``"count"`` or ``"off"`` (see the module docstring).

    Work runs on streams in simulated time::

        >>> k = dev.launch(0, 0.010, [(p, 5)], name="reader")   # a 10 ms kernel reading p
        >>> done = dev.event_record(0)
        >>> dev.event_query(done)
        False
        >>> dev.free(p)                  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        gpumem.errors.MemoryHazardError: free: ...
        >>> dev.event_synchronize(done); dev.free(p)
    """

    kind = DeviceKind.SIM
    event_type = SimEvent

    def __init__(
        self,
        profile: DeviceProfile,
        *,
        env: simpy.Environment | None = None,
        pressure: Iterable[Scenario] | Scenario | None = None,
        faults: FaultPlan | None = None,
        seed: int = 0,
        spec: str | None = None,
        sanitizer: str = "raise",
    ) -> None:
        if sanitizer not in SANITIZER_MODES:
            raise InvalidArgumentError(f"sanitizer must be one of {', '.join(SANITIZER_MODES)}, got {sanitizer!r}")
        super().__init__()
        self.profile = profile
        self.spec = spec or profile.spec
        # Note [A lazy clock over SimPy] (gpumem.sim.clock): lazy on the device's own environment only
        self._clock = SimClock(env if env is not None else simpy.Environment(), lazy=env is None)
        self.latency = profile.latency
        self._waits_for_device = profile.latency.waits_for_device
        # Note [Size-dependent costs are cached]: mem_create and mem_release interpolate a curve; an
        # allocator asks for few distinct sizes, so each device remembers the cost of each size it saw.
        self._create_cost_us: dict[int, float] = {}
        self._release_cost_us: dict[int, float] = {}
        self._props = profile.properties()
        self._gran = profile.granularity_nbytes
        self._rng = random.Random(seed)
        self.seed = seed
        self.faults = FaultInjector(faults or FaultPlan(), random.Random(self._rng.getrandbits(64)))
        self.stats = SimCallStats()
        self._calls = self.stats.calls
        self._costs = self.stats.cost_us
        self._prices_busy = profile.latency.busy_factor(0) != 1.0 or profile.latency.busy_factor_per_decade != 0.0
        self._n_mappings = 0
        """Live mappings (Note [A busy device prices VMM calls higher] in :mod:`gpumem.sim.latency`)."""
        self._vmm_end_s: float | None = None
        """When the last call of BUSY_PRICED_CALLS ended (Note [A cold VMM call costs more]); None before the first."""
        self.sanitizer = sanitizer
        """``"raise"``, ``"count"`` or ``"off"`` (see the module docstring)."""
        self.hazards: list[Hazard] = []
        """Hazards seen in ``count`` mode, oldest first."""
        self.streams = StreamEngine(self._clock)
        self.streams.on_alias = self._alias_seen
        self._next_stream = 1
        self._closed = False
        self._lost = False
        self._lost_at_s = 0.0
        self._total_pages = profile.total_nbytes // self._gran
        self._fixed_nbytes = profile.context_nbytes + profile.host_reserved_nbytes
        self._process_pages = 0
        self._tenant_pages = 0
        # one address space of top-level ranges: large allocations, small pages and reservations
        self._space: IntervalMap[_Allocation | _SmallPage | str] = IntervalMap()
        self._va_cursor = _VA_BASE
        # Note [Where the driver places a segment]: the slots holding segments, in creation order (each segment
        # names its own; Note [Finding the newest slot with room]); the lowest slot's base; ranges emptied slots
        # gave back, as (low, high)
        self._slots = SlotIndex()
        self._slot_low = _VA_LIMIT
        self._slot_ranges: list[tuple[int, int]] = []
        self._small_pages: list[_SmallPage] = []  # in creation order: small mallocs fit first there
        self._tenants: list[_Tenant] = []
        self._twins: list[Callable[[], None]] = []
        """Guarded by ``_lock``: what to call when this device closes, one per native engine whose idle twin keeps
        its books of mappings and events (:meth:`attach_idle_twin`)."""
        if isinstance(pressure, Scenario):
            pressure = [pressure]
        for i, scenario in enumerate(pressure or ()):
            self.add_tenant(scenario, name=f"tenant-{i}")
        if self.faults.plan.device_lost_at_s is not None:
            self._clock.process(self._lose_at(self.faults.plan.device_lost_at_s))

    # -- simulated time ------------------------------------------------------------------
    @property
    def env(self) -> simpy.Environment:
        """The SimPy environment the device lives in, its clock handed over (``env.now`` is the
        device's time). Code given it may schedule into it or run it, so from then on the device
        hands every move of its clock to SimPy at once (Note [A lazy clock over SimPy] in
        :mod:`gpumem.sim.clock`)."""
        with self._lock:
            self._refuse_under_twin("env")
            clock = self._clock
            clock.lazy = False
            return clock.sync()

    @property
    def now_s(self) -> float:
        """The device's simulated time in seconds: 0 when it was created on its own environment, the given
        environment's time otherwise."""
        return float(self._clock.now)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` of simulated time pass (tenants, faults and queued work act meanwhile)."""
        seconds = check_duration(seconds, what="advance: seconds")
        self._run(self._advance, seconds)

    def _advance(self, seconds: float) -> None:
        self._check_usable()
        self._check_finite_time("advance", seconds)
        if seconds:
            self._clock.advance(seconds)

    def _do_engine_work(self, pages_indexed: int) -> None:
        # the engine's CPU time, not a device call: no call counted, no fault drawn, nothing refused
        # (Note [The engine's own time] in gpumem.sim.latency)
        seconds = self.latency._engine_index_cost_us(pages_indexed) * 1e-6  # noqa: SLF001 - checked by engine_work
        if seconds and math.isfinite(self._clock.now + self.streams.pending_s + seconds):
            self._clock.advance(seconds)

    def _check_finite_time(self, call: str, seconds: float) -> None:
        """Refuse a duration after which the clock would not be finite (Note [The clock stays finite])."""
        now = self._clock.now
        end_s = now + self.streams.pending_s + seconds
        if not math.isfinite(end_s):
            raise InvalidArgumentError(f"{call}: {seconds!r} s from t={now!r} s (with "
                                       f"{self.streams.pending_s!r} s of queued work) would take the simulated "
                                       f"clock past the largest finite time")

    def _lost_message(self) -> str:
        # the time it was lost on the device's clock: device_lost_at_s counts from its creation, which on
        # a given environment need not be t=0
        return f"{self.spec} was lost at t={self._lost_at_s}s"

    def _priced(self, idle_cost_us: float) -> float:
        """The cost of a call of :data:`~gpumem.sim.latency.BUSY_PRICED_CALLS` now: its idle cost, times the
        busy factor at the mappings held while any stream has unfinished work (Note [A busy device prices
        VMM calls higher] in :mod:`gpumem.sim.latency`), plus the cold term for the time since the previous such
        call ended (Note [A cold VMM call costs more] there)."""
        lat = self.latency
        if self.streams._n_pending:  # noqa: SLF001 - the device is busy: a hot check
            self.stats.busy_priced_calls += 1
            if self._prices_busy:  # not the default model, which prices every call idle
                idle_cost_us *= lat.busy_factor(self._n_mappings)
        cold_us = lat.cold_vmm_us
        if cold_us:
            now = self._clock.now
            if self._vmm_end_s is not None:
                idle_cost_us += lat._cold_vmm_cost_us((now - self._vmm_end_s) * 1e6)  # noqa: SLF001
            self._vmm_end_s = now + idle_cost_us * 1e-6
        return idle_cost_us

    def runs_alone(self) -> bool:
        """Whether nothing but its caller's own calls can happen on this device now: no tenants, no planned
        faults (per call or a device loss), no GPU work queued, no VMM call that waits for the device, its
        clock its own (:attr:`env` never handed out), neither lost nor closed. Then its ``mem_map``,
        ``mem_set_access``, ``mem_unmap`` and event calls change nothing but its books of mappings and events
        and its clock, and every event completes when recorded (Note [An idle device's bookkeeping calls made
        here] in ``gpumem/_native/pybackend.cpp``)."""
        with self._lock:
            return (not self._tenants and not self.faults.per_call and self.faults.plan.device_lost_at_s is None
                    and not self._waits_for_device and self._clock.lazy and not self.streams._n_pending  # noqa: SLF001
                    and not self._lost and not self._closed and not self._twins)

    def attach_idle_twin(self, on_close: Callable[[], None]) -> None:
        """Let a native engine's idle twin keep this device's books of mappings and events (Note [An idle device's
        bookkeeping calls made here] in ``gpumem/_native/pybackend.cpp``) until :meth:`detach_idle_twin`;
        ``on_close()`` is called when the device closes. Meanwhile the calls that would need those books or break
        :meth:`runs_alone` (``launch``, ``read``, ``write``, ``add_tenant``, ``env``) raise
        :class:`~gpumem.errors.UnsupportedOperationError`.

        Raises:
            UnsupportedOperationError: the device does not run alone (:meth:`runs_alone`), or its latency model prices
                a cold VMM call higher (the twin's own calls would not; Note [A cold VMM call costs more] in
                :mod:`gpumem.sim.latency`); nothing attached.
        """
        with self._lock:
            if not self.runs_alone():
                raise UnsupportedOperationError(
                    f"the idle device twin needs a simulated device with nothing else on it (no tenants, faults per "
                    f"call, GPU work or other twin): {self.spec} is not one")
            if self.latency.cold_vmm_us:
                raise UnsupportedOperationError(
                    f"the idle device twin prices its calls without the cold-call term: this device's latency model "
                    f"has cold_vmm_us={self.latency.cold_vmm_us!r} (use one with cold_vmm_us=0 for the twin)")
            self._twins.append(on_close)

    def detach_idle_twin(self, on_close: Callable[[], None]) -> None:
        """Undo :meth:`attach_idle_twin` (no error if ``on_close`` is not attached)."""
        with self._lock:
            if on_close in self._twins:
                self._twins.remove(on_close)

    def _refuse_under_twin(self, what: str) -> None:
        if self._twins:
            raise UnsupportedOperationError(
                f"{what} on {self.spec}: an allocator's idle device twin keeps this device's mappings and events "
                "(Note [An idle device's bookkeeping calls made here]); close that allocator first")

    @property
    def n_mappings(self) -> int:
        """Live mappings (``mem_map`` calls not yet unmapped)."""
        return self._n_mappings

    def _call(self, name: str, cost_us: float, nbytes: int = 0) -> None:
        """Start a call (the base class refused a closed or lost device already): let its cost in time
        pass, then decide a per-call-type injected fault (``nbytes``: what an allocating call asked for).

        This runs once per simulated call."""
        clock = self._clock
        if clock.lazy:  # SimClock.advance, inlined: Note [A lazy clock over SimPy] in gpumem.sim.clock
            now = clock.now_s
            until_s = now + cost_us * 1e-6
            if until_s > now:  # a cost > 0 that moves a clock this large
                if clock.next_s > until_s:
                    clock.now_s = until_s
                else:
                    clock.run_to(until_s)
        else:
            clock.advance(cost_us * 1e-6)
        calls = self._calls
        calls[name] = calls.get(name, 0) + 1
        costs = self._costs
        costs[name] = costs.get(name, 0.0) + cost_us
        self.stats.busy_us += cost_us
        if self._lost or self.faults.per_call:
            self._call_fails(name, nbytes)

    def _call_fails(self, name: str, nbytes: int) -> None:
        """The rare end of :meth:`_call`: a lost device, or per-call-type faults planned."""
        if self._lost:
            raise DeviceLostError(self._lost_message())
        if self.faults.per_call and self.faults.call_fails(name):
            self.stats.injected_faults += 1
            self.events.publish(MemoryEvent(self.now_s, MemoryEventKind.FAULT_INJECTED, nbytes, self._free_nbytes(),
                                            name))
            if name in ("malloc", "mem_create"):
                raise self._oom(nbytes, injected=True)
            raise CudaError(name, "CUDA_ERROR_UNKNOWN", "injected fault", injected=True)

    def _lose_at(self, at_s: float):  # SimPy process
        yield self._clock.env.timeout(at_s)
        self._lost = True
        self._lost_at_s = self._clock.env.now
        self.events.publish(MemoryEvent(self.now_s, MemoryEventKind.DEVICE_LOST, 0, self._free_nbytes(), "faults"))

    # -- events and tenants -----------------------------------------------------------------
    def watch_free_level(self, level_nbytes: int) -> None:
        """Publish FREE_BELOW / FREE_ABOVE events when free memory crosses ``level_nbytes``."""
        level_nbytes = check_nbytes(level_nbytes, what="level_nbytes")
        self._run(self._watch_free_level, level_nbytes)

    def _watch_free_level(self, level_nbytes: int) -> None:
        self._check_usable()
        self.events.watch_level(level_nbytes)

    def add_tenant(self, scenario: Scenario, name: str | None = None) -> None:
        """Start another tenant running ``scenario`` now."""
        self._refuse_under_twin("add_tenant")
        if not isinstance(scenario, Scenario):
            raise InvalidArgumentError(f"scenario must be a gpumem.sim.pressure.Scenario, got {type(scenario).__name__}")
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError(f"name must be a str or None, got {type(name).__name__}")
        self._run(self._add_tenant, scenario, name)

    def _add_tenant(self, scenario: Scenario, name: str | None) -> None:
        self._check_usable()
        tenant = _Tenant(self, name or f"tenant-{len(self._tenants)}", random.Random(self._rng.getrandbits(64)))
        self._tenants.append(tenant)
        self._clock.process(scenario.process(tenant))

    @property
    def tenant_nbytes(self) -> int:
        """Device bytes other tenants hold now (granularity-rounded)."""
        return self._tenant_pages * self._gran

    def _tenant_take(self, tenant: _Tenant, nbytes: int) -> bool:
        pages = -(-nbytes // self._gran)
        old_free = self._free_nbytes()
        if pages * self._gran > old_free or self._closed:
            self.events.publish(MemoryEvent(self.now_s, MemoryEventKind.TENANT_DENIED, nbytes, old_free, tenant.name))
            return False
        self._tenant_pages += pages
        tenant._held += nbytes
        tenant._held_pages += pages
        new_free = self._free_nbytes()
        self.events.publish(MemoryEvent(self.now_s, MemoryEventKind.TENANT_TOOK, nbytes, new_free, tenant.name))
        self.events.free_changed(self.now_s, old_free, new_free, tenant.name)
        return True

    def _tenant_give(self, tenant: _Tenant, nbytes: int) -> None:
        nbytes = min(nbytes, tenant._held)
        if nbytes <= 0:
            return
        old_free = self._free_nbytes()
        tenant._held -= nbytes
        # Each take was rounded up to pages on its own, so a give returns its own pages (scenarios give
        # back what they took): recomputing ceil(held / granularity) instead would repack what is
        # left and free more than was given back. Never keep fewer pages than the bytes held need,
        # and none once nothing is held.
        if tenant._held == 0:
            pages = 0
        else:
            pages = max(-(-tenant._held // self._gran), tenant._held_pages - -(-nbytes // self._gran))
        released = tenant._held_pages - pages
        tenant._held_pages = pages
        self._tenant_pages -= released
        new_free = self._free_nbytes()
        self.events.publish(MemoryEvent(self.now_s, MemoryEventKind.TENANT_RETURNED, nbytes, new_free, tenant.name))
        self.events.free_changed(self.now_s, old_free, new_free, tenant.name)

    # -- accounting -------------------------------------------------------------------------------
    def _free_nbytes(self) -> int:
        return (self.profile.total_nbytes - self._fixed_nbytes
                - (self._process_pages + self._tenant_pages) * self._gran)

    def _take_pages(self, pages: int) -> None:
        if not self.events.watching_levels:  # nobody watches a level: no crossing to look for
            self._process_pages += pages
            return
        old = self._free_nbytes()
        self._process_pages += pages
        self.events.free_changed(self.now_s, old, self._free_nbytes(), "process")

    def _give_pages(self, pages: int) -> None:
        if not self.events.watching_levels:
            self._process_pages -= pages
            return
        old = self._free_nbytes()
        self._process_pages -= pages
        self.events.free_changed(self.now_s, old, self._free_nbytes(), "process")

    @property
    def process_used_nbytes(self) -> int:
        """Device bytes this process holds through this device object (granularity-rounded)."""
        return self._process_pages * self._gran

    def _oom(self, nbytes: int, *, injected: bool = False) -> OutOfMemoryError:
        return OutOfMemoryError(nbytes, self._free_nbytes(), self.profile.total_nbytes, device=self.spec,
                                hint="(cudaErrorMemoryAllocation)", injected=injected)

    def _decide_allocation_fault(self, nbytes: int) -> None:
        fault = self.faults.next_allocation_fault()
        if fault is None:
            return
        self.stats.injected_faults += 1
        self.events.publish(MemoryEvent(self.now_s, MemoryEventKind.FAULT_INJECTED, nbytes, self._free_nbytes(),
                                        fault.value))
        if fault is FaultKind.TRANSIENT:
            raise TransientDeviceError(f"injected transient error on allocation call {self.faults.allocation_calls}")
        raise self._oom(nbytes, injected=True)

    # -- the address space ----------------------------------------------------------------------
    def _va_alloc(self, nbytes: int, alignment: int) -> int:
        """A free, aligned range of the address space: above everything so far, or (once the top is
        reached) the lowest gap that fits."""
        start = align_up(self._va_cursor, alignment)
        if start + nbytes <= self._slot_low:
            return start
        at = self._space.find_gap(_VA_BASE, self._slot_low, nbytes, alignment)  # never among the slots
        if at is not None:
            return at
        raise OutOfMemoryError(nbytes, self._free_nbytes(), self.profile.total_nbytes, device=self.spec,
                               hint="(virtual address space exhausted)")

    def _space_add(self, start: int, nbytes: int, what: _Allocation | _SmallPage | str) -> None:
        self._space.add(start, start + nbytes, what)
        self._va_cursor = max(self._va_cursor, start + nbytes)

    # -- Device: properties and info -------------------------------------------------------------
    def properties(self) -> DeviceProperties:
        return self._props

    def _do_mem_info(self) -> MemInfo:
        self._call("mem_info", self.latency.mem_get_info_us)
        return MemInfo(self._free_nbytes(), self.profile.total_nbytes)

    # -- Device: malloc and free -------------------------------------------------------------------
    def _do_malloc(self, nbytes: int) -> _Allocation:
        # a request beyond the device fails at once on a real GPU: do not charge (and simulate) the
        # extrapolated cost of an absurd size, which can be hours of simulated tenant activity
        self._call("malloc", self.latency.malloc_us(min(nbytes, self.profile.total_nbytes)), nbytes)
        self._decide_allocation_fault(nbytes)
        if nbytes <= SMALL_MALLOC_MAX_NBYTES:
            return self._malloc_small(nbytes)
        span = align_up(nbytes, self._gran)
        if span > self._free_nbytes():
            raise self._oom(nbytes)
        start, slot = self._place_segment(span)
        # the gap it goes into: only where that was the slot's largest can the largest change (a new slot's gap
        # was set where it was made)
        lo, hi = self._space.free_run(slot.base, slot.base + slot.nbytes, start)
        alloc = _Allocation(start, nbytes, span, None, slot)
        self._space.add(start, start + span, alloc)
        slot.n_live += 1
        if slot.n_live > 1 and hi - lo == slot.gap_nbytes:
            self._slot_changed(slot)
        self._take_pages(span // self._gran)
        return alloc

    def _place_segment(self, span: int) -> "tuple[int, _Slot]":
        """Where a segment of ``span`` bytes goes, and its slot (Note [Where the driver places a segment])."""
        slot = self._slots.newest_with_gap(span)
        if slot is not None:  # Note [Finding the newest slot with room]
            at = self._space.find_gap(slot.base, slot.base + slot.nbytes, span, self._gran)
            if at is None:
                raise InternalError(f"{self.spec}: slot at {slot.base:#x} has no gap of {span} bytes, its books say "
                                    f"{slot.gap_nbytes}")
            return at, slot
        size = align_up(span, SEGMENT_SLOT_NBYTES)
        ranges = self._slot_ranges
        best, best_hi = -1, 0
        for i, (lo, hi) in enumerate(ranges):  # the highest range that can take it
            if hi - lo >= size and hi > best_hi:
                best, best_hi = i, hi
        if best >= 0:  # above the lowest slot: nothing but segments is ever placed there
            lo, hi = ranges.pop(best)
            base = hi - size
            if base > lo:
                ranges.append((lo, base))
        else:
            # below every slot, where reservations and small pages may have come up to: the range must be free
            base = self._slot_low - size
            if base < _VA_BASE or self._space.first_overlap(base, base + size) is not None:
                raise OutOfMemoryError(span, self._free_nbytes(), self.profile.total_nbytes, device=self.spec,
                                       hint="(virtual address space exhausted)")
            self._slot_low = base
        slot = _Slot(base, size)
        slot.gap_nbytes = size - span  # the segment goes at its base, the rest one gap
        self._slots.add(slot)
        return base, slot

    def _slot_changed(self, slot: _Slot) -> None:
        """A segment came into ``slot`` or left it (still holding some): its largest gap read again."""
        slot.gap_nbytes = self._space.largest_gap(slot.base, slot.base + slot.nbytes)
        self._slots.update(slot)

    def _segment_freed(self, alloc: _Allocation) -> None:
        """The segment ``alloc`` was freed: its slot gives its range back once it holds none."""
        slot = alloc.slot
        if slot is None:
            raise InternalError(f"{self.spec}: segment at {alloc.start:#x} has no slot")
        slot.n_live -= 1
        if slot.n_live:  # the gap it leaves, merged with its neighbours', may be the new largest
            lo, hi = self._space.free_run(slot.base, slot.base + slot.nbytes, alloc.start)
            if hi - lo > slot.gap_nbytes:
                slot.gap_nbytes = hi - lo
                self._slots.update(slot)
            return
        self._slots.remove(slot)
        lo, hi = slot.base, slot.base + slot.nbytes
        kept = []
        for r in self._slot_ranges:  # merge with the ranges it touches
            if r[1] == lo:
                lo = r[0]
            elif r[0] == hi:
                hi = r[1]
            else:
                kept.append(r)
        if lo == self._slot_low:
            self._slot_low = hi
        else:
            kept.append((lo, hi))
        self._slot_ranges = kept

    def _malloc_small(self, nbytes: int) -> _Allocation:
        span = align_up(nbytes, SMALL_MALLOC_ALIGNMENT)
        for page in self._small_pages:
            at = page.find_gap(span)
            if at is not None:
                break
        else:
            page_nbytes = align_up(SMALL_PAGE_NBYTES, self._gran)
            if page_nbytes > self._free_nbytes():
                raise self._oom(nbytes)
            start = self._va_alloc(page_nbytes, self._gran)
            page = _SmallPage(start, page_nbytes)
            self._space_add(start, page_nbytes, page)
            self._small_pages.append(page)
            self._take_pages(page_nbytes // self._gran)
            at = start
        alloc = _Allocation(at, nbytes, span, page)
        page.subs.add(at, at + span, alloc)
        return alloc

    def _do_free(self, alloc: _Allocation) -> None:  # type: ignore[override]
        hazard = self._sanitize_release("free", alloc.start, alloc.nbytes) if self.streams._inflight else None  # noqa: SLF001
        self._call("free", self.latency.free_us(alloc.nbytes))
        if hazard is not None:
            self._record_hazards(hazard)
        page = alloc.page
        if page is None:
            self._space.remove(alloc.start)
            self._segment_freed(alloc)
            self._give_pages(alloc.span_nbytes // self._gran)
            return
        page.subs.remove(alloc.start)
        if not page.subs:
            self._small_pages.remove(page)
            self._space.remove(page.start)
            self._give_pages(page.nbytes // self._gran)

    # -- Device: virtual memory management -----------------------------------------------------------
    def _do_address_reserve(self, nbytes: int, alignment: int) -> int:
        self._call("address_reserve", self._priced(self.latency.address_reserve_us))
        start = self._va_alloc(nbytes, max(alignment, self._gran))
        self._space_add(start, nbytes, _RESERVED)
        return start

    def _do_address_free(self, va: int, nbytes: int) -> None:
        self._call("address_free", self._priced(self.latency.address_free_cost_us(nbytes)))
        self._space.remove(va)

    def _do_mem_create(self, nbytes: int) -> SparseStore:
        cost_us = self._create_cost_us.get(nbytes)
        if cost_us is None:
            # priced at most at the card's size, as malloc is: a create past it fails, after no longer than that
            cost_us = self._create_cost_us[nbytes] = self.latency.mem_create_cost_us(
                min(nbytes, self.profile.total_nbytes))
        self._call("mem_create", self._priced(cost_us), nbytes)
        self._decide_allocation_fault(nbytes)
        if nbytes > self._free_nbytes():
            raise self._oom(nbytes)
        self._take_pages(nbytes // self._gran)
        return SparseStore(nbytes)

    def _do_mem_release(self, phys: Physical) -> None:
        nbytes = phys.handle.nbytes
        cost_us = self._release_cost_us.get(nbytes)
        if cost_us is None:
            cost_us = self._release_cost_us[nbytes] = self.latency.mem_release_cost_us(nbytes)
        if "mem_release" in self._waits_for_device:
            self._wait_until_idle()
        self._call("mem_release", self._priced(cost_us))

    def _physical_gone(self, phys: Physical) -> None:
        self._give_pages(phys.handle.nbytes // self._gran)

    def _do_mem_map(self, va: int, nbytes: int, phys: Physical, offset: int) -> None:
        if "mem_map" in self._waits_for_device:
            self._wait_until_idle()
        self._call("mem_map", self._priced(self.latency.mem_map_us))
        self._n_mappings += 1

    def _do_mem_set_access(self, va: int, nbytes: int, maps: list[Mapping]) -> None:
        if "mem_set_access" in self._waits_for_device:
            self._wait_until_idle()
        lat = self.latency
        self._call("mem_set_access", self._priced(lat.mem_set_access_us + lat.mem_set_access_mapping_us * len(maps)
                                                  + lat.mem_set_access_mib_us * nbytes / MiB))

    def _do_mem_unmap(self, r: Reservation, maps: list[Mapping]) -> None:
        va, end = maps[0].va, maps[-1].va + maps[-1].nbytes
        # nothing in flight touches memory: no hazard (what _sanitize_release finds, without the call)
        hazard = self._sanitize_release("mem_unmap", va, end - va) if self.streams._inflight else None  # noqa: SLF001
        if "mem_unmap" in self._waits_for_device:
            self._wait_until_idle()
        lat = self.latency
        self._call("mem_unmap", self._priced(lat.mem_unmap_us + lat.mem_unmap_mapping_us * len(maps)
                                             + lat.mem_unmap_mib_us * (end - va) / MiB))
        if hazard is not None:
            self._record_hazards(hazard)
        for m in maps:  # one simulated call for the whole range: all or nothing
            self._unmapped(r, m)
        self._n_mappings -= len(maps)

    # -- Device: data --------------------------------------------------------------------------------
    def _do_write(self, ptr: int, view: memoryview, pieces: list[tuple[Any, int, int]]) -> None:
        self._call("write", self.latency.copy_us(len(view), self._props.memory_bandwidth_gbps))
        pos = 0
        for holder, offset, length in pieces:
            holder.native.write(offset, view[pos:pos + length])
            pos += length

    def _do_read(self, ptr: int, nbytes: int, pieces: list[tuple[Any, int, int]]) -> bytes:
        self._call("read", self.latency.copy_us(nbytes, self._props.memory_bandwidth_gbps))
        return b"".join(holder.native.read(offset, length) for holder, offset, length in pieces)

    # -- Device: streams and events ---------------------------------------------------------------------
    def _do_synchronize(self) -> None:
        self._call("synchronize", self.latency.device_synchronize_us)
        for work in self.streams.tails():
            self._wait_for(work)

    # Note [Does a VMM call wait for the GPU?]
    # -----------------------------------------
    # CUDA does not say whether cuMemUnmap, cuMemMap, cuMemSetAccess or cuMemRelease wait for work queued on
    # the device (PyTorch's expandable segments synchronize the stream before unmapping, as "MemUnmap and
    # MemRelease do not appear to synchronize in all cases"). LatencyModel.waits_for_device names calls that
    # first run simulated time until every stream is idle (as _do_synchronize), then cost their idle cost;
    # the sanitizer looks before the wait, as CUDA promises no implicit synchronisation.
    # Measured on the H200 (hil/probes/vmm_stall.py, reports/hil/vmm-stall-h200-2026-11-25.md): none waits.
    # With 20 ms of work queued (one stream, a deep queue, three streams) unmap (also of the page the running
    # kernel wrote), map, set access, create, release, reserve and free all returned before the work ended
    # (825 of 825), costing 0-47 us more than idle; a kernel of fixed work ran as long with 586 steals made
    # under it, and 3,000 short kernels took 0.2 % longer with 1,000 steals made between their launches.
    # So waits_for_device stays empty by default; it remains for what-if studies (sim/unmap_stall.py,
    # reports/sim-unmap-stall.md: a drain per call over-predicted MoE and ViT and missed half of GPT-2 C).
    # What a call costs instead is its busy price: with 1,000-3,000 mappings held a busy device makes a steal
    # 142-157 us against 52-62 idle (LatencyModel.as_measured(), Note [A busy device prices VMM calls higher]
    # in gpumem.sim.latency; the step time that predicts: reports/sim-step-time.md).
    def _wait_until_idle(self) -> None:
        """A VMM call of :attr:`LatencyModel.waits_for_device`: run simulated time until no stream has
        queued or running work (Note [Does a VMM call wait for the GPU?]); counted in :attr:`stats`."""
        start_s = self._clock.now
        tails = [w for w in self.streams.tails() if w.state != DONE]
        if not tails:
            return
        try:
            for work in tails:
                self._wait_for(work)
        finally:   # counted, and not a pause before the call (Note [A cold VMM call costs more]), if interrupted too
            waited_s = self._clock.now - start_s
            self.stats.device_waits += 1
            self.stats.device_wait_s += waited_s
            if self._vmm_end_s is not None:
                self._vmm_end_s += waited_s

    def _wait_for(self, work: Work | None) -> None:
        """Run simulated time until ``work`` has finished (tenants and other streams act meanwhile)."""
        if work is None or work.state == DONE:
            return
        self._clock.wait(work.done_event)
        if work.state != DONE:  # never seen: the event triggers only after the state moved
            raise InternalError(f"{self.spec}: {work!r} not done after its event")
        if self._lost:
            raise DeviceLostError(self._lost_message())

    def _do_stream_create(self) -> int:
        self._call("stream_create", self.latency.stream_create_us)
        while self._next_stream in self._user_streams or self.streams.known(self._next_stream):
            self._next_stream += 1  # skip ids foreign code already queued work on
        stream = self._next_stream
        self._next_stream += 1
        return stream

    def _do_stream_destroy(self, stream: int) -> None:
        # like cudaStreamDestroy: returns at once; work queued on the stream still runs to its end
        self._call("stream_destroy", self.latency.stream_destroy_us)

    def _do_event_record(self, stream: int) -> SimEvent:
        self._call("event_record", self.latency.event_record_us)
        st = self.streams._streams.get(stream)  # noqa: SLF001 - StreamEngine.tail(), inlined: a hot call
        tail = None if st is None else st.tail
        return SimEvent(self, stream, tail if tail is not None and tail.state != DONE else None)

    def _do_event_query(self, event: SimEvent) -> bool:
        self._call("event_query", self.latency.event_query_us)
        work = event.work
        return work is None or work.state == DONE

    def _do_event_synchronize(self, event: SimEvent) -> None:
        self._call("event_synchronize", self.latency.synchronize_us)
        work = event.work
        if work is not None and work.state != DONE:
            self._wait_for(work)

    def _do_event_destroy(self, event: SimEvent) -> None:
        self._call("event_destroy", self.latency.event_destroy_us)

    def _do_stream_synchronize(self, stream: int) -> None:
        self._call("stream_synchronize", self.latency.synchronize_us)
        if stream in self.streams._streams:  # noqa: SLF001 - an idle stream has no entry: nothing to wait for
            self._wait_for(self.streams.tail(stream))

    def _do_stream_wait_event(self, stream: int, event: SimEvent) -> None:
        self._call("stream_wait_event", self.latency.stream_wait_event_us)
        if not event.complete:
            self.streams.launch(stream, f"wait for an event on stream {event.stream}", 0.0, (), event.work)

    def launch(self, stream: int, duration_s: float, touches: Sequence[tuple[int, int]] = (),
               name: str | None = None) -> Work:
        """Queue work (a kernel) on ``stream`` that runs ``duration_s`` simulated seconds once the work
        before it there has finished, and reads and writes the ``(ptr, nbytes)`` ranges ``touches``
        from the moment it is queued until it ends.

        Every touched range must lie inside one live ``malloc`` allocation or inside mappings with
        access set; otherwise the sanitizer raises :class:`~gpumem.errors.MemoryHazardError`
        (``sanitizer="raise"``). Returns the :class:`~gpumem.sim.streams.Work` (its ``state``, ``end_s``).
        """
        self._refuse_under_twin("launch")
        stream = check_stream(stream)
        duration_s = check_duration(duration_s, what="launch: duration_s")
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError(f"launch: name must be a str or None, got {type(name).__name__}")
        ranges: list[tuple[int, int]] = []
        try:
            for touch in touches:
                ptr, nbytes = touch
                ranges.append((check_pointer(ptr, what="touch pointer"), check_nbytes(nbytes, what="touch nbytes")))
        except (TypeError, ValueError) as exc:
            if isinstance(exc, InvalidArgumentError):
                raise
            raise InvalidArgumentError("launch: touches must be a sequence of (ptr, nbytes) pairs") from None
        return self._run(self._launch, stream, duration_s, ranges, name)

    def wait_work(self, work: Work) -> None:
        """Let simulated time run until ``work`` (from :meth:`launch`) has finished, as a host blocked on
        it would (tenants, faults and other streams act meanwhile). No device call is counted: a replay's
        program waiting on its own launch queue (:mod:`gpumem.sim.gpu_work`)."""
        if not isinstance(work, Work):
            raise InvalidArgumentError(f"wait_work: expected a Work from launch(), got {type(work).__name__}")
        self._run(self._wait_for, work)

    def order_streams(self, stream: int, waited: int) -> Work | None:
        """Work queued on ``stream`` from now on starts only after the work queued on ``waited`` so far has
        finished, as after ``cudaStreamWaitEvent(stream, event recorded on waited)``: a zero-length marker
        on ``stream`` that waits for ``waited``'s last unfinished work (returned), or None when there is
        nothing to wait for (``waited`` idle, or ``stream == waited``). No device call is counted, as in
        :meth:`wait_work`: a replay's program ordering its own streams (Note [Cross-stream waits] in
        :mod:`gpumem.sim.gpu_work`)."""
        stream = check_stream(stream)
        waited = check_stream(waited, what="waited")
        return self._run(self._order_streams, stream, waited)

    def _order_streams(self, stream: int, waited: int) -> Work | None:
        self._check_usable()
        tail = self.streams.tail(waited)
        if tail is None or stream == waited:
            return None
        return self.streams.launch(stream, f"wait for stream {waited}", 0.0, (), tail)

    def _launch(self, stream: int, duration_s: float, ranges: list[tuple[int, int]], name: str | None) -> Work:
        self._check_usable()
        self._check_finite_time("launch", duration_s)
        label = name if name is not None else f"work {self.stats.calls.get('launch', 0) + 1}"
        hazards: list[Hazard] = []
        phys: list[PhysicalPiece] = []   # Note [Physical aliasing] in gpumem.sim.streams
        if self.sanitizer != "off":
            for ptr, nbytes in ranges:
                try:
                    pieces = self._book.locate(ptr, nbytes, "launch")
                except InvalidPointerError as exc:
                    hazards.append(self._hazard(Hazard(self.now_s, "launch", stream, ptr, nbytes, label,
                                        f"work {label!r} on stream {stream} touches [{ptr:#x}, {ptr + nbytes:#x}), "
                                        f"which is not allocated or not mapped with access ({exc})")))
                    continue
                va = ptr
                for record, offset, n in pieces:
                    if isinstance(record, Physical):
                        phys.append(PhysicalPiece(record, offset, n, va))
                    va += n
        self._call("launch", self.latency.launch_us)
        self._record_hazards(*hazards)
        return self.streams.launch(stream, label, duration_s, ranges, phys=phys)

    def _alias_seen(self, work: Work, other: Work, theirs: PhysicalPiece, ours: PhysicalPiece) -> None:
        """StreamEngine.on_alias: ``work``, just launched, may run beside unfinished ``other`` on the same physical
        bytes through another address, nothing ordering it after (Note [Physical aliasing] in
        :mod:`gpumem.sim.streams`). The hazard is recorded, and in ``raise`` mode the next device call raises it."""
        lo = max(ours.offset, theirs.offset)
        hi = min(ours.offset + ours.nbytes, theirs.offset + theirs.nbytes)
        va, other_va = ours.va + lo - ours.offset, theirs.va + lo - theirs.offset
        hazard = Hazard(self.now_s, "alias", work.stream, va, hi - lo, work.name,
                        f"work {work.name!r} on stream {work.stream} touches [{va:#x}, {va + hi - lo:#x}) while "
                        f"{other.state_name} work {other.name!r} on stream {other.stream} touches the same physical "
                        f"bytes through [{other_va:#x}, {other_va + hi - lo:#x}): a chunk was mapped again before its "
                        f"old work ended, and nothing orders the new work after it")
        self._record_hazards(hazard)
        if self.sanitizer == "raise" and self._pending_error is None:
            self._pending_error = hazard.to_error()   # the next call raises it (Device._check_usable)

    def _sanitize_release(self, call: str, va: int, nbytes: int) -> Hazard | None:
        """Before ``free`` or ``mem_unmap`` of ``[va, va + nbytes)``: is in-flight work touching it?
        Raises in ``raise`` mode; returns the hazard to record in ``count`` mode."""
        if self.sanitizer == "off":
            return None
        hit = self.streams.touching(va, nbytes)
        if hit is None:
            return None
        work, ptr, n = hit
        return self._hazard(Hazard(self.now_s, call, work.stream, va, nbytes, work.name,
                            f"[{va:#x}, {va + nbytes:#x}) is touched by {work.state_name} work {work.name!r} on stream "
                            f"{work.stream} (its range [{ptr:#x}, {ptr + n:#x})); wait for it first "
                            f"(event_synchronize / stream_synchronize)"))

    def _hazard(self, hazard: Hazard) -> Hazard:
        """Raise ``hazard`` in ``raise`` mode; in ``count`` mode return it, for :meth:`_record_hazards`
        once the call goes ahead (a call that then fails, e.g. by an injected fault, did not do the
        hazardous thing: recording it would count a retry twice)."""
        if self.sanitizer == "raise":
            raise hazard.to_error()
        return hazard

    def _record_hazards(self, *hazards: Hazard | None) -> None:
        for hazard in hazards:
            if hazard is not None:
                self.hazards.append(hazard)
                log.debug("%s: hazard %s", self.spec, hazard.message)

    # -- life cycle -------------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Before ``close`` frees anything: run simulated time until every stream is idle, as a program
        calls ``cudaDeviceSynchronize`` before tearing down (freeing memory that queued or running work
        touches is the hazard the sanitizer exists for). A lost device's work is gone: no wait."""
        while not self._lost:
            tails = [w for w in self.streams.tails() if w.state != DONE]
            if not tails:
                return
            for work in tails:
                if work.state != DONE and not self._lost:
                    self._clock.wait(work.done_event)

    def _read(self, ptr: int, nbytes: int) -> bytes:
        self._refuse_under_twin("read")
        return super()._read(ptr, nbytes)

    def _write(self, ptr: int, view: memoryview) -> None:
        self._refuse_under_twin("write")
        super()._write(ptr, view)

    def _do_close(self) -> None:
        twins, self._twins = self._twins, []
        for on_close in twins:  # C++ only (the twin's flag): safe under the device's lock
            on_close()
        self._drain()
        if self._pending_error is not None:   # no call comes after close to raise it: said here
            log.warning("%s closed with an error no call raised: %s", self.spec, self._pending_error)
            self._pending_error = None
        self._small_pages.clear()
        self._space.clear()
        self._slots.clear()
        self._slot_ranges.clear()
        self._slot_low = _VA_LIMIT
        self._process_pages = 0
        self._n_mappings = 0

    # -- introspection for tests and reports ----------------------------------------------------------------
    def accounting(self) -> tuple[int, int, int]:
        """``(process_pages, tenant_pages, live allocations + live handles)``: what tests compare
        before and after a failing call."""
        with self._lock:
            return (self._process_pages, self._tenant_pages,
                    len(self._book.allocations) + len(self._book.physicals))

    def _check_device_invariants(self) -> None:
        def require(ok: bool, what: str) -> None:
            if not ok:
                raise InternalError(f"{self.spec}: {what}")

        self._space.check()
        book = self._book
        pages = 0
        for start, end, what in self._space.items():
            if isinstance(what, _Allocation):
                require(book.allocations.get(start) is what, f"allocation at {start:#x} not in the book")
                pages += what.span_nbytes // self._gran
            elif isinstance(what, _SmallPage):
                require(bool(what.subs), f"empty small page kept at {start:#x}")
                what.subs.check()
                for s, _, sub in what.subs.items():
                    require(book.allocations.get(s) is sub, f"small allocation at {s:#x} not in the book")
                pages += what.nbytes // self._gran
            else:
                require(start in book.reservations and book.reservations.end_of(start) == end,
                        f"reservation at {start:#x} not in the book")
        # Note [Where the driver places a segment]: each segment in its slot, each slot counting its segments and
        # knowing its largest gap; nothing else among the slots; the ranges slots gave back free (one walk of the
        # address space)
        live_in: dict[int, int] = {}
        slot_ids = {id(s) for s in self._slots}
        for start, end, what in self._space.items():
            if isinstance(what, _Allocation):
                slot = what.slot
                require(slot is not None and slot.base <= start and end <= slot.base + slot.nbytes
                        and id(slot) in slot_ids, f"segment at {start:#x} outside its slot")
                live_in[id(slot)] = live_in.get(id(slot), 0) + 1
            else:
                require(end <= self._slot_low, f"a reservation or small page among the slots at {start:#x}")
        self._slots.check()
        for slot in self._slots:
            require(slot.n_live == live_in.get(id(slot), 0) > 0
                    and slot.gap_nbytes == self._space.largest_gap(slot.base, slot.base + slot.nbytes)
                    and slot.base >= self._slot_low, f"slot at {slot.base:#x}: its count or gap is wrong")
        require(all(self._slot_low <= lo < hi <= _VA_LIMIT and self._space.find_gap(lo, hi, hi - lo) == lo
                    for lo, hi in self._slot_ranges), "a range given back by a slot is not free")
        require(len(book.reservations) == sum(1 for *_, w in self._space.items() if w == _RESERVED),
                "the book has reservations the address space lacks")
        require(len(book.allocations) == sum(len(p.subs) for p in self._small_pages)
                + sum(1 for *_, w in self._space.items() if isinstance(w, _Allocation)),
                "the book has allocations the address space lacks")
        pages += sum(p.handle.nbytes // self._gran for p in book.physicals.values())
        require(pages == self._process_pages, f"{pages} pages held, {self._process_pages} counted")
        require(self._free_nbytes() >= 0, f"negative free memory {self._free_nbytes()}")
        mapped = sum(len(r.mappings) for r in book.reservations.values())
        require(mapped == self._n_mappings, f"{mapped} mappings in the book, {self._n_mappings} counted")
        if self.sanitizer == "raise" and not self._closed:
            for work in self.streams.inflight:
                for ptr, n in work.touches:
                    try:
                        self._book.locate(ptr, n, "check_invariants")
                    except InvalidPointerError as exc:
                        raise InternalError(f"{self.spec}: in-flight {work!r} touches memory that is gone: {exc}") \
                            from None
