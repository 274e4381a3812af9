"""RMM ``logging_resource_adaptor`` CSV logs: reading and writing.

RAPIDS Memory Manager's logging adaptor writes one CSV line per call::

    Thread,Time,Action,Pointer,Size,Stream
    3228,21:50:47.674565,allocate,0x7f49e3e00000,37632,0
    3228,21:50:47.789937,free,0x7f49e3e00000,37632,0
    3228,21:50:47.790001,allocate failure,0x0,1099511627776,0

* ``Time`` is the wall-clock *time of day* with microseconds. It is converted to
  microseconds since midnight of the first line's day; when it jumps back by more
  than 12 hours the day has changed and a day is added, so times stay
  monotonic across midnight (smaller backward steps, from threads logging out of
  order, are kept as they are). Gaps of 12 hours or more between consecutive lines
  cannot be told from a wrap.
* ``Pointer`` is hexadecimal; ``Stream`` is decimal or ``0x`` hexadecimal.
* ``allocate`` becomes an ALLOC op, ``free`` the FREE op of the allocation at that
  pointer (its ``Size`` column is not needed: a free of another size than its allocation's
  is kept with the allocation's, and such frees are counted in one warning naming the first);
  ``allocate failure`` is counted in ``n_failed_allocs``. A free of a pointer never allocated
  in the log is skipped and counted (allocated before logging began); a second free of a pointer
  whose allocation in the log was freed already, like an allocation at a pointer still live, means
  lines were lost and is refused. ``Thread`` is ignored. Columns are found by header name, so
  extra columns are tolerated; a column named twice is refused (which one is meant cannot be told).

:func:`write_rmm_log` writes the same format (thread 0, times taken modulo a day
after rounding to whole microseconds), so a trace with non-decreasing times whose
consecutive gaps are under 12 hours reads back with the same ops and the same
times *relative to the first op*, to the microsecond.

The reader streams the file line by line under
:class:`~gpumem.trace.limits.TraceLimits` (bounded line length, at most
``max_entries`` lines and ``max_memory_nbytes // ENTRY_NBYTES`` events, the
decompressed-size and ratio caps), keeps events in compact array columns,
range-checks every number (ASCII digits only: no Unicode digits, no underscores;
sizes, pointers and streams non-negative), and quotes at most a short prefix of
a bad field in its errors.
"""

from __future__ import annotations

import re
from array import array
from pathlib import Path

import numpy as np

from ..errors import TraceFormatError
from ._fileio import PathLike, check_exists, iter_lines, open_binary, open_for_writing, trace_name_from_path
from .builder import AddressReuseError, SecondFreeError, build_trace, replay_addresses
from .limits import DEFAULT_LIMITS, TraceLimits, max_entries_for, shorten
from .model import OpKind, Trace

__all__ = ["RMM_HEADER", "read_rmm_log", "write_rmm_log", "parse_time_of_day_us", "format_time_of_day"]

RMM_HEADER = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
_REQUIRED = ("Time", "Action", "Pointer", "Size", "Stream")
_ACTION_CODES = {"allocate": 0, "free": 1, "allocate failure": 2}
_DAY_US = 86_400_000_000
_HALF_DAY_US = _DAY_US // 2
_INT64_MAX = 2**63 - 1
_DEC_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_HEX_INT = re.compile(r"[+-]?(?:0[xX])?[0-9a-fA-F]+", re.ASCII)
_TIME_OF_DAY = re.compile(r"([0-9]{1,2}):([0-9]{1,2}):([0-9]{1,2})(?:\.([0-9]{0,9}))?", re.ASCII)


def parse_time_of_day_us(text: str) -> int:
    """``"21:50:47.674565"`` -> microseconds since midnight. Raises ``ValueError`` when malformed."""
    m = _TIME_OF_DAY.fullmatch(text.strip())  # ASCII digits only: str.isdigit() admits "١٢" and "²"
    if m is None:
        raise ValueError(f"time of day {shorten(text)} is not HH:MM:SS.ffffff")
    hour, minute, second = (int(g) for g in m.groups()[:3])
    frac = m.group(4) or ""
    if not (0 <= hour < 24 and 0 <= minute < 60 and 0 <= second < 61):
        raise ValueError(f"time of day out of range: {shorten(text)}")
    us = int((frac + "000000")[:6]) if frac else 0
    return ((hour * 60 + minute) * 60 + second) * 1_000_000 + us


def format_time_of_day(time_us: float) -> str:
    """Microseconds (any origin) -> ``HH:MM:SS.ffffff``, rounded to the microsecond, modulo one day."""
    t = round(time_us) % _DAY_US
    seconds, us = divmod(t, 1_000_000)
    minutes, second = divmod(seconds, 60)
    hour, minute = divmod(minutes, 60)
    return f"{hour:02d}:{minute:02d}:{second:02d}.{us:06d}"


def _parse_int(text: str, what: str = "stream", *, hexadecimal: bool = False) -> int:
    """A decimal or ``0x`` hexadecimal (always hexadecimal when ``hexadecimal``) integer in ``(-2**63, 2**63)``.

    Raises ``ValueError`` quoting at most a short prefix of ``text``.
    """
    text = text.strip()
    base = 16 if hexadecimal or text.lstrip("+-")[:2].lower() == "0x" else 10
    if len(text) > 20:
        raise ValueError(f"{what} {shorten(text)} is not a 64-bit integer")
    pattern = _HEX_INT if base == 16 else _DEC_INT
    if not pattern.fullmatch(text):  # int() would take Unicode digits ("١٢") and underscores ("1_0")
        raise ValueError(f"{what} {shorten(text)} is not {'a hexadecimal' if base == 16 else 'an'} integer")
    value = int(text, base)
    if abs(value) > _INT64_MAX:
        raise ValueError(f"{what} {value} does not fit in 64 bits")
    return value


def read_rmm_log(path: PathLike, *, name: str | None = None, limits: TraceLimits | None = None,
                 progress: bool | None = False) -> Trace:
    """Read an RMM logging-adaptor CSV (gzipped or not) as a :class:`Trace` with ``source == "rmm-log"``.

    Raises ``TraceFormatError`` naming the file and line for a bad header, a
    malformed line, an unknown action, a number out of range, an exceeded limit
    (``limits``, default :data:`~gpumem.trace.limits.DEFAULT_LIMITS`) or an
    allocation at a pointer still live. ``progress`` shows the bytes read (None:
    only on a terminal).
    """
    where = str(path)
    check_exists(path)
    limits = limits or DEFAULT_LIMITS
    max_lines, binding = max_entries_for(limits)
    codes = array("b")  # compact columns: ~41 bytes per event instead of ~250 in lists of ints
    addrs = array("q")
    sizes = array("q")
    streams = array("q")
    times = array("q")
    linenos = array("q")  # the line of each event, to name it in an error found after reading
    with open_binary(path, limits=limits, progress=progress) as f:
        lines = iter_lines(f, where, limits, skip_blank=True)
        first = next(lines, None)
        header = first[1].strip() if first else ""
        if not header:
            raise TraceFormatError(where, "line 1: empty file, expected the RMM log header " + ",".join(RMM_HEADER))
        columns = [c.strip() for c in header.split(",")]
        # empty names (a header that ends in commas) name no column: not a repeat (second attacker review)
        repeated = sorted({c for c in columns if c and columns.count(c) > 1})
        if repeated:   # which of the two would be meant cannot be told: refused, not the first taken
            raise TraceFormatError(where, f"line 1: header {shorten(header)} repeats column(s) "
                                          f"{', '.join(shorten(c, 40) for c in repeated)}; each column may appear once")
        missing = [c for c in _REQUIRED if c not in columns]
        if missing:
            raise TraceFormatError(where, f"line 1: header {shorten(header)} lacks column(s) {', '.join(missing)}")
        i_time, i_action, i_ptr, i_size, i_stream = (columns.index(c) for c in _REQUIRED)
        n_cols = len(columns)
        day_offset = 0
        prev = None
        for lineno, line in lines:
            if not line.strip():
                continue
            fields = line.split(",")
            if len(fields) != n_cols:
                raise TraceFormatError(where, f"line {lineno}: {len(fields)} fields, the header has {n_cols}")
            action = fields[i_action].strip()
            code = _ACTION_CODES.get(action)
            if code is None:
                raise TraceFormatError(where, f"line {lineno}: unknown action {shorten(action)}")
            try:
                t = parse_time_of_day_us(fields[i_time]) + day_offset
                if prev is not None and t < prev - _HALF_DAY_US:
                    day_offset += _DAY_US
                    t += _DAY_US
                size = _parse_int(fields[i_size], "size")
                stream = _parse_int(fields[i_stream], "stream")
                addr = 0 if code == 2 else _parse_int(fields[i_ptr], "pointer", hexadecimal=True)
            except ValueError as e:
                raise TraceFormatError(where, f"line {lineno}: {e}") from None
            if size < 0:
                raise TraceFormatError(where, f"line {lineno}: negative size {size}")
            if addr < 0:
                raise TraceFormatError(where, f"line {lineno}: negative pointer {addr:#x}")
            if stream < 0:
                raise TraceFormatError(where, f"line {lineno}: negative stream {stream} (stream ids are >= 0)")
            if t > _INT64_MAX:
                raise TraceFormatError(where, f"line {lineno}: time out of range")
            if len(codes) >= max_lines:
                raise TraceFormatError(where, f"line {lineno}: more than {max_lines:,} events ({binding}); "
                                              "raise the limit if the file is genuine")
            prev = t
            codes.append(code)
            addrs.append(addr)
            sizes.append(size)
            streams.append(stream)
            times.append(t)
            linenos.append(lineno)
    try:
        return build_trace(
            name if name is not None else trace_name_from_path(path), "rmm-log",
            codes, addrs, sizes, streams, times, origin=where, n_failed_allocs=codes.count(2),
            free_sizes=True, event_name=lambda i: f"line {linenos[i]}", refuse_second_free=True,
        )
    except SecondFreeError as e:
        raise TraceFormatError(where, f"line {linenos[e.index]}: "
                                      + e.describe(f"line {linenos[e.first_free]}", e.addr)) from None
    except AddressReuseError as e:
        raise TraceFormatError(where, f"line {linenos[e.index]}: {e}") from None


def write_rmm_log(trace: Trace, path: PathLike) -> Path:
    """Write ``trace`` in RMM's logging-adaptor CSV format (gzip when ``path`` ends in ``.gz``).

    Pointers are ``Trace.addrs`` (invented when all are 0). Returns the path written.
    """
    addrs = replay_addresses(trace)
    p = Path(path)
    times = np.round(np.nan_to_num(trace.times_us, posinf=0.0, neginf=0.0)).astype(np.int64) % _DAY_US
    with open_for_writing(p) as f:
        f.write(",".join(RMM_HEADER) + "\n")
        lines = []
        for kind, n, s, t, a in zip(trace.kinds.tolist(), trace.nbytes.tolist(), trace.streams.tolist(),
                                    times.tolist(), addrs.tolist()):
            seconds, us = divmod(t, 1_000_000)
            minutes, sec = divmod(seconds, 60)
            hour, minute = divmod(minutes, 60)
            action = "allocate" if kind == OpKind.ALLOC else "free"
            lines.append(f"0,{hour:02d}:{minute:02d}:{sec:02d}.{us:06d},{action},{a:#x},{n},{s}\n")
            if len(lines) >= 65536:
                f.write("".join(lines))
                lines.clear()
        f.write("".join(lines))
    return p
