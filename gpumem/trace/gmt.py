"""gpumem's own trace format (``.gmt``, or ``.gmt.gz`` gzip-compressed).

A UTF-8 text file: a JSON header line, then one line per op, fields separated by
single spaces (one space between two fields, none at the start or the end of a line: a tab, or two
spaces in a row, is refused; a line may end in ``\r\n``)::

    {"format": "gpumem-trace", "version": 1, "name": "gpt2_train", "source": "pytorch-snapshot", "n_ops": 4, "n_allocs": 2, "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us"}
    a 0 37632 0 1795211429637998 7f49e3e00000
    a 1 256 0 1795211429638010.5 7f49e3e09300
    f 0 0 1795211429640001
    f 1 7 1795211429640002

* ``a <alloc_id> <nbytes> <stream> <time_us> <addr>``: an ALLOC. Ids must be
  0, 1, 2, ... in order (they are redundant, and checked, so a damaged file is
  caught early). ``addr`` is the original address in lowercase hex, no ``0x``.
* ``f <alloc_id> <stream> <time_us>``: the FREE of a live allocation; its size
  and address are those of the ALLOC. Its stream is the one the free was made on, kept as written: it may
  differ from the allocation's (RMM's ``deallocate`` takes a stream of its own; PyTorch and gpumem.torch
  free on the allocation's), so a trace read from an RMM log writes and reads back equal; a replay frees
  the block, which belongs to its allocation's stream.
* ``time_us`` is written as an integer when integral, else as Python's shortest
  round-trip ``repr`` of the float (``nan``/``inf`` allowed), so times survive
  exactly. Streams, sizes, ids and reserved bytes are plain decimal digits (no sign: ``+1000`` is refused,
  as is a ``+`` before a time).
* ``u <alloc_id> <stream> <time_us>`` (version 2): a stream use, ``record_stream`` of the live
  allocation ``alloc_id`` on ``stream``, made where the line stands among the ops
  (:class:`~gpumem.trace.model.StreamUse`; ``at_op`` is the number of op lines before it). The
  allocation must be live there (allocated on an earlier line, not yet freed).
* ``w <stream> <waited> <time_us>`` (version 3): a stream wait, work queued on ``stream`` from there on
  waits for the work queued on ``waited`` before it (:class:`~gpumem.trace.model.StreamWait`; ``at_op``
  as for ``u``). A stream may wait for itself (``s.wait_stream(s)``): it orders nothing, and it is kept as
  the program made it, as :class:`~gpumem.trace.model.StreamWait` keeps it.
* ``p <kind> <time_us>`` (version 4): a step-plan event of the program, ``kind`` 0 a step mark, 1 the
  memory-first warm-up begun, 2 stopped (:class:`~gpumem.trace.model.PlanEvent`; ``at_op`` as for ``u``).
* version 5: every ``a`` and ``f`` line ends with one more field, ``<gpu_time_us>``, the op's GPU clock
  (:attr:`~gpumem.trace.Trace.gpu_times_us`: when the GPU had run the work queued on its stream before it;
  ``nan`` where unknown), and the header has ``"gpu_clock": true``.
* ``r <reserved_nbytes>`` (version 6): the live engine's reserved bytes after the op on the line before it
  (:attr:`~gpumem.trace.Trace.live_reserved_nbytes`; at most one per op, none where not recorded; never fewer
  than the bytes the trace's allocations live after that op hold, which the engine holds among its reserve: a
  smaller one is read as written, since a :class:`~gpumem.trace.Trace` may hold it and what is written must read
  back, and one warning names the first); the header
  has ``"n_reserves"`` (their count) and ``"gpu_clock"`` (true or false: whether op lines carry the clock
  field).
* ``n_ops`` in the header must match the number of op lines (this catches a
  truncated uncompressed file); ``name``, ``source`` and the counters restore the
  :class:`~gpumem.trace.Trace` fields, so ``read(write(t)) == t``.

The reader rejects another ``format``, an unknown ``version`` and any malformed
line with :class:`~gpumem.errors.TraceFormatError` naming the file and line. It
streams the file under :class:`~gpumem.trace.limits.TraceLimits`: lines of bounded
length, a header of bounded nesting, at most ``max_entries`` ops and
``max_memory_nbytes // ENTRY_NBYTES`` (kept in compact array columns; a ``u`` or ``w`` line, kept as an
object, counts :data:`STREAM_ENTRY_NBYTES`), an integer
``version`` (not ``true``), and every number in ASCII digits and in range (sizes,
ids, addresses and streams in ``[0, 2**63)``), and a header ``time_unit`` of ``"us"`` (or none).
Versions: 1 has ``a`` and ``f`` lines only; 2 adds ``u`` lines and the header's ``n_stream_uses`` (their
count); 3 adds ``w`` lines and the header's ``n_stream_waits``; 4 adds ``p`` lines and the header's
``n_plan_events``; 5 adds the GPU clock field; 6 adds ``r`` lines and makes the clock field optional. The
writer writes the oldest version that holds the trace: 1 when it has neither uses nor waits nor plan events nor
a GPU clock nor live reserves (so such files are byte for byte what they were), 2 with uses only, 3 with waits,
4 with plan events, 5 with a GPU clock, 6 with live reserves; the reader reads all six, and refuses ``u`` lines
before version 2, ``w`` lines before version 3, ``p`` lines before version 4, ``r`` lines before version 6, and
op lines whose clock field the header does not announce (or without it where it does).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, TraceFormatError
from ._fileio import PathLike, check_exists, iter_lines, open_binary, open_for_writing
from .limits import DEFAULT_LIMITS, ENTRY_NBYTES, TraceLimits, shorten
from .model import OpKind, PlanEvent, PlanEventKind, StreamUse, StreamWait, Trace

log = logging.getLogger(__name__)

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "FORMAT_VERSIONS", "NATIVE_SUFFIXES", "read_gmt_trace",
           "write_gmt_trace"]

FORMAT_NAME = "gpumem-trace"
#: Bytes the reader counts per ``u`` or ``w`` line against ``TraceLimits.max_memory_nbytes``: a
#: :class:`~gpumem.trace.StreamUse` / :class:`~gpumem.trace.StreamWait` object with its ints and float and
#: its list slot (measured by resident memory: 161 bytes per use, 209 per wait with 63-bit stream ids; ops, in
#: array columns, count :data:`~gpumem.trace.limits.ENTRY_NBYTES`).
STREAM_ENTRY_NBYTES = 224


def _op_cap(limits: TraceLimits, n_stream: int) -> tuple[int, str]:
    """The most ops the reader may keep with ``n_stream`` uses and waits kept, and the limit that binds."""
    by_count = limits.max_entries - n_stream
    by_memory = max(0, limits.max_memory_nbytes - n_stream * STREAM_ENTRY_NBYTES) // ENTRY_NBYTES
    if by_memory < by_count:
        taken = (f", {n_stream:,} stream uses, waits and plan events at {STREAM_ENTRY_NBYTES} bytes each"
                 if n_stream else "")
        return by_memory, (f"TraceLimits.max_memory_nbytes: {limits.max_memory_nbytes:,} bytes{taken}, at "
                           f"{ENTRY_NBYTES} bytes per op")
    return by_count, "TraceLimits.max_entries"


#: The newest version (live reserves); a trace is written in the oldest version that holds it (module docstring).
FORMAT_VERSION = 6
FORMAT_VERSIONS = (1, 2, 3, 4, 5, 6)
NATIVE_SUFFIXES = (".gmt", ".gmt.gz")
_HEADER_INTS = ("n_ops", "n_allocs", "n_unmatched_frees", "n_failed_allocs")
_INT64_MAX = 2**63 - 1
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_DEC_INT = re.compile(r"-?[0-9]+", re.ASCII)   # a '-' only to say "negative" (out of range), never a '+'
_HEX_INT = re.compile(r"[0-9a-fA-F]+", re.ASCII)
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|nan|inf|infinity)",
                    re.ASCII | re.IGNORECASE)


def _fmt_time(t: float) -> str:
    if t.is_integer() and abs(t) < 2**63:
        return str(int(t))
    return repr(t)


def write_gmt_trace(trace: Trace, path: PathLike) -> Path:
    """Write ``trace`` in the .gmt format (gzip when ``path`` ends in ``.gz``); returns the path."""
    uses = trace.stream_uses
    waits = trace.stream_waits
    plans = trace.plan_events
    clock = trace.gpu_times_us
    reserves = trace.live_reserved_nbytes   # None, or at least one recorded (Trace keeps no all -1 array)
    header: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": (6 if reserves is not None else 5 if clock is not None else 4 if plans else 3 if waits
                    else 2 if uses else 1),
        "name": trace.name,
        "source": trace.source,
        "n_ops": trace.n_ops,
        "n_allocs": trace.n_allocs,
        "n_unmatched_frees": trace.n_unmatched_frees,
        "n_failed_allocs": trace.n_failed_allocs,
        "time_unit": "us",
    }
    if header["version"] >= 2:
        header["n_stream_uses"] = len(uses)
    if header["version"] >= 3:
        header["n_stream_waits"] = len(waits)
    if header["version"] >= 4:
        header["n_plan_events"] = len(plans)
    if header["version"] >= 5:
        header["gpu_clock"] = clock is not None
    if reserves is not None:
        header["n_reserves"] = int(np.count_nonzero(reserves >= 0))
    use_at = [u.at_op for u in uses] + [-1]   # -1: no more uses
    wait_at = [w.at_op for w in waits] + [-1]
    plan_at = [e.at_op for e in plans] + [-1]
    k = j = m = 0
    p = Path(path)
    fmt_time = _fmt_time
    with open_for_writing(p) as f:
        f.write(json.dumps(header) + "\n")
        lines: list[str] = []
        push = lines.append
        gpu = itertools.repeat("") if clock is None else [f" {fmt_time(g)}" for g in clock.tolist()]
        res = itertools.repeat(-1) if reserves is None else reserves.tolist()
        for i, (kind, aid, n, s, t, a, g, r) in enumerate(zip(trace.kinds.tolist(), trace.alloc_ids.tolist(),
                                                              trace.nbytes.tolist(), trace.streams.tolist(),
                                                              trace.times_us.tolist(), trace.addrs.tolist(), gpu,
                                                              res)):
            while use_at[k] == i:
                u = uses[k]
                push(f"u {u.alloc_id} {u.stream} {fmt_time(float(u.time_us))}\n")
                k += 1
            while wait_at[j] == i:
                w = waits[j]
                push(f"w {w.stream} {w.waited} {fmt_time(float(w.time_us))}\n")
                j += 1
            while plan_at[m] == i:
                e = plans[m]
                push(f"p {int(e.kind)} {fmt_time(float(e.time_us))}\n")
                m += 1
            if kind == OpKind.ALLOC:
                push(f"a {aid} {n} {s} {fmt_time(t)} {a:x}{g}\n")
            else:
                push(f"f {aid} {s} {fmt_time(t)}{g}\n")
            if r >= 0:
                push(f"r {r}\n")
            if len(lines) >= 65536:
                f.write("".join(lines))
                lines.clear()
        for u in uses[k:]:   # after the last op
            push(f"u {u.alloc_id} {u.stream} {fmt_time(float(u.time_us))}\n")
        for w in waits[j:]:
            push(f"w {w.stream} {w.waited} {fmt_time(float(w.time_us))}\n")
        for e in plans[m:]:
            push(f"p {int(e.kind)} {fmt_time(float(e.time_us))}\n")
        f.write("".join(lines))
    return p


def _nesting_depth(text: str) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings do not count)."""
    depth = deepest = 0
    for ch in _JSON_STRING.sub("", text):
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _parse_header(line: str, where: str, limits: TraceLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    depth = _nesting_depth(line)
    if depth > limits.max_nesting_depth:
        raise TraceFormatError(where, f"line 1: header nests {depth} levels deep "
                                      f"(TraceLimits.max_nesting_depth is {limits.max_nesting_depth})")
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise TraceFormatError(where, f"line 1: not a {FORMAT_NAME} header")
    if type(header.get("version")) is not int or header["version"] not in FORMAT_VERSIONS:  # True == 1 in Python
        raise TraceFormatError(
            where, f"line 1: unsupported {FORMAT_NAME} version {shorten(header.get('version'))} "
                   f"(this reader knows {', '.join(map(str, FORMAT_VERSIONS))})"
        )
    if header["version"] == 5 and header.get("gpu_clock") is not True:
        raise TraceFormatError(where, "line 1: a version 5 header must say \"gpu_clock\": true")
    if header["version"] >= 6 and type(header.get("gpu_clock")) is not bool:
        raise TraceFormatError(where, "line 1: a version 6 header must say \"gpu_clock\": true or false")
    if header["version"] < 6 and "n_reserves" in header:
        raise TraceFormatError(where, f"line 1: \"n_reserves\" is a version 6 field, in a version "
                                      f"{header['version']} header")
    if header["version"] < 5 and "gpu_clock" in header:
        raise TraceFormatError(where, f"line 1: \"gpu_clock\" is a version 5 field, in a version {header['version']} "
                                      "header")
    for key in _HEADER_INTS + (("n_stream_uses",) if header["version"] >= 2 else ()) \
            + (("n_stream_waits",) if header["version"] >= 3 else ()) \
            + (("n_plan_events",) if header["version"] >= 4 else ()) \
            + (("n_reserves",) if header["version"] >= 6 else ()):
        value = header.get(key)
        if key not in header:
            raise TraceFormatError(where, f"line 1: header field {key!r} is missing")
        if type(value) is not int or not 0 <= value <= _INT64_MAX:
            raise TraceFormatError(where, f"line 1: header field {key!r} must be a non-negative 64-bit integer, "
                                          f"got {shorten(value)}")
    for key in ("name", "source"):
        if not isinstance(header.get(key), str):
            raise TraceFormatError(where, f"line 1: header field {key!r} must be a string")
    if header.get("time_unit", "us") != "us":   # every time in the file is in microseconds
        raise TraceFormatError(where, f"line 1: time_unit {shorten(header['time_unit'])} is not supported "
                                      "(this reader knows 'us')")
    return header


def _int(text: str, what: str, lo: int, hi: int, base: int = 10) -> int:
    """``int(text, base)`` within ``[lo, hi]``; ``ValueError`` quoting at most a prefix of ``text``."""
    if len(text) > 20:  # 2**63 has 19 digits, 16 in hex: anything longer is out of range (or not a number)
        raise ValueError(f"{what} {shorten(text)} is not a 64-bit integer")
    if text[:1] == "+":
        raise ValueError(f"{what} {shorten(text)} has a '+' sign: numbers are plain decimal digits")
    if not (_HEX_INT if base == 16 else _DEC_INT).fullmatch(text):  # int() takes "١٢" and "1_0"
        raise ValueError(f"{what} {shorten(text)} is not {'a hexadecimal' if base == 16 else 'an'} integer")
    value = int(text, base)
    if not lo <= value <= hi:
        raise ValueError(f"{what} {value} out of range [{lo}, {hi}]")
    return value


def _time(text: str, what: str = "time_us") -> float:
    if text[:1] == "+":   # the writer never writes one
        raise ValueError(f"{what} {shorten(text)} has a '+' sign: times are written without one")
    if not _FLOAT.fullmatch(text):  # float() takes "١٢" and "1_0"
        raise ValueError(f"{what} {shorten(text)} is not a number")
    return float(text)


def read_gmt_trace(path: PathLike, *, limits: TraceLimits | None = None, progress: bool | None = False) -> Trace:
    """Read a ``.gmt``/``.gmt.gz`` trace; see the module docstring for the format and its checks.

    ``limits`` defaults to :data:`~gpumem.trace.limits.DEFAULT_LIMITS`; ``progress``
    shows the bytes read (None: only on a terminal).
    """
    where = str(path)
    check_exists(path)
    limits = limits or DEFAULT_LIMITS
    max_ops, binding = _op_cap(limits, 0)
    kinds = array("b")  # compact columns (see TraceLimits.max_memory_nbytes)
    ids = array("q")
    nbytes = array("q")
    streams = array("q")
    times = array("d")
    gpu_times = array("d")
    reserves = array("q")   # by op, -1 where no r line
    addrs = array("q")
    alloc_nbytes = array("q")
    alloc_addrs = array("q")
    live = bytearray()
    uses: list[StreamUse] = []
    waits: list[StreamWait] = []
    plans: list[PlanEvent] = []
    with open_binary(path, limits=limits, progress=progress) as f:
        lines = iter_lines(f, where, limits)
        first = next(lines, None)
        header = _parse_header(first[1] if first else "", where, limits)
        with_uses = header["version"] >= 2
        with_waits = header["version"] >= 3
        with_plans = header["version"] >= 4
        with_clock = header["version"] == 5 or header.get("gpu_clock") is True
        with_reserves = header["version"] >= 6
        n_reserves = 0
        a_fields, f_fields = (7, 5) if with_clock else (6, 4)
        last_tag = ""
        live_nbytes = 0   # what the trace's live allocations hold (a live engine's reserve is never less)
        below_live: list[tuple[int, int, int]] = []   # the first reserve below it: (line, reserved, live)
        n_below_live = 0
        for lineno, line in lines:
            p = line.split(" ")
            try:
                if "\t" in line:
                    raise ValueError(f"a tab in {shorten(line.strip())}: fields are separated by single spaces")
                if "" in p and line:
                    raise ValueError(f"an empty field in {shorten(line)} (two spaces in a row, or a space at the "
                                     "start or the end of the line): fields are separated by single spaces")
                tag = p[0]
                if tag == "a" and len(p) == a_fields:
                    aid = _int(p[1], "alloc id", 0, _INT64_MAX)
                    if aid != len(alloc_nbytes):
                        raise ValueError(f"alloc id {aid}, expected {len(alloc_nbytes)}")
                    if p[2][:1] == "-":
                        raise ValueError(f"negative size {shorten(p[2])}")
                    n = _int(p[2], "size", 0, _INT64_MAX)
                    a = _int(p[5], "addr", 0, _INT64_MAX, 16)
                    s, t = _int(p[3], "stream", 0, _INT64_MAX), _time(p[4])
                    kinds.append(0)
                    live_nbytes += n
                    alloc_nbytes.append(n)
                    alloc_addrs.append(a)
                    live.append(1)
                elif tag == "f" and len(p) == f_fields:
                    aid = _int(p[1], "alloc id", 0, _INT64_MAX)
                    if not 0 <= aid < len(live) or not live[aid]:
                        raise ValueError(f"free of id {aid}, which is not live")
                    s, t = _int(p[2], "stream", 0, _INT64_MAX), _time(p[3])
                    live[aid] = 0
                    n, a = alloc_nbytes[aid], alloc_addrs[aid]
                    live_nbytes -= n
                    kinds.append(1)
                elif tag == "u" and len(p) == 4 and with_uses:
                    aid = _int(p[1], "alloc id", 0, _INT64_MAX)
                    if not 0 <= aid < len(live) or not live[aid]:
                        raise ValueError(f"stream use of id {aid}, which is not live")
                    uses.append(StreamUse(len(kinds), aid, _int(p[2], "stream", 0, _INT64_MAX), _time(p[3])))
                elif tag == "w" and len(p) == 4 and with_waits:
                    waits.append(StreamWait(len(kinds), _int(p[1], "stream", 0, _INT64_MAX),
                                            _int(p[2], "waited stream", 0, _INT64_MAX), _time(p[3])))
                elif tag == "p" and len(p) == 3 and with_plans:
                    kind = _int(p[1], "plan event kind", 0, max(PlanEventKind))
                    plans.append(PlanEvent(len(kinds), PlanEventKind(kind), _time(p[2])))
                elif tag == "r" and len(p) == 2 and with_reserves:
                    if last_tag not in ("a", "f") or reserves[-1] != -1:   # right after its op line, once
                        raise ValueError("a reserve ('r') must follow the op line it belongs to, one per op")
                    reserved = _int(p[1], "reserved bytes", 0, _INT64_MAX)
                    if reserved < live_nbytes:   # impossible live; kept as written (save_trace writes it)
                        if not below_live:
                            below_live.append((lineno, reserved, live_nbytes))
                        n_below_live += 1
                    reserves[-1] = reserved
                    n_reserves += 1
                    last_tag = tag
                    continue
                else:
                    if with_clock or with_reserves:
                        a_form, f_form = (("a <id> <nbytes> <stream> <time_us> <addr> <gpu_time_us>",
                                           "f <id> <stream> <time_us> <gpu_time_us>") if with_clock else
                                          ("a <id> <nbytes> <stream> <time_us> <addr>", "f <id> <stream> <time_us>"))
                        raise ValueError(f"expected '{a_form}', '{f_form}', 'u <id> <stream> <time_us>', "
                                         "'w <stream> <waited> <time_us>', 'p <kind> <time_us>'"
                                         + (" or 'r <reserved_nbytes>'" if with_reserves else "")
                                         + f" (a version {header['version']} file), got {shorten(line.strip())}")
                    raise ValueError(f"expected 'a <id> <nbytes> <stream> <time_us> <addr>' or "
                                     f"'f <id> <stream> <time_us>'" + (" or 'u <id> <stream> <time_us>'" if with_uses
                                                                      else " (a version 1 file)")
                                     + (" or 'w <stream> <waited> <time_us>'" if with_waits
                                        else " (a version 2 file)" if with_uses else "")
                                     + (" or 'p <kind> <time_us>'" if with_plans
                                        else " (a version 3 file)" if with_waits else "")
                                     + f", got {shorten(line.strip())}")
                if with_clock and tag in ("a", "f"):
                    g = _time(p[-1], "gpu_time_us")
                    if g in (float("inf"), float("-inf")):
                        raise ValueError(f"gpu_time_us {shorten(p[-1])} is infinite (nan is for unknown)")
                last_tag = tag
                if tag in ("u", "w", "p"):   # a placed event, kept as an object: it counts against the limits
                    max_ops, binding = _op_cap(limits, len(uses) + len(waits) + len(plans))
                    if len(kinds) > max_ops:   # the except below names the file and line
                        raise ValueError(f"more entries than the limits admit ({binding}); raise the limit if "
                                         "the file is genuine")
                    continue
            except (ValueError, IndexError) as e:
                raise TraceFormatError(where, f"line {lineno}: {e}") from None
            if len(kinds) > max_ops:
                raise TraceFormatError(where, f"line {lineno}: more than {max_ops:,} ops ({binding}); "
                                              "raise the limit if the file is genuine")
            ids.append(aid)
            nbytes.append(n)
            streams.append(s)
            times.append(t)
            addrs.append(a)
            if with_clock:
                gpu_times.append(g)
            if with_reserves:
                reserves.append(-1)
    if len(kinds) != header["n_ops"]:
        raise TraceFormatError(where, f"header says {header['n_ops']} ops, the file has {len(kinds)} (truncated?)")
    if len(alloc_nbytes) != header["n_allocs"]:
        raise TraceFormatError(where, f"header says {header['n_allocs']} allocations, the file has {len(alloc_nbytes)}")
    if with_uses and len(uses) != header["n_stream_uses"]:
        raise TraceFormatError(where, f"header says {header['n_stream_uses']} stream uses, the file has {len(uses)}")
    if with_waits and len(waits) != header["n_stream_waits"]:
        raise TraceFormatError(where, f"header says {header['n_stream_waits']} stream waits, the file has {len(waits)}")
    if with_plans and len(plans) != header["n_plan_events"]:
        raise TraceFormatError(where, f"header says {header['n_plan_events']} plan events, the file has {len(plans)}")
    if with_reserves and n_reserves != header["n_reserves"]:
        raise TraceFormatError(where, f"header says {header['n_reserves']} reserves, the file has {n_reserves}")
    if below_live:
        line_no, reserved, held = below_live[0]
        log.warning("%s: %d reserve(s) below the bytes the trace's allocations hold live (the first, line %d: %s "
                    "reserved, %s live): not what a live engine reports; comparisons with them mean little",
                    where, n_below_live, line_no, f"{reserved:,}", f"{held:,}")
    try:
        return Trace(
            header["name"], header["source"],
            np.array(kinds, dtype=np.int8), np.array(ids, dtype=np.int64), np.array(nbytes, dtype=np.int64),
            np.array(streams, dtype=np.int64), np.array(times, dtype=np.float64), np.array(addrs, dtype=np.int64),
            n_unmatched_frees=header["n_unmatched_frees"], n_failed_allocs=header["n_failed_allocs"],
            stream_uses=tuple(uses), stream_waits=tuple(waits), plan_events=tuple(plans),
            gpu_times_us=np.array(gpu_times, dtype=np.float64) if with_clock else None,
            live_reserved_nbytes=np.array(reserves, dtype=np.int64) if with_reserves else None,
        )
    except (InvalidArgumentError, OverflowError) as e:
        raise TraceFormatError(where, shorten(str(e), 200)[1:-1]) from None
