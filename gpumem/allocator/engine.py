"""The engine seam: what :class:`~gpumem.allocator.caching.CachingAllocator` asks of the engine that runs it.

Two engines make the same decisions (``tests/allocator/test_native_differential.py``): the pure-Python
reference (:class:`~gpumem.allocator.python_engine.PythonEngine`) and the C++ port of its virtual-memory
path (:class:`~gpumem.allocator.native.NativeEngine` over ``gpumem._engine``). The allocator picks one
when it is created (Note [Choosing the engine] in :mod:`.caching`), checks its own arguments, and hands
every call to the engine through :class:`Engine`. The out-of-memory error of both is built here
(:func:`oom_error`), from the numbers each engine gathers when a request fails.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import InvalidArgumentError, OutOfMemoryError
from ..units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ..trace import Trace
    from .stats import AllocatorStats

__all__ = ["Engine", "OomCause", "oom_error", "plan_hint", "too_large_hint", "no_history_error"]


@runtime_checkable
class Engine(Protocol):
    """One allocator engine over one device, under one policy.

    ``allocate`` and ``free`` are the hot path: they check their arguments themselves with
    :mod:`gpumem.validate` (the native engine in C, calling the same checks for anything unusual),
    so that the allocator can hand them out as they are. The other methods take arguments the
    allocator has checked (``ptr`` and ``stream`` ints). Every method raises the errors of
    :class:`~gpumem.allocator.caching.CachingAllocator`'s documentation.
    """

    name: str
    """``"python"`` or ``"native"``."""

    def allocate(self, nbytes: int, stream: int = 0) -> int: ...

    def free(self, ptr: int) -> None: ...

    def record_stream(self, ptr: int, stream: int) -> None: ...

    def synchronize(self) -> None: ...

    def empty_cache(self) -> int:
        """Bytes given back to the device."""
        ...

    def stats(self) -> "AllocatorStats":
        """A snapshot of the counters, derived fields (reserved, fragmentation...) filled in."""
        ...

    def reset_peak_stats(self) -> None:
        """Peaks (allocated, requested, reserved with a step plan's arena) down to the values now."""
        ...

    def reserved_nbytes(self) -> int: ...

    def allocated_nbytes(self) -> int: ...

    def releasable_nbytes(self, with_carried: bool = False) -> int:
        """The bytes giving the engine's cache back would release now (whole idle chunks, cached chunks, free
        segments; not a step plan's arena), its fences waited for; with ``with_carried``, were the READY step's
        carried allocations (live at the mark, placed by its plan) freed too. Changes nothing (Note [The room
        counts whole chunks] in :mod:`.plan`); 0 once closed, DeviceLostError once the device was lost."""
        ...

    def live_blocks(self) -> list[tuple[int, int]]: ...

    def block_size(self, ptr: int) -> int: ...

    def consistency_problems(self) -> list[str]:
        """Where the engine's bookkeeping and the device's disagree (empty: none)."""
        ...

    def describe(self) -> str:
        """The backing, in words, for ``memory_summary()``."""
        ...

    def history(self, label: str) -> "Trace":
        """The recorded history; :func:`no_history_error` when none was recorded."""
        ...

    def close(self) -> int:
        """Give everything back (idempotent); return the bytes that could not be (leaked)."""
        ...

    # step plans (Note [Step plans] in gpumem.allocator.plan)
    def mark_step(self) -> int:
        """A step boundary; a :class:`~gpumem.allocator.plan.MarkResult` value."""
        ...

    def start_plan_warmup(self) -> bool:
        """Begin the memory-first warm-up before the first mark; whether it is on (Note [A memory-first
        warm-up] in :mod:`gpumem.allocator.plan`)."""
        ...

    def stop_plan_warmup(self) -> bool:
        """Stop the memory-first warm-up as if it had not begun (its idle cache goes back); whether it was on."""
        ...

    def step_template(self, missing_ok: bool = False) -> tuple[list[int], list[int], list[int], list[int], int] | None:
        """The recorded step waiting for its plan: requested bytes, streams, free ranks (own step, next), and
        its generation (for :meth:`install_plan`); None with ``missing_ok`` when none waits."""
        ...

    def install_plan(self, offsets: list[int], generation: int | None = None) -> bool:
        """Install the READY step's plan; False (nothing installed) when ``generation`` is not the READY
        step's (Note [Step plans and threads] in :mod:`gpumem.allocator.plan`)."""
        ...

    def step_plan_info(self) -> tuple[int, ...]:
        """The plan layer's counters, in the order of :attr:`~gpumem.allocator.plan.PlanInfo.FIELDS`."""
        ...

    def set_step_record_limit(self, records: int) -> None:
        """Records a recorded step may hold before it is abandoned (Note [When marks stop] in
        :mod:`gpumem.allocator.plan`; default :data:`~gpumem.allocator.plan.RECORD_LIMIT`)."""
        ...

    def set_early_leave_steps(self, steps: int) -> None:
        """Planned steps from an install within which a step that leaves the plan drops it (Note [A plan that
        leaves early] in :mod:`gpumem.allocator.plan`; default :data:`~gpumem.allocator.plan.EARLY_LEAVE_STEPS`,
        0: never)."""
        ...


def no_history_error() -> InvalidArgumentError:
    """What :meth:`Engine.history` raises when the allocator was created without ``record_history``."""
    return InvalidArgumentError("history was not recorded: create the allocator with record_history=True")


class OomCause(enum.IntEnum):
    """Why a request failed; the values of ``OomCause`` in ``gpumem/_native/engine.h``."""

    DEVICE = 1
    """The device (or a fault injected into it) refused memory."""
    TOO_LARGE = 2
    """Larger than the device's total memory: refused at once."""
    LIMIT = 3
    """The allocator's ``limit`` is reached."""
    ADDRESS_SPACE = 4
    """The pool's virtual address range is exhausted."""


def too_large_hint(nbytes: int, size: int, total_nbytes: int) -> str:
    """The hint of an out-of-memory error for a request (``nbytes``, rounded to ``size``) that can never
    fit the device."""
    what = "The request" if size == nbytes else f"The request, rounded up to {format_bytes(size)} by the policy,"
    return (f"{what} is larger than the device's total memory ({format_bytes(total_nbytes)}), so it was "
            "refused at once. Try: use smaller batches or shorter sequences, or split the tensor.")


def plan_hint(mapped_nbytes: int, dropped_nbytes: int, live_nbytes: int) -> str:
    """The sentence of an out-of-memory error on what the step plans' arenas hold (Note [A step plan in the
    out-of-memory error])."""
    parts = []
    if mapped_nbytes > dropped_nbytes:
        parts.append(f"{format_bytes(mapped_nbytes - dropped_nbytes)} is the current step plan's arena")
    if dropped_nbytes:
        parts.append(f"{format_bytes(dropped_nbytes)} is held by the arenas of dropped step plans, until the "
                     "allocations still live in them are freed")
    return (f"Of the memory this allocator holds, {' and '.join(parts)} ({format_bytes(live_nbytes)} of the step "
            "plans' arenas in live allocations; see memory_summary()'s step plan line).")


def oom_error(cause: OomCause, nbytes: int, rounded_nbytes: int, *, free_nbytes: int, total_nbytes: int,
              device: str, allocated_nbytes: int, cached_nbytes: int, reserved_nbytes: int,
              limit_nbytes: int | None, va_nbytes: int = 0, injected: bool = False,
              segment_mode_vmm: bool | None = None, plan_mapped_nbytes: int = 0, plan_dropped_nbytes: int = 0,
              plan_live_nbytes: int = 0) -> OutOfMemoryError:
    """The :class:`~gpumem.errors.OutOfMemoryError` of a failed request, with its hint.

    The numbers are the engine's at the moment of the failure (``free_nbytes``/``total_nbytes`` from
    the device's ``mem_info()``). ``segment_mode_vmm``: None in virtual-memory mode; in segment mode,
    whether the device has virtual memory management (the hint on fragmented cached memory says
    what to try then). ``plan_*``: the step plans' arenas (Note [A step plan in the out-of-memory error]).

    Note [A step plan in the out-of-memory error]
    ---------------------------------------------
    A step plan's arena (Note [Step plans] in :mod:`.plan`) is device memory outside the engine's cache:
    its mapped pages count in *reserved* (the error's cached bytes), and those of a dropped plan stay mapped
    while a block made in a planned step and kept past it lives in them. The error named none of it, so a
    user reading it could not tell where the memory went. It now says how much the arenas hold (the current
    plan's and dropped plans'), and how much of that is live allocations; what a dropped arena holds goes
    back once those allocations are freed (at the next ``mark_step``). By the time a request fails the
    retry ladder has dropped the plan and given back every run nothing live touches (Note [Step plans
    under memory pressure]), so what is left is usually the dropped arenas' pinned runs. The figures are
    gathered by each engine (``PythonEngine._oom_error``, ``Engine::oom_error`` in ``engine.cpp``)."""
    if cause is OomCause.TOO_LARGE:
        hint = too_large_hint(nbytes, rounded_nbytes, total_nbytes)
    elif injected:
        hint = ("The device call failed because of an injected fault (the simulator's fault plan), "
                "not a real shortage of memory.")
    elif cause is OomCause.ADDRESS_SPACE:
        hint = (f"The allocator's virtual address range ({format_bytes(va_nbytes)} per pool) is exhausted, not the "
                "device's memory: free blocks of other streams that are still busy, or below live blocks, "
                "hold its address space. Free long-lived blocks, use fewer streams, or raise the policy's "
                "va_reserve_factor.")
    elif cause is OomCause.LIMIT:
        hint = (f"The allocator's limit of {format_bytes(limit_nbytes or 0)} is reached: raise `limit`, "
                "free tensors you no longer need, or use smaller batches.")
    else:
        outside = max(0, total_nbytes - free_nbytes - reserved_nbytes)
        hint = ("Try: free what you no longer need; use smaller batches or shorter sequences. "
                f"{format_bytes(outside)} of this device is held outside this allocator (this process's "
                "CUDA context, other allocators, other processes; see `gpumem devices`)")
        if segment_mode_vmm is not None and cached_nbytes > 0:
            if segment_mode_vmm:
                hint += "; the cached memory is fragmented: the 'gpumem' policy with virtual memory avoids that"
            else:
                hint += "; the cached memory is fragmented (this device has no virtual memory management)"
        hint += "."
    if plan_mapped_nbytes and cause is not OomCause.TOO_LARGE:
        hint += " " + plan_hint(plan_mapped_nbytes, plan_dropped_nbytes, plan_live_nbytes)
    return OutOfMemoryError(nbytes, free_nbytes, total_nbytes, device=device, allocated_nbytes=allocated_nbytes,
                            cached_nbytes=cached_nbytes, limit_nbytes=limit_nbytes, hint=hint, injected=injected,
                            rounded_nbytes=rounded_nbytes)
