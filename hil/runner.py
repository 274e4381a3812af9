"""The hardware-in-the-loop runner: every device suite, the peer benchmark, simulator fidelity and
sanitizer runs on a real GPU, with one command and one record.

::

    python -m hil run --device cuda:0 --out reports/hil/

runs, on each device given:

1. **suites** - every suite of :data:`hil.suites.SUITES` (contract, CUDA adapter, allocator,
   native engine, managers, workspace, CuPy and PyTorch integration), each in its own pytest process
   with ``--gpumem-device``;
2. **peers** - the peer benchmark (:mod:`hil.peers`): every trace through gpumem and through
   PyTorch's, CuPy's and RMM's allocators and cudaMallocAsync, each in a fresh process;
3. **fidelity** - the simulator against the real device (:mod:`hil.fidelity`): peak reserved,
   ``mem_info``, call latency and hazard scenarios;
4. **sanitizer** - the suites again under compute-sanitizer (``--sanitizer memcheck,racecheck``).

and writes ``hil-<device>-<date>.json`` (the machine-readable record) and ``hil-<device>-<date>.md``
(a short summary) into ``--out``, with every pytest and sanitizer log in ``hil-<device>-<date>-logs/``.

Given a simulated device (``--device sim:h200-141gb``) the suites run on the simulator and the parts
that need a real GPU are recorded as skipped. Given a CUDA device on a machine without one, the
runner stops at once with one message.

Note [The runner holds no CUDA context]
---------------------------------------
Everything that touches the GPU runs in a child process: the environment probe, each suite, each
peer, the fidelity check. A CUDA context in the runner itself would take about half a GiB of the card
for the whole run (shrinking what each suite and peer sees, and shifting every ``mem_info`` figure the
fidelity check compares), and a fault in one suite (an illegal address kills the context) would end
the run instead of failing one suite.

Note [Parts of a record made in several calls]
----------------------------------------------
A GPU runner may limit how long one command runs. ``--parts`` chooses what a call runs and
``--resume FILE`` adds its results to an earlier record of the same devices: the parts run now
replace theirs in the record, the rest are kept, and ``runs`` lists every call with its own parts,
times, command and git commit. Parts never run are listed as "not run" in the summary: a record is
complete only when every part ran in it.

Exit status: 0 every part run passed and nothing was skipped; 1 something failed; 2 bad input or no
usable device; 3 nothing failed but a suite or part was skipped (or not run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import enum
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from hil.sanitizer import CHILD_PROCESS_SUITES, DEVICE_TESTS_ONLY, MEMCHECK_SUITES, RACECHECK_SUITES, \
    SANITIZER_ENV_VAR, SanitizerTool, child_control_command, find_compute_sanitizer, parse_sanitizer_log, sanitizer_prefix
from hil.process import run_in_group
from gpumem.outputs import resolve_output, write_text_atomically
from hil.suites import SUITES, SuiteResult, SuiteStatus, missing_needs, run_suite, slug, suite_named

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_INCOMPLETE", "EXIT_OK", "HilRunError", "Part", "RunOptions",
           "exit_code_of", "find_repo_root", "overall_status", "render_markdown", "run"]

log = logging.getLogger("hil")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INCOMPLETE = 3

#: The schema of the record this module writes.
RECORD_KIND = "gpumem-hil-record"
SCHEMA_VERSION = 1


class Part(str, enum.Enum):
    """The parts of a HIL run, in the order they run."""

    SUITES = "suites"
    PEERS = "peers"
    FIDELITY = "fidelity"
    SANITIZER = "sanitizer"


class HilRunError(Exception):
    """The run cannot start (no usable device, no test suites, a bad ``--resume`` file): one clear message."""


@dataclasses.dataclass
class RunOptions:
    """What :func:`run` does; the command line fills it (``python -m hil run --help``)."""

    devices: list[str]
    out_dir: Path
    parts: list[Part] = dataclasses.field(default_factory=lambda: list(Part))
    suites: list[str] = dataclasses.field(default_factory=lambda: [s.name for s in SUITES])
    sanitizer_tools: list[SanitizerTool] = dataclasses.field(
        default_factory=lambda: [SanitizerTool.MEMCHECK, SanitizerTool.RACECHECK])
    sanitizer_suites: list[str] | None = None
    traces: Path | None = None
    repo_root: Path | None = None
    sim: str | None = None
    suite_timeout_s: float = 1800.0
    part_timeout_s: float = 3600.0
    peers_repeat: int = 3
    resume: Path | None = None
    command: str = ""


def find_repo_root(start: Path | None = None) -> Path:
    """The gpumem checkout whose ``tests/`` hold the suites: ``start`` (default: the current directory,
    else the checkout this runner lies in, else the one gpumem was imported from)."""
    import gpumem

    if start is not None:  # asked for by name: that checkout or an error, never another one
        if (start / "tests" / "contract").is_dir() and (start / "gpumem").is_dir():
            return start.resolve()
        raise HilRunError(f"--repo {start}: not a gpumem checkout (no tests/contract and gpumem/ in it)")
    candidates = [Path.cwd(), Path(__file__).resolve().parents[1], Path(gpumem.__file__).resolve().parents[1]]
    for root in candidates:
        if (root / "tests" / "contract").is_dir() and (root / "gpumem").is_dir():
            return root.resolve()
    raise HilRunError("the HIL suites live in the tests/ folder of a gpumem checkout, and none was found here or "
                      "beside the installed package: run from a clone of the repository (git clone, then "
                      "pip install -e \".[dev]\"), or pass --repo PATH")


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _root(opts: RunOptions) -> Path:
    """The checkout the children run in (:func:`run` has found it by then)."""
    if opts.repo_root is None:
        raise HilRunError("no gpumem checkout to run in")
    return opts.repo_root


def _child_env(repo_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _git_commit(repo_root: Path) -> str | None:
    from gpumem.testing import _git_commit as commit_of  # one rule for every record (+dirty, GPUMEM_GIT_COMMIT)

    return commit_of(repo_root)


# -- the environment probe (a child process: Note [The runner holds no CUDA context]) ------------------------
def probe_device(spec: str, repo_root: Path, timeout_s: float = 300.0) -> dict[str, Any]:
    """The environment report of ``spec`` (:func:`hil.environment.probe`), made in a child process.

    Raises :class:`HilRunError` with one message when the device cannot be opened."""
    cmd = [sys.executable, "-m", "hil", "env", "--device", spec, "--json"]
    try:
        res = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=timeout_s,
                             env=_child_env(repo_root))
    except subprocess.TimeoutExpired:
        raise HilRunError(f"opening {spec} did not finish in {timeout_s:g} s (is the GPU hung?)") from None
    try:
        report = json.loads(res.stdout)
    except ValueError:
        tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:]
        raise HilRunError(f"could not describe {spec}: the probe exited with status {res.returncode}"
                          + (f": {tail[0]}" if tail else "")) from None
    if report.get("error"):
        hint = ""
        if spec.startswith("cuda"):
            hint = (" The HIL runner needs a CUDA GPU with its driver, and CuPy and cuda-bindings installed "
                    "(pip install -e \".[dev,cuda13]\"). Without a GPU, run the suites on the simulator: "
                    "python -m hil run --device sim:h200-141gb --out DIR.")
        raise HilRunError(f"cannot open {spec}: {report['error']}.{hint}")
    return report


# -- parts ---------------------------------------------------------------------------------------------------------
def _run_suites(opts: RunOptions, spec: str, log_dir: Path) -> list[dict[str, Any]]:
    results = []
    for name in opts.suites:
        suite = suite_named(name)
        missing = missing_needs(suite) if spec.startswith("cuda:") else []
        if missing:  # Note [A skipped suite is not a passed one]
            reason = f"{', '.join(missing)} not installed: the suite's real-device tests cannot run"
            log.info("suite %s on %s: skipped (%s)", name, spec, reason)
            results.append(SuiteResult(suite=name, device=spec, status=SuiteStatus.SKIPPED, passed=0, failed=0,
                                       skipped=0, errors=0, duration_s=0.0, skip_reasons={reason: 1}, failures=[],
                                       exit_code=None, command="", reason=reason).as_json())
            continue
        log.info("suite %s on %s ...", name, spec)
        res = run_suite(suite, spec, repo_root=opts.repo_root, log_dir=log_dir, timeout_s=opts.suite_timeout_s,
                        env=_child_env(opts.repo_root))
        log.info("suite %s on %s: %s (%d passed, %d failed, %d skipped, %d errors, %.0f s)%s", name, spec,
                 res.status.value, res.passed, res.failed, res.skipped, res.errors, res.duration_s,
                 f": {res.reason}" if res.reason else "")
        results.append(res.as_json())
    return results


def _skipped_part(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason, "summary": "", "markdown": ""}


def _run_module_part(module: str, args: list[str], opts: RunOptions, log_dir: Path, label: str) -> dict[str, Any]:
    """Run ``python -m <module> ... --json FILE`` and return the JSON it wrote (the contract in
    ``hil.peers`` and ``hil.fidelity``); a crash, a timeout or no JSON is ``status: error``."""
    json_path = log_dir / f"{label}.json"
    log_path = log_dir / f"{label}.log"
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", module, *args, "--json", str(json_path)]
    started = time.monotonic()
    code = run_in_group(cmd, cwd=_root(opts), log_path=log_path, env=_child_env(_root(opts)),
                        timeout_s=opts.part_timeout_s)
    ended = f"exited with status {code}" if code is not None else f"timed out after {opts.part_timeout_s:g} s"
    duration_s = round(time.monotonic() - started, 1)
    try:
        data = json.loads(json_path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or "status" not in data:
            raise ValueError("no status")
    except (OSError, ValueError):
        lines = [ln for ln in log_path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
        data = {"status": "error", "reason": f"python -m {module} {ended} without writing its JSON"
                + (f": {lines[-1][:300]}" if lines else ""), "summary": "", "markdown": ""}
    data["command"] = " ".join(["python", "-m", module, *args])
    data["log"] = log_path.name
    data.setdefault("duration_s", duration_s)
    return data


def _run_peers(opts: RunOptions, spec: str, log_dir: Path) -> dict[str, Any]:
    args = ["--device", spec, "--repeat", str(opts.peers_repeat)]
    if opts.traces is not None:
        args += ["--traces", str(opts.traces)]
    return _run_module_part("hil.peers", args, opts, log_dir, f"peers-{slug(spec)}")


def _run_fidelity(opts: RunOptions, spec: str, sim: str, log_dir: Path) -> dict[str, Any]:
    args = ["--device", spec, "--sim", sim]
    if opts.traces is not None:
        args += ["--traces", str(opts.traces)]
    return _run_module_part("hil.fidelity", args, opts, log_dir, f"fidelity-{slug(spec)}")


def _sanitizer_suites(opts: RunOptions, tool: SanitizerTool) -> list[str]:
    if opts.sanitizer_suites is not None:
        chosen = opts.sanitizer_suites
    else:
        chosen = [s for s in opts.suites if s in MEMCHECK_SUITES]
    if tool is SanitizerTool.RACECHECK:
        return [s for s in chosen if s in RACECHECK_SUITES]
    return list(chosen)


#: How long the sanitizer's control run may take (it takes seconds on the H200).
CONTROL_TIMEOUT_S = 300.0


def _run_control(exe: str, opts: RunOptions, spec: str, log_dir: Path) -> dict[str, Any]:
    """The control of Note [A clean run needs a control]: memcheck, checking children, must count errors in
    a child that reads freed memory on purpose."""
    label = f"control-{slug(spec)}-memcheck"
    tool_log = log_dir / f"{label}.sanitizer.log"
    tool_log.unlink(missing_ok=True)
    cmd = [*sanitizer_prefix(exe, SanitizerTool.MEMCHECK, tool_log, children=True), *child_control_command(spec)]
    log.info("control on %s: memcheck on a child that reads freed memory on purpose ...", spec)
    if run_in_group(cmd, cwd=_root(opts), log_path=log_dir / f"{label}.log", env=_child_env(_root(opts)),
                    timeout_s=CONTROL_TIMEOUT_S) is None:
        return {"status": "error", "errors": None, "log": tool_log.name,
                "reason": f"the control run timed out after {CONTROL_TIMEOUT_S:g} s"}
    try:
        findings = parse_sanitizer_log(tool_log.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        return {"status": "error", "errors": None, "log": tool_log.name, "reason": f"the control run: {exc}"}
    if findings.errors:
        return {"status": "passed", "errors": findings.errors, "log": tool_log.name, "reason": ""}
    return {"status": "failed", "errors": 0, "log": tool_log.name,
            "reason": "memcheck counted no error in a child process that reads freed memory on purpose: "
                      "the runs that check child processes prove nothing"}


def _run_sanitizer(opts: RunOptions, spec: str, log_dir: Path) -> dict[str, Any]:
    exe = find_compute_sanitizer()
    if exe is None:
        return _skipped_part("compute-sanitizer was not found (on PATH, under $CUDA_HOME/bin or /usr/local/cuda/bin)")
    runs = []
    control = None
    if SanitizerTool.MEMCHECK in opts.sanitizer_tools and \
            set(_sanitizer_suites(opts, SanitizerTool.MEMCHECK)) & set(CHILD_PROCESS_SUITES):
        control = _run_control(exe, opts, spec, log_dir)
    for tool in opts.sanitizer_tools:
        for name in _sanitizer_suites(opts, tool):
            label = f"{name}-{slug(spec)}-{tool.value}"
            tool_log = log_dir / f"{label}.sanitizer.log"
            tool_log.unlink(missing_ok=True)
            log.info("suite %s on %s under compute-sanitizer %s ...", name, spec, tool.value)
            res = run_suite(suite_named(name), spec, repo_root=opts.repo_root, log_dir=log_dir,
                            timeout_s=opts.suite_timeout_s, prefix=sanitizer_prefix(exe, tool, tool_log, children=name in CHILD_PROCESS_SUITES),
                            env={**_child_env(opts.repo_root), SANITIZER_ENV_VAR: tool.value}, label=label,
                            pytest_args=DEVICE_TESTS_ONLY)
            entry: dict[str, Any] = {"tool": tool.value, "suite": name, "device": spec, "tests": res.as_json(),
                                     "sanitizer_log": tool_log.name}
            try:
                findings = parse_sanitizer_log(tool_log.read_text(encoding="utf-8", errors="replace"))
            except (OSError, ValueError) as exc:
                entry.update(status="error", errors=None, processes=0, first_reports=[],
                             reason=f"{exc} (tests: {res.status.value}{': ' + res.reason if res.reason else ''})")
            else:
                entry.update(findings.as_json())
                if findings.processes == 0:
                    entry.update(status="skipped", reason="no CUDA call in the processes the tool checked: nothing to check")
                elif findings.errors:
                    entry.update(status="failed", reason=f"{findings.errors} errors reported")
                elif res.status is SuiteStatus.PASSED:
                    entry.update(status="passed", reason="")
                elif res.status is SuiteStatus.SKIPPED:
                    entry.update(status="skipped", reason=res.reason)
                else:
                    entry.update(status="failed" if res.status is SuiteStatus.FAILED else "error",
                                 reason=f"0 sanitizer errors, but the tests {res.status.value}: {res.reason}")
            log.info("compute-sanitizer %s, suite %s: %s (%s errors)", tool.value, name, entry["status"],
                     entry.get("errors"))
            runs.append(entry)
    statuses = [r["status"] for r in runs] + ([control["status"]] if control else [])
    worst = _worst(statuses) if runs else "skipped"
    n_errors = sum(r.get("errors") or 0 for r in runs)
    reasons = [f"{r['tool']}/{r['suite']}: {r['reason']}" for r in runs if r["status"] != "passed"]
    if control and control["status"] != "passed":
        reasons.append(f"control: {control['reason']}")
    result = {"status": worst, "reason": "; ".join(reasons), "summary": f"{len(runs)} sanitizer runs, {n_errors} errors",
              "executable": Path(exe).name, "runs": runs}
    if control is not None:
        result["control"] = control
    return result


_RANK = {"passed": 0, "skipped": 1, "not run": 1, "failed": 2, "error": 3}


def _worst(statuses: Sequence[str]) -> str:
    return max(statuses, key=lambda s: _RANK.get(s, 3)) if statuses else "passed"


# -- the record ------------------------------------------------------------------------------------------------
def record_stem(devices: list[dict[str, Any]], date: str) -> str:
    """``hil-<device-name>-<YYYY-MM-DD>`` (``sim-`` marks a simulated device; ``-and-N-more`` several)."""
    first = devices[0]
    base = slug(first.get("name") or first["spec"])
    if first.get("kind") == "sim":
        base = f"sim-{base}"
    if len(devices) > 1:
        base += f"-and-{len(devices) - 1}-more"
    return f"hil-{base}-{date[:10]}"


def _statuses(record: dict[str, Any], parts: Sequence[Part]) -> list[str]:
    """The status of every suite and part of ``parts`` on every device (``not run`` where absent)."""
    statuses: list[str] = []
    for dev in record["devices"]:
        results = record["results"].get(dev["spec"], {})
        for part in parts:
            value = results.get(part.value)
            if value is None:
                statuses.append("not run")
            elif part is Part.SUITES:
                statuses += [s["status"] for s in value]
            else:
                statuses.append(value.get("status", "error"))
    return statuses


def overall_status(record: dict[str, Any]) -> str:
    """``passed`` (every part and every suite of :data:`SUITES` ran and passed, nothing skipped), ``failed``,
    or ``incomplete``."""
    statuses = _statuses(record, list(Part))
    every = {s.name for s in SUITES}
    for dev in record["devices"]:
        ran = {s.get("suite") for s in record["results"].get(dev["spec"], {}).get("suites") or []}
        if every - ran:
            statuses.append("not run")  # a record of some suites only is not a passed record
    worst = _worst(statuses)
    return "failed" if worst in ("failed", "error") else "incomplete" if worst in ("skipped", "not run") else "passed"


def exit_code_of(record: dict[str, Any], parts_run: Sequence[Part]) -> int:
    """0 / 1 / 3 for what this call ran (parts not run in this call do not count against it)."""
    worst = _worst(_statuses(record, parts_run))
    return EXIT_FAILED if worst in ("failed", "error") else EXIT_INCOMPLETE if worst != "passed" else EXIT_OK


def _load_resume(path: Path, specs: list[str]) -> dict[str, Any]:
    """The record to add to, checked before anything runs (Note [Parts of a record made in several calls])."""
    try:
        record = json.loads(_read_bounded(path))
    except OSError as exc:
        raise HilRunError(f"--resume {path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:
        raise HilRunError(f"--resume {path}: not JSON ({str(exc)[:200]})") from None
    if not isinstance(record, dict) or record.get("record") != RECORD_KIND:
        raise HilRunError(f"--resume {path}: not a gpumem HIL record (its 'record' field is not {RECORD_KIND!r})")
    problem = _record_shape_problem(record)
    if not problem:
        try:  # every field the summary reads, read now: a damaged record fails before any suite runs
            render_markdown({**record, "status": overall_status(record)})
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            problem = f"the summary cannot be made of it ({type(exc).__name__}: {str(exc)[:200]})"
    if problem:
        raise HilRunError(f"--resume {path}: a damaged record: {problem}")
    theirs = [d.get("spec") for d in record["devices"]]
    if theirs != specs:
        raise HilRunError(f"--resume {path}: that record is of {', '.join(map(str, theirs))}, this run of "
                          f"{', '.join(specs)}; a record covers one set of devices")
    return record


#: The largest record ``--resume`` reads: a record of every suite on 8 devices with many calls is well under.
MAX_RECORD_NBYTES = 64 << 20


def _read_bounded(path: Path) -> str:
    """The text of the regular file ``path``, at most :data:`MAX_RECORD_NBYTES`; a FIFO, a device
    (``/dev/zero``) or a folder is refused without being read (opened non-blocking: a FIFO never blocks)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HilRunError(f"--resume {path}: not a regular file (a record is a JSON file)")
        if st.st_size > MAX_RECORD_NBYTES:
            raise HilRunError(f"--resume {path}: {st.st_size} bytes, larger than any record "
                              f"({MAX_RECORD_NBYTES} bytes at most)")
        data = os.read(fd, MAX_RECORD_NBYTES + 1)
        chunks = [data]
        total = len(data)
        while data and total <= MAX_RECORD_NBYTES:
            data = os.read(fd, MAX_RECORD_NBYTES + 1 - total)
            chunks.append(data)
            total += len(data)
        if total > MAX_RECORD_NBYTES:
            raise HilRunError(f"--resume {path}: grew past {MAX_RECORD_NBYTES} bytes while read")
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _suite_problem(x: Any) -> str:
    """What is wrong with one suite result read back, or ''."""
    if not isinstance(x, dict):
        return "not an object"
    for key in ("suite", "status", "reason"):
        if not isinstance(x.get(key), str):
            return f"{key!r} is not a string"
    for key in ("passed", "failed", "skipped", "errors"):
        if not _is_int(x.get(key)) or x[key] < 0:
            return f"{key!r} is not a count"
    if not isinstance(x.get("duration_s"), (int, float)) or isinstance(x.get("duration_s"), bool):
        return "'duration_s' is not a number"
    if not isinstance(x.get("failures"), list) or not all(isinstance(f, str) for f in x["failures"]):
        return "'failures' is not a list of strings"
    reasons = x.get("skip_reasons")
    if not isinstance(reasons, dict) or not all(_is_int(n) for n in reasons.values()):
        return "'skip_reasons' is not an object of counts"
    return ""


def _record_shape_problem(record: dict[str, Any]) -> str:
    """What is wrong with the shape of a record read back, or '' (the fields :func:`run` and
    :func:`render_markdown` rely on)."""
    devices, results, runs = record.get("devices"), record.get("results"), record.get("runs")
    if not isinstance(devices, list) or not devices or not all(isinstance(d, dict) and isinstance(d.get("spec"), str)
                                                              for d in devices):
        return "'devices' is not a list of devices with a spec"
    if not isinstance(results, dict) or not all(isinstance(v, dict) for v in results.values()):
        return "'results' is not an object of results per device"
    if not isinstance(runs, list) or not runs or not all(
            isinstance(r, dict) and isinstance(r.get("parts"), list) and all(isinstance(p, str) for p in r["parts"])
            and isinstance(r.get("started_utc"), str) and isinstance(r.get("finished_utc"), str)
            for r in runs):
        return "'runs' is not a list of calls with their parts and start time"
    for spec, res in results.items():
        suites = res.get("suites", [])
        if not isinstance(suites, list):
            return f"the suites of {spec} are not a list of suite results"
        for i, x in enumerate(suites):
            problem = _suite_problem(x)
            if problem:
                return f"the suites of {spec}: result {i}: {problem}"
        for part in ("peers", "fidelity", "sanitizer"):
            if part in res and not (isinstance(res[part], dict) and isinstance(res[part].get("status"), str)):
                return f"the {part} part of {spec} is not a result with a status"
    return ""


def _check_same_devices(previous: dict[str, Any], devices: list[dict[str, Any]], path: Path) -> None:
    """A resumed record must be of the very cards probed now, not only of the same specs."""
    for old, new in zip(previous["devices"], devices):
        for key in ("name", "total_nbytes", "kind"):
            if old.get(key) is not None and new.get(key) is not None and old.get(key) != new.get(key):
                raise HilRunError(f"--resume {path}: {new['spec']} there is {old.get('name')} "
                                  f"({old.get(key)!r} for {key}), here {new.get('name')} ({new.get(key)!r}): "
                                  "a record covers one set of cards")


def _check_out_dir(out_dir: Path) -> None:
    """Make ``out_dir`` or say, in one line, why it cannot be used."""
    if str(out_dir).strip() == "":
        raise HilRunError("--out: empty path")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HilRunError(f"--out {out_dir}: cannot make the folder ({exc.strerror or exc})") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise HilRunError(f"--out {out_dir}: cannot write there")


@contextlib.contextmanager
def _exclusive(out_dir: Path) -> Iterator[None]:
    """One run at a time writes into ``out_dir``: a second one stops at once instead of overwriting the
    first one's record and logs (it picks its record's name at its start and writes it at its end)."""
    import fcntl

    lock_path = out_dir / ".gpumem-hil.lock"
    try:
        handle = open(lock_path, "a+", encoding="utf-8")
    except OSError as exc:
        raise HilRunError(f"--out {out_dir}: cannot write there ({exc.strerror or exc})") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise HilRunError(f"another run is writing into {out_dir}: wait for it, or give another --out") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_part_inputs(opts: RunOptions) -> None:
    """--traces and --sim, checked before any suite runs."""
    if opts.traces is not None and (Part.PEERS in opts.parts or Part.FIDELITY in opts.parts):
        if not opts.traces.is_dir():
            raise HilRunError(f"--traces {opts.traces}: no such folder")
    if opts.sim is not None:
        from gpumem.sim import get_profile
        from gpumem.specs import parse_spec

        try:
            parsed = parse_spec(opts.sim)
            if parsed.kind.value != "sim":
                raise HilRunError(f"--sim {opts.sim}: not a simulated device (sim:PROFILE)")
            get_profile(parsed.target)
        except HilRunError:
            raise
        except Exception as exc:  # noqa: BLE001 - any refusal of the spec is the user's input
            raise HilRunError(f"--sim {opts.sim}: {exc}") from None


def run(opts: RunOptions) -> tuple[dict[str, Any], list[Path]]:
    """Run what ``opts`` says and write the record; returns the record and the paths written.

    Raises :class:`HilRunError` (one message) when the run cannot start."""
    opts.repo_root = find_repo_root(opts.repo_root)
    specs = list(dict.fromkeys(opts.devices))
    if len({slug(s) for s in specs}) != len(specs):
        raise HilRunError(f"--device {', '.join(specs)}: two of these name the same device (their logs would "
                          "share one file)")
    _check_part_inputs(opts)
    previous = _load_resume(opts.resume, specs) if opts.resume is not None else None
    out_dir = opts.resume.parent if opts.resume is not None else opts.out_dir
    if str(out_dir).strip():
        out_dir = resolve_output(out_dir)  # Note [An output is replaced only by a complete one]
    started = _utc_now()
    devices = []
    for spec in specs:  # before anything runs or is written: a missing GPU stops here, with one message
        log.info("probing %s ...", spec)
        devices.append(probe_device(spec, opts.repo_root))
    _check_out_dir(out_dir)
    with _exclusive(out_dir):
        return _run_locked(opts, specs, previous, out_dir, started, devices)


def _run_locked(opts: RunOptions, specs: list[str], previous: dict[str, Any] | None, out_dir: Path, started: str,
                devices: list[dict[str, Any]]) -> tuple[dict[str, Any], list[Path]]:
    if previous is not None and opts.resume is not None:
        _check_same_devices(previous, devices, opts.resume)
        out_json = opts.resume
        stem = out_json.stem
    else:
        stem = record_stem(devices, started)
        n = 1
        base = stem
        while (out_dir / f"{stem}.json").exists() or (out_dir / f"{stem}.md").exists():
            n += 1
            stem = f"{base}-{n}"
        out_json = out_dir / f"{stem}.json"
    log_dir = out_dir / f"{stem}-logs"
    for path, is_kind, kind in ((summary_path(out_json), os.path.isfile, "a file"), (log_dir, os.path.isdir, "a folder")):
        if os.path.lexists(path) and not (is_kind(path) and not os.path.islink(path)):  # before any suite runs
            raise HilRunError(f"{path}: is in the way of this record's {kind} (it is not {kind}); move it away")
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {spec: {} for spec in specs}
    if previous is not None:
        for spec in specs:
            results[spec].update(previous.get("results", {}).get(spec, {}))
    for dev in devices:
        spec = dev["spec"]
        real = dev["kind"] == "cuda"
        sim = opts.sim or environment_sim(dev)
        dev["fidelity_sim"] = sim if real else None
        for part in opts.parts:
            if part is Part.SUITES:  # suites not run in this call keep their earlier results
                ran = _run_suites(opts, spec, log_dir)
                names = {r["suite"] for r in ran}
                kept = [r for r in results[spec].get("suites", []) if r["suite"] not in names]
                order = {s.name: i for i, s in enumerate(SUITES)}
                results[spec]["suites"] = sorted(kept + ran, key=lambda r: order.get(r["suite"], len(order)))
            elif not real:
                results[spec][part.value] = _skipped_part(f"needs a real GPU ({spec} is simulated)")
            elif part is Part.PEERS:
                log.info("peer benchmark on %s ...", spec)
                results[spec]["peers"] = _run_peers(opts, spec, log_dir)
            elif part is Part.FIDELITY:
                log.info("simulator fidelity: %s against %s ...", spec, sim)
                results[spec]["fidelity"] = _run_fidelity(opts, spec, sim, log_dir)
            else:
                results[spec]["sanitizer"] = _run_sanitizer(opts, spec, log_dir)
            if part is not Part.SUITES:
                value = results[spec][part.value]
                log.info("%s on %s: %s%s", part.value, spec, value.get("status"),
                         f" ({value.get('summary')})" if value.get("summary") else "")
    finished = _utc_now()
    this_run = {"started_utc": started, "finished_utc": finished, "parts": [p.value for p in opts.parts],
                "suites": list(opts.suites), "git_commit": _git_commit(opts.repo_root), "command": opts.command}
    runs = list(previous.get("runs", [])) if previous is not None else []
    runs.append(this_run)
    record: dict[str, Any] = {
        "record": RECORD_KIND,
        "schema_version": SCHEMA_VERSION,
        "date": runs[0]["started_utc"],
        "finished_utc": finished,
        "git_commit": this_run["git_commit"],
        "devices": devices,
        "results": results,
        "runs": runs,
    }
    record["status"] = overall_status(record)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_md = summary_path(out_json)
    markdown = render_markdown(record)  # rendered before anything is replaced: a failure leaves both intact
    write_text_atomically(out_json, json.dumps(record, indent=1, default=str) + "\n")
    write_text_atomically(out_md, markdown)
    return record, [out_json, out_md, log_dir]


def summary_path(record_path: Path) -> Path:
    """The Markdown summary's path for the record ``record_path``: ``X.json`` -> ``X.md``; never the record
    itself (a record resumed from ``X.md`` gets ``X.md.summary.md``), so a summary cannot overwrite it."""
    md = record_path.with_suffix(".md")
    return md if md.name != record_path.name else record_path.with_name(record_path.name + ".summary.md")


def environment_sim(dev: dict[str, Any]) -> str:
    from hil.environment import sim_profile_for

    return sim_profile_for(dev.get("name"), dev.get("total_nbytes"))


# -- the summary -----------------------------------------------------------------------------------------------
_MARK = {"passed": "passed", "failed": "**FAILED**", "error": "**ERROR**", "skipped": "*skipped*",
         "not run": "*not run*", "incomplete": "*incomplete*"}


def _gib(n: Any) -> str:
    return f"{n / 2**30:.2f} GiB" if isinstance(n, int) else "?"


def _status_causes(record: dict[str, Any]) -> str:
    """What keeps a record from passing, in a few words per suite or part."""
    every = [s.name for s in SUITES]
    causes = []
    for dev in record["devices"]:
        spec = dev["spec"]
        res = record["results"].get(spec, {})
        ran = {x.get("suite"): x for x in res.get("suites") or []}
        causes += [f"suite {n} {ran[n]['status']}" for n in every if n in ran and ran[n].get("status") != "passed"]
        not_run = [n for n in every if n not in ran]
        if not_run:
            causes.append(f"suites not run: {', '.join(not_run)}")
        for part in (Part.PEERS, Part.FIDELITY, Part.SANITIZER):
            value = res.get(part.value)
            if value is None:
                causes.append(f"{part.value} not run")
            elif value.get("status") != "passed":
                reason = str(value.get("reason") or "")
                causes.append(f"{part.value} {value.get('status')}" + (f" ({reason[:120]})" if reason else ""))
        if len(record["devices"]) > 1 and causes:
            causes[-1] += f" on {spec}"
    return "; ".join(causes)


def render_markdown(record: dict[str, Any]) -> str:
    """The short Markdown summary of a record."""
    causes = _status_causes(record)
    lines = [f"# gpumem hardware-in-the-loop record, {record['date'][:10]}", "",
             f"Status: {_MARK.get(record['status'], record['status'])}" + (f": {causes}" if causes else "")
             + " (passed = every part ran and passed; a skipped suite or part makes a record incomplete)", ""]
    commits = list(dict.fromkeys(str(r.get("git_commit")) for r in record.get("runs", [])))
    if len(commits) > 1:
        lines += [f"Made by {len(record['runs'])} calls at {len(commits)} commits ({', '.join(commits)}): "
                  "each run below names the parts it made and its commit.", ""]
    for dev in record["devices"]:
        versions = dev.get("versions", {})
        lines += [f"- device `{dev['spec']}`: {dev.get('name')}, {_gib(dev.get('total_nbytes'))}"
                  + (f", driver {dev['driver_version']}" if dev.get("driver_version") else "")
                  + (f", CUDA driver {dev['cuda_driver_version']}" if dev.get("cuda_driver_version") else "")
                  + (f", CUDA runtime {dev['cuda_runtime_version']}" if dev.get("cuda_runtime_version") else "")
                  + f", engine {dev.get('engine')}",
                  "- packages: " + ", ".join(f"{k} {v}" for k, v in versions.items())]
        if dev.get("compute_sanitizer"):
            lines.append(f"- compute-sanitizer: {dev['compute_sanitizer']}")
    for r in record["runs"]:
        lines.append(f"- run {r['started_utc']} to {r['finished_utc']}: parts {', '.join(r['parts'])}; commit "
                     f"`{r.get('git_commit') or 'unknown'}`; `{r.get('command') or ''}`")
    lines.append("")
    for dev in record["devices"]:
        spec = dev["spec"]
        parts = record["results"].get(spec, {})
        lines += [f"## Suites on `{spec}`", ""]
        suites = parts.get("suites")
        if suites is None:
            lines += ["*not run*", ""]
        else:
            lines += ["| suite | status | passed | failed | skipped | errors | time |", "|---|---|---|---|---|---|---|"]
            for s in suites:
                lines.append(f"| {s['suite']} | {_MARK.get(s['status'], s['status'])} | {s['passed']} | {s['failed']} "
                             f"| {s['skipped']} | {s['errors']} | {s['duration_s']:.0f} s |")
            lines.append("")
            for s in suites:
                if s["reason"] and s["status"] != "passed":
                    lines.append(f"- **{s['suite']}**: {s['reason']}")
                for failure in s["failures"][:10]:
                    lines.append(f"  - `{failure}`")
            skips = [(s["suite"], reason, n) for s in suites for reason, n in s["skip_reasons"].items()]
            if skips:
                lines += ["", "Skipped tests, by reason:", ""]
                lines += [f"- {suite}: {reason} ({n})" for suite, reason, n in skips]
            lines.append("")
        for part, title in ((Part.PEERS, "Peer benchmark"), (Part.FIDELITY, "Simulator fidelity"),
                            (Part.SANITIZER, "compute-sanitizer")):
            value = parts.get(part.value)
            lines += [f"## {title} on `{spec}`", ""]
            if value is None:
                lines += ["*not run*", ""]
                continue
            lines.append(f"Status: {_MARK.get(value.get('status'), value.get('status'))}"
                         + (f" — {value['summary']}" if value.get("summary") else ""))
            if value.get("reason") and value.get("status") != "passed":
                lines += ["", f"Reason: {value['reason']}"]
            lines.append("")
            if part is Part.SANITIZER and value.get("runs"):
                lines += ["| tool | suite | status | errors | checked | tests passed / failed / skipped |",
                          "|---|---|---|---|---|---|"]
                for r in value["runs"]:
                    t = r["tests"]
                    checked = "yes" if r.get("processes") else "no"
                    if r["suite"] in CHILD_PROCESS_SUITES and r["tool"] == SanitizerTool.MEMCHECK.value:
                        checked += ", with children"
                    lines.append(f"| {r['tool']} | {r['suite']} | {_MARK.get(r['status'], r['status'])} "
                                 f"| {r.get('errors') if r.get('errors') is not None else '?'} | {checked} "
                                 f"| {t['passed']} / {t['failed']} / {t['skipped']} |")
                lines.append("")
                control = value.get("control")
                if control:
                    lines += [f"Control (Note [A clean run needs a control]): memcheck on a child process that reads "
                              f"freed memory on purpose counted {control.get('errors') if control.get('errors') is not None else '?'} "
                              f"errors: {_MARK.get(control['status'], control['status'])}"
                              + (f" ({control['reason']})" if control.get("reason") else "") + ".", ""]
                for r in value["runs"]:
                    for rep in r.get("first_reports", []):
                        lines.append(f"- {r['tool']}/{r['suite']}: `{rep}`")
                lines.append("")
            elif value.get("markdown"):
                lines += [value["markdown"].rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"
