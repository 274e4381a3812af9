"""The HIL runner (``python -m hil``): suite results, skips made visible, records, resume,
the no-GPU message, sanitizer logs and the GPU workflow file. Runs without a GPU."""

from __future__ import annotations

import json
import shlex
import textwrap
from pathlib import Path

import pytest

from hil.__main__ import build_parser, main
from hil.runner import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK, exit_code_of, overall_status, \
    render_markdown
from hil.sanitizer import CHILD_PROCESS_SUITES, MEMCHECK_SUITES, SanitizerTool, check_tools, parse_sanitizer_log, \
    sanitizer_prefix
from hil.suites import SUITES, Suite, SuiteStatus, TestCounts, parse_junit, run_suite, status_of, suite_named

REPO = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="6">
 <testcase classname="tests.contract.test_a" name="test_ok"/>
 <testcase classname="tests.contract.test_a" name="test_ok2"/>
 <testcase classname="tests.contract.test_a" name="test_skip1"><skipped type="pytest.skip" message="PyTorch is installed">x</skipped></testcase>
 <testcase classname="tests.contract.test_a" name="test_skip2"><skipped type="pytest.skip" message="tests/x.py:12: PyTorch is installed">x</skipped></testcase>
 <testcase classname="tests.contract.test_b" name="test_bad"><failure message="assert 1 == 2&#10;more">tb</failure></testcase>
 <testcase classname="tests.contract.test_b" name="test_err"><error message="fixture 'device' broke">tb</error></testcase>
</testsuite></testsuites>
"""


# -- JUnit parsing and suite status ------------------------------------------------------------------------------
def test_parse_junit_counts_reasons_and_failures(tmp_path: Path) -> None:
    path = tmp_path / "r.xml"
    path.write_text(JUNIT)
    counts = parse_junit(path)
    assert (counts.passed, counts.failed, counts.skipped, counts.errors) == (2, 1, 2, 1)
    assert counts.skip_reasons == {"PyTorch is installed": 2}  # "path:line: reason" grouped with the bare reason
    assert counts.failures == ["tests.contract.test_b::test_bad: assert 1 == 2",
                               "tests.contract.test_b::test_err (error): fixture 'device' broke"]


@pytest.mark.parametrize("text", ["not xml at all", "<html><body/></html>", ""])
def test_parse_junit_refuses_what_is_not_junit(tmp_path: Path, text: str) -> None:
    path = tmp_path / "r.xml"
    path.write_text(text)
    with pytest.raises(ValueError, match="JUnit XML"):
        parse_junit(path)


@pytest.mark.parametrize("counts, exit_code, expected", [
    (TestCounts(passed=3), 0, SuiteStatus.PASSED),
    (TestCounts(passed=3, skipped=2, skip_reasons={"r": 2}), 0, SuiteStatus.PASSED),
    (TestCounts(skipped=4, skip_reasons={"no torch": 4}), 0, SuiteStatus.SKIPPED),  # skipped is never passed
    (TestCounts(), 5, SuiteStatus.ERROR),                                           # nothing collected
    (TestCounts(passed=3, failed=1), 1, SuiteStatus.FAILED),
    (TestCounts(passed=3, errors=1), 1, SuiteStatus.FAILED),
    (TestCounts(passed=3), 3, SuiteStatus.ERROR),                                   # pytest crashed after the tests
])
def test_status_of(counts: TestCounts, exit_code: int, expected: SuiteStatus) -> None:
    assert status_of(counts, exit_code)[0] is expected


def test_every_suite_path_exists_and_suites_are_named_uniquely() -> None:
    names = [s.name for s in SUITES]
    assert len(names) == len(set(names))
    for suite in SUITES:
        for path in (*suite.paths, *suite.ignore):
            assert (REPO / path).exists(), f"suite {suite.name}: {path} is missing"
    with pytest.raises(ValueError, match="the suites are: contract"):
        suite_named("nope")


# the fake suites lie outside the checkout, away from tests/conftest.py: where gpumem is not installed
# (PYTHONPATH=. pytest), their conftest registers the plugin as that one does, or --gpumem-device is unknown
_FAKE_CONFTEST = """
def pytest_addoption(parser, pluginmanager):
    import gpumem.testing

    if not pluginmanager.is_registered(gpumem.testing) and not pluginmanager.is_blocked("gpumem_hil"):
        pluginmanager.register(gpumem.testing, "gpumem_hil")
"""


def _write_tests(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "conftest.py").write_text(_FAKE_CONFTEST)
    path = folder / "test_fake.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_run_suite_reports_a_failing_test(tmp_path: Path) -> None:
    path = _write_tests(tmp_path / "t", """
        def test_ok():
            pass

        def test_bad():
            assert 1 == 2, "the figure is off"
    """)
    res = run_suite(Suite("fake", "a failing suite", (str(path),)), "sim:t4-16gb", repo_root=REPO,
                    log_dir=tmp_path / "logs", timeout_s=300)
    assert res.status is SuiteStatus.FAILED
    assert (res.passed, res.failed) == (1, 1)
    assert any("test_bad" in f and "the figure is off" in f for f in res.failures)
    assert (tmp_path / "logs" / res.log).exists()


def test_run_suite_kills_a_suite_past_its_time(tmp_path: Path) -> None:
    path = _write_tests(tmp_path / "t", """
        import time

        def test_hangs():
            time.sleep(120)
    """)
    res = run_suite(Suite("slow", "hangs", (str(path),)), "sim:t4-16gb", repo_root=REPO, log_dir=tmp_path / "logs",
                    timeout_s=3)
    assert res.status is SuiteStatus.ERROR
    assert "timed out after 3 s" in res.reason


# -- the command line ---------------------------------------------------------------------------------------------
def test_run_on_a_simulator_shows_skipped_suites_and_parts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The CuPy suite skips entirely on a simulated device: the record says skipped, never passed, and the
    parts that need a real GPU are skipped too (exit 3, status incomplete)."""
    rc = main(["run", "--device", "sim:t4-16gb", "--out", str(tmp_path), "--suites", "cupy",
               "--parts", "suites,peers,sanitizer"])
    assert rc == EXIT_INCOMPLETE
    (json_path,) = tmp_path.glob("hil-sim-tesla-t4-*.json")
    record = json.loads(json_path.read_text())
    assert record["record"] == "gpumem-hil-record" and record["status"] == "incomplete"
    (suite,) = record["results"]["sim:t4-16gb"]["suites"]
    assert suite["suite"] == "cupy" and suite["status"] == "skipped" and suite["passed"] == 0
    assert suite["skip_reasons"]
    assert record["results"]["sim:t4-16gb"]["peers"]["status"] == "skipped"
    assert "fidelity" not in record["results"]["sim:t4-16gb"]
    md = json_path.with_suffix(".md").read_text()
    assert "| cupy | *skipped* | 0 |" in md
    assert "## Simulator fidelity on `sim:t4-16gb`\n\n*not run*" in md
    assert record["devices"][0]["versions"]["python"]
    assert record["runs"][0]["command"].startswith("python -m hil run --device sim:t4-16gb")


def test_resume_adds_parts_to_a_record(tmp_path: Path) -> None:
    assert main(["run", "--device", "sim:t4-16gb", "--out", str(tmp_path), "--suites", "cupy",
                 "--parts", "peers"]) == EXIT_INCOMPLETE
    (first,) = tmp_path.glob("hil-*.json")
    assert main(["run", "--device", "sim:t4-16gb", "--suites", "cupy", "--parts", "fidelity",
                 "--resume", str(first)]) == EXIT_INCOMPLETE
    assert sorted(p.name for p in tmp_path.glob("hil-*.json")) == [first.name]  # the same record, added to
    record = json.loads(first.read_text())
    parts = record["results"]["sim:t4-16gb"]
    assert parts["peers"]["status"] == "skipped" and parts["fidelity"]["status"] == "skipped"
    assert [r["parts"] for r in record["runs"]] == [["peers"], ["fidelity"]]


def test_resume_refuses_another_devices_record_and_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--device", "sim:t4-16gb", "--out", str(tmp_path), "--parts", "peers"]) == EXIT_INCOMPLETE
    (first,) = tmp_path.glob("hil-*.json")
    before = first.read_text()
    capsys.readouterr()
    assert main(["run", "--device", "sim:a100-80gb", "--parts", "peers", "--resume", str(first)]) == EXIT_BAD_INPUT
    assert "that record is of sim:t4-16gb" in capsys.readouterr().err
    assert first.read_text() == before  # unchanged
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["run", "--device", "sim:t4-16gb", "--parts", "peers", "--resume", str(bad)]) == EXIT_BAD_INPUT
    assert "not JSON" in capsys.readouterr().err
    bad.write_text('{"record": "something else"}')
    assert main(["run", "--device", "sim:t4-16gb", "--parts", "peers", "--resume", str(bad)]) == EXIT_BAD_INPUT
    assert "not a gpumem HIL record" in capsys.readouterr().err
    assert main(["run", "--device", "sim:t4-16gb", "--parts", "peers", "--resume",
                 str(tmp_path / "missing.json")]) == EXIT_BAD_INPUT
    assert "cannot read it" in capsys.readouterr().err


def _has_cuda() -> bool:
    try:
        import gpumem

        with gpumem.open_device("cuda:0"):
            return True
    except Exception:  # noqa: BLE001 - any failure means no usable GPU here
        return False


def test_without_a_gpu_it_stops_at_once_with_one_message(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    if _has_cuda():
        pytest.skip("this machine has a GPU")
    rc = main(["run", "--device", "cuda:0", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln[:2].isdigit()]  # not the log's timestamped lines
    assert len(lines) == 1, err
    assert "cannot open cuda:0" in lines[0] and "--device sim:h200-141gb" in lines[0]
    assert "Traceback" not in err
    assert not list(tmp_path.glob("hil-*"))  # nothing written


@pytest.mark.parametrize("argv, message", [
    (["run", "--device", "gpu0"], "not a device spec"),
    (["run", "--device", "cuda:0", "--suites", "contract,bogus"], "unknown suite 'bogus'"),
    (["run", "--device", "cuda:0", "--parts", "suites,lunch"], "unknown part 'lunch'"),
    (["run", "--device", "cuda:0", "--sanitizer", "memcheck,initcheck"], "unknown compute-sanitizer tool 'initcheck'"),
    (["run", "--device", "cuda:0", "--repeat", "0"], "must be from 1 to 100"),
    (["run", "--device", "cuda:0", "--suite-timeout", "nan"], "positive number of seconds"),
    (["run"], "--device"),
])
def test_bad_arguments_exit_2_naming_the_problem(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_every_suite(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for suite in SUITES:
        assert suite.name in out
    assert "exit status" in out


def test_help_lists_the_exit_statuses_docs_hil_md_lists(capsys: pytest.CaptureFixture) -> None:
    """``--help`` and docs/hil.md name the same exit statuses (the help once left out SIGTERM's and SIGHUP's)."""
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    doc = (Path(__file__).resolve().parents[2] / "docs" / "hil.md").read_text(encoding="utf-8")
    doc = " ".join(doc[doc.index("Exit status"):].split("\n\n")[0].split())
    for code in ("0", "1", "2", "3", "130", "143", "129"):
        assert f" {code} " in doc, code
        assert f" {code} " in help_text, f"python -m hil run --help does not give exit status {code}"


# -- overall status and exit codes --------------------------------------------------------------------------------
def _record(suite_statuses: list[str], **parts: str) -> dict:
    """A record of these suite statuses; every other suite of SUITES passed."""
    from hil.suites import SUITES

    suite_statuses = suite_statuses + ["passed"] * (len(SUITES) - len(suite_statuses))
    suites = [{"suite": SUITES[i].name if i < len(SUITES) else f"s{i}", "status": s, "passed": 1, "failed": 0, "skipped": 0, "errors": 0, "duration_s": 1.0,
               "reason": "", "failures": [], "skip_reasons": {}} for i, s in enumerate(suite_statuses)]
    results = {"suites": suites, **{k: {"status": v, "summary": "", "markdown": ""} for k, v in parts.items()}}
    return {"devices": [{"spec": "cuda:0"}], "results": {"cuda:0": results}}


def test_overall_status_and_exit_codes() -> None:
    from hil.runner import Part

    every = {"peers": "passed", "fidelity": "passed", "sanitizer": "passed"}
    assert overall_status(_record(["passed", "passed"], **every)) == "passed"
    assert overall_status(_record(["passed", "skipped"], **every)) == "incomplete"
    assert overall_status(_record(["passed"], peers="passed", fidelity="passed")) == "incomplete"  # sanitizer not run
    assert overall_status(_record(["passed", "skipped"], **{**every, "fidelity": "failed"})) == "failed"
    assert overall_status(_record(["error"], **every)) == "failed"
    rec = _record(["passed"], peers="passed")
    assert exit_code_of(rec, [Part.SUITES, Part.PEERS]) == EXIT_OK  # what this call ran passed
    assert exit_code_of(rec, [Part.SUITES, Part.FIDELITY]) == EXIT_INCOMPLETE
    assert exit_code_of(_record(["failed"], peers="passed"), [Part.PEERS, Part.SUITES]) == EXIT_FAILED


def test_markdown_shows_failures_and_reasons() -> None:
    rec = _record(["failed"], peers="error")
    rec["results"]["cuda:0"]["suites"][0].update(failures=["tests/x.py::test_y: boom"], reason="1 failed, 0 errors",
                                                  skip_reasons={"PyTorch is installed": 1})
    rec["results"]["cuda:0"]["peers"]["reason"] = "python -m hil.peers exited with status 1"
    rec.update(date="2026-11-22T00:00:00+00:00", status="failed", runs=[])
    rec["devices"][0].update(name="NVIDIA H200", total_nbytes=150_109_880_320, versions={"python": "3.12"})
    md = render_markdown(rec)
    assert md.splitlines()[2].startswith("Status: **FAILED**")
    assert "`tests/x.py::test_y: boom`" in md
    assert "PyTorch is installed (1)" in md
    assert "Reason: python -m hil.peers exited with status 1" in md


# -- compute-sanitizer ----------------------------------------------------------------------------------------------
SANITIZER_LOG = """\
========= COMPUTE-SANITIZER
========= ERROR SUMMARY: 0 errors
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 8 bytes
=========     at slow_sum+0x120
=========     by thread (3,0,0) in block (0,0,0)
========= Invalid __global__ read of size 8 bytes
========= ERROR SUMMARY: 32 errors
"""


def test_parse_sanitizer_log_sums_every_process() -> None:
    f = parse_sanitizer_log(SANITIZER_LOG)
    assert (f.processes, f.errors) == (2, 32)
    assert f.first_reports[0] == "Invalid __global__ read of size 8 bytes"


def test_parse_sanitizer_log_racecheck_and_unfinished() -> None:
    f = parse_sanitizer_log("========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n")
    assert f.errors == 1
    with pytest.raises(ValueError, match="did not finish"):
        parse_sanitizer_log("========= COMPUTE-SANITIZER\nSegmentation fault\n")  # no summary: never read as 0


def test_sanitizer_prefix_turns_api_errors_off_only_for_memcheck(tmp_path: Path) -> None:
    mem = sanitizer_prefix("compute-sanitizer", SanitizerTool.MEMCHECK, tmp_path / "m.log")
    race = sanitizer_prefix("compute-sanitizer", SanitizerTool.RACECHECK, tmp_path / "r.log")
    assert mem[mem.index("--tool") + 1] == "memcheck" and "--report-api-errors" in mem
    assert "--report-api-errors" not in race and "application-only" in race  # Note [Which processes are checked]
    assert check_tools(["memcheck", "memcheck", "racecheck"]) == [SanitizerTool.MEMCHECK, SanitizerTool.RACECHECK]


# -- the GPU runner's workflow ----------------------------------------------------------------------------------------
def test_the_workflow_runs_the_runner_with_valid_arguments() -> None:
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "hil.yml").read_text())
    (job,) = workflow["jobs"].values()
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    commands = [line.strip() for step in job["steps"] for line in str(step.get("run", "")).splitlines()]
    (run_line,) = [c for c in commands if c.startswith("python -m hil run")]
    args = build_parser().parse_args(shlex.split(run_line)[3:])  # what the runner will be given parses
    assert args.device == ["cuda:0"]
    upload = [s for s in job["steps"] if "upload-artifact" in str(s.get("uses", ""))]
    assert upload and upload[0]["with"]["path"].rstrip("/") == str(args.out).rstrip("/")
    assert upload[0].get("if") == "always()"  # the record is kept when the run fails


def test_a_program_without_cuda_calls_is_nothing_checked_not_zero_errors() -> None:
    f = parse_sanitizer_log("========= COMPUTE-SANITIZER\n========= Error: Target application terminated before "
                            "first instrumented API call\n")
    assert (f.processes, f.errors) == (0, 0)  # the runner shows that run as skipped, not as a clean check


def test_suites_working_in_child_processes_have_their_children_checked(tmp_path: Path) -> None:
    # the engine and pytorch suites do their CUDA work in child processes; checking only pytest found
    # nothing to check there on the H200 (Note [Which processes are checked])
    assert set(CHILD_PROCESS_SUITES) == {"engine", "pytorch"} and set(CHILD_PROCESS_SUITES) <= set(MEMCHECK_SUITES)
    prefix = sanitizer_prefix("compute-sanitizer", SanitizerTool.MEMCHECK, tmp_path / "m.log", children=True)
    assert prefix[prefix.index("--target-processes") + 1] == "all"
    assert prefix[prefix.index("--launch-timeout") + 1] == "0"  # a child that takes long to start is still checked
    # the compiler child made no CUDA call, the check program did: one process checked, not zero
    log = ("========= COMPUTE-SANITIZER\n========= Error: Target application terminated before first instrumented "
           "API call\n========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n")
    f = parse_sanitizer_log(log)
    assert (f.processes, f.errors) == (1, 0)


def _fake_sanitizer(tmp_path: Path, log_text: str | None) -> str:
    """A stand-in for compute-sanitizer that writes ``log_text`` to its ``--log-file`` (nothing when None)."""
    exe = tmp_path / "compute-sanitizer"
    body = "" if log_text is None else f"cat > \"$log\" <<'EOF'\n{log_text}EOF\n"
    exe.write_text("#!/bin/sh\nlog=''\nwhile [ $# -gt 0 ]; do\n  if [ \"$1\" = --log-file ]; then log=\"$2\"; fi\n"
                   "  shift\ndone\n" + body)
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize("log_text, status", [
    ("========= ERROR SUMMARY: 32 errors\n", "passed"),  # the tool saw the child's invalid reads
    ("========= ERROR SUMMARY: 0 errors\n", "failed"),  # it did not: a clean child run would prove nothing
    (None, "error"),  # no log at all
])
def test_the_sanitizer_control_must_see_the_childs_errors(tmp_path: Path, log_text: str | None, status: str) -> None:
    from hil.runner import RunOptions, _run_control

    opts = RunOptions(devices=["cuda:0"], out_dir=tmp_path, repo_root=REPO)
    control = _run_control(_fake_sanitizer(tmp_path, log_text), opts, "cuda:0", tmp_path)
    assert control["status"] == status, control
    assert (control["errors"] == 32) if status == "passed" else control["reason"]


def test_a_failed_control_fails_the_sanitizer_part_in_the_summary(tmp_path: Path) -> None:
    from hil.runner import render_markdown

    run = {"tool": "memcheck", "suite": "pytorch", "status": "passed", "errors": 0, "processes": 1,
           "tests": {"passed": 7, "failed": 0, "skipped": 0}, "first_reports": []}
    control = {"status": "failed", "errors": 0, "reason": "memcheck counted no error"}
    record = _record(["passed"], peers="passed", fidelity="passed")
    record["results"]["cuda:0"]["sanitizer"] = {"status": "failed", "summary": "1 sanitizer runs, 0 errors",
                                                "reason": "control: memcheck counted no error", "runs": [run],
                                                "control": control}
    record.update(date="2026-11-22T00:00:00+00:00", status=overall_status(record), runs=[])
    md = render_markdown(record)
    assert "| memcheck | pytorch | passed | 0 | yes, with children | 7 / 0 / 0 |" in md
    assert "counted 0 errors: **FAILED** (memcheck counted no error)" in md
    assert overall_status(record) == "failed"


def test_memcheck_runs_only_suites_that_make_cuda_calls() -> None:
    from hil.runner import RunOptions, _sanitizer_suites

    opts = RunOptions(devices=["cuda:0"], out_dir=Path("x"))
    assert "cuda_adapter" not in _sanitizer_suites(opts, SanitizerTool.MEMCHECK)
    assert _sanitizer_suites(opts, SanitizerTool.RACECHECK) == ["allocator", "cupy"]
    opts.sanitizer_suites = ["cuda_adapter", "contract"]  # asked for by name: run
    assert _sanitizer_suites(opts, SanitizerTool.MEMCHECK) == ["cuda_adapter", "contract"]


def test_parse_sanitizer_log_on_real_memcheck_output() -> None:
    """Found by review on the project's own H200 log: 'ERROR SUMMARY: 27 errors were not printed' was read as
    a second process with 27 more errors, and 'Warp illegal address' reports were not listed."""
    text = (REPO / "reports" / "hil" / "inflight-sanitizer-h200-2026-11-22.log").read_text()
    f = parse_sanitizer_log(text)
    assert (f.processes, f.errors) == (4, 64)  # two clean runs, two with 32 errors each
    assert f.first_reports and f.first_reports[0] == "Warp illegal address"


@pytest.mark.parametrize("log, errors", [
    ("========= ERROR SUMMARY: 0 errors\n========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n", 2),
    ("========= ERROR SUMMARY: 0 errors\n========= Invalid __global__ read of size 8 bytes\n=========     at k+0x10\n", 1),
    ("========= COMPUTE-SANITIZER\n========= Error: Target application terminated before first instrumented API "
     "call\n========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n", 0),
])
def test_parse_sanitizer_log_never_reads_fewer_errors_than_listed(log: str, errors: int) -> None:
    assert parse_sanitizer_log(log).errors == errors


def test_an_internal_sanitizer_error_is_not_a_clean_run() -> None:
    with pytest.raises(ValueError, match="cannot be trusted"):
        parse_sanitizer_log("========= Internal Sanitizer Error: x\n========= ERROR SUMMARY: 0 errors\n")


def test_resume_of_a_record_named_md_never_overwrites_it(tmp_path: Path) -> None:
    """issue 20 item 8: ``--resume X.md`` wrote the Markdown summary over the JSON record it resumed."""
    assert main(["run", "--device", "sim:t4-16gb", "--out", str(tmp_path), "--suites", "cupy",
                 "--parts", "peers"]) == EXIT_INCOMPLETE
    (first,) = tmp_path.glob("hil-*.json")
    x = tmp_path / "X.md"
    first.rename(x)
    assert main(["run", "--device", "sim:t4-16gb", "--suites", "cupy", "--parts", "fidelity",
                 "--resume", str(x)]) == EXIT_INCOMPLETE
    record = json.loads(x.read_text())  # still the JSON record, with both calls in it
    assert [r["parts"] for r in record["runs"]] == [["peers"], ["fidelity"]]
    assert (tmp_path / "X.md.summary.md").read_text().startswith("#")


def _first_record(tmp_path: Path) -> Path:
    assert main(["run", "--device", "sim:t4-16gb", "--out", str(tmp_path), "--suites", "cupy",
                 "--parts", "peers"]) == EXIT_INCOMPLETE
    (first,) = tmp_path.glob("hil-*.json")
    return first


@pytest.mark.parametrize("damage", ["reason", "passed", "failures", "skip_reasons", "duration_s", "finished_utc",
                                    "passed-as-text"])
def test_resume_refuses_a_record_missing_what_the_summary_reads(tmp_path: Path, damage: str,
                                                                capsys: pytest.CaptureFixture) -> None:
    """issue 20 item 9: a record missing fields passed the shape check and crashed the summary after the
    suites ran; now refused before anything runs, the record unchanged."""
    first = _first_record(tmp_path)
    record = json.loads(first.read_text())
    suite = {"suite": "contract", "device": "sim:t4-16gb", "status": "passed", "passed": 204, "failed": 0,
             "skipped": 0, "errors": 0, "duration_s": 12.5, "skip_reasons": {}, "failures": [], "exit_code": 0,
             "reason": "", "log": "contract-sim-t4-16gb.log", "sanitizer": None}
    record["results"]["sim:t4-16gb"]["suites"] = [suite]
    if damage == "reason":  # the undamaged record is taken (a control)
        first.write_text(json.dumps(record))
        assert main(["run", "--device", "sim:t4-16gb", "--suites", "cupy", "--parts", "peers",
                     "--resume", str(first)]) == EXIT_INCOMPLETE
        record = json.loads(first.read_text())
        suite = record["results"]["sim:t4-16gb"]["suites"][0]
    if damage == "finished_utc":
        del record["runs"][0]["finished_utc"]
    elif damage == "passed-as-text":
        suite["passed"] = "204"
    else:
        del suite[damage]
    first.write_text(json.dumps(record))
    before = first.read_text()
    capsys.readouterr()
    assert main(["run", "--device", "sim:t4-16gb", "--suites", "cupy", "--parts", "fidelity",
                 "--resume", str(first)]) == EXIT_BAD_INPUT
    assert "a damaged record" in capsys.readouterr().err
    assert first.read_text() == before


def test_resume_refuses_dev_zero_a_fifo_and_a_huge_file_without_reading_them(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """issue 20 item 9: ``--resume /dev/zero`` read without bound and a FIFO blocked for ever."""
    import os
    from hil import runner
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo), str(tmp_path)):
        assert main(["run", "--device", "sim:t4-16gb", "--parts", "peers", "--resume", path]) == EXIT_BAD_INPUT
        assert "not a regular file" in capsys.readouterr().err
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(runner.MAX_RECORD_NBYTES + 1)
    assert main(["run", "--device", "sim:t4-16gb", "--parts", "peers", "--resume", str(huge)]) == EXIT_BAD_INPUT
    assert "larger than any record" in capsys.readouterr().err


def test_a_relative_out_from_outside_the_checkout_holds_the_junit_and_counts_the_tests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 20 item 9: from outside the checkout a relative log folder sent the JUnit file into the
    checkout (pytest runs there) and the passing suite was recorded as an error."""
    monkeypatch.chdir(tmp_path)
    res = run_suite(Suite("units", "the units tests", ("tests/test_units.py",)), "sim:t4-16gb", repo_root=REPO,
                    log_dir=Path("logs"), timeout_s=300)
    assert res.status is SuiteStatus.PASSED and res.passed > 0, res.reason
    assert (tmp_path / "logs" / res.log).exists() and not (REPO / "logs").exists()
