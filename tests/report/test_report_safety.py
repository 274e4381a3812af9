"""gpumem report --out/--force: only an earlier gpumem report is ever replaced; the trace, the folder
holding it, a file or a folder with other files are refused up front (exit 2) and nothing is touched."""

from __future__ import annotations

import random

import pytest

from gpumem.cli import EXIT_OK, EXIT_USAGE, main
from gpumem.trace import Trace, save_trace
from gpumem.units import MiB

pytest.importorskip("matplotlib")


def _trace(n: int = 60) -> Trace:
    rng = random.Random(3)
    ops, live, i = [], [], 0
    for _ in range(n):
        if live and rng.random() < 0.4:
            aid, nb = live.pop()
            ops.append((1, aid, nb, 0, 0.0, 0))
        else:
            nb = rng.choice([4096, 2 * MiB, 9 * MiB])
            ops.append((0, i, nb, 0, 0.0, 0))
            live.append((i, nb))
            i += 1
    ops += [(1, aid, nb, 0, 0.0, 0) for aid, nb in live]
    return Trace.from_ops("t", "test", ops)


@pytest.fixture()
def trace(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    p = d / "t.pickle.gz"
    save_trace(_trace(), p)
    (d / "notes.txt").write_text("keep me")
    return p


def _report(trace, out, *extra):
    return main(["report", str(trace), "--out", str(out), "--policy", "gpumem", "--no-fit", "--json", *extra])


def test_force_refuses_the_folder_holding_the_trace(trace, capsys):
    assert _report(trace, trace.parent, "--force") == EXIT_USAGE
    assert trace.is_file() and (trace.parent / "notes.txt").read_text() == "keep me"
    assert "trace" in capsys.readouterr().err


def test_force_refuses_the_trace_itself(trace):
    assert _report(trace, trace, "--force") == EXIT_USAGE
    assert trace.is_file()


def test_force_refuses_a_file_and_a_folder_of_other_files(trace, tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert _report(trace, f, "--force") == EXIT_USAGE
    assert f.read_text() == "x"
    d = tmp_path / "other"
    d.mkdir()
    (d / "a.txt").write_text("a")
    (d / "report.json").write_text("{}")
    assert _report(trace, d, "--force") == EXIT_USAGE
    assert (d / "a.txt").read_text() == "a" and (d / "report.json").read_text() == "{}"


def test_force_refuses_a_report_with_a_stranger_in_it(trace, tmp_path):
    out = tmp_path / "rep"
    assert _report(trace, out) == EXIT_OK
    (out / "notes.txt").write_text("mine")
    assert _report(trace, out, "--force") == EXIT_USAGE
    assert (out / "notes.txt").read_text() == "mine" and (out / "report.json").is_file()


def test_force_replaces_an_earlier_report(trace, tmp_path):
    out = tmp_path / "rep"
    assert _report(trace, out) == EXIT_OK
    assert _report(trace, out) == EXIT_USAGE  # no --force: refused
    assert _report(trace, out, "--force") == EXIT_OK
    assert (out / "index.html").is_file()


@pytest.mark.parametrize("out", ["/", ".", ".."])
def test_root_and_dot_are_refused_up_front(trace, tmp_path, monkeypatch, capsys, out):
    monkeypatch.chdir(trace.parent)
    assert _report(trace, out, "--force") == EXIT_USAGE
    assert "Traceback" not in capsys.readouterr().err
    assert trace.is_file() and (trace.parent / "notes.txt").is_file()
    assert sorted(p.name for p in trace.parent.iterdir()) == ["notes.txt", "t.pickle.gz"]


def test_force_through_the_folder_being_replaced_keeps_a_whole_report(trace, tmp_path, capsys):
    """Issue 20 item 8: `report --out R/../R --force` hid the old report in .R.old-PID, left the new one in
    .R.tmp-* and said "no such trace file"."""
    out = tmp_path / "rep"
    assert _report(trace, out) == EXIT_OK
    capsys.readouterr()
    assert _report(trace, f"{out}/../rep", "--force") == EXIT_OK, capsys.readouterr().err
    assert (out / "index.html").is_file() and (out / "report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "rep"]   # nothing hidden beside it


def test_force_through_the_folder_being_replaced_ends_complete(trace, tmp_path, monkeypatch):
    """issue 20 item 8: ``--out R/../R --force`` hid the old report in ``.R.old-PID`` and left the new one
    in ``.R.tmp-*``; the path is resolved first and nothing hidden is left."""
    monkeypatch.chdir(tmp_path)
    assert _report(trace, "R") == EXIT_OK
    assert _report(trace, "R/../R", "--force") == EXIT_OK
    assert (tmp_path / "R" / "index.html").is_file() and (tmp_path / "R" / "report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_failed_replacement_leaves_the_old_output_and_no_temp(tmp_path, monkeypatch):
    from gpumem import outputs
    out = tmp_path / "R"
    out.mkdir()
    (out / "old.txt").write_text("old")
    tmp = tmp_path / ".R.new"
    tmp.mkdir()
    real_rename = outputs.os.rename

    def failing(src, dst):
        if str(src) == str(tmp):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)
    monkeypatch.setattr(outputs.os, "rename", failing)
    with pytest.raises(OSError):
        outputs.replace_atomically(tmp, tmp_path / "R" / ".." / "R")
    assert (out / "old.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["R"]


def test_out_under_a_file_is_one_line_error_not_a_traceback(trace, tmp_path, capsys):
    """issue 20 review: `report --out FILE/r` raised a raw FileExistsError traceback."""
    f = tmp_path / "afile"
    f.write_text("x")
    assert _report(trace, f / "r") == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot write the report" in err and "Traceback" not in err
    assert f.read_text() == "x"


def test_output_folder_vanishing_is_not_called_a_missing_trace(trace, tmp_path, capsys, monkeypatch):
    """issue 20 review: any FileNotFoundError while writing (the output's folder removed meanwhile,
    `--out /proc/r`) was reported as "no such trace file" naming a trace that exists."""
    import gpumem.report.build as build

    def vanish(tmp, out, force):
        raise FileNotFoundError(2, "No such file or directory", str(out.parent))

    monkeypatch.setattr(build, "_install", vanish)
    assert _report(trace, tmp_path / "gone" / "r") == EXIT_USAGE
    err = capsys.readouterr().err
    assert "no such trace file" not in err and "cannot write the report" in err
    assert not list((tmp_path / "gone").iterdir())
