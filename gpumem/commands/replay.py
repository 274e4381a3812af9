"""``gpumem replay``: replay an allocation trace through gpumem's caching allocator on a device, and
report peak live and reserved bytes, overhead, external fragmentation, out-of-memory errors and the time
per operation; the out-of-memory report says what failed and which profiles have room."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from ..errors import DeviceLostError, GpumemError, InvalidArgumentError, TraceFormatError
from ..managers.forensics import replay_oom_report
from ..sim.gpu_work import DEFAULT_GPU_TIMING, GpuTiming, GpuWorkModel
from ..trace.limits import printable
from ..units import format_bytes
from ..validate import parse_limit
from ._common import (EXIT_CODES, EXIT_USAGE, EXIT_OK, EXIT_OOM, OutputFile, _DEFAULT_DEVICE, _LIMIT_HELP,
                      _UsageError, _add_verbose, _check_trace_path, _cli_names, _device_index, _exit_codes_text,
                      _folder_message, _limit_syntax, _shorten_path, check_output_path, log)


def _load(args: argparse.Namespace):
    from ..trace import detect_format, load_trace

    _check_trace_path(args.trace)
    try:
        if args.device_index is not None or args.stream_uses is not None:
            fmt = detect_format(args.trace) if args.format is None else args.format
            if fmt != "pytorch-snapshot":
                option = ("--device-index" if args.device_index is not None else
                          "--stream-uses (a log of PyTorch's allocator; gpumem's own traces record their uses)")
                raise _UsageError(f"{option} applies to PyTorch snapshots only; {args.trace} is read as {fmt}")
        rs = None if args.stream_uses is None else _read_stream_log(args)
        # the log's device picks the snapshot's (a log of another device is then refused by the loader)
        device = args.device_index if rs is None or args.device_index is not None else rs.only_device()
        from_log = f" (device {device}, the --stream-uses log's)" if device != args.device_index else ""
        trace = load_trace(args.trace, format=args.format, device=device, step_marks=not args.no_step_marks)
    except FileNotFoundError:
        _check_trace_path(args.trace)
        raise _UsageError(f"no such trace file: {_shorten_path(args.trace)}") from None
    except IsADirectoryError:
        raise _UsageError(_folder_message(args.trace)) from None
    except TraceFormatError as exc:
        if "is a directory" in str(exc).lower():  # the readers' own check
            raise _UsageError(_folder_message(args.trace)) from None
        raise _UsageError(f"cannot read the trace{from_log}: {_cli_names(str(exc))}") from None
    except OSError as exc:  # permission denied, an I/O error
        raise _UsageError(f"cannot read the trace {_shorten_path(args.trace)}: {exc.strerror or exc}") from None
    return trace if rs is None else _merge_stream_uses(args, trace, rs, device)


def _read_stream_log(args: argparse.Namespace) -> Any:
    """The record_stream log of ``--stream-uses`` (gpumem.trace.stream_log)."""
    from ..trace.stream_log import read_record_stream_log

    try:
        return read_record_stream_log(args.stream_uses)
    except FileNotFoundError:
        raise _UsageError(f"--stream-uses: no such file: {_shorten_path(args.stream_uses)}") from None
    except TraceFormatError as exc:
        raise _UsageError(f"--stream-uses: {_cli_names(str(exc))}") from None
    except OSError as exc:
        raise _UsageError(f"--stream-uses: cannot read {_shorten_path(args.stream_uses)}: {exc.strerror or exc}") from None


def _merge_stream_uses(args: argparse.Namespace, trace: Any, rs: Any, device: int | None) -> Any:
    """``trace`` (of snapshot device ``device``) with the record_stream log ``rs`` merged."""
    from ..trace.stream_log import merge_stream_uses

    try:
        merged, report = merge_stream_uses(trace, rs, device=device, where=args.stream_uses)
    except FileNotFoundError:
        raise _UsageError(f"--stream-uses: no such file: {_shorten_path(args.stream_uses)}") from None
    except (TraceFormatError, InvalidArgumentError) as exc:
        raise _UsageError(f"--stream-uses: {_cli_names(str(exc))}") from None
    except OSError as exc:
        raise _UsageError(f"--stream-uses: cannot read {_shorten_path(args.stream_uses)}: {exc.strerror or exc}") from None
    log.info("%s", report)
    return merged


_LABEL_WIDTH = 15  # the longest label ("peak reserved") and two spaces


def _row(label: str, value: str) -> None:
    print(f"{label:<{_LABEL_WIDTH}}{value}")


def _marks_row(trace: Any, no_step_marks: bool) -> str | None:
    """The replay's line on the trace's step marks (Note [Plan events in a replay]), or None where it made none
    and none were left out."""
    from ..trace.model import PlanEventKind

    if no_step_marks:
        return "left out (--no-step-marks)"
    n = sum(1 for e in trace.plan_events if e.kind is PlanEventKind.MARK)
    if not trace.plan_events:
        return None
    where = ("read off the snapshot's optimizer steps, where gpumem.torch marks by default"
             if trace.source == "pytorch-snapshot" else "where gpumem.torch made them")
    return f"{n:,} step marks and {len(trace.plan_events) - n:,} warm-up switch(es), {where}"


def _events_in(marks: str) -> str:
    """The count of events a :func:`_marks_row` line names (marks and switches together)."""
    words = marks.replace(",", "").split()
    return f"{int(words[0]) + int(words[4]):,}"


def _print_result(result: Any, summary: str | None, marks: str | None = None) -> None:
    # the name comes from the trace file: escape sequences in it must not reach the terminal
    _row("trace", f"{printable(result.trace)} ({result.n_ops:,} ops, {result.n_allocs:,} allocations)")
    _row("device", result.device)
    _row("policy", result.policy)
    if "engine" in result.extra:
        _row("engine", str(result.extra["engine"]))
    if "gpu_timing" in result.extra:
        drain = result.extra.get("gpu_sync_drain")
        _row("gpu timing", str(result.extra["gpu_timing"])
             + ("" if drain is None else " (a sync's gap is GPU work)" if drain else " (--no-sync-drain)"))
    if result.oom_op is not None:
        _row("replayed", f"{result.completed_ops:,} of {result.n_ops:,} ops (stopped by out of memory at op "
                         f"{result.oom_op + 1:,})")
    _row("peak live", f"{format_bytes(result.peak_live_bytes)}  (the most the program had allocated at once)")
    _row("peak reserved", f"{format_bytes(result.peak_reserved_bytes)}  (the most the allocator held from the device)")
    _row("overhead", f"{result.overhead:.2%}  (= peak reserved / peak live - 1: what the allocator held beyond "
                     "the program's own bytes, at its worst)")
    _row("ext. frag.", f"{result.stats.external_fragmentation:.2%}  (external fragmentation at the end = 1 - "
                       "largest free cached block / all free cached bytes; 0% when the unused cache is one piece)")
    _row("ooms", str(result.ooms))
    if result.extra.get("n_stream_uses"):
        _row("stream uses", f"{result.extra['n_stream_uses']:,} record_stream calls made (a block used on another "
                            "stream is reused once that stream's work is done)")
    if result.extra.get("gpu_stream_waits"):
        _row("stream waits", f"{result.extra['gpu_stream_waits']:,} cross-stream waits made (work queued after a "
                             "wait starts once the awaited stream's work before it is done)")
    if "sanitizer_hazards" in result.extra:
        seen = result.extra["sanitizer_hazards"]
        _row("hazards", (", ".join(f"{n:,} {call}" for call, n in sorted(seen.items())) if seen else "none")
             + "  (the simulator's sanitizer, count mode: docs/devices.md)")
    if marks is not None:
        made = result.extra.get("n_plan_events", 0)
        _row("step marks", marks if marks.startswith("left out") else
             marks + (" (not made: this policy has no step plans)" if not made else
                      "" if f"{made:,}" == _events_in(marks) else f" ({made:,} made before the replay stopped)"))
    _row("time", f"{result.wall_s:.2f} s wall, {result.ns_per_op:,.0f} ns per op")
    if summary is not None:
        print(summary)


def cmd_replay(args: argparse.Namespace) -> int:
    """``gpumem replay``: check the options and the output path, open the device, read the trace, replay,
    print the results (then the out-of-memory report, once), write the export; returns the exit status.
    Bad input raises :class:`_UsageError`; device errors propagate to :func:`_run`, which maps them to
    exit statuses."""
    export = None if args.export_snapshot is None else check_output_path(args.export_snapshot, "--export-snapshot")
    finished = False
    try:
        code = _replay(args, export)
        finished = True
        return code
    finally:
        if export is not None and not finished:
            export.discard()  # the replay failed: leave no empty file behind


def _source_frames(args: argparse.Namespace, n_allocs: int) -> "list[Any] | None":
    """The stack frames of each allocation of the replayed trace, when it is a PyTorch snapshot that recorded
    them and the replay made as many allocations (so an exported snapshot keeps who allocated what); else None."""
    from ..trace import detect_format
    from ..trace.pytorch_export import snapshot_frames

    try:
        fmt = detect_format(args.trace) if args.format is None else args.format
        if fmt != "pytorch-snapshot":
            return None
        return snapshot_frames(args.trace, n_allocs, args.device_index)
    except (GpumemError, OSError, ValueError) as exc:  # the trace was read once already: keep the export going
        logging.getLogger(__name__).info("no stack frames for the exported snapshot: %s", exc)
        return None


def _replay(args: argparse.Namespace, export: OutputFile | None) -> int:
    from ..allocator import make_allocator
    from ..replay import program_gpu, replay
    from ..replay_compare import ReserveCapture, compare_reserves, comparison_json
    from ..specs import open_device
    from ..trace import save_pytorch_snapshot

    try:
        device = open_device(args.device)
    except GpumemError as exc:
        raise _UsageError(f"--device {args.device}: {exc}") from None
    try:
        total = device.properties().total_nbytes
        try:
            limit = parse_limit(args.limit, total) if args.limit is not None else None
        except InvalidArgumentError as exc:
            raise _UsageError(f"--limit: {exc}") from None
        if limit is not None and limit > total:
            log.warning("--limit %s (%s) is more than %s has (%s in all): it caps nothing the device would not "
                        "refuse first", args.limit, format_bytes(limit), device.spec, format_bytes(total))
        trace = _load(args)
        if trace.n_ops == 0:
            raise _UsageError(f"the trace {args.trace} has no allocations or frees: nothing to replay")
        if args.compare_live and trace.live_reserved_nbytes is None:
            raise _UsageError(f"--compare-live: the trace {args.trace} has no live reserves (gpumem.torch traces "
                              "have them since .gmt version 6): nothing to compare the replay with")
        allocator = make_allocator(device, args.policy, limit=limit, record_history=export is not None)
        if export is not None and getattr(allocator, "engine", None) == "python":
            from ..native import load_engine

            if load_engine() is not None:
                print("gpumem replay: --export-snapshot records the allocator's history, which only the Python "
                      "engine does: this replay runs on it, several times slower per operation than the native "
                      "engine (see 'time' below)", file=sys.stderr)
        lost = False
        capture = ReserveCapture(trace, allocator) if args.compare_live else None
        comparison = None
        try:
            if args.no_sync_drain and args.gpu_timing not in (None, GpuTiming.TRACE.value):
                raise _UsageError(f"--no-sync-drain is for --gpu-timing trace, not {args.gpu_timing}")
            try:
                gpu = program_gpu(trace, device, args.gpu_timing,
                                  GpuWorkModel(sync_gap_is_gpu_work=False) if args.no_sync_drain else None)
            except InvalidArgumentError as exc:
                raise _UsageError(f"--gpu-timing: {exc}") from None
            if args.no_sync_drain and (gpu is None or gpu.timing is not GpuTiming.TRACE or not gpu.clock):
                raise _UsageError("--no-sync-drain is for --gpu-timing trace on a trace with a clock (this replay's "
                                  "timing is " + ("idle" if gpu is None else "model: the trace has no clock"
                                                  if gpu.timing is GpuTiming.TRACE else gpu.timing.value) + ")")
            if gpu is None and (trace.stream_uses or trace.stream_waits):
                log.warning("GPU timing idle: every fence is complete at once, so the trace's %d stream use(s) and "
                            "%d cross-stream wait(s) change no decision of this replay: a block freed after a stream use waits "
                            "for its fence only until the next allocation, so only one freed last can stay pending "
                            "(Active) at its end (--gpu-timing trace or model honours them)", len(trace.stream_uses), len(trace.stream_waits))
            result = replay(trace, allocator, stop_on_oom=True, progress=None if not args.json else False,
                            gpu=gpu, gpu_timing=None if gpu is not None else (args.gpu_timing or "idle"))
            if capture is not None:
                capture.restore()
                comparison = compare_reserves(trace, capture, result, args.policy)
            summary = allocator.memory_summary() if args.summary else None
            history = allocator.history() if export is not None else None
            report = replay_oom_report(result, allocator, device) if result.oom_error is not None else None
        except DeviceLostError:
            lost = True  # nothing can be given back to a lost device: closing the allocator would only log failures
            raise
        finally:
            if not lost:
                allocator.close()
    finally:
        device.close()
    if args.json:
        data = result.as_json()
        data["limit_bytes"] = limit
        if report is not None:
            data["oom_report"] = report  # the report printed on stderr, with the command line's option names
        if summary is not None:
            data["summary"] = summary  # --summary: the allocator's memory summary table, as text
        if comparison is not None:
            data["live_comparison"] = comparison_json(comparison)
        print(json.dumps(data, indent=2))
    else:
        _print_result(result, summary, _marks_row(trace, args.no_step_marks))
        if comparison is not None:
            for k, line in enumerate(comparison.lines()):
                _row("live" if k == 0 else "", printable(line))
    sys.stdout.flush()
    code = EXIT_OK
    if report is not None:
        print(report, file=sys.stderr)
        code = EXIT_OOM
    if export is not None:
        frames = _source_frames(args, history.n_allocs)
        try:
            save_pytorch_snapshot(history, export.path, frames=frames)
        except OSError as exc:
            export.discard()
            print(f"gpumem replay: --export-snapshot: cannot write {_shorten_path(str(export))}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
            return EXIT_USAGE
        # on stderr, so that --json's stdout stays one JSON document
        print(f"gpumem replay: wrote the PyTorch snapshot to {_shorten_path(str(export))}", file=sys.stderr)
    return code


def register(sub: Any, formatter_class: Any) -> None:
    """Add ``gpumem replay`` to the subcommands."""
    from ..allocator.bucket import BUCKET_POLICY_NAME, BucketPolicy
    from ..allocator.policy import DEFAULT_POLICY, POLICIES
    from ..trace import FORMATS

    raw = formatter_class
    p = sub.add_parser(
        "replay", help="replay an allocation trace through the caching allocator", formatter_class=raw,
        description="Replay an allocation trace (PyTorch snapshot .pickle[.gz], RMM log .csv[.gz], or gpumem\n"
                    ".gmt[.gz]) through gpumem's caching allocator on a device, and report:\n"
                    "  peak live      the most the program had allocated at once;\n"
                    "  peak reserved  the most the allocator held from the device;\n"
                    "  overhead       peak reserved / peak live - 1: what the allocator held, at its worst,\n"
                    "                 beyond what the program had allocated;\n"
                    "  external fragmentation (at the end)\n"
                    "                 1 - largest free cached block / all free cached bytes: 0% when the\n"
                    "                 memory the allocator keeps but does not use is one piece;\n"
                    "  out-of-memory errors and the time per operation.\n"
                    "A gpumem.torch trace (.gmt version 4) also holds where the program marked its steps and\n"
                    "began the memory-first warm-up, and a PyTorch snapshot where its optimizer steps ended\n"
                    "(gpumem.torch's automatic marks): the gpumem policy makes the same calls there, so the\n"
                    "replay predicts the run's step plan (--no-step-marks: a run without); the models of other\n"
                    "allocators ignore them (docs/replay.md).\n"
                    "One recorded with its GPU clock (.gmt version 5) replays as its GPU ran (--gpu-timing);\n"
                    "one that has the live engine's reserve after each allocation (.gmt version 6, every\n"
                    "gpumem.torch trace) can be compared with it (--compare-live).\n"
                    "An allocation that does not fit stops the replay; one report on stderr says what failed,\n"
                    "what the trace needs at its peak and which simulated profiles have room for it.",
        epilog=_exit_codes_text(EXIT_CODES),
    )
    p.add_argument("trace", help="the trace file")
    p.add_argument("--device", default=_DEFAULT_DEVICE, help="device spec (default: %(default)s)")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted({*POLICIES, BUCKET_POLICY_NAME}),
                   help="allocator policy (default: %(default)s): " + "; ".join(
                       f"{name}: {pol.description}" for name, pol in POLICIES.items())
                   + f"; {BUCKET_POLICY_NAME}: {BucketPolicy().description}")
    p.add_argument("--limit", type=_limit_syntax, default=None, metavar="LIMIT", help=_LIMIT_HELP)
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="read the trace with this reader instead of detecting the format from the content "
                        "and the file name")
    p.add_argument("--device-index", type=_device_index, default=None, metavar="N",
                   help="for a PyTorch snapshot of several GPUs: replay GPU N's trace (needed when more than one "
                        "GPU has one; with --stream-uses, the device of the log's calls by default)")
    p.add_argument("--no-step-marks", action="store_true",
                   help="leave out the trace's step marks (those a gpumem.torch trace recorded, and those read off a "
                        "PyTorch snapshot's optimizer steps, where gpumem.torch marks by default): the gpumem "
                        "policy then predicts a run without step plans, as GPUMEM_STEP_MARKS=off runs")
    p.add_argument("--no-sync-drain", action="store_true",
                   help="under --gpu-timing trace: a synchronisation's gap is not GPU work, the work between two "
                        "takes only the CPU's gaps (the model before 2026-12-01; docs/gpu-timing.md)")
    p.add_argument("--gpu-timing", choices=[t.value for t in GpuTiming], default=None,
                   help="how the program's GPU work runs beside the replay, so that memory is freed while work "
                        "that used it may still be queued: 'trace' (GPU time from the trace's clock), 'model' "
                        "(from the bytes each kernel touches), 'idle' (no GPU work, every fence done at once), "
                        "'gpu-clock' (as the recording's GPU ran it: a gpumem.torch trace recorded with "
                        "start_trace(gpu_clock=True), one stream). Default on a simulated device: gpu-clock for a "
                        f"one-stream trace that has its whole GPU clock, else {DEFAULT_GPU_TIMING.value} (with a "
                        "warning where a clock is left unused); idle on a real one")
    p.add_argument("--stream-uses", metavar="LOG", default=None,
                   help="a record_stream log written beside a PyTorch snapshot (gpumem.trace.stream_log; the "
                        "workloads probe writes NAME.default.record_stream.jsonl.gz): each logged "
                        "Tensor.record_stream is made in the replay, so a block used on another stream waits "
                        "for that stream's work when freed, as in PyTorch's allocator; its logged "
                        "Stream.wait_stream calls order the streams' GPU work (not under --gpu-timing idle)")
    p.add_argument("--compare-live", action="store_true",
                   help="compare the replay's reserve with the live engine's after each allocation (a gpumem.torch "
                        "trace records it, .gmt version 6) and say where they first differ: the op, its size, and "
                        "how far behind the GPU ran there, and whether each block sits where the live engine put it "
                        "(with --json: the \"live_comparison\" key)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--summary", action="store_true", help="also print the allocator's memory summary table "
                                                          "(with --json: as the text of the \"summary\" key)")
    p.add_argument("--export-snapshot", metavar="PATH",
                   help="write what gpumem did as a PyTorch memory snapshot (open it in PyTorch's memory_viz); "
                        "a regular file (created, or replaced once the replay is done) in a folder that exists: "
                        "checked by opening it for writing before the replay starts; removed again if the "
                        "replay fails and the file was not there before")
    _add_verbose(p)
    p.set_defaults(func=cmd_replay)
