"""PyTorch on gpumem: make PyTorch allocate GPU memory through gpumem's native engine.

Call :func:`install` at the very start of the program, before PyTorch touches the GPU::

    import gpumem.torch
    gpumem.torch.install()          # before the first CUDA tensor

    import torch
    model = MyModel().cuda()        # every CUDA tensor's memory now comes from gpumem
    ...
    print(gpumem.torch.memory_summary())

How it works. PyTorch lets a program replace its CUDA caching allocator, once, before CUDA is
initialised, with two C functions (``torch.cuda.memory.CUDAPluggableAllocator``). gpumem's native
library exports them (``gpumem_torch_alloc_hook``, which reports failures as the C++ exceptions
PyTorch turns into its own, and ``gpumem_torch_free``; ``gpumem_torch_malloc`` is the same allocation
for C callers, returning null on failure); each device gets one
native engine, made at its first allocation, which calls the CUDA driver directly (virtual memory:
``cuMemAddressReserve``, ``cuMemCreate``, ``cuMemMap``...). No Python runs when PyTorch allocates.

:func:`gpumem.torch_shim.install` installs gpumem through PyTorch's C++ interface instead, where
record_stream, CUDA graphs, ``torch.cuda.MemPool``, ``empty_cache`` and ``memory_stats`` reach
gpumem. What differs from PyTorch's own allocator on the path of this module (Note [What PyTorch
gives a pluggable allocator] in ``gpumem/_native/torch_api.cpp``):

* ``torch.cuda.memory_stats()``, ``memory_allocated()``, ``max_memory_reserved()``,
  ``memory_summary()`` and snapshots raise: PyTorch does not ask a pluggable allocator for them.
  Use :func:`memory_stats` and :func:`memory_summary` here.
* ``torch.cuda.empty_cache()`` does nothing: use :func:`empty_cache`.
* ``Tensor.record_stream(stream)`` does nothing (PyTorch does not pass it on). Frees are
  stream-ordered on the stream a tensor was allocated on; a tensor also used on another stream
  must stay alive until that stream is done with it, or be announced with :func:`record_stream`.
* Out of memory raises ``torch.OutOfMemoryError`` as usual, with gpumem's figures in its message.
* ``torch.cuda.memory._record_memory_history`` records nothing either: :func:`start_trace` records
  every allocation and free PyTorch asks gpumem for, :func:`recorded_trace` gives them as a gpumem
  trace (replay it with ``gpumem replay``); ``GPUMEM_TRACE_OUT=run.gmt.gz`` does both for a whole
  program (the trace is written at exit). :func:`configure` gives the engine a policy's growth knobs.
  Every optimizer step marks a step plan's step, with no :func:`step` call in the loop (automatic step
  marks, on by default; ``GPUMEM_STEP_MARKS=off`` or ``configure(step_marks=None)`` turns them off).
* CUDA graph capture (``torch.cuda.graph``, ``torch.cuda.make_graphed_callables``, and
  ``torch.compile`` with ``mode="reduce-overhead"``, ``mode="max-autotune"`` or
  ``backend="cudagraphs"``) raises :class:`~gpumem.errors.UnsupportedOperationError` before anything
  is captured: PyTorch gives these two functions no private graph pool, so memory a graph allocated
  would go to other tensors while the graph replays (Note [No graph capture through two C
  functions]). :func:`gpumem.torch_shim.install` supports capture.
"""

from __future__ import annotations

import ctypes
import atexit
import dataclasses
import functools
import importlib
import inspect
import logging
import os
import sys
import threading
import weakref
from typing import Any, Callable

from .errors import BackendUnavailableError, GpumemError, InvalidArgumentError, UnsupportedOperationError
from .marker_rule import HANDOVER_MIN_STEPS, RARER_GAPS, MarkerRule  # re-exported: the rule the Note below gives
from .native import library_path
from .units import format_bytes

__all__ = ["install", "installed", "memory_stats", "memory_summary", "empty_cache", "record_stream", "step",
           "step_plan_info", "trace_wait_stream",
           "TooLateError", "configure", "start_trace", "stop_trace", "recorded_trace", "trace_from_words",
           "automatic_step_marks", "TRACE_OUT_ENV", "STEP_MARKS_ENV", "STEP_MARKS", "DEFAULT_STEP_MARKS", "STEP_MARKS_OFF"]

#: Environment variable: when set, :func:`install` starts tracing and the trace of device 0 is written
#: to this path (a gpumem ``.gmt`` trace, gzipped when the name ends in ``.gz``) when the process exits.
TRACE_OUT_ENV = "GPUMEM_TRACE_OUT"
#: Environment variable read by :func:`install`: one of :data:`STEP_MARKS` turns automatic step marks on, as
#: ``configure(step_marks=...)`` does, ``off`` (:data:`STEP_MARKS_OFF`) leaves them off; unset or empty,
#: :data:`DEFAULT_STEP_MARKS` where PyTorch has the global optimizer hook (Note [Automatic step marks]).
STEP_MARKS_ENV = "GPUMEM_STEP_MARKS"
#: What ``configure(step_marks=...)`` takes besides ``None`` (off): ``"optimizer"``, every step of a PyTorch
#: optimizer marks a step (Note [Automatic step marks]).
STEP_MARKS = ("optimizer",)
#: The automatic step marks :func:`install` turns on when ``GPUMEM_STEP_MARKS`` is unset.
DEFAULT_STEP_MARKS = "optimizer"
#: ``GPUMEM_STEP_MARKS=off``: no automatic step marks.
STEP_MARKS_OFF = "off"

log = logging.getLogger(__name__)

ALLOC_FN = "gpumem_torch_alloc_hook"  # throws: Note [Two alloc functions: one for C, one for PyTorch]
FREE_FN = "gpumem_torch_free"


class TooLateError(GpumemError):
    """:func:`install` was called after PyTorch had initialised CUDA (its allocator is then fixed)."""


def _torch(who: str = "gpumem.torch") -> Any:
    """The ``torch`` module, or :class:`BackendUnavailableError` saying that ``who`` needs it."""
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailableError(f"PyTorch is not installed ({exc}); {who} needs it") from None
    return torch


# Note [Installing once]: PyTorch takes one allocator per process, so the pluggable allocator is
# made and installed once; functools.cache keeps it (and is how `installed()` knows). A failed
# install raises, caches nothing and may be retried. Where gpumem.torch_shim.install() came first,
# gpumem is PyTorch's allocator already and install() makes no second one (PyTorch would refuse it,
# which read as "called too late"); the shim called after install() says so and stays on the two
# C hooks (gpumem.torch_shim._installed).
@functools.cache
def _installed_allocator() -> Any:
    torch = _torch()
    if not torch.cuda.is_available():
        raise BackendUnavailableError("PyTorch sees no CUDA device (torch.cuda.is_available() is False)")
    if torch.cuda.is_initialized():
        raise TooLateError(
            "gpumem.torch.install() was called after PyTorch initialised CUDA, when its allocator can no longer be "
            "replaced; call it at the start of the program, before the first CUDA tensor, torch.cuda.init() or "
            "anything else that uses the GPU")
    allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path(), ALLOC_FN, FREE_FN)
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as exc:  # "Can't swap an already initialized allocator"
        if _shim_is_allocator():   # the shim won, in another thread (Note [Installing once])
            return None
        raise TooLateError(f"PyTorch refused to change its CUDA allocator ({exc}); call gpumem.torch.install() "
                           "before PyTorch first uses the GPU") from None
    _refuse_graph_capture(torch)
    log.info("PyTorch allocates through gpumem (%s)", library_path())
    return allocator


# Note [No graph capture through two C functions]: a CUDA graph replays its kernels on the addresses it was
# captured with, so PyTorch serves a capture from a private pool (beginAllocateToPool) whose blocks no tensor
# outside the graph gets while the graph lives. A pluggable allocator installed from Python has only its alloc
# and free functions: nothing tells it that a capture began, and a block the graph freed at the end of capture
# goes back to the engine's cache, to be handed to the next tensor while replays still write it. The engine's
# own calls fail the capture besides: a growth (cuMemCreate, cuMemMap) or a fence query on a capturing stream is
# refused in the default (global) capture mode, which PyTorch reports only at capture_end, as "operation failed
# due to a previous error during capture" (live on the H200: reports/hil/workloads-today-h200-2026-11-30.md).
# A capture that allocates nothing would be safe, but it cannot be told apart in advance, and a silent
# corruption is the worse failure. So install() wraps the doors of a capture to raise before anything happens:
# CUDAGraph.capture_begin (every capture from Python), torch.cuda.graph's __enter__ (which switches the current
# stream first; torch.compile's CUDA-graph trees enter one when made), and make_graphed_callables (which runs
# warm-up passes first, updating BatchNorm statistics and the RNG), each under every name PyTorch binds it to.
# The refusal names gpumem.torch_shim, whose C++ hooks give each graph a pool of its own (where the shim fell back
# to these two functions, its warning said why). What it cannot see: captures begun in C++ (an extension's
# at::cuda::CUDAGraph), a call to the C base class (torch._C._CUDAGraph.capture_begin) or to a wrapper's
# __wrapped__, a subclass whose capture_begin does not call super(), and a name bound before install() (`from
# torch.cuda import make_graphed_callables` runs its warm-up before the graph's refusal: install first). Guarding
# the doors must never fail an install that succeeded: a door that cannot be read or wrapped is logged, the others
# are guarded.
GRAPH_CAPTURE_REFUSED = (
    "CUDA graph capture is not supported when gpumem is PyTorch's allocator through its two C functions "
    "(gpumem.torch.install(), or gpumem.torch_shim.install() where the shim could not be built): PyTorch gives "
    "them no private graph pool, so memory the graph allocates would be handed to other tensors while the graph "
    "replays. Install gpumem with gpumem.torch_shim.install() (its C++ hooks give each graph a pool of its own; it "
    "needs ninja, a C++ compiler and the CUDA headers), or capture under PyTorch's own allocator.")


def _lookup(owner: Any, name: str) -> Any:
    """``owner.name``, or None where it is missing or its lookup raises anything (logged: a lazy attribute of a
    PyTorch that cannot be read must not keep the other doors from being guarded)."""
    try:
        return getattr(owner, name, None)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("gpumem.torch: could not look at %s of PyTorch to refuse CUDA graph capture there (%s: %s)",
                    name, type(exc).__name__, exc)
        return None


def _graph_doors(torch: Any) -> list[tuple[Any, str]]:
    """``(owner, attribute)`` of every door of a CUDA graph capture in ``torch`` (Note [No graph capture through two
    C functions]), each distinct class once: the ``CUDAGraph`` classes' ``capture_begin``, the ``graph`` context
    managers' ``__enter__``, and each module's ``make_graphed_callables``."""
    cuda = _lookup(torch, "cuda")
    doors: list[tuple[Any, str]] = []
    seen: set[int] = set()
    for module in (_lookup(cuda, "graphs"), cuda):
        if module is None:
            continue
        for attr, name in (("CUDAGraph", "capture_begin"), ("graph", "__enter__")):
            cls = _lookup(module, attr)
            if isinstance(cls, type) and id(cls) not in seen and _lookup(cls, name) is not None:
                seen.add(id(cls))
                doors.append((cls, name))
        if callable(_lookup(module, "make_graphed_callables")):
            doors.append((module, "make_graphed_callables"))
    return doors


def _refusing(original: Any) -> Any:
    """``original`` (a door of a CUDA graph capture) wrapped to raise :data:`GRAPH_CAPTURE_REFUSED`, unless gpumem's
    C++ shim is PyTorch's allocator (which PyTorch does not let take over from the two C functions; a guard)."""

    @functools.wraps(original)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        if _shim_is_allocator():
            return original(*args, **kwargs)
        raise UnsupportedOperationError(GRAPH_CAPTURE_REFUSED)

    return refuse


def _refused_door(owner: Any, name: str) -> Any:
    """What ``owner.name`` becomes: the door wrapped by :func:`_refusing`, as the same kind of attribute (a static or
    class method of a class stays one)."""
    raw = inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)
    if isinstance(raw, (staticmethod, classmethod)):
        return type(raw)(_refusing(raw.__func__))
    return _refusing(raw)


def _refuse_graph_capture(torch: Any) -> None:
    """Every door of a CUDA graph capture made to raise :data:`GRAPH_CAPTURE_REFUSED` (Note [No graph capture
    through two C functions]); installed once, with the allocator. Never raises: a door that cannot be found or
    wrapped is logged."""
    try:
        doors = _graph_doors(torch)
    except Exception as exc:  # noqa: BLE001 - guarding the doors must not fail an install that succeeded
        log.warning("gpumem.torch: could not find PyTorch's CUDA graph capture to refuse it (%s); a capture will "
                    "fail only at its end, or silently share the graph's memory", exc)
        return
    for owner, name in doors:
        try:
            setattr(owner, name, _refused_door(owner, name))
        except Exception as exc:  # noqa: BLE001 - as above
            try:
                where = f"{owner.__name__}.{name}"
            except Exception:  # noqa: BLE001 - a name that cannot be read is not worth a failed install
                where = name
            log.warning("gpumem.torch: could not refuse CUDA graph capture at %s (%s)", where, exc)


def install(device: "int | str | Any | None" = None) -> None:
    """Make PyTorch allocate all its CUDA memory through gpumem's native engine.

    Call it once, at program start, before PyTorch first uses the GPU (a CUDA tensor,
    ``torch.cuda.init()``, ``torch.cuda.current_device()``...): PyTorch can change its allocator only
    before that. Calling it again is harmless.

    Args:
        device: ``None`` (the default) starts gpumem on each device at its first allocation. A device
            (``0``, ``"cuda:1"``, ``torch.device("cuda", 1)``) starts gpumem's engine there now, so that a
            device gpumem cannot run on (no virtual memory management) fails here rather than at the
            first allocation. No memory is taken.

    ``GPUMEM_TRACE_OUT`` (:data:`TRACE_OUT_ENV`) traces the whole program. Automatic step marks are turned
    on (every optimizer step marks a step plan's step, as ``configure(step_marks="optimizer")`` does) unless
    ``GPUMEM_STEP_MARKS`` (:data:`STEP_MARKS_ENV`) is ``off``, ``configure(step_marks=None)`` came first, or
    PyTorch has no global optimizer hook (before 2.0). Both variables are read at the first call that
    installs them. Making the two C functions PyTorch's allocator also makes every CUDA graph capture of this
    process raise :class:`~gpumem.errors.UnsupportedOperationError` (Note [No graph capture through two C
    functions]): capture needs :func:`gpumem.torch_shim.install`. Where that came first, gpumem is PyTorch's
    allocator already: no second one is made (Note [Installing once]).

    Raises:
        TooLateError: PyTorch had already initialised CUDA, and gpumem is not its allocator.
        BackendUnavailableError: PyTorch, a CUDA device or gpumem's native engine is missing
            (see :func:`gpumem.engine`).
        InvalidArgumentError: ``GPUMEM_STEP_MARKS`` holds a value not in :data:`STEP_MARKS` and not ``off``
            (nothing installed).
        BackendUnavailableError: ``GPUMEM_STEP_MARKS=optimizer`` and PyTorch has no global optimizer hook
            (nothing installed).
        GpumemError: gpumem could not start on ``device``.
    """
    index = None if device is None else _device_index(device, default_current=False)
    marks = _env_step_marks()   # checked before anything is installed: a bad value changes nothing
    if not _shim_is_allocator():   # Note [Installing once]
        _installed_allocator()
    out = os.environ.get(TRACE_OUT_ENV)
    if out and not _trace_at_exit.cache_info().currsize:
        _trace_at_exit(out)
    if marks and not _step_marks_from_env.cache_info().currsize:
        _step_marks_from_env(marks)
    if index is not None:
        lib = _lib()
        if lib.gpumem_torch_start(index) != 0:
            raise GpumemError(f"gpumem could not start on cuda:{index}: {_last_error(lib)}")


@functools.cache
def _installed_through_shim() -> None:
    """Called by :mod:`gpumem.torch_shim` once its C++ shim is PyTorch's allocator: the cache is how
    :func:`installed` knows (Note [Installing once]), without this module reading the shim's."""


def _shim_is_allocator() -> bool:
    """Whether :mod:`gpumem.torch_shim` made its C++ shim PyTorch's allocator here (Note [Installing once])."""
    return _installed_through_shim.cache_info().currsize > 0


def _installed_through_c_hooks() -> bool:
    """Whether :func:`install` made its two C functions PyTorch's allocator here (Note [Installing once])."""
    return _installed_allocator.cache_info().currsize > 0


def installed() -> bool:
    """Whether :func:`install` (or :func:`gpumem.torch_shim.install`) made gpumem PyTorch's allocator here."""
    return _installed_through_c_hooks() or _shim_is_allocator()


@functools.cache
def _lib() -> ctypes.CDLL:
    """The native library through ctypes, for the stats accessors (never on the allocation path)."""
    lib = ctypes.CDLL(library_path())
    u64p = ctypes.POINTER(ctypes.c_uint64)
    lib.gpumem_torch_stat_names.restype = ctypes.c_char_p
    lib.gpumem_torch_stat_names.argtypes = []
    lib.gpumem_torch_stats.restype = ctypes.c_int
    lib.gpumem_torch_stats.argtypes = [ctypes.c_int, u64p, ctypes.c_int]
    lib.gpumem_torch_empty_cache.restype = ctypes.c_int
    lib.gpumem_torch_empty_cache.argtypes = [ctypes.c_int, u64p]
    lib.gpumem_torch_releasable.restype = ctypes.c_int
    lib.gpumem_torch_releasable.argtypes = [ctypes.c_int, ctypes.c_int, u64p]
    lib.gpumem_torch_record_stream.restype = ctypes.c_int
    lib.gpumem_torch_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.gpumem_torch_trace_wait_stream.restype = ctypes.c_int
    lib.gpumem_torch_trace_wait_stream.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.gpumem_torch_start.restype = ctypes.c_int
    lib.gpumem_torch_start.argtypes = [ctypes.c_int]
    lib.gpumem_torch_engine_state.restype = ctypes.c_int
    lib.gpumem_torch_engine_state.argtypes = [ctypes.c_int]
    lib.gpumem_torch_last_error.restype = ctypes.c_char_p
    lib.gpumem_torch_last_error.argtypes = []
    lib.gpumem_torch_trace.restype = None
    lib.gpumem_torch_trace.argtypes = [ctypes.c_int]
    lib.gpumem_torch_trace_read.restype = ctypes.c_int64
    lib.gpumem_torch_trace_read.argtypes = [ctypes.c_int, u64p, ctypes.c_int64]
    lib.gpumem_torch_trace_gpu_clock.restype = None
    lib.gpumem_torch_trace_gpu_clock.argtypes = [ctypes.c_int]
    lib.gpumem_torch_trace_gpu_read.restype = ctypes.c_int64
    lib.gpumem_torch_trace_gpu_read.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    lib.gpumem_torch_trace_reserved_read.restype = ctypes.c_int64
    lib.gpumem_torch_trace_reserved_read.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    lib.gpumem_torch_step_mark.restype = ctypes.c_int
    lib.gpumem_torch_step_mark.argtypes = [ctypes.c_int]
    lib.gpumem_torch_step_template.restype = ctypes.c_int64
    lib.gpumem_torch_step_template.argtypes = [ctypes.c_int, u64p, ctypes.c_int64, u64p]
    lib.gpumem_torch_step_install.restype = ctypes.c_int
    lib.gpumem_torch_step_install.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                              ctypes.c_int64]
    lib.gpumem_torch_step_info.restype = ctypes.c_int
    lib.gpumem_torch_step_info.argtypes = [ctypes.c_int, u64p, ctypes.c_int]
    lib.gpumem_torch_configure.restype = ctypes.c_int
    lib.gpumem_torch_configure.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.c_double, ctypes.c_double,
                                           ctypes.c_int, ctypes.c_double, ctypes.c_int, ctypes.c_uint64, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.gpumem_torch_plan_warmup.restype = ctypes.c_int
    lib.gpumem_torch_plan_warmup.argtypes = [ctypes.c_int]
    return lib


def _last_error(lib: ctypes.CDLL) -> str:
    return (lib.gpumem_torch_last_error() or b"").decode("utf-8", "replace")


def _device_index(device: "int | str | Any | None", default_current: bool = True) -> int:
    """A CUDA device index from an int, ``"cuda:N"``, ``torch.device`` or ``None`` (the current device)."""
    if device is None:
        if not default_current:
            raise InvalidArgumentError("no device given")
        return int(_torch().cuda.current_device())
    if isinstance(device, bool):
        raise InvalidArgumentError(f"not a CUDA device: {device!r}")
    if isinstance(device, int):
        index = device
    else:
        text = str(device)
        kind, _, rest = text.partition(":")
        if kind != "cuda":
            raise InvalidArgumentError(f"not a CUDA device: {device!r} (expected an index, 'cuda:N' or a torch.device)")
        if rest == "":
            index = getattr(device, "index", None)
            if index is None:
                return int(_torch().cuda.current_device())
        else:
            try:
                index = int(rest)
            except ValueError:
                raise InvalidArgumentError(f"not a CUDA device: {device!r}") from None
    if index < 0:
        raise InvalidArgumentError(f"CUDA device index must be >= 0, got {index}")
    return index


def _require_installed() -> None:
    if not installed():
        raise GpumemError("gpumem is not PyTorch's allocator in this process: call gpumem.torch.install() first "
                          "(at program start)")


def _raw_stats(index: int) -> dict[str, int]:
    lib = _lib()
    names = lib.gpumem_torch_stat_names().decode().split(",")
    values = (ctypes.c_uint64 * len(names))()
    n = lib.gpumem_torch_stats(index, values, len(names))
    if n < 0:
        raise GpumemError(f"gpumem could not read its stats on cuda:{index}: {_last_error(lib)}")
    if n == 0:  # no engine on this device yet: nothing allocated there
        return {name: 0 for name in names}
    return {name: int(values[i]) for i, name in enumerate(names[:n])}


def memory_stats(device: "int | str | Any | None" = None) -> dict[str, int]:
    """What gpumem holds for PyTorch on ``device`` (default: the current device), as a flat dict.

    The keys PyTorch's ``torch.cuda.memory_stats()`` uses where the quantity is the same (all bytes,
    ``.all`` pools together):

    * ``allocated_bytes.all.current`` / ``.peak`` - bytes in live tensors' blocks (sizes rounded up
      to 512 bytes, as PyTorch counts them);
    * ``requested_bytes.all.current`` / ``.peak`` - bytes PyTorch asked for;
    * ``reserved_bytes.all.current`` / ``.peak`` - device memory gpumem holds (mapped physical pages):
      the figure that decides whether another process still fits on the GPU;
    * ``active_bytes.all.current``, ``inactive_split_bytes.all.current``;
    * ``num_alloc_retries``, ``num_ooms`` (allocations that failed for lack of memory);
    * ``num_allocs``, ``num_frees``, ``num_device_calls`` (driver memory calls: create, map, set
      access, unmap, release), ``num_event_calls``.

    and every counter of gpumem's engine under ``gpumem.<name>`` (``gpumem.n_chunks``,
    ``gpumem.n_steals``, ``gpumem.va_nbytes``...), with the host's wall time inside its driver calls since
    the engine was made, in nanoseconds: ``gpumem.driver_memory_ns`` (create, map, set access, unmap,
    release), ``gpumem.driver_event_ns`` (event record, query, destroy) and ``gpumem.driver_wait_ns``
    (synchronizations): what a policy's calls add to the thread that allocates (Note [Time in driver calls]
    in ``gpumem/_native/cuda_backend.h``); and the hooks' wall time in the engine's slow path (an allocation or
    free its fast path does not serve: searches, growth, steals, fences, driver calls included),
    ``gpumem.engine_slow_ns`` over ``gpumem.engine_slow_calls`` calls (Note [Time in the engine's slow path] in
    ``gpumem/_native/torch_api.cpp``). Before the first allocation on ``device`` every value is 0.

    Raises:
        GpumemError: :func:`install` was not called in this process.
    """
    _require_installed()
    raw = _raw_stats(_device_index(device))
    out = {
        "allocated_bytes.all.current": raw["allocated_nbytes"],
        "allocated_bytes.all.peak": raw["peak_allocated_nbytes"],
        "requested_bytes.all.current": raw["requested_nbytes"],
        "requested_bytes.all.peak": raw["peak_requested_nbytes"],
        "reserved_bytes.all.current": raw["reserved_nbytes"],
        "reserved_bytes.all.peak": raw["peak_reserved_nbytes"],
        "active_bytes.all.current": raw["active_nbytes"],
        "inactive_split_bytes.all.current": raw["inactive_split_nbytes"],
        "num_alloc_retries": raw["num_alloc_retries"],
        "num_ooms": raw["torch_ooms"],
        "num_allocs": raw["num_allocs"],
        "num_frees": raw["num_frees"],
        "num_device_calls": raw["device_calls"],
        "num_event_calls": raw["event_calls"],
    }
    out.update({f"gpumem.{k}": v for k, v in raw.items()})
    return out


def memory_summary(device: "int | str | Any | None" = None) -> str:
    """A text table of :func:`memory_stats` for ``device`` (default: the current device).

    Memory rows give the current and peak bytes; ``overhead`` is how much more device memory gpumem
    holds than live tensors take (peak reserved over peak allocated, minus one).
    """
    st = memory_stats(device)
    index = _device_index(device)
    plan = step_plan_info(index)
    # Note [The step plan's arena in the summary] (gpumem/allocator/stats.py): the arena's free bytes are no
    # split block of the engine's cache
    arena_free = max(0, plan.mapped_nbytes - plan.live_nbytes)

    def row(label: str, key: str, less: int = 0) -> str:
        cur, peak = st[f"{key}.all.current"], st[f"{key}.all.peak"] if f"{key}.all.peak" in st else None
        cur = max(0, cur - less)
        return f"| {label:<22} | {format_bytes(cur):>12} | {format_bytes(peak) if peak is not None else '':>12} |"

    peak_alloc, peak_res = st["allocated_bytes.all.peak"], st["reserved_bytes.all.peak"]
    overhead = f"{(peak_res / peak_alloc - 1) * 100:.2f} %" if peak_alloc else "n/a"
    lines = [
        f"gpumem memory summary, cuda:{index} (PyTorch on gpumem's native engine)",
        f"| {'memory':<22} | {'current':>12} | {'peak':>12} |",
        f"|{'-' * 24}|{'-' * 14}|{'-' * 14}|",
        row("allocated (blocks)", "allocated_bytes"),
        row("requested", "requested_bytes"),
        row("reserved (mapped)", "reserved_bytes"),
        row("active", "active_bytes"),
        row("inactive split", "inactive_split_bytes", arena_free),
        "",
        f"overhead (peak reserved / peak allocated - 1): {overhead}",
        f"allocations {st['num_allocs']:,}, frees {st['num_frees']:,}, out of memory {st['num_ooms']:,}, "
        f"retries {st['num_alloc_retries']:,}",
        f"driver memory calls {st['num_device_calls']:,}, event calls {st['num_event_calls']:,}, "
        f"chunks {st['gpumem.n_chunks']:,}, steals {st['gpumem.n_steals']:,}, waits {st['gpumem.n_waits']:,}",
        f"address space reserved {format_bytes(st['gpumem.va_nbytes'])}, page {format_bytes(st['gpumem.granularity_nbytes'])}",
        f"time in driver calls: memory {st['gpumem.driver_memory_ns'] / 1e6:,.1f} ms, events "
        f"{st['gpumem.driver_event_ns'] / 1e6:,.1f} ms, waits {st['gpumem.driver_wait_ns'] / 1e6:,.1f} ms; "
        f"in the engine's slow path {st['gpumem.engine_slow_ns'] / 1e6:,.1f} ms over {st['gpumem.engine_slow_calls']:,} calls",
    ]
    if plan.mapped_nbytes or plan.state_name != "OFF":
        lines.append(f"step plan: {plan.state_name}, {plan.slots} slots, arena {format_bytes(plan.mapped_nbytes)} mapped, "
                     f"{format_bytes(plan.live_nbytes)} live (in reserved and allocated, not in inactive split)")
    if st["gpumem.free_errors"] or st["gpumem.torch_errors"]:
        lines.append(f"errors: {st['gpumem.torch_errors']} failed allocations, {st['gpumem.free_errors']} failed frees "
                     "(see stderr)")
    return "\n".join(lines)


def empty_cache(device: "int | str | Any | None" = None) -> int:
    """Give the device memory gpumem caches but no tensor uses back to the driver; returns the bytes released.

    ``torch.cuda.empty_cache()`` does not reach a pluggable allocator: call this instead. Memory whose
    free is still pending on a stream is released once that stream's work is done.
    """
    _require_installed()
    index = _device_index(device)
    lib = _lib()
    released = ctypes.c_uint64(0)
    if lib.gpumem_torch_empty_cache(index, ctypes.byref(released)) != 0:
        raise GpumemError(f"gpumem could not empty its cache on cuda:{index}: {_last_error(lib)}")
    return int(released.value)


def record_stream(tensor: Any, stream: Any) -> None:
    """``tensor.record_stream(stream)`` for gpumem: ``tensor`` is also used on ``stream``.

    When ``tensor`` is freed, its memory is not reused until the work queued on ``stream`` so far is
    done (PyTorch's own ``Tensor.record_stream`` does not reach a pluggable allocator).
    """
    _require_installed()
    ptr = int(tensor.untyped_storage().data_ptr())
    if ptr == 0:
        return  # a zero-size tensor has no memory
    handle = int(getattr(stream, "cuda_stream", stream))
    lib = _lib()
    if lib.gpumem_torch_record_stream(ctypes.c_void_p(ptr), ctypes.c_void_p(handle)) != 0:
        raise GpumemError(f"gpumem could not record the stream for the tensor at {ptr:#x}: {_last_error(lib)}")


def trace_wait_stream(stream: Any, waited: Any, device: "int | str | Any | None" = None) -> None:
    """Tell gpumem's trace (:func:`start_trace`) that ``stream`` waits for the work queued on ``waited`` so
    far: call it beside ``stream.wait_stream(waited)``, which passes no allocator call and so is not seen
    otherwise. Kept as a :class:`~gpumem.trace.StreamWait`, which a replay's simulated GPU honours (Note
    [Cross-stream waits] in :mod:`gpumem.sim.gpu_work`). Nothing is recorded while tracing is off.
    ``device`` defaults to ``stream``'s (else the current device)."""
    _require_installed()
    if device is None:
        device = getattr(stream, "device", None)
    index = _device_index(device)
    lib = _lib()
    s = int(getattr(stream, "cuda_stream", stream))
    w = int(getattr(waited, "cuda_stream", waited))
    if lib.gpumem_torch_trace_wait_stream(index, ctypes.c_void_p(s), ctypes.c_void_p(w)) != 0:
        raise GpumemError(f"gpumem could not trace the wait of stream {s:#x} on {w:#x}: {_last_error(lib)}")


def step(device: "int | str | Any | None" = None) -> Any:
    """Mark a step boundary of a repeating loop on ``device`` (default: the current device): opt in to
    step plans (Note [Step plans] in :mod:`gpumem.allocator.plan`).

    Call it at the same point of every step, where the fewest tensors are alive (the top of the training
    loop). The first call starts recording the step's allocations; once two recorded steps allocate the
    same sizes on the same streams, the first is planned here (a few hundredths of a second of numpy) and
    every later step's allocations come from one arena at planned offsets, with no driver call; a step that
    differs is served by gpumem's engine as without a plan, and three differing steps in a row (or four of
    the last eight) drop the plan and record again. The first call also begins the memory-first warm-up: the
    engine grows in one-page chunks until the plan is installed (at most eight marks; Note [A memory-first
    warm-up] in :mod:`gpumem.allocator.plan`), so call it from the first step on. Without calls to ``step()``
    nothing changes. Returns
    what the call did (:class:`gpumem.allocator.plan.MarkResult`). Threads may mark the same device: a
    READY step that another thread's mark took while this call planned it is not installed (Note [Step
    plans and threads]). With ``configure(step_marks="optimizer")`` every optimizer step marks instead;
    a program that calls ``step()`` as well keeps its own marks and the optimizer's stop (Note [Automatic
    step marks]).

    Raises:
        GpumemError: :func:`install` was not called in this process, or gpumem could not mark the step
            (no engine could start on ``device``; a plan the engine refused).
    """
    _require_installed()
    index = _device_index(device)
    _auto_marks().marked_by_hand(index)
    return _mark_step(index)


def _mark_step(index: int) -> Any:
    """The mark of :func:`step` on device ``index`` (also the optimizer hook's: Note [Automatic step marks])."""
    import numpy as np

    from .allocator.plan import MAX_ARENA_NBYTES, MarkResult, StepTemplate, plan_step_and_height

    lib = _lib()
    code = lib.gpumem_torch_step_mark(index)
    if code < 0:
        raise GpumemError(f"gpumem could not mark a step on cuda:{index}: {_last_error(lib)}")
    result = MarkResult(code)
    if result is MarkResult.READY:
        u64p = ctypes.POINTER(ctypes.c_uint64)
        generation, again = ctypes.c_uint64(0), ctypes.c_uint64(0)
        n = int(lib.gpumem_torch_step_template(index, None, 0, ctypes.byref(generation)))
        if n < 0:
            raise GpumemError(f"gpumem could not read the recorded step on cuda:{index}: {_last_error(lib)}")
        words = np.zeros(4 * n, dtype=np.uint64)
        if n == 0 or int(lib.gpumem_torch_step_template(index, words.ctypes.data_as(u64p), n,
                                                        ctypes.byref(again))) != n or again.value != generation.value:
            return result   # another thread's mark took the step (Note [Step plans and threads])
        ranks = words.view(np.int64)
        t = StepTemplate(ranks[0::4], words[1::4], ranks[2::4], ranks[3::4])
        page_nbytes = _raw_stats(index).get("granularity_nbytes") or None   # the arena's page (its device's)
        room = _plan_room_nbytes(index, t.carried_nbytes())
        refused = _refused_plans().on(index)
        if not refused.worth_planning(t, room or MAX_ARENA_NBYTES):
            return result   # refused before in no less room (Note [A plan taller than the device])
        offsets, height = plan_step_and_height(t, page_nbytes=page_nbytes, limit_nbytes=room)
        if refused.note(t, room or MAX_ARENA_NBYTES, offsets):
            log.warning("gpumem.torch: the recorded step's plan on cuda:%d needs %s (its arena and what gpumem serves "
                        "beside it in the step) and gpumem has room for %s there (free memory plus the idle chunks its "
                        "cache can give back): no step plan, gpumem serves the step as it does where no plan forms, "
                        "and this step is not planned again until the room grows (Notes [The room counts whole chunks] "
                        "and [A plan taller than the device] in gpumem.allocator.plan)", index, format_bytes(height),
                        format_bytes(room or MAX_ARENA_NBYTES))
        if (offsets >= 0).any():
            offsets = np.ascontiguousarray(offsets, dtype=np.int64)
            code = lib.gpumem_torch_step_install(index, offsets.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), n,
                                                 generation.value)
            if code == -2:   # the arena's memory or address range: this step runs as where no plan forms
                log.warning("gpumem.torch: the step plan's arena could not be reserved on cuda:%d (%s): no step "
                            "plan, the engine serves the step", index, _last_error(lib))
            elif code < 0:
                raise GpumemError(f"gpumem refused the step plan on cuda:{index}: {_last_error(lib)}")
            if code == 0:
                log.info("gpumem.torch: a step plan of %d allocations is installed on cuda:%d",
                         int((offsets >= 0).sum()), index)
    _warmups().after_mark(index)
    return result


def _plan_room_nbytes(index: int, carried_nbytes: int = 0) -> int | None:
    """The room a step plan has on cuda:``index`` (:func:`gpumem.allocator.plan.plan_room_nbytes`: the device's
    memory, at most its free bytes plus the chunks of gpumem's idle cache there that hold no live block, the carried
    allocations counted as freed; Note [The room counts whole chunks]); None
    where PyTorch is not loaded, has no CUDA or cannot say (the tests' stand-in engines)."""
    from .allocator.plan import plan_room_nbytes

    cuda = getattr(sys.modules.get("torch"), "cuda", None)   # a mark comes from a PyTorch program: never imported
    try:
        if cuda is None or not cuda.is_available():
            return None
        free_nbytes, total_nbytes = cuda.mem_get_info(index)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    raw = _raw_stats(index)
    return plan_room_nbytes(int(total_nbytes), int(free_nbytes), raw.get("reserved_nbytes", 0),
                            raw.get("allocated_nbytes", 0), carried_nbytes=carried_nbytes,
                            releasable_nbytes=_releasable_nbytes(index))


def _releasable_nbytes(index: int) -> int:
    """What :func:`empty_cache` would give back on cuda:``index`` now were the READY step's carried allocations
    freed (whole idle chunks and cached ones; Note [The room counts whole chunks] in gpumem.allocator.plan),
    changing nothing."""
    lib = _lib()
    nbytes = ctypes.c_uint64(0)
    if lib.gpumem_torch_releasable(index, 1, ctypes.byref(nbytes)) != 0:
        raise GpumemError(f"gpumem could not read its releasable cache on cuda:{index}: {_last_error(lib)}")
    return int(nbytes.value)


@dataclasses.dataclass
class _RefusedPlansByDevice:
    """Each device's :class:`gpumem.allocator.plan.RefusedPlans`; one per process (:func:`_refused_plans`)."""

    by_index: dict[int, Any] = dataclasses.field(default_factory=dict)   # guarded by lock
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def on(self, index: int) -> Any:
        from .allocator.plan import RefusedPlans

        with self.lock:
            return self.by_index.setdefault(index, RefusedPlans())


@functools.cache
def _refused_plans() -> _RefusedPlansByDevice:
    return _RefusedPlansByDevice()


@dataclasses.dataclass
class _Warmups:
    """Whether each device's engine was in its memory-first warm-up at the last mark, to log when it ends (Note
    [A memory-first warm-up] in gpumem/allocator/plan.py); one per process (:func:`_warmups`)."""

    warm: dict[int, bool] = dataclasses.field(default_factory=dict)   # guarded by lock
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def after_mark(self, index: int) -> None:
        from .allocator.plan import StepState

        info = step_plan_info(index)
        with self.lock:
            was, self.warm[index] = self.warm.get(index, False), bool(info.warmup)
        if was and not info.warmup:
            log.info("gpumem.torch: the memory-first warm-up on cuda:%d ended: %s", index,
                     "a step plan is installed" if info.state is StepState.PLANNED
                     else "no step plan formed; the engine grows as without marks (the idle cache the warm-up grew "
                          "went back unless warmup_give_back is off)")


@functools.cache
def _warmups() -> _Warmups:
    return _Warmups()


def step_plan_info(device: "int | str | Any | None" = None) -> Any:
    """The step plan's state and counters on ``device`` (:class:`gpumem.allocator.plan.PlanInfo`: slots,
    arena bytes, allocations served from the plan and by the engine, steps hit and missed, plans installed
    and dropped, the arena's driver calls); all 0 before gpumem's first allocation there.

    Raises:
        GpumemError: :func:`install` was not called in this process.
    """
    from .allocator.plan import PlanInfo

    _require_installed()
    index = _device_index(device)
    lib = _lib()
    values = (ctypes.c_uint64 * len(PlanInfo.FIELDS))()
    n = lib.gpumem_torch_step_info(index, values, len(values))
    if n < 0:
        raise GpumemError(f"gpumem could not read its step plan on cuda:{index}: {_last_error(lib)}")
    return PlanInfo([int(values[i]) if i < n else 0 for i in range(len(values))])


# Note [Automatic step marks]
# Why: step plans need a mark at the same point of every step (Note [Step plans] in gpumem/allocator/plan.py),
# and a program that does not call step() got none. Every training loop calls optimizer.step() once per step,
# and PyTorch (2.0 on) shows every optimizer's step to one global post-hook
# (torch.optim.optimizer.register_optimizer_step_post_hook): configure(step_marks="optimizer"), or
# install() (either install; on by default, GPUMEM_STEP_MARKS=off keeps it off), registers one that makes
# step()'s mark right after the update. The gradients still live there are freed by the next zero_grad, which the plan's
# lifetimes wrapping into the next step cover; what a loop allocates between there and its top joins the next
# step, as repeating.
# * One marker per device: the first optimizer with parameters on a CUDA device marks that device; others'
#   steps do not (a GAN's two optimizers, ZeroRedundancyOptimizer around its inner one): two marks per
#   iteration cut it into two halves that never match, so nothing would plan. An optimizer with no parameter
#   on a GPU marks nothing (and never initialises CUDA). The marker hands over to another optimizer of its
#   device once that one has stepped HANDOVER_MIN_STEPS (16) times, or twice the most steps others ever made
#   between two of the marker's plus two if more, with no step of the marker between: a warm-up or LR-finder
#   optimizer still referenced stops marking after 16 steps of the real one (the plan forms that much
#   later), a GAN's pair (one step each) or a critic stepping five or ten times per generator step does not
#   take over by this floor (the first gap cannot tell a critic from a successor: hence a floor, not only the
#   learnt gap).
#   And a marker that steps 2 to HANDOVER_MIN_STEPS times between two steps of another, RARER_GAPS (2) times in
#   a row, hands over to that one, which learns that gap as the most others' steps between its own (so the floor
#   does not hand back; an auxiliary optimizer stepping once per hundred steps never takes over): a WGAN whose
#   critic stepped first marked five times per iteration (a critic's four steps alike, the fifth with the
#   generator's update), the plan missed one step in five and served it beside the arena: 77.3 % above peak
#   allocated live on the H200, where PyTorch's allocator held 16.6 % (reports/two-optimizers.md). The rarer
#   optimizer's steps cut whole iterations. Held by weak reference: a collected marker hands over at once. The
#   rule is MarkerRule's (gpumem/marker_rule.py), which a snapshot's replay follows too.
# * A step GradScaler skips (inf or NaN gradients: scaler.step(optimizer) does not call optimizer.step, so
#   the hook does not run) is marked all the same: while marks are on, GradScaler.step is wrapped (the class's
#   method, put back when marks go off) and marks as the hook would when the optimizer did not step inside it
#   (counted per thread: the hook runs in the thread that steps). The mark comes where the skipped update's
#   would have, and the iteration, short of the optimizer's allocations, is the template's prefix: a hit (Note
#   [A step that ends early] in gpumem/allocator/plan.py). Before, no mark: the next iteration met a later
#   slot, left the plan and was served beside the arena (live GPT-2 under fp16 AMP: +81.9 %). A loop that
#   skips without GradScaler (its own inf check) still makes no mark there; the implicit restart (Note [An
#   implicit step restart]) covers the iterations that allocate as the template does.
# * A program that calls step(device) as well keeps its own marks on that device: the hook stands down there
#   (a warning, once per device) until marks are turned off and on again; other devices keep theirs.
# * A mark that fails in the hook (a device error, a plan the engine refused) is logged and turns automatic
#   marks off, not raised: the hook runs after the optimizer updated the weights, so a raise would fail a
#   step that happened (and a retry would update twice), for a memory optimisation the loop never asked for.
#   step() called by hand still raises.
# * No mark while the current stream captures a CUDA graph: a mark could install a plan mid-capture.
# * The engines' memory-first warm-up begins before the first step (gpumem_torch_plan_warmup; engines made later
#   begin it when made), since the first automatic mark comes after it and the plan cannot lower its peak (Note
#   [A memory-first warm-up] in gpumem/allocator/plan.py): when install() turns marks on, at the making of the
#   first optimizer with parameters on a GPU (Optimizer.__init__ is wrapped until then), so a program that
#   never trains (inference) never grows memory-first (live multistream inference, warm for its whole run when
#   the warm-up began at install: +7.6 % and +23 % step time); when the program turns them on
#   (configure(step_marks=...)), at once, as an optimizer may exist already.
# * configure(step_marks=None) removes the hook (and, called before install, keeps install from turning marks
#   on). A plan already installed stays until the plan layer's own bounds drop it.
# * On by default (where PyTorch has the hook): a training loop meets the memory target with no setting
#   (live GPT-2, ResNet-50, ViT and UNet, reports/hil/default-marks-h200-2026-11-29.md).
class _OptimizerKey:
    """An optimizer as :class:`MarkerRule` compares it: by identity, held weakly (an optimizer's own ``__eq__``
    is never called; a collected one equals nothing)."""

    __slots__ = ("ref",)

    def __init__(self, optimizer: Any) -> None:
        self.ref = weakref.ref(optimizer)

    def __eq__(self, other: object) -> bool:
        mine = self.ref()
        return isinstance(other, _OptimizerKey) and mine is not None and mine is other.ref()

    __hash__ = None  # type: ignore[assignment]


@dataclasses.dataclass
class _DeviceMarks:
    """One device's marker (Note [Automatic step marks]): a :class:`MarkerRule` over :class:`_OptimizerKey`."""

    rule: MarkerRule = dataclasses.field(default_factory=MarkerRule)
    by_hand: bool = False  # step() was called for this device: the hook stands down here


@dataclasses.dataclass
class _AutoMarks:
    """The optimizer hook's state (Note [Automatic step marks]); one per process (:func:`_auto_marks`).
    Every field is guarded by ``lock``."""

    mode: str | None = None
    handle: Any = None                  # PyTorch's handle of the registered hook (its .remove())
    devices: dict[int, _DeviceMarks] = dataclasses.field(default_factory=dict)
    failed: str | None = None           # why a failed mark turned the hook off
    explicit: bool = False              # configure(step_marks=...) was called: GPUMEM_STEP_MARKS is not read
    scaler: "_MethodPatch | None" = None  # GradScaler.step wrapped while marks are on
    # Optimizer.__init__ wrapped while marks turned on at install wait for the first optimizer on a GPU to begin
    # the warm-up (None once begun, or when it began at once)
    made: "_MethodPatch | None" = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # optimizer steps the hook saw in each thread (not guarded: each thread reads and writes its own)
    stepped: threading.local = dataclasses.field(default_factory=threading.local)

    def steps_seen(self) -> int:
        """Optimizer steps the hook saw in the calling thread."""
        return getattr(self.stepped, "n", 0)

    def turn(self, mode: str | None, register: Any, warm_now: bool = True) -> None:
        """Turn marks to ``mode`` (checked); ``register`` is PyTorch's hook registrar when ``mode`` is on.
        Turned on, the engines' warm-up begins at once (``warm_now``, a program's ``configure``: an optimizer
        may exist already), else when the first optimizer with parameters on a GPU is made (install)."""
        with self.lock:
            self.explicit = True
            if mode == self.mode and self.failed is None:
                return
            handle = self.handle
            if mode is not None and mode != self.mode:
                handle = register(_optimizer_stepped)   # first: a registrar that raises changes nothing
                if self.handle is not None:
                    self.handle.remove()
            elif mode is None and self.handle is not None:
                self.handle.remove()
                handle = None
            was = self.mode
            self.mode, self.handle, self.devices, self.failed = mode, handle, {}, None
            warm = ""
            if (mode is None) != (was is None):
                # Note [A memory-first warm-up] in gpumem/allocator/plan.py: the first automatic mark comes after
                # the first step, so the engines begin the warm-up before it (and engines made from then on, at
                # once): now, or when the first optimizer on a GPU is made (Note [Automatic step marks])
                if self.made is not None:
                    self.made.remove()
                    self.made = None
                if mode is None or warm_now:
                    _lib().gpumem_torch_plan_warmup(int(mode is not None))
                    warm = "" if mode is None else "; the memory-first warm-up begins"
                else:
                    self.made = _patch_optimizer_init(self)
                    if self.made is None:   # no Optimizer class to wrap: at once, as before
                        _lib().gpumem_torch_plan_warmup(1)
                    warm = ("; the memory-first warm-up begins" if self.made is None
                            else "; the memory-first warm-up begins with the first optimizer on a GPU")
            if mode is not None and self.scaler is None:
                self.scaler = _patch_scaler_step(self)
            elif mode is None and self.scaler is not None:
                self.scaler.remove()
                self.scaler = None
        log.info("gpumem.torch: automatic step marks %s%s", mode or "off", warm)

    def optimizer_made(self, optimizer: Any) -> None:
        """An optimizer was made (:func:`_patch_optimizer_init`): the first with parameters on a GPU begins the
        warm-up."""
        if not _optimizer_devices(optimizer):
            return
        with self.lock:
            if self.made is None or self.mode is None:
                return
            self.made.remove()
            self.made = None
            _lib().gpumem_torch_plan_warmup(1)
        log.info("gpumem.torch: %s (%#x) on a GPU: the memory-first warm-up begins", type(optimizer).__name__,
                 id(optimizer))

    def marked_by_hand(self, index: int) -> None:
        with self.lock:
            if self.mode is None:
                return
            dm = self.devices.setdefault(index, _DeviceMarks())
            if dm.by_hand:
                return
            dm.by_hand = True
        log.warning("gpumem.torch: step() was called for cuda:%d while step marks are automatic (step_marks=%r): "
                    "the program's own marks are kept there and the optimizer's stop on that device", index, self.mode)

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.failed is not None:
                return
            self.failed = str(exc)
            # marks off, as configure(step_marks=None) turns them: no mark will end a warm-up under way, which
            # grew memory-first for WARMUP_ALLOCS more allocations (review attacker 15)
            if self.made is not None:
                self.made.remove()
                self.made = None
            try:
                _lib().gpumem_torch_plan_warmup(0)
            except Exception as stop_exc:  # noqa: BLE001 - the warning below is what the program learns
                log.debug("gpumem.torch: could not stop the warm-up: %s", stop_exc)
        log.warning("gpumem.torch: an automatic step mark failed (%s); automatic step marks are off for this process "
                    "(configure(step_marks=None), then 'optimizer', turns them on again)", exc)

    def marking_devices(self, optimizer: Any) -> tuple[int, ...]:
        """The CUDA devices ``optimizer``'s step marks now: those it is the marker of, after the hand-over rule."""
        found = _optimizer_devices(optimizer)
        out: list[int] = []
        with self.lock:
            if self.mode is None or self.failed is not None:
                return ()
            for d in found:
                dm = self.devices.setdefault(d, _DeviceMarks())
                if dm.by_hand:
                    continue
                rule = dm.rule
                if rule.marker is not None and rule.marker.ref() is None:
                    rule.marker = None   # a collected marker hands over at once
                before, since, gap = rule.marker, rule.others + 1, rule.mine
                if not rule.stepped(_OptimizerKey(optimizer)):
                    continue
                if before is None:
                    log.info("gpumem.torch: the steps of %s (%#x) mark step plans on cuda:%d",
                             type(optimizer).__name__, id(optimizer), d)
                elif rule.marker is not before and rule.others_max:
                    log.info("gpumem.torch: %s (%#x) steps once per %d steps of the optimizer that marked cuda:%d; "
                             "its steps, which cut whole iterations, mark cuda:%d from now on",
                             type(optimizer).__name__, id(optimizer), gap, d, d)
                elif rule.marker is not before:
                    log.warning("gpumem.torch: %s (%#x) stepped %d times with no step of the optimizer that marked "
                                "cuda:%d; its steps mark cuda:%d from now on", type(optimizer).__name__,
                                id(optimizer), since, d, d)
                out.append(d)
        return tuple(out)


@functools.cache
def _auto_marks() -> _AutoMarks:
    return _AutoMarks()


def _check_step_marks(value: Any, name: str) -> None:
    if not isinstance(value, str) or value not in STEP_MARKS:
        accepted = ", ".join(repr(v) for v in STEP_MARKS)
        raise InvalidArgumentError(f"{name} must be {accepted} or None (off), not {value!r}" if name == "step_marks"
                                   else f"{name} must be {accepted} or {STEP_MARKS_OFF!r} (unset: "
                                        f"{DEFAULT_STEP_MARKS!r}), not {value!r}")


def _env_step_marks() -> str | None:
    """The step marks :func:`install` turns on: ``GPUMEM_STEP_MARKS``, checked (its value, and that PyTorch has
    the hook) before anything is installed, so a bad value or an old PyTorch raises and installs nothing; None
    for ``off``. Unset or empty: :data:`DEFAULT_STEP_MARKS`, or None (logged) where PyTorch has no hook."""
    marks = os.environ.get(STEP_MARKS_ENV)
    if marks == STEP_MARKS_OFF:
        return None
    if not marks:
        try:
            _optimizer_hook_registrar()
        except BackendUnavailableError as exc:
            log.info("gpumem.torch: no automatic step marks by default: %s", exc)
            return None
        return DEFAULT_STEP_MARKS
    _check_step_marks(marks, STEP_MARKS_ENV)
    _optimizer_hook_registrar()
    return marks


@functools.cache
def _step_marks_from_env(value: str) -> None:
    """``GPUMEM_STEP_MARKS`` (or its default), once per process, unless ``configure(step_marks=...)`` was called
    first; the warm-up waits for the first optimizer on a GPU (Note [Automatic step marks])."""
    marks = _auto_marks()
    if not marks.explicit:
        _check_step_marks(value, STEP_MARKS_ENV)
        _require_installed()
        marks.turn(value, _optimizer_hook_registrar(), warm_now=False)


def _optimizer_hook_registrar() -> Any:
    """PyTorch's ``register_optimizer_step_post_hook``, or :class:`BackendUnavailableError`."""
    torch = _torch("gpumem.torch.configure(step_marks=...)")
    register = getattr(getattr(getattr(torch, "optim", None), "optimizer", None), "register_optimizer_step_post_hook", None)
    if register is None:  # torch.optim deletes its submodules' names (PyTorch 2.11): import the module itself
        try:
            register = getattr(importlib.import_module("torch.optim.optimizer"), "register_optimizer_step_post_hook", None)
        except ImportError:
            register = None
    if register is None:
        raise BackendUnavailableError(f"PyTorch {getattr(torch, '__version__', '?')} has no global optimizer step hook "
                                      "(torch.optim.optimizer.register_optimizer_step_post_hook, PyTorch 2.0 or later); "
                                      "call gpumem.torch.step() in the loop instead")
    return register


def _optimizer_devices(optimizer: Any) -> tuple[int, ...]:
    """The CUDA device indices of ``optimizer``'s parameters, sorted (none for an optimizer on the host)."""
    found = {int(p.device.index or 0) for group in getattr(optimizer, "param_groups", ())
             for p in group.get("params", ()) if getattr(p, "is_cuda", False)}
    return tuple(sorted(found))


def _grad_scaler_class() -> Any:
    """PyTorch's ``GradScaler`` class (``torch.amp.GradScaler``, which ``torch.cuda.amp.GradScaler`` subclasses,
    from PyTorch 2.3; before, ``torch.cuda.amp.GradScaler`` itself: the step hook the marks need is there from
    2.0), or None where this PyTorch has none."""
    torch = sys.modules.get("torch")
    for owner in (getattr(torch, "amp", None), getattr(getattr(torch, "cuda", None), "amp", None)):
        cls = getattr(owner, "GradScaler", None)
        if isinstance(cls, type) and callable(cls.__dict__.get("step")):
            return cls
    return None


def _optimizer_base_class() -> Any:
    """PyTorch's ``torch.optim.Optimizer`` (every optimizer's base class), or None."""
    cls = getattr(getattr(sys.modules.get("torch"), "optim", None), "Optimizer", None)
    return cls if isinstance(cls, type) and "__init__" in cls.__dict__ else None


@dataclasses.dataclass
class _MethodPatch:
    """A class's method wrapped while automatic marks need it (Note [Automatic step marks]): ``GradScaler.step``
    (a skipped optimizer step still marks), ``Optimizer.__init__`` (the first optimizer on a GPU begins the
    warm-up)."""

    cls: Any
    name: str
    original: Any
    wrapper: Any

    @classmethod
    def install(cls, owner: Any, name: str, wrap: Callable[[Any], Any]) -> "_MethodPatch | None":
        """``owner.name`` replaced by ``wrap(original)``; None when there is no such class (``owner`` None)."""
        if owner is None:
            return None
        original = owner.__dict__[name]
        wrapper = functools.wraps(original)(wrap(original))
        setattr(owner, name, wrapper)
        return cls(owner, name, original, wrapper)

    def remove(self) -> None:
        """Put the method back, unless something wrapped it after us (then ours stays, and does nothing while
        marks are off)."""
        if self.cls.__dict__.get(self.name) is self.wrapper:
            setattr(self.cls, self.name, self.original)


def _patch_optimizer_init(marks: _AutoMarks) -> "_MethodPatch | None":
    """``Optimizer.__init__`` wrapped until the first optimizer on a GPU is made."""

    def wrap(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                marks.optimizer_made(self)
            except Exception as exc:  # noqa: BLE001 - a memory optimisation must not fail the optimizer's making
                log.warning("gpumem.torch: could not begin the memory-first warm-up for %s: %s", type(self).__name__, exc)
        return __init__

    return _MethodPatch.install(_optimizer_base_class(), "__init__", wrap)


def _patch_scaler_step(marks: _AutoMarks) -> "_MethodPatch | None":
    """``GradScaler.step`` wrapped so that a skipped optimizer step still marks."""

    def wrap(original: Any) -> Any:
        def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            seen = marks.steps_seen()
            out = original(self, optimizer, *args, **kwargs)
            if marks.steps_seen() == seen:   # skipped (inf or NaN): mark where the optimizer's hook would have
                _optimizer_stepped(optimizer, args, kwargs)
            return out
        return step

    return _MethodPatch.install(_grad_scaler_class(), "step", wrap)


def _optimizer_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    """PyTorch's global optimizer step post-hook while step marks are automatic (Note [Automatic step marks])."""
    marks = _auto_marks()
    marks.stepped.n = marks.steps_seen() + 1
    devices = marks.marking_devices(optimizer)
    if not devices:
        return
    import torch

    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return
    try:
        for device in devices:
            _mark_step(device)
    except GpumemError as exc:
        marks.fail(exc)


#: The policy fields the native engine takes from :func:`configure` (the others are the default policy's).
_ENGINE_KNOBS = ("growth", "page_slack", "page_slack_min_nbytes", "chunk_max_fraction", "grow_ahead_fraction",
                 "steal_empty_pages", "busy_slack", "stream_ordered_steal", "wait_own_stream", "plan_warmup",
                 "warmup_give_back", "steal_after_warmup", "steal_before_warmup", "wait_on_gpu")


#: ``configure``'s default for ``step_marks``: leave the step marks as they are.
_KEEP: Any = object()


def configure(policy: Any = None, *, step_marks: "str | None" = _KEEP) -> None:
    """Give the engines gpumem makes from now on ``policy``'s growth knobs (an
    :class:`~gpumem.allocator.policy.AllocatorPolicy` or a policy name), and/or turn automatic step marks
    on or off.

    Call it with a policy before the first allocation on a device: an engine already made keeps its policy. The
    native engine takes ``growth``, ``page_slack``, ``page_slack_min_nbytes``, ``chunk_max_fraction``, ``grow_ahead_fraction``,
    ``steal_empty_pages``, ``busy_slack``, ``stream_ordered_steal``, ``wait_own_stream``, ``plan_warmup``,
    ``warmup_give_back``, ``steal_after_warmup``, ``steal_before_warmup`` and ``wait_on_gpu`` (``GPUMEM_BUSY_SLACK``,
    ``GPUMEM_CHUNK_MAX_FRACTION``, ``GPUMEM_PAGE_SLACK``, ``GPUMEM_PAGE_SLACK_MIN_NBYTES``,
    ``GPUMEM_STREAM_ORDERED_STEAL=0|1``, ``GPUMEM_WAIT_OWN_STREAM=0|1``, ``GPUMEM_PLAN_WARMUP=0|1``,
    ``GPUMEM_WARMUP_GIVE_BACK=0|1``, ``GPUMEM_STEAL_AFTER_WARMUP=0|1``, ``GPUMEM_STEAL_BEFORE_WARMUP=0|1`` and
    ``GPUMEM_WAIT_ON_GPU=0|1``, when
    set, override those; only gpumem.torch reads them, a ``CachingAllocator`` takes its policy as given); the
    policy's other fields must be the default policy's.

    ``step_marks="optimizer"`` (after :func:`install`, which turns it on by default: ``GPUMEM_STEP_MARKS``)
    marks a step plan's step (as :func:`step` does) each time the first PyTorch optimizer that steps
    from now on finishes ``optimizer.step()``, on the CUDA devices of its parameters: a training loop gets step
    plans with no call to :func:`step`, and the engines grow memory-first until their plan forms (Note [A
    memory-first warm-up] in :mod:`gpumem.allocator.plan`). ``step_marks=None`` removes the hook (a plan already
    installed stays).
    Turning on what is on changes nothing. Several optimizers, ``GradScaler``'s skipped steps, programs that
    call :func:`step` too: Note [Automatic step marks].

    Raises:
        InvalidArgumentError: a value the engine refuses, or another field that differs from the default
            policy's (the engine cannot run it); ``step_marks`` not ``None`` or one of :data:`STEP_MARKS`;
            neither argument given. Nothing is changed.
        GpumemError: ``step_marks`` turned on before :func:`install` (nothing is changed).
        BackendUnavailableError: PyTorch is missing, or too old for a global optimizer hook (2.0 or later).
    """
    from .allocator.policy import DEFAULT_POLICY, GrowthRule, get_policy

    if policy is None and step_marks is _KEEP:
        raise InvalidArgumentError("gpumem.torch.configure() needs a policy, step_marks, or both")
    register = None
    if step_marks is not _KEEP:   # checked first: a bad value leaves the policy unchanged too
        if step_marks is not None:
            _check_step_marks(step_marks, "step_marks")
            _require_installed()
            register = _optimizer_hook_registrar()
    if policy is not None:
        pol = get_policy(policy)
        default = get_policy(DEFAULT_POLICY)
        differ = [f.name for f in dataclasses.fields(pol)
                  if f.name not in _ENGINE_KNOBS + ("name", "description") and getattr(pol, f.name) != getattr(default, f.name)]
        if differ:
            raise InvalidArgumentError(
                f"gpumem.torch.configure({pol.name!r}): the native engine runs the default policy's "
                f"{', '.join(differ)}; it takes only {', '.join(_ENGINE_KNOBS)} (use a CachingAllocator for other policies)")
        lib = _lib()
        growth = 0 if GrowthRule(pol.growth) is GrowthRule.PAGES else 1
        if lib.gpumem_torch_configure(growth, float(pol.page_slack), float(pol.chunk_max_fraction),
                                      float(pol.grow_ahead_fraction), int(bool(pol.steal_empty_pages)),
                                      float(pol.busy_slack), int(bool(pol.stream_ordered_steal)),
                                      int(pol.page_slack_min_nbytes), int(bool(pol.plan_warmup)),
                                      int(bool(pol.wait_own_stream)), int(bool(pol.warmup_give_back)),
                                      int(bool(pol.steal_after_warmup)), int(bool(pol.steal_before_warmup)),
                                      int(bool(pol.wait_on_gpu))) != 0:
            raise InvalidArgumentError(f"gpumem.torch.configure({pol.name!r}): {_last_error(lib)}")
    if step_marks is not _KEEP:
        _auto_marks().turn(step_marks, register)


def automatic_step_marks() -> "str | None":
    """What marks step plans' steps automatically now (one of :data:`STEP_MARKS`), or None: off, or turned off
    by a mark that failed (Note [Automatic step marks])."""
    marks = _auto_marks()
    with marks.lock:
        return None if marks.failed is not None else marks.mode


def start_trace(gpu_clock: bool = False) -> None:
    """Record every allocation and free PyTorch asks gpumem for, on every device, from now on (what an
    earlier trace recorded is forgotten). Read it with :func:`recorded_trace`.

    ``gpu_clock``: also record, for each op, when the GPU had run the work queued on its stream before it (a
    CUDA event with timing per op, a few microseconds of CPU each; Note [The trace's GPU clock] in
    ``gpumem/_native/torch_api.cpp``): :attr:`~gpumem.trace.Trace.gpu_times_us` of the recorded trace, which a
    replay then runs the program's GPU work on (``gpu_timing="gpu-clock"``)."""
    if not isinstance(gpu_clock, bool):
        raise InvalidArgumentError(f"start_trace: gpu_clock must be True or False, not {gpu_clock!r}")
    lib = _lib()
    lib.gpumem_torch_trace_gpu_clock(1 if gpu_clock else 0)
    lib.gpumem_torch_trace(1)


def stop_trace() -> None:
    """Stop recording; what was recorded stays readable with :func:`recorded_trace`."""
    _lib().gpumem_torch_trace(0)


#: The native trace buffer's words per event: kind (0 alloc, 1 free, 2 stream use, 3 stream wait, 4 step-plan
#: event), address (of a wait: the awaited stream), bytes (of a plan event: its PlanEventKind), stream, ns.
_TRACE_WORDS = 5


def trace_from_words(words: Any, name: str = "gpumem.torch", gpu_ns: Any = None, reserved: Any = None) -> Any:
    """A :class:`~gpumem.trace.Trace` from the native trace buffer's words (5 per event: kind, address,
    bytes, stream, nanoseconds since tracing began; kind 2 is a :func:`record_stream`, kept as a
    :class:`~gpumem.trace.StreamUse`, kind 3 a :func:`trace_wait_stream`, kept as a
    :class:`~gpumem.trace.StreamWait`, the awaited stream in the address word; kind 4 a step mark or a
    warm-up begun or stopped, kept as a :class:`~gpumem.trace.PlanEvent`, its kind in the bytes word). Frees
    and stream uses of blocks allocated before tracing began are skipped (logged). ``gpu_ns`` (int64, one per
    event: the native GPU clock, nanoseconds on the trace's clock, negative where unknown): the trace's
    :attr:`~gpumem.trace.Trace.gpu_times_us` (NaN where unknown). ``reserved`` (int64, one per event: the engine's
    reserved bytes after it, -1 where not recorded): the trace's :attr:`~gpumem.trace.Trace.live_reserved_nbytes`."""
    import numpy as np

    from .errors import InvalidArgumentError, TraceFormatError
    from .trace.builder import PLAN_CODE, USE_CODE, WAIT_CODE, AddressReuseError, build_trace

    try:
        arr = np.asarray(words, dtype=np.uint64)
    except (OverflowError, ValueError, TypeError) as exc:   # -1 in a list, a float, a string
        raise TraceFormatError(f"<{name}>", f"the words are not unsigned 64-bit integers ({exc})") from None
    if arr.ndim != 1 or arr.size % _TRACE_WORDS:
        raise TraceFormatError(f"<{name}>", f"{arr.size} words is not a whole number of {_TRACE_WORDS}-word events")
    ev = arr.reshape(-1, _TRACE_WORDS)
    gpu_us = None
    if gpu_ns is not None:
        ns = np.asarray(gpu_ns)
        if ns.shape != (len(ev),) or ns.dtype != np.int64:
            raise TraceFormatError(f"<{name}>", f"expected {len(ev)} int64 GPU clock values, one per event, got "
                                                f"{ns.dtype} of shape {ns.shape}")
        gpu_us = np.where(ns < 0, np.nan, ns / 1e3)
    if reserved is not None:
        reserved = np.asarray(reserved)
        if reserved.shape != (len(ev),) or reserved.dtype != np.int64:
            raise TraceFormatError(f"<{name}>", f"expected {len(ev)} int64 reserves, one per event, got "
                                                f"{reserved.dtype} of shape {reserved.shape}")
        reserved = np.maximum(reserved, -1)   # any negative is "not recorded"
    if ev.size and int(ev[:, 0].max()) > PLAN_CODE:
        raise TraceFormatError(f"<{name}>", f"event kind {int(ev[:, 0].max())} is not 0 (alloc), 1 (free), "
                                            f"{USE_CODE} (stream use), {WAIT_CODE} (stream wait) or {PLAN_CODE} "
                                            "(step-plan event)")
    try:
        return build_trace(name, "recorded", ev[:, 0].astype(np.int8), ev[:, 1].astype(np.int64),
                           ev[:, 2].astype(np.int64), ev[:, 3].astype(np.int64), ev[:, 4].astype(np.float64) / 1e3,
                           origin=f"<{name}>", use_code=USE_CODE, wait_code=WAIT_CODE, plan_code=PLAN_CODE,
                           gpu_times_us=gpu_us, live_reserved_nbytes=reserved)
    except AddressReuseError as e:
        raise TraceFormatError(f"<{name}>", str(e), entry=e.index) from None
    except InvalidArgumentError as e:   # a plan event of an unknown kind
        raise TraceFormatError(f"<{name}>", str(e)) from None


def recorded_trace(device: "int | str | Any | None" = None, name: str | None = None) -> Any:
    """What :func:`start_trace` has recorded on ``device`` so far, as a :class:`~gpumem.trace.Trace`
    (save it with :func:`gpumem.trace.save_trace`), with its GPU clock where ``start_trace(gpu_clock=True)``
    recorded one (:attr:`~gpumem.trace.Trace.gpu_times_us`; reading it waits for the GPU to get there) and the
    engine's reserved bytes after each allocation (:attr:`~gpumem.trace.Trace.live_reserved_nbytes`, which
    :func:`gpumem.replay_compare.compare_live` compares a replay with). Call :func:`stop_trace` first when other
    threads allocate.

    Raises:
        GpumemError: gpumem has no engine on ``device`` (nothing was allocated there), or the trace changed while
            being read.
    """
    import numpy as np

    _require_installed()
    index = _device_index(device)
    words = _trace_words(index)
    lib = _lib()
    n = len(words) // _TRACE_WORDS
    ns = np.full(n, -1, dtype=np.int64)
    have = int(lib.gpumem_torch_trace_gpu_read(index, ns.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), n))
    if have < 0:
        raise GpumemError(f"gpumem has no GPU clock on cuda:{index}: {_last_error(lib)}")
    if have != n:
        raise GpumemError(f"gpumem's trace on cuda:{index} changed while being read; call stop_trace() first")
    reserved = np.full(n, -1, dtype=np.int64)   # Note [The live engine's reserve]
    have = int(lib.gpumem_torch_trace_reserved_read(index, reserved.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                                                    n))
    if have < 0:
        raise GpumemError(f"gpumem has no engine on cuda:{index}: {_last_error(lib)}")
    if have != n:
        raise GpumemError(f"gpumem's trace on cuda:{index} changed while being read; call stop_trace() first")
    # recorded without the clock: no clock in the trace
    return trace_from_words(words, name or f"gpumem.torch cuda:{index}", ns if (ns >= 0).any() else None,
                            reserved if (reserved >= 0).any() else None)


def _trace_words(index: int) -> Any:
    """The native trace buffer of device ``index`` (:data:`_TRACE_WORDS` words per event)."""
    import numpy as np

    lib = _lib()
    u64p = ctypes.POINTER(ctypes.c_uint64)
    for _ in range(8):   # the buffer may grow between sizing and copying while other threads allocate
        n = int(lib.gpumem_torch_trace_read(index, None, 0))
        if n < 0:
            raise GpumemError(f"gpumem has no trace on cuda:{index}: {_last_error(lib)}")
        buf = np.zeros(n * _TRACE_WORDS + 1024 * _TRACE_WORDS, dtype=np.uint64)
        have = int(lib.gpumem_torch_trace_read(index, buf.ctypes.data_as(u64p), len(buf) // _TRACE_WORDS))
        if have <= len(buf) // _TRACE_WORDS:
            return buf[:have * _TRACE_WORDS]
    raise GpumemError(f"gpumem's trace on cuda:{index} kept growing while being read; call stop_trace() first")


@functools.cache
def _trace_at_exit(path: str) -> None:
    """Start tracing now and write device 0's trace to ``path`` when the process exits (``GPUMEM_TRACE_OUT``)."""
    start_trace()

    def write() -> None:
        from .trace import save_trace

        stop_trace()
        try:
            save_trace(recorded_trace(0), path)
        except GpumemError as exc:
            log.error("gpumem.torch: could not write the trace to %s: %s", path, exc)

    atexit.register(write)
