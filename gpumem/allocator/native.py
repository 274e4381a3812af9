"""The native engine (:class:`NativeEngine` over ``gpumem._engine.Allocator``), and what its binding calls back for.

The binding (``gpumem/_native/module.cpp``) reads the policy's fields from one table that names every
field of :class:`~gpumem.allocator.policy.AllocatorPolicy` (``gpumem._engine.POLICY_FIELDS``) and
builds its stats from one that names every field of :class:`~gpumem.allocator.stats.AllocatorStats`
(``gpumem._engine.STATS_FIELDS``; ``tests/allocator/test_native_differential.py`` holds both to the
dataclasses). It runs the hot path in C++ and calls the helpers of this module on slow paths only:
argument validation with the checks (and messages) of :mod:`gpumem.validate`, and the
:class:`~gpumem.errors.OutOfMemoryError` of :func:`gpumem.allocator.engine.oom_error`, from the
numbers the engine gathered at the same moment.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Callable, NoReturn

from ..device import Device
from ..errors import (DeviceClosedError, DeviceLostError, DoubleFreeError, InternalError, InvalidArgumentError,
                      InvalidPointerError, OutOfMemoryError, UnsupportedOperationError)
from ..native import native_module
from ..units import align_up, format_bytes
from ..validate import as_int, check_nbytes, check_stream

if TYPE_CHECKING:
    from ..sim.gpu_work import GpuWorkModel
from .backing import pool_page_nbytes
from .engine import OomCause, no_history_error
from .engine import oom_error as build_oom_error
from .plan import check_early_leave_steps, check_generation, check_record_limit
from .policy import AllocatorPolicy
from .stats import AllocatorStats

__all__ = ["NativeEngine", "check_alloc_args", "as_ptr", "check_stream", "bad_pointer", "oom_error"]

log = logging.getLogger(__name__)

# error classes the binding raises (read once when an allocator is created)
INVALID_ARGUMENT = InvalidArgumentError
INVALID_POINTER = InvalidPointerError
DOUBLE_FREE = DoubleFreeError
DEVICE_LOST = DeviceLostError
DEVICE_CLOSED = DeviceClosedError
INTERNAL = InternalError
OUT_OF_MEMORY = OutOfMemoryError


class NativeEngine:
    """The C++ engine (:class:`~.engine.Engine`) over ``device`` under ``policy``: virtual-memory mode, or
    ``malloc``'d segments when not ``uses_vmm`` (Note [Segment mode] in ``gpumem/_native/engine.cpp``).

    A thin shell: the extension object's methods are this engine's methods (bound here, so that
    ``allocate`` and ``free`` run with no Python frame); only the results that need Python objects
    (the stats dataclass, the device's listings for the consistency check) pass through Python.
    Raises :class:`~gpumem.errors.BackendUnavailableError` when the extension is not built."""

    name = "native"

    def __init__(self, device: Device, policy: AllocatorPolicy, *, limit_nbytes: int | None,
                 gc_threshold: float | None, uses_vmm: bool = True) -> None:
        self.device = device
        self.uses_vmm = uses_vmm
        if uses_vmm:  # a page that is not a multiple of the granularity: refused as in Python (VirtualBacking)
            pool_page_nbytes(device, policy)
        self._ext = ext = native_module().Allocator(device, sys.modules[__name__], policy,
                                                    limit_nbytes=limit_nbytes or 0, gc_threshold=gc_threshold or 0.0,
                                                    segments=not uses_vmm)
        self.allocate = ext.allocate
        self.free = ext.free
        self.record_stream = ext.record_stream
        self.synchronize = ext.synchronize
        self.empty_cache = ext.empty_cache
        self.reserved_nbytes = ext.reserved_nbytes
        self.allocated_nbytes = ext.allocated_nbytes
        self.releasable_nbytes = ext.releasable_nbytes
        self.live_blocks = ext.live_blocks
        self.block_size = ext.block_size
        self.describe = ext.describe
        self.mark_step = ext.mark_step
        self.step_template = ext.step_template
        self.step_plan_info = ext.step_plan_info
        self.start_plan_warmup = ext.start_plan_warmup
        self.stop_plan_warmup = ext.stop_plan_warmup
        self.reset_peak_stats = ext.reset_peak_stats
        self.run_ops = ext.run_ops   # Note [A step's ops in one call] (gpumem/_native/op_table.h)
        self.lag_before = ext.lag_before   # Note [A twin that runs the program's GPU work] (gpumem/_native/pybackend.cpp)
        self.lag_after = ext.lag_after
        self.lag_stats = ext.lag_stats
        self._twin_on_close: Callable[[], None] | None = None  # use_idle_twin's callback, attached to the device

    def use_idle_twin(self, gpu_model: "GpuWorkModel | None" = None) -> None:
        """Make the device's ``mem_map``, ``mem_set_access``, ``mem_unmap`` and event calls in C++ from now on,
        keeping the device's books of them there (Note [An idle device's bookkeeping calls made here] in
        ``gpumem/_native/pybackend.cpp``), until :meth:`close`. Only for a simulated device that
        :meth:`~gpumem.sim.SimDevice.runs_alone`, while the engine holds no chunk and no event; meanwhile the device
        refuses ``launch``, ``read``, ``write``, ``add_tenant`` and ``env`` (:meth:`~gpumem.sim.SimDevice.attach_idle_twin`).

        With ``gpu_model`` the twin also runs the program's GPU work of the ``model`` timing (Note [A twin that runs
        the program's GPU work] in ``gpumem/_native/pybackend.cpp``): every op sent through :meth:`run_ops` costs the
        CPU's time and each allocation queues its kernel; an op sent through :meth:`allocate` or :meth:`free` takes
        :meth:`lag_before` before it and, for an allocation, :meth:`lag_after` after it.

        Raises:
            UnsupportedOperationError: the device is not such a device, its latency model prices a cold VMM call
                higher (``cold_vmm_us``), or (``gpu_model``) it prices calls on a busy device higher or its sanitizer
                does not raise (nothing changed).
            InvalidArgumentError: the allocator is closed, the twin is on already, the engine holds a chunk or an
                event, or (``gpu_model``) a constant is out of range (nothing changed).
        """
        attach = getattr(self.device, "attach_idle_twin", None)
        if not self.uses_vmm or attach is None:
            raise UnsupportedOperationError(
                f"the idle device twin needs a simulated device in virtual-memory mode: {self.device.spec} "
                f"{'is not simulated' if attach is None else 'runs malloc segments'}")
        lag = None if gpu_model is None else self._gpu_lag_constants(gpu_model)
        on_close = self._ext.twin_device_closed
        attach(on_close)  # raises when the device does not run alone
        try:
            if lag is None:
                self._ext.use_idle_twin()
            else:  # the twin and its lag on together: a refusal changes nothing
                self._ext.use_idle_twin(lag, self.device._clock)  # noqa: SLF001 - the twin keeps the device's clock
        except BaseException:
            self.device.detach_idle_twin(on_close)
            raise
        self._twin_on_close = on_close

    def _gpu_lag_constants(self, m: "GpuWorkModel") -> tuple[float | int, ...]:
        """The twin's lag constants: the model's and the device's latencies, computed as ProgramGpu computes them
        (the engine refuses any that is not finite and >= 0, a bandwidth not > 0)."""
        from ..sim.gpu_work import GpuWorkModel

        if not isinstance(m, GpuWorkModel):
            raise InvalidArgumentError(f"gpu_model must be a GpuWorkModel, not {type(m).__name__}")
        dev = self.device
        lat = dev.latency
        if lat.busy_factor(0) != 1.0 or lat.busy_factor_per_decade != 0.0 or lat.waits_for_device:
            raise UnsupportedOperationError(
                f"the twin's GPU lag prices every call idle: {dev.spec}'s latency model prices a busy device higher "
                "or makes calls wait for it")
        if getattr(dev, "sanitizer", "raise") != "raise":
            raise UnsupportedOperationError(
                f"the twin's GPU lag refuses what the simulator's sanitizer would raise: {dev.spec} has "
                f"sanitizer={dev.sanitizer!r}")
        if m.queue_depth > sys.maxsize:
            raise InvalidArgumentError(f"GpuWorkModel.queue_depth must be at most {sys.maxsize}, not {m.queue_depth}")
        return (m.cpu_op_us * 1e-6, m.kernel_min_us * 1e-6, m.touch_factor, m.bandwidth_bps(dev.profile), m.queue_depth,
                lat.launch_us, lat.event_record_us, lat.event_query_us, lat.event_destroy_us, lat.synchronize_us,
                lat.mem_map_us, lat.mem_set_access_us, lat.mem_set_access_mapping_us, lat.mem_set_access_mib_us,
                lat.mem_unmap_us, lat.mem_unmap_mapping_us, lat.mem_unmap_mib_us, lat.stream_wait_event_us)

    def set_step_record_limit(self, records: int) -> None:
        """The engine's limit on a recorded step's records, checked as the Python engine checks it."""
        self._ext.set_step_record_limit(check_record_limit(records))

    def set_early_leave_steps(self, steps: int) -> None:
        """The engine's early-leave bound (Note [A plan that leaves early]), checked as the Python engine checks it."""
        self._ext.set_early_leave_steps(check_early_leave_steps(steps))

    def install_plan(self, offsets: list[int], generation: int | None = None) -> bool:
        """The engine's install; ``generation`` checked as the Python engine checks it (-1: none given)."""
        generation = check_generation(generation)
        return bool(self._ext.install_plan(offsets, -1 if generation is None else generation))

    @property
    def backing(self) -> NoReturn:
        """The Python engine's backing: none here (:attr:`~.caching.CachingAllocator.backing`)."""
        raise UnsupportedOperationError("the native engine's backing is C++: create the allocator with "
                                        "engine='python' to look inside it")

    def stats(self) -> AllocatorStats:
        return AllocatorStats(**self._ext.stats())

    def consistency_problems(self) -> list[str]:
        device = self.device

        def list_device() -> tuple[list[tuple[int, int, int]], list[tuple[int, int]] | None]:
            # called by the engine under its lock (Engine::consistency_problems), so that another
            # thread's allocation cannot change the mappings between the two views
            if not self.uses_vmm:  # segment mode: the device's allocations (SegmentBacking.consistency_problems)
                return [], list(device.allocation_ranges())
            reservations = list(device.reservation_ranges()) if hasattr(device, "reservation_ranges") else None
            twin = self._ext.twin_mapping_ranges()  # the idle twin keeps the device's mappings itself
            return list(device.mapping_ranges()) if twin is None else twin, reservations

        return self._ext.consistency_problems(list_device)

    def history(self, label: str):  # -> gpumem.trace.Trace
        raise no_history_error()

    def close(self) -> int:
        try:
            self._ext.close()
        finally:
            on_close = self._twin_on_close
            if on_close is not None:
                self.device.detach_idle_twin(on_close)
                self._twin_on_close = None
        leaked = self._ext.backing_stats()["leaked_nbytes"]
        if leaked:
            log.warning("closed with %s still held on %s and not given back: work on some streams may "
                        "still use it", format_bytes(leaked), self.device.spec)
        return leaked


def check_alloc_args(nbytes: object, stream: object) -> tuple[int, int]:
    """``allocate``'s argument checks, for the arguments the binding's fast check did not let through."""
    return check_nbytes(nbytes), check_stream(stream)


def as_ptr(ptr: object) -> int:
    """A pointer argument as an int (:func:`gpumem.validate.as_int`)."""
    return as_int(ptr, "ptr")


def bad_pointer(op: str, ptr: int, closed: bool, lost: str | None) -> None:
    """Raise what the Python engine raises for a pointer outside [0, 2**64) (never a live block)."""
    if lost is not None:
        raise DeviceLostError(f"the device was lost: {lost}")
    if op == "free":
        if closed:
            raise InvalidArgumentError(f"free of {ptr:#x}: the allocator is closed")
        if ptr <= 0:
            raise InvalidArgumentError(f"ptr must be a positive address, got {ptr}")
        raise InvalidPointerError(f"free of {ptr:#x}, which this allocator did not allocate")
    if closed:
        raise InvalidArgumentError(f"record_stream of {ptr:#x}: the allocator is closed")
    raise InvalidPointerError(f"record_stream: {ptr:#x} is not a live allocation")


def oom_error(cause: int, nbytes: int, free_nbytes: int, total_nbytes: int, allocated_nbytes: int,
              cached_nbytes: int, reserved_nbytes: int, limit_nbytes: int, va_nbytes: int, cause_exc: object,
              device: str, round_nbytes: int, plan_mapped_nbytes: int = 0, plan_dropped_nbytes: int = 0,
              plan_live_nbytes: int = 0, segment_mode_vmm: bool | None = None) -> OutOfMemoryError:
    """:func:`gpumem.allocator.engine.oom_error` from the numbers the engine passes (``OomInfo`` in
    ``engine.h``; ``limit_nbytes`` 0: none; ``cause_exc``: the device's error, for ``DEVICE``;
    ``segment_mode_vmm``: None in virtual-memory mode, else the device's ``vmm_supported``)."""
    why = OomCause(cause)
    injected = why is OomCause.DEVICE and bool(getattr(cause_exc, "injected", False))
    return build_oom_error(why, nbytes, align_up(nbytes, round_nbytes), free_nbytes=free_nbytes,
                           total_nbytes=total_nbytes, device=device, allocated_nbytes=allocated_nbytes,
                           cached_nbytes=cached_nbytes, reserved_nbytes=reserved_nbytes,
                           limit_nbytes=limit_nbytes or None, va_nbytes=va_nbytes, injected=injected,
                           plan_mapped_nbytes=plan_mapped_nbytes, plan_dropped_nbytes=plan_dropped_nbytes,
                           plan_live_nbytes=plan_live_nbytes, segment_mode_vmm=segment_mode_vmm)
