"""``gpumem sweep TRACES... --device SPEC... --policy NAME... [--limit LIMIT...] --out DIR [--jobs N |
--scheduler ADDR]``: replay every trace x device x policy x limit and write one tidy table (CSV and JSON)
and summary figures (PNG) into DIR, on local processes or on a Dask cluster."""

from __future__ import annotations

from ._args import MANY

import argparse
import json
import logging
import sys
from typing import Any

from ._common import EXIT_OK, EXIT_USAGE, _UsageError, _add_verbose, _limit_syntax, whole_number_at_least
from ..sim.gpu_work import GpuTiming
from ..units import format_bytes

log = logging.getLogger(__name__)

_DESCRIPTION = """\
Replay every combination of the traces (PyTorch snapshot .pickle[.gz], RMM log .csv[.gz], gpumem
.gmt[.gz]), devices, allocator policies and limits, in parallel, and write into DIR:
  sweep.csv, sweep.json  one row per trace x device x policy x limit: status (ok, oom, error), peak live
                         and peak reserved bytes, overhead (peak reserved / peak live - 1), out-of-memory
                         errors, external fragmentation at the end, device calls, time per operation, and
                         the error of a case that could not run;
  fit.png                which combinations run (peak reserved in GiB where they do);
  peak_reserved.png, overhead.png, time_per_op.png
                         per device (and limit): one bar per policy for each trace.
Cases run on local processes (--jobs N, default: one per CPU) or, with --scheduler, on the workers of a
running Dask cluster (pip install 'gpumem[dask]'; every worker must read the trace files at the same
absolute paths). Rows come in argument order and every number except the wall-clock columns (wall_s,
ns_per_op) is the same whichever runs them. A trace path that does not exist is refused before any case runs
(on local processes); a case that fails (a trace file that cannot be read) is a row with its error; the
others still run. DIR must be new, empty, or an earlier sweep's folder (replaced); the files are
written into a temporary folder beside it and renamed at the end, so a failed sweep leaves nothing."""

_EPILOG = """\
exit status:
  0   every case ran to a result (it fits, or an out-of-memory error: both are rows of the table)
  2   bad input: a bad option, device spec, policy, limit, missing trace file or output folder (nothing
      is run); or some case could not run (a trace file that cannot be read): the table is written, with
      the error in its rows
  130 interrupted (Ctrl-C)

example:
  gpumem sweep data/traces/*.gz --device sim:t4-16gb sim:a100-40gb --policy gpumem pytorch cupy \\
      --limit none 8GiB --out sweep-out --jobs 2"""


def _policies(values: list[str]) -> list[str]:
    from ..allocator.policy import POLICIES

    if "all" in values:
        if len(values) > 1:
            raise _UsageError("--policy all names every policy; give it alone")
        return list(POLICIES)
    return values


def _limit(text: str) -> str | None:
    """``--limit`` values: ``none`` (no cap) or ``gpumem replay --limit``'s syntax."""
    if text.strip().lower() == "none":
        return None
    return _limit_syntax(text)


def register(sub: Any, formatter_class: Any) -> None:
    """Add ``gpumem sweep`` to the subcommands."""
    p = sub.add_parser("sweep", help="replay every trace x device x policy x limit; a table and figures",
                       formatter_class=formatter_class, description=_DESCRIPTION, epilog=_EPILOG)
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace files")
    p.add_argument("--device", **MANY, required=True, metavar="SPEC",
                   help="device specs, one or more, repeatable ('sim:<profile>', see `gpumem devices`; 'cuda:N')")
    p.add_argument("--policy", **MANY, required=True, metavar="NAME",
                   help="allocator policies, one or more, repeatable (see `gpumem replay --help`; 'bucket' "
                        "too), or 'all' (every caching-allocator policy)")
    p.add_argument("--limit", **MANY, type=_limit, default=None, metavar="LIMIT",
                   help="caps on the memory the allocator reserves, as `gpumem replay --limit` takes them "
                        "(8GiB, 90%%, 0.5), or 'none' for no cap (default: none)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--jobs", type=_jobs, default=None, metavar="N",
                       help="local worker processes (default: one per CPU; 1 runs in this process)")
    where.add_argument("--scheduler", metavar="ADDR",
                       help="run on the Dask cluster whose scheduler is at ADDR (tcp://host:8786); needs "
                            "pip install 'gpumem[dask]'")
    p.add_argument("--gpu-timing", choices=[t.value for t in GpuTiming], default=None,
                   help="how the program's GPU work runs beside each replay (as gpumem replay --gpu-timing)")
    p.add_argument("--no-step-marks", action="store_true",
                   help="read the traces without their step marks (as gpumem replay --no-step-marks): the gpumem "
                        "policy then replays runs without step plans")
    p.add_argument("--no-plots", action="store_true", help="write the table only")
    p.add_argument("--json", action="store_true", help="print {out, files, rows} as JSON instead of the table")
    _add_verbose(p)
    p.set_defaults(func=cmd_sweep)


_jobs = whole_number_at_least(1, "a whole number")


def _dask_executor(address: str) -> tuple[Any, Any]:
    """A Dask client connected to ``address`` and its ``concurrent.futures`` executor."""
    try:
        from distributed import Client
    except ImportError:
        raise _UsageError("--scheduler runs the sweep on Dask, which is not installed: "
                          "pip install 'gpumem[dask]'") from None
    import threading

    # Client(timeout=) bounds only the TCP connect: a server that accepts and then says nothing (or speaks
    # HTTP) would hang the handshake for ever, so the whole handshake runs in a thread under a deadline.
    box: dict[str, Any] = {}
    lock = threading.Lock()

    def connect() -> None:
        try:
            client = Client(address, timeout=f"{_CONNECT_TIMEOUT_S}s")
            client.scheduler_info()
        except Exception as exc:  # noqa: BLE001 - anything from a non-Dask peer is "cannot connect"
            with lock:
                box["error"] = exc
            return
        with lock:
            if box.get("abandoned"):
                client.close()  # too late: the caller already gave up
            else:
                box["client"] = client

    thread = threading.Thread(target=connect, name="gpumem-dask-connect", daemon=True)
    thread.start()
    thread.join(_CONNECT_TIMEOUT_S + 2)
    with lock:
        if "client" not in box:
            box["abandoned"] = True
    if "client" in box:
        client = box["client"]
        try:
            return client, client.get_executor()
        except Exception as exc:  # noqa: BLE001
            client.close()
            raise _UsageError(f"--scheduler: cannot use the Dask scheduler at {address}: {exc}") from None
    why = box.get("error")
    why_text = f"{type(why).__name__}: {why}" if why is not None else \
        f"no Dask handshake within {_CONNECT_TIMEOUT_S + 2:g} s (is it a Dask scheduler?)"
    raise _UsageError(f"--scheduler: cannot connect to the Dask scheduler at {address}: {why_text}"[:500])


#: Seconds allowed for connecting to a Dask scheduler (the whole handshake gets two more).
_CONNECT_TIMEOUT_S = 8


def cmd_sweep(args: argparse.Namespace) -> int:
    """``gpumem sweep``: check everything, run the cases, write DIR, print the table."""
    from ..errors import BackendUnavailableError, InvalidArgumentError
    from ..report.sweep import check_out_dir, make_cases, require_matplotlib, run_sweep, write_sweep

    policies = _policies(args.policy)
    try:
        if not args.no_plots:
            require_matplotlib()
    except BackendUnavailableError as exc:
        raise _UsageError(str(exc)) from None
    if args.scheduler is None:  # local workers read these very paths: a typo is bad input, found before any case
        _check_traces(args.traces)
    try:
        check_out_dir(args.out, args.traces)
        # bad arguments: fail before any work
        make_cases(args.traces, args.device, policies, args.limit or [None], args.gpu_timing, not args.no_step_marks)
    except InvalidArgumentError as exc:
        raise _UsageError(str(exc)) from None
    client = executor = None
    if args.scheduler is not None:
        client, executor = _dask_executor(args.scheduler)
    try:
        result = run_sweep(args.traces, args.device, policies, args.limit or [None], executor=executor, jobs=args.jobs,
                           progress=not args.json, gpu_timing=args.gpu_timing, step_marks=not args.no_step_marks)
    finally:
        if client is not None:
            client.close()
    try:
        files = write_sweep(result, args.out, plots=not args.no_plots)
    except InvalidArgumentError as exc:
        raise _UsageError(str(exc)) from None
    except OSError as exc:  # the folder removed or made read-only while the cases ran
        where = f" ({exc.filename})" if exc.filename is not None else ""
        raise _UsageError(f"--out {args.out}: cannot write the sweep: {exc.strerror or exc}{where}; "
                          "nothing was replaced") from None
    if args.json:
        print(json.dumps({"out": args.out, "files": [f.name for f in files],
                          "rows": [r.as_dict() for r in result.rows]}, indent=2))
    else:
        _print_table(result)
        what = "table" if args.no_plots else "table and figures"
        print(f"\n{len(result.rows)} cases on {result.executor}; {what} in {args.out}")
    if result.n_errors:
        print(f"gpumem sweep: {result.n_errors} of {len(result.rows)} cases could not run; their rows say why "
              f"(sweep.csv, column error)", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _check_traces(traces: list[str]) -> None:
    """A usage error (exit 2, nothing run) for a trace path that does not exist or is not a regular file: the
    whole sweep ran before such a typo showed as an error row. (On a Dask cluster the workers read the
    paths, which this machine may not hold: their errors stay rows.)"""
    import os

    from ._common import _check_trace_path, _shorten_path

    missing = [t for t in traces if not os.path.lexists(t) or (os.path.islink(t) and not os.path.exists(t))]
    if missing:
        raise _UsageError(f"no such trace file: {', '.join(_shorten_path(t) for t in missing[:5])}"
                          f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''}; nothing was run")
    for t in traces:
        _check_trace_path(t)


def _print_table(result: Any) -> None:
    from ..report.sweep import SweepStatus, trace_labels

    labels = trace_labels(result.traces)
    width = max([5] + [len(v) for v in labels.values()])
    head = f"{'TRACE':<{width}} {'DEVICE':<20} {'POLICY':<10} {'LIMIT':<8} {'STATUS':<6} {'PEAK LIVE':>11} " \
           f"{'RESERVED':>11} {'OVERHEAD':>9} {'NS/OP':>8}"
    print(head)
    for r in result.rows:
        name = labels[r.trace]
        if r.status == SweepStatus.ERROR:
            print(f"{name:<{width}} {r.device[:20]:<20} {r.policy:<10} {str(r.limit or '-'):<8} error  "
                  f"{(r.error or '')[:60]}")
            continue
        print(f"{name:<{width}} {r.device[:20]:<20} {r.policy:<10} {str(r.limit or '-'):<8} {r.status:<6} "
              f"{format_bytes(r.peak_live_bytes):>11} {format_bytes(r.peak_reserved_bytes):>11} "
              f"{r.overhead:>9.2%} {r.ns_per_op:>8,.0f}")
