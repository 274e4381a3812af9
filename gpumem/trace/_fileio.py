"""File helpers shared by the readers and writers: gzip by content, errors by file name, limits while reading.

Readers open their input with :func:`open_binary`: a :class:`GuardedReader` that
decompresses gzip by content, chunk by chunk, and enforces
:class:`~gpumem.trace.limits.TraceLimits` on every chunk (decompressed bytes,
compression ratio), reports the compressed bytes read to a progress bar, and lets
a reader inspect each chunk before it is parsed (the pickle reader refuses
forbidden opcodes there). :func:`iter_lines` reads lines of bounded length.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import stat
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from ..errors import TraceFormatError
from ..progress import progress as progress_bar
from .limits import DEFAULT_LIMITS, TraceLimits, shorten

GZIP_MAGIC = b"\x1f\x8b"

#: What a truncated or corrupt (possibly gzipped) file raises while being read.
READ_ERRORS: tuple[type[BaseException], ...] = (EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError, OSError)

#: Bytes decompressed per chunk: the granularity at which limits are checked.
CHUNK_NBYTES = 64 * 1024

PathLike = str | os.PathLike[str]


def _not_regular(mode: int) -> str:
    """What a file that is no regular file is, for an error message."""
    if stat.S_ISDIR(mode):
        return "is a directory, not a trace file"
    kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "special")
    return f"is not a regular file ({kind}); a trace must be a regular file"


def check_exists(path: PathLike) -> Path:
    """``Path(path)`` when it is a regular file (after following symbolic links).

    Raises ``FileNotFoundError`` naming it when there is no such file, and
    ``TraceFormatError`` saying what it is for a directory, a FIFO, a device, a
    socket or a symbolic link loop. Only ``os.stat`` is used, so a FIFO without a
    writer is never opened (opening it would block).
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(errno.ENOENT, "no such trace file", str(p)) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TraceFormatError(str(p), "is a symbolic link loop, not a trace file") from None
        raise TraceFormatError(str(p), f"cannot read ({type(e).__name__}: {shorten(str(e))})") from None
    if not stat.S_ISREG(st.st_mode):
        raise TraceFormatError(str(p), _not_regular(st.st_mode))
    return p


def open_regular(path: Path) -> IO[bytes]:
    """Open ``path`` for binary reading, refusing anything but a regular file without ever blocking.

    The file is opened non-blocking and checked with ``fstat``, so a file swapped
    for a FIFO after :func:`check_exists` still cannot hang the reader.
    """
    nonblock = getattr(os, "O_NONBLOCK", 0)  # POSIX only
    fd = os.open(path, os.O_RDONLY | nonblock | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise TraceFormatError(str(path), _not_regular(mode))
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def is_gzip(path: Path) -> bool:
    """Whether the file starts with the gzip magic bytes (the suffix is not trusted)."""
    with open_regular(path) as f:
        return f.read(2) == GZIP_MAGIC


class GuardedReader(io.RawIOBase):
    """A readable stream over a (possibly gzipped) file that enforces ``limits`` chunk by chunk.

    ``inspect(chunk)`` (optional) sees every chunk of decompressed content before
    the consumer does and may raise ``TraceFormatError``; ``bar`` (optional, a
    :func:`gpumem.progress.progress` bar counting bytes) advances by the compressed
    bytes read. Raises ``TraceFormatError`` naming the limit when one is exceeded.
    """

    def __init__(self, path: Path, limits: TraceLimits, *, inspect: Callable[[bytes], None] | None = None,
                 bar: Any = None) -> None:
        super().__init__()
        self.path = path
        self.limits = limits
        self._inspect = inspect
        self._bar = bar
        self._raw: IO[bytes] = open_regular(path)
        self.gzipped = self._raw.read(2) == GZIP_MAGIC
        self._raw.seek(0)
        self._source: IO[bytes] = gzip.GzipFile(fileobj=self._raw, mode="rb") if self.gzipped else self._raw
        self.decompressed_nbytes = 0
        self._compressed_seen = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        chunk = self._source.read(min(len(buffer), CHUNK_NBYTES))
        n = len(chunk)
        if n:
            self.decompressed_nbytes += n
            self._check()
            if self._inspect is not None:
                self._inspect(chunk)
            buffer[:n] = chunk
        return n

    def _check(self) -> None:
        limits = self.limits
        total = self.decompressed_nbytes
        if total > limits.max_decompressed_nbytes:
            raise TraceFormatError(
                str(self.path), f"more than {limits.max_decompressed_nbytes:,} bytes of content "
                "(TraceLimits.max_decompressed_nbytes); raise the limit if the file is genuine")
        compressed = self._raw.tell()
        if self._bar is not None and compressed > self._compressed_seen:
            self._bar.update(compressed - self._compressed_seen)
            self._compressed_seen = compressed
        if self.gzipped and total > limits.ratio_floor_nbytes and total > limits.max_compression_ratio * compressed:
            raise TraceFormatError(
                str(self.path), f"{compressed:,} compressed bytes expand to more than {total:,} "
                f"(over {limits.max_compression_ratio:g}x, TraceLimits.max_compression_ratio): a decompression bomb?")

    def close(self) -> None:
        if not self.closed:
            try:
                if self._source is not self._raw:
                    self._source.close()
            finally:
                self._raw.close()
        super().close()


@contextmanager
def open_binary(path: PathLike, *, limits: TraceLimits | None = None, inspect: Callable[[bytes], None] | None = None,
                progress: bool | None = False, desc: str | None = None) -> Iterator[IO[bytes]]:
    """Open for reading, transparently decompressing gzip; read errors become ``TraceFormatError``.

    The stream enforces ``limits`` (:data:`~gpumem.trace.limits.DEFAULT_LIMITS` when
    None) while it is read; ``inspect`` sees each decompressed chunk first;
    ``progress`` shows a bar of compressed bytes read (None: only on a terminal).
    """
    p = check_exists(path)
    try:
        reader = GuardedReader(p, limits or DEFAULT_LIMITS, inspect=inspect)
    except OSError as e:
        raise TraceFormatError(str(p), f"cannot read ({type(e).__name__}: {shorten(str(e))})") from e
    bar = progress_bar(p.stat().st_size, desc or f"load {p.name}", "B", enabled=progress)
    reader._bar = bar
    try:
        with reading_errors(p):
            yield io.BufferedReader(reader, buffer_size=CHUNK_NBYTES)
    finally:
        reader.close()
        bar.close()


def iter_lines(f: IO[bytes], where: str, limits: TraceLimits, *, start: int = 1,
               skip_blank: bool = False) -> Iterator[tuple[int, str]]:
    """``(line_number, text)`` for each line of ``f`` (line ending stripped), numbered from ``start``.

    Reads in chunks and splits them in C, so even a file of millions of empty
    lines costs little (``skip_blank=True`` drops empty lines before decoding
    them, still counting them). A line longer than ``limits.max_line_nbytes`` or
    not valid UTF-8 raises ``TraceFormatError`` naming the line and quoting at
    most a short prefix; the long line is never held whole.
    """
    cap = limits.max_line_nbytes
    lineno = start
    pending = b""
    while True:
        block = f.read(CHUNK_NBYTES)
        if not block:
            break
        lines = (pending + block if pending else block).split(b"\n")
        pending = lines.pop()
        if len(pending) > cap:
            raise _long_line(where, lineno + len(lines), cap, pending)
        for raw in lines:
            if skip_blank and (not raw or raw == b"\r"):
                lineno += 1
                continue
            if len(raw) > cap:
                raise _long_line(where, lineno, cap, raw)
            yield lineno, _decode(raw, where, lineno).rstrip("\r")
            lineno += 1
    if pending and not (skip_blank and pending == b"\r"):
        yield lineno, _decode(pending, where, lineno).rstrip("\r")


def _long_line(where: str, lineno: int, cap: int, raw: bytes) -> TraceFormatError:
    return TraceFormatError(where, f"line {lineno}: longer than {cap:,} bytes (TraceLimits.max_line_nbytes), "
                                   f"starting {shorten(raw)}")


def _decode(raw: bytes, where: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(where, f"line {lineno}: not UTF-8 ({e.reason} at byte {e.start}): "
                                      f"{shorten(raw)}") from None


@contextmanager
def reading_errors(path: PathLike) -> Iterator[None]:
    """Turn truncation/corruption errors raised inside the block into ``TraceFormatError``."""
    try:
        yield
    except READ_ERRORS as e:
        raise TraceFormatError(str(path), f"truncated or corrupt file ({type(e).__name__}: {shorten(str(e))})") from e


def peek(path: PathLike, nbytes: int = 256) -> bytes:
    """The first ``nbytes`` of the (decompressed) content; ``b""`` when that cannot be read."""
    try:
        with open_binary(path) as f:
            return f.read(nbytes)
    except (TraceFormatError, OSError):
        return b""


@contextmanager
def open_for_writing(path: PathLike, *, text: bool = True) -> Iterator[IO]:  # type: ignore[type-arg]
    """Open for writing; gzip-compressed when the name ends with ``.gz`` (mtime 0, so output is reproducible).

    The content goes to a temporary file beside ``path``, renamed over it only once the block has
    finished without an exception: a writer that fails half-way (a bad value, Ctrl-C, a full disk)
    leaves the file that was there untouched, and no partial trace under the final name.
    """
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        raw = open(tmp, "wb")
        try:
            if p.name.endswith(".gz"):
                with gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz:
                    if text:
                        with io.TextIOWrapper(gz, encoding="utf-8", newline="\n") as t:
                            yield t
                    else:
                        yield gz
            elif text:
                t = io.TextIOWrapper(raw, encoding="utf-8", newline="\n")
                yield t
                t.flush()
                t.detach()
            else:
                yield raw
        finally:
            raw.close()
        os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()


def trace_name_from_path(path: PathLike) -> str:
    """The default trace name: the file name up to its first dot.

    ``gpt2_train.snapshot.pickle.gz`` -> ``gpt2_train``.
    """
    return Path(path).name.split(".", 1)[0] or Path(path).name
