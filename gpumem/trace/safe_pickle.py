"""Loading pickles that cannot run code, and cannot make the process run out of memory.

A pickle is a small program: its ``GLOBAL``/``STACK_GLOBAL`` opcodes import any
callable (``os.system``, ``builtins.eval``) and ``REDUCE`` calls it. Every such
import goes through :meth:`pickle.Unpickler.find_class`, so an unpickler whose
``find_class`` always refuses can only build what the pickle machine makes
natively: ``dict``, ``list``, ``tuple``, ``set``, ``frozenset``, ``str``,
``bytes``, ``bytearray``, ``int``, ``float``, ``bool`` and ``None``. That is
all a PyTorch memory snapshot contains.

Except one way around ``find_class``: the ``EXT1``/``EXT2``/``EXT4`` opcodes name
an object by an extension code, and the unpickler first looks that code up in
:mod:`copyreg`'s process-wide extension cache, which holds whatever any earlier
unpickling in the process resolved. So the byte stream is scanned, opcode by
opcode and chunk by chunk, *before* the unpickler sees it
(:class:`OpcodeScanner`), and a pickle using an extension code, or any byte that is
not a pickle opcode, is refused outright; copyreg is never consulted.

Memory is bounded while loading (see :class:`~gpumem.trace.limits.TraceLimits`):
the decompressed bytes, the compression ratio, the interpreter objects alive
(``sys.getallocatedblocks``) and the process's resident memory growth
(``max_memory_nbytes``, from ``/proc/self/statm``, else the peak from
``getrusage``) are checked after every 64 KiB chunk, and frames are capped at
:data:`MAX_FRAME_NBYTES`, so a small file of memo references (a list of 100
million references is one object, but 800 MB) or a gzip bomb is refused once it
takes the budget, whatever its compression ratio.

:func:`load_plain_pickle` reads such a file (gzipped or not, detected by content)
and turns every failure -- a forbidden global or opcode, a persistent id, a
truncated or corrupt stream, an exceeded limit -- into
:class:`~gpumem.errors.TraceFormatError` naming the file.
"""

from __future__ import annotations

import functools
import os
import pickle
import pickletools
import re
import sys
from collections.abc import Callable
from typing import Any

from ..errors import TraceFormatError
from ._fileio import CHUNK_NBYTES, PathLike, check_exists, is_gzip, open_binary
from .limits import DEFAULT_LIMITS, TraceLimits, shorten

__all__ = ["OpcodeScanner", "PlainUnpickler", "load_plain_pickle"]

_EXT_OPCODES = frozenset(b"\x82\x83\x84")  # EXT1, EXT2, EXT4
_TUPLE_OPCODES = frozenset(b"t\x85\x86\x87")  # TUPLE, TUPLE1, TUPLE2, TUPLE3 (EMPTY_TUPLE cannot nest)
_STOP = ord(".")
_FRAME = 0x95  # FRAME: an 8-byte length the unpickler reads (and allocates) in one go
_PAIR_LINE_OPCODES = frozenset(b"ci")  # GLOBAL and INST: two newline-terminated arguments
#: The largest FRAME admitted. Python's picklers end a frame once it reaches 64 KiB (a larger argument is
#: written outside frames), and the unpickler executes a frame's opcodes only after reading it whole, so the
#: memory checks made after every chunk see a frame's effect at most this late.
MAX_FRAME_NBYTES = 1 << 20


def _opcode_tables() -> tuple[dict[int, int], frozenset[int], frozenset[int], dict[int, tuple[int, bool]]]:
    fixed: dict[int, int] = {}  # opcode -> argument bytes
    line: set[int] = set()  # argument up to a newline
    len1: set[int] = set()  # 1-byte length, then that many bytes
    lenn: dict[int, tuple[int, bool]] = {}  # opcode -> (length bytes, signed), then that many bytes
    for od in pickletools.opcodes:
        code = od.code.encode("latin-1")[0]
        arg = od.arg
        if arg is None:
            fixed[code] = 0
        elif arg.n >= 0:
            fixed[code] = arg.n
        elif arg.n == pickletools.UP_TO_NEWLINE:
            line.add(code)
        elif arg.n == pickletools.TAKEN_FROM_ARGUMENT1:
            len1.add(code)
        elif arg.n == pickletools.TAKEN_FROM_ARGUMENT4:
            lenn[code] = (4, True)
        elif arg.n == pickletools.TAKEN_FROM_ARGUMENT4U:
            lenn[code] = (4, False)
        else:
            lenn[code] = (8, False)
    return fixed, frozenset(line), frozenset(len1), lenn


_FIXED, _LINE, _LEN1, _LENN = _opcode_tables()


def _byte_class(codes: set[int] | frozenset[int]) -> bytes:
    return b"[" + b"".join(re.escape(bytes([c])) for c in sorted(codes)) + b"]"


@functools.lru_cache(maxsize=8)
def _run_pattern(max_line_nbytes: int) -> re.Pattern[bytes]:
    """A run of allowed opcodes whose arguments the regex engine can measure itself (lines up to the cap).

    Left out, for :class:`OpcodeScanner` to handle one by one: 4/8-byte lengths, FRAME, tuples (counted),
    STOP and EXT.
    """
    by_size: dict[int, set[int]] = {}
    for code, size in _FIXED.items():
        if code not in _EXT_OPCODES and code not in _TUPLE_OPCODES and code not in (_STOP, _FRAME):
            by_size.setdefault(size, set()).add(code)
    alts = [_byte_class(codes) + (b".{%d}" % size if size else b"") for size, codes in sorted(by_size.items())]
    line = b"[^\\n]{0,%d}\\n" % max_line_nbytes
    alts.append(_byte_class(_LINE - _PAIR_LINE_OPCODES) + line)
    alts.append(_byte_class(_PAIR_LINE_OPCODES) + line + line)
    counted = b"|".join(re.escape(bytes([k])) + (b".{%d}" % k if k else b"") for k in range(256))
    alts.append(_byte_class(_LEN1) + b"(?:" + counted + b")")
    return re.compile(b"(?:" + b"|".join(alts) + b")*+", re.DOTALL)



class OpcodeScanner:
    """Follows a pickle's opcode stream chunk by chunk and refuses extension codes and non-opcodes.

    ``feed(chunk)`` parses as far as the chunk allows (an opcode cut at the chunk's
    end is completed by the next one; long string arguments are skipped without
    being kept) and raises ``TraceFormatError`` at an ``EXT1``/``EXT2``/``EXT4``
    opcode, at a byte that is no opcode, at a text argument longer than
    ``max_line_nbytes``, or past ``max_tuples`` tuple-building opcodes. Tuples are
    capped because they nest without bound and hashing a tuple nested 200,000 deep
    (a dict key, 200 KB of pickle) overflows the C stack and kills the process;
    with at most ``max_tuples`` tuples none nests deeper. A length-prefixed
    argument or frame that would end past ``max_stream_nbytes`` (the most the
    stream can hold: the file's size, or what a gzip file may expand to under the
    limits) is refused before the unpickler allocates a buffer of that length.
    After ``STOP`` the rest is ignored (the unpickler stops there too).
    """

    def __init__(self, where: str, max_line_nbytes: int, max_tuples: int = 20_000,
                 max_stream_nbytes: int | None = None, *, stream_is_exact: bool = False) -> None:
        self.where = where
        self.max_stream_nbytes = max_stream_nbytes
        self.stream_is_exact = stream_is_exact  # max_stream_nbytes is the stream's size, not a bound on it
        self.max_line_nbytes = max_line_nbytes
        self.max_tuples = max_tuples
        self.n_tuples = 0
        self.done = False
        self._tail = b""
        self._skip = 0
        self._offset = 0  # stream offset of the first byte of the next chunk
        self._run = _run_pattern(max_line_nbytes)

    def feed(self, chunk: bytes) -> None:
        """Scan the next chunk of the stream."""
        start = self._offset
        self._offset += len(chunk)
        if self.done:
            return
        if self._skip:
            if len(chunk) <= self._skip:
                self._skip -= len(chunk)
                return
            chunk = chunk[self._skip:]
            start += self._skip
            self._skip = 0
        buf = self._tail + chunk if self._tail else chunk
        base = start - len(self._tail)  # stream offset of buf[0]
        self._tail = b""
        n = len(buf)
        pos = 0
        while True:
            pos = self._run.match(buf, pos).end()  # type: ignore[union-attr]  # a starred group always matches
            if pos >= n:
                return
            op = buf[pos]
            if op == _STOP:
                self.done = True
                return
            if op in _LENN:
                width, signed = _LENN[op]
                if pos + 1 + width > n:
                    break
                length = int.from_bytes(buf[pos + 1:pos + 1 + width], "little", signed=signed)
                if length < 0:
                    raise TraceFormatError(self.where, f"not a readable pickle (negative length at byte {base + pos})")
                end = pos + 1 + width + length
                self._check_end(base + pos, base + end, length)
                if end > n:
                    self._skip = end - n
                    return
                pos = end
                continue
            if op == _FRAME:
                if pos + 9 > n:
                    break
                length = int.from_bytes(buf[pos + 1:pos + 9], "little")
                self._check_end(base + pos, base + pos + 9 + length, length)
                if length > MAX_FRAME_NBYTES:
                    raise TraceFormatError(
                        self.where, f"pickle frame at byte {base + pos:,} holds {length:,} bytes, more than "
                        f"{MAX_FRAME_NBYTES:,} (pickle writes frames of about 64 KiB; the unpickler runs a frame "
                        "only once it is read whole, so a larger one would escape the memory checks)")
                pos += 9
                continue
            if op in _TUPLE_OPCODES:
                self.n_tuples += 1
                if self.n_tuples > self.max_tuples:
                    raise TraceFormatError(
                        self.where, f"pickle builds more than {self.max_tuples:,} tuples (TraceLimits.max_pickle_tuples;"
                        " deeply nested tuples would overflow the stack when hashed)")
                pos += 1
                continue
            if op in _EXT_OPCODES:
                raise TraceFormatError(
                    self.where, f"pickle uses an extension code (EXT opcode at byte {base + pos}), which a memory "
                    "snapshot never does; refused without consulting copyreg")
            if op in _LINE and self._line_too_long(buf, pos, op):
                raise self._long_argument(base + pos, buf[pos:pos + 100])
            if not self._incomplete(buf, pos, op):
                raise TraceFormatError(self.where, f"not a readable pickle (byte {op:#04x} at {base + pos} is no "
                                                   "opcode a snapshot may use)")
            break
        self._tail = buf[pos:]
        if self._tail[0] in _LINE and self._line_too_long(self._tail, 0, self._tail[0]):
            raise self._long_argument(base + pos, self._tail[:100])

    def _line_too_long(self, buf: bytes, pos: int, op: int) -> bool:
        """Whether a newline-terminated argument at ``pos`` (complete or not) exceeds the cap."""
        cap = self.max_line_nbytes
        start = pos + 1
        for _ in range(2 if op in _PAIR_LINE_OPCODES else 1):
            end = buf.find(b"\n", start, start + cap + 1)
            if end < 0:
                return len(buf) - start > cap
            start = end + 1
        return False

    def _long_argument(self, at: int, head: bytes) -> TraceFormatError:
        return TraceFormatError(self.where, f"pickle argument at byte {at:,} is longer than {self.max_line_nbytes:,} "
                                            f"bytes (TraceLimits.max_line_nbytes): {shorten(head, 40)}")

    def _check_end(self, at: int, end: int, length: int) -> None:
        if self.max_stream_nbytes is not None and end > self.max_stream_nbytes:
            if self.stream_is_exact:
                raise TraceFormatError(
                    self.where, f"not a readable pickle (truncated): the opcode at byte {at:,} declares {length:,} bytes, which run "
                    f"past the end of the file ({self.max_stream_nbytes:,} bytes)")
            raise TraceFormatError(
                self.where, f"not a readable pickle: the opcode at byte {at:,} declares {length:,} bytes, more than "
                f"the file may expand to ({self.max_stream_nbytes:,} bytes under its TraceLimits: "
                "max_decompressed_nbytes, max_compression_ratio); truncated, corrupt, or a decompression bomb")

    @staticmethod
    def _incomplete(buf: bytes, pos: int, op: int) -> bool:
        """Whether the opcode at ``pos`` is a valid one cut short by the end of ``buf``."""
        rest = len(buf) - pos - 1
        if op == _FRAME:
            return rest < 8
        if op in _FIXED:
            return rest < _FIXED[op]
        if op in _LEN1:
            return rest < 1 or rest < 1 + buf[pos + 1]
        if op in _LINE:
            return buf.count(b"\n", pos) < (2 if op in _PAIR_LINE_OPCODES else 1)
        return False


class PlainUnpickler(pickle.Unpickler):
    """An unpickler that refuses every global, so loading never imports or calls anything.

    Give it a stream that an :class:`OpcodeScanner` has checked (as
    :func:`load_plain_pickle` does): ``find_class`` cannot stop the ``EXT`` opcodes.
    """

    def __init__(self, file: Any, *, path: str = "<pickle>") -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        raise TraceFormatError(
            self._path,
            f"forbidden global {shorten(module, 60)[1:-1]}.{shorten(name, 60)[1:-1]} in pickle: only plain "
            "containers and scalars are allowed (the file may be trying to run code)",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise TraceFormatError(self._path, "pickle uses persistent ids, which a memory snapshot never does")


def _rss_reader() -> Callable[[], int] | None:
    """A function returning the process's resident memory in bytes, or None where the platform has none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            f.read()
        page = os.sysconf("SC_PAGE_SIZE")

        def current() -> int:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * page
        return current
    except (OSError, ValueError, AttributeError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere

    def peak() -> int:  # the peak only ever grows, so its growth bounds the load's growth too
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return peak


_RSS = _rss_reader()


class _ObjectBudget:
    """Inspects each chunk: feeds the opcode scanner, then checks the objects and memory the load has taken so far."""

    def __init__(self, where: str, limits: TraceLimits, max_stream_nbytes: int | None = None,
                 stream_is_exact: bool = False) -> None:
        self.where = where
        self.limits = limits
        self.scanner = OpcodeScanner(where, limits.max_line_nbytes, limits.max_pickle_tuples, max_stream_nbytes,
                                     stream_is_exact=stream_is_exact)
        self.baseline = sys.getallocatedblocks()
        self.peak_objects = 0
        self.rss_baseline = _RSS() if _RSS is not None else 0
        self.peak_memory_nbytes = 0

    def __call__(self, chunk: bytes) -> None:
        self.scanner.feed(chunk)
        self.check()

    def check(self) -> None:
        """Refuse when more objects than ``limits.max_objects`` are alive since the load began."""
        if _RSS is not None:
            grown = _RSS() - self.rss_baseline
            if grown > self.peak_memory_nbytes:
                self.peak_memory_nbytes = grown
                if grown > self.limits.max_memory_nbytes:
                    raise TraceFormatError(
                        self.where, f"unpickling took more than {self.limits.max_memory_nbytes:,} bytes of memory "
                        "(TraceLimits.max_memory_nbytes; repeated memo references or a decompression bomb?); "
                        "raise the limit if the file is genuine")
        made = sys.getallocatedblocks() - self.baseline
        if made > self.peak_objects:
            self.peak_objects = made
            if made > self.limits.max_objects:
                raise TraceFormatError(
                    self.where, f"unpickling made more than {self.limits.max_objects:,} objects "
                    "(TraceLimits.max_objects); raise the limit if the file is genuine")


def load_plain_pickle(path: PathLike, *, limits: TraceLimits | None = None, progress: bool | None = False) -> Any:
    """Unpickle ``path`` (gzip detected by content) admitting only plain data; see the module docstring.

    ``limits`` defaults to :data:`~gpumem.trace.limits.DEFAULT_LIMITS`; ``progress``
    shows the compressed bytes read (None: only on a terminal).
    """
    value, _, _ = _load_counted(path, limits or DEFAULT_LIMITS, progress)
    return value


def _load_counted(path: PathLike, limits: TraceLimits, progress: bool | None) -> tuple[Any, int, int]:
    """The unpickled value, the peak number of objects the load made and the memory it took (for the reader's
    own bounds)."""
    name = str(path)
    p = check_exists(path)
    size = p.stat().st_size
    gzipped = is_gzip(p)
    if gzipped:  # what GuardedReader lets the file expand to, plus one chunk of slack
        size = min(limits.max_decompressed_nbytes,
                   max(limits.ratio_floor_nbytes, int(limits.max_compression_ratio * size))) + CHUNK_NBYTES
    budget = _ObjectBudget(name, limits, size, stream_is_exact=not gzipped)
    with open_binary(path, limits=limits, inspect=budget, progress=progress) as f:
        try:
            value = PlainUnpickler(f, path=name).load()
        except TraceFormatError:
            raise
        except RecursionError as e:
            raise TraceFormatError(name, "pickle nests too deeply") from e
        except MemoryError as e:
            raise TraceFormatError(name, "pickle needs more memory than is available") from e
        except Exception as e:  # any failure of the C unpickler on untrusted bytes is a format error
            raise TraceFormatError(name, f"not a readable pickle ({type(e).__name__}: {shorten(str(e))})") from e
        budget.check()  # the objects made from the last chunk
    return value, budget.peak_objects, budget.peak_memory_nbytes
