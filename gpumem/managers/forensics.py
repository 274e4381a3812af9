"""OOM forensics: when an allocation fails, write down who held what before the error propagates.

:func:`write_oom_forensics` writes two files into a directory:

* ``oom-<device>-<time>-<pid>-<n>.pickle``: a PyTorch memory snapshot
  (:mod:`gpumem.trace.pytorch_export`, the format ``torch.cuda.memory._dump_snapshot`` writes and
  https://pytorch.org/memory_viz draws) of the buffers the tracker holds, in the order they were
  made, each with its frames: first a frame naming its region and tag (``<gpumem region>``), then
  its Python stack when stacks are captured; region, tag and buffer id are also in each entry's
  ``user_metadata``. The failed request is the trace's last entry, an ``oom`` action. gpumem's own
  reader (:func:`gpumem.trace.read_pytorch_snapshot`) loads it back.
* ``oom-....txt``: a short report: the error, what the device and the manager held, the top
  regions, tags and allocation sites by bytes, and the largest buffers.

:class:`ForensicsLayer` does this for any resource stack; a
:class:`~gpumem.managers.GpuMemoryManager` adds it when ``MemoryConfig.oom_forensics_dir`` is set.
The :class:`~gpumem.errors.OutOfMemoryError` that propagates says where the files are
(``error.forensics``, and the end of its message). :func:`replay_oom_report` is the text ``gpumem replay``
prints when a replay runs out of memory: what failed, why, and which simulated profiles have room.

Note [Forensics never hide the out-of-memory error]
---------------------------------------------------
Writing the files can fail (a full disk, a read-only directory). That failure is logged and the
original out-of-memory error propagates unchanged: the program must learn that it ran out of
memory, not that a report could not be written.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from gpumem.device import Device
from gpumem.errors import GpumemError, InvalidArgumentError, OutOfMemoryError
from gpumem.trace.model import OpKind, Trace
from gpumem.trace.pytorch_export import save_pytorch_snapshot, to_pytorch_snapshot
from gpumem.units import format_bytes

from .layers import ResourceLayer
from .resource import MemoryResource
from .tracker import AllocationInfo, AllocationTracker, Location

log = logging.getLogger(__name__)

#: Rows per table in the text report.
TOP_N = 10


@dataclass(frozen=True)
class ForensicsRecord:
    """The files one out-of-memory error left behind."""

    snapshot_path: Path
    report_path: Path
    requested_nbytes: int
    n_buffers: int
    """Buffers in the snapshot (live GPU buffers the tracker knew)."""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "device"


def _frames(info: AllocationInfo) -> list[dict[str, Any]]:
    head = {"filename": "<gpumem region>", "line": 0,
            "name": f"region={info.region or '(none)'} tag={info.tag or '(none)'} buffer=#{info.buffer_id}"}
    stack = [{"filename": f.filename, "line": f.line, "name": f.name} for f in reversed(info.stack or ())]
    return [head] + stack  # PyTorch lists the innermost frame first


def _metadata(info: AllocationInfo) -> str:
    return f"region={info.region or ''};tag={info.tag or ''};buffer={info.buffer_id}"


def build_snapshot(buffers: Iterable[AllocationInfo], *, name: str = "snapshot") -> dict[str, Any]:
    """The PyTorch snapshot dict of ``buffers`` (GPU buffers with a pointer): one ``alloc`` entry and
    one active block each, with the region, tag and Python stack as frames (region first) and as
    ``user_metadata``. What an OOM writes and what :meth:`GpuMemoryManager.export_snapshot` writes."""
    live = sorted((b for b in buffers if b.location is Location.GPU and b.ptr is not None),
                  key=lambda b: (b.created_s, b.buffer_id))
    t0 = live[0].created_s if live else 0.0
    ops = [(int(OpKind.ALLOC), i, b.nbytes, 0, round((b.created_s - t0) * 1e6), b.ptr) for i, b in enumerate(live)]
    trace = Trace.from_ops(name, "gpumem.managers.forensics", ops)
    snap = to_pytorch_snapshot(trace)
    by_addr = {b.ptr: b for b in live}
    entries = snap["device_traces"][-1]
    for e in entries:
        b = by_addr.get(e["addr"])
        if b is not None and e["action"] == "alloc":
            e["frames"] = _frames(b)
            e["user_metadata"] = _metadata(b)
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            b = by_addr.get(blk["address"])
            if b is not None and blk["state"] == "active_allocated":
                blk["frames"] = _frames(b)
    return snap


def build_oom_snapshot(buffers: Iterable[AllocationInfo], requested_nbytes: int, free_nbytes: int,
                       *, name: str = "oom", stream: int = 0) -> dict[str, Any]:
    """:func:`build_snapshot` of ``buffers`` followed by an ``oom`` entry."""
    snap = build_snapshot(buffers, name=name)
    entries = snap["device_traces"][-1]
    last_t = max((e["time_us"] for e in entries), default=0)
    entries.append(oom_entry(requested_nbytes, free_nbytes, stream=stream, time_us=last_t))
    return snap


def oom_entry(requested_nbytes: int, free_nbytes: int, *, stream: int = 0, time_us: float = 0,
              frames: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A PyTorch snapshot trace entry for a failed request (``action == "oom"``), as PyTorch writes it."""
    return {"action": "oom", "addr": 0, "size": int(requested_nbytes), "stream": int(stream), "time_us": time_us,
            "frames": list(frames or ()), "device_free": int(free_nbytes)}


def unique_stem(directory: Path, spec: str, sequence: int = 0) -> str:
    """``oom-<device>-<time>-<pid>-<n>``: a file stem no ``.pickle`` or ``.txt`` in ``directory`` has yet."""
    base = f"oom-{_slug(spec)}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{sequence}"
    stem, n = base, 1
    while (directory / f"{stem}.pickle").exists() or (directory / f"{stem}.txt").exists():  # same second
        stem, n = f"{base}.{n}", n + 1
    return stem


def _table(title: str, rows: list[tuple[str, int, int]]) -> list[str]:
    out = [title]
    out += [f"  {format_bytes(n):>12}  {c:>6} buffer(s)  {k}" for k, n, c in rows[:TOP_N]] or ["  (none)"]
    return out


def _group(buffers: list[AllocationInfo], key: Any) -> list[tuple[str, int, int]]:
    acc: dict[str, list[int]] = {}
    for b in buffers:
        slot = acc.setdefault(key(b) or "(none)", [0, 0])
        slot[0] += b.nbytes
        slot[1] += 1
    return sorted(((k, n, c) for k, (n, c) in acc.items()), key=lambda x: (-x[1], x[0]))


def format_oom_report(error: OutOfMemoryError, buffers: list[AllocationInfo], *, device: str = "",
                      extra: Iterable[str] = (), tracking: bool | None = None) -> str:
    """The text report: the error, then who holds what (top regions, tags, sites, largest buffers).

    ``tracking``: whether a tracker was on (default: whether ``buffers`` is non-empty). With tracking on
    and no buffers, the report says so: advice to turn tracking on would be wrong there (the memory is
    then held outside this manager's tracked buffers: its pool's cache, other processes, the context)."""
    if tracking is None:
        tracking = bool(buffers)
    total = sum(b.nbytes for b in buffers)
    lines = [f"gpumem out-of-memory report ({time.strftime('%Y-%m-%d %H:%M:%S %Z')}, pid {os.getpid()})",
             f"device: {device or error.device or '?'}", f"error: {error}", ""]
    lines += list(extra)
    lines.append(f"tracked live buffers: {len(buffers)}, {format_bytes(total)} "
                 f"({format_bytes(sum(b.nbytes for b in buffers if b.location is Location.GPU))} on the GPU)")
    lines += _table("top regions:", _group(buffers, lambda b: b.region))
    lines += _table("top tags:", _group(buffers, lambda b: b.tag))
    lines += _table("top allocation sites:", _group(buffers, lambda b: b.site() if b.stack else None))
    lines.append("largest buffers:")
    for b in sorted(buffers, key=lambda b: -b.nbytes)[:TOP_N]:
        lines.append(f"  {format_bytes(b.nbytes):>12}  #{b.buffer_id} {b.location.value} region={b.region} "
                     f"tag={b.tag} at {b.site()}")
    if not buffers and tracking:
        lines.append("  (no live tracked buffers: this manager's allocations hold nothing now; the memory is "
                     "held elsewhere, see the device figures above)")
    elif not buffers:
        lines.append("  (no tracked buffers: turn on MemoryConfig.track_allocations to see who holds what)")
    return "\n".join(lines) + "\n"


def write_oom_forensics(directory: str | os.PathLike[str], error: OutOfMemoryError, *,
                        tracker: AllocationTracker | None = None, device: Device | None = None,
                        extra: Iterable[str] = (), sequence: int = 0) -> ForensicsRecord:
    """Write the snapshot and the report for ``error`` into ``directory`` (created if missing)."""
    if not isinstance(error, OutOfMemoryError):
        raise InvalidArgumentError(f"error must be an OutOfMemoryError, got {type(error).__name__}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    spec = device.spec if device is not None else (error.device or "device")
    stem = unique_stem(d, spec, sequence)  # another manager may write in the same second
    buffers = tracker.live() if tracker is not None else []
    snap = build_oom_snapshot(buffers, error.requested_nbytes, error.free_nbytes, name=stem)
    snap["allocator_settings"]["oom_message"] = str(error)
    snapshot_path = save_pytorch_snapshot(snap, d / f"{stem}.pickle")
    report_path = d / f"{stem}.txt"
    report_path.write_text(format_oom_report(error, buffers, device=spec, extra=extra,
                                                     tracking=tracker is not None), encoding="utf-8")
    return ForensicsRecord(snapshot_path, report_path, error.requested_nbytes,
                           sum(1 for b in buffers if b.location is Location.GPU and b.ptr is not None))


def with_forensics(error: OutOfMemoryError, record: ForensicsRecord) -> OutOfMemoryError:
    """A copy of ``error`` whose message ends with where the forensics are; ``.forensics`` is the record."""
    hint = (error.hint + " " if error.hint else "") + (
        f"OOM forensics: snapshot {record.snapshot_path} (PyTorch format: pytorch.org/memory_viz), "
        f"report {record.report_path}.")
    new = OutOfMemoryError(error.requested_nbytes, error.free_nbytes, error.total_nbytes, device=error.device,
                           allocated_nbytes=error.allocated_nbytes, cached_nbytes=error.cached_nbytes,
                           limit_nbytes=error.limit_nbytes, hint=hint, injected=error.injected,
                           rounded_nbytes=error.rounded_nbytes)
    new.forensics = record  # type: ignore[attr-defined]
    return new


class ForensicsLayer(ResourceLayer):
    """On an out-of-memory error from upstream, writes :func:`write_oom_forensics` into ``directory``
    and raises the error with the files' paths (Note [Forensics never hide the out-of-memory error]).

    ``tracker``: whose buffers to report (a :class:`~gpumem.managers.layers.TrackingLayer`'s); without
    one the report has the error and the device's figures only. :attr:`records` lists what was written.
    """

    def __init__(self, upstream: MemoryResource, directory: str | os.PathLike[str], *,
                 tracker: AllocationTracker | None = None) -> None:
        super().__init__(upstream)
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise InvalidArgumentError(f"directory must be a non-empty path, got {directory!r}")
        if tracker is not None and not isinstance(tracker, AllocationTracker):
            raise InvalidArgumentError(f"tracker must be an AllocationTracker, got {type(tracker).__name__}")
        self.directory = Path(directory)
        self.tracker = tracker
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self.records: list[ForensicsRecord] = []  # guarded by _lock

    def do_allocate(self, nbytes: int, alignment: int, stream: int) -> int:
        try:
            return self.upstream.do_allocate(nbytes, alignment, stream)
        except OutOfMemoryError as exc:
            try:
                mem = self.device.mem_info()
                extra = [f"device memory now: {format_bytes(mem.free_nbytes)} free of {format_bytes(mem.total_nbytes)}",
                         f"request: {format_bytes(nbytes)} ({nbytes} bytes), alignment {alignment}, stream {stream}", ""]
                record = write_oom_forensics(self.directory, exc, tracker=self.tracker, device=self.device,
                                             extra=extra, sequence=next(self._seq))
            except Exception as write_exc:  # noqa: BLE001 - Note [Forensics never hide the out-of-memory error]
                log.error("could not write OOM forensics to %s: %s: %s", self.directory, type(write_exc).__name__,
                          write_exc)
                raise exc from None
            with self._lock:
                self.records.append(record)
            log.warning("out of memory on %s: forensics written to %s", self.device.spec, record.report_path)
            raise with_forensics(exc, record) from exc


def write_snapshot(path: str | os.PathLike[str], tracker: AllocationTracker, *, name: str = "snapshot") -> Path:
    """Write :func:`build_snapshot` of ``tracker``'s live buffers to ``path`` (PyTorch's pickle format:
    pytorch.org/memory_viz, or :func:`gpumem.trace.read_pytorch_snapshot`); return the path."""
    if not isinstance(tracker, AllocationTracker):
        raise InvalidArgumentError(f"tracker must be an AllocationTracker, got {type(tracker).__name__}")
    out = Path(path)
    if out.is_dir():
        raise InvalidArgumentError(f"cannot write the snapshot to {out}: it is a folder (give a file name)")
    if not out.parent.is_dir():
        raise InvalidArgumentError(f"cannot write the snapshot to {out}: no such folder {out.parent}")
    snapshot = build_snapshot(tracker.live(), name=name)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:  # an existing file is replaced only by a complete snapshot
        save_pytorch_snapshot(snapshot, Path(tmp_name))
        os.replace(tmp_name, out)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write the snapshot to {out}: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return out


#: How many larger simulated profiles the replay's out-of-memory report names.
_FITS_SHOWN = 4


def _usable_nbytes(profile: Any) -> int:
    """What a simulated profile leaves to programs: its total less the CUDA context and the host's share."""
    return int(profile.total_nbytes - profile.context_nbytes - profile.host_reserved_nbytes)


def _spec_has_pressure(device: Any) -> bool:
    """Whether the device was opened from a spec with a pressure scenario (``?pressure=...``)."""
    from gpumem.specs import parse_spec

    try:
        return "pressure" in parse_spec(str(getattr(device, "spec", ""))).options
    except GpumemError:
        return False


def replay_oom_report(result: Any, allocator: Any, device: Any) -> str:
    """The out-of-memory report of a replay stopped at its first out-of-memory error (``gpumem replay``, a
    :class:`~gpumem.replay.ReplayResult` with ``oom_error`` set): what failed, where, why, and which simulated
    profiles have room for the trace. ``allocator`` and ``device`` are the ones the replay ran on."""
    from gpumem import sim  # the simulator's profiles, imported on demand to keep the managers light

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
                f"that peak and for the {format_bytes(needed_at_failure)} this policy needed when it failed (what it "
                "held, live and cached, plus the failed request)")
        lines.append(f"  these larger simulated profiles have room for {what}: {shown} (see `gpumem devices`; "
                     "under this policy it may need more).")
    else:
        lines.append("  no larger simulated profile has room for that peak"
                     + ("" if need == peak else " and for what this policy needed when it failed (what it held "
                                                "plus the failed request)") + ".")
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


__all__ = ["ForensicsLayer", "ForensicsRecord", "write_oom_forensics", "build_oom_snapshot", "build_snapshot",
           "write_snapshot", "format_oom_report", "with_forensics", "oom_entry", "unique_stem", "replay_oom_report"]
