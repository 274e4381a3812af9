"""Writing outputs safely: one place that replaces an output folder or file atomically, and resolves the
path it is given first.

Note [An output is replaced only by a complete one]
---------------------------------------------------
Reports, sweeps and HIL records are written into a temporary sibling of the destination and renamed into
place only once complete. The destination is resolved first (``os.path.realpath`` of its parent): with
``--out R/../R`` the parent ``R/..`` stops existing while ``R`` is moved aside, so a sibling named through
it could not be found again (the old output was left hidden in ``.R.old-PID`` and the new one in
``.R.tmp-*``). On any failure the old output is put back and the temporary one removed; nothing hidden is
left behind. A file is fsynced before its rename (cheap); folders are not (many files).
"""

from __future__ import annotations

import decimal
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["csv_cell", "csv_row", "resolve_output", "replace_atomically", "write_text_atomically"]


# Note [Spreadsheet formulas in CSV cells]
# A cell that starts with =, +, -, @, a tab or a carriage return is read as a formula by spreadsheets;
# snapshot frame names and trace file names come from files a user did not write. As OWASP's CSV
# injection advice says, such a text cell is prefixed with a single quote (and is still quoted by the
# csv module where needed). The start is looked for after any leading whitespace or quotes (spreadsheets
# skip them: " =1+1" and "\"=1+1" are formulas too) and includes the full-width forms of the four
# signs; a value that is not a number (a Path, bytes, an enum) is checked as the text csv writes for it.
# Numbers are left as they are, and so is text that is a plain number ("-5", "+1.5e3"): a spreadsheet
# reads it as that number, not a formula, and prefixing it would change the value.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\uff1d", "\uff0b", "\uff0d", "\uff20")
_PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def csv_cell(value: Any) -> Any:
    """``value`` safe to put in a CSV cell (Note [Spreadsheet formulas in CSV cells])."""
    if value is None or isinstance(value, (int, float, decimal.Decimal)):
        return value
    text = value if isinstance(value, str) else str(value)
    head = text.lstrip().lstrip("\"'").lstrip()
    if (head.startswith(_FORMULA_STARTS) or text.startswith(_FORMULA_STARTS)) \
            and not _PLAIN_NUMBER.fullmatch(text):
        return "'" + text
    return value


def csv_row(row: "dict[str, Any]") -> "dict[str, Any]":
    """:func:`csv_cell` of every value of a ``csv.DictWriter`` row."""
    return {k: csv_cell(v) for k, v in row.items()}


def resolve_output(path: "str | os.PathLike[str]") -> Path:
    """``path`` with its parent resolved (symlinks, ``..``) and its own name kept, so that moving the old
    output aside cannot change what the path names."""
    p = Path(path)
    if p.name in ("", ".", ".."):
        p = Path(os.path.realpath(p))
    return Path(os.path.realpath(p.parent)) / p.name


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def replace_atomically(tmp: "str | os.PathLike[str]", out: "str | os.PathLike[str]") -> None:
    """Move the finished ``tmp`` (a sibling of ``out``) to ``out``, replacing what is there only now
    (Note [An output is replaced only by a complete one]). On failure the old ``out`` is restored, ``tmp``
    is removed and the error propagates."""
    tmp, out = Path(tmp), resolve_output(out)
    try:
        if out.exists() or out.is_symlink():
            aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            keep_aside = False
            try:
                os.rename(out, aside / "prev")
                try:
                    os.rename(tmp, out)
                except BaseException:
                    try:
                        os.rename(aside / "prev", out)
                    except OSError as e:  # something took ``out`` meanwhile: the old output is kept aside
                        keep_aside = True
                        raise OSError(e.errno, f"{out} could not be replaced and something else took its "
                                      f"place meanwhile; the earlier output was kept in {aside / 'prev'}") from e
                    raise
            finally:
                if not keep_aside:
                    shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        _remove(tmp)
        raise


def _file_mode(out: Path) -> int:
    """The permission bits for a file replacing ``out``: those of the file it replaces, or the umask's."""
    try:
        return stat.S_IMODE(os.stat(out).st_mode) & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_text_atomically(path: "str | os.PathLike[str]", text: str) -> Path:
    """Write ``text`` to ``path`` through a fsynced temporary sibling renamed over it; the old file stays
    whole until then. Returns the resolved path."""
    out = resolve_output(path)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), _file_mode(out))  # mkstemp makes it private (0600): keep an ordinary file's mode
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, out)
    except BaseException:
        _remove(Path(name))
        raise
    return out
