"""File helpers shared by the readers and writers: gzip by content, errors by file name."""

from __future__ import annotations

import errno
import gzip
import io
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from ..errors import TraceFormatError

GZIP_MAGIC = b"\x1f\x8b"

#: What a truncated or corrupt (possibly gzipped) file raises while being read.
READ_ERRORS: tuple[type[BaseException], ...] = (EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError)

PathLike = str | os.PathLike[str]


def check_exists(path: PathLike) -> Path:
    """``Path(path)``, or ``FileNotFoundError`` naming it when there is no such file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(errno.ENOENT, "no such trace file", str(p))
    return p


def is_gzip(path: Path) -> bool:
    """Whether the file starts with the gzip magic bytes (the suffix is not trusted)."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


@contextmanager
def open_binary(path: PathLike) -> Iterator[IO[bytes]]:
    """Open for reading, transparently decompressing gzip; read errors become ``TraceFormatError``."""
    p = check_exists(path)
    raw: IO[bytes] = open(p, "rb")
    try:
        f: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="rb") if raw.read(2) == GZIP_MAGIC else raw
        raw.seek(0)
        with reading_errors(p):
            yield f
    finally:
        raw.close()


@contextmanager
def open_text(path: PathLike) -> Iterator[IO[str]]:
    """Like :func:`open_binary`, as UTF-8 text with universal newlines."""
    with open_binary(path) as f:
        yield io.TextIOWrapper(f, encoding="utf-8", newline=None)


@contextmanager
def reading_errors(path: PathLike) -> Iterator[None]:
    """Turn truncation/corruption errors raised inside the block into ``TraceFormatError``."""
    try:
        yield
    except READ_ERRORS as e:
        raise TraceFormatError(str(path), f"truncated or corrupt file ({type(e).__name__}: {e})") from e


def peek(path: PathLike, nbytes: int = 256) -> bytes:
    """The first ``nbytes`` of the (decompressed) content; ``b""`` when that cannot be read."""
    try:
        with open_binary(path) as f:
            return f.read(nbytes)
    except TraceFormatError:
        return b""


@contextmanager
def open_for_writing(path: PathLike, *, text: bool = True) -> Iterator[IO]:  # type: ignore[type-arg]
    """Open for writing; gzip-compressed when the name ends with ``.gz`` (mtime 0, so output is reproducible)."""
    p = Path(path)
    if p.name.endswith(".gz"):
        raw = open(p, "wb")
        try:
            gz = gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=6, mtime=0)
            with gz:
                if text:
                    with io.TextIOWrapper(gz, encoding="utf-8", newline="\n") as t:
                        yield t
                else:
                    yield gz
        finally:
            raw.close()
    else:
        if text:
            with open(p, "w", encoding="utf-8", newline="\n") as f:
                yield f
        else:
            with open(p, "wb") as fb:
                yield fb


def trace_name_from_path(path: PathLike) -> str:
    """The default trace name: the file name up to its first dot.

    ``gpt2_train.snapshot.pickle.gz`` -> ``gpt2_train``.
    """
    return Path(path).name.split(".", 1)[0] or Path(path).name
