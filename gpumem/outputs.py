"""Writing outputs without losing the old ones: one module for every command that writes a folder or a file.

Note [An output is replaced only by a complete one]: a report, a sweep or a HIL record is first written in
full beside its destination (a temporary sibling), and only then moved into place; the old output is moved
aside just before and removed just after, and put back if the move fails. An interrupted or failing command
therefore leaves either the old output or the new one, never half of each, and never a hidden copy. The
destination's folder is resolved first (:func:`resolve_output_path`): with ``--out R/../R`` the path
``R/..`` stops existing the moment ``R`` is moved aside, and a rename through it fails half-way.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .errors import InvalidArgumentError

__all__ = ["resolve_output_path", "replace_dir", "write_file_atomic"]


def resolve_output_path(path: "str | os.PathLike[str]", *, what: str = "--out") -> Path:
    """``path`` with its folder resolved (symbolic links and ``..`` followed) and its own name kept.

    Raises :class:`~gpumem.errors.InvalidArgumentError` for a path without a name of its own
    (``""``, ``.``, ``..``, ``/``)."""
    p = Path(path)
    if p.name in ("", ".", ".."):
        raise InvalidArgumentError(f"{what} {os.fspath(path)!r}: give the output a name of its own (a new path)")
    return Path(os.path.realpath(p.parent)) / p.name


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out`` (a sibling), replacing an existing ``out`` only now
    (Note [An output is replaced only by a complete one]). ``out`` must be resolved
    (:func:`resolve_output_path`)."""
    old = None
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, old / "prev")
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old / "prev", out)
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        prev = old / "prev"
        shutil.rmtree(prev, ignore_errors=True) if prev.is_dir() and not prev.is_symlink() else prev.unlink()
        shutil.rmtree(old, ignore_errors=True)


def write_file_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and a rename: readers see the old file or the
    new one, never a part (Note [An output is replaced only by a complete one])."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
