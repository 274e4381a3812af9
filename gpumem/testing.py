"""pytest plugin: run device-parametrised suites on simulated or real GPUs, and record the runs.

Loaded through the ``pytest11`` entry point ``gpumem_hil`` once gpumem is installed
(``pip install -e .``); ``tests/conftest.py`` registers it for a bare checkout.

Opting in
    Installing gpumem changes nothing in other projects' pytest runs: the plugin only
    adds its command-line options and the ini key ``gpumem_hil``. Its fixtures
    (``device``, ``device_spec``, ``gpumem_device_specs``), their parametrisation, its
    markers, its report header and ``--gpumem-record`` take effect only in a project that
    opts in, with ``gpumem_hil = true`` in its pytest configuration (``[tool.pytest.ini_options]``
    in ``pyproject.toml``, ``pytest.ini``, or ``-o gpumem_hil=true``), or in a run given
    ``--gpumem-device``. (``GPUMEM_DEVICE`` chooses the devices of a project that opted in;
    it does not opt in by itself.) gpumem's own ``pyproject.toml`` opts in.

Choosing devices
    ``--gpumem-device SPEC`` (repeatable, or comma-separated) names the devices that
    device-parametrised tests run on, e.g. ``--gpumem-device cuda:0`` on a GPU machine or
    ``--gpumem-device sim:a100-80gb,sim:h200-141gb``; ``sim:all`` means every built-in
    simulated profile. Without the option the ``GPUMEM_DEVICE`` environment variable is
    used (same syntax), and without that :data:`DEFAULT_DEVICE_SPECS`, a handful of
    simulated profiles covering the range (unified memory without VMM, a small, a large
    and the largest data-centre card).

Writing device tests
    A test that requests the ``device`` fixture (or ``device_spec``) runs once per chosen
    device. ``device`` is a freshly opened :class:`gpumem.Device` (``gpumem.open_device``),
    closed after the test; when the test passed, the fixture also checks that the test
    left no live allocations, mappings or reservations behind (through the device's
    ``n_allocations`` and, where it has them, ``mapping_ranges()`` and ``reservation_ranges()``;
    see :func:`live_objects`).

Markers
    ``requires_vmm`` - skip on devices without virtual memory management;
    ``sim_only`` - skip on real devices; ``cuda`` - run only on real devices.

Recording a run
    ``--gpumem-record DIR`` writes ``contract-<device>-<date>.json`` and a Markdown twin
    into ``DIR`` at the end of the session: devices (spec, properties), pass/fail/skip/error
    counts (overall and per device), date (UTC), host, Python and package versions, the
    git commit and the ids of the tests that failed. The H200 runs live in ``reports/hil/``.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as _dt
import json
import os
import platform
import re
import socket
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import pytest

#: Environment variable read when ``--gpumem-device`` is not given.
ENV_VAR = "GPUMEM_DEVICE"

#: Devices used when neither ``--gpumem-device`` nor ``GPUMEM_DEVICE`` says otherwise:
#: unified memory without VMM (2 GB Jetson), a small PCIe card, an A100 and the H200.
DEFAULT_DEVICE_SPECS: tuple[str, ...] = (
    "sim:jetson-nano-2gb",
    "sim:t4-16gb",
    "sim:a100-80gb",
    "sim:h200-141gb",
)

#: ``--gpumem-device sim:all`` expands to every built-in simulated profile.
ALL_SIMS = "sim:all"

_MARKERS = {
    "requires_vmm": "requires_vmm: skip on devices without virtual memory management (cuMemCreate/cuMemMap)",
    "sim_only": "sim_only: runs only on simulated devices (skipped on real GPUs)",
    "cuda": "cuda: needs a real CUDA device (runs only when --gpumem-device names one)",
}


@dataclasses.dataclass
class _HilState:
    specs: list[str]
    source: str
    record_dir: Path | None
    started_s: float = dataclasses.field(default_factory=time.time)
    started_utc: _dt.datetime = dataclasses.field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc))
    properties: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    open_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    per_device: dict[str, collections.Counter] = dataclasses.field(default_factory=dict)
    failed: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    nodeid_spec: dict[str, str] = dataclasses.field(default_factory=dict)
    record_paths: list[Path] = dataclasses.field(default_factory=list)
    warned_no_leak_check: set[str] = dataclasses.field(default_factory=set)


_STATE_KEY = pytest.StashKey[_HilState]()
_ACTIVE_NAME = "gpumem_hil_active"
_CALL_REPORT_KEY = pytest.StashKey[Any]()


# -- options and configuration ---------------------------------------------------------------------
#: The ini key (``[tool.pytest.ini_options]``, ``pytest.ini``) by which a project opts in.
INI_KEY = "gpumem_hil"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(INI_KEY, type="bool", default=False,
                  help="enable gpumem's device fixtures, their parametrisation over --gpumem-device, its markers and "
                       "report header in this project (they are off unless a project sets this or passes "
                       "--gpumem-device)")
    group = parser.getgroup("gpumem", "gpumem hardware-in-the-loop (device-parametrised tests)")
    group.addoption(
        "--gpumem-device",
        action="append",
        dest="gpumem_devices",
        default=[],
        metavar="SPEC",
        help=(
            "device(s) that tests using the 'device' fixture run on; repeat the option or separate "
            "specs with commas. 'sim:<profile>[?options]' is a simulated GPU (e.g. sim:t4-16gb, "
            "sim:h200-141gb?pressure=spikes&seed=3), 'sim:all' every built-in profile, 'cuda:<index>' "
            f"a real GPU (needs gpumem[cuda12] or gpumem[cuda13]). Default: ${ENV_VAR} if set, else "
            + ",".join(DEFAULT_DEVICE_SPECS) + f". Giving it enables the plugin in this run (as the ini key "
            f"{INI_KEY} = true does)."
        ),
    )
    group.addoption(
        "--gpumem-record",
        dest="gpumem_record",
        default=None,
        metavar="DIR",
        help=(
            "at the end of the session write a record of the run into DIR "
            "(contract-<device>-<date>.json and .md): devices and their properties, pass/fail/skip/error "
            "counts, date (UTC), host, versions and the failed test ids. The lead keeps H200 runs in reports/hil/."
        ),
    )


def split_specs(values: Iterable[str]) -> list[str]:
    """Flatten repeated and comma-separated spec values, expand ``sim:all``, drop duplicates (order kept)."""
    out: list[str] = []
    for value in values:
        for part in str(value).split(","):
            spec = part.strip()
            if not spec:
                continue
            if spec.lower() == ALL_SIMS:
                from gpumem import sim

                expanded = [f"sim:{name}" for name in sim.profile_names()]
            else:
                expanded = [spec]
            for s in expanded:
                if s not in out:
                    out.append(s)
    return out


def _validate_specs(specs: list[str], source: str) -> None:
    from gpumem import GpumemError, parse_spec
    from gpumem.device import DeviceKind

    for spec in specs:
        try:
            parsed = parse_spec(spec)
            if parsed.kind is DeviceKind.SIM:
                from gpumem import sim

                sim.get_profile(parsed.target)
        except GpumemError as exc:
            raise pytest.UsageError(f"{source}: bad device spec {spec!r}: {exc}") from None


def enabled(config: pytest.Config) -> bool:
    """Whether this run opted in: ``--gpumem-device`` given, or the ini key ``gpumem_hil`` true."""
    if config.getoption("gpumem_devices", default=None):
        return True
    try:
        return bool(config.getini(INI_KEY))
    except ValueError:  # pragma: no cover - the key is always registered by pytest_addoption
        return False


def pytest_configure(config: pytest.Config) -> None:
    if not enabled(config) or config.pluginmanager.has_plugin(_ACTIVE_NAME):
        return
    known = {line.split(":", 1)[0].strip() for line in config.getini("markers")}
    for name, line in _MARKERS.items():
        if name not in known:
            config.addinivalue_line("markers", line)

    given = config.getoption("gpumem_devices", default=None) or []
    if given:
        specs, source = split_specs(given), "--gpumem-device"
    elif os.environ.get(ENV_VAR, "").strip():
        specs, source = split_specs([os.environ[ENV_VAR]]), ENV_VAR
    else:
        specs, source = list(DEFAULT_DEVICE_SPECS), "default"
    if not specs:
        raise pytest.UsageError(f"{source}: no device spec given")
    if source != "default" and not getattr(config.option, "help", False):
        _validate_specs(specs, source)
    record = config.getoption("gpumem_record", default=None)
    config.stash[_STATE_KEY] = _HilState(specs=specs, source=source,
                                         record_dir=None if record is None else _record_dir(record))
    config.pluginmanager.register(GpumemHil(), _ACTIVE_NAME)


def _record_dir(value: str) -> Path:
    """``--gpumem-record``'s directory, refused before any test runs when it cannot be one (empty, a file,
    or below a file): the record is written at the end of the session, after a run that may take hours."""
    if not value.strip():
        raise pytest.UsageError("--gpumem-record: no directory given")
    directory = Path(value)
    for path in (directory, *directory.parents):
        if path.exists() and not path.is_dir():
            raise pytest.UsageError(f"--gpumem-record: {str(path)!r} is a file, not a directory: the record "
                                    f"could not be written into {value!r}")
    return directory


def _state(config: pytest.Config) -> _HilState:
    return config.stash[_STATE_KEY]


# -- parametrisation and markers ---------------------------------------------------------------------
def _spec_kind(spec: str) -> str:
    return spec.partition(":")[0].strip().lower()


def _parametrize_argnames(marker: pytest.Mark) -> list[str]:
    names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
    if isinstance(names, str):
        return [n.strip() for n in names.split(",")]
    return list(names)


def _generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device_spec" not in metafunc.fixturenames:
        return
    for marker in metafunc.definition.iter_markers("parametrize"):
        if "device_spec" in _parametrize_argnames(marker):
            return  # the test chose its own devices
    fixturedefs = getattr(metafunc, "_arg2fixturedefs", {}).get("device_spec") or ()
    if fixturedefs and fixturedefs[-1].params is not None:
        return  # a conftest overrides device_spec with a parametrised fixture of its own
    specs = _state(metafunc.config).specs
    metafunc.parametrize("device_spec", specs, ids=specs)


def _sim_vmm_supported(spec: str) -> bool | None:
    """Whether a simulated spec's profile supports VMM (None when that cannot be told without opening it)."""
    try:
        from gpumem import sim
        from gpumem import parse_spec

        return sim.get_profile(parse_spec(spec).target).vmm_supported
    except Exception:  # noqa: BLE001 - the device fixture reports the real error
        return None


def _collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = _state(config)
    any_cuda = any(_spec_kind(s) == "cuda" for s in state.specs)
    for item in items:
        callspec = getattr(item, "callspec", None)
        spec = callspec.params.get("device_spec") if callspec is not None else None
        if spec is not None:
            state.nodeid_spec[item.nodeid] = spec
        if spec is None:
            if item.get_closest_marker("cuda") and not any_cuda:
                item.add_marker(pytest.mark.skip(reason="needs a real CUDA device (--gpumem-device cuda:N)"))
            continue
        kind = _spec_kind(spec)
        if item.get_closest_marker("sim_only") and kind != "sim":
            item.add_marker(pytest.mark.skip(reason=f"sim_only: {spec} is a real device"))
        elif item.get_closest_marker("cuda") and kind != "cuda":
            item.add_marker(pytest.mark.skip(reason=f"cuda: {spec} is not a real device"))
        elif item.get_closest_marker("requires_vmm") and kind == "sim" and _sim_vmm_supported(spec) is False:
            item.add_marker(pytest.mark.skip(reason=f"requires_vmm: {spec} does not support VMM"))


# -- fixtures ------------------------------------------------------------------------------------------
def live_objects(dev: Any) -> int | None:
    """What a device holds for the program right now: live ``malloc`` allocations, mappings and reservations.

    Duck-typed, so that any :class:`gpumem.Device` can take part: ``n_allocations`` (an int
    attribute or property) and, where the device has them, ``mapping_ranges()`` and
    ``reservation_ranges()``. None when the device has no ``n_allocations``.
    """
    n = getattr(dev, "n_allocations", None)
    if callable(n):
        n = n()
    if not isinstance(n, int):
        return None
    for name in ("mapping_ranges", "reservation_ranges"):
        ranges = getattr(dev, name, None)
        if callable(ranges):
            n += len(ranges())
    return n


def _properties_dict(props: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(props):
        d = dataclasses.asdict(props)
    else:  # pragma: no cover - every gpumem device returns the dataclass
        d = {"name": str(getattr(props, "name", props))}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _device(request: pytest.FixtureRequest, device_spec: str) -> Iterator[Any]:
    """A freshly opened device for ``device_spec``, closed after the test.

    After a passing test the fixture checks the test released everything it allocated or
    mapped (see :func:`live_objects`); a leak is reported as an error of the test.
    """
    import gpumem

    state = _state(request.config)
    try:
        dev = gpumem.open_device(device_spec)
    except Exception as exc:
        state.open_errors.setdefault(device_spec, f"{type(exc).__name__}: {exc}")
        raise
    try:
        props = dev.properties()
        state.properties.setdefault(device_spec, _properties_dict(props))
        if request.node.get_closest_marker("requires_vmm") and not props.vmm_supported:
            pytest.skip(f"requires_vmm: {device_spec} ({props.name}) does not support VMM")
        baseline = live_objects(dev)
        if baseline is None and device_spec not in state.warned_no_leak_check:
            state.warned_no_leak_check.add(device_spec)
            warnings.warn(f"gpumem_hil: {type(dev).__name__} exposes no n_allocations; "
                          f"leak checks are off for {device_spec}", stacklevel=1)
        yield dev
        report = request.node.stash.get(_CALL_REPORT_KEY, None)
        if baseline is not None and report is not None and report.passed:
            left = live_objects(dev)
            if left is not None and left != baseline:
                pytest.fail(f"{device_spec}: the test left {left - baseline} live allocation(s), mapping(s) or "
                            f"reservation(s) behind (had {baseline} before, {left} after)", pytrace=False)
    finally:
        dev.close()


# -- recording -----------------------------------------------------------------------------------------
class _Recorder:
    """Counts outcomes the way the terminal summary does (via ``pytest_report_teststatus``)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        state = _state(self.config)
        res = self.config.hook.pytest_report_teststatus(report=report, config=self.config)
        category = res[0] if res else ""
        if not category:
            return
        key = {"error": "errors"}.get(category, category)
        state.counts[key] += 1
        spec = state.nodeid_spec.get(report.nodeid)
        if spec is not None:
            state.per_device.setdefault(spec, collections.Counter())[key] += 1
        if category == "failed" and report.nodeid not in state.failed:
            state.failed.append(report.nodeid)
        elif category == "error" and report.nodeid not in state.errors:
            state.errors.append(report.nodeid)


def _sessionstart(session: pytest.Session) -> None:
    config = session.config
    if config.stash.get(_STATE_KEY, None) is not None and not config.pluginmanager.has_plugin("gpumem_hil_recorder"):
        config.pluginmanager.register(_Recorder(config), "gpumem_hil_recorder")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _versions() -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {"python": platform.python_version()}
    try:
        import gpumem

        out["gpumem"] = gpumem.__version__
    except Exception:  # noqa: BLE001
        pass
    for dist in ("pytest", "numpy", "simpy", "hypothesis", "cupy-cuda12x", "cupy-cuda13x", "cuda-bindings",
                 "nvidia-ml-py"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


GIT_COMMIT_ENV = "GPUMEM_GIT_COMMIT"
"""Environment variable that names the commit a record is of, where the checkout's own git metadata cannot
be trusted (a copy of a working tree sent to a GPU runner can carry a stale ``.git``)."""


def _git_commit(root: Path) -> str | None:
    """The commit the record is of: ``$GPUMEM_GIT_COMMIT`` if set, else ``git rev-parse HEAD`` in ``root``,
    with ``+dirty`` appended when tracked files differ from that commit (so a record of a modified tree, or
    of a copy whose ``.git`` is stale, never claims to be of a clean commit); None without git."""
    given = os.environ.get(GIT_COMMIT_ENV, "").strip()
    if given:
        return given
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if res.returncode != 0 or not res.stdout.strip():
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = res.stdout.strip()
    if status.returncode == 0 and status.stdout.strip():
        commit += "+dirty"
    return commit


def _fill_missing_properties(state: _HilState) -> None:
    """Open the devices no test opened, to name them in the record."""
    for spec in state.specs:
        if spec in state.properties or spec in state.open_errors:
            continue
        try:
            import gpumem

            with gpumem.open_device(spec) as dev:
                state.properties[spec] = _properties_dict(dev.properties())
        except Exception as exc:  # noqa: BLE001 - recorded, not raised
            state.open_errors[spec] = f"{type(exc).__name__}: {exc}"


def build_record(config: pytest.Config, exitstatus: int) -> dict[str, Any]:
    """The JSON record of this session (see the module docstring)."""
    state = _state(config)
    _fill_missing_properties(state)
    devices = []
    for spec in state.specs:
        props = state.properties.get(spec)
        devices.append({
            "spec": spec,
            "kind": _spec_kind(spec),
            "name": props.get("name") if props else None,
            "properties": props,
            "open_error": state.open_errors.get(spec),
            "counts": dict(state.per_device.get(spec, {})),
        })
    counts = {k: state.counts.get(k, 0) for k in ("passed", "failed", "skipped", "errors", "xfailed", "xpassed")}
    counts.update({k: v for k, v in state.counts.items() if k not in counts})
    finished = _dt.datetime.now(_dt.timezone.utc)
    return {
        "record": "gpumem-hil-run",
        "schema_version": 1,
        "date": state.started_utc.isoformat(timespec="seconds"),
        "finished": finished.isoformat(timespec="seconds"),
        "duration_s": round(time.time() - state.started_s, 3),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "versions": _versions(),
        "git_commit": _git_commit(Path(str(config.rootpath))),
        "device_source": state.source,
        "devices": devices,
        "counts": counts,
        "exit_status": int(exitstatus),
        "failed": list(state.failed),
        "errors": list(state.errors),
        "command": " ".join(["pytest", *config.invocation_params.args]),
    }


def record_stem(record: dict[str, Any]) -> str:
    """``contract-<device-name-slug>-<YYYY-MM-DD>`` (``sim-`` marks simulated devices)."""
    devices = record["devices"]

    def name(d: dict[str, Any]) -> str:
        base = _slug(d["name"] or d["spec"])
        return f"sim-{base}" if d["kind"] == "sim" else base

    device_part = name(devices[0]) if devices else "no-device"
    if len(devices) > 1:
        device_part += f"-and-{len(devices) - 1}-more"
    return f"contract-{device_part}-{record['date'][:10]}"


def _fmt_bytes(n: Any) -> str:
    if not isinstance(n, int):
        return "?"
    from gpumem.units import format_bytes

    return f"{format_bytes(n)} ({n:,} B)"


def render_markdown(record: dict[str, Any]) -> str:
    """A short human-readable twin of the JSON record."""
    c = record["counts"]
    lines = [
        f"# gpumem run {record['date']}",
        "",
        f"- host: `{record['host']}` ({record['platform']})",
        f"- versions: " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()),
        f"- git commit: `{record['git_commit']}`" if record["git_commit"] else "- git commit: unknown",
        f"- command: `{record['command']}`",
        f"- duration: {record['duration_s']:.1f} s, exit status {record['exit_status']}",
        "",
        "| device | name | total | compute capability | VMM | passed | failed | skipped | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in record["devices"]:
        p = d["properties"] or {}
        dc = d["counts"]
        cc = ".".join(str(x) for x in p.get("compute_capability", ())) or "?"
        lines.append(
            f"| `{d['spec']}` | {d['name'] or d['open_error'] or '?'} | {_fmt_bytes(p.get('total_nbytes'))} | {cc} "
            f"| {p.get('vmm_supported', '?')} | {dc.get('passed', 0)} | {dc.get('failed', 0)} "
            f"| {dc.get('skipped', 0)} | {dc.get('errors', 0)} |"
        )
    lines += [
        "",
        f"**Total:** {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, {c['errors']} errors"
        + (f", {c['xfailed']} xfailed" if c.get("xfailed") else "")
        + (f", {c['xpassed']} xpassed" if c.get("xpassed") else ""),
        "",
    ]
    if record["failed"] or record["errors"]:
        lines.append("## Failed")
        lines.append("")
        lines += [f"- `{nodeid}`" for nodeid in record["failed"]]
        lines += [f"- `{nodeid}` (error)" for nodeid in record["errors"]]
        lines.append("")
    return "\n".join(lines)


def write_record(record: dict[str, Any], directory: Path) -> list[Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``directory``; never overwrite an earlier record."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = record_stem(record)
    candidate, n = stem, 1
    while (directory / f"{candidate}.json").exists() or (directory / f"{candidate}.md").exists():
        n += 1
        candidate = f"{stem}-{n}"
    json_path = directory / f"{candidate}.json"
    md_path = directory / f"{candidate}.md"
    json_path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    md_path.write_text(render_markdown(record), encoding="utf-8")
    return [json_path, md_path]


def _sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    state = config.stash.get(_STATE_KEY, None)
    if state is None or state.record_dir is None or hasattr(config, "workerinput"):
        return  # not recording, or an xdist worker (the controller records)
    record = build_record(config, int(exitstatus))
    state.record_paths = write_record(record, state.record_dir)


def _terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE_KEY, None)
    if state is not None and state.record_paths:
        terminalreporter.write_line("gpumem: recorded this run in " + ", ".join(str(p) for p in state.record_paths))


class GpumemHil:
    """The plugin's effect: registered (as ``gpumem_hil_active``) only in a run that opted in
    (see the module docstring), so that other projects' runs see none of its fixtures and hooks."""

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        state = config.stash.get(_STATE_KEY, None)
        if state is None:
            return None
        return f"gpumem devices ({state.source}): {', '.join(state.specs)}"

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        _generate_tests(metafunc)

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        _collection_modifyitems(config, items)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
        outcome = yield
        report = outcome.get_result()
        if report.when == "call":
            item.stash[_CALL_REPORT_KEY] = report

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        _sessionstart(session)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        _sessionfinish(session, exitstatus)

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        _terminal_summary(terminalreporter, exitstatus, config)

    @pytest.fixture(scope="session")
    def gpumem_device_specs(self, pytestconfig: pytest.Config) -> list[str]:
        """The device specs this session runs device-parametrised tests on."""
        return list(_state(pytestconfig).specs)

    @pytest.fixture
    def device_spec(self, pytestconfig: pytest.Config) -> str:
        """The device spec of this test run (parametrised over ``--gpumem-device``); the first spec otherwise."""
        return _state(pytestconfig).specs[0]

    @pytest.fixture
    def device(self, request: pytest.FixtureRequest, device_spec: str) -> Iterator[Any]:
        """A freshly opened device for ``device_spec``, closed after the test.

        After a passing test the fixture checks the test released everything it allocated or
        mapped (see :func:`live_objects`); a leak is reported as an error of the test.
        """
        yield from _device(request, device_spec)


__all__ = ["DEFAULT_DEVICE_SPECS", "ENV_VAR", "INI_KEY", "GpumemHil", "enabled", "split_specs", "live_objects", "build_record", "record_stem",
           "render_markdown", "write_record"]


def segments_made(trace: Any, policy: str = "pytorch", device: str = "sim:h200-141gb") -> tuple[list[int], int]:
    """Replay ``trace``'s allocations and frees on a Python-engine ``CachingAllocator`` under ``policy``: the
    sizes of the segments it makes, in order, and its peak reserved bytes (for comparing with the
    ``segment_alloc`` entries of a PyTorch snapshot)."""
    from .allocator import CachingAllocator
    from .specs import open_device

    dev = open_device(device)
    a = CachingAllocator(dev, policy, engine="python")
    made: list[int] = []
    new_segment = a.backing.new_segment

    def spy(small: bool, stream: int, nbytes: int) -> Any:
        seg = new_segment(small, stream, nbytes)
        made.append(seg.nbytes)
        return seg

    a.backing.new_segment = spy
    try:
        ptrs = {}
        for kind, i, n in zip(trace.kinds, trace.alloc_ids, trace.nbytes):
            if kind == 0:
                ptrs[i] = a.allocate(int(n))
            else:
                a.free(ptrs.pop(i))
        return made, a.stats.peak_reserved_nbytes
    finally:
        a.close()
        dev.close()

