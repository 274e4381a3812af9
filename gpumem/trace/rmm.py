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
  pointer (its ``Size`` column is not needed); ``allocate failure`` is counted in
  ``n_failed_allocs``. ``Thread`` is ignored. Columns are found by header name, so
  extra columns are tolerated.

:func:`write_rmm_log` writes the same format (thread 0, times taken modulo a day
after rounding to whole microseconds), so a trace with non-decreasing times whose
consecutive gaps are under 12 hours reads back with the same ops and the same
times *relative to the first op*, to the microsecond.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import TraceFormatError
from ._fileio import PathLike, check_exists, open_for_writing, open_text, trace_name_from_path
from .builder import AddressReuseError, build_trace, replay_addresses
from .model import OpKind, Trace

__all__ = ["RMM_HEADER", "read_rmm_log", "write_rmm_log", "parse_time_of_day_us", "format_time_of_day"]

RMM_HEADER = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
_REQUIRED = ("Time", "Action", "Pointer", "Size", "Stream")
_ACTION_CODES = {"allocate": 0, "free": 1, "allocate failure": 2}
_DAY_US = 86_400_000_000
_HALF_DAY_US = _DAY_US // 2
_INT64_MAX = 2**63 - 1


def parse_time_of_day_us(text: str) -> int:
    """``"21:50:47.674565"`` -> microseconds since midnight. Raises ``ValueError`` when malformed."""
    hms, _, frac = text.strip().partition(".")
    h, m, s = hms.split(":")
    if not (frac.isdigit() or frac == "") or len(frac) > 9:
        raise ValueError(f"bad fraction of a second in {text!r}")
    hour, minute, second = int(h), int(m), int(s)
    if not (0 <= hour < 24 and 0 <= minute < 60 and 0 <= second < 61):
        raise ValueError(f"time of day out of range: {text!r}")
    us = int((frac + "000000")[:6]) if frac else 0
    return ((hour * 60 + minute) * 60 + second) * 1_000_000 + us


def format_time_of_day(time_us: float) -> str:
    """Microseconds (any origin) -> ``HH:MM:SS.ffffff``, rounded to the microsecond, modulo one day."""
    t = round(time_us) % _DAY_US
    seconds, us = divmod(t, 1_000_000)
    minutes, second = divmod(seconds, 60)
    hour, minute = divmod(minutes, 60)
    return f"{hour:02d}:{minute:02d}:{second:02d}.{us:06d}"


def _parse_int(text: str) -> int:
    text = text.strip()
    return int(text, 16) if text[:2].lower() == "0x" else int(text)


def read_rmm_log(path: PathLike, *, name: str | None = None) -> Trace:
    """Read an RMM logging-adaptor CSV (gzipped or not) as a :class:`Trace` with ``source == "rmm-log"``.

    Raises ``TraceFormatError`` naming the file and line for a bad header, a
    malformed line, an unknown action, or an allocation at a pointer still live.
    """
    where = str(path)
    check_exists(path)
    codes: list[int] = []
    addrs: list[int] = []
    sizes: list[int] = []
    streams: list[int] = []
    times: list[int] = []
    with open_text(path) as f:
        header = f.readline().strip()
        if not header:
            raise TraceFormatError(where, "line 1: empty file, expected the RMM log header " + ",".join(RMM_HEADER))
        columns = [c.strip() for c in header.split(",")]
        missing = [c for c in _REQUIRED if c not in columns]
        if missing:
            raise TraceFormatError(where, f"line 1: header {header!r} lacks column(s) {', '.join(missing)}")
        i_time, i_action, i_ptr, i_size, i_stream = (columns.index(c) for c in _REQUIRED)
        n_cols = len(columns)
        day_offset = 0
        prev = None
        lineno = 1
        for lineno, line in enumerate(f, start=2):
            if not line.strip():
                continue
            fields = line.rstrip("\r\n").split(",")
            if len(fields) != n_cols:
                raise TraceFormatError(where, f"line {lineno}: {len(fields)} fields, the header has {n_cols}")
            action = fields[i_action].strip()
            code = _ACTION_CODES.get(action)
            if code is None:
                raise TraceFormatError(where, f"line {lineno}: unknown action {action!r}")
            try:
                t = parse_time_of_day_us(fields[i_time]) + day_offset
                if prev is not None and t < prev - _HALF_DAY_US:
                    day_offset += _DAY_US
                    t += _DAY_US
                size = int(fields[i_size])
                stream = _parse_int(fields[i_stream])
                addr = 0 if code == 2 else int(fields[i_ptr].strip(), 16)
            except ValueError as e:
                raise TraceFormatError(where, f"line {lineno}: {e}") from None
            if size < 0 or size > _INT64_MAX or not 0 <= addr <= _INT64_MAX or abs(stream) > _INT64_MAX:
                raise TraceFormatError(where, f"line {lineno}: size, pointer or stream out of range")
            prev = t
            codes.append(code)
            addrs.append(addr)
            sizes.append(size)
            streams.append(stream)
            times.append(t)
    try:
        return build_trace(
            name if name is not None else trace_name_from_path(path), "rmm-log",
            codes, addrs, sizes, streams, times, origin=where, n_failed_allocs=codes.count(2),
        )
    except AddressReuseError as e:
        raise TraceFormatError(where, f"line {_line_of_event(path, e.index)}: {e}") from None


def _line_of_event(path: PathLike, index: int) -> int:
    """The line number of the ``index``-th event (blank lines are skipped when reading)."""
    with open_text(path) as f:
        f.readline()
        seen = -1
        for lineno, line in enumerate(f, start=2):
            if line.strip():
                seen += 1
                if seen == index:
                    return lineno
    return -1


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
