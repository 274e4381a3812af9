"""The caching allocator: best fit, splitting and coalescing over any :class:`~gpumem.device.Device`.

>>> from gpumem import open_device
>>> from gpumem.allocator import CachingAllocator
>>> alloc = CachingAllocator(open_device("sim:a100-80gb"))
>>> p = alloc.allocate(1000)          # rounded to 1024 B, from the small pool
>>> alloc.free(p)                     # cached: the next request of that size costs no device call
>>> print(alloc.memory_summary())

Requests are rounded (512 B by default) and served from a small pool (up to
1 MiB) or a large pool, each with one free list per stream. A request takes the
best-fitting free block of its pool and stream, splitting off the remainder
when it is large enough to be useful; a freed block merges with free
neighbours. When no free block fits, the backing (:mod:`.backing`) grows: a new
``malloc``'d segment, or more of a virtual range with physical pages mapped
under it. When the device is out of memory, the allocator gives its cached
memory back and retries once before raising
:class:`~gpumem.errors.OutOfMemoryError` with what it holds and what to try.

Note [Streams]
--------------
Every block carries the stream it was allocated on, and free lists are per
stream, so a block freed on stream A is never handed to stream B: B's kernels
could run while A's still use it. A block used on other streams too
(:meth:`CachingAllocator.record_stream`) records an event on each of them when it
is freed and goes to a pending list; it becomes reusable once those events have
completed, which the allocator checks when an allocation misses the cache and
waits for before it reports out of memory (PyTorch's ``process_events``). Memory
goes back to the device only once the work of its last users is done: Note
[Stream-ordered frees] in :mod:`.fences`.

Note [The hot path makes no device call]
----------------------------------------
A request served from the cache on a page (or segment) that already holds live
data needs no device call, and neither does a free (fences are recorded only
when memory goes back to the device): they run under the lock alone, as a fast
path. Anything else (growth, the first block on a mapped empty page, a free of
a block used on other streams, which records events) runs as a full operation,
below.

Note [Callbacks run outside the allocator]
------------------------------------------
A device may publish memory events (another tenant took memory...) during a
call the allocator makes. Every public operation runs as
``with device.deferred_events(): with self._lock: ...``, so those events reach
subscribers after the operation has finished and the lock is released, as
PyTorch calls its observers after unlocking: a subscriber may call
:meth:`CachingAllocator.empty_cache` or :meth:`~CachingAllocator.allocate`.

Note [A failed allocation changes nothing]
------------------------------------------
Allocation first finds or grows a free block, then commits it (maps its pages
in virtual mode). If committing fails the block goes back exactly where it was
(re-merged with its neighbours), and growth that produced it is kept only as
cached memory, which a retry or :meth:`empty_cache` reuses or returns; stats
other than the OOM and retry counters are unchanged. Every other operation is
failure-atomic too (Note [Failure atomicity] in :mod:`.backing`), and
:meth:`CachingAllocator.check_consistency` compares the bookkeeping with the
device's. After the device is lost, every call raises
:class:`~gpumem.errors.DeviceLostError`.
"""

from __future__ import annotations

import logging
from typing import Any

from ..device import Device
from ..errors import InternalError, InvalidArgumentError, OutOfMemoryError, UnsupportedOperationError
from ..native import load_engine
from ..units import format_bytes
from ..validate import as_int, check_stream, parse_limit
from .backing import Backing, pool_va_nbytes
from .engine import Engine
from .native import NativeEngine
from .plan import MarkResult, PlanInfo, RefusedPlans, StepTemplate, plan_room_nbytes, plan_step_and_height
from .policy import DEFAULT_POLICY, AllocatorPolicy, VmmMode, get_policy
from .python_engine import PythonEngine
from .resource import AllocatorContract
from .stats import AllocatorStats, format_summary

log = logging.getLogger(__name__)

NATIVE_BY_DEFAULT = True
"""Whether ``engine=None`` picks the native engine where it can run (Note [Choosing the engine]).

On: the native engine makes the reference's decisions (tests/allocator/test_native_differential.py). The
white-box tests that read the Python engine's internals pin the reference (tests/allocator/conftest.py)."""


class CachingAllocator(AllocatorContract):
    """A caching allocator over ``device`` under a named or custom :class:`AllocatorPolicy`.

    ``limit``: the most memory the allocator may reserve: bytes (int), a fraction of the
    device's total (float in (0, 1]), or text by the same rules as ``gpumem replay --limit``
    (``"8GiB"``, ``"512MB"``, ``"90%"``, ``"0.9"``; see :func:`gpumem.validate.parse_limit`). ``gc_threshold``: a fraction in (0, 1); once reserved
    memory passes that fraction of the limit (or of the device), cached memory is given back
    before the allocator grows. ``record_history``: keep every allocation, free and segment
    event for export as a trace or a PyTorch snapshot (:meth:`history`).

    ``engine``: which implementation runs it. ``None`` (the default) takes the native C++ engine
    (``gpumem._engine``, built at install time where a C++ compiler exists) in virtual-memory mode
    (the ``gpumem`` and ``expandable`` policies on a device with VMM) without ``record_history``, and the
    pure-Python reference engine otherwise (the ``bestfit``, ``pytorch`` and ``cupy`` policies, devices
    without VMM, history recording). ``"python"`` forces the reference; ``"native"`` runs the native engine
    in either mode (``malloc``'d segments too) and raises
    :class:`~gpumem.errors.UnsupportedOperationError` where it cannot run (not built, history
    recorded). Both make
    the same decisions (``tests/allocator/test_native_differential.py``); :attr:`engine` says
    which one runs.
    """

    def __init__(
        self,
        device: Device,
        policy: str | AllocatorPolicy = DEFAULT_POLICY,
        *,
        limit: int | float | str | None = None,
        gc_threshold: float | None = None,
        record_history: bool = False,
        engine: str | None = None,
    ) -> None:
        self.device = device
        self.policy = get_policy(policy)
        self.limit_nbytes = parse_limit(limit, device.properties().total_nbytes)
        # the native engine's slack arithmetic takes the limit as a signed 64-bit count, so a limit of 2**63 or more
        # would turn negative there and the two engines decide apart (attacker review, 2026-12-05): refused alike
        if self.limit_nbytes is not None and self.limit_nbytes >= 1 << 63:
            raise InvalidArgumentError(f"limit: {self.limit_nbytes} bytes is more than an allocator can reserve "
                                       "(2**63 - 1 at most)")
        if gc_threshold is not None and not (isinstance(gc_threshold, (int, float)) and 0 < gc_threshold < 1):
            raise InvalidArgumentError(f"gc_threshold must be a fraction in (0, 1), got {gc_threshold!r}")
        self.gc_threshold = gc_threshold
        self._refused_plans = RefusedPlans()   # Note [A plan taller than the device] in .plan
        if self.policy.vmm is VmmMode.ALWAYS and not device.vmm_supported:
            raise UnsupportedOperationError(f"policy {self.policy.name!r} needs virtual memory management, "
                                            f"which {device.spec} does not support")
        self.uses_vmm = self.policy.vmm is VmmMode.ALWAYS or (self.policy.vmm is VmmMode.AUTO and device.vmm_supported)
        if self.uses_vmm:
            pool_va_nbytes(device, self.policy)  # a range past 64 bits is refused here, alike for both engines
        self._engine: Engine = self._make_engine(engine, record_history)
        self.leaked_nbytes = 0
        """After :meth:`close`: device memory that could not be given back (Note [Closing waits for the streams])."""
        # the hot path is the engine's own, with no frame of this class on it; a subclass that overrides
        # allocate or free keeps its override (whose super() call reaches the engine)
        if type(self).allocate is CachingAllocator.allocate:
            self.allocate = self._engine.allocate  # type: ignore[method-assign]
        if type(self).free is CachingAllocator.free:
            self.free = self._engine.free  # type: ignore[method-assign]

    def _make_engine(self, engine: str | None, record_history: bool) -> Engine:
        """Note [Choosing the engine]: the native engine is an exact port of both backings
        (``gpumem/_native/engine.h``; segment mode: Note [Segment mode] in ``engine.cpp``), so it runs
        where history is not recorded (the recorder lives in Python), pools with pages of their own size
        (``expandable``) included;
        ``engine="python"`` forces the reference, ``engine="native"`` refuses to fall back. ``None``
        takes it in virtual-memory mode only: in segment mode it runs ``malloc``'d segments exactly as the
        reference, but reports and benchmarks read a segment allocator's Python backing (:attr:`backing`),
        which the native engine does not have, so ``engine="native"`` asks for it (the estimate's fast path).
        The choice is made once, here: the allocator then only delegates to it."""
        if engine not in (None, "python", "native"):
            raise InvalidArgumentError(f"engine must be None, 'python' or 'native', got {engine!r}")
        why = None
        if engine != "python":
            if load_engine(warn=True) is None:
                why = "the native engine (gpumem._engine) is not built"
            elif record_history:
                why = "the native engine does not record history"
            if why is None and (engine == "native" or (NATIVE_BY_DEFAULT and self.uses_vmm)):
                return NativeEngine(self.device, self.policy, limit_nbytes=self.limit_nbytes,
                                    gc_threshold=self.gc_threshold, uses_vmm=self.uses_vmm)
            if engine == "native":
                raise UnsupportedOperationError(f"engine='native' is unavailable: {why}")
        return PythonEngine(self.device, self.policy, uses_vmm=self.uses_vmm, limit_nbytes=self.limit_nbytes,
                            gc_threshold=self.gc_threshold, record_history=record_history)

    @property
    def engine(self) -> str:
        """Which engine runs this allocator: ``"native"`` (``gpumem._engine``) or ``"python"``."""
        return self._engine.name

    @property
    def backing(self) -> Backing:
        """The Python engine's backing (its segments or virtual ranges), for reports and white-box tests.

        Raises :class:`~gpumem.errors.UnsupportedOperationError` on the native engine, whose backing
        is C++: create the allocator with ``engine="python"`` to look inside."""
        return self._engine.backing  # type: ignore[attr-defined,no-any-return]

    # -- the hot path (the engine's methods themselves, bound in __init__) ---------------------------------
    def allocate(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` on ``stream``; return the device pointer.

        Raises :class:`~gpumem.errors.InvalidArgumentError` for a bad size and
        :class:`~gpumem.errors.OutOfMemoryError` when neither the cache nor the device can serve it.
        """
        return self._engine.allocate(nbytes, stream)

    def free(self, ptr: int) -> None:
        """Return ``ptr`` to the cache. Unknown pointers and double frees raise, changing nothing.

        The block is reusable at once on its own stream; blocks used on other streams
        (:meth:`record_stream`) once those streams' work up to now is done (Note [Streams]).
        """
        self._engine.free(ptr)

    # -- step plans ------------------------------------------------------------------------------------
    def mark_step(self) -> MarkResult:
        """The program's step boundary: opt in to step plans (Note [Step plans] in :mod:`.plan`).

        The first call starts recording the step's allocations; once two recorded steps in a row
        allocate the same sizes on the same streams, the first is planned (:func:`.plan.plan_step`) and
        every later step's allocations are served from one arena at their planned offsets, with no
        device call; a step that leaves the plan is served by the engine as without a plan, and a plan
        missed three steps in a row, or four of its last eight, is dropped and recording starts again.
        Call it at the same point of every step, where the fewest bytes are live (the top of a training
        loop). Returns what the call did (:class:`.plan.MarkResult`). A plan must fit the room the allocator has
        at the mark (free memory plus the chunks of its idle cache that hold no live block, within ``limit``; each
        stream's slots are stacked, and what the engine still serves beside them in the step counts too: Note [The
        room counts whole chunks] in :mod:`.plan`): one that does not is not installed (the call still returns READY; ``step_plan_info().plans_installed`` says
        it), a warning says so once, and the same step is not planned again until the room grows (Note [A plan
        taller than the device] in :mod:`.plan`). Marks from several threads are
        safe: a READY step that another thread's mark took while this one planned it is not installed
        (Note [Step plans and threads] in :mod:`.plan`).

        The first mark also begins the memory-first warm-up where the policy has one (``plan_warmup``): the
        engine grows in one-page chunks until the plan is installed, or for at most eight marks (Note [A
        memory-first warm-up] in :mod:`.plan`; :meth:`start_plan_warmup` begins it before the first mark).

        Raises:
            InvalidArgumentError: the allocator is closed.
            UnsupportedOperationError: the device has no virtual memory management, which a plan's arena
                needs (an address range of its own): nothing is recorded.
        """
        if not self.device.vmm_supported:
            raise UnsupportedOperationError(
                f"mark_step: step plans need virtual memory management (an arena is an address range of its own), "
                f"which {self.device.spec} does not support; do not mark steps on it")
        result = MarkResult(self._engine.mark_step())
        if result is MarkResult.READY:
            ready = self._engine.step_template(True)   # None: another thread's mark took the step
            if ready is not None:
                self._plan_ready_step(StepTemplate(*ready[:4]), ready[4])
        return result

    def _plan_ready_step(self, t: StepTemplate, generation: int) -> None:
        """Plan the recorded step ``t`` within the room it has and install the plan (Note [A plan taller than
        the device] in :mod:`.plan`); a step refused for want of room is not planned again while the room
        is no larger."""
        props = self.device.properties()
        mem = self.device.mem_info()
        room = plan_room_nbytes(props.total_nbytes, mem.free_nbytes, self._engine.reserved_nbytes(),
                                self._engine.allocated_nbytes(), self.limit_nbytes, t.carried_nbytes(),
                                self._engine.releasable_nbytes(True))
        if not self._refused_plans.worth_planning(t, room):
            return
        offsets, height = plan_step_and_height(t, page_nbytes=props.granularity_nbytes, limit_nbytes=room,
                                               round_nbytes=self.policy.round_nbytes)
        if self._refused_plans.note(t, room, offsets):
            log.warning("mark_step: the recorded step's plan needs %s (its arena and what the engine serves beside it "
                        "in the step) and this allocator has room for %s on %s (free memory plus the idle chunks its "
                        "cache can give back%s): no step plan, the engine serves the step as it does where no plan "
                        "forms, and this step is not planned again until the room grows (Notes [The room counts whole "
                        "chunks] and [A plan taller than the device] in gpumem.allocator.plan)", format_bytes(height),
                        format_bytes(room), self.device.spec,
                        "" if self.limit_nbytes is None else f", within the limit of {format_bytes(self.limit_nbytes)}")
        if not (offsets >= 0).any():
            return
        try:
            self._engine.install_plan([int(x) for x in offsets], generation)
        except OutOfMemoryError as exc:   # the arena's address range: this step runs as without a plan; not
            # remembered as a refusal, an address range may come free (the next match plans again)
            log.warning("mark_step: the step plan's arena could not be reserved on %s (%s): no step plan, the "
                        "engine serves the step as where no plan forms", self.device.spec, exc)

    def start_plan_warmup(self) -> bool:
        """Grow memory-first from now until a step plan is installed, as the first :meth:`mark_step` would begin
        it: for a program whose first mark comes after its first step (automatic marks after
        ``optimizer.step()``), so that the steps before the plan, which decide the run's peak, hold little
        (Note [A memory-first warm-up] in :mod:`.plan`). Returns whether the warm-up is on: not where the policy
        has no ``plan_warmup`` or grows otherwise than by chunks, a warm-up already ran, or a plan is installed.

        Raises:
            InvalidArgumentError: the allocator is closed.
        """
        return bool(self._engine.start_plan_warmup())

    def stop_plan_warmup(self) -> bool:
        """Stop the memory-first warm-up as if it had not begun, for a program that turns its automatic marks
        off: the idle cache goes back (the warm-up's small chunks do not outlive it), the engine grows by its
        policy again, and a later :meth:`mark_step` or :meth:`start_plan_warmup` may begin it again. Returns
        whether it was on.

        Raises:
            InvalidArgumentError: the allocator is closed.
        """
        return bool(self._engine.stop_plan_warmup())

    def reset_peak_stats(self) -> None:
        """Set the peaks (allocated, requested, reserved) to the values now, as
        ``torch.cuda.reset_peak_memory_stats`` does; reserved counts a step plan's arena."""
        self._engine.reset_peak_stats()

    def step_plan_info(self) -> PlanInfo:
        """The step plan's state and counters (:class:`.plan.PlanInfo`): slots, arena bytes (reserved,
        mapped), allocations served from it and by the engine, steps hit and missed, plans installed and
        dropped, the arena's device calls."""
        return PlanInfo(self._engine.step_plan_info())

    # -- streams ---------------------------------------------------------------------------------------
    def record_stream(self, ptr: int, stream: int) -> None:
        """Note that the live block at ``ptr`` is used on ``stream`` too (see Note [Streams]).

        Pure bookkeeping: no device call, so on a device lost but not yet noticed it succeeds; the
        next call that reaches the device (the free of that block records events) raises
        :class:`~gpumem.errors.DeviceLostError`."""
        self._engine.record_stream(as_int(ptr, "ptr"), check_stream(stream))

    def synchronize(self) -> None:
        """Wait for the device, then make every block freed with pending stream uses reusable.

        Never needed for correctness or for memory to be reused: the allocator tracks the
        streams' events itself (Note [Streams]).
        """
        self._engine.synchronize()

    # -- cache control and introspection -----------------------------------------------------------------
    def empty_cache(self) -> int:
        """Give every cached byte that holds no live data back to the device; return how many.

        Waits for the work still using that memory (events recorded when it was freed),
        never gives back memory a queued kernel still touches.
        """
        return self._engine.empty_cache()

    def check_consistency(self) -> None:
        """Compare the allocator's bookkeeping with the device's; raise
        :class:`~gpumem.errors.InternalError` listing the differences.

        Checks that every segment is a live device allocation (or every virtual range a
        reservation, and its mapped pages exactly the device's mappings with the same
        chunks), that blocks tile their segments, that free blocks are in their free
        lists and live ones are not, and that the byte counts add up. Runs on any
        device that lists its ranges (the simulator and the CUDA adapter).
        """
        problems = self._engine.consistency_problems()
        if problems:
            raise InternalError("allocator and device disagree: " + "; ".join(problems[:8])
                                + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""))

    @property
    def stats(self) -> AllocatorStats:
        """A snapshot of the counters, derived fields filled in (as :meth:`snapshot_stats`)."""
        return self._engine.stats()

    @property
    def reserved_nbytes(self) -> int:
        """Device memory the allocator holds now."""
        return self._engine.reserved_nbytes()

    @property
    def allocated_nbytes(self) -> int:
        """Bytes in live blocks (rounded sizes)."""
        return self._engine.allocated_nbytes()

    def live_blocks(self) -> list[tuple[int, int]]:
        """``(ptr, size)`` of every live block."""
        return self._engine.live_blocks()

    def block_size(self, ptr: int) -> int:
        """The (rounded) size of the live block at ``ptr`` (any integer, ``np.int64`` included).

        Raises :class:`~gpumem.errors.InvalidArgumentError` when ``ptr`` is not an integer, and
        :class:`~gpumem.errors.InvalidPointerError` when no live block starts there."""
        return self._engine.block_size(as_int(ptr, "ptr"))

    def memory_stats(self) -> dict[str, int | float]:
        """Counters in the spirit of ``torch.cuda.memory_stats`` (flat names, values now)."""
        return self._engine.stats().as_dict()

    def snapshot_stats(self) -> AllocatorStats:
        """A copy of the stats with the derived fields (reserved, fragmentation...) filled in."""
        return self._engine.stats()

    def memory_summary(self) -> str:
        """A text table of the stats, for people. A step plan's arena has a line of its own; the cache's
        rows (cached free, largest free block, fragmentation) leave it out (Note [The step plan's arena in
        the summary] in :mod:`.stats`)."""
        plan = PlanInfo(self._engine.step_plan_info())
        return format_summary(self._engine.stats(), self.policy, self.device.spec,
                              f"{self._engine.describe()}; {self.engine} engine", plan=plan, vmm=self.uses_vmm)

    def history(self) -> Any:  # -> gpumem.trace.Trace
        """The recorded allocation history as a :class:`gpumem.trace.Trace` (``record_history=True``).

        The trace carries the allocator's segment events in ``trace.segment_events``
        (``segment_alloc``/``segment_free`` for ``malloc``'d segments, ``segment_map``/``segment_unmap``
        per page in virtual memory), which :func:`gpumem.trace.save_pytorch_snapshot` writes, so
        PyTorch's memory viewer shows the memory the allocator really reserved over time.
        """
        return self._engine.history(f"gpumem-{self.policy.name}")

    def close(self) -> None:
        """Give all memory back to the device, after the work still using it. Live blocks become invalid.

        Note [Closing waits for the streams]: before a segment or a virtual range goes back, the
        streams that used it are synchronized (``stream_synchronize``; if that fails for a stream,
        one ``synchronize`` of the whole device is tried). Memory used by a stream that could not be
        waited for is *kept*, not given back under a kernel that may still run: it stays counted in
        :attr:`reserved_nbytes` (and :attr:`leaked_nbytes`), and a warning says how much was leaked.
        """
        self.leaked_nbytes = self._engine.close()

    def __enter__(self) -> "CachingAllocator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
