"""Checks the studies' command lines share: a ``--json`` target checked before a study runs (minutes on the
corpus), so that a path that cannot be written is refused in one line, not after the study."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def json_target_problem(path: Path) -> str:
    """Why rows cannot be written to ``path``, or ``""``: a folder, a missing folder, a link to a missing file,
    an existing target that is no regular file (a FIFO would block the write after the study; ``/dev/full``
    fails it), or a file or folder that refuses writing.

    Writability is tried, not read from the mode bits (``os.access`` says yes to root for any file): an
    existing file is opened for appending and given a write of no bytes (its contents unchanged;
    non-blocking, in case it became a FIFO since the check), a new one is tried as a temporary file beside it, removed at
    once."""
    if os.path.lexists(path) and not path.exists():
        return f"{path} is a link to a missing file"
    if path.is_dir():
        return f"{path} is a folder"
    if not path.parent.is_dir():
        return f"no folder {path.parent}"
    if path.exists():
        try:
            if not stat.S_ISREG(path.stat().st_mode):
                return f"{path} is not a regular file"
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            return f"cannot write {path}: {exc.strerror or exc}"
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):   # replaced between the checks
                return f"{path} is not a regular file"
            os.write(fd, b"")   # nothing written; a file that takes no writes (/proc/version) fails here
        except OSError as exc:
            return f"cannot write {path}: {exc.strerror or exc}"
        finally:
            os.close(fd)
        return ""
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name[:40]}.", suffix=".check"):
            pass
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    return ""


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same path once resolved (links followed), or, both existing, one
    file under two names (a hard link)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
