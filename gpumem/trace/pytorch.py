"""Reading PyTorch memory snapshots (``torch.cuda.memory._dump_snapshot``).

A snapshot is a pickled dict (often gzipped)::

    {
      "segments": [ {"address", "total_size", "stream", "blocks": [...], ...}, ... ],  # state at dump time
      "device_traces": [ [entry, entry, ...],   # device 0, oldest first
                         [...], ... ],          # one list per device
      "allocator_settings": {...},              # optional, ignored here
      "external_annotations": [ {"stage", "name", "device", "time_us"}, ... ],  # record_function ranges
    }

Each trace entry is a dict with ``action``, ``addr``, ``size`` (the *requested*
size, not the rounded block size), ``stream``, ``time_us`` and ``frames`` (a stack
trace), sometimes ``compile_context`` and ``user_metadata``. Actions:

=================  =====================================================
``alloc``          a tensor allocation: becomes an ALLOC op
``free_requested`` the tensor was freed: becomes the FREE op
``free_completed`` the block is reusable (later, if streams recorded it): ignored
``segment_*``      cudaMalloc/cudaFree/map/unmap of allocator segments: ignored
``snapshot``       a snapshot was taken: ignored
``oom``            an allocation failed: counted in ``n_failed_allocs``
=================  =====================================================

So an allocation lives from its ``alloc`` to the ``free_requested`` of the same
address. The history is a ring buffer: it may begin with frees of allocations
made before recording started; those are skipped and counted
(``n_unmatched_frees``). Events lost inside the window are refused with the entry named
(:mod:`gpumem.trace.builder`): an ``alloc`` at an address still live (its free lost) and a second
``free_requested`` of an address whose allocation in the window was freed already (the alloc between
them lost). A ``free_requested`` carries its allocation's requested size (PyTorch writes the same
``requested_size``): one of another size is kept with its allocation's size and the frees that differ are
counted in one warning naming the first. ``segments`` (the allocator state at dump time) is not
needed to rebuild the ops and is not read. ``external_annotations`` give the trace's plan events: the step
marks gpumem.torch would have made at the end of each optimizer step (Note [Step marks read off a snapshot's
optimizer steps] in :mod:`gpumem.trace.optimizer_marks`).

Loading is safe (see :mod:`gpumem.trace.safe_pickle`), bounded (see
:class:`~gpumem.trace.limits.TraceLimits`: besides the caps applied while
unpickling, a device's entries are capped at ``max_entries`` and may not
outnumber the objects the file really made, so a list that repeats one memo
reference a million times is refused before it is walked; every number is
range-checked, times included: NaN and infinite times are refused; the memory
unpickling takes is capped by ``max_memory_nbytes``, ``segments`` included) and fast: the cyclic garbage
collector is paused while the million small dicts are built (it would otherwise
triple the load time) and entries are read column by column with list
comprehensions; a per-entry validating pass runs only when the fast path finds
something wrong, to name the bad entry.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..errors import TraceFormatError
from ._fileio import PathLike, check_exists, trace_name_from_path
from .builder import AddressReuseError, SecondFreeError, build_trace
from .limits import DEFAULT_LIMITS, TraceLimits, max_entries_for, shorten
from .model import Trace
from .optimizer_marks import infer_step_marks
from .safe_pickle import _load_counted

__all__ = ["ACTIONS", "read_pytorch_snapshot", "load_snapshot_dict", "snapshot_to_trace"]

log = logging.getLogger(__name__)

#: Every trace-entry action PyTorch writes, with the code used internally (0 alloc, 1 free).
ACTIONS: dict[str, int] = {
    "alloc": 0,
    "free_requested": 1,
    "free_completed": 2,
    "segment_alloc": 3,
    "segment_free": 4,
    "segment_map": 5,
    "segment_unmap": 6,
    "snapshot": 7,
    "oom": 8,
}
_OOM = ACTIONS["oom"]
_INT64_MAX = 2**63 - 1
_TIME_LIMIT_US = 2**63  # integer times beyond this are no real clock (and 2**1024 does not fit a float)

Columns = tuple[list[int], list[int], list[int], list[int], list[Any]]


@contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load_snapshot_dict(path: PathLike, *, limits: TraceLimits | None = None,
                       progress: bool | None = False) -> dict[str, Any]:
    """The snapshot dict of ``path``, loaded safely under ``limits``, with its top-level shape checked."""
    return _load_snapshot(path, limits or DEFAULT_LIMITS, progress)[0]


def _load_snapshot(path: PathLike, limits: TraceLimits,
                   progress: bool | None) -> tuple[dict[str, Any], int, int]:
    """The checked snapshot dict, the number of objects unpickling it made and the memory it took."""
    check_exists(path)
    with _gc_paused():
        data, n_objects, memory_nbytes = _load_counted(path, limits, progress)
    _check_top_level(data, str(path), limits)
    return data, n_objects, memory_nbytes


def _check_top_level(data: Any, where: str, limits: TraceLimits = DEFAULT_LIMITS) -> None:
    if not isinstance(data, dict):
        raise TraceFormatError(where, f"top level is a {type(data).__name__}, not the dict of a memory snapshot")
    if "device_traces" not in data:
        raise TraceFormatError(
            where, "no 'device_traces' key: not a memory snapshot, or recorded without _record_memory_history"
        )
    traces = data["device_traces"]
    if not isinstance(traces, list):
        raise TraceFormatError(where, "'device_traces' must be a list with one list of entries per device")
    if len(traces) > limits.max_devices:
        raise TraceFormatError(where, f"'device_traces' has {len(traces):,} devices, more than "
                                      f"{limits.max_devices:,} (TraceLimits.max_devices)")
    if not all(isinstance(t, list) for t in traces):
        raise TraceFormatError(where, "'device_traces' must be a list with one list of entries per device")
    if not isinstance(data.get("segments", []), list):
        raise TraceFormatError(where, "'segments' must be a list")


def _pick_device(traces: list[list[Any]], device: int | None, where: str) -> int:
    if device is not None:
        if type(device) is not int:
            raise TraceFormatError(where, f"device must be an int index, got {shorten(device)}")
        if not 0 <= device < len(traces):
            raise TraceFormatError(where, f"no device {device}: the snapshot has traces for {len(traces)} device(s)")
        return device
    non_empty = [i for i, t in enumerate(traces) if t]
    if len(non_empty) > 1:
        shown = ", ".join(map(str, non_empty[:8])) + (", ..." if len(non_empty) > 8 else "")
        raise TraceFormatError(where, f"devices [{shown}] all have traces: pass device= (the command line's "
                                      "--device-index) to choose one")
    return non_empty[0] if non_empty else 0


def _columns_fast(entries: list[Any]) -> Columns | None:
    """All five columns, or None when anything needs the careful pass (which then names the entry)."""
    try:
        codes = list(map(ACTIONS.get, [e["action"] for e in entries]))
        # PyTorch writes an oom entry with device_free in place of addr (memory_snapshot.cpp)
        addrs = [e["addr"] if "addr" in e or e["action"] != "oom" else 0 for e in entries]
        sizes = [e["size"] for e in entries]
        streams = [e["stream"] for e in entries]
        times = [e["time_us"] for e in entries]
    except (KeyError, TypeError, IndexError):
        return None
    if None in codes:
        return None
    if not ({int} >= set(map(type, addrs)) and {int} >= set(map(type, sizes)) and {int} >= set(map(type, streams))):
        return None
    if not {int, float} >= set(map(type, times)):
        return None
    if entries and float in set(map(type, times)):
        float_times = np.array([t for t in times if type(t) is float], dtype=np.float64)
        if not np.isfinite(float_times).all():
            return None
    if entries and int in set(map(type, times)):
        int_times = [t for t in times if type(t) is int]
        if min(int_times) < -_TIME_LIMIT_US or max(int_times) > _TIME_LIMIT_US:
            return None
    if entries and (min(sizes) < 0 or min(addrs) < 0 or max(addrs) > _INT64_MAX or max(sizes) > _INT64_MAX
                    or min(streams) < 0 or max(streams) > _INT64_MAX):
        return None
    return codes, addrs, sizes, streams, times  # type: ignore[return-value]


def _int_field(entry: dict[str, Any], key: str, where: str, i: int, *, default: int | None = None,
               minimum: int = 0) -> int:
    if key not in entry and default is not None:
        return default
    value = entry.get(key)
    if type(value) is not int:
        what = "missing" if key not in entry else f"not an integer ({type(value).__name__})"
        raise TraceFormatError(where, f"'{key}' is {what}", entry=i)
    if value < minimum:
        raise TraceFormatError(where, f"negative '{key}' ({shorten(value)})", entry=i)
    if value > _INT64_MAX:
        raise TraceFormatError(where, f"'{key}' ({shorten(value)}) does not fit in 64 bits", entry=i)
    return value


def _columns_careful(entries: list[Any], where: str) -> Columns:
    """Validate entry by entry; raise ``TraceFormatError`` naming the first bad one."""
    codes, addrs, sizes, streams, times = [], [], [], [], []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise TraceFormatError(where, f"entry is a {type(e).__name__}, not a dict", entry=i)
        action = e.get("action")
        if not isinstance(action, str):
            raise TraceFormatError(where, "'action' is missing or not a string", entry=i)
        if action not in ACTIONS:
            raise TraceFormatError(where, f"unknown action {shorten(action)}", entry=i)
        codes.append(ACTIONS[action])
        addrs.append(_int_field(e, "addr", where, i, default=0 if action == "oom" else None))
        sizes.append(_int_field(e, "size", where, i))
        streams.append(_int_field(e, "stream", where, i, default=0))  # replays take streams >= 0
        t = e.get("time_us", 0)
        if type(t) not in (int, float):
            raise TraceFormatError(where, f"'time_us' is not a number ({type(t).__name__})", entry=i)
        if type(t) is float and not math.isfinite(t):
            raise TraceFormatError(where, f"'time_us' is not finite ({t!r})", entry=i)
        if type(t) is int and not -_TIME_LIMIT_US <= t <= _TIME_LIMIT_US:
            raise TraceFormatError(where, f"'time_us' ({shorten(t)}) is out of range (|time_us| <= 2**63)", entry=i)
        times.append(t)
    return codes, addrs, sizes, streams, times


def snapshot_to_trace(
    snapshot: Any,
    *,
    name: str = "snapshot",
    device: int | None = None,
    where: str = "<snapshot>",
    consume: bool = False,
    limits: TraceLimits | None = None,
    n_objects: int | None = None,
    memory_nbytes: int = 0,
    step_marks: bool = True,
) -> Trace:
    """The ops of one device of an in-memory snapshot dict (``where`` names it in errors).

    ``device=None`` picks the only device whose trace is non-empty. With
    ``consume=True`` the snapshot's ``device_traces`` are emptied once read, so
    the entry dicts can be freed before the trace is built (lower peak memory).
    At most ``limits.max_entries`` entries are read; ``n_objects`` (the objects
    unpickling made, when known) bounds them too: distinct entries are distinct
    dicts, so more entries than objects means memo references repeated.
    ``memory_nbytes`` (the memory unpickling took) is deducted from
    ``limits.max_memory_nbytes`` before the entries' columns are counted against it.
    ``step_marks``: the trace's plan events are the step marks gpumem.torch would have made, read off the
    snapshot's optimizer steps (Note [Step marks read off a snapshot's optimizer steps] in
    :mod:`gpumem.trace.optimizer_marks`); False leaves them out.
    """
    limits = limits or DEFAULT_LIMITS
    _check_top_level(snapshot, where, limits)
    traces = snapshot["device_traces"]
    picked = _pick_device(traces, device, where) if traces else 0
    entries = traces[picked] if traces else []
    n_devices_with_ops = sum(1 for t in traces if t)   # counted before consume empties them
    max_entries, binding = max_entries_for(limits, memory_nbytes)
    if len(entries) > max_entries:
        raise TraceFormatError(where, f"{len(entries):,} entries, more than {max_entries:,} "
                                      f"({binding}); raise the limit if the file is genuine")
    if n_objects is not None and len(entries) > n_objects:
        raise TraceFormatError(where, f"{len(entries):,} entries but the file made only {n_objects:,} objects: "
                                      "the entries repeat the same objects (memo references), as no snapshot does")
    with _gc_paused():
        cols = _columns_fast(entries) or _columns_careful(entries, where)
    if consume:
        del entries
        traces.clear()
    codes, addrs, sizes, streams, times = cols
    n_oom = codes.count(_OOM)
    try:
        trace = build_trace(
            name, "pytorch-snapshot", codes, addrs, sizes, streams, np.asarray(times, dtype=np.float64),
            origin=where, n_failed_allocs=n_oom, free_sizes=True, event_name=lambda i: f"entry {i}",
            refuse_second_free=True,
        )
    except SecondFreeError as e:
        raise TraceFormatError(where, e.describe(f"entry {e.first_free}", e.addr), entry=e.index) from None
    except AddressReuseError as e:
        raise TraceFormatError(where, str(e), entry=e.index) from None
    if not step_marks:
        return trace
    # Note [Step marks read off a snapshot's optimizer steps] in gpumem/trace/optimizer_marks.py
    annotations = snapshot.get("external_annotations")
    if isinstance(annotations, list) and len(annotations) > max_entries:
        raise TraceFormatError(where, f"{len(annotations):,} external annotations, more than {max_entries:,} "
                                      f"({binding}); raise the limit if the file is genuine, or read it without "
                                      "them (step_marks=False, gpumem replay --no-step-marks)")
    marks = infer_step_marks(annotations, picked, trace.times_us, where, sole_device=n_devices_with_ops <= 1,
                             kinds=trace.kinds, nbytes=trace.nbytes, alloc_ids=trace.alloc_ids)
    if marks.reason is not None:
        log.warning("%s: no step marks read off its optimizer steps, so a replay under the gpumem policy predicts "
                    "a run without step plans: %s", where, marks.reason)
    if not marks.events:
        return trace
    log.info("%s: %d step mark(s) read off the optimizer steps of %s (gpumem.torch's automatic marks; %s; %d of "
             "them for steps GradScaler skipped; %d step end(s) before the first op, %d after the last, not made), "
             "the memory-first warm-up begun at op 0", where, len(marks.events) - 1, shorten(marks.optimizer, 60),
             "one optimizer as far as its steps' allocations tell" if marks.n_optimizers == 1 else
             f"{marks.n_optimizers} optimizers of the class told apart by their steps' allocations, the marker's "
             "steps marked", marks.n_skipped, marks.n_before_first_op, marks.n_after_last_op)
    return dataclasses.replace(trace, plan_events=marks.events)


def read_pytorch_snapshot(path: PathLike, *, device: int | None = None, name: str | None = None,
                          limits: TraceLimits | None = None, progress: bool | None = False,
                          step_marks: bool = True) -> Trace:
    """Read a PyTorch memory snapshot pickle (gzipped or not) as a :class:`Trace`.

    ``device`` picks one device of a multi-device snapshot (its index in
    ``device_traces``); ``name`` defaults to the file name up to its first dot;
    ``limits`` defaults to :data:`~gpumem.trace.limits.DEFAULT_LIMITS`; ``progress``
    shows the compressed bytes read (None: only on a terminal); ``step_marks`` as for
    :func:`snapshot_to_trace` (the step marks gpumem.torch would have made). Raises
    ``FileNotFoundError`` for a missing file and ``TraceFormatError`` (naming the
    file, and the entry index for a bad entry) for anything unreadable.
    """
    limits = limits or DEFAULT_LIMITS
    with _gc_paused():  # the collector would repeatedly traverse the million entry dicts
        data, n_objects, memory_nbytes = _load_snapshot(path, limits, progress)
        return snapshot_to_trace(
            data, name=trace_name_from_path(path) if name is None else name, device=device, where=str(path),
            consume=True, limits=limits, n_objects=n_objects, memory_nbytes=memory_nbytes, step_marks=step_marks,
        )
