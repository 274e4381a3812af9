"""The ``gpumem`` command.

``gpumem devices [--json]``
    Real CUDA devices (through NVML, without creating a CUDA context) and every
    simulated profile, with total and free bytes.

``gpumem replay TRACE [--device SPEC] [--policy NAME] [--limit LIMIT] [--format NAME]
[--device-index N] [--json] [--summary] [--export-snapshot PATH]``
    Replay an allocation trace (PyTorch snapshot, RMM log or gpumem trace)
    through gpumem's caching allocator and report peak live and reserved bytes,
    overhead, external fragmentation, out-of-memory errors and time per operation.

Exit status (:data:`EXIT_CODES`): 0 done; 1 out of memory (the trace does not fit the
device or the limit); 2 bad input (a bad option, device spec, trace file or output
path); 3 the device was lost; 4 another device error during the replay (a failed
device call, a memory hazard the simulator caught, an internal consistency error);
130 interrupted (Ctrl-C); 141 standard output was closed: the output pipe closed early
(``gpumem replay ... --json | head``), as for a command that SIGPIPE ended, or no standard output
at all (``gpumem replay ... >&-``: the command stops before it starts, with one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import stat
import sys
from .sim.gpu_work import DEFAULT_GPU_TIMING, GpuTiming
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from . import __version__
from .errors import DeviceLostError, GpumemError, InvalidArgumentError, OutOfMemoryError, TraceFormatError
from .units import format_bytes, parse_limit

log = logging.getLogger("gpumem")

EXIT_OK = 0
EXIT_OOM = 1
EXIT_USAGE = 2
EXIT_DEVICE_LOST = 3
EXIT_DEVICE_ERROR = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

#: Exit status -> meaning, as ``--help`` and the README list them (read-only).
EXIT_CODES: Mapping[int, str] = MappingProxyType({
    EXIT_OK: "done",
    EXIT_OOM: "out of memory: the trace does not fit the device (or --limit)",
    EXIT_USAGE: "bad input: a bad option, device spec, trace file or output path",
    EXIT_DEVICE_LOST: "the device was lost during the replay",
    EXIT_DEVICE_ERROR: "another device error during the replay (a failed device call, a memory hazard\n"
                       "      the simulator caught, an internal consistency error)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_BROKEN_PIPE: "standard output was closed: the output pipe closed early (e.g. `| head`; nothing\n"
                      "      else went wrong), or it was closed from the start (`>&-`; nothing was run)",
})

_DEFAULT_DEVICE = "sim:h200-141gb"
_FITS_SHOWN = 4

OVERHEAD_MEANING = ("peak reserved / peak live - 1: memory the allocator held from the device, at its worst, "
                    "beyond what the program had allocated")
FRAGMENTATION_MEANING = ("1 - largest free cached block / all free cached bytes, at the end: 0% when the memory "
                         "the allocator keeps but does not use is one piece")


class _UsageError(Exception):
    """A bad input found by a command: printed as ``gpumem COMMAND: message``, exit 2."""


#: Exit status -> meaning in words that hold for every command (``gpumem --help``); a command with more
#: specific words passes them to :func:`_exit_codes_text` (replay: :data:`EXIT_CODES`).
GENERAL_EXIT_CODES: Mapping[int, str] = MappingProxyType({
    EXIT_OK: "done",
    EXIT_OOM: "out of memory: what the command needs does not fit the device (or its limit)",
    EXIT_USAGE: "bad input: a bad option, device spec, input file or output path",
    EXIT_DEVICE_LOST: "the device was lost",
    EXIT_DEVICE_ERROR: "another device error (a failed device call, a memory hazard the simulator caught,\n"
                       "      an internal consistency error)",
    EXIT_INTERRUPTED: EXIT_CODES[EXIT_INTERRUPTED],
    EXIT_BROKEN_PIPE: EXIT_CODES[EXIT_BROKEN_PIPE],
})


def _exit_codes_text(meanings: Mapping[int, str] | None = None) -> str:
    """The ``exit status:`` block of a ``--help``: :data:`GENERAL_EXIT_CODES`, with a command's own
    ``meanings`` (status -> text) in their place; a status whose text is empty is left out."""
    merged = {**GENERAL_EXIT_CODES, **(meanings or {})}
    return "exit status:\n" + "\n".join(f"  {code:<4}{text}" for code, text in sorted(merged.items()) if text)


# -- devices -------------------------------------------------------------------------------------------
def _device_rows() -> list[dict[str, Any]]:
    from gpumem import sim

    rows: list[dict[str, Any]] = []
    try:
        from .cuda.nvml import list_cuda_devices
    except ImportError as exc:  # the adapter itself always imports; this guards partial installs
        log.debug("no CUDA listing: %s", exc)
    else:
        for d in list_cuda_devices():
            # NVML lists without a CUDA context; whether the device has VMM needs one: unknown (None)
            rows.append({"spec": f"cuda:{d.index}", "kind": "cuda", "name": d.name, "total_bytes": d.total_bytes,
                         "free_bytes": d.free_bytes, "vmm_supported": None})
    for profile in sim.BUILTIN_PROFILES:
        dev = sim.SimDevice(profile)
        info = dev.mem_info()
        props = dev.properties()
        dev.close()
        rows.append({
            "spec": profile.spec, "kind": "sim", "name": props.name, "total_bytes": info.total_nbytes,
            "free_bytes": info.free_nbytes, "compute_capability": list(props.compute_capability),
            "unified_memory": props.unified_memory, "vmm_supported": props.vmm_supported,
        })
    return rows


def _no_cuda_reason() -> str:
    """Why no CUDA device is listed, as backend discovery found it: the extra missing, no driver, no GPU..."""
    from .discovery import BackendKind, discover_backends

    cuda = next((b for b in discover_backends() if b.kind is BackendKind.CUDA), None)
    if cuda is None or not cuda.reason:
        return "CUDA backend discovery found none"
    return cuda.reason


def cmd_devices(args: argparse.Namespace) -> int:
    """``gpumem devices``: print the device table (or JSON list); returns the exit status."""
    from .native import engine

    rows = _device_rows()
    which = engine()  # "native" or "python" (the allocator engine gpumem runs on in this install)
    if args.json:
        # Note [The engine in the JSON list]: the list stays a list of devices (what scripts parse);
        # each row says which engine gpumem's default policy would allocate on it with: the native
        # engine runs virtual-memory mode only, so devices without VMM run on the Python engine. A CUDA row
        # (vmm_supported None: unknown until a context exists) names the engine the allocator will try.
        print(json.dumps([{**r, "engine": "python" if r.get("vmm_supported") is False else which} for r in rows],
                         indent=2))
        return EXIT_OK
    print(f"{'SPEC':<24} {'KIND':<5} {'NAME':<36} {'TOTAL':>11} {'FREE':>11}")
    for r in rows:
        print(f"{r['spec']:<24} {r['kind']:<5} {r['name'][:36]:<36} {format_bytes(r['total_bytes']):>11} "
              f"{format_bytes(r['free_bytes']):>11}")
    if not any(r["kind"] == "cuda" for r in rows):
        print(f"(no CUDA device listed: {_no_cuda_reason()})")
    print(f"engine: {which}" + (" (devices without virtual memory management run on the python engine)"
                                if which == "native" and any(r.get("vmm_supported") is False for r in rows) else ""))
    return EXIT_OK


# -- replay --------------------------------------------------------------------------------------------
def _cli_names(message: str) -> str:
    """Python keyword names in a library message, as the options a command-line user passes instead."""
    # the library may already name the option in parentheses: "pass format= (the command line's --format)"
    aside = r"(?:\s*\(the command line's [^)]*\))?"
    message = re.sub(r"\bpass device=" + aside, "pass --device-index N", message)
    return re.sub(r"\bpass format=" + aside, "pass --format NAME", message)


_FILE_KINDS = ((stat.S_ISDIR, "a folder; give a file name"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _shorten_path(path: str, limit: int = 120) -> str:
    return path if len(path) <= limit else path[: limit // 2] + "..." + path[-(limit // 2):]


class OutputFile:
    """An output file checked and opened for writing before a long run (:func:`check_output_path`).

    ``created`` says whether the check created it (empty); :meth:`discard` removes it again then, so that
    a run that fails leaves nothing behind.
    """

    def __init__(self, path: Path, created: bool) -> None:
        self.path = path
        self.created = created

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def discard(self) -> None:
        """Remove the file if the check created it (a failed run); keeps a file that was there before."""
        if self.created:
            try:
                os.unlink(self.path)
            except OSError as exc:  # pragma: no cover - removed meanwhile
                log.debug("could not remove %s: %s", self.path, exc)
            self.created = False


def check_output_path(path: str, option: str) -> OutputFile:
    """Check that a file can be written at ``path`` by opening it for writing (creating it if missing),
    before the long run starts; :class:`_UsageError` saying why not.

    The target, if it exists, must be a regular file (or a link to one): folders, FIFOs, devices, sockets
    and dangling links are refused, since writing them would fail (or block, for a FIFO without a
    reader) only after the whole replay. The file is opened with ``O_WRONLY | O_CREAT | O_NONBLOCK`` and
    without truncation, so an existing file keeps its content until the results are written; every
    ``OSError`` (a missing folder, permission denied, a name too long) is a usage error.
    """
    if not path:
        raise _UsageError(f"{option}: the file name is empty")
    shown = _shorten_path(path)
    p = Path(path)  # note: Path drops a trailing "/", so the checks below use the text as given
    try:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if os.path.lexists(path):
                raise _UsageError(f"{option}: {shown} is a link to a missing file ({os.readlink(path)[:120]}); "
                                  "give a file name") from None
            if path.endswith(("/", os.sep)):
                raise _UsageError(f"{option}: {shown} names a folder (it ends with {path[-1]!r}); give a file name")
            existed = False
        else:
            existed = True
            for is_kind, what in _FILE_KINDS:
                if is_kind(st.st_mode):
                    raise _UsageError(f"{option}: {shown} is {what}")
        parent = p.parent
        if not existed and not parent.is_dir():
            raise _UsageError(f"{option}: no such folder {_shorten_path(str(parent))} (create it first)")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        out = OutputFile(p, created=not existed)
        if not stat.S_ISREG(st.st_mode):  # changed between the checks
            raise _UsageError(f"{option}: {shown} is not a regular file")
        return out
    except OSError as exc:
        raise _UsageError(f"{option}: cannot write {shown}: {exc.strerror or exc}") from None


def _load(args: argparse.Namespace):
    from .trace import detect_format, load_trace

    _check_trace_path(args.trace)
    try:
        if args.device_index is not None:
            fmt = detect_format(args.trace) if args.format is None else args.format
            if fmt != "pytorch-snapshot":
                raise _UsageError(f"--device-index applies to PyTorch snapshots only; {args.trace} is read as {fmt}")
        return load_trace(args.trace, format=args.format, device=args.device_index)
    except FileNotFoundError:
        _check_trace_path(args.trace)
        raise _UsageError(f"no such trace file: {_shorten_path(args.trace)}") from None
    except IsADirectoryError:
        raise _UsageError(_folder_message(args.trace)) from None
    except TraceFormatError as exc:
        if "is a directory" in str(exc).lower():  # the readers' own check
            raise _UsageError(_folder_message(args.trace)) from None
        raise _UsageError(f"cannot read the trace: {_cli_names(str(exc))}") from None
    except OSError as exc:  # permission denied, an I/O error
        raise _UsageError(f"cannot read the trace {_shorten_path(args.trace)}: {exc.strerror or exc}") from None


def _folder_message(path: str) -> str:
    shown = _shorten_path(path)
    return (f"{shown} is a folder, not a trace file; give one trace file, or replay every trace in the folder "
            f"with: python benchmarks/replay_bench.py --traces {shown}")


def _check_trace_path(path: str) -> None:
    """A usage error for a trace path that is a folder or not a regular file (a FIFO, a device)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # the reader says "no such trace file"
    except OSError as exc:  # a name too long, a loop of links, a file where a folder should be
        raise _UsageError(f"cannot read the trace {_shorten_path(path)}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise _UsageError(_folder_message(path))
    if not stat.S_ISREG(st.st_mode):
        what = next((w for is_kind, w in _FILE_KINDS if is_kind(st.st_mode)), "not a regular file")
        raise _UsageError(f"{_shorten_path(path)} is {what}, not a trace file (traces are read from regular files)")


def _usable_nbytes(profile: Any) -> int:
    """What a simulated profile leaves to programs: its total less the CUDA context and the host's share."""
    return int(profile.total_nbytes - profile.context_nbytes - profile.host_reserved_nbytes)


def _spec_has_pressure(device: Any) -> bool:
    """Whether the device was opened from a spec with a pressure scenario (``?pressure=...``)."""
    from .specs import parse_spec

    try:
        return "pressure" in parse_spec(str(getattr(device, "spec", ""))).options
    except GpumemError:
        return False


def oom_report(result: Any, allocator: Any, device: Any) -> str:
    """The out-of-memory report of a stopped replay: what failed, where, why, and what fits the trace."""
    from gpumem import sim

    exc: OutOfMemoryError = result.oom_error
    op = (result.oom_op if result.oom_op is not None else result.completed_ops) + 1
    peak = result.trace_peak_live_bytes
    lines: list[str] = []
    stats = getattr(device, "stats", None)
    n_injected = getattr(stats, "injected_faults", 0) if stats is not None else 0
    injected = bool(getattr(exc, "injected", False))
    what = (f"allocation of {format_bytes(exc.requested_nbytes)} ({exc.requested_nbytes:,} bytes) at op {op:,} of "
            f"{result.n_ops:,}")
    if injected:
        lines.append(f"gpumem replay: an injected fault (the device spec's fault options) failed the {what} on "
                     f"{result.device}; nothing was out of memory. The replay stopped there.")
        return "\n".join(lines)
    lines.append(f"gpumem replay: out of memory on {result.device}: the {what} failed; the replay stopped there.")
    if n_injected:
        lines.append(f"  note: this device spec injects faults ({n_injected} so far): this failure may be one of them.")
    held = (exc.allocated_nbytes or 0) + (exc.cached_nbytes or 0)
    outside = max(0, exc.total_nbytes - exc.free_nbytes - held)
    profile = getattr(device, "profile", None)
    lines.append(f"  device: {format_bytes(exc.free_nbytes)} free of {format_bytes(exc.total_nbytes)}; this "
                 f"allocator held {format_bytes(exc.allocated_nbytes or 0)} in live allocations and "
                 f"{format_bytes(exc.cached_nbytes or 0)} cached but unused.")
    has_pressure = _spec_has_pressure(device)
    if profile is not None:
        ctx = profile.context_nbytes + profile.host_reserved_nbytes
        tenants = min(max(0, int(getattr(device, "tenant_nbytes", 0) or 0)), max(0, outside - min(ctx, outside)))
        rest = max(0, outside - min(ctx, outside) - tenants)
        parts = [f"{format_bytes(min(ctx, outside))} for this process's CUDA context"
                 + ("" if not profile.host_reserved_nbytes else " and the host's share of unified memory")]
        if tenants:
            parts.append(f"{format_bytes(tenants)} held by other tenants (the spec's pressure scenario)")
        if rest:
            parts.append(f"{format_bytes(rest)} of granularity rounding (the device hands out whole pages) and "
                         "the device's own reserve")
        lines.append("  outside this allocator's blocks: " + ", ".join(parts) + ".")
    else:
        tenants = 0
        lines.append(f"  outside this allocator: {format_bytes(outside)} (this process's CUDA context and "
                     "other processes on the device).")
    limit = exc.limit_nbytes
    limit_hit = limit is not None and held + exc.requested_nbytes > limit
    room = (f"leaves {format_bytes(_usable_nbytes(profile))} to programs after the CUDA context" if profile is not None
            else f"has {format_bytes(exc.total_nbytes)} in total")
    lines.append(f"  this trace needs {format_bytes(peak)} ({peak:,} bytes) live at its peak; {result.device} {room}"
                 + (f", and --limit allows {format_bytes(limit)}" if limit is not None else "") + ".")
    # Only profiles that can be *truthfully* offered: not the device that just failed, none that is not
    # larger than it, and none below what the policy had already taken when it failed (live + cached +
    # the failed request): the peak of live bytes alone is a lower bound of what a policy needs, and a
    # policy that rounds or caches needs more, so a card with room for the peak alone may fail the same way.
    needed_at_failure = held + exc.requested_nbytes
    need = max(peak, needed_at_failure)
    own = _usable_nbytes(profile) if profile is not None else None
    fits = [p.spec for p in sim.BUILTIN_PROFILES
            if _usable_nbytes(p) >= need and p is not profile and (own is None or _usable_nbytes(p) > own)]
    # Note [Which bound the peak breaks]: the usable memory of the profile and --limit both bound what a
    # replay may hold; "the peak fits, the policy needed more" is true only when the peak is within both.
    # With the limit below the trace's peak no policy could fit, and the report must say so.
    cap = own if limit is None else (limit if own is None else min(own, limit))
    if limit is not None and limit < peak:
        lines.append(f"  --limit allows {format_bytes(limit)}, less than the {format_bytes(peak)} this trace has live "
                     "at its peak: no allocator could replay it under this limit.")
    elif own is not None and own < peak:
        lines.append(f"  {result.device} has room for {format_bytes(own)}, less than the {format_bytes(peak)} this "
                     "trace has live at its peak: no allocator could replay it on this device.")
    elif cap is not None and cap >= peak:
        where = result.device if limit is None else f"{result.device} under --limit {format_bytes(limit)}"
        lines.append(f"  the peak live bytes fit {where}; under this policy the replay needed more: it held "
                     f"{format_bytes(held)} (live and cached) when the request of "
                     f"{format_bytes(exc.requested_nbytes)} failed.")
    if fits:
        shown = ", ".join(fits[:_FITS_SHOWN]) + (f" and {len(fits) - _FITS_SHOWN} larger" if len(fits) > _FITS_SHOWN
                                                  else "")
        what = ("that peak" if need == peak else
                f"that peak and for the {format_bytes(needed_at_failure)} this policy had reached when it failed")
        lines.append(f"  these larger simulated profiles have room for {what}: {shown} (see `gpumem devices`; "
                     "under this policy it may need more).")
    else:
        lines.append("  no larger simulated profile has room for that peak"
                     + ("" if need == peak else " and for what this policy had reached when it failed") + ".")
    advice = []
    if limit_hit:
        advice.append(f"raise --limit (it is {format_bytes(limit)}; the peak is {format_bytes(peak)})")
    if fits:
        advice.append(f"replay on a larger device (--device {fits[0]})")
    uses_vmm = bool(getattr(allocator, "uses_vmm", False))
    if not uses_vmm and (exc.cached_nbytes or 0) > 0 and getattr(device, "vmm_supported", False):
        advice.append("use --policy gpumem: with virtual memory its cache does not fragment")
    if has_pressure and tenants:
        advice.append("replay without the spec's pressure scenario")
    if advice:
        lines.append("  try: " + "; ".join(advice) + ".")
    return "\n".join(lines)


_LABEL_WIDTH = 15  # the longest label ("peak reserved") and two spaces


def _row(label: str, value: str) -> None:
    print(f"{label:<{_LABEL_WIDTH}}{value}")


def _print_result(result: Any, summary: str | None) -> None:
    _row("trace", f"{result.trace} ({result.n_ops:,} ops, {result.n_allocs:,} allocations)")
    _row("device", result.device)
    _row("policy", result.policy)
    if "engine" in result.extra:
        _row("engine", str(result.extra["engine"]))
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
    from .trace import detect_format
    from .trace.pytorch_export import snapshot_frames

    try:
        fmt = detect_format(args.trace) if args.format is None else args.format
        if fmt != "pytorch-snapshot":
            return None
        return snapshot_frames(args.trace, n_allocs, args.device_index)
    except (GpumemError, OSError, ValueError) as exc:  # the trace was read once already: keep the export going
        logging.getLogger(__name__).info("no stack frames for the exported snapshot: %s", exc)
        return None


def _replay(args: argparse.Namespace, export: OutputFile | None) -> int:
    from .allocator import make_allocator
    from .replay import program_gpu, replay
    from .specs import open_device
    from .trace import save_pytorch_snapshot

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
        allocator = make_allocator(device, args.policy, limit=limit, record_history=export is not None)
        if export is not None and getattr(allocator, "engine", None) == "python":
            from .allocator.native import load_engine

            if load_engine() is not None:
                print("gpumem replay: --export-snapshot records the allocator's history, which only the Python "
                      "engine does: this replay runs on it, several times slower per operation than the native "
                      "engine (see 'time' below)", file=sys.stderr)
        lost = False
        try:
            try:
                gpu = program_gpu(trace, device, args.gpu_timing)
            except InvalidArgumentError as exc:
                raise _UsageError(f"--gpu-timing: {exc}") from None
            result = replay(trace, allocator, stop_on_oom=True, progress=None if not args.json else False,
                            gpu=gpu, gpu_timing=None if gpu is not None else (args.gpu_timing or "idle"))
            summary = allocator.memory_summary() if args.summary else None
            history = allocator.history() if export is not None else None
            report = oom_report(result, allocator, device) if result.oom_error is not None else None
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
        print(json.dumps(data, indent=2))
    else:
        _print_result(result, summary)
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


def _limit_syntax(text: str) -> str:
    """argparse check of ``--limit``'s form (the bytes are computed once the device is open)."""
    try:
        parse_limit(text, 2**64)
    except InvalidArgumentError as exc:
        if "less than one byte" not in str(exc):
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _device_index(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a device number (0, 1, ...), got {text[:40]!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


_LIMIT_HELP = (
    "cap on the memory the allocator reserves. Bytes: a whole number (536870912) or a number with a unit "
    "(8GiB, 512MiB, 1.5GiB: powers of 1024; 512MB, 8GB: powers of 1000). Or a share of the device: a "
    "percentage (90%%) or a fraction written with a decimal point, in (0, 1] (0.9; 1.0 is the whole device). "
    "A bare number with a decimal point is always a fraction, so 2.5 is refused, not read as 2 bytes; '1' "
    "alone is refused as ambiguous (1.0, 100%% or 1B); 8G is refused (GB or GiB?). Same rules as "
    "CachingAllocator(limit=...). Default: no cap."
)


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    """``-v``/``-vv`` after the command too (``gpumem replay -v T``), counted with those before it."""
    parser.add_argument("-v", "--verbose", action="count", default=0, dest="command_verbose",
                        help="more logging (-v info, -vv debug)")


def build_parser() -> argparse.ArgumentParser:
    """The ``gpumem`` argument parser (``devices`` and ``replay``, and the commands of :mod:`gpumem.commands`)."""
    from .commands._args import refuse_repeated_options
    from .allocator.bucket import BUCKET_POLICY_NAME, BucketPolicy
    from .allocator.policy import DEFAULT_POLICY, POLICIES
    from .trace import FORMATS

    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="gpumem",
        formatter_class=raw,
        description="GPU memory management, simulation first: list devices, replay allocation traces.\n"
                    "Run `gpumem COMMAND --help` for a command's options.",
        epilog="device specs: 'sim:<profile>' (see `gpumem devices`), with options such as\n"
               "'sim:h200-141gb?pressure=spikes&seed=3', or 'cuda:<index>' for a real GPU.\n\n" + _exit_codes_text(),
    )
    parser.add_argument("--version", action="version", version=f"gpumem {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("devices", help="list real CUDA devices and simulated profiles", formatter_class=raw,
                       description="List real CUDA devices (via NVML, no CUDA context) and every simulated "
                                   "profile, with total and free bytes, and which allocator engine gpumem runs on "
                                   "(native: the C++ engine; python: the pure-Python one).",
                       epilog="exit status: 0 done.")
    p.add_argument("--json", action="store_true", help="print a JSON list of {spec, kind, name, total_bytes, "
                                                       "free_bytes, engine, ...}")
    _add_verbose(p)
    p.set_defaults(func=cmd_devices)

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
                        "GPU has one)")
    p.add_argument("--gpu-timing", choices=[t.value for t in GpuTiming], default=None,
                   help="how the program's GPU work runs beside the replay, so that memory is freed while work "
                        "that used it may still be queued: 'trace' (GPU time from the trace's clock), 'model' "
                        "(from the bytes each kernel touches), 'idle' (no GPU work, every fence done at once). "
                        f"Default: {DEFAULT_GPU_TIMING.value} on a simulated device, idle on a real one")
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

    import importlib

    from .commands import COMMAND_MODULES
    for name in COMMAND_MODULES:
        importlib.import_module(f".commands.{name}", __package__).register(sub, raw)
    refuse_repeated_options(parser)  # Note [Options behave the same in every command]
    return parser


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except _UsageError as exc:
        print(f"gpumem {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DeviceLostError as exc:
        print(f"gpumem {args.command}: the device was lost: {exc}", file=sys.stderr)
        return EXIT_DEVICE_LOST
    except InvalidArgumentError as exc:
        print(f"gpumem {args.command}: {_cli_names(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except GpumemError as exc:
        print(f"gpumem {args.command}: device error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_DEVICE_ERROR


def _stdout_closed() -> bool:
    """Whether standard output is missing or closed (Python sets ``sys.stdout`` to None when the process
    starts with file descriptor 1 closed)."""
    out = sys.stdout
    if out is None or getattr(out, "closed", False):
        return True
    try:
        fd = out.fileno()
    except (OSError, ValueError, AttributeError):  # a stream without a file descriptor (captured output)
        return False
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gpumem`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Ctrl-C anywhere in here, the imports that building the parser and the commands do included, ends with
    one line on stderr and status 130. (Python's own start-up and the imports of the ``gpumem`` package
    and of this module, about the first 0.15 s of the process, come before this function runs: a Ctrl-C
    then still ends as for any Python program, with Python's traceback and death by SIGINT, which a shell
    reports as status 130 too.)
    """
    command = ""
    sigint: _SigintFlag | None = None
    try:
        # inside the try: a Ctrl-C while the handler is being installed is an interruption like any other
        sigint = _SigintFlag()
        parser = build_parser()
        from .commands._args import strip_bookkeeping

        args = strip_bookkeeping(parser.parse_args(argv))
        command = f" {args.command}"
        return _main(args)
    except KeyboardInterrupt:
        pass
    except Exception:
        # a Ctrl-C inside a C extension's import (numpy's) can come out as an ImportError or SystemError
        if sigint is None or not sigint.seen:
            raise
    finally:
        if sigint is not None:
            sigint.restore()
    if sys.stderr is not None:
        print(f"gpumem{command}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


class _SigintFlag:
    """Python's SIGINT handling (``KeyboardInterrupt``) that also remembers that SIGINT came, for :func:`main`.

    Installed only over Python's default handler, in the main thread; :meth:`restore` puts it back.
    """

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None
        try:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread
            pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self._previous is not None:
            try:
                signal.signal(signal.SIGINT, self._previous)
            except ValueError:  # pragma: no cover
                pass
            self._previous = None


def _main(args: argparse.Namespace) -> int:
    level = logging.WARNING - 10 * min(args.verbose + getattr(args, "command_verbose", 0), 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if _stdout_closed():
        # started with stdout closed (`gpumem replay T >&-`): the results could go nowhere; end at once, as
        # for a closed pipe, with one line on stderr (if there is one) and no traceback
        if sys.stderr is not None:
            print(f"gpumem {args.command}: standard output is closed: nothing to print the results to",
                  file=sys.stderr)
        return EXIT_BROKEN_PIPE
    try:
        code = _run(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the reader went away (`| head`): as CPython's documentation recommends, point stdout at devnull so that
        # the interpreter's final flush does not fail again, and end quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor
            pass
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
