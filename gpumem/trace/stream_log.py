"""PyTorch's ``Tensor.record_stream`` calls, logged beside a memory snapshot and merged into its trace.

A PyTorch memory snapshot (:mod:`gpumem.trace.pytorch`) records every allocation and free but not
``record_stream``: a block used on another stream is, in PyTorch's allocator, reusable only once an event
recorded on that stream at the free has completed, and a replay that never hears of the use hands the
block out at once (the multistream row of ``reports/hil/live-vs-predicted-h200-2026-11-25-run3.md``: live
50.20 %, replayed 25.24 %). :class:`RecordStreamLogger` wraps ``torch.Tensor.record_stream`` while a
program runs and logs each call; :func:`merge_stream_uses` turns the log into the trace's
:attr:`~gpumem.trace.Trace.stream_uses`, which every replay makes (Note [Stream uses in a replay] in
:mod:`gpumem.replay`)::

    with RecordStreamLogger(torch) as rs:            # after torch.cuda.memory._record_memory_history(...)
        run_the_program()
    torch.cuda.memory._dump_snapshot("run.snapshot.pickle")
    write_record_stream_log(rs.log(), "run.record_stream.jsonl.gz")
    ...
    trace, report = load_trace_with_stream_uses("run.snapshot.pickle", "run.record_stream.jsonl.gz")

Note [Placing a logged record_stream among a snapshot's ops]
------------------------------------------------------------
A use must sit between its block's allocation and its free (:class:`~gpumem.trace.StreamUse`); where
exactly changes nothing in a replay, since the engines only note the stream and record the event at the
free (Note [Streams] in :mod:`gpumem.allocator.caching`). What the log must get right is *which*
allocation: addresses are reused at once, so the block at ``ptr`` a microsecond later may be another one.
Each call therefore logs two sequence points:

* the allocator's own counts, ``allocation.all.allocated`` and ``.freed`` of
  ``torch.cuda.memory_stats`` (PyTorch counts them where it writes the ``alloc`` and ``free_requested``
  trace entries, under the same lock), less the counts when the log began: exactly the number of
  allocations and frees before the call, so the call sits after op ``allocs + frees``. This is used when
  it is consistent with the trace (those first ops hold exactly that many allocations, and the trace
  dropped no free) and, on a PyTorch snapshot, with the call's own time (Note [Counts checked against the
  call's time]): a history that began late or a ring buffer that wrapped usually fails the first check,
  but an offset of as many allocations as frees (the logger started a step before the history) passes
  it and is caught only by the second;
* the time, ``time.time_ns() / 1000``: the snapshot's ``time_us`` is Unix time in microseconds too
  (PyTorch converts its cycle counter to ``CLOCK_REALTIME``), to within the conversion's error. The
  fallback: the call sits after every op of time <= its own; an allocation holding ``ptr`` live within
  :data:`TIME_TOLERANCE_US` of it is taken, and the use moved inside its life.

The pointer is the tensor's storage's (``untyped_storage().data_ptr()``), which is what PyTorch's
``recordStream`` looks the block up by; an interior pointer is matched to the allocation holding it.
Not seen: calls PyTorch makes from C++ (``ProcessGroupNCCL``'s ``recordStream`` on collective buffers),
which never pass through ``torch.Tensor.record_stream``.

The logger also logs ``torch.cuda.Stream.wait_stream`` (:class:`LoggedWait`, same sequence points): the
order the program put between its streams. The merge places each the same way (by the counts when they
agree with the trace, else after every op of time <= its own) as the trace's
:attr:`~gpumem.trace.Trace.stream_waits`, which a replay's simulated GPU honours (Note [Cross-stream waits]
in :mod:`gpumem.sim.gpu_work`): without them each simulated stream runs its work on its own, and a program
that chains its streams (copy, towers, main) has its GPU far less behind in the replay than live. A wait
is a wait wherever it lies in its gap (the work between two ops is one item on the first op's stream).
Not seen: waits made from C++ or through ``torch.cuda.Event.wait`` / ``Stream.wait_event``.

Calls PyTorch itself ignores are skipped, counted (:attr:`MergeReport.n_skipped`) and warned about once:
a null pointer (an empty tensor has none; ``recordStream`` returns at once, and the logger does not log
it) and an address that no allocation of the trace ever holds (memory not from the caching allocator,
or a block allocated before the history began): the replay has no such block to hold back, as the
shim's ``record`` and :class:`~gpumem.trace.TraceRecorder` skip them too. An address the trace holds at
other times but not at the call is still refused: that shows a misplaced log, not an ignored call.

Note [Counts checked against the call's time]
---------------------------------------------
The counts say where a call was only if the log's base is the history's: a logger started before
``_record_memory_history``, or a history that began at a point where everything alive is never freed,
offsets them by k allocations and k frees, which passes the trace's own check (``allocs_before[a + f]
== a``), and the call lands 2k ops away, on the next step's block at the same address. A PyTorch
snapshot's times and the log's are one clock (Unix microseconds), so each placement by the counts is
checked against the call's time: the ops around position ``p`` must not lie further than
:data:`TIME_TOLERANCE_US` from it (the latest time before ``p`` at most that much after the call, the
first time from ``p`` on at most that much before it). A placement that disagrees is dropped and the call
placed by time, which finds the allocation holding the pointer within the tolerance or refuses; the
merge warns once, naming the first disagreeing call and the count (:attr:`MergeReport.n_count_disagreed`).
Falling back rather than refusing: the time placement is checked on its own (an allocation must hold
the pointer within the tolerance, else the merge refuses), so a log with a bad base stays usable, and the
warning says its counts were not. The check needs one clock: when the log's calls lie outside the
snapshot's times (the warning of :data:`CLOCK_SLACK_US`) or the trace is not a PyTorch snapshot's, the
counts are taken as they are. Not caught: an offset whose ops all lie within the tolerance of the call
(a burst microseconds apart), which the time cannot tell apart either.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, TraceFormatError
from ._fileio import PathLike, iter_lines, open_binary, open_for_writing
from .limits import DEFAULT_LIMITS, TraceLimits, max_entries_for, printable, shorten
from .model import OpKind, StreamUse, StreamWait, Trace

__all__ = ["LOG_FORMAT", "LOG_VERSION", "TIME_TOLERANCE_US", "CLOCK_SLACK_US", "LoggedUse", "LoggedWait", "RecordStreamLog",
           "RecordStreamLogger",
           "MergeReport", "merge_stream_uses", "read_record_stream_log", "write_record_stream_log",
           "load_trace_with_stream_uses", "unknown_stream_uses"]

log = logging.getLogger(__name__)

LOG_FORMAT = "gpumem-record-stream-log"
LOG_VERSION = 1
#: How far (microseconds) a logged call's time may be from its block's life when it is placed by time
#: (Note [Placing a logged record_stream among a snapshot's ops]): PyTorch's cycle-counter times are
#: converted to Unix time by a linear fit, a few microseconds off.
TIME_TOLERANCE_US = 100.0
#: How far (microseconds) a PyTorch snapshot's log may have calls outside the snapshot's times before a merge
#: warns that it may be another run's (both are Unix time).
CLOCK_SLACK_US = 10e6
#: Bytes the log reader counts per use or wait against ``TraceLimits.max_memory_nbytes``: a
#: :class:`LoggedUse` with its ints and float time, its list slot and the tuple's, measured by resident
#: memory at about 224 bytes each with 40-bit pointers and 317 with every int past 2**62 (Python's ints
#: grow with their value).
LOG_ENTRY_NBYTES = 320
_INT64_MAX = 2**63 - 1
_DEVICE_KEY = re.compile(r"[0-9]{1,19}")
"""A device number as a ``base_counts`` key: ASCII digits (``str.isdigit`` takes "²", which ``int`` refuses),
few enough that ``int`` never meets Python's limit on digits."""


@dataclass(frozen=True, slots=True)
class LoggedUse:
    """One ``record_stream`` call: the storage pointer, the stream's ``cudaStream_t`` as an integer (0: the
    legacy default stream, as the snapshot writes it), the tensor's device, the call's Unix time in
    microseconds, and the allocator's allocation and free counts then (None when they could not be read)."""

    device: int
    ptr: int
    stream: int
    time_us: float
    n_allocs: int | None = None
    n_frees: int | None = None


@dataclass(frozen=True, slots=True)
class LoggedWait:
    """One ``torch.cuda.Stream.wait_stream`` call: work queued on ``stream`` from here on waits for the
    work queued on ``waited`` until now. Fields as :class:`LoggedUse`'s."""

    device: int
    stream: int
    waited: int
    time_us: float
    n_allocs: int | None = None
    n_frees: int | None = None


@dataclass(frozen=True)
class RecordStreamLog:
    """A program's ``record_stream`` calls, in call order.

    ``base_counts``: device -> ``(allocations, frees)`` the allocator had counted when the log began (the
    counts of each use are taken relative to them); ``n_unlogged``: calls that went through but could not
    be logged (no storage pointer or no ``cuda_stream`` on the arguments), which a merge refuses;
    ``waits``: the ``wait_stream`` calls (merged as the trace's stream waits: the module's docstring)."""

    uses: tuple[LoggedUse, ...] = ()
    base_counts: dict[int, tuple[int, int]] = field(default_factory=dict)
    n_unlogged: int = 0
    clock: str = "unix_us"
    waits: tuple[LoggedWait, ...] = ()

    def __post_init__(self) -> None:
        """The reader's checks on a log built through the API (so that the merge never meets a bad field and
        the writer never writes a file its reader refuses). Raises InvalidArgumentError naming the field."""
        if self.clock != "unix_us":
            raise InvalidArgumentError(f"RecordStreamLog.clock must be 'unix_us', not {shorten(self.clock)}")
        if not _is_int(self.n_unlogged):
            raise InvalidArgumentError(f"RecordStreamLog.n_unlogged must be an integer in [0, 2**63), not "
                                       f"{shorten(self.n_unlogged)}")
        base = self.base_counts
        if not isinstance(base, dict) or not all(
                _is_int(d) and isinstance(c, (tuple, list)) and len(c) == 2 and all(map(_is_int, c))
                for d, c in base.items()):
            raise InvalidArgumentError("RecordStreamLog.base_counts must map devices (integers >= 0) to "
                                       "(allocations, frees) integer pairs")
        object.__setattr__(self, "base_counts", {d: (c[0], c[1]) for d, c in base.items()})
        for name, kind, items in (("uses", LoggedUse, self.uses), ("waits", LoggedWait, self.waits)):
            if not isinstance(items, tuple):
                raise InvalidArgumentError(f"RecordStreamLog.{name} must be a tuple of {kind.__name__}")
            for k, item in enumerate(items):
                problem = _entry_problem(item, kind)
                if problem:
                    raise InvalidArgumentError(f"RecordStreamLog.{name}[{k}]: {problem}")

    def devices(self) -> list[int]:
        """The devices the uses and waits are on, sorted."""
        return sorted({u.device for u in self.uses} | {w.device for w in self.waits})

    def only_device(self) -> int | None:
        """The device all the calls are on; None when the log is empty or spans several devices."""
        devices = self.devices()
        return devices[0] if len(devices) == 1 else None


class RecordStreamLogger:
    """Logs every ``torch.Tensor.record_stream`` call between :meth:`start` and :meth:`stop` (or in a
    ``with`` block), and with ``waits`` every ``torch.cuda.Stream.wait_stream``; the call itself goes to
    PyTorch unchanged, first.

    ``torch`` is the module (passed in, so that tests give a stand-in); ``clock_ns`` the clock (Unix
    nanoseconds: the snapshot's); ``counts`` False skips the allocator's counts (placing by time only).
    Start it right after ``torch.cuda.memory._record_memory_history``: the counts are taken relative to
    those at :meth:`start`, which must be the counts when the history began."""

    def __init__(self, torch: Any, *, clock_ns: Callable[[], int] = time.time_ns, counts: bool = True,
                 waits: bool = True) -> None:
        self._torch = torch
        self._clock_ns = clock_ns
        self._counts_on = counts
        self._waits_on = waits
        self._uses: list[LoggedUse] = []
        self._waits: list[LoggedWait] = []
        self._patched: list[tuple[Any, str, bool, Any]] = []
        """``(class, name, had its own attribute, original)`` of each wrapped method, to put back."""
        self._base: dict[int, tuple[int, int]] = {}
        self._n_unlogged = 0

    # -- the allocator's counts ------------------------------------------------------------------------
    def _counts(self, device: int) -> tuple[int, int] | None:
        if not self._counts_on:
            return None
        stats = self._torch.cuda.memory_stats_as_nested_dict(device)
        try:
            alloc = stats["allocation"]["all"]
            return int(alloc["allocated"]), int(alloc["freed"])
        except (KeyError, TypeError):
            return None   # CUDA not initialised yet: nothing allocated, the base is 0 (see start)

    def start(self) -> RecordStreamLogger:
        """Wrap ``torch.Tensor.record_stream`` (and ``torch.cuda.Stream.wait_stream``). Raises
        InvalidArgumentError when a logger already wraps them."""
        tensor_cls = self._torch.Tensor
        current = getattr(tensor_cls, "record_stream")
        if getattr(current, "_gpumem_record_stream_logger", None) is not None:
            raise InvalidArgumentError("torch.Tensor.record_stream is already logged by a RecordStreamLogger")
        if self._counts_on:
            n = int(self._torch.cuda.device_count()) if self._torch.cuda.is_available() else 0
            self._base = {d: self._counts(d) or (0, 0) for d in range(n)}
        self._wrap(tensor_cls, "record_stream", self._note)
        stream_cls = getattr(self._torch.cuda, "Stream", None)
        if self._waits_on and stream_cls is not None and hasattr(stream_cls, "wait_stream"):
            self._wrap(stream_cls, "wait_stream", self._note_wait)
        return self

    def _wrap(self, cls: Any, name: str, note: Callable[[Any, Any], None]) -> None:
        """``cls.name`` calls the original, then ``note(self, arg)`` (a call that raised is not noted)."""
        original = getattr(cls, name)

        def wrapper(obj: Any, arg: Any) -> Any:
            out = original(obj, arg)
            note(obj, arg)
            return out

        wrapper.__doc__ = getattr(original, "__doc__", None)
        wrapper.__name__ = name
        wrapper._gpumem_record_stream_logger = self   # type: ignore[attr-defined]
        self._patched.append((cls, name, name in vars(cls), original))
        setattr(cls, name, wrapper)

    def stop(self) -> None:
        """Put the wrapped methods back (nothing when not started)."""
        while self._patched:
            cls, name, had_own, original = self._patched.pop()
            if had_own:
                setattr(cls, name, original)
            else:
                delattr(cls, name)

    def __enter__(self) -> RecordStreamLogger:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _note(self, tensor: Any, stream: Any) -> None:
        try:
            ptr = int(tensor.untyped_storage().data_ptr())
            handle = int(stream.cuda_stream)
            device = int(tensor.device.index) if tensor.device.index is not None else 0
        except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
            self._n_unlogged += 1
            if self._n_unlogged == 1:
                log.warning("record_stream(%s, %s) went through but cannot be logged (%s): a merge of this log "
                            "will refuse it", type(tensor).__name__, type(stream).__name__, exc)
            return
        if ptr == 0:   # an empty tensor: PyTorch's recordStream returns at once, there is no block to hold
            return
        t_us = self._clock_ns() / 1000.0
        counts = self._counts(device)
        self._uses.append(LoggedUse(device, ptr, handle, t_us, *(counts or (None, None))))

    def _note_wait(self, stream: Any, waited: Any) -> None:
        try:
            handle, other = int(stream.cuda_stream), int(waited.cuda_stream)
            device = getattr(getattr(stream, "device", None), "index", None) or 0
        except (AttributeError, TypeError, ValueError) as exc:
            # a missing wait makes a replay's GPU less behind than the program's, never frees anything early
            log.warning("wait_stream(%s) went through but cannot be logged (%s): a replay of this log runs that "
                        "stream's work without waiting", type(waited).__name__, exc)
            return
        t_us = self._clock_ns() / 1000.0
        counts = self._counts(int(device))
        self._waits.append(LoggedWait(int(device), handle, other, t_us, *(counts or (None, None))))

    def log(self) -> RecordStreamLog:
        """What was logged so far."""
        return RecordStreamLog(tuple(self._uses), dict(self._base), self._n_unlogged, waits=tuple(self._waits))


# -- the file ----------------------------------------------------------------------------------------------
def write_record_stream_log(rs: RecordStreamLog, path: PathLike) -> Path:
    """Write ``rs`` (gzip when ``path`` ends in ``.gz``): a JSON header line, then one JSON array per use,
    ``[device, ptr, stream, time_us, n_allocs, n_frees]``, then one object per wait,
    ``{"w": [device, stream, waited, time_us, n_allocs, n_frees]}``. Returns the path."""
    header = {"format": LOG_FORMAT, "version": LOG_VERSION, "clock": rs.clock, "n_uses": len(rs.uses),
              "n_waits": len(rs.waits), "n_unlogged": rs.n_unlogged,
              "base_counts": {str(d): list(c) for d, c in sorted(rs.base_counts.items())}}
    with open_for_writing(path) as f:
        f.write(json.dumps(header) + "\n")
        f.writelines(json.dumps([u.device, u.ptr, u.stream, u.time_us, u.n_allocs, u.n_frees]) + "\n" for u in rs.uses)
        f.writelines(json.dumps({"w": [w.device, w.stream, w.waited, w.time_us, w.n_allocs, w.n_frees]}) + "\n"
                     for w in rs.waits)
    return Path(path)


def _is_int(v: Any, lo: int = 0) -> bool:
    return type(v) is int and lo <= v <= _INT64_MAX


def _entry_problem(item: Any, kind: type) -> str:
    """Why ``item`` is not a valid :class:`LoggedUse` / :class:`LoggedWait` (``kind``) as the reader would
    read it back, or ``""``."""
    if type(item) is not kind:
        return f"expected a {kind.__name__}, not a {type(item).__name__}"
    ints = ("device", "ptr", "stream") if kind is LoggedUse else ("device", "stream", "waited")
    for name in ints:
        if not _is_int(getattr(item, name)):
            return f"{name} must be an integer in [0, 2**63), not {shorten(getattr(item, name))}"
    if _finite_time(item.time_us) is None:
        return f"time_us must be a finite number, not {shorten(item.time_us)}"
    n_allocs, n_frees = item.n_allocs, item.n_frees
    if (n_allocs is None) != (n_frees is None) or not all(c is None or _is_int(c) for c in (n_allocs, n_frees)):
        return "n_allocs and n_frees must both be integers in [0, 2**63), or both None"
    return ""


def read_record_stream_log(path: PathLike, *, limits: TraceLimits | None = None) -> RecordStreamLog:
    """Read a log written by :func:`write_record_stream_log` (gzipped or not), under ``limits``.

    Raises ``FileNotFoundError`` for a missing file and ``TraceFormatError`` naming the file and line for
    anything else wrong (another format or version, a malformed line, a count that disagrees)."""
    limits = limits or DEFAULT_LIMITS
    where = str(path)
    uses: list[LoggedUse] = []
    waits: list[LoggedWait] = []
    header: dict[str, Any] | None = None
    max_entries, binding = max_entries_for(limits, entry_nbytes=LOG_ENTRY_NBYTES)
    with open_binary(path, limits=limits) as f:
        for lineno, text in iter_lines(f, where, limits, skip_blank=True):
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                raise TraceFormatError(where, f"line {lineno}: not JSON: {shorten(text)}") from None
            if header is None:
                header = _check_header(value, where)
                continue
            if len(uses) + len(waits) >= max_entries:
                raise TraceFormatError(where, f"line {lineno}: more than {max_entries:,} entries ({binding}); "
                                              "raise the limit if the file is genuine")
            if isinstance(value, dict) and list(value) == ["w"]:
                waits.append(LoggedWait(*_parse_use(value["w"], where, lineno, "[device, stream, waited, "
                                                    "time_us, n_allocs, n_frees]")))
            else:
                uses.append(LoggedUse(*_parse_use(value, where, lineno)))
    if header is None:
        raise TraceFormatError(where, "empty: no header line")
    if len(uses) != header["n_uses"] or len(waits) != header.get("n_waits", 0):
        raise TraceFormatError(where, f"header says {header['n_uses']} uses and {header.get('n_waits', 0)} waits, "
                                      f"the file has {len(uses)} and {len(waits)} (truncated?)")
    base = {int(d): (c[0], c[1]) for d, c in header["base_counts"].items()}
    return RecordStreamLog(tuple(uses), base, header["n_unlogged"], header["clock"], tuple(waits))


def _check_header(h: Any, where: str) -> dict[str, Any]:
    if not isinstance(h, dict) or h.get("format") != LOG_FORMAT:
        raise TraceFormatError(where, f"line 1: not a record_stream log (no \"format\": \"{LOG_FORMAT}\")")
    if h.get("version") != LOG_VERSION or type(h.get("version")) is not int:
        raise TraceFormatError(where, f"line 1: version {shorten(h.get('version'))}, this gpumem reads {LOG_VERSION}")
    if h.get("clock") != "unix_us":
        raise TraceFormatError(where, f"line 1: clock {shorten(h.get('clock'))}, expected \"unix_us\"")
    for key, required in (("n_uses", True), ("n_unlogged", True), ("n_waits", False)):
        if not _is_int(h.get(key, None if required else 0)):
            raise TraceFormatError(where, f"line 1: {key!r} must be an integer >= 0")
    base = h.get("base_counts", {})
    if not isinstance(base, dict) or not all(
            isinstance(d, str) and _DEVICE_KEY.fullmatch(d) and int(d) <= _INT64_MAX and isinstance(c, list) and len(c) == 2 and all(map(_is_int, c))
            for d, c in base.items()):
        raise TraceFormatError(where, "line 1: 'base_counts' must map device numbers to [allocations, frees]")
    return dict(h, base_counts=base)


def _parse_use(v: Any, where: str, lineno: int,
               shape: str = "[device, ptr, stream, time_us, n_allocs, n_frees]") -> tuple[Any, ...]:
    """The six fields of a use (or of a wait, whose second and third are its streams), checked."""
    if not isinstance(v, list) or len(v) != 6:
        raise TraceFormatError(where, f"line {lineno}: expected {shape}")
    device, ptr, stream, t, n_allocs, n_frees = v
    if not (_is_int(device) and _is_int(ptr) and _is_int(stream)):
        names = ", ".join(shape.strip("[]").split(", ")[:3])
        raise TraceFormatError(where, f"line {lineno}: {names} must be integers in [0, 2**63)")
    if _finite_time(t) is None:
        raise TraceFormatError(where, f"line {lineno}: time_us must be a finite number, not {shorten(t)}")
    if (n_allocs is None) != (n_frees is None) or not all(c is None or _is_int(c) for c in (n_allocs, n_frees)):
        raise TraceFormatError(where, f"line {lineno}: n_allocs and n_frees must both be integers >= 0, or both null")
    return device, ptr, stream, _finite_time(t), n_allocs, n_frees


def _finite_time(t: Any) -> float | None:
    """``t`` as a finite float, or None: not a number, NaN, infinite, or an integer too large for a float
    (``math.isfinite`` raises OverflowError on one, where the reader must name the line)."""
    if type(t) not in (int, float):
        return None
    try:
        f = float(t)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


# -- the merge -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MergeReport:
    """What :func:`merge_stream_uses` did: uses merged, how each was placed (Note [Placing a logged
    record_stream among a snapshot's ops]), those on the block's own stream (kept; a replay ignores them,
    as PyTorch does), and the other streams named."""

    n_uses: int
    n_by_count: int
    n_by_time: int
    n_own_stream: int
    streams: tuple[int, ...]
    n_waits: int = 0
    """``wait_stream`` calls merged as stream waits (:attr:`~gpumem.trace.Trace.stream_waits`)."""
    n_waits_by_count: int = 0
    """Of :attr:`n_waits`, those placed by the allocator's counts (the others by time)."""
    n_skipped: int = 0
    """``record_stream`` calls skipped as PyTorch ignores them: a null pointer, or an address no allocation
    of the trace ever holds (the module's docstring)."""
    n_count_disagreed: int = 0
    """Calls (uses and waits) whose counts put them where the snapshot's times disagree, placed by time
    instead (Note [Counts checked against the call's time])."""

    def __str__(self) -> str:
        text = (f"{self.n_uses} record_stream use(s) merged ({self.n_by_count} placed by the allocator's counts, "
                f"{self.n_by_time} by time; {self.n_own_stream} on the block's own stream)")
        if self.n_waits:
            text += (f", {self.n_waits} wait_stream call(s) merged ({self.n_waits_by_count} placed by the counts, "
                     f"{self.n_waits - self.n_waits_by_count} by time)")
        if self.n_skipped:
            text += f", {self.n_skipped} record_stream call(s) skipped (a null or foreign pointer)"
        if self.n_count_disagreed:
            text += f", {self.n_count_disagreed} call(s) whose counts disagreed with their times placed by time"
        return text


def merge_stream_uses(trace: Trace, rs: RecordStreamLog, *, device: int | None = None,
                      where: str = "<record_stream log>") -> tuple[Trace, MergeReport]:
    """``trace`` (a PyTorch snapshot's, one device) with the uses of ``rs`` on ``device`` as its
    :attr:`~gpumem.trace.Trace.stream_uses` and the waits as its :attr:`~gpumem.trace.Trace.stream_waits`,
    and what was done. ``device``: the snapshot's device the trace is of (its index in ``device_traces``);
    None: the log's only device, which nothing can then check against the trace (callers that loaded the
    snapshot pass it: :func:`load_trace_with_stream_uses` loads the log's device). A log whose calls lie far
    outside a PyTorch snapshot's times (:data:`CLOCK_SLACK_US`) is merged with a warning. Ops of NaN time
    take the time before them when calls are placed by time (:func:`_times_for_placing`).

    Raises:
        InvalidArgumentError: ``trace`` has stream uses or waits already, or the log holds several devices
            and ``device`` is None.
        TraceFormatError (naming ``where`` and the use's index): the log is not empty and none of its calls
            is on ``device`` (a log of another device: nothing would merge), the log has calls it could not log, a use
            names a stream that runs none of the trace's operations (the replay has no work there to
            wait for: the log is of another program, or the stream handle is not the snapshot's), or no
            allocation of the trace holds the pointer at that point; a wait names two streams of which neither
            runs any of the trace's operations (a wait naming one such stream is kept: a chain of waits
            runs through it).
    ``trace`` itself is never changed.
    """
    if trace.stream_uses or trace.stream_waits:
        raise InvalidArgumentError(f"{printable(trace.name)} has {len(trace.stream_uses)} stream uses and "
                                   f"{len(trace.stream_waits)} stream waits already: merging a record_stream log "
                                   "would add them twice")
    if rs.n_unlogged:
        raise TraceFormatError(where, f"{rs.n_unlogged} record_stream call(s) could not be logged: the log is "
                                      "incomplete, a replay of it would free those blocks too early")
    devices = rs.devices()
    if device is None:
        if len(devices) > 1:
            raise InvalidArgumentError(f"{where}: uses on devices {devices}: pass device= to choose the trace's")
        device = devices[0] if devices else 0
    elif devices and device not in devices:   # nothing of the log would merge: say so, never drop it silently
        raise TraceFormatError(where, f"the log's calls are on device(s) {devices}, the trace is of device {device}: "
                                      "a log of another device (or of another run)")
    picked = [(k, u) for k, u in enumerate(rs.uses) if u.device == device]
    n_ops = trace.n_ops
    kinds = trace.kinds
    is_alloc = kinds == OpKind.ALLOC
    alloc_pos = np.flatnonzero(is_alloc)
    free_pos = np.full(len(alloc_pos), n_ops, dtype=np.int64)
    frees = np.flatnonzero(~is_alloc)
    free_pos[trace.alloc_ids[frees]] = frees
    blocks = _Blocks(alloc_pos, free_pos, trace.addrs[alloc_pos], np.maximum(trace.nbytes[alloc_pos], 1))
    allocs_before = np.concatenate(([0], np.cumsum(is_alloc, dtype=np.int64)))
    times = _times_for_placing(trace.times_us)
    on_device = [u.time_us for _, u in picked] + [w.time_us for w in rs.waits if w.device == device]
    one_clock = not _warn_if_clocks_differ(trace, on_device, where) and trace.source == "pytorch-snapshot"
    after = _next_times(trace.times_us) if one_clock else times
    known = set(np.unique(trace.streams).tolist())
    base = rs.base_counts.get(device)
    counts_usable = trace.n_unmatched_frees == 0 and base is not None
    n_disagreed = 0
    first_disagreed = ""

    def by_counts(c: LoggedUse | LoggedWait, what: str) -> int | None:
        """The position the call's counts give, when they agree with the trace and, on one clock, with the
        call's time (Note [Counts checked against the call's time]); else None."""
        if not counts_usable or c.n_allocs is None:
            return None
        a, f = c.n_allocs - base[0], c.n_frees - base[1]   # type: ignore[index,operator]
        if not (a >= 0 and f >= 0 and a + f <= n_ops and allocs_before[a + f] == a):
            return None
        p = a + f
        if one_clock:
            before = float(times[p - 1]) if p else -math.inf   # the latest op time before p
            later = float(after[p]) if p < n_ops else math.inf   # the first op time from p on
            if before - TIME_TOLERANCE_US > c.time_us or c.time_us > max(later, before) + TIME_TOLERANCE_US:
                nonlocal n_disagreed, first_disagreed
                n_disagreed += 1
                if not first_disagreed:
                    near = f"op {p - 1} at {before:.0f} us" if p else "the trace's start"
                    first_disagreed = f"{what} at {c.time_us:.0f} us, which its counts put after {near}"
                return None
        return p

    alloc_stream = trace.streams[alloc_pos]
    merged: list[tuple[int, int, StreamUse]] = []
    n_by_count = n_own = 0
    skipped: list[int] = []
    for k, u in picked:
        if u.ptr == 0 or not blocks.ever_holds(u.ptr):   # a call PyTorch ignores (the module's docstring)
            skipped.append(k)
            continue
        if u.stream not in known:
            raise TraceFormatError(where, f"record_stream of {u.ptr:#x} on stream {u.stream}: no operation of "
                                          f"{printable(trace.name)} runs on that stream (its streams: "
                                          f"{sorted(known)})", entry=k)
        p = by_counts(u, f"entry {k} (record_stream of {u.ptr:#x} on stream {u.stream})")
        by_count = p is not None
        if by_count:   # the counts agree with the trace: they say exactly where the call was
            aid = blocks.live_at(p, u.ptr)
        else:
            p, aid = _by_time(u, times, blocks)
        if aid is None:
            at = f"after op {p - 1}" if by_count else f"time {u.time_us:.0f} us"
            raise TraceFormatError(where, f"record_stream of {u.ptr:#x} on stream {u.stream} ({at}): no allocation "
                                          f"of {printable(trace.name)} holds that address then", entry=k)
        n_by_count += by_count
        n_own += int(alloc_stream[aid]) == u.stream
        merged.append((p, k, StreamUse(int(p), int(aid), int(u.stream), float(u.time_us))))
    merged.sort(key=lambda m: (m[0], m[1]))
    uses = tuple(m[2] for m in merged)
    waits: list[tuple[int, int, StreamWait]] = []
    n_waits_by_count = 0
    for k, w in enumerate(rs.waits):
        if w.device != device:
            continue
        if w.stream not in known and w.waited not in known:
            raise TraceFormatError(where, f"wait_stream of stream {w.stream} on stream {w.waited}: no operation of "
                                          f"{printable(trace.name)} runs on either (its streams: {sorted(known)})",
                                   entry=len(rs.uses) + k)
        p = by_counts(w, f"entry {len(rs.uses) + k} (wait_stream of stream {w.stream} on stream {w.waited})")
        if p is None:
            p = int(np.searchsorted(times, w.time_us, side="right"))
        else:
            n_waits_by_count += 1
        waits.append((p, k, StreamWait(int(p), int(w.stream), int(w.waited), float(w.time_us))))
    waits.sort(key=lambda m: (m[0], m[1]))
    if skipped:
        log.warning("%s: %d record_stream call(s) skipped (first: entry %d, pointer %#x): a null pointer or an "
                    "address no allocation of %s ever holds (memory not from the caching allocator, or allocated "
                    "before the history began), which PyTorch's recordStream ignores too", where, len(skipped),
                    skipped[0], rs.uses[skipped[0]].ptr, printable(trace.name))
    if n_disagreed:
        log.warning("%s: %d call(s) placed by time, not by their allocator counts, which disagree with the "
                    "snapshot's times by more than %.0f us (first: %s): the log's base counts are not the "
                    "history's (a logger started before _record_memory_history, or a ring buffer that wrapped)",
                    where, n_disagreed, TIME_TOLERANCE_US, first_disagreed)
    out = Trace(trace.name, trace.source, trace.kinds, trace.alloc_ids, trace.nbytes, trace.streams, trace.times_us,
                trace.addrs, n_unmatched_frees=trace.n_unmatched_frees, n_failed_allocs=trace.n_failed_allocs,
                stream_uses=uses, stream_waits=tuple(m[2] for m in waits),
                plan_events=trace.plan_events,   # the ops are the trace's: its plan events stay where they were
                gpu_times_us=trace.gpu_times_us, live_reserved_nbytes=trace.live_reserved_nbytes)
    report = MergeReport(len(uses), n_by_count, len(uses) - n_by_count, n_own,
                         tuple(sorted({u.stream for u in uses})), len(waits), n_waits_by_count,
                         n_skipped=len(skipped), n_count_disagreed=n_disagreed)
    return out, report


def _times_for_placing(times_us: np.ndarray) -> np.ndarray:
    """The ops' times made non-decreasing for ``searchsorted`` (Note [Placing a logged record_stream among a
    snapshot's ops]): each op at the latest time so far. A NaN time (a .gmt may hold one) is skipped: the op
    takes the last finite time before it (-inf before the first), so that one NaN cannot carry to every later
    op and send every call placed by time to the trace's start."""
    if not len(times_us):
        return times_us
    return np.maximum.accumulate(np.where(np.isnan(times_us), -np.inf, times_us))


def _next_times(times_us: np.ndarray) -> np.ndarray:
    """For each op, the earliest finite time at it or after it (+inf when none): the upper end of where a
    call placed before that op may lie (Note [Counts checked against the call's time])."""
    if not len(times_us):
        return times_us
    return np.minimum.accumulate(np.where(np.isnan(times_us), np.inf, times_us)[::-1])[::-1]


def _warn_if_clocks_differ(trace: Trace, times_us: list[float], where: str) -> bool:
    """Warn when a PyTorch snapshot's log has calls far (:data:`CLOCK_SLACK_US`) outside the snapshot's span:
    both clocks are Unix microseconds, so the log is of another run (placing by the counts cannot check
    such a call against its time, and would take it silently). Returns whether it warned."""
    if trace.source != "pytorch-snapshot" or not times_us:
        return False
    finite = trace.times_us[np.isfinite(trace.times_us)]
    if not len(finite):
        return False
    first, last = float(finite.min()), float(finite.max())
    outside = [t for t in times_us if not first - CLOCK_SLACK_US <= t <= last + CLOCK_SLACK_US]
    if outside:
        log.warning("%s: %d of its %d call(s) on this device lie more than %.0f s outside the snapshot's times "
                    "(%.0f .. %.0f us, Unix): is the log of another run?", where, len(outside), len(times_us),
                    CLOCK_SLACK_US / 1e6, first, last)
    return bool(outside)


class _Blocks:
    """The trace's allocations for looking up the one holding a pointer at a position (Note [Finding the
    allocation live at a position]).

    Note [Finding the allocation live at a position]
    ------------------------------------------------
    A merge asks, for each logged call, which allocation holds ``ptr`` at position ``p`` (made before
    op ``p``, freed at op ``p`` or later). PyTorch reuses an address at once: a block used every step
    comes back at the same address thousands of times, so walking every allocation ever made at the
    address made a merge quadratic (about 35 s for 40,000 blocks at one address). The allocations are
    grouped by address, in position order (ids are in position order); at one address lives do not
    overlap in a snapshot (its reader refuses an address reused while live), so the one live at ``p``
    can only be the last one made before ``p``: one bisection. An address whose lives overlap (a .gmt or
    a hand-built trace may have that) is walked as before, lowest id first, so the answer is the one the
    walk gave. Blocks holding ``ptr`` inside (past their start) are found among the blocks sorted by
    address: those below ``ptr`` and past the first whose running largest end passes it (usually none;
    a large block low in a segment that small ones later reuse makes it more). Placing by time
    (:func:`_by_time`) looks for the position nearest its first guess, within :data:`TIME_TOLERANCE_US`,
    at which an allocation holds ``ptr``: each holder's life clipped to that window (at ``ptr`` itself
    only the lives meeting the window, by bisection), the point nearest the guess in each, the nearest of
    these (the earlier on a tie), in numpy; trying every position of the window made one numpy pass over
    every allocation per position.
    """

    def __init__(self, alloc_pos: np.ndarray, free_pos: np.ndarray, addr: np.ndarray, extent: np.ndarray) -> None:
        self.alloc_pos, self.free_pos = alloc_pos, free_pos
        order = np.argsort(addr, kind="stable")   # by address, then by id (= by position)
        self._order = order
        self._ids = order.tolist()
        self._apos = alloc_pos[order].tolist()
        self._fpos = free_pos[order].tolist()
        self._sorted_addr = sorted_addr = addr[order]
        # ends in uint64: an address near 2**63 plus its size passes int64 (Trace admits it) and would wrap; a
        # negative address (a hand-built trace) ends at its end, or at 0 when that is below 0 (holds no pointer)
        end = np.where(addr >= 0, addr.astype(np.uint64) + extent.astype(np.uint64),
                       np.maximum(np.minimum(addr, 0) + extent, 0).astype(np.uint64))
        self._sorted_end = end[order]
        # the largest end of the blocks at or below each address: those before the first that passes ptr
        # cannot hold it
        self._reach = np.maximum.accumulate(self._sorted_end) if len(order) else self._sorted_end
        starts = np.flatnonzero(np.r_[True, sorted_addr[1:] != sorted_addr[:-1]]) if len(order) else order
        ends = np.r_[starts[1:], len(order)]
        # lives overlap where the next allocation at the address is made before this one is freed
        overlap = np.r_[(free_pos[order][:-1] >= alloc_pos[order][1:]) & (sorted_addr[:-1] == sorted_addr[1:]),
                        False] if len(order) else np.zeros(0, bool)
        n_overlap = np.r_[0, np.cumsum(overlap)]
        self._at = {a: (s, e, bool(n_overlap[e - 1] - n_overlap[s]))
                    for a, s, e in zip(sorted_addr[starts].tolist(), starts.tolist(), ends.tolist())}

    def _inside(self, ptr: int) -> np.ndarray:
        """The allocations holding ``ptr`` past their start (whenever they lived), by address."""
        below = int(np.searchsorted(self._sorted_addr, ptr, side="left"))
        first = int(np.searchsorted(self._reach, ptr, side="right"))
        if first >= below:
            return self._order[:0]
        return self._order[first:below][self._sorted_end[first:below] > ptr]

    def ever_holds(self, ptr: int) -> bool:
        """Whether any allocation of the trace holds ``ptr`` (at its start or inside), at any time."""
        return ptr in self._at or len(self._inside(ptr)) > 0

    def live_at(self, p: int, ptr: int) -> int | None:
        """The allocation live before op ``p`` (made before it, freed at it or later) that holds ``ptr``: one
        made at ``ptr`` first (the lowest id), else the lowest id of those holding it inside."""
        found = self._at.get(ptr)
        if found is not None:
            s, e, overlapping = found
            if overlapping:
                for j in range(s, e):
                    if self._apos[j] < p <= self._fpos[j]:
                        return self._ids[j]
            else:
                j = bisect.bisect_left(self._apos, p, s, e) - 1
                if j >= s and self._fpos[j] >= p:
                    return self._ids[j]
        h = self._inside(ptr)
        live = h[(self.alloc_pos[h] < p) & (self.free_pos[h] >= p)]
        return int(live.min()) if len(live) else None

    def holders_near(self, ptr: int, lo: int, hi: int) -> np.ndarray:
        """The allocations holding ``ptr`` (at their start or inside), among them all whose life meets
        positions ``lo .. hi`` (some others too)."""
        parts = [self._inside(ptr)]
        found = self._at.get(ptr)
        if found is not None:
            s, e, overlapping = found
            if not overlapping:   # lives in order: those freed at lo or later and made before hi
                s, e = bisect.bisect_left(self._fpos, lo, s, e), bisect.bisect_left(self._apos, hi, s, e)
            parts.append(self._order[s:max(s, e)])
        return np.concatenate(parts)


def _by_time(u: LoggedUse, times: np.ndarray, blocks: _Blocks) -> tuple[int, int | None]:
    """Place ``u`` after every op of time <= its own; else take the allocation holding ``ptr`` live within
    :data:`TIME_TOLERANCE_US` and move the use inside its life, at the position nearest the first guess (the
    earlier on a tie; the Notes)."""
    t = u.time_us
    p = int(np.searchsorted(times, t, side="right"))
    aid = blocks.live_at(p, u.ptr)
    if aid is not None:
        return p, aid
    lo = int(np.searchsorted(times, t - TIME_TOLERANCE_US, side="left"))
    hi = int(np.searchsorted(times, t + TIME_TOLERANCE_US, side="right"))
    h = blocks.holders_near(u.ptr, lo, hi)
    first = np.maximum(blocks.alloc_pos[h] + 1, lo)    # each holder's life, (alloc, free], within [lo, hi]
    last = np.minimum(blocks.free_pos[h], hi)
    ok = first <= last
    if not ok.any():
        return p, None
    h, first, last = h[ok], first[ok], last[ok]
    nearest = np.clip(p, first, last)
    dist = np.abs(nearest - p)
    q = int(nearest[dist == dist.min()].min())
    return q, blocks.live_at(q, u.ptr)


def load_trace_with_stream_uses(trace_path: PathLike, log_path: PathLike, *, device: int | None = None,
                                limits: TraceLimits | None = None, **load_options: Any) -> tuple[Trace, MergeReport]:
    """:func:`~gpumem.trace.load_trace` of ``trace_path`` with the ``record_stream`` log at ``log_path``
    merged (:func:`merge_stream_uses`). ``device`` picks the snapshot's device and the log's; None: the
    device of the log's calls (the loader refuses a snapshot with no trace for it), or the snapshot's only
    one when the log is empty or spans several devices (the merge then refuses the latter)."""
    from .io import load_trace

    rs = read_record_stream_log(log_path, limits=limits)
    if device is None:   # the log's device picks the snapshot's: a log of another device is refused
        device = rs.only_device()
    trace = load_trace(trace_path, device=device, limits=limits, **load_options)
    return merge_stream_uses(trace, rs, device=device, where=str(log_path))


def unknown_stream_uses(trace: Trace, uses_recorded: bool) -> str | None:
    """Why a replay of ``trace`` cannot predict its program, or None when it can, as far as streams go.

    A program that ran on several streams may have used blocks across them; a trace with no stream uses
    cannot say whether it did unless its recording was able to record them (``uses_recorded``: gpumem's
    recorder since ``.gmt`` version 2, a PyTorch snapshot with its :class:`RecordStreamLogger` log). Without
    them a replay hands such blocks out too early (run 1's multistream row: live 50.04 %, replayed 25.09 %)."""
    if trace.stream_uses or uses_recorded or trace.n_ops == 0:
        return None
    n_streams = len(np.unique(trace.streams))
    if n_streams <= 1:
        return None
    return (f"not scored: the program ran on {n_streams} streams and its trace was recorded without its "
            "record_stream calls")
