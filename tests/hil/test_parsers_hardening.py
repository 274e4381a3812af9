"""Reviewer-found bugs in the HIL harness's parsers and the peer benchmark, each pinned: compute-sanitizer
logs read as the tool printed them, JUnit testcases with several outcomes, a peer benchmark that measured
nothing, non-finite timeouts, and a timed-out worker's whole process group. Runs without a GPU."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hil import peers
from hil.sanitizer import parse_sanitizer_log
from hil.suites import SuiteStatus, TestCounts, parse_junit, status_of

REPO = Path(__file__).resolve().parents[2]
REAL_LOG = REPO / "reports" / "hil" / "inflight-sanitizer-h200-2026-11-22.log"
SMALL_TRACE = REPO / "data" / "traces" / "resnet_train.rmm_log.csv.gz"


# -- compute-sanitizer logs ------------------------------------------------------------------------------------------
def test_real_memcheck_log_counts_each_process_once() -> None:
    """'ERROR SUMMARY: 27 errors were not printed ...' follows 'ERROR SUMMARY: 32 errors' and is no summary."""
    f = parse_sanitizer_log(REAL_LOG.read_text())
    assert f.processes == 4          # steal/release, each without and with --old
    assert f.errors == 64            # 32 + 32, not 32 + 27 + 32 + 27
    assert f.first_reports == ["Warp illegal address"] * 5
    assert not any(r.startswith(("at ", "by thread", "Saved host", "Host Frame")) for r in f.first_reports)


@pytest.mark.parametrize("header", [
    "Warp illegal address",
    "Invalid __global__ read of size 8 bytes",
    "Invalid __shared__ write of size 4 bytes",
    "Lane user stack overflow",
    "Out-of-range Shared or Local Address",
    "Address 0x7f0000000000 is out of bounds",
    "Error: Race reported between Write access at k+0x10 and Read access at k+0x20 [8 hazards]",
    "ERROR: Potential WAW hazard detected at __shared__ 0x0 in block (0,0,0) :",
    "Uninitialized __global__ memory read of size 4 bytes",
    "Barrier error detected. Divergent thread(s) in warp",
    "Malloc/Free error encountered : Double free",
    "Leaked 1024 bytes at 0x7f0000000000",
])
def test_report_headers_are_listed_and_counted(header: str) -> None:
    log = f"========= COMPUTE-SANITIZER\n========= {header}\n=========     at k+0x10\n" \
          f"=========     by thread (0,0,0) in block (0,0,0)\n=========     Address 0x10 is out of bounds\n" \
          f"=========     Saved host backtrace up to driver entry point at kernel launch time\n" \
          f"=========         Host Frame: main in x.py:1\n========= \n========= ERROR SUMMARY: 1 error\n"
    f = parse_sanitizer_log(log)
    assert f.first_reports == [header]   # the header, none of the indented detail lines
    assert (f.processes, f.errors) == (1, 1)


@pytest.mark.parametrize("line", [
    "Error: Target application terminated before first instrumented API call",
    "Error: No attachable process found. compute-sanitizer timed-out.",
    "Error: process didn't terminate successfully",
    "Target application returned an error",
    "COMPUTE-SANITIZER",
])
def test_the_tools_own_lines_are_not_reports(line: str) -> None:
    f = parse_sanitizer_log(f"========= COMPUTE-SANITIZER\n========= {line}\n========= ERROR SUMMARY: 0 errors\n")
    assert (f.errors, f.first_reports) == (0, [])


def test_race_errors_are_not_dropped_when_an_error_summary_is_there_too() -> None:
    log = ("========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)\n"
           "========= ERROR SUMMARY: 0 errors\n"
           "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n"
           "========= ERROR SUMMARY: 0 errors\n")
    assert parse_sanitizer_log(log).errors == 3  # max(0, 2 + 1)
    log = "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n========= ERROR SUMMARY: 4 errors\n"
    assert parse_sanitizer_log(log).errors == 4  # max(4, 1)


def test_a_listed_report_is_never_read_as_zero_errors() -> None:
    after = "========= Invalid __global__ read of size 8 bytes\n=========     at k+0x10\n"
    assert parse_sanitizer_log("========= ERROR SUMMARY: 0 errors\n" + after).errors == 1
    # a report after the last summary belongs to a process whose summary never came: it adds to the count
    assert parse_sanitizer_log(REAL_LOG.read_text() + after).errors == 65
    before = "========= Warp illegal address\n=========     at k+0x10\n" * 2
    assert parse_sanitizer_log(before + "========= ERROR SUMMARY: 0 errors\n").errors == 2


def test_an_internal_sanitizer_error_raises() -> None:
    log = REAL_LOG.read_text().replace("========= ERROR SUMMARY: 0 errors",
                                       "========= Internal Sanitizer Error: The Sanitizer encountered an error\n"
                                       "========= ERROR SUMMARY: 0 errors", 1)
    with pytest.raises(ValueError, match="Internal Sanitizer Error"):
        parse_sanitizer_log(log)
    with pytest.raises(ValueError):
        parse_sanitizer_log("========= Internal Sanitizer Error: x\n")


# -- JUnit XML and suite status -------------------------------------------------------------------------------------
SKIP_THEN_TEARDOWN_ERROR = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="0" skipped="1" tests="2">
 <testcase classname="t" name="test_ok"/>
 <testcase classname="t" name="test_skip"><skipped type="pytest.skip" message="nope">x</skipped><error message="failed on teardown with &quot;RuntimeError: boom&quot;">tb</error></testcase>
</testsuite></testsuites>
"""


def test_a_skipped_test_whose_teardown_raised_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "j.xml"
    path.write_text(SKIP_THEN_TEARDOWN_ERROR)
    counts = parse_junit(path)
    assert (counts.passed, counts.skipped, counts.errors, counts.failed) == (1, 1, 1, 0)  # pytest: same
    assert counts.failures == ['t::test_skip (error): failed on teardown with "RuntimeError: boom"']
    assert status_of(counts, 1)[0] is SuiteStatus.FAILED


PYTEST_FILE = """
import pytest

@pytest.fixture
def bad():
    yield
    raise RuntimeError("teardown boom")

def test_skip_then_teardown_error(bad):
    pytest.skip("nope")

def test_pass_then_teardown_error(bad):
    pass

def test_fail_then_teardown_error(bad):
    assert 0

def test_ok():
    pass

def test_skip():
    pytest.skip("plain skip")

@pytest.fixture
def broken():
    raise RuntimeError("setup boom")

def test_setup_error(broken):
    pass
"""


def test_parse_junit_counts_what_pytest_reports(tmp_path: Path) -> None:
    """The counts of pytest's own JUnit XML are the counts of pytest's summary line."""
    (tmp_path / "test_mixed.py").write_text(textwrap.dedent(PYTEST_FILE))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    junit = tmp_path / "out.xml"
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}",
                          "test_mixed.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout[-2000:]
    said = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", res.stdout.splitlines()[-1])}
    expected = (said.get("passed", 0), said.get("failed", 0), said.get("skipped", 0),
                said.get("errors", said.get("error", 0)))
    counts = parse_junit(junit)
    assert (counts.passed, counts.failed, counts.skipped, counts.errors) == expected == (2, 1, 2, 4)
    assert status_of(counts, res.returncode)[0] is SuiteStatus.FAILED


@pytest.mark.parametrize("exit_code, expected", [
    (1, SuiteStatus.FAILED),    # pytest says tests failed or errored: never "every test skipped"
    (2, SuiteStatus.ERROR),     # interrupted
    (3, SuiteStatus.ERROR),     # internal error
    (0, SuiteStatus.SKIPPED),   # the contract for a clean all-skipped run is kept
    (None, SuiteStatus.SKIPPED),
])
def test_an_all_skipped_suite_with_a_failing_exit_code_is_not_skipped(exit_code: int | None,
                                                                      expected: SuiteStatus) -> None:
    status, reason = status_of(TestCounts(skipped=3, skip_reasons={"no torch": 3}), exit_code)
    assert status is expected
    if exit_code:
        assert f"status {exit_code}" in reason


# -- the peer benchmark ---------------------------------------------------------------------------------------------
def test_gpumem_missing_is_a_failed_benchmark_not_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(peers.FAKE_ENV, "missing:gpumem")
    out = peers.run_benchmark("cuda:0", [SMALL_TRACE], ["gpumem", "cupy-pool"], 1, 5)
    assert out["status"] == "failed"
    assert "gpumem itself is unavailable" in out["reason"] and peers.FAKE_ENV in out["reason"]


def test_nothing_measured_is_skipped_not_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(peers.FAKE_ENV, "missing:cupy-pool")
    out = peers.run_benchmark("cuda:0", [SMALL_TRACE], ["cupy-pool"], 1, 60)
    assert out["status"] == "skipped" and "nothing measured" in out["reason"]
    assert "0 measured" in out["summary"]
    out = peers.run_benchmark("cuda:0", [], ["gpumem"], 1, 60)
    assert out["status"] == "skipped" and "nothing measured" in out["reason"]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e7", "1e309", "0", "-5", "soon"])
def test_non_finite_or_absurd_timeouts_are_refused_in_one_line(value: str, capsys: pytest.CaptureFixture) -> None:
    assert peers.main(["--device", "cuda:0", "--peers", "gpumem", f"--timeout-s={value}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--timeout-s" in err and "Traceback" not in err


def test_timeout_inf_on_the_command_line_exits_2_with_one_line() -> None:
    res = subprocess.run([sys.executable, "-m", "hil.peers", "--device", "cuda:0", "--peers", "gpumem",
                          "--timeout-s", "inf"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "--timeout-s" in res.stderr
    assert "OverflowError" not in res.stderr and res.stdout == ""


def test_a_timed_out_worker_leaves_no_process_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The hang fake starts a hanging child of its own; the whole process group goes on the timeout."""
    trace = tmp_path / "orphan-check-trace.rmm_log.csv.gz"  # a path of its own: pgrep finds this test's workers only
    shutil.copy(SMALL_TRACE, trace)
    monkeypatch.setenv(peers.FAKE_ENV, "hang:cupy-pool")
    cell, _ = peers.run_cell("cupy-pool", trace, "cuda:0", 1, timeout_s=3)
    assert cell.status == "failed" and "timed out after 3 s" in cell.reason
    pattern = "hil.peers --worker .*" + re.escape(str(trace))
    deadline = time.monotonic() + 5
    while True:
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in found:  # never leave them behind, even when the check fails
        subprocess.run(["kill", "-9", pid], capture_output=True)
    assert found == [], f"orphan workers survived the timeout: {found}"
