"""The program's GPU work in a replay: the GPU runs behind the CPU, as on a real card.

A trace records allocator operations, not kernels. Between two operations the recorded program queued
GPU work on the operation's stream; a replay with a GPU timing other than ``idle`` queues that work on a
:class:`~gpumem.sim.SimDevice` (``SimDevice.launch``), so memory is freed while work that touched it may
still be queued, and the allocator's stream fences (:mod:`gpumem.allocator.fences`) see what they see on a
real GPU: a page freed a moment ago cannot be unmapped (stolen) before the GPU has caught up.

Note [The GPU runs behind the CPU]
----------------------------------
A replay is a CPU (the program issuing operations) and a GPU (one FIFO per stream) in simulated time.
After operation ``i`` the CPU queues the work it launched before operation ``i + 1``, one work item on
op ``i``'s stream; an allocation's item touches the new block (the simulator's sanitizer then catches any
unmap of memory the queued work still uses). The CPU spends ``cpu_op_us`` per operation (PyTorch's eager
dispatch, launches and the allocator), and may be at most ``queue_depth`` items ahead of the GPU: with
more queued, it blocks until the oldest has run (CUDA's launch queue is bounded too; a full queue is why a
GPU-bound program's CPU runs at the GPU's pace, about one queue behind). Where the GPU time of an item
comes from is the timing:

* ``trace`` (the default): the trace's clock (a trace without one gets ``model``'s times). A GPU-bound
  program's CPU is throttled to the GPU's pace, so the time the recording spent between operations ``i``
  and ``i + 1`` is the GPU time of the work queued there; a gap of ``sync_gap_us`` or more is a
  synchronisation (``loss.item()``, a data loader): the CPU waits for the GPU to drain there, and the gap
  is that drain (Note [A sync gap is the GPU draining]).
* ``model``: no clock. An allocation's item runs ``kernel_min_us`` plus ``touch_factor`` times the block's
  bytes at ``bandwidth_fraction`` of the profile's bandwidth; a free queues nothing.
* ``idle``: no work; every fence is complete when recorded: the replay before issue 18, bit for bit.

Why ``trace`` at 2 ms, priced idle, is the default: against every live H200 run whose trace gpumem recorded
(24 rows, split by workload; ``python -m sim.predict_live``, ``reports/sim-predict-live.md``) it predicts the
12 tuning rows within 0.77 pp (mean 0.088), and no other timing, threshold (1 ms to none) or latency model
beats it there beyond the rows' noise (``model``: 0.079 pp, closer on 2 rows, farther on 3); on the 10
scored check rows it is 0.064 pp mean (``model`` 0.89, ``idle`` 2.37; two multistream rows whose traces lack
their ``record_stream`` calls are not scored). In a training step every steal meets busy
pages once the GPU is behind at all, so the constants hardly matter there; the threshold does where a
program synchronises often (several streams, ``generate()``), and gaps include the allocator's own time.
Left out: kernels that touch no new block; each operation's work goes to its own stream. A block used
on other streams is kept back as live when the trace has its ``record_stream`` calls
(:attr:`~gpumem.trace.Trace.stream_uses`: gpumem's ``.gmt`` version 2; Note [Stream uses in a replay] in
:mod:`gpumem.replay`): its free waits for those streams' queued work here. Cross-stream order is kept
when the trace has the program's waits (Note [Cross-stream waits]).

Note [A sync gap is the GPU draining]
-------------------------------------
A training step's CPU issues its work and waits at ``loss.item()``: GPT-2 fp32 (batch 8 x 512, H200) issues
for about 50 ms and then waits about 45 ms, while the GPU, never idle, runs the step's 95 ms. The gaps
before the wait are the CPU's pace, not the GPU's; the wait is the GPU finishing what was queued. Priced
as the CPU's gaps alone, the GPU of a replay kept pace with the CPU and the step lasted half its time
(that trace: 0.577 s simulated for 1.342 s recorded), so a cost the allocator adds (a steal's driver calls,
a wait) came out as twice its share of the step. So the work queued since the previous synchronisation is
stretched, item by item in proportion, to end where the trace's clock resumes (never beyond the clock's
net span where it stepped back, and not where the clock is not finite): the replay lasts the recording
(1.312 s). Measured (``reports/sim-sync-drain.md``): on the 24 live rows of ``python -m sim.predict_live``
the memory predicted is the same within noise (tuning 0.087 -> 0.088 pp mean error; check 0.236 -> 0.064);
the rule off predicted within 0.2 points of live step time on three steady workloads, ``wait_own_stream``'s
price far under it (GPT-2 fp32 +3.4 %, +8.4 % before, live +4.8; ResNet-50 +3.8 %, live +21 %). Limits: a
gap that is not GPU work (a data loader, a per-shape CPU cost, a short stall past ``sync_gap_us`` that splits
a step) moves the drain onto the wrong ops, and the recorded GPU clock tells them apart (below); the stretch
is of the interval's total, so streams that overlap end before the clock resumes; a cut trace
(``Trace.head``) leaves its last interval unstretched. ``GpuWorkModel(sync_gap_is_gpu_work=False)`` keeps
the CPU's gaps alone (``gpumem replay --no-sync-drain``).

Note [A replay on the recorded GPU clock]
----------------------------------------
``trace`` timing guesses the GPU from the CPU's clock, and cannot tell a gap the GPU spent draining from one the
CPU spent elsewhere: on a 7B batch-16 server whose second request outgrew its first (H200), each new length
stalled the CPU ~40 ms (a per-shape cost, not GPU work), after which the GPU was idle and the engine stole
freed chunks; ``trace`` read the gaps as a GPU running behind and grew instead (4.56 % against 3.27 % live).
gpumem.torch can record the GPU's side too (``start_trace(gpu_clock=True)``, Note [The trace's GPU clock] in
``gpumem/_native/torch_api.cpp``): for each op, when the GPU had run the work queued on its stream before it.
``gpu-clock`` replays on both clocks: the CPU spends the recorded time between ops (with the simulated
allocator's own calls on top), and the work queued after op ``i`` ends, relative to the CPU, where the
recording says: at op ``j``, the next on the stream, the GPU was ``clock[j] - times[j]`` behind, so the work
ends that long after the CPU reaches ``j`` (a replay whose allocator costs more or less time than live keeps
the GPU's lag, not its wall time). No launch queue is modelled (the recorded CPU clock holds its waits), and no
syncs or stream waits (the clock holds their effect). One stream only: the clock times a stream at its own ops,
so the work of one stream between two of them is one item, and a fence another stream records between them
(``record_stream``) would wait for all of it; traces of several streams are refused (replayed under ``trace``
by default). The clock travels in the trace (:attr:`~gpumem.trace.Trace.gpu_times_us`, ``.gmt`` version 5),
and a replay of a trace that has it runs on it unless told otherwise. Measured:
``reports/hil/gpu-clock-h200-2026-11-30.md``.

Note [Cross-stream waits]
-------------------------
A program that chains its streams (``copy.wait_stream(main)``, then each tower's stream waits for the
copy, then ``main`` for each tower: ``multistream_infer`` of ``hil/probes/workloads.py``) makes each stream's
work start only after the work it waits for has run. Without that order each simulated stream runs its
own queue from the moment it is queued, so the GPU of a replay is far less behind than the live one (run 3:
seven steps issued in 20 ms of CPU time, 138 ms to the final synchronize), frees' events complete sooner
and blocks come back sooner: PyTorch's allocator replayed at 35.22 % where it held 50.20 % live (45.21 %
with the waits, reconstructed: ``reports/sim-stream-waits.md``). A trace's
:attr:`~gpumem.trace.Trace.stream_waits` (:class:`~gpumem.trace.StreamWait`: gpumem's ``.gmt`` version 3;
a PyTorch snapshot's merged from its run's log, :mod:`gpumem.trace.stream_log`; gpumem's own trace where
the program reports them, :func:`gpumem.torch.trace_wait_stream`) say where the program made them. Before operation ``i`` the replay makes the waits recorded there, after the work of operation
``i - 1`` was queued: each queues on the waiting stream a zero-length marker (``SimDevice.order_streams``)
whose SimPy process yields on the ``done_event`` of the waited stream's last queued item, so everything
queued behind the marker starts no earlier than the waited work ends; time still advances only through
the event queue, and a chain (main -> copy -> tower -> main) carries through markers, since a later wait
on a stream whose tail is a marker waits for that marker. The markers are not in the launch queue (they
hold no launch slot) and touch no memory. A trace without waits queues none, so its figures are what they
were bit for bit, and ``idle`` ignores waits (no GPU work to order). What the work between two ops is
(one item on the first op's stream) is unchanged, so a wait made mid-gap is placed at the gap's end.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from ..trace import Trace
    from .device import SimDevice
    from .streams import Work


class GpuTiming(str, enum.Enum):
    """How a replay runs the program's GPU work (Note [The GPU runs behind the CPU])."""

    TRACE = "trace"
    """GPU time between operations from the trace's clock; the CPU at the model's pace, a bounded queue ahead."""
    MODEL = "model"
    """GPU time from the bytes each allocation's kernel touches and the profile's bandwidth."""
    IDLE = "idle"
    """No GPU work: every fence completes at once (the replay before issue 18)."""
    GPU_CLOCK = "gpu-clock"
    """The CPU at the trace's clock, the GPU as the recording's GPU clock says it ran (Note [A replay on the
    recorded GPU clock]); for traces that have it (:attr:`~gpumem.trace.Trace.gpu_times_us`)."""


DEFAULT_GPU_TIMING = GpuTiming.TRACE
#: ``gpu-clock``: work ends this much before the recorded time (:meth:`ProgramGpu._after_on_clock`)
_CLOCK_MARGIN_S = 1e-9
#: ``gpu-clock``'s launch queue: never full (the recorded CPU clock already holds the program's waits on it)
_UNBOUNDED_QUEUE = 2**62


def gpu_timing(value: "str | GpuTiming | None") -> GpuTiming:
    """``value`` as a :class:`GpuTiming` (None: the default); an unknown name raises InvalidArgumentError."""
    if value is None:
        return DEFAULT_GPU_TIMING
    if isinstance(value, GpuTiming):
        return value
    try:
        return GpuTiming(value)
    except ValueError:
        raise InvalidArgumentError(f"unknown gpu timing {value!r}; choose one of "
                                   f"{', '.join(t.value for t in GpuTiming)}") from None


@dataclass(frozen=True)
class GpuWorkModel:
    """The constants of Note [The GPU runs behind the CPU] (calibration: ``reports/gpu-timing-calibration.md``)."""

    cpu_op_us: float = 4.0
    """CPU time per allocator operation when the CPU is not throttled."""
    queue_depth: int = 1024
    """Work items the CPU may be ahead of the GPU before it blocks."""
    sync_gap_us: float = 2000.0
    """``trace``: a gap in the trace's clock at least this long is a synchronisation, not GPU work (1 ms to
    none swept against the live runs: ``reports/sim-predict-live.md``)."""
    sync_gap_is_gpu_work: bool = True
    """``trace``: a synchronisation's gap is the GPU finishing the work queued since the previous one, so that
    work is stretched to end where the trace's clock resumes (Note [A sync gap is the GPU draining]); ``False``:
    the work takes only the CPU's gaps (the model before 2026-12-01)."""
    kernel_min_us: float = 4.0
    """``model``: the shortest kernel."""
    touch_factor: float = 2.0
    """``model``: bytes a kernel touches per byte of the block it makes."""
    bandwidth_fraction: float = 0.7
    """``model``: the fraction of the profile's memory bandwidth a kernel reaches."""

    def bandwidth_bps(self, profile: Any) -> float:
        """``model``: the bytes per second a kernel moves on a device of ``profile`` (a
        :class:`~gpumem.sim.profiles.DeviceProfile`): its memory bandwidth times :attr:`bandwidth_fraction`."""
        return profile.memory_bandwidth_gbps * 1e9 * self.bandwidth_fraction

    def __post_init__(self) -> None:
        for knob in ("cpu_op_us", "sync_gap_us", "kernel_min_us", "touch_factor"):
            value = getattr(self, knob)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < float("inf"):
                raise InvalidArgumentError(f"GpuWorkModel.{knob} must be a finite number >= 0, not {value!r}")
        if not isinstance(self.bandwidth_fraction, (int, float)) or not 0.0 < self.bandwidth_fraction <= 1.0:
            raise InvalidArgumentError(f"GpuWorkModel.bandwidth_fraction must be in (0, 1], not {self.bandwidth_fraction!r}")
        if not isinstance(self.sync_gap_is_gpu_work, bool):
            raise InvalidArgumentError(
                f"GpuWorkModel.sync_gap_is_gpu_work must be a bool, not {self.sync_gap_is_gpu_work!r}")
        if not isinstance(self.queue_depth, int) or isinstance(self.queue_depth, bool) or self.queue_depth < 1:
            raise InvalidArgumentError(f"GpuWorkModel.queue_depth must be a positive int, not {self.queue_depth!r}")


class _LaunchQueue:
    """The program's launch queue on a simulated device: work queued after operations, at most
    ``model.queue_depth`` items ahead of the GPU (Note [The GPU runs behind the CPU])."""

    __slots__ = ("device", "model", "_queue", "n_launches", "n_blocked", "_cpu_s")

    def __init__(self, device: Any, model: GpuWorkModel | None, what: str) -> None:
        from .device import SimDevice

        if not isinstance(device, SimDevice):
            raise InvalidArgumentError(
                f"gpu timing {what!r} runs the program's GPU work on a simulated device; "
                f"{getattr(device, 'spec', device)!r} is not one (replay with gpu_timing='idle')")
        self.device: SimDevice = device
        self.model = model if model is not None else GpuWorkModel()
        if not isinstance(self.model, GpuWorkModel):
            raise InvalidArgumentError(f"gpu work model must be a GpuWorkModel, not {type(model).__name__}")
        self._cpu_s = self.model.cpu_op_us * 1e-6
        self._queue: deque[Work] = deque()
        self.n_launches = 0
        self.n_blocked = 0

    def _launch(self, stream: int, duration_s: float, ptr: int, nbytes: int) -> None:
        """Queue ``duration_s`` of work on ``stream`` touching ``[ptr, ptr + nbytes)`` (nothing where either is
        0), blocking while the launch queue is full."""
        q = self._queue
        dev = self.device
        while q and q[0].done:
            q.popleft()
        if len(q) >= self.model.queue_depth:
            self.n_blocked += 1
            dev.wait_work(q[0])
            while q and q[0].done:
                q.popleft()
        touches = ((ptr, nbytes),) if ptr and nbytes else ()
        work = dev.launch(stream, duration_s, touches, name="program")
        q.append(work)
        self.n_launches += 1

    def _wait_all(self) -> None:
        for w in list(self._queue):
            if not w.done:
                self.device.wait_work(w)
        self._queue.clear()


def _stretch(work: list[float], first: int, end: int, total_s: float) -> None:
    """Scale ``work[first:end]`` up so that it totals ``total_s`` (Note [A sync gap is the GPU draining]). Left as
    it is where it is all zero, where ``total_s`` is not more than its sum, and where ``total_s`` is not finite (a
    clock of inf or NaN): no item is ever made non-finite."""
    span_s = sum(work[first:end])
    if span_s > 0 and span_s < total_s < math.inf:
        scale = total_s / span_s
        if math.isfinite(scale):
            for k in range(first, end):
                work[k] *= scale
        else:   # a sum so small that the scale overflows: each item's share of the total instead
            for k in range(first, end):
                work[k] = work[k] / span_s * total_s


def gpu_clock_problem(trace: "Trace") -> str:
    """Why ``trace`` cannot be replayed on its GPU clock (Note [A replay on the recorded GPU clock]), or ``""``."""
    import numpy as np

    clock = trace.gpu_times_us
    name = trace.name
    if clock is None:
        return (f"{name} has no GPU clock (record it with gpumem.torch.start_trace(gpu_clock=True), or replay "
                "under 'trace')")
    n = trace.n_ops
    unknown = int(np.count_nonzero(np.isnan(clock)))
    if unknown:
        return (f"{name}: its GPU clock has no time for {unknown} of its {n} operations (recorded partly without "
                "the clock, or it stopped)")
    times = trace.times_us
    if n > 1 and (not np.isfinite(times).all() or float(times.min()) == float(times.max())):
        return f"{name} has no clock of its own (times_us) to pace the CPU by"
    with np.errstate(over="ignore", invalid="ignore"):
        spans = np.concatenate((np.diff(times), clock - times))
    if not np.isfinite(spans).all():
        return f"{name}: its clocks are too far apart for a float (a gap or a lag is not finite)"
    streams = set(trace.streams.tolist()) | {u.stream for u in trace.stream_uses}
    if len(streams) > 1:
        return (f"{name}: the GPU clock times each stream only at its own operations, and it uses {len(streams)} "
                "streams, so a fence one stream records on another cannot be placed")
    return ""


class ModelGpu(_LaunchQueue):
    """The ``model`` timing for operations given one at a time rather than as a trace (the estimate's streamed
    decode, :mod:`gpumem.estimate.fit`): call :meth:`before` ahead of each operation and :meth:`after` once an
    allocation is done. The same device calls, in the same order, as :class:`ProgramGpu` with
    ``timing="model"`` over a trace of those operations; the native engine's twin keeps the same clock in C++
    (Note [A twin that runs the program's GPU work] in ``gpumem/_native/pybackend.cpp``)."""

    __slots__ = ("_k_min_s", "_factor", "_bandwidth_bps")

    def __init__(self, device: Any, model: GpuWorkModel | None = None) -> None:
        super().__init__(device, model, GpuTiming.MODEL.value)
        m = self.model
        self._bandwidth_bps = m.bandwidth_bps(self.device.profile)
        self._k_min_s, self._factor = m.kernel_min_us * 1e-6, m.touch_factor

    def before(self) -> None:
        """The CPU reaches the next operation: its time passes."""
        if self._cpu_s:
            self.device.advance(self._cpu_s)

    def after(self, stream: int, ptr: int, nbytes: int) -> None:
        """An allocation of ``nbytes`` at ``ptr`` on ``stream`` is done: queue the kernel that follows it."""
        duration_s = self._k_min_s + self._factor * nbytes / self._bandwidth_bps if nbytes else 0.0
        if duration_s:
            self._launch(stream, duration_s, ptr, nbytes)

    def finish(self) -> None:
        """Let the queued work run out."""
        self._wait_all()


class ProgramGpu(_LaunchQueue):
    """Runs a trace's GPU work on a simulated device beside a replay loop: call :meth:`before` ahead of
    operation ``i`` and :meth:`after` once it is done (with the block's pointer for an allocation)."""

    __slots__ = ("timing", "clock", "_work_s", "_sync", "_streams", "_sizes", "n_syncs", "max_lag_s", "_waits",
                 "n_waits", "n_wait_markers", "_cpu_op_s", "_clock_end_s", "_tail_s", "_launched_s")

    def __init__(self, trace: "Trace", device: Any, timing: "str | GpuTiming | None",
                 model: GpuWorkModel | None = None) -> None:
        self.timing = gpu_timing(timing)
        if self.timing is GpuTiming.IDLE:
            raise InvalidArgumentError("ProgramGpu: gpu timing 'idle' runs no GPU work (make none)")
        if self.timing is GpuTiming.GPU_CLOCK:
            why = gpu_clock_problem(trace)
            if why:
                raise InvalidArgumentError(f"gpu timing 'gpu-clock': {why}")
        super().__init__(device, model, self.timing.value)
        if self.timing is GpuTiming.GPU_CLOCK:   # the recorded CPU clock paces the CPU: no launch queue to model
            self.model = dataclasses.replace(self.model, queue_depth=_UNBOUNDED_QUEUE)
        kinds = trace.kinds.tolist()
        self._sizes = trace.nbytes.tolist()
        self._streams = trace.streams.tolist()
        n = len(kinds)
        m = self.model
        self._sync = [0] * n
        """Per operation: 1 where the program synchronised before it, 2 where it made cross-stream waits,
        3 both (0 mostly: one test per operation in :meth:`before`)."""
        times = trace.times_us.tolist()
        self.clock = bool(times) and min(times) != max(times)
        """Whether the trace has a clock (``trace`` timing without one uses the model's kernel times)."""
        self._cpu_op_s: list[float] | None = None
        """``gpu-clock``: per operation, the CPU time before it (Note [A replay on the recorded GPU clock])."""
        self._clock_end_s: list[float] | None = None
        """``gpu-clock``: per operation, when the work queued after it ends, in seconds after the operation."""
        self._tail_s: dict[int, float] = {}
        """``gpu-clock``: stream -> when the work queued on it so far ends (simulated seconds)."""
        self._launched_s = 0.0
        """``gpu-clock``: the simulated launch the last operation's work cost the CPU (taken off the next gap)."""
        if self.timing is GpuTiming.GPU_CLOCK:
            work = self._from_gpu_clock(times, trace.gpu_times_us)
        elif self.timing is GpuTiming.TRACE and self.clock:
            work = [0.0] * n
            since = 0   # the first operation after the last synchronisation
            backward = False   # whether the clock stepped back since then (an RMM log's threads, out of order)
            for i in range(n - 1):
                gap = times[i + 1] - times[i]
                if gap >= m.sync_gap_us:
                    self._sync[i + 1] = 1
                    if m.sync_gap_is_gpu_work:   # Note [A sync gap is the GPU draining]
                        # to where the clock resumes: the gaps' sum, or net of the steps back if there were any
                        total_s = ((times[i + 1] - times[since]) * 1e-6 if backward
                                   else sum(work[since:i + 1]) + gap * 1e-6)
                        _stretch(work, since, i + 1, total_s)
                    since, backward = i + 1, False
                elif gap > 0:
                    work[i] = gap * 1e-6
                elif gap < 0:
                    backward = True
        else:
            bw = m.bandwidth_bps(device.profile)
            k_min, factor = m.kernel_min_us * 1e-6, m.touch_factor
            work = [k_min + factor * s / bw if kind == 0 and s else 0.0 for kind, s in zip(kinds, self._sizes)]
        self._work_s = work
        self._waits: dict[int, list[tuple[int, int]]] = {}
        """Operation -> the ``(stream, waited)`` waits made before it (Note [Cross-stream waits])."""
        for w in (() if self.timing is GpuTiming.GPU_CLOCK else trace.stream_waits):   # the clock holds their effect
            if w.at_op < n:   # a wait after the last operation orders no work of the replay
                self._waits.setdefault(w.at_op, []).append((int(w.stream), int(w.waited)))
                self._sync[w.at_op] |= 2
        self.n_waits = 0
        self.n_wait_markers = 0
        self.n_syncs = 0
        self.max_lag_s = 0.0

    def _from_gpu_clock(self, times: list[float], clock: Any) -> list[float]:
        """The work after each operation and the CPU time before it, from the recorded clocks (Note [A replay on
        the recorded GPU clock]); the trace was checked (:func:`gpu_clock_problem`)."""
        n = len(times)
        clock = clock.tolist()
        self._cpu_op_s = [self._cpu_s] + [max(times[i + 1] - times[i], 0.0) * 1e-6 for i in range(n - 1)]
        # the work queued after op i ends when the GPU reaches the next op on its stream: that op's clock
        # less its CPU time, as a lag behind the CPU (seconds), kept per op i (NaN: no later op there)
        lag_s = [float("nan")] * n
        later: dict[int, int] = {}   # stream -> the next operation on it (walking backwards)
        for i in range(n - 1, -1, -1):
            s = self._streams[i]
            j = later.get(s)
            if j is not None:
                lag_s[i] = (clock[j] - times[j]) * 1e-6 + (times[j] - times[i]) * 1e-6
            later[s] = i
        self._clock_end_s = lag_s
        return [0.0] * n

    def before(self, i: int) -> None:
        """The CPU reaches operation ``i``: its time passes, and it waits where the program synchronised."""
        dev = self.device
        flags = self._sync[i]
        if flags & 2:
            for stream, waited in self._waits[i]:
                self.n_waits += 1
                if dev.order_streams(stream, waited) is not None:
                    self.n_wait_markers += 1
        if flags & 1:
            self.n_syncs += 1
            if self._queue:
                dev.wait_work(self._queue[-1])
                for w in self._queue:
                    if not w.done:
                        dev.wait_work(w)
                self._queue.clear()
        if self._cpu_op_s is None:
            cpu_s = self._cpu_s
        else:   # the recorded CPU time holds the program's launches: the simulated launch before is not added
            cpu_s = max(self._cpu_op_s[i] - self._launched_s, 0.0)
            self._launched_s = 0.0
        if cpu_s:
            dev.advance(cpu_s)

    def after(self, i: int, ptr: int) -> None:
        """Operation ``i`` is done (``ptr``: the block an allocation got, else 0): queue the work that
        follows it, blocking while the launch queue is full."""
        if self._clock_end_s is not None:
            self._after_on_clock(i, ptr)
            return
        duration_s = self._work_s[i]
        if duration_s:
            self._launch(self._streams[i], duration_s, ptr, self._sizes[i])

    def _after_on_clock(self, i: int, ptr: int) -> None:
        """``gpu-clock``: queue the work after op ``i`` to end where the recording's did, relative to the CPU
        (Note [A replay on the recorded GPU clock])."""
        end_after_s = self._clock_end_s[i]   # type: ignore[index]
        if end_after_s != end_after_s:   # NaN: no later op on the stream, nothing to time
            return
        s = self._streams[i]
        now = self.device.now_s
        launch_s = self.device.latency.launch_us * 1e-6   # the launch call's cost passes before the work is queued
        start = max(now + launch_s, self._tail_s.get(s, now))
        # a nanosecond early (the clock's resolution is half a microsecond): work the recording had done when the
        # CPU reached op j is done when the replay's CPU gets there, not at the same instant
        duration_s = max(now + end_after_s - _CLOCK_MARGIN_S - start, 0.0)
        if duration_s:
            self._tail_s[s] = start + duration_s
            self._launch(s, duration_s, ptr, self._sizes[i])
            self._launched_s = launch_s

    def finish(self) -> dict[str, Any]:
        """Let the queued work run out; what the GPU did, for :attr:`ReplayResult.extra`."""
        lag_s = self.device.streams.pending_s
        self._wait_all()
        timing = (self.timing.value if self.clock or self.timing in (GpuTiming.MODEL, GpuTiming.GPU_CLOCK)
                  else "model (the trace has no clock)")
        out = {"gpu_timing": timing, "gpu_launches": self.n_launches,
               "gpu_queue_full_waits": self.n_blocked, "gpu_syncs": self.n_syncs, "gpu_pending_at_end_s": lag_s}
        if self.timing is GpuTiming.TRACE and self.clock:   # which model of a synchronisation's gap priced it
            out["gpu_sync_drain"] = self.model.sync_gap_is_gpu_work
        if self._waits:   # only for a trace with waits: a replay of one without them reports what it did
            out.update(gpu_stream_waits=self.n_waits, gpu_stream_wait_markers=self.n_wait_markers)
        return out
