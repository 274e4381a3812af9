"""The HIL runner under hostile input, interruption and concurrency (found by an attacker's review):
every refusal is one line and exit 2 with nothing written, and no child process outlives the runner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hil.__main__ import EXIT_INTERRUPTED, main
from hil.process import run_in_group
from hil.runner import EXIT_BAD_INPUT, overall_status

REPO = Path(__file__).resolve().parents[2]
SIM = "sim:t4-16gb"


def _refused(capsys: pytest.CaptureFixture, argv: list[str], expected: str) -> None:
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture
def cupy_record(tmp_path: Path) -> Path:
    """A record of the (quick, all-skipped) CuPy suite on a simulated device."""
    main(["run", "--device", SIM, "--out", str(tmp_path / "rec"), "--suites", "cupy", "--parts", "suites"])
    (path,) = (tmp_path / "rec").glob("hil-*.json")
    return path


@pytest.mark.parametrize("damage, expected", [
    (lambda r: r.update(devices="x"), "'devices' is not a list"),
    (lambda r: r.update(devices=[SIM]), "'devices' is not a list"),
    (lambda r: r.update(results=[]), "'results' is not an object"),
    (lambda r: r.update(runs="abc"), "'runs' is not a list"),
    (lambda r: r["runs"][0].update(parts=None), "'runs' is not a list"),
    (lambda r: r["results"][SIM].update(peers="x"), "the peers part"),
    (lambda r: r["results"][SIM]["suites"][0].pop("suite"), "the suites of"),
])
def test_a_damaged_resume_record_is_refused_before_anything_runs(cupy_record: Path, capsys, damage,
                                                                  expected: str) -> None:
    record = json.loads(cupy_record.read_text())
    damage(record)
    cupy_record.write_text(json.dumps(record))
    before = cupy_record.read_bytes()
    capsys.readouterr()
    _refused(capsys, ["run", "--device", SIM, "--suites", "cupy", "--parts", "suites", "--resume", str(cupy_record)],
             expected)
    assert cupy_record.read_bytes() == before


def test_a_deeply_nested_resume_file_is_one_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "deep.json"
    bad.write_text("[" * 100_000)
    _refused(capsys, ["run", "--device", SIM, "--suites", "cupy", "--resume", str(bad)], "not JSON")


def test_a_resumed_record_of_another_card_is_refused(cupy_record: Path, capsys) -> None:
    record = json.loads(cupy_record.read_text())
    record["devices"][0]["name"] = "NVIDIA H100 80GB HBM3"
    cupy_record.write_text(json.dumps(record))
    capsys.readouterr()
    _refused(capsys, ["run", "--device", SIM, "--suites", "cupy", "--parts", "suites", "--resume", str(cupy_record)],
             "a record covers one set of cards")


def test_resuming_some_suites_keeps_the_others(cupy_record: Path) -> None:
    assert main(["run", "--device", SIM, "--suites", "cuda_adapter", "--parts", "suites",
                 "--resume", str(cupy_record)]) in (0, 3)
    suites = [s["suite"] for s in json.loads(cupy_record.read_text())["results"][SIM]["suites"]]
    assert suites == ["cuda_adapter", "cupy"]  # the CuPy result of the first call is still there, in suite order


def test_a_record_missing_suites_is_not_passed() -> None:
    record = {"devices": [{"spec": SIM}], "results": {SIM: {
        "suites": [{"suite": "contract", "status": "passed"}],
        **{p: {"status": "passed"} for p in ("peers", "fidelity", "sanitizer")}}}}
    assert overall_status(record) == "incomplete"
    record["results"][SIM]["suites"] = []
    assert overall_status(record) == "incomplete"


def test_bad_out_traces_sim_repo_and_devices_are_refused_up_front(tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    base = ["run", "--device", SIM, "--suites", "cupy"]
    _refused(capsys, [*base, "--out", str(a_file)], "cannot make the folder")
    _refused(capsys, [*base, "--out", str(a_file / "sub")], "cannot make the folder")
    with pytest.raises(SystemExit) as stop:
        main([*base, "--out", ""])
    assert stop.value.code == EXIT_BAD_INPUT and "argument --out: empty path" in capsys.readouterr().err
    _refused(capsys, [*base, "--out", str(tmp_path), "--traces", str(tmp_path / "none")], "no such folder")
    _refused(capsys, [*base, "--out", str(tmp_path), "--sim", "sim:bogus"], "unknown simulated profile")
    _refused(capsys, [*base, "--out", str(tmp_path), "--sim", "cuda:0"], "not a simulated device")
    _refused(capsys, [*base, "--out", str(tmp_path), "--repo", str(tmp_path)], "not a gpumem checkout")
    _refused(capsys, ["run", "--device", "sim:t4-16gb,sim:T4-16gb", "--out", str(tmp_path)], "name the same device")
    assert list(tmp_path.iterdir()) == [a_file]  # nothing written
    assert not list(Path.cwd().glob("hil-sim-*"))


def test_a_second_run_into_the_same_folder_stops_at_once(tmp_path: Path, capsys) -> None:
    import fcntl

    with open(tmp_path / ".gpumem-hil.lock", "a+") as held:  # as a first run holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _refused(capsys, ["run", "--device", SIM, "--suites", "cupy", "--out", str(tmp_path)],
                 "another run is writing into")
    assert not list(tmp_path.glob("hil-*"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_child_that_runs_too_long_is_killed_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    code = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    assert run_in_group([sys.executable, "-c", code], cwd=tmp_path, log_path=tmp_path / "log", env=None,
                        timeout_s=3) is None
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_kills_the_suite_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "hil", "run", "--device", SIM, "--suites", "managers",
                             "--parts", "suites", "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    log = out / "hil-sim-tesla-t4-16gb-placeholder"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait for the suite's pytest to be running
        logs = list(out.glob("*-logs/managers-*.log"))
        if logs and logs[0].stat().st_size > 0:
            log = logs[0]
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the managers suite never started")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "interrupted; no record written" in err and "Traceback" not in err
    assert not list(out.glob("hil-*.json"))
    size = log.stat().st_size
    time.sleep(1.5)
    assert log.stat().st_size == size  # the suite's pytest was killed, not left writing its log
    found = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    assert found.stdout.strip() == "", found.stdout


def test_sigterm_kills_the_suite_as_ctrl_c_does(tmp_path: Path) -> None:
    """Found by review: a cancelled CI job (SIGTERM) left the suite's pytest running under PID 1."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "hil", "run", "--device", SIM, "--suites", "managers",
                             "--parts", "suites", "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size for p in out.glob("*-logs/managers-*.log")):
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the managers suite never started")
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by signal" in err and "Traceback" not in err
    time.sleep(0.5)
    found = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
    assert found.stdout.strip() == "", found.stdout


def test_out_and_resume_together_are_refused(cupy_record: Path, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    _refused(capsys, ["run", "--device", SIM, "--suites", "cupy", "--resume", str(cupy_record),
                      "--out", str(tmp_path / "elsewhere")], "a resumed record stays where it is")
    assert not (tmp_path / "elsewhere").exists()


def test_a_failed_probe_writes_nothing(tmp_path: Path, capsys) -> None:
    """Found by review: a run that stopped at once still made --out and a lock file in it."""
    _refused(capsys, ["run", "--device", "sim:nope", "--out", str(tmp_path / "out")], "nope")
    assert not (tmp_path / "out").exists()


def test_a_suite_whose_library_is_missing_is_skipped_on_a_real_device(tmp_path: Path, monkeypatch) -> None:
    """Found by review: without PyTorch the pytorch suite's argument tests passed and the suite read as passed."""
    from hil import runner

    monkeypatch.setattr(runner, "missing_needs", lambda suite: ["torch"] if suite.name == "pytorch" else [])
    opts = runner.RunOptions(devices=["cuda:0"], out_dir=tmp_path, suites=["pytorch"], repo_root=REPO)
    (res,) = runner._run_suites(opts, "cuda:0", tmp_path)
    assert res["status"] == "skipped" and "torch not installed" in res["reason"]


def test_env_takes_one_device_and_says_its_error_in_one_line(capsys) -> None:
    assert main(["env", "--device", "sim:h200-141gb,sim:t4-16gb"]) == EXIT_BAD_INPUT
    assert "one device at a time" in capsys.readouterr().err
    assert main(["env", "--device", "sim:nope"]) == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "nope" in err


def test_the_summary_says_why_a_record_is_not_passed_and_which_commits_made_it() -> None:
    from hil.runner import render_markdown

    record = {"date": "2026-11-22T00:00:00+00:00", "status": "incomplete", "devices": [{"spec": SIM}],
              "results": {SIM: {"suites": [{"suite": "contract", "status": "passed", "passed": 1, "failed": 0,
                                            "skipped": 0, "errors": 0, "duration_s": 1.0, "skip_reasons": {},
                                            "failures": [], "reason": ""}],
                                "fidelity": {"status": "failed", "reason": "latency of x", "summary": ""}}},
              "runs": [{"git_commit": "aaa", "parts": ["suites"], "started_utc": "t", "finished_utc": "t", "command": "c"},
                       {"git_commit": "bbb", "parts": ["fidelity"], "started_utc": "t", "finished_utc": "t", "command": "c"}]}
    status_line = render_markdown(record).splitlines()[2]
    assert "suites not run: cuda_adapter" in status_line and "fidelity failed (latency of x)" in status_line
    assert "peers not run" in status_line
    assert "Made by 2 calls at 2 commits (aaa, bbb)" in render_markdown(record)


def test_child_logs_name_files_relative_to_the_checkout(tmp_path: Path) -> None:
    """The H200 record's logs named the device machine's checkout (pytest's warnings print absolute paths)."""
    code = "import os; print(os.path.join(os.getcwd(), 'tests', 'x.py') + ':1: a warning')"
    assert run_in_group([sys.executable, "-c", code], cwd=tmp_path, log_path=tmp_path / "log", env=None,
                        timeout_s=30) == 0
    assert (tmp_path / "log").read_text() == "tests/x.py:1: a warning\n"


# -- issue 20 items 8 and 9 ------------------------------------------------------------------------------------

def test_resume_of_dev_zero_and_of_a_fifo_is_refused_at_once(tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "rec.json"
    os.mkfifo(fifo)
    _refused(capsys, ["run", "--device", SIM, "--suites", "cupy", "--resume", str(fifo)], "not a regular file")
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    _refused(capsys, ["run", "--device", SIM, "--suites", "cupy", "--resume", str(link)], "not a regular file")


def test_resume_of_a_huge_file_is_refused_by_size(tmp_path: Path, capsys, monkeypatch) -> None:
    from hil import runner

    monkeypatch.setattr(runner, "MAX_RECORD_NBYTES", 1000)
    big = tmp_path / "big.json"
    big.write_text(" " * 5000 + "{}")
    _refused(capsys, ["run", "--device", SIM, "--suites", "cupy", "--resume", str(big)], "larger than any record")


def test_a_record_missing_what_the_summary_reads_is_refused_before_anything_runs(cupy_record: Path, capsys) -> None:
    record = json.loads(cupy_record.read_text())
    del record["devices"][0]["kind"]
    del record["date"]
    cupy_record.write_text(json.dumps(record))
    before = cupy_record.read_bytes()
    capsys.readouterr()
    _refused(capsys, ["run", "--device", SIM, "--suites", "cupy", "--parts", "suites", "--resume", str(cupy_record)],
             "the summary cannot be made of it")
    assert cupy_record.read_bytes() == before


def test_a_relative_out_is_the_callers_not_the_checkouts(tmp_path: Path, monkeypatch) -> None:
    """A relative --out given from outside the checkout sent the JUnit files into the checkout, and a suite of
    passing tests was recorded as an error."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--device", SIM, "--out", "rel", "--suites", "cupy", "--parts", "suites"]) in (0, 3)
    (path,) = (tmp_path / "rel").glob("hil-*.json")
    suites = json.loads(path.read_text())["results"][SIM]["suites"]
    assert suites and all(s["status"] != "error" for s in suites), suites
    assert not (REPO / "rel").exists()


@pytest.mark.parametrize("in_the_way", ["summary-folder", "logs-file"])
def test_resume_with_the_summary_or_logs_path_taken_is_refused_before_anything_runs(cupy_record: Path, capsys,
                                                                                    in_the_way: str) -> None:
    """issue 20 review: a folder at X.md ended the resumed run in an IsADirectoryError traceback after
    every suite had run; a file at X-logs in a FileExistsError one."""
    md, logs = cupy_record.with_suffix(".md"), cupy_record.with_name(cupy_record.stem + "-logs")
    if in_the_way == "summary-folder":
        md.unlink()
        md.mkdir()
    else:
        for p in logs.iterdir():
            p.unlink()
        logs.rmdir()
        logs.write_text("mine")
    before = cupy_record.read_bytes()
    capsys.readouterr()
    _refused(capsys, ["run", "--device", SIM, "--suites", "cupy", "--parts", "suites", "--resume", str(cupy_record)],
             "is in the way")
    assert cupy_record.read_bytes() == before
