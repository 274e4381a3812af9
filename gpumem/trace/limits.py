"""Limits that keep a hostile or broken trace file from exhausting memory or time.

Trace files come from other machines and other people. Every reader streams its
input and enforces a :class:`TraceLimits` while it reads, so a small file that
would expand into gigabytes (a gzip bomb, a pickle of memo references) is
refused after a bounded amount of work, with a
:class:`~gpumem.errors.TraceFormatError` naming the limit and how to raise it::

    from gpumem.trace import TraceLimits, load_trace
    trace = load_trace("huge.snapshot.pickle.gz", limits=TraceLimits(max_decompressed_nbytes=200 * 2**30))

The defaults admit real multi-GB snapshots (the 58 MB ``llama_generate`` pickle
uses under a tenth of every limit) while bounding what a small file can cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = ["DEFAULT_LIMITS", "ENTRY_NBYTES", "TraceLimits", "printable", "shorten"]

_GiB = 2**30
_MiB = 2**20


@dataclass(frozen=True, slots=True)
class TraceLimits:
    """Caps enforced while a trace file is read (all checked while streaming, never after the fact).

    * ``max_decompressed_nbytes``: bytes of (decompressed) content read, in total.
    * ``max_compression_ratio``: decompressed bytes per compressed byte, checked once
      more than ``ratio_floor_nbytes`` have been decompressed. Real traces compress
      5-20x; a gzip bomb compresses about 1000x.
    * ``max_entries``: events (snapshot entries, log lines, ops) in one trace.
    * ``max_objects``: interpreter objects alive at once while a pickle is unpickled
      (measured with :func:`sys.getallocatedblocks` after every chunk read, so
      other threads' allocations during the load count too); a real snapshot
      makes about one object per 8 bytes of pickle.
    * ``max_line_nbytes``: one line of a text format (RMM CSV, ``.gmt``), or one
      text-protocol pickle argument.
    * ``max_nesting_depth``: brackets nested in a ``.gmt`` JSON header.
    * ``max_pickle_tuples``: tuples a pickle builds. Tuples can nest as deep as
      there are tuples, and hashing one nested ~200,000 deep crashes the
      interpreter; a real snapshot holds about 150.
    * ``max_devices``: per-device trace lists in a snapshot.
    * ``max_memory_nbytes``: memory a load may take, whatever the file's size or
      compression ratio. Text readers (RMM, ``.gmt``) store events compactly in
      array-backed columns and count :data:`ENTRY_NBYTES` per event (their
      measured peak, building the trace included), so they refuse an event past
      ``max_memory_nbytes // ENTRY_NBYTES`` as it is read. The pickle reader
      measures the process's resident memory growth since the load began after
      every 64 KiB chunk (and every pickle frame, at most 1 MiB) and refuses the
      load once it exceeds the budget; it then counts :data:`ENTRY_NBYTES` per
      snapshot entry, for the columns it builds, against what is left. A real snapshot takes about 12
      bytes per decompressed pickle byte (the 58 MB ``llama_generate`` pickle:
      0.7 GB), so the 4 GiB default admits snapshots of ~300 MB of pickle
      (~4 million entries), and text logs of ~25 million events.
    """

    max_decompressed_nbytes: int = 64 * _GiB
    max_compression_ratio: float = 200.0
    ratio_floor_nbytes: int = 16 * _MiB
    max_entries: int = 200_000_000
    max_objects: int = 2_000_000_000
    max_line_nbytes: int = 1 * _MiB
    max_nesting_depth: int = 64
    max_pickle_tuples: int = 20_000
    max_devices: int = 4096
    max_memory_nbytes: int = 4 * _GiB

    def __post_init__(self) -> None:
        for name in ("max_decompressed_nbytes", "ratio_floor_nbytes", "max_entries", "max_objects",
                     "max_line_nbytes", "max_nesting_depth", "max_pickle_tuples", "max_devices",
                     "max_memory_nbytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"TraceLimits.{name} must be a positive int, got {value!r}")
        ratio = self.max_compression_ratio
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not ratio >= 1:
            raise InvalidArgumentError(f"TraceLimits.max_compression_ratio must be a number >= 1, got {ratio!r}")


#: Bytes a reader counts per event against ``TraceLimits.max_memory_nbytes``: the measured peak of the
#: RMM and ``.gmt`` readers, building the trace included, is about 120 bytes per event.
ENTRY_NBYTES = 160


def max_entries_for(limits: TraceLimits, used_nbytes: int = 0, *, entry_nbytes: int = ENTRY_NBYTES) -> tuple[int, str]:
    """The most events a reader may keep under ``limits`` (``used_nbytes`` of the memory budget already
    taken; ``entry_nbytes`` counted per event, :data:`ENTRY_NBYTES` for the array-backed columns), and the
    limit that binds, as an error message names it."""
    by_memory = max(0, limits.max_memory_nbytes - used_nbytes) // entry_nbytes
    if by_memory < limits.max_entries:
        taken = f", {used_nbytes:,} of them taken by unpickling" if used_nbytes else ""
        return by_memory, (f"TraceLimits.max_memory_nbytes: {limits.max_memory_nbytes:,} bytes{taken}, at "
                           f"{entry_nbytes} bytes per event")
    return limits.max_entries, "TraceLimits.max_entries"


#: The limits used when a reader is given none.
DEFAULT_LIMITS = TraceLimits()

#: How much of a bad field an error message quotes.
QUOTE_CHARS = 80


def shorten(value: object, max_chars: int = QUOTE_CHARS) -> str:
    """``repr`` of at most ``max_chars`` characters of ``value`` (str or bytes), noting the full length.

    Error messages quote bad fields through this, so a 1 GiB line never reaches a terminal whole.
    """
    if isinstance(value, (str, bytes, bytearray)):
        if len(value) <= max_chars:
            return repr(value)
        return f"{value[:max_chars]!r}... ({len(value):,} {'chars' if isinstance(value, str) else 'bytes'})"
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > 200:
            return f"an integer of {value.bit_length():,} bits"
        return repr(value)
    text = repr(value) if isinstance(value, (float, bool, type(None))) else f"a {type(value).__name__}"
    return text if len(text) <= max_chars else text[:max_chars] + "..."


#: C0 and C1 control characters and DEL, each to its ``\\xNN`` (a ``str.translate`` table, read only).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def printable(text: str) -> str:
    """``text`` with its C0 and C1 control characters and DEL written ``\\xNN``: a trace's name comes from
    its file, and an escape sequence in it must not reach a terminal (clear the screen, set the title,
    forge an output line). Other characters are kept as they are."""
    return text.translate(_CONTROLS)
