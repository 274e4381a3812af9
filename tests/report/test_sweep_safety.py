"""gpumem sweep: --out replaces only an earlier gpumem sweep's folder; one trace given twice under two
names is refused; --scheduler at something that is not a Dask scheduler is a usage error, quickly;
gpumem report refuses two --device specs naming one device."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from gpumem.cli import EXIT_OK, EXIT_USAGE, main
from gpumem.report.sweep import SweepError, check_out_dir, make_cases
from gpumem.trace import Trace, save_trace


@pytest.fixture()
def trace(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    p = d / "t.gmt"
    save_trace(Trace.from_ops("t", "test", [(0, 0, 4096, 0, 0.0, 0), (0, 1, 1 << 20, 0, 0.0, 0),
                                            (1, 0, 4096, 0, 0.0, 0), (1, 1, 1 << 20, 0, 0.0, 0)]), p)
    (d / "notes.txt").write_text("keep me")
    return p


def _sweep(trace, out, *extra):
    where = [] if "--scheduler" in extra else ["--jobs", "1"]
    return main(["sweep", str(trace), "--device", "sim:t4-16gb", "--policy", "gpumem", "--out", str(out),
                 "--no-plots", "--json", *where, *extra])


def test_a_folder_with_a_fake_sweep_json_is_not_replaced(trace, capsys):
    d = trace.parent
    (d / "sweep.json").write_text("{}")
    assert _sweep(trace, d) == EXIT_USAGE
    assert trace.is_file() and (d / "notes.txt").read_text() == "keep me"
    assert (d / "sweep.json").read_text() == "{}"


def test_an_earlier_sweep_with_a_stranger_is_not_replaced(trace, tmp_path):
    out = tmp_path / "sw"
    assert _sweep(trace, out) == EXIT_OK
    (out / "notes.txt").write_text("mine")
    assert _sweep(trace, out) == EXIT_USAGE
    assert (out / "notes.txt").read_text() == "mine"


def test_an_earlier_sweep_is_replaced(trace, tmp_path):
    out = tmp_path / "sw"
    assert _sweep(trace, out) == EXIT_OK
    data = json.loads((out / "sweep.json").read_text())
    assert _sweep(trace, out) == EXIT_OK
    assert json.loads((out / "sweep.json").read_text())["columns"] == data["columns"]


def test_the_folder_of_the_trace_and_root_are_refused(trace, tmp_path):
    with pytest.raises(SweepError):
        check_out_dir(trace.parent, [str(trace)])
    for bad in ("/", ".", ".."):
        with pytest.raises(SweepError):
            check_out_dir(bad)


def test_one_trace_under_two_names_is_refused(trace, monkeypatch):
    monkeypatch.chdir(trace.parent)
    with pytest.raises(SweepError, match="same file"):
        make_cases(["t.gmt", "./t.gmt"], ["sim:t4-16gb"], ["gpumem"])
    link = trace.parent / "link.gmt"
    link.symlink_to(trace)
    with pytest.raises(SweepError, match="same file"):
        make_cases([str(trace), str(link)], ["sim:t4-16gb"], ["gpumem"])


def test_report_refuses_one_device_given_twice(trace, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "rep"
    assert main(["report", str(trace), "--device", "sim:t4-16gb", "--device", "sim:t4-16gb?",
                 "--out", str(out), "--policy", "gpumem"]) == EXIT_USAGE
    assert "same device" in capsys.readouterr().err and not out.exists()


# -- --scheduler at something that is not a Dask scheduler -------------------------------------------------
def _silent_server():
    """Accepts connections and never says a word."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held = []

    def loop():
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=loop, daemon=True).start()
    return srv, held


def test_scheduler_that_never_answers_is_a_quick_usage_error(trace, tmp_path, capsys):
    pytest.importorskip("distributed")
    srv, held = _silent_server()
    try:
        t0 = time.monotonic()
        rc = _sweep(trace, tmp_path / "sw", "--scheduler", f"tcp://127.0.0.1:{srv.getsockname()[1]}")
        took = time.monotonic() - t0
    finally:
        srv.close()
        for c in held:
            c.close()
    assert rc == EXIT_USAGE and took < 20
    assert "cannot connect" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()


def test_scheduler_that_is_a_web_server_is_a_quick_usage_error(trace, tmp_path, capsys):
    pytest.importorskip("distributed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                           cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        t0 = time.monotonic()
        rc = _sweep(trace, tmp_path / "sw", "--scheduler", f"tcp://127.0.0.1:{port}")
        took = time.monotonic() - t0
    finally:
        web.kill()
        web.wait()
    assert rc == EXIT_USAGE and took < 20
    assert f"127.0.0.1:{port}" in capsys.readouterr().err


def test_any_error_from_connecting_is_a_usage_error(trace, tmp_path, monkeypatch, capsys):
    distributed = pytest.importorskip("distributed")

    def explode(*a, **k):
        raise MemoryError("Unable to allocate 3.07 EiB")

    monkeypatch.setattr(distributed, "Client", explode)
    assert _sweep(trace, tmp_path / "sw", "--scheduler", "tcp://127.0.0.1:1") == EXIT_USAGE
    err = capsys.readouterr().err
    assert "tcp://127.0.0.1:1" in err and "Traceback" not in err


def test_a_sweep_through_the_folder_being_replaced_is_whole(trace, tmp_path, capsys):
    """Issue 20 item 8: `sweep --out S/../S` ended in a traceback with the old sweep hidden."""
    out = tmp_path / "sw"
    assert _sweep(trace, out) == EXIT_OK
    capsys.readouterr()
    assert _sweep(trace, f"{out}/../sw") == EXIT_OK, capsys.readouterr().err
    assert (out / "sweep.json").is_file() and (out / "sweep.csv").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "sw"]


def test_sweep_through_the_folder_being_replaced_ends_complete(trace, tmp_path, monkeypatch):
    """issue 20 item 8: ``sweep --out S/../S`` ended in a traceback with the old sweep hidden."""
    monkeypatch.chdir(tmp_path)
    assert _sweep(trace, "S") == EXIT_OK
    assert _sweep(trace, "S/../S") == EXIT_OK
    assert (tmp_path / "S" / "sweep.csv").is_file() and (tmp_path / "S" / "sweep.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".S")] == []


def test_output_folder_removed_while_running_is_one_line(trace, tmp_path, capsys, monkeypatch):
    """issue 20 review: an OS error while writing the sweep (its folder removed or made read-only while
    the cases ran) ended in a traceback."""
    import gpumem.report.sweep as sweep_mod

    def vanish(tmp, out):
        raise FileNotFoundError(2, "No such file or directory", str(out))

    monkeypatch.setattr(sweep_mod, "replace_atomically", vanish)
    out = tmp_path / "s"
    assert _sweep(trace, out) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot write the sweep" in err and "Traceback" not in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".s.")]
