"""``gpumem report TRACE [--device SPEC ...] [--policy NAME ... | --policy all] [--pressure SCENARIO] --out DIR``:
replay a trace under several allocator policies on several devices and write a self-contained report
(``DIR/index.html``, PNG figures, and the numbers behind each figure as JSON and CSV)."""

from __future__ import annotations

from ._args import MANY

import argparse
import json
import os
import shlex
import sys
from typing import Any

from ._common import _DEFAULT_DEVICE, _UsageError, _add_verbose, _check_trace_path, _cli_names, _device_index, \
    _exit_codes_text, _shorten_path
from ..sim.gpu_work import GpuTiming
from ..errors import BackendUnavailableError, TraceFormatError

_DESCRIPTION = """\
Replay an allocation trace (PyTorch snapshot .pickle[.gz], RMM log .csv[.gz] or gpumem .gmt[.gz]) under
each allocator policy on each device and write a report to DIR:
  index.html   open it in a browser; it shows, per device:
  (1) live and reserved memory over time per policy, with out-of-memory errors and pressure events;
  (2) an occupancy map at the peak of live data: segments or virtual ranges, live blocks, free holes,
      unmapped address space;
  (3) free-hole sizes at the peak and external fragmentation over time;
  and (4) who holds the memory at the peak (live bytes by the snapshot's stack frames, or by size),
  (5) a fit matrix: whether the trace runs per device and policy, and the smallest memory limit it runs
      under, (6) a summary table: peak live, peak reserved, overhead, OOMs, time per operation.
  *.png        the figures; *.json, *.csv: the numbers behind each figure; report.json: all of them.
The report is built in a temporary folder beside DIR and renamed to DIR when complete: a bad trace or an
error leaves nothing behind. The same trace and options give the same numbers (the time per operation,
measured, excepted)."""


def _output_error(out: str, exc: OSError) -> str:
    """One line for an error met while writing the report (the trace was read: it is not the cause)."""
    where = f" ({_shorten_path(str(exc.filename))})" if exc.filename is not None else ""
    return f"--out {_shorten_path(str(out))}: cannot write the report: {exc.strerror or exc}{where}; nothing was replaced"


def _policies(values: list[str] | None) -> tuple[str, ...]:
    from ..allocator.policy import POLICIES

    if not values or "all" in values:
        if values and len(values) > 1:
            raise _UsageError("--policy all names every policy; give it alone")
        return tuple(POLICIES)
    return tuple(dict.fromkeys(values))


def _fit_devices(values: list[str] | None) -> tuple[str, ...]:
    from ..report.build import FIT_DEVICES

    if not values:
        return FIT_DEVICES
    if values == ["none"]:
        return ()
    return tuple(dict.fromkeys(values))


def cmd_report(args: argparse.Namespace) -> int:
    """Check the options, build the report, print where it is and the summary table."""
    from ..errors import InvalidArgumentError
    from ..report import ReportOptions, build_report

    _check_trace_path(args.trace)
    try:
        options = ReportOptions(devices=tuple(dict.fromkeys(args.device or [_DEFAULT_DEVICE])),
                                policies=_policies(args.policy), pressure=args.pressure,
                                stop_on_oom=not args.keep_going, fit=not args.no_fit, samples=args.samples,
                                trace_format=args.format, device_index=args.device_index,
                                gpu_timing=args.gpu_timing, step_marks=not args.no_step_marks,
                                fit_devices=() if args.no_fit else _fit_devices(args.fit_device))
    except InvalidArgumentError as exc:
        raise _UsageError(str(exc)) from None
    from ..errors import GpumemError
    from ..report.build import _slug, with_pressure
    from ..specs import open_device

    seen: dict[str, str] = {}
    for spec in options.devices:  # a bad spec is bad input, found before any replay
        try:
            dev = open_device(with_pressure(spec, options.pressure))
            name = dev.spec
            dev.close()
        except GpumemError as exc:
            raise _UsageError(f"--device {spec}: {exc}") from None
        key = _slug(name)  # two specs naming one device would write the same figures
        if key in seen:
            raise _UsageError(f"--device {spec} is the same device as --device {seen[key]}; give it once")
        seen[key] = spec
    command = _command_line(args, options)
    try:
        result = build_report(args.trace, args.out, options, force=args.force,
                              progress=None if not args.json else False, command=command)
    except FileNotFoundError as exc:
        if exc.filename is None or os.path.realpath(exc.filename) == os.path.realpath(args.trace):
            raise _UsageError(f"no such trace file: {_shorten_path(args.trace)}") from None
        raise _UsageError(_output_error(args.out, exc)) from None
    except OSError as exc:  # the output folder: its parent a file, a read-only or vanished folder
        if exc.filename is not None and os.path.realpath(exc.filename) == os.path.realpath(args.trace):
            raise _UsageError(f"cannot read the trace {_shorten_path(args.trace)}: {exc.strerror or exc}") from None
        raise _UsageError(_output_error(args.out, exc)) from None
    except TraceFormatError as exc:
        raise _UsageError(f"cannot read the trace: {_cli_names(str(exc))}; nothing was written") from None
    except BackendUnavailableError as exc:
        raise _UsageError(str(exc)) from None
    except InvalidArgumentError as exc:
        raise _UsageError(f"{_cli_names(str(exc))}; nothing was written") from None
    if args.json:
        print(json.dumps({"out": str(result.out_dir), "index": str(result.out_dir / "index.html"),
                          "files": result.files, "summary": result.summary}, indent=2, sort_keys=True))
        return 0
    _print_summary(result.summary)
    print(f"\nreport written to {result.out_dir / 'index.html'} (open it in a browser)")
    return 0


def _command_line(args: argparse.Namespace, options: Any) -> str:
    """The command, as the report shows it (the paths as given)."""
    words = ["gpumem", "report", args.trace]
    for d in options.devices:
        words += ["--device", d]
    words += ["--policy", "all"] if args.policy in (None, ["all"]) else [w for p in options.policies
                                                                          for w in ("--policy", p)]
    for flag, on in (("--keep-going", args.keep_going), ("--no-fit", args.no_fit),
                     ("--no-step-marks", args.no_step_marks)):
        if on:
            words.append(flag)
    for flag, value in (("--gpu-timing", args.gpu_timing), ("--format", args.format),
                        ("--device-index", args.device_index)):
        if value is not None:
            words += [flag, str(value)]
    for d in args.fit_device or []:
        words += ["--fit-device", d]
    if args.pressure:
        words += ["--pressure", args.pressure]
    if args.samples != 1000:
        words += ["--samples", str(args.samples)]
    words += ["--out", args.out]
    return " ".join(shlex.quote(w) for w in words)


def _print_summary(rows: list[dict[str, Any]]) -> None:
    """The summary table; sizes in the unit that fits each (a 1 MiB trace read "0.00 GiB" in every column)."""
    from ..units import format_bytes

    w = max([len("device")] + [len(str(r["device"])) for r in rows]) + 2
    print(f"{'device':<{w}}{'policy':<12}{'peak live':>12}{'reserved':>12}{'overhead':>10}{'OOMs':>6}{'needs':>12}")
    for r in rows:
        if r.get("status") == "unsupported":
            print(f"{r['device']:<{w}}{r['policy']:<12}  unsupported: {r.get('reason')}")
            continue
        needs = r.get("smallest_limit_bytes")
        print(f"{r['device']:<{w}}{r['policy']:<12}{format_bytes(r['peak_live_bytes']):>12}"
              f"{format_bytes(r['peak_reserved_bytes']):>12}{r['overhead']:>10.2%}{r['ooms']:>6}"
              + (f"{format_bytes(needs):>12}" if needs else f"{'-':>12}"))
    sys.stdout.flush()


def register(sub: Any, formatter_class: type) -> None:
    """Add ``gpumem report`` to the subcommands."""
    from ..allocator.policy import POLICIES
    from ..sim.pressure import PRESET_NAMES
    from ..trace import FORMATS

    p = sub.add_parser("report", help="write an HTML report with figures comparing allocator policies on a trace",
                       formatter_class=formatter_class, description=_DESCRIPTION, epilog=_exit_codes_text())
    p.add_argument("trace", help="the trace file")
    p.add_argument("--out", required=True, metavar="DIR", help="the report's folder (created; must not exist "
                                                               "unless --force)")
    p.add_argument("--device", **MANY, metavar="SPEC",
                   help=f"device specs, one or more, repeatable (default: {_DEFAULT_DEVICE}); see `gpumem devices`")
    p.add_argument("--policy", **MANY, metavar="NAME", choices=sorted(POLICIES) + ["all"],
                   help="allocator policies, one or more, repeatable, or 'all' (default: all): " + ", ".join(POLICIES)
                   + " (the size-bucket pool, 'bucket', has no segments to draw: gpumem replay, sweep, estimate "
                     "and fit take it)")
    p.add_argument("--pressure", choices=PRESET_NAMES, default=None,
                   help="run the simulated devices with this pressure scenario (other tenants taking memory): "
                        + ", ".join(PRESET_NAMES))
    p.add_argument("--keep-going", action="store_true",
                   help="skip an allocation that does not fit and go on (default: stop at the first, as replay)")
    p.add_argument("--fit-device", **MANY, metavar="SPEC",
                   help="further devices of the fit matrix, one or more, repeatable, each decided by the smallest memory limit "
                        "of its kind against what it can give, without a replay of its own (default: a spread "
                        "of simulated profiles from 2 GB to 141 GB; 'none' for only the --device ones)")
    p.add_argument("--no-fit", action="store_true",
                   help="skip the bisection of the smallest memory limit (faster; the fit matrix then says only "
                        "whether the trace runs)")
    p.add_argument("--samples", type=int, default=1000, metavar="N",
                   help="points per policy in the figures over time (default: %(default)s)")
    p.add_argument("--format", choices=FORMATS, default=None, help="read the trace with this reader instead of "
                                                                    "detecting its format")
    p.add_argument("--device-index", type=_device_index, default=None, metavar="N",
                   help="for a PyTorch snapshot of several GPUs: report GPU N's trace")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists (once the new report is complete)")
    p.add_argument("--gpu-timing", choices=[t.value for t in GpuTiming], default=None,
                   help="how the program's GPU work runs beside each replay (as gpumem replay --gpu-timing)")
    p.add_argument("--no-step-marks", action="store_true",
                   help="read the trace without its step marks (as gpumem replay --no-step-marks): the gpumem "
                        "policy then replays a run without step plans")
    p.add_argument("--json", action="store_true", help="print the files and the summary table as JSON")
    _add_verbose(p)
    p.set_defaults(func=cmd_report)
