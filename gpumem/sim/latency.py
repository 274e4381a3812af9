"""How long each simulated device call takes.

Note [Latency calibration]
--------------------------
The figures below, and the runs they come from, are in ``reports/sim-latency-model.md``: the
geometric mean of three calibrations of the H200 we test on (``sim/calibrate.py``;
``python -m sim.fit_latency FILE...`` prints the table and the fits). Why a geometric mean:
the same call took up to 2.7x longer in one run than in another (the host's load and clock, the
driver's state), so a model fitted to one run was up to 2.9x off on the next; the geometric mean is
the figure whose largest ratio to any run is smallest.

* Driver calls were timed from Python through cuda-bindings; the binding's own cost (a call that
  does nothing) is taken off each, since the native engine calls the driver directly. The runtime
  calls (``cudaMalloc``, ``cudaFree``, ``cudaMemGetInfo``) are as CuPy sees them.
* A cost that grows with the size (``cudaMalloc`` + ``cudaFree`` pairs, ``cuMemCreate``,
  ``cuMemRelease``, ``cuMemAddressFree``) is interpolated linearly between the measured sizes and
  extrapolated with the last slope; a pair is split between its two calls by
  :attr:`LatencyModel.malloc_share`.
* ``cuMemSetAccess`` and ``cuMemUnmap`` cost a fixed part, a part per mapping and a part per MiB:
  one call over many mappings saves almost nothing over one call each.
* Not measured yet, estimates: a kernel launch (``launch_us``) and the fixed cost of a copy
  (``copy_launch_us``); copies then run at the profile's bandwidth.
* The same driver costs serve every profile: they are host-side driver work, and no other card was
  measured (an H100 runs the same driver on the same kind of host).
* The costs above were measured on an idle device. A VMM call made while the device has queued or
  running work costs more, the more so the more mappings the context holds: Note [A busy device
  prices VMM calls higher] below. Whether a VMM call also *waits* for the device's queued work is
  :attr:`LatencyModel.waits_for_device` (Note [Does a VMM call wait for the GPU?] in
  :mod:`gpumem.sim.device`); by default none does, as measured.

Note [A busy device prices VMM calls higher]
--------------------------------------------
The VMM probe (``hil/probes/vmm_stall.py``, ``reports/hil/vmm-stall-h200-2026-11-25.md``) timed each
VMM call on an idle H200 and with 20 ms of work queued, holding a handful of mappings, 1,000 or 3,000.
No call waits for the queue, but a busy device makes calls dearer, and more so with many mappings
held: a steal (unmap + map + set access) 52-62 µs idle at every count, 79-85 µs busy with a handful,
142-157 µs busy with 1,000-3,000. So a call of :data:`BUSY_PRICED_CALLS` made while any stream has
unfinished work costs its idle cost times :meth:`LatencyModel.busy_factor`::

    factor(n) = busy_factor_base + busy_factor_per_decade * log10(1 + n)      (n: mappings held)

a factor of the idle cost (the probe's single calls idle are 1-4x the model's, as between calibrations,
so its busy/idle *ratio* is what carries over; the model's idle steal, 53 µs, is the probe's 52-62).
Fitted (``python -m sim.fit_busy_latency``, ``reports/sim-latency-model.md``) on the fit part: the
one-kernel queue with a handful held (taken as n = 2) and with 3,000; at each, the geometric mean of
the busy/idle ratios of the steal and the five calls an allocator makes (unmap, map, set access,
create, release), 1.34x and 2.32x, and the line through the two. Checked on the rest: the 1,000-held
run (geometric mean 2.18x, model 2.17x; its steal 3.03x, model 2.17x) and the deep and three-stream
queues (1.22x and 1.24x, model 1.34x). Why a log: the cost grows with the mappings held, far less
than in proportion (3,000 cost no more than 1,000); the data have no point between 2 and 1,000, and
the steal cost more with 1,000 held than with 3,000, so the curve is a trend, not a law.
Event and stream calls keep their idle price (the model's 0.35-0.9 µs; the probe: ~2x busy with
1,000 held, a few µs).

Off by default (``busy_factor_base=1, busy_factor_per_decade=0``: every call priced idle);
:meth:`LatencyModel.as_measured` turns it on. Why not the default: dearer calls move the CPU's clock,
so fences complete at other points of a trace-timed replay and its memory figures move (GPT-2 under C
1.62 -> 1.81 %, live 1.73 %; ResNet-50 under C 0.90 -> 1.04 %, live 0.87 %; the shared gpt2_train
under the default policy 5.68 -> 5.64 %), and against every traced live run they predict memory no
better (``reports/sim-predict-live.md``: 0.101 pp mean error on the tuning rows at 2 ms against 0.088
priced idle, 3.73 against 2.55 on the check rows). ``idle`` timing never sees a busy device: unchanged.

Note [The engine's own time]
----------------------------
The simulated clock used to move only through device calls, so the engine's decisions took no time. Live they do:
in four gpumem.torch servers on the H200, whose every driver call was timed
(``reports/hil/where-replays-part-2026-11-30.md`` §5, the tuning part), a steal's first fence record came 29-34 µs
(median) after the op began, a growth's first call 4.6 µs after. The same engine on this project's CPU shows where
the difference goes: indexing the pages that fell empty since its last look (freed, or mapped by a steal and not
yet taken; ``_idle_refresh``, Note [An index of idle chunks] in :mod:`gpumem.allocator.backing`), 1,300 pages at
the median. A replay whose fence is asked at once finds pending what live, asked 30 µs later, found done, and
grows where live stole (the first difference of both b16 servers, op 3,088). So both engines tell the device how
many pages they index (:meth:`gpumem.device.Device.engine_work`, the same count in both: the differential test
records it), and the simulator lets ``engine_index_us * ln(1 + pages / engine_index_pages)`` pass. Fitted on the
105 steals of the two call logs that timed fence records, less the 4.6 µs every slow op takes (the scale that
minimises the median absolute error, the height its median ratio; over walks of 1 to 24,873 pages: 17.1 µs and 274
pages; median error 5.5 µs). Why a log: the time grows with the pages far less than in proportion (36 ns a page at
261 pages, 3.6 at 17,000), as pages freed together lie together in memory; a line misses the small walks by 10 µs,
a square root the large ones by 36. The 4.6 µs is left out: every slow op takes it, and none of the replays'
differences is a growth asked 4 µs late.

The same logs price ``cuMemUnmap`` inside the program at twice its calibration on an idle device (1,741 unmaps:
38.9 µs at the median, 2.00x the model's 19.4 per mapping, 1.98x its 19.6 for a 2 MiB page), so
:attr:`LatencyModel.mem_unmap_mapping_us` is the in-program figure, 38.7 (with 0.10 per MiB: 38.9 for a 2 MiB
page). The other VMM calls cost what the calibration says there (create 1.0-1.5x, map 0.45-0.75x, set access
0.86-1.3x). A real device's time passes by itself: ``engine_work`` does nothing there.

Note [A cold VMM call costs more]
--------------------------------
The calibration timed each call in a loop, each right after the last. Inside a program a VMM call mostly comes
after the program's own work, and then costs more: found first in the four ``ct-`` servers' call logs
(``reports/hil/workloads-today-h200-2026-11-30.md`` §5), timed again in three training runs without step plans
(GPT-2, MoE, ResNet-50; ``reports/hil/engine-time-training-h200-2026-12-02.md``). Over those seven tuning logs a
create, map, unmap or release made within 5 µs of the previous VMM call costs its warm price, one after 2-5 ms 56 µs
more at the median, after 50 ms or more 111 µs more. So a call of :data:`BUSY_PRICED_CALLS` made ``gap`` µs after
the previous one of them ended costs ``cold_vmm_us * ln(1 + gap / cold_vmm_gap_us)`` more: 18 µs and 150 µs, fitted
on those logs (least absolute error, each run alike; median error 6.9 µs against 13.6 without, on the check run 4.3
against 5.0). The fit covers creates, maps, unmaps and releases; set access and the address calls take the term by
extension, and that other calls (events, ``mem_info``) do not warm the path is a choice, not a measurement. It does
not explain every slow call: at the op where a Llama replay parted from live, another run's live create cost 61 µs
(11 µs of price and about 50 of term) and the map right after it 55 µs, which no term here gives.
Off by default (:data:`MEASURED_COLD_VMM_US` holds the fit). The shipped unmap price (38.7 µs, Note [The engine's
own time]) is the median of warm and cold unmaps together: with the term, the logs' model prices unmaps at their warm
30.2 µs a mapping (the tuning runs' warm median, 30.4 µs, less a 2 MiB page's 0.2). Replayed on their GPU clocks
(that record, §3), that model predicts the tuning rows better than the shipped one and the check rows worse; the term
on the shipped unmap (cold unmaps counted twice) is better on both, but a model whose parts the logs contradict is
not adopted for its totals, as in the first study. Under the default ``trace`` timing the term gains nothing (the
engine's own time is already in the trace's gaps). The idle twin does not price it and refuses such a device.

Simulated time only moves the SimPy clock; nothing sleeps for real.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Sequence

from gpumem.errors import InvalidArgumentError
from gpumem.validate import check_int_in_range
from gpumem.units import GiB, MiB

#: The device calls :attr:`LatencyModel.waits_for_device` may name: the virtual-memory calls.
VMM_CALLS = ("mem_map", "mem_set_access", "mem_unmap", "mem_release")
#: The calls that cost :meth:`LatencyModel.busy_factor` times their idle cost on a busy device
#: (Note [A busy device prices VMM calls higher]).
BUSY_PRICED_CALLS = ("mem_create", "mem_release", "mem_map", "mem_set_access", "mem_unmap", "address_reserve",
                     "address_free")

Points = tuple[tuple[int, float], ...]

#: The busy-device terms fitted on the VMM probe (``python -m sim.fit_busy_latency``), for
#: :meth:`LatencyModel.as_measured` (Note [A busy device prices VMM calls higher]).
MEASURED_BUSY_FACTOR_BASE = 1.18
MEASURED_BUSY_FACTOR_PER_DECADE = 0.33
#: The cold-call term fitted on the live call logs of seven tuning runs, for :attr:`LatencyModel.cold_vmm_us` (its
#: scale, :attr:`LatencyModel.cold_vmm_gap_us`, defaults to the fitted 150 µs; Note [A cold VMM call costs more]).
MEASURED_COLD_VMM_US = 18.0


def _real(knob: str, value: object, low: float, high: float = math.inf) -> float:
    """``value`` as a plain float, if it is a real number (numpy's too, not a bool) that is finite and within
    ``[low, high]``; else InvalidArgumentError naming ``LatencyModel.knob``."""
    try:
        got = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except Exception:  # noqa: BLE001 - an int past any float, or a __float__ that raises: not a number we can use
        got = math.nan
    if not (math.isfinite(got) and low <= got <= high):
        bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise InvalidArgumentError(f"LatencyModel.{knob} must be a finite number {bounds}, not {value!r:.60}")
    return got


def interpolate_us(points: Points, nbytes: int, sizes: Sequence[int] | None = None) -> float:
    """The cost at ``nbytes`` on the piecewise-linear curve through ``points`` (``(nbytes, µs)``, sizes
    increasing): the first point's cost below it, the last segment's slope beyond the last point.
    ``sizes``: the points' sizes, if the caller keeps them."""
    if nbytes <= points[0][0]:
        return points[0][1]
    i = bisect.bisect_right(sizes if sizes is not None else [p[0] for p in points], nbytes)
    if i >= len(points):
        (s0, c0), (s1, c1) = points[-2], points[-1]
    else:
        (s0, c0), (s1, c1) = points[i - 1], points[i]
    return c0 + (c1 - c0) * (nbytes - s0) / (s1 - s0)


@dataclass(frozen=True)
class LatencyModel:
    """Simulated cost of each device call, in microseconds (Note [Latency calibration]).

    The defaults price every call as calibrated, warm and on an idle device. Optional terms, each off by default:
    ``waits_for_device`` (VMM calls that wait for queued work), the busy factor (:meth:`as_measured`; Note [A busy
    device prices VMM calls higher]) and the cold-call term (``cold_vmm_us``; Note [A cold VMM call costs more])::

        import dataclasses
        from gpumem.sim import SimDevice, get_profile
        from gpumem.sim.latency import MEASURED_COLD_VMM_US, LatencyModel
        profile = get_profile("h200-141gb")
        lat = LatencyModel(cold_vmm_us=MEASURED_COLD_VMM_US, mem_unmap_mapping_us=30.2)   # unmaps at their warm price
        dev = SimDevice(dataclasses.replace(profile, latency=lat))
    """

    malloc_free_points: Points = ((0, 84.6), (1 * MiB, 84.6), (64 * MiB, 152.0), (1 * GiB, 641.4))
    malloc_share: float = 0.6
    mem_get_info_us: float = 5.8
    get_properties_us: float = 1257.0
    address_reserve_us: float = 2.8
    address_free_points: Points = ((1 * GiB, 2.8), (1024 * GiB, 5.1))
    mem_create_points: Points = ((2 * MiB, 10.7), (32 * MiB, 11.1), (256 * MiB, 16.5), (1 * GiB, 60.8))
    mem_release_points: Points = ((2 * MiB, 12.1), (32 * MiB, 25.4), (256 * MiB, 118.7), (1 * GiB, 437.2))
    mem_map_us: float = 2.1
    mem_set_access_us: float = 1.5
    """Per call; plus :attr:`mem_set_access_mapping_us` per mapping and :attr:`mem_set_access_mib_us` per MiB."""
    mem_set_access_mapping_us: float = 29.5
    mem_set_access_mib_us: float = 0.18
    mem_unmap_us: float = 0.0
    """Per call; plus :attr:`mem_unmap_mapping_us` per mapping and :attr:`mem_unmap_mib_us` per MiB."""
    mem_unmap_mapping_us: float = 38.7
    """Inside a program: twice the 19.4 measured on an idle device (Note [The engine's own time])."""
    mem_unmap_mib_us: float = 0.10
    copy_launch_us: float = 8.0
    synchronize_us: float = 0.7
    """``cudaStreamSynchronize`` / ``cudaEventSynchronize`` with nothing left to wait for."""
    device_synchronize_us: float = 0.8
    """``cudaDeviceSynchronize`` with nothing left to wait for."""
    stream_create_us: float = 2.8
    stream_destroy_us: float = 2.0
    event_record_us: float = 0.9
    event_query_us: float = 0.35
    event_destroy_us: float = 0.4
    stream_wait_event_us: float = 0.8
    launch_us: float = 4.0  # an estimate (see the Note above)
    waits_for_device: frozenset[str] = frozenset()
    """The VMM calls (of :data:`VMM_CALLS`) that first wait until every stream's queued work is done, as a
    ``cudaDeviceSynchronize`` would, then cost what they cost on an idle device (Note [Does a VMM call wait
    for the GPU?] in :mod:`gpumem.sim.device`). Empty (the default): none waits. A tuple or list of names
    is taken as a frozenset."""
    busy_factor_base: float = 1.0
    """A call of :data:`BUSY_PRICED_CALLS` on a busy device costs its idle cost times :meth:`busy_factor`:
    this, plus :attr:`busy_factor_per_decade` per decade of mappings held (Note [A busy device prices VMM
    calls higher]). At least 1. The default, 1 (with no term per decade), prices every call idle, as
    before; :meth:`as_measured` holds the fitted terms."""
    busy_factor_per_decade: float = 0.0
    """Added to the busy factor per decade of ``1 + mappings held``; at least 0."""
    engine_index_us: float = 17.1
    """Not a device call: the allocator's own CPU time before it steals a page, ``engine_index_us * ln(1 +
    pages / engine_index_pages)`` for the pages it indexes first, which the engine reports through
    :meth:`gpumem.device.Device.engine_work` (Note [The engine's own time]); at least 0."""
    engine_index_pages: float = 274.0
    """The scale of :attr:`engine_index_us`'s curve, in pages; at least 1."""
    cold_vmm_us: float = 0.0
    """A call of :data:`BUSY_PRICED_CALLS` made ``gap`` µs after the previous one of them ended costs
    ``cold_vmm_us * ln(1 + gap / cold_vmm_gap_us)`` more, added after the busy factor (fitted over the live warm
    price), growing without bound but slowly (about 158 µs at a 1 s gap; measured to 111-117 µs past 20 ms); a wait
    for the device the call itself makes (:attr:`waits_for_device`) is not part of the gap (Note [A cold VMM call
    costs more]); at least 0."""
    cold_vmm_gap_us: float = 150.0
    """The scale of :attr:`cold_vmm_us`'s curve, in µs; at least 1."""

    def __post_init__(self) -> None:
        # every cost and term is kept as a plain float, checked first: a numpy float32 or a float subclass would
        # carry its arithmetic into the simulated clock
        lows = {"busy_factor_base": 1.0, "engine_index_pages": 1.0, "cold_vmm_gap_us": 1.0}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_points"):
                if not isinstance(value, tuple) or not value or not all(
                        isinstance(p, tuple) and len(p) == 2 for p in value):
                    raise InvalidArgumentError(f"LatencyModel.{f.name} must be a non-empty tuple of (nbytes, µs) "
                                               f"pairs, not {value!r:.60}")
                object.__setattr__(self, f.name, tuple((n, _real(f"{f.name} cost", c, 0.0)) for n, c in value))
            elif f.type in ("float", float):   # the annotation, as a string (postponed) or not
                high = 1.0 if f.name == "malloc_share" else math.inf
                object.__setattr__(self, f.name, _real(f.name, value, lows.get(f.name, 0.0), high))
        # a walk's time stays finite: at most engine_index_us * ln(1 + 2**63), 44x it; so does a cold call's extra
        for knob in ("engine_index_us", "cold_vmm_us"):
            if getattr(self, knob) * math.log1p(2.0**63) > 1e12:
                raise InvalidArgumentError(f"LatencyModel.{knob} must be at most {1e12 / math.log1p(2.0**63):.3g} "
                                           f"µs, not {getattr(self, knob)!r}")
        waits = self.waits_for_device
        if isinstance(waits, (tuple, list)):
            waits = frozenset(waits)
        if not isinstance(waits, frozenset):
            raise InvalidArgumentError(f"LatencyModel.waits_for_device must be a frozenset of call names "
                                       f"({', '.join(VMM_CALLS)}), not {type(waits).__name__}")
        unknown = sorted(repr(w) for w in waits if w not in VMM_CALLS)
        if unknown:
            raise InvalidArgumentError(f"LatencyModel.waits_for_device: {', '.join(unknown)} is not a VMM call; "
                                       f"choose among {', '.join(VMM_CALLS)}")
        object.__setattr__(self, "waits_for_device", waits)
        # the sizes of the malloc curve, kept: malloc and free interpolate it on every call
        object.__setattr__(self, "_malloc_sizes", tuple(p[0] for p in self.malloc_free_points))

    @classmethod
    def as_measured(cls, **overrides: object) -> "LatencyModel":
        """The model with the busy-device terms fitted on the VMM probe (:data:`MEASURED_BUSY_FACTOR_BASE`,
        :data:`MEASURED_BUSY_FACTOR_PER_DECADE`; Note [A busy device prices VMM calls higher]); ``overrides``
        set other fields."""
        fields = {"busy_factor_base": MEASURED_BUSY_FACTOR_BASE,
                  "busy_factor_per_decade": MEASURED_BUSY_FACTOR_PER_DECADE, **overrides}
        return cls(**fields)  # type: ignore[arg-type]

    def busy_factor(self, n_mappings: int) -> float:
        """What a call of :data:`BUSY_PRICED_CALLS` costs on a busy device with ``n_mappings`` mappings held,
        as a multiple of its idle cost (Note [A busy device prices VMM calls higher]): at least 1, and never
        lower with more mappings."""
        if isinstance(n_mappings, bool) or not isinstance(n_mappings, int) or n_mappings < 0:
            raise InvalidArgumentError(f"busy_factor: n_mappings must be an int >= 0, not {n_mappings!r}")
        return self.busy_factor_base + self.busy_factor_per_decade * math.log10(1 + n_mappings)

    def engine_index_cost_us(self, pages_indexed: int) -> float:
        """The engine's CPU time to index ``pages_indexed`` pages before a steal (Note [The engine's own time]).

        Raises:
            InvalidArgumentError: ``pages_indexed`` is not an integer in ``[0, 2**63)``.
        """
        if pages_indexed.__class__ is not int or not 0 <= pages_indexed < 1 << 63:
            pages_indexed = check_int_in_range(pages_indexed, "engine_index_cost_us: pages_indexed", 0, (1 << 63) - 1)
        return self._engine_index_cost_us(pages_indexed)

    def _engine_index_cost_us(self, pages_indexed: int) -> float:
        """:meth:`engine_index_cost_us` of a count already checked (``Device.engine_work`` checked it)."""
        return self.engine_index_us * math.log1p(pages_indexed / self.engine_index_pages)

    def cold_vmm_cost_us(self, gap_us: float) -> float:
        """What a VMM call made ``gap_us`` after the previous one ended costs beyond its price (Note [A cold VMM
        call costs more]): 0 for a gap of 0 or less (or NaN), or when :attr:`cold_vmm_us` is 0. The gap is capped at
        2**63 µs, so the extra stays finite.

        Raises:
            InvalidArgumentError: ``gap_us`` is not a real number (a bool is not one).
        """
        if isinstance(gap_us, bool) or not isinstance(gap_us, numbers.Real):
            raise InvalidArgumentError(f"cold_vmm_cost_us: gap_us must be a real number, not {gap_us!r:.60}")
        try:
            gap = float(gap_us)
        except OverflowError:   # past any float: as far as it goes
            gap = math.inf if gap_us > 0 else -math.inf
        except Exception as exc:  # noqa: BLE001 - a __float__ that raises
            raise InvalidArgumentError(f"cold_vmm_cost_us: gap_us must be a real number, not {gap_us!r:.60}") from exc
        return self._cold_vmm_cost_us(gap)

    def _cold_vmm_cost_us(self, gap_us: float) -> float:
        """:meth:`cold_vmm_cost_us` of a float gap (the device's clock)."""
        if not self.cold_vmm_us or not gap_us > 0:
            return 0.0
        return self.cold_vmm_us * math.log1p(min(gap_us, 2.0**63) / self.cold_vmm_gap_us)

    def malloc_free_us(self, nbytes: int) -> float:
        """Cost of a ``cudaMalloc`` + ``cudaFree`` pair of ``nbytes``."""
        return interpolate_us(self.malloc_free_points, nbytes, self._malloc_sizes)  # type: ignore[attr-defined]

    def malloc_us(self, nbytes: int) -> float:
        return self.malloc_free_us(nbytes) * self.malloc_share

    def free_us(self, nbytes: int) -> float:
        return self.malloc_free_us(nbytes) * (1.0 - self.malloc_share)

    def mem_create_cost_us(self, nbytes: int) -> float:
        """Cost of a ``cuMemCreate`` of ``nbytes``."""
        return interpolate_us(self.mem_create_points, nbytes)

    def address_free_cost_us(self, nbytes: int) -> float:
        """Cost of a ``cuMemAddressFree`` of a range of ``nbytes``."""
        return interpolate_us(self.address_free_points, nbytes)

    def mem_release_cost_us(self, nbytes: int) -> float:
        """Cost of a ``cuMemRelease`` of a chunk of ``nbytes``."""
        return interpolate_us(self.mem_release_points, nbytes)

    def mem_set_access_cost_us(self, n_mappings: int, nbytes: int) -> float:
        """Cost of one ``cuMemSetAccess`` over ``nbytes`` covered by ``n_mappings`` mappings."""
        return self.mem_set_access_us + self.mem_set_access_mapping_us * n_mappings \
            + self.mem_set_access_mib_us * nbytes / MiB

    def mem_unmap_cost_us(self, n_mappings: int, nbytes: int) -> float:
        """Cost of one ``cuMemUnmap`` over ``nbytes`` covered by ``n_mappings`` mappings."""
        return self.mem_unmap_us + self.mem_unmap_mapping_us * n_mappings + self.mem_unmap_mib_us * nbytes / MiB

    def copy_us(self, nbytes: int, bandwidth_gbps: float) -> float:
        """A host-device copy: launch cost plus bytes over the bandwidth (PCIe-limited copies are slower;
        this is a lower bound good enough for ordering events)."""
        return self.copy_launch_us + nbytes / (bandwidth_gbps * 1e3)
