"""Attacks on gpumem.outputs (issue 20 review): formula cells in disguise, and the old output kept when
something takes the destination while it is being replaced."""

from __future__ import annotations

import csv
import enum
import io
import os
from pathlib import Path

import pytest

from gpumem import outputs
from gpumem.outputs import csv_cell, csv_row, replace_atomically


@pytest.mark.parametrize("value", [" =1+1", "  @SUM(A1)", "\"=1+1", "'=1+1", "\n=cmd", "\u00a0=cmd",
                                   "\uff1d1+1", " \" -2+3", "\t=x"])
def test_formula_after_leading_whitespace_or_quotes_is_neutralised(value):
    assert csv_cell(value) == "'" + value


class _Name(enum.Enum):
    EVIL = "=cmd"


@pytest.mark.parametrize("value", [Path("=cmd"), b"=cmd", _Name.EVIL])
def test_non_str_values_are_checked_as_the_text_csv_writes(value):
    buf = io.StringIO()
    csv.writer(buf).writerow([csv_cell(value)])
    assert not buf.getvalue().lstrip("\"").startswith(("=", "+", "-", "@")), buf.getvalue()


@pytest.mark.parametrize("value", ["-5", "+1.5e3", "-.5", "12", -5, 1.5, float("nan"), True, None, "ok"])
def test_numbers_and_plain_numeric_text_are_unchanged(value):
    out = csv_cell(value)
    assert out is value or out == value


def test_csv_row_neutralises_every_value():
    assert csv_row({"a": " =x", "b": 3}) == {"a": "' =x", "b": 3}


def test_old_output_kept_when_the_destination_is_taken_meanwhile(tmp_path, monkeypatch):
    """Two commands writing one --out: if the other one's output lands between our two renames, the
    restore fails; the old output must not be deleted with the temporary folder."""
    out = tmp_path / "R"
    out.mkdir()
    (out / "old.txt").write_text("precious")
    tmp = tmp_path / ".R.tmp"
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append((Path(src), Path(dst)))
        if len(calls) == 2:  # ours: tmp -> out; the other command got there first
            Path(dst).mkdir()
            (Path(dst) / "other.txt").write_text("other")
        return real_rename(src, dst)

    monkeypatch.setattr(outputs.os, "rename", rename)
    with pytest.raises(OSError, match="kept in"):
        replace_atomically(tmp, out)
    monkeypatch.setattr(outputs.os, "rename", real_rename)
    kept = [p for p in tmp_path.rglob("old.txt")]
    assert kept and kept[0].read_text() == "precious"
    assert not tmp.exists()


def test_a_file_written_atomically_keeps_an_ordinary_mode(tmp_path):
    """issue 20 review: write_text_atomically left every HIL record and summary private (0600, mkstemp's)."""
    from gpumem.outputs import write_text_atomically

    umask = os.umask(0o022)
    try:
        new = write_text_atomically(tmp_path / "new.json", "{}")
        assert oct(new.stat().st_mode & 0o777) == oct(0o644)
        old = tmp_path / "old.md"
        old.write_text("x")
        old.chmod(0o664)
        write_text_atomically(old, "y")
        assert oct(old.stat().st_mode & 0o777) == oct(0o664) and old.read_text() == "y"
    finally:
        os.umask(umask)
