"""CuPy's own test suite as a HIL suite, under CuPy's pool and under gpumem, diffed test by test (issue 19).

CuPy's tests (``tests/cupy_tests`` of the CuPy release installed, checked out at its tag) are run
twice, at the same time on one GPU: once as CuPy runs them (its ``MemoryPool``), once with
``gpumem.cupy_allocator.install()`` put in before the first test. Both runs load this module as a
pytest plugin (``-p hil.cupy_suite``), which records each test's outcome as it ends (JSON lines, so a
run cut short by the deadline still counts what it ran) and, in the gpumem run, at the end of each
worker, runs the allocator's consistency check (:func:`gpumem.cupy_allocator.check_installed`). The
runner then diffs the outcomes test by test and writes a Markdown record and a JSON file.

Note [Splitting CuPy's suite over one GPU]: CuPy's tests are mostly CPU-bound (NumPy references,
NVRTC compiling each kernel once), so one pytest process per allocator leaves the GPU idle. With
pytest-xdist installed each allocator's run gets ``--jobs`` workers (``--dist load``); without it the
test files are dealt to ``--jobs`` processes per allocator, largest first (file size stands for test
count), the same deal for both allocators, so that a deadline cuts both runs alike. The two runs
compile the same kernels; CuPy's kernel cache is shared through the disk (written by rename).

Usage::

    python -m hil.cupy_suite --tests CUPY_CHECKOUT --out DIR [--folders creation,manipulation,...]
                             [--jobs 7] [--deadline-s 520] [--allocators cupy,gpumem]

``CUPY_CHECKOUT`` holds ``tests/cupy_tests`` (and CuPy's ``tests/conftest.py`` and ``pyproject.toml``,
whose pytest settings apply). Exit status: 0 no differing outcome and every consistency check clean;
1 some test differs or a check found a problem; 2 bad input.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

ALLOCATOR_ENV = "GPUMEM_CUPY_SUITE_ALLOCATOR"   # "cupy" or "gpumem": which allocator this pytest process runs on
OUT_ENV = "GPUMEM_CUPY_SUITE_OUT"               # folder the plugin writes its files into
STOP_ENV = "GPUMEM_CUPY_SUITE_STOP_AT"          # time.time() after which a process starts no new test
ALLOCATORS = ("cupy", "gpumem")
DEFAULT_FOLDERS = ("creation", "manipulation", "sorting", "indexing", "statistics", "fft", "linalg", "logic")
GRACE_S = 40.0   # the processes stop starting tests this long before the deadline (a test, then the check)
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


# -- the pytest plugin (runs inside each pytest process and xdist worker) -------------------------------------

def _worker_id() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def _is_xdist_controller(config: Any) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def _plugin_file(suffix: str) -> Path:
    out = Path(os.environ[OUT_ENV])
    return out / f"{os.environ[ALLOCATOR_ENV]}-{os.getpid()}-{_worker_id()}.{suffix}"


def fold_outcome(current: str | None, report: Any) -> str:
    """The test's outcome so far (``current``, None before its setup) with one more phase's ``report``: an
    error in setup or teardown wins, then a failed, skipped or expected-failure call, then passed."""
    if hasattr(report, "wasxfail"):
        new = "xpassed" if report.passed else "xfailed"
    elif report.failed:
        new = "failed" if report.when == "call" else "error"
    elif report.skipped:
        new = "skipped"
    else:
        new = "passed"
    if current is None or new == "error" or current == "passed":
        return new
    return current


class _Recorder:
    """Writes each test's outcome as it ends; at the end, the allocator's consistency check."""

    def __init__(self, allocator: str, stop_at_s: float | None) -> None:
        self.allocator = allocator
        self.stop_at_s = stop_at_s
        self.outcomes: dict[str, str] = {}
        self.file = open(_plugin_file("jsonl"), "a", buffering=1)  # noqa: SIM115 - closed at sessionfinish
        if allocator == "gpumem":   # before any test allocates
            import gpumem.cupy_allocator as gca

            gca.install()

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.outcomes[report.nodeid] = fold_outcome(self.outcomes.get(report.nodeid), report)
        if report.when == "teardown":
            self.file.write(json.dumps({"test": report.nodeid, "outcome": self.outcomes.pop(report.nodeid),
                                        "worker": _worker_id()}) + "\n")

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        # Note [Splitting CuPy's suite over one GPU]: stopping here, between tests, lets the session end
        # normally (and the check run) before the runner's deadline would kill the process
        if self.stop_at_s is not None and time.time() > self.stop_at_s:
            self._session.shouldstop = "gpumem cupy suite: deadline"

    def pytest_sessionstart(self, session: Any) -> None:
        self._session = session

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        self.file.close()
        import gc

        gc.collect()
        record: dict[str, Any] = {"worker": _worker_id(), "pid": os.getpid(), "exitstatus": int(exitstatus)}
        try:
            import cupy

            cupy.cuda.Device().synchronize()
            if self.allocator == "gpumem":
                import gpumem.cupy_allocator as gca

                record["checks"] = [dataclasses.asdict(c) for c in gca.check_installed()]
            else:
                pool = cupy.get_default_memory_pool()
                record["pool"] = {"used_nbytes": pool.used_bytes(), "total_nbytes": pool.total_bytes()}
        except Exception as exc:  # noqa: BLE001 - recorded: the runner reports it
            record["check_error"] = f"{type(exc).__name__}: {exc}"
        _plugin_file("check.json").write_text(json.dumps(record))


def pytest_configure(config: Any) -> None:
    """Register the recorder in each process that runs tests (not in an xdist controller)."""
    allocator = os.environ.get(ALLOCATOR_ENV)
    if allocator not in ALLOCATORS or _is_xdist_controller(config):
        return
    stop = os.environ.get(STOP_ENV)
    config.pluginmanager.register(_Recorder(allocator, float(stop) if stop else None), "gpumem-cupy-suite-recorder")


# -- the runner ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
    """One pytest process: an allocator and the test paths it runs."""

    allocator: str
    name: str
    paths: list[str]
    proc: "subprocess.Popen[bytes] | None" = None
    log_path: Path | None = None
    started_s: float = 0.0
    ended_s: float | None = None
    killed: bool = False


def _have_xdist() -> bool:
    return importlib.util.find_spec("xdist") is not None


def folder_paths(tests_root: Path, folders: Iterable[str]) -> list[Path]:
    """The folders ``tests/cupy_tests/<name>_tests`` of a CuPy checkout; raises ValueError for a missing one."""
    out = []
    for name in folders:
        path = tests_root / "tests" / "cupy_tests" / f"{name.removesuffix('_tests')}_tests"
        if not path.is_dir():
            raise ValueError(f"{path} is not a folder of CuPy's tests")
        out.append(path)
    return out


def deal_files(folders: list[Path], jobs: int) -> list[list[Path]]:
    """The test files of ``folders`` dealt to ``jobs`` lists of about equal size, largest file first."""
    files = sorted((f for d in folders for f in d.rglob("test_*.py")), key=lambda f: (-f.stat().st_size, str(f)))
    buckets: list[list[Path]] = [[] for _ in range(max(1, min(jobs, len(files))))]
    sizes = [0] * len(buckets)
    for f in files:
        k = sizes.index(min(sizes))
        buckets[k].append(f)
        sizes[k] += f.stat().st_size
    return [sorted(b) for b in buckets if b]


def make_jobs(tests_root: Path, folders: list[Path], allocators: list[str], jobs: int, xdist: bool) -> list[Job]:
    rel = [str(p.relative_to(tests_root)) for p in folders]
    if xdist:
        return [Job(a, f"{a}-xdist", rel) for a in allocators]
    deal = deal_files(folders, jobs)
    return [Job(a, f"{a}-{k}", [str(f.relative_to(tests_root)) for f in files])
            for a in allocators for k, files in enumerate(deal)]


def start(job: Job, tests_root: Path, work: Path, repo: Path, jobs: int, xdist: bool, stop_at_s: float) -> None:
    env = dict(os.environ)
    env[STOP_ENV] = repr(stop_at_s)
    env[ALLOCATOR_ENV] = job.allocator
    env[OUT_ENV] = str(work)
    env["PYTHONPATH"] = os.pathsep.join([str(repo), str(tests_root / "tests")] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("CUPY_CACHE_DIR", str(work / "kernel-cache"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "hil.cupy_suite", "-p", "no:cacheprovider",
           "--rootdir", str(tests_root), "-c", str(tests_root / "pyproject.toml"), "-o", "console_output_style=classic",
           "-rN"]
    if xdist:
        cmd += ["-n", str(jobs), "--dist", "load"]
    cmd += job.paths
    job.log_path = work / f"{job.name}.log"
    job.started_s = time.monotonic()
    with open(job.log_path, "wb") as out:
        job.proc = subprocess.Popen(cmd, cwd=tests_root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)


def run_jobs(job_list: list[Job], deadline_s: float) -> None:
    """Wait for every job; at the deadline, end what still runs (its process group: xdist workers too)."""
    t_end = time.monotonic() + deadline_s
    while any(j.ended_s is None for j in job_list):
        for j in job_list:
            if j.ended_s is None and j.proc is not None and j.proc.poll() is not None:
                j.ended_s = time.monotonic()
        if time.monotonic() > t_end:
            for j in job_list:
                if j.ended_s is None and j.proc is not None:
                    j.killed = True
                    os.killpg(j.proc.pid, signal.SIGTERM)
            time.sleep(5)
            for j in job_list:
                if j.ended_s is None and j.proc is not None:
                    if j.proc.poll() is None:
                        os.killpg(j.proc.pid, signal.SIGKILL)
                        j.proc.wait()
                    j.ended_s = time.monotonic()
            break
        time.sleep(1)


def read_results(work: Path) -> tuple[dict[str, dict[str, str]], dict[str, list[dict[str, Any]]]]:
    """(allocator -> test -> outcome, allocator -> worker records) from the plugin's files."""
    outcomes: dict[str, dict[str, str]] = {a: {} for a in ALLOCATORS}
    checks: dict[str, list[dict[str, Any]]] = {a: [] for a in ALLOCATORS}
    for f in sorted(work.glob("*.jsonl")):
        alloc = f.name.split("-", 1)[0]
        for line in f.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue   # a line cut by the deadline
            outcomes[alloc][r["test"]] = r["outcome"]
    for f in sorted(work.glob("*.check.json")):
        checks[f.name.split("-", 1)[0]].append(json.loads(f.read_text()))
    return outcomes, checks


def folder_of(test: str) -> str:
    """CuPy's test folder of a test id (``tests/cupy_tests/<folder>/...``), or its file."""
    parts = test.split("::")[0].split("/")
    return parts[2] if len(parts) > 3 and parts[1] == "cupy_tests" else parts[0]


def diff(outcomes: dict[str, dict[str, str]], a: str = "cupy", b: str = "gpumem") -> list[tuple[str, str, str]]:
    """Tests run under both allocators whose outcomes differ: (test, outcome under a, outcome under b)."""
    both = outcomes[a].keys() & outcomes[b].keys()
    return sorted((t, outcomes[a][t], outcomes[b][t]) for t in both if outcomes[a][t] != outcomes[b][t])


def render(outcomes: dict[str, dict[str, str]], checks: dict[str, list[dict[str, Any]]], job_list: list[Job],
           differing: list[tuple[str, str, str]], meta: dict[str, Any]) -> str:
    lines = [f"# CuPy's test suite under CuPy's pool and under gpumem ({meta['date']})", ""]
    lines.append(f"CuPy {meta['cupy']} (tests of tag {meta['tag']}), {meta['device']}; {meta['mode']}; deadline "
                 f"{meta['deadline_s']:.0f} s, wall {meta['wall_s']:.0f} s; gpumem's hook: {meta['hook']}.")
    lines.append("")
    per: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for alloc, tests in outcomes.items():
        for t, o in tests.items():
            per[(folder_of(t), alloc)][o] += 1
    folders = sorted({f for f, _ in per})
    lines.append("| folder | allocator | " + " | ".join(OUTCOMES) + " | total |")
    lines.append("|---|---|" + "---|" * (len(OUTCOMES) + 1))
    for f in folders:
        for alloc in ALLOCATORS:
            c = per.get((f, alloc), collections.Counter())
            lines.append(f"| {f} | {alloc} | " + " | ".join(str(c[o]) for o in OUTCOMES) + f" | {sum(c.values())} |")
    totals = {a: len(outcomes[a]) for a in ALLOCATORS}
    common = len(outcomes["cupy"].keys() & outcomes["gpumem"].keys())
    lines += ["", f"Tests run: {totals['cupy']} under CuPy's pool, {totals['gpumem']} under gpumem, {common} under "
              f"both (a test that only one run reached before the deadline is not compared)."]
    lines += ["", f"## Tests whose outcome differs: {len(differing)}", ""]
    if differing:
        lines += ["| test | CuPy's pool | gpumem |", "|---|---|---|"]
        lines += [f"| `{t}` | {a} | {b} |" for t, a, b in differing]
    else:
        lines.append("None.")
    lines += ["", "## The allocator's consistency check at the end of each worker (gpumem run)", ""]
    if not checks["gpumem"]:
        lines.append("No worker of the gpumem run reached its end (cut by the deadline): no check ran.")
    for rec in checks["gpumem"]:
        if "check_error" in rec:
            lines.append(f"- worker {rec['worker']} (pid {rec['pid']}): the check could not run: {rec['check_error']}")
            continue
        for c in rec.get("checks", []):
            state = "consistent" if not c["problems"] else "PROBLEMS: " + "; ".join(c["problems"])
            lines.append(f"- worker {rec['worker']} (pid {rec['pid']}), cuda:{c['device']} ({c['engine']} engine): "
                         f"{state}; {c['allocated_nbytes']} B allocated, {c['reserved_nbytes']} B reserved at the end")
    lines += ["", "## Processes", "", "| process | tests | wall s | exit | cut by the deadline |", "|---|---|---|---|---|"]
    for j in job_list:
        rc = j.proc.returncode if j.proc is not None else None
        wall = (j.ended_s or j.started_s) - j.started_s
        lines.append(f"| {j.name} | {len(j.paths)} path(s) | {wall:.0f} | {rc} | {'yes' if j.killed else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", type=Path, required=True, help="a CuPy checkout holding tests/cupy_tests")
    ap.add_argument("--out", type=Path, required=True, help="where the record (.md), the JSON and the logs go")
    ap.add_argument("--folders", default=",".join(DEFAULT_FOLDERS))
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--jobs", type=int, default=7, help="processes (or xdist workers) per allocator")
    ap.add_argument("--deadline-s", type=float, default=520.0)
    ap.add_argument("--tag", default="?", help="the CuPy tag the tests were checked out at, for the record")
    ap.add_argument("--stem", default="cupy-suite", help="file names of the record")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    allocators = [a for a in args.allocators.split(",") if a]
    if not allocators or any(a not in ALLOCATORS for a in allocators) or args.jobs < 1 or args.deadline_s <= 0:
        print(f"--allocators must name some of {ALLOCATORS}; --jobs and --deadline-s must be positive", file=sys.stderr)
        return 2
    tests_root = args.tests.resolve()
    try:
        folders = folder_paths(tests_root, [f for f in args.folders.split(",") if f])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    repo = Path(__file__).resolve().parents[1]
    import cupy

    import gpumem.cupy_allocator as gca

    hook = gca.native_hook()
    meta = {"date": dt.date.today().isoformat(), "cupy": cupy.__version__, "tag": args.tag,
            "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "deadline_s": args.deadline_s,
            "hook": "native engine, stream read " + (
                "in C by device (cupy_backends' get_stream_ptr)" if hook.reads_stream_by_device()
                else "in C" if hook.reads_stream_in_c() else "through Python")}
    del hook
    xdist = _have_xdist()
    meta["mode"] = (f"pytest-xdist, {args.jobs} workers per allocator" if xdist else
                    f"no pytest-xdist: the test files dealt to {args.jobs} processes per allocator")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cupy-suite-") as tmp:
        work = Path(tmp)
        job_list = make_jobs(tests_root, folders, allocators, args.jobs, xdist)
        t0 = time.monotonic()
        stop_at_s = time.time() + max(args.deadline_s - GRACE_S, args.deadline_s / 2)
        for j in job_list:
            start(j, tests_root, work, repo, args.jobs, xdist, stop_at_s)
        log.info("%d pytest processes started (%s)", len(job_list), meta["mode"])
        run_jobs(job_list, args.deadline_s)
        meta["wall_s"] = time.monotonic() - t0
        outcomes, checks = read_results(work)
        differing = diff(outcomes)
        text = render(outcomes, checks, job_list, differing, meta)
        (args.out / f"{args.stem}.md").write_text(text)
        (args.out / f"{args.stem}.json").write_text(json.dumps(
            {"meta": meta, "outcomes": outcomes, "checks": checks, "differing": differing}, indent=0))
        with open(args.out / f"{args.stem}-logs.txt", "w") as logs:
            for j in job_list:   # the tail of each process's output: failures are summarised there
                tail = j.log_path.read_text(errors="replace")[-6000:] if j.log_path else ""
                logs.write(f"==== {j.name} (exit {j.proc.returncode if j.proc else None}) ====\n{tail}\n")
    print(text)
    bad_check = any("check_error" in r or any(c["problems"] for c in r.get("checks", [])) for r in checks["gpumem"])
    return 1 if differing or bad_check else 0


if __name__ == "__main__":
    sys.exit(main())
