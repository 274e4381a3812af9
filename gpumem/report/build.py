"""Build a report: replay a trace under several policies on several devices, draw the figures, write
``index.html`` with the numbers behind every figure as JSON and CSV.

Note [A report is written whole or not at all]
----------------------------------------------
Everything is written into a fresh folder beside the destination (``.NAME.tmp-*``), which is renamed to
the destination only once every file is there; any error removes it. So a bad trace, a policy that
fails, or Ctrl-C leaves no half-written report, and an existing report is replaced (``force=True``) only
by a complete one.

Note [Reproducible reports]
---------------------------
The replays are deterministic (simulated devices, seeded pressure scenarios), the figures carry no
timestamp (PNG metadata off) and the JSON is written with sorted keys, so the same trace and options give
the same numbers and the same files, except the time per operation, which is measured
(``ns_per_op``, the only wall-clock figure).
"""

from __future__ import annotations

import csv
import html
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..allocator.policy import POLICIES
from ..outputs import csv_row, replace_atomically, resolve_output
from ..errors import InternalError, InvalidArgumentError
from ..progress import ProgressBar
from ..specs import open_device, parse_spec
from ..trace import Trace, detect_format, load_trace
from ..trace.limits import printable
from ..units import format_bytes
from . import figures
from .runs import FitCell, Occupancy, PolicyRun, occupancy_at, peak_live_op, run_policy, smallest_limit
from .sites import SiteTable, live_by_site, snapshot_sites

log = logging.getLogger(__name__)

DEFAULT_DEVICES = ("sim:h200-141gb",)
FIT_DEVICES = ("sim:jetson-nano-2gb", "sim:gtx-1050-2gb", "sim:jetson-nano-4gb", "sim:gtx-1650-4gb",
               "sim:rtx-2060-6gb", "sim:rtx-3060-12gb", "sim:t4-16gb", "sim:rtx-4090-24gb", "sim:a100-40gb",
               "sim:a100-80gb", "sim:h200-141gb")
"""The fit matrix's spread of profiles, 2 GB to 141 GB (with and without virtual memory), by default."""
SAMPLES = 1000
"""Samples per replay in the timeline figures."""


class ReportExistsError(InvalidArgumentError):
    """The report's folder exists and replacing it was not asked for."""


@dataclass(frozen=True)
class ReportOptions:
    """What a report replays: devices (specs), policies (names), an optional pressure scenario for the
    simulated devices, and whether out-of-memory errors stop a replay."""

    devices: tuple[str, ...] = DEFAULT_DEVICES
    policies: tuple[str, ...] = tuple(POLICIES)
    pressure: str | None = None
    stop_on_oom: bool = True
    fit: bool = True
    """Bisect the smallest memory limit per device and policy (the fit matrix's "needs")."""
    fit_devices: tuple[str, ...] = ()
    """Further device profiles of the fit matrix, decided by the smallest limit (no replay of their own)."""
    samples: int = SAMPLES
    trace_format: str | None = None
    device_index: int | None = None
    gpu_timing: str | None = None
    """How the program's GPU work runs beside each replay (:func:`gpumem.replay.replay`; None: the default)."""
    step_marks: bool = True
    """Read the trace's step marks (False: a run without step plans, as ``gpumem replay --no-step-marks``)."""

    def __post_init__(self) -> None:
        if not self.devices:
            raise InvalidArgumentError("a report needs at least one device")
        if not self.policies:
            raise InvalidArgumentError("a report needs at least one policy")
        for p in self.policies:
            if p not in POLICIES:
                raise InvalidArgumentError(f"unknown allocator policy {p!r}; choose one of {', '.join(POLICIES)}")
        if len(set(self.policies)) != len(self.policies) or len(set(self.devices)) != len(self.devices):
            raise InvalidArgumentError("each device and each policy may be named only once")
        if self.pressure is not None:
            from ..sim.pressure import PRESET_NAMES

            if self.pressure not in PRESET_NAMES:
                raise InvalidArgumentError(f"unknown pressure scenario {self.pressure!r}; choose one of "
                                           f"{', '.join(PRESET_NAMES)}")
        if self.samples < 10:
            raise InvalidArgumentError("samples must be at least 10")
        if not isinstance(self.step_marks, bool):
            raise InvalidArgumentError(f"step_marks must be True or False, got {self.step_marks!r}")


@dataclass
class ReportResult:
    """What :func:`build_report` wrote."""

    out_dir: Path
    trace: str
    summary: list[dict[str, Any]]
    files: list[str] = field(default_factory=list)


def with_pressure(spec: str, pressure: str | None) -> str:
    """``spec`` with the pressure scenario added (simulated devices only)."""
    if pressure is None:
        return spec
    from ..specs import DeviceKind

    parsed = parse_spec(spec)
    if parsed.kind is not DeviceKind.SIM:
        raise InvalidArgumentError(f"--pressure applies to simulated devices only, not {spec}")
    if "pressure" in parsed.options:
        raise InvalidArgumentError(f"{spec} already names a pressure scenario; give it once")
    return spec + ("&" if "?" in spec else "?") + f"pressure={pressure}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-") or "device"


def _x_axis(trace: Trace, runs: list[PolicyRun]) -> tuple[dict[str, np.ndarray], str]:
    """The x values of every run's samples: the trace's own clock where it has one, else the operation."""
    times = np.asarray(trace.times_us, dtype=np.float64)
    use_time = len(times) > 1 and bool(np.isfinite(times).all()) and float(times.max() - times.min()) > 0
    xs: dict[str, np.ndarray] = {}
    for r in runs:
        ops = np.asarray(r.timeline.op, dtype=np.int64)
        if use_time:
            idx = np.clip(ops - 1, 0, len(times) - 1)
            xs[r.policy] = np.where(ops > 0, (times[idx] - times[0]) / 1e6, 0.0)
        else:
            xs[r.policy] = ops.astype(np.float64)
    return xs, ("trace time (s)" if use_time else "operations replayed")


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        if not rows:
            return
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(csv_row(r) for r in rows)  # Note [Spreadsheet formulas in CSV cells]


def _write_json(path: Path, data: Any, indent: int | None = 1) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=indent, sort_keys=True, separators=None if indent else (",", ":"))
        f.write("\n")


def summary_row(run: PolicyRun, smallest: int | None) -> dict[str, Any]:
    """One row of the summary table: the plain replay's JSON fields plus the smallest limit."""
    row: dict[str, Any] = {"device": run.device, "policy": run.policy}
    data = run.result.as_json() if run.result is not None else {}
    row.update({k: data.get(k) for k in SUMMARY_FIELDS})
    if run.result is None:
        row.update(status="unsupported", reason=run.unsupported, smallest_limit_bytes=None)
        return row
    row["status"] = "runs" if run.result.ooms == 0 else "out of memory"
    row["reason"] = run.result.oom_message
    row["smallest_limit_bytes"] = smallest
    return row


SUMMARY_FIELDS = ("trace", "n_ops", "completed_ops", "peak_live_bytes", "peak_reserved_bytes", "overhead", "ooms",
                  "oom_op", "ns_per_op", "sim_time_s", "device_calls", "cache_hits", "cache_misses",
                  "external_fragmentation_at_end", "engine", "gpu_timing", "trace_peak_live_bytes")
"""The fields of a summary row taken from :meth:`gpumem.replay.ReplayResult.as_json` (equal to a plain replay's,
``ns_per_op`` excepted: it is measured)."""


def build_report(trace_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 options: ReportOptions | None = None, *, force: bool = False,
                 progress: bool | None = None, command: str | None = None) -> ReportResult:
    """Replay ``trace_path`` as ``options`` say and write the report to ``out_dir`` (Note [A report is
    written whole or not at all]). Raises :class:`ReportExistsError` when ``out_dir`` exists and not
    ``force``; trace errors (:class:`~gpumem.errors.TraceFormatError`, ``FileNotFoundError``) propagate with
    nothing written."""
    options = options or ReportOptions()
    out = Path(out_dir)
    if out.name not in ("", ".", ".."):  # the folder resolved first (Note [An output is replaced only by a complete one])
        out = resolve_output(out)
    if out.exists() and not force:
        raise ReportExistsError(f"{out} exists; choose another folder or replace it (--force)")
    check_report_out(out, trace_path)
    figures.check_matplotlib()
    trace = load_trace(trace_path, format=options.trace_format, device=options.device_index,
                       step_marks=options.step_marks)
    if trace.n_ops == 0:
        raise InvalidArgumentError(f"the trace {trace_path} has no allocations or frees: nothing to report")
    specs = [with_pressure(d, options.pressure) for d in options.devices]
    for spec in specs:  # a bad spec fails now, before any replay
        open_device(spec).close()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a report is an ordinary folder
        result = _build(trace, str(trace_path), specs, options, tmp, progress, command)
        _install(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.out_dir = out
    return result


#: Files a report writes: fixed names, and the per-device figures and numbers.
_REPORT_NAMES = frozenset({"index.html", "report.json", "summary.json", "summary.csv", "fig4-sites.png",
                           "sites.json", "sites.csv", "fig5-fit.png", "fit.json", "fit.csv"})
_REPORT_PATTERN = re.compile(r"(fig[1-3]-(timeline|occupancy|fragmentation)-[A-Za-z0-9-]+\.png"
                             r"|(timeline|occupancy|fragmentation)-[A-Za-z0-9-]+\.(json|csv))")


def _is_report_folder(out: Path) -> bool:
    """True when ``out`` is a real folder holding an earlier gpumem report and nothing else: a
    ``report.json`` with gpumem's report signature, and only plain files with the names a report writes."""
    if out.is_symlink() or not out.is_dir():
        return False
    try:
        entries = list(out.iterdir())
        data = json.loads((out / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    meta = data.get("meta") if isinstance(data, dict) else None
    if not isinstance(meta, dict) or "gpumem_version" not in meta or "trace" not in meta \
            or not {"summary", "fit", "figures"} <= set(data):
        return False
    return all(not e.is_symlink() and e.is_file()
               and (e.name in _REPORT_NAMES or _REPORT_PATTERN.fullmatch(e.name)) for e in entries)


def check_report_out(out: Path, trace_path: "str | os.PathLike[str] | None" = None) -> None:
    """Raise :class:`ReportExistsError` unless ``out`` can take a report: a new path with a name, or
    (``--force``) an earlier gpumem report's folder, which is all that is ever replaced; never the trace,
    the folder holding it, a file, or a folder with anything else in it. Checked before any replay."""
    out = Path(out)
    if out.name in ("", ".", "..") or os.path.realpath(out) == os.path.realpath(os.sep):
        raise ReportExistsError(f"--out {out}: give the report a folder of its own (a new name)")
    if not (out.exists() or out.is_symlink()):
        return
    real = os.path.realpath(out)
    if trace_path is not None:
        trace_real = os.path.realpath(trace_path)
        if trace_real == real or trace_real.startswith(real.rstrip(os.sep) + os.sep):
            raise ReportExistsError(f"--out {out}: is or holds the trace being read; nothing was replaced")
    if not _is_report_folder(out):
        raise ReportExistsError(f"--out {out}: exists and is not an earlier gpumem report (only a report's "
                                "folder is replaced by --force); choose a new folder")


def _install(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished folder to ``out`` (replacing an old one only once the new one is complete)."""
    if out.exists() or out.is_symlink():
        if not force:
            raise ReportExistsError(f"{out} appeared while the report was being built; nothing was replaced")
        check_report_out(out)
    replace_atomically(tmp, out)


def _build(trace: Trace, trace_path: str, specs: list[str], options: ReportOptions, tmp: Path,
           progress: bool | None, command: str | None) -> ReportResult:
    n = trace.n_ops
    peak_op = peak_live_op(trace)
    n_runs = len(specs) * len(options.policies)
    fit_steps = 8 * len(options.policies) if options.fit else 0
    bar = ProgressBar(n * n_runs + peak_op * n_runs + n * fit_steps, f"report {printable(trace.name)}", enabled=progress)
    done = [0]

    def advance(k: int) -> None:
        done[0] += k
        bar.update(min(done[0], bar.total - 1))

    try:
        fmt = options.trace_format or detect_format(trace_path)
        sites = snapshot_sites(trace_path, trace, options.device_index) if fmt == "pytorch-snapshot" else None
        site_table = live_by_site(trace, peak_op, sites)
        files: list[str] = []
        per_device: list[dict[str, Any]] = []
        all_runs: list[PolicyRun] = []
        groups: list[list[PolicyRun]] = []
        for spec in specs:
            runs = [run_policy(trace, spec, p, samples=options.samples, stop_on_oom=options.stop_on_oom,
                               on_progress=advance, gpu_timing=options.gpu_timing) for p in options.policies]
            occs: list[tuple[str, Occupancy | None]] = []
            for r in runs:
                occs.append((r.policy, occupancy_at(trace, spec, r.policy, peak_op, options.gpu_timing)
                             if r.result else None))
                advance(peak_op)
            all_runs.extend(runs)
            groups.append(runs)
            per_device.append(_device_outputs(trace, spec, runs, occs, tmp, files))
        fit_cells, smallest = _fit(trace, options, groups, lambda: advance(n))
        summary = [summary_row(r, smallest.get((r.device, r.policy))) for r in all_runs]
        _write_json(tmp / "summary.json", summary)
        _write_csv(tmp / "summary.csv", summary)
        files += ["summary.json", "summary.csv"]
        # (4) sites
        title = (f"{trace.name}: who holds the memory at the peak of live data (op {peak_op:,}), by "
                 + ("allocation site" if site_table.kind == "stack frame" else "requested size (no stacks)"))
        figures.sites_figure(tmp / "fig4-sites.png", site_table, title)
        rows = [asdict(s) for s in site_table.sites]
        _write_json(tmp / "sites.json", {"op": site_table.op, "kind": site_table.kind,
                                         "total_live_bytes": site_table.total_live_nbytes, "sites": rows})
        _write_csv(tmp / "sites.csv", rows)
        files += ["fig4-sites.png", "sites.json", "sites.csv"]
        # (5) fit matrix
        devices = list(dict.fromkeys(c.device for c in fit_cells))
        figures.fit_figure(tmp / "fig5-fit.png", fit_cells, devices, list(options.policies),
                           f"{trace.name}: does it fit? (peak live {format_bytes(trace.peak_live_nbytes)})")
        fit_rows = [asdict(c) for c in fit_cells]
        _write_json(tmp / "fit.json", fit_rows)
        _write_csv(tmp / "fit.csv", fit_rows)
        files += ["fig5-fit.png", "fit.json", "fit.csv"]
        meta = {"trace": trace.name, "trace_file": Path(trace_path).name, "format": fmt,
                "trace_summary": str(trace.summary()), "peak_live_op": peak_op, "devices": specs,
                "policies": list(options.policies), "pressure": options.pressure,
                "stop_on_oom": options.stop_on_oom, "gpumem_version": __version__, "command": command}
        _write_json(tmp / "report.json", {"meta": meta, "summary": summary, "fit": fit_rows,
                                          "sites": rows, "figures": per_device})
        files.append("report.json")
        (tmp / "index.html").write_text(_html(meta, summary, per_device, site_table, fit_rows, files))
        files.insert(0, "index.html")
        bar.update(bar.total)
    finally:
        bar.close()
    return ReportResult(out_dir=tmp, trace=trace.name, summary=summary, files=files)


def _kind(spec: str) -> tuple[int, bool, Any]:
    """A device's kind for the smallest limit (granularity, virtual memory) and its profile (None when real)."""
    dev = open_device(spec)
    try:
        profile = getattr(dev, "profile", None)
        return dev.granularity_nbytes, bool(dev.vmm_supported), profile
    finally:
        dev.close()


def _capacity(spec: str) -> int:
    """What ``spec`` can give an allocator: its free memory when opened."""
    dev = open_device(spec)
    try:
        return int(dev.mem_info().free_nbytes)
    finally:
        dev.close()


def _fit(trace: Trace, options: ReportOptions, groups: list[list[PolicyRun]],
         step: Any) -> tuple[list[FitCell], dict[tuple[str, str], int | None]]:
    """The fit matrix; the smallest limit is bisected without pressure, once per policy and kind of device
    (granularity, virtual memory), since a limit, not the device's size, decides it.

    The report's devices are decided by their replays; the further profiles of ``options.fit_devices`` by the
    smallest limit of their kind compared with the memory the profile can give (no replay of their own)."""
    cells: list[FitCell] = []
    smallest: dict[tuple[str, str], int | None] = {}
    cache: dict[tuple[Any, ...], int | None] = {}
    for runs, base in zip(groups, options.devices):
        key_dev = _kind(base)
        for r in runs:
            if r.result is None:
                cells.append(FitCell(r.device, r.policy, "unsupported", None, "replay"))
                continue
            value = None
            if options.fit:
                key = (r.policy, *key_dev[:2])
                if key not in cache:
                    cache[key] = _bisect_limit(trace, base, r, options, key_dev, step)
                value = cache[key]
            smallest[(r.device, r.policy)] = value
            cells.append(FitCell(r.device, r.policy, "runs" if r.result.ooms == 0 else "out of memory", value,
                                 "replay"))
    if not options.fit:
        return cells, smallest
    shown = {c.device for c in cells} | set(options.devices)
    extra = [d for d in options.fit_devices if d not in shown]
    for spec in extra:
        key_dev = _kind(spec)
        capacity = _capacity(spec)
        for policy in options.policies:
            key = (policy, *key_dev[:2])
            if key not in cache:
                cache[key] = _bisect_policy(trace, spec, policy, key_dev, step, options.gpu_timing)
            value = cache[key]
            if value is None:
                status = "unsupported" if _unsupported(spec, policy) else "out of memory"
            else:
                status = "runs" if value <= capacity else "out of memory"
            cells.append(FitCell(spec, policy, status, value, "limit"))
    return cells, smallest


def _unsupported(spec: str, policy: str) -> bool:
    """Whether ``policy`` cannot run on ``spec`` at all (e.g. virtual memory on a device without it)."""
    from ..errors import UnsupportedOperationError
    from ..allocator import make_allocator

    dev = open_device(spec)
    try:
        try:
            make_allocator(dev, policy).close()
        except UnsupportedOperationError:
            return True
        return False
    finally:
        dev.close()


BIG_TWIN = "sim:h200-141gb"
"""Where the smallest limit is bisected for a device too small for the trace (a limit, not the card's size,
decides whether the trace runs, so the answer holds for the smaller card too: it needs that much)."""


def _big_twin(profile: Any, trace: Trace) -> Any:
    """A simulated profile like ``profile`` (same kind) but large enough for ``trace``: the place to bisect the
    smallest limit of a device too small for it."""
    from ..sim import custom_profile, get_profile

    total = max(get_profile(BIG_TWIN.split(":", 1)[1]).total_nbytes, 4 * trace.peak_live_nbytes)
    return custom_profile(f"{profile.name}-twin", total, base=profile)


def _bisect_policy(trace: Trace, spec: str, policy: str, key_dev: tuple[int, bool, Any], step: Any,
                   gpu_timing: str | None = None) -> int | None:
    """The smallest limit of ``policy`` on a device of ``spec``'s kind, bisected on a big twin of it (the
    program's GPU work run as ``gpu_timing`` says)."""
    from ..errors import UnsupportedOperationError
    from ..replay import replay_trace

    profile = key_dev[2]
    if profile is None:  # a real device: bisect on it
        twin_kw: dict[str, Any] = {}
    else:
        twin_kw = {"profile": _big_twin(profile, trace)}
    dev = open_device(spec, **twin_kw)
    try:
        try:
            big = replay_trace(trace, dev, policy, progress=False, gpu_timing=gpu_timing)
        except UnsupportedOperationError:
            return None
    finally:
        dev.close()
    if big.ooms:
        return None
    return smallest_limit(trace, spec, policy, big.peak_reserved_bytes, on_step=step,
                          profile=twin_kw.get("profile"), gpu_timing=gpu_timing)


def _bisect_limit(trace: Trace, base: str, run: PolicyRun, options: ReportOptions,
                  key_dev: tuple[int, bool, Any], step: Any) -> int | None:
    """The smallest limit for ``run``'s policy: bisected on ``base`` (without pressure), or on a big twin of
    ``base`` (same kind of device, more memory) when the trace does not fit ``base`` at all."""
    from ..replay import replay_trace

    if run.result is None:
        raise InternalError(f"the {run.policy!r} run on {run.device!r} has no replay result to size the fit from")
    fits_at = run.result.peak_reserved_bytes
    if run.result.ooms or options.pressure is not None:
        plain = replay_trace(trace, base, run.policy, progress=False, gpu_timing=options.gpu_timing)
        fits_at = plain.peak_reserved_bytes if plain.ooms == 0 else 0
        if not fits_at:
            return _bisect_policy(trace, base, run.policy, key_dev, step, options.gpu_timing)
    return smallest_limit(trace, base, run.policy, fits_at, on_step=step, gpu_timing=options.gpu_timing)


def _device_outputs(trace: Trace, spec: str, runs: list[PolicyRun], occs: list[tuple[str, Occupancy | None]],
                    tmp: Path, files: list[str]) -> dict[str, Any]:
    """Figures (1)-(3) of one device and their numbers."""
    device = runs[0].device
    slug = _slug(device)
    xs, x_label = _x_axis(trace, runs)
    ran = [r for r in runs if r.result is not None]
    # (1) timeline
    f1 = f"fig1-timeline-{slug}.png"
    figures.timeline_figure(tmp / f1, runs, xs, x_label, f"{trace.name} on {device}: live and reserved memory")
    tl_rows = []
    columns: dict[str, Any] = {}
    for r in ran:
        tl = r.timeline
        x = [round(float(v), 6) for v in xs[r.policy]]
        frag = [round(v, 6) for v in tl.external_fragmentation]
        columns[r.policy] = {"op": tl.op, "x": x, "live_bytes": tl.live_nbytes, "reserved_bytes": tl.reserved_nbytes,
                             "external_fragmentation": frag, "largest_free_bytes": tl.largest_free_nbytes,
                             "tenant_bytes": tl.tenant_nbytes, "ooms": [asdict(o) for o in r.ooms],
                             "pressure_events": [asdict(e) for e in r.pressure]}
        for k in range(len(tl.op)):
            tl_rows.append({"policy": r.policy, "op": tl.op[k], "x": x[k], "live_bytes": tl.live_nbytes[k],
                            "reserved_bytes": tl.reserved_nbytes[k], "external_fragmentation": frag[k],
                            "largest_free_bytes": tl.largest_free_nbytes[k], "tenant_bytes": tl.tenant_nbytes[k]})
    # one object per policy, a list per column (sample k of every list is the state after op[k] operations)
    _write_json(tmp / f"timeline-{slug}.json", {"device": device, "x": x_label, "policies": columns}, indent=None)
    _write_csv(tmp / f"timeline-{slug}.csv", tl_rows)
    # (2) occupancy
    f2 = f"fig2-occupancy-{slug}.png"
    present = [(p, o) for p, o in occs if o is not None]
    at = present[0][1].op if present else 0
    figures.occupancy_figure(tmp / f2, present, f"{trace.name} on {device}: occupancy at the peak of live data "
                                                f"(after op {at:,})")
    occ_rows = []
    occ_json: dict[str, Any] = {}
    holes: dict[str, list[int]] = {}
    for p, o in present:
        hs: list[int] = []
        segs = []
        for s in o.segments:
            h = s.holes()
            hs += h
            row = {"policy": p, "base": s.base, "extent_bytes": s.extent_nbytes, "pool": "small" if s.small else "large",
                   "virtual": s.virtual, "live_bytes": s.live_nbytes, "mapped_bytes": s.mapped_nbytes,
                   "n_live_runs": len(s.live), "n_holes": len(h), "largest_hole_bytes": max(h, default=0)}
            occ_rows.append(row)
            segs.append(row)
        holes[p] = hs
        occ_json[p] = {"op": o.op, "stopped_by_oom": o.stopped_by_oom, "reserved_bytes": o.reserved_nbytes,
                       "segments": segs}
    _write_json(tmp / f"occupancy-{slug}.json", {"device": device, "policies": occ_json}, indent=None)
    _write_csv(tmp / f"occupancy-{slug}.csv", occ_rows)
    # (3) fragmentation
    f3 = f"fig3-fragmentation-{slug}.png"
    figures.fragmentation_figure(tmp / f3, runs, holes, xs, x_label,
                                 f"{trace.name} on {device}: free memory and fragmentation")
    frag_rows = []
    for p, hs in holes.items():
        sizes, counts = np.unique(np.asarray(hs, dtype=np.int64), return_counts=True)
        frag_rows += [{"policy": p, "hole_bytes": int(s), "count": int(c)} for s, c in zip(sizes, counts)]
    _write_json(tmp / f"fragmentation-{slug}.json",
                {"device": device, "holes_at_peak": frag_rows,
                 "external_fragmentation_over_time": "see timeline-" + slug + ".json"})
    _write_csv(tmp / f"fragmentation-{slug}.csv", frag_rows)
    files += [f1, f"timeline-{slug}.json", f"timeline-{slug}.csv", f2, f"occupancy-{slug}.json",
              f"occupancy-{slug}.csv", f3, f"fragmentation-{slug}.json", f"fragmentation-{slug}.csv"]
    return {"device": device, "spec": spec, "slug": slug, "figures": [f1, f2, f3]}


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:24px auto;
padding:0 16px;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:0.2em}h2{margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:4px}
img{max-width:100%;border:1px solid #eee}table{border-collapse:collapse;font-size:0.9em;margin:8px 0}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}th{background:#f4f4f4}td.l,th.l{text-align:left}
.meta{color:#555;font-size:0.92em}code{background:#f4f4f4;padding:1px 4px;border-radius:3px}
.files a{margin-right:10px}
"""


def _fmt_gib(v: Any) -> str:
    """A size in the unit that fits it (a 1 MiB trace read 0.00 in a GiB column)."""
    return "" if v is None else format_bytes(v)


def _html(meta: dict[str, Any], summary: list[dict[str, Any]], per_device: list[dict[str, Any]],
          sites: SiteTable, fit_rows: list[dict[str, Any]], files: list[str]) -> str:
    e = html.escape
    out = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>gpumem report: {e(meta['trace'])}</title>",
           f"<style>{_CSS}</style></head><body>",
           f"<h1>gpumem report: {e(meta['trace'])}</h1>",
           f"<p class=meta>{e(meta['trace_summary'])}<br>Trace file <code>{e(meta['trace_file'])}</code> "
           f"({e(meta['format'])}); devices: {e(', '.join(meta['devices']))}; policies: "
           f"{e(', '.join(meta['policies']))}"
           + (f"; pressure scenario <code>{e(meta['pressure'])}</code>" if meta["pressure"] else "")
           + f". gpumem {e(meta['gpumem_version'])}."
           + (f"<br>Made with <code>{e(meta['command'])}</code>" if meta.get("command") else "") + "</p>",
           "<h2>Summary</h2>",
           "<p>Peak live: the most the program had allocated at once. Peak reserved: the most the allocator held "
           "from the device. Overhead: peak reserved / peak live &minus; 1. Needs: the smallest memory limit the "
           "trace runs under (bisected to 1&nbsp;% of peak live). Time per operation is measured on this machine "
           "(the only figure that changes between runs).</p>",
           "<table><tr><th class=l>device</th><th class=l>policy</th><th>peak live</th>"
           "<th>peak reserved</th><th>overhead</th><th>OOMs</th><th>needs</th><th>time/op (µs)</th>"
           "<th>device calls</th></tr>"]
    for r in summary:
        if r.get("status") == "unsupported":
            out.append(f"<tr><td class=l>{e(r['device'])}</td><td class=l>{e(r['policy'])}</td>"
                       f"<td class=l colspan=7>unsupported: {e(str(r.get('reason')))}</td></tr>")
            continue
        out.append(f"<tr><td class=l>{e(r['device'])}</td><td class=l>{e(r['policy'])}</td>"
                   f"<td>{_fmt_gib(r['peak_live_bytes'])}</td><td>{_fmt_gib(r['peak_reserved_bytes'])}</td>"
                   f"<td>{r['overhead']:.2%}</td><td>{r['ooms']}</td><td>{_fmt_gib(r['smallest_limit_bytes'])}</td>"
                   f"<td>{r['ns_per_op'] / 1000:.2f}</td><td>{r['device_calls']:,}</td></tr>")
    out.append("</table><p class=files>Numbers: <a href=summary.csv>summary.csv</a><a href=summary.json>summary.json"
               "</a><a href=report.json>report.json</a> (everything)</p>")
    captions = [
        ("Live and reserved memory over time",
         "Black: the most the program had allocated in each interval; coloured: the most each policy held from "
         "the device. Red crosses: out-of-memory errors (none when the trace fits)."
         + (" Dotted: other tenants' memory (the pressure scenario); ticks at the bottom: their events (a tenant "
            "took or gave back memory)." if meta["pressure"] else "")),
        ("Occupancy at the peak",
         "Each policy's segments (or virtual ranges) laid end to end, row after row, at the moment live data "
         "peaks: blue is live blocks, orange free holes the allocator holds, grey address space with no memory "
         "behind it. Orange is the memory fragmentation costs."),
        ("Free holes and external fragmentation",
         "Left: how much free memory sits in holes of each size at the peak. Right: 1 &minus; largest free "
         "block / all free bytes over time (0&nbsp;%: the free memory is one piece)."),
    ]
    for dev in per_device:
        slug = dev["slug"]
        data = [f"timeline-{slug}", f"occupancy-{slug}", f"fragmentation-{slug}"]
        for (cap, text), fig, stem in zip(captions, dev["figures"], data):
            out.append(f"<h2>{cap}: {e(dev['device'])}</h2><p>{text}</p><img src='{e(fig)}' alt='{e(cap)}'>"
                       f"<p class=files>Numbers: <a href='{stem}.csv'>{stem}.csv</a><a href='{stem}.json'>"
                       f"{stem}.json</a></p>")
    out.append("<h2>Who holds the memory at the peak</h2>")
    how = ("the innermost stack frame outside PyTorch of each live tensor" if sites.kind == "stack frame"
           else "requested size (this trace has no stack frames)")
    out.append(f"<p>Live bytes after operation {sites.op:,}, grouped by {how}.</p>"
               "<img src='fig4-sites.png' alt='live memory by allocation site'>"
               "<table><tr><th class=l>site</th><th>live</th><th>share</th><th>tensors</th></tr>")
    for s in sites.sites:
        share = s.live_nbytes / sites.total_live_nbytes if sites.total_live_nbytes else 0.0
        out.append(f"<tr><td class=l>{e(s.site)}</td><td>{_fmt_gib(s.live_nbytes)}</td><td>{share:.1%}</td>"
                   f"<td>{s.n_live:,}</td></tr>")
    out.append("</table><p class=files>Numbers: <a href=sites.csv>sites.csv</a><a href=sites.json>sites.json</a></p>")
    out.append("<h2>Fit matrix</h2><p>Whether the trace runs on each device under each policy, and the smallest "
               "memory limit it runs under (found by bisection, without pressure).</p>"
               "<img src='fig5-fit.png' alt='fit matrix'>"
               "<p class=files>Numbers: <a href=fit.csv>fit.csv</a><a href=fit.json>fit.json</a></p>")
    out.append("</body></html>\n")
    return "\n".join(out)
