"""The CuPy-suite HIL runner (hil/cupy_suite.py) without a GPU: its plugin over a fake CuPy, the deal, the diff."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hil import cupy_suite as cs

REPO = Path(__file__).resolve().parents[2]


def _report(when, outcome, xfail=False):
    r = types.SimpleNamespace(when=when, passed=outcome == "passed", failed=outcome == "failed",
                              skipped=outcome == "skipped")
    if xfail:
        r.wasxfail = "reason"
    return r


@pytest.mark.parametrize("phases,expected", [
    ([("setup", "passed"), ("call", "passed"), ("teardown", "passed")], "passed"),
    ([("setup", "skipped"), ("teardown", "passed")], "skipped"),
    ([("setup", "failed"), ("teardown", "passed")], "error"),
    ([("setup", "passed"), ("call", "failed"), ("teardown", "passed")], "failed"),
    ([("setup", "passed"), ("call", "failed"), ("teardown", "failed")], "error"),
    ([("setup", "passed"), ("call", "passed"), ("teardown", "failed")], "error"),
])
def test_the_phases_fold_into_one_outcome(phases, expected):
    out = None
    for when, o in phases:
        out = cs.fold_outcome(out, _report(when, o))
    assert out == expected


def test_expected_failures_are_their_own_outcomes():
    assert cs.fold_outcome("passed", _report("call", "skipped", xfail=True)) == "xfailed"
    assert cs.fold_outcome("passed", _report("call", "passed", xfail=True)) == "xpassed"


def test_the_deal_is_balanced_deterministic_and_complete(tmp_path):
    folder = tmp_path / "tests" / "cupy_tests" / "x_tests"
    folder.mkdir(parents=True)
    for k, size in enumerate([900, 500, 400, 300, 200, 100]):
        (folder / f"test_{k}.py").write_text("#" * size)
    (folder / "helper.py").write_text("not a test file")
    deal = cs.deal_files(cs.folder_paths(tmp_path, ["x"]), 2)
    assert deal == cs.deal_files(cs.folder_paths(tmp_path, ["x_tests"]), 2)
    assert sorted(f.name for b in deal for f in b) == [f"test_{k}.py" for k in range(6)]
    sizes = [sum(f.stat().st_size for f in b) for b in deal]
    assert sizes == [1200, 1200]
    assert len(cs.deal_files(cs.folder_paths(tmp_path, ["x"]), 50)) == 6


def test_a_missing_folder_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="is not a folder of CuPy's tests"):
        cs.folder_paths(tmp_path, ["creation"])
    assert cs.main(["--tests", str(tmp_path), "--out", str(tmp_path / "o"), "--folders", "creation"]) == 2
    assert cs.main(["--tests", str(tmp_path), "--out", str(tmp_path / "o"), "--allocators", "rmm"]) == 2
    assert cs.main(["--tests", str(tmp_path), "--out", str(tmp_path / "o"), "--jobs", "0"]) == 2
    assert not (tmp_path / "o").exists()


def test_only_tests_both_runs_reached_are_compared():
    outcomes = {"cupy": {"a": "passed", "b": "failed", "c": "passed"}, "gpumem": {"a": "passed", "b": "passed"}}
    assert cs.diff(outcomes) == [("b", "failed", "passed")]
    assert cs.folder_of("tests/cupy_tests/sorting_tests/test_sort.py::T::test_x") == "sorting_tests"


FAKE_CUPY = '''
import types
class _Dev:
    def synchronize(self): pass
class _Pool:
    def used_bytes(self): return 0
    def total_bytes(self): return 1024
cuda = types.SimpleNamespace(Device=lambda *a: _Dev())
def get_default_memory_pool(): return _Pool()
'''

TESTS = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_pass(): pass
def test_fail(): assert False
def test_skip(): pytest.skip("no")
@pytest.mark.xfail(strict=True)
def test_xfail(): assert False
def test_error(broken): pass
'''


def test_the_plugin_records_each_outcome_and_the_end_of_the_worker(tmp_path):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "cupy.py").write_text(FAKE_CUPY)
    (tmp_path / "test_some.py").write_text(TESTS)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path / "fake")]))
    env[cs.ALLOCATOR_ENV] = "cupy"
    env[cs.OUT_ENV] = str(work)
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "hil.cupy_suite", "-p", "no:cacheprovider",
                           "test_some.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    outcomes, checks = cs.read_results(work)
    assert outcomes["cupy"] == {"test_some.py::test_pass": "passed", "test_some.py::test_fail": "failed",
                                "test_some.py::test_skip": "skipped", "test_some.py::test_xfail": "xfailed",
                                "test_some.py::test_error": "error"}
    assert outcomes["gpumem"] == {}
    assert [c["pool"] for c in checks["cupy"]] == [{"used_nbytes": 0, "total_nbytes": 1024}]
    assert checks["cupy"][0]["exitstatus"] == 1 and "check_error" not in checks["cupy"][0]
    text = cs.render(outcomes, checks, [], cs.diff(outcomes), {"date": "d", "cupy": "x", "tag": "t", "device": "dev",
                                                               "mode": "m", "deadline_s": 1, "wall_s": 1, "hook": "h"})
    assert "| test_some.py | cupy | 1 | 1 | 1 | 1 | 1 | 0 | 5 |" in text
    assert "| test_some.py | gpumem | 0 | 0 | 0 | 0 | 0 | 0 | 0 |" in text and "differs: 0" in text
    json.dumps(checks)
