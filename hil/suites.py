"""The device suites the HIL runner runs, and how one suite's pytest run becomes a result.

A *suite* is a named set of test files from gpumem's ``tests/`` folder that takes a device: the
runner (:mod:`hil.runner`) runs each in its own pytest process with ``--gpumem-device SPEC``,
reads the JUnit XML it writes, and keeps per-suite counts, the reasons of every skip and the first
line of every failure in a :class:`SuiteResult`.

Note [A skipped suite is not a passed one]
------------------------------------------
A suite whose tests all skipped (no PyTorch on the runner, a simulated device given to the PyTorch
suite, a missing compiler) has proved nothing, so its status is :attr:`SuiteStatus.SKIPPED`, shown as
such in the record and the summary, and it keeps the runner's overall status from ``passed``. Single
skips inside a suite that otherwise ran are normal (a test of "PyTorch missing" skips where PyTorch is
installed): the suite passes, and each reason is listed with its count, so nobody has to guess.
A pytest run that collected nothing, crashed, or ran past its time limit is
:attr:`SuiteStatus.ERROR`, never a pass.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import os
import re
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Sequence

from hil.process import run_in_group

__all__ = ["SUITES", "Suite", "SuiteResult", "SuiteStatus", "TestCounts", "parse_junit", "pytest_command",
           "run_suite", "slug", "suite_named"]


@dataclasses.dataclass(frozen=True)
class Suite:
    """A named set of test paths (relative to the repository root) that take a device."""

    name: str
    description: str
    paths: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    """Modules without which the suite's real-device tests all skip: on a real device a missing one makes the
    suite ``skipped`` (its argument and error-path tests alone would read as passed)."""


#: Every suite that takes a device, in the order they run.
SUITES: tuple[Suite, ...] = (
    Suite("contract", "the Device contract every backend keeps (errors, VMM, streams, mem_info)",
          ("tests/contract",)),
    Suite("cuda_adapter", "the CUDA adapter: CuPy, cuda-bindings VMM, NVML", ("tests/cuda_adapter",),
          ignore=("tests/cuda_adapter/test_cupy_integration.py",)),
    Suite("allocator", "the caching allocator on the device, a kernel reading freed memory included",
          ("tests/allocator",),
          ignore=("tests/allocator/test_native_differential.py", "tests/allocator/test_native_hardening.py")),
    Suite("engine", "the native engine: build, differential and hardening tests, the C++ CUDA backend check",
          ("tests/test_native_build.py", "tests/allocator/test_native_differential.py",
           "tests/allocator/test_native_hardening.py", "tests/pytorch/test_torch_cuda_backend.py")),
    Suite("managers", "memory managers: reserve, layers, tracker, fallback, pressure, multi-GPU, discovery",
          ("tests/managers",)),
    Suite("workspace", "workspace sizing and memory estimation", ("tests/workspace", "tests/estimate")),
    Suite("cupy", "CuPy allocating through gpumem", ("tests/cuda_adapter/test_cupy_integration.py",), needs=("cupy",)),
    Suite("pytorch", "PyTorch allocating through gpumem's native engine", ("tests/pytorch/test_torch_on_gpumem.py",),
          needs=("torch",)),
)


def missing_needs(suite: Suite) -> list[str]:
    """The modules of ``suite.needs`` that cannot be imported here (looked for, not imported: no CUDA call)."""
    import importlib.util

    return [m for m in suite.needs if importlib.util.find_spec(m) is None]


def suite_named(name: str) -> Suite:
    """The suite called ``name``; ``ValueError`` naming the known ones otherwise."""
    for suite in SUITES:
        if suite.name == name:
            return suite
    raise ValueError(f"unknown suite {name!r}; the suites are: {', '.join(s.name for s in SUITES)}")


class SuiteStatus(str, enum.Enum):
    """How a suite's run ended (Note [A skipped suite is not a passed one])."""

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    ERROR = "error"


@dataclasses.dataclass
class TestCounts:
    """What one pytest run's JUnit XML says."""

    __test__ = False  # not a pytest test class

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    skip_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.skipped + self.errors


@dataclasses.dataclass
class SuiteResult:
    """One suite on one device: counts, skip reasons, failures, and how the run ended."""

    suite: str
    device: str
    status: SuiteStatus
    passed: int
    failed: int
    skipped: int
    errors: int
    duration_s: float
    skip_reasons: dict[str, int]
    failures: list[str]
    exit_code: int | None
    command: str
    reason: str = ""
    log: str | None = None
    sanitizer: str | None = None

    def as_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["status"] = self.status.value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SuiteResult":
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["status"] = SuiteStatus(kwargs["status"])
        return cls(**kwargs)


def slug(text: str) -> str:
    """``NVIDIA H200`` → ``nvidia-h200``, ``cuda:0`` → ``cuda-0``: names for files."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def _first_line(text: str | None, limit: int = 240) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _skip_reason(message: str) -> str:
    """pytest writes ``path:line: reason`` for some skips: keep the reason, which groups across lines."""
    text = _first_line(message)
    head, sep, rest = text.partition(": ")
    if sep and (head.endswith(".py") or ".py:" in head):
        return rest
    return text


def parse_junit(path: Path) -> TestCounts:
    """Counts, skip reasons (with counts) and failures (``nodeid: first line``) of a JUnit XML file.

    Raises ``ValueError`` when the file is not JUnit XML (``ET.ParseError`` is a ``SyntaxError``)."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise ValueError(f"{path.name} is not valid JUnit XML: {exc}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"{path.name} is not JUnit XML (its root element is <{root.tag}>)")
    counts = TestCounts()
    reasons: collections.Counter[str] = collections.Counter()
    seen: set[str] = set()
    for case in root.iter("testcase"):
        nodeid = "::".join(x for x in (case.get("classname", ""), case.get("name", "")) if x)
        # a testcase can hold several outcomes: a test that skipped (or failed) and whose fixture teardown then
        # raised has <skipped/> (<failure/>) and <error/>; every one counts, as in pytest's own summary line
        # ("1 skipped, 1 error"), so an error or a failure is never hidden behind a skip
        outcomes = [child for child in case if child.tag in ("failure", "error", "skipped")]
        if not outcomes:
            counts.passed += 1
        elif (len(outcomes) == 1 and outcomes[0].tag == "error" and nodeid not in seen
              and (outcomes[0].get("message") or "").startswith("failed on teardown")):
            # pytest counts the test passed and its teardown an error ("1 passed, 1 error"); a teardown error of
            # a test that failed comes as a second <testcase> of the same name, and that one is no pass
            counts.passed += 1
        seen.add(nodeid)
        for outcome in outcomes:
            message = outcome.get("message") or outcome.text
            if outcome.tag == "skipped":
                counts.skipped += 1
                reasons[_skip_reason(message or "no reason given")] += 1
            elif outcome.tag == "failure":
                counts.failed += 1
                counts.failures.append(f"{nodeid}: {_first_line(message)}")
            else:
                counts.errors += 1
                counts.failures.append(f"{nodeid} (error): {_first_line(message)}")
    counts.skip_reasons = dict(reasons.most_common())
    return counts


def pytest_command(suite: Suite, device: str, junit_path: Path, extra: Sequence[str] = ()) -> list[str]:
    """The pytest command line of ``suite`` on ``device`` (run from the repository root)."""
    cmd = [sys.executable, "-m", "pytest", *suite.paths]
    for path in suite.ignore:
        cmd += ["--ignore", path]
    cmd += ["--gpumem-device", device, "-o", "gpumem_hil=true", "-p", "no:cacheprovider", "-q", "-rfEs",
            f"--junitxml={junit_path}", *extra]
    return cmd


def status_of(counts: TestCounts, exit_code: int | None) -> tuple[SuiteStatus, str]:
    """The suite's status from its counts and pytest's exit code (Note [A skipped suite is not a passed one])."""
    if counts.failed or counts.errors:
        return SuiteStatus.FAILED, f"{counts.failed} failed, {counts.errors} errors"
    if counts.total == 0:
        return SuiteStatus.ERROR, "no test ran (pytest collected nothing)"
    # pytest's exit status before "every test skipped": 1 says tests failed or errored, whatever the XML lists
    if exit_code == 1:
        return SuiteStatus.FAILED, ("pytest exited with status 1 (tests failed or errored) although its JUnit XML "
                                    "lists no failure or error")
    if exit_code not in (0, None):
        return SuiteStatus.ERROR, f"pytest exited with status {exit_code} although no test failed"
    if counts.passed == 0:
        return SuiteStatus.SKIPPED, "every test skipped: " + "; ".join(counts.skip_reasons)
    return SuiteStatus.PASSED, ""


def _tail(path: Path, n_lines: int = 3) -> str:
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n_lines:])


def run_suite(suite: Suite, device: str, *, repo_root: Path, log_dir: Path, timeout_s: float,
              prefix: Sequence[str] = (), env: dict[str, str] | None = None, label: str | None = None,
              pytest_args: Sequence[str] = ()) -> SuiteResult:
    """Run ``suite`` on ``device`` in a fresh pytest process and return its result.

    ``prefix`` goes before the command (e.g. ``compute-sanitizer --tool memcheck``); the log of the run
    (stdout and stderr together) is written to ``log_dir/<label>.log``. A run past ``timeout_s`` is
    killed with its whole process group and reported as :attr:`SuiteStatus.ERROR`."""
    label = label or f"{suite.name}-{slug(device)}"
    # pytest runs in repo_root: a relative folder would send its JUnit file there and read it from here
    log_dir = Path(os.path.abspath(log_dir))
    log_dir.mkdir(parents=True, exist_ok=True)
    junit = log_dir / f"{label}.junit.xml"
    log_path = log_dir / f"{label}.log"
    junit.unlink(missing_ok=True)
    cmd = [*prefix, *pytest_command(suite, device, junit, pytest_args)]
    started = time.monotonic()
    # its own process group, killed whole on a timeout or a Ctrl-C of the runner (hil.process)
    exit_code = run_in_group(cmd, cwd=repo_root, log_path=log_path, env=env if env is not None else dict(os.environ),
                             timeout_s=timeout_s)
    timed_out = exit_code is None
    duration_s = time.monotonic() - started
    shown = " ".join(str(c) for c in cmd[len(prefix):]).replace(sys.executable, "python")
    if prefix:
        shown = " ".join(Path(prefix[0]).name if i == 0 else str(p) for i, p in enumerate(prefix)) + " " + shown
    try:
        counts = parse_junit(junit)
    except (OSError, ValueError):
        counts = None
    if timed_out:
        status, reason = SuiteStatus.ERROR, f"timed out after {timeout_s:g} s"
    elif counts is None:
        status, reason = SuiteStatus.ERROR, (f"pytest wrote no result (exit status {exit_code}): "
                                             f"{_tail(log_path) or 'no output'}")
    else:
        status, reason = status_of(counts, exit_code)
    counts = counts or TestCounts()
    junit.unlink(missing_ok=True)
    return SuiteResult(suite=suite.name, device=device, status=status, passed=counts.passed, failed=counts.failed,
                       skipped=counts.skipped, errors=counts.errors, duration_s=round(duration_s, 2),
                       skip_reasons=counts.skip_reasons, failures=counts.failures[:50], exit_code=exit_code,
                       command=shown, reason=reason, log=log_path.name)
