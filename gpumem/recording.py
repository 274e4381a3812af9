"""Recording a PyTorch program's GPU memory: the snapshot ``gpumem replay`` and ``gpumem report`` read.

From Python, around the code to record::

    import gpumem
    with gpumem.record(out="run1") as rec:      # allocator="gpumem" to record PyTorch on gpumem.torch
        train()
    print(rec.result.snapshot_path)              # run1/snapshot.pickle

From the shell, for a whole program: ``gpumem record --out run1 --report -- python train.py ARGS``
(:mod:`gpumem.commands.record`, which runs the program under :mod:`gpumem.record_child`).

The snapshot is written when the block ends, normally or by an exception (an out-of-memory error
included). With PyTorch's allocator it is PyTorch's own (``torch.cuda.memory._record_memory_history``
then ``_snapshot``: stacks and all); under gpumem.torch, where PyTorch records nothing for a pluggable
allocator, it is built from gpumem's native allocation history (Note [Allocation history for gpumem
record] in ``gpumem/_native/torch_api.cpp``): allocations, frees and out-of-memory events, no stacks.

Snapshot on out of memory: :func:`snapshot_on_oom` (or ``GPUMEM_OOM_SNAPSHOT_DIR`` for ``gpumem record``
and :func:`record`) writes, when an allocation fails and before the error reaches the program, the
snapshot and a text report of who holds what (:func:`gpumem.managers.forensics.format_oom_report`) into
a folder: ``oom-cuda-<n>-<time>-<pid>-<k>.pickle`` and ``.txt``.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import itertools
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from .errors import BackendUnavailableError, GpumemError, InvalidArgumentError, OutOfMemoryError
from . import torch as gtorch
from .units import format_bytes

log = logging.getLogger(__name__)

__all__ = ["Allocator", "record", "Recording", "RecordResult", "OomSnapshot", "snapshot_on_oom",
           "OOM_SNAPSHOT_ENV", "SNAPSHOT_NAME", "DEFAULT_MAX_ENTRIES", "MAX_ENTRIES_LIMIT", "check_max_entries",
           "MAX_OOM_SNAPSHOTS"]

#: Environment variable naming the folder for out-of-memory snapshots (``gpumem record``, :func:`record`).
OOM_SNAPSHOT_ENV = "GPUMEM_OOM_SNAPSHOT_DIR"
#: The snapshot's file name in the output folder.
SNAPSHOT_NAME = "snapshot.pickle"
#: Allocation events kept at most (PyTorch's ``max_entries``; gpumem's history stops there).
DEFAULT_MAX_ENTRIES = 1_000_000
#: The largest ``max_entries`` taken: gpumem's history counts in 64 bits, and ctypes passes a larger int on
#: modulo 2**64 (2**64 became 0, which turns the history off: a recording of nothing).
MAX_ENTRIES_LIMIT = 2**63 - 1


def check_max_entries(value: Any, name: str = "max_entries") -> int:
    """``value`` if it is an int from 1 to :data:`MAX_ENTRIES_LIMIT`; :class:`InvalidArgumentError` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_ENTRIES_LIMIT:
        raise InvalidArgumentError(f"{name} must be an int from 1 to {MAX_ENTRIES_LIMIT}, got {value!r}")
    return value


class Allocator(str, enum.Enum):
    """Whose allocator the recorded program runs on."""

    PYTORCH = "pytorch"
    """PyTorch's own CUDA caching allocator."""
    GPUMEM = "gpumem"
    """gpumem's native engine through :mod:`gpumem.torch` (installed by the recording)."""


@dataclass(frozen=True)
class OomSnapshot:
    """The files one out-of-memory error left behind (:func:`snapshot_on_oom`)."""

    snapshot_path: Path
    report_path: Path
    device: int
    requested_nbytes: int


@dataclass(frozen=True)
class RecordResult:
    """What a recording wrote."""

    snapshot_path: Path
    allocator: Allocator
    n_events: int
    """Entries in the snapshot's device traces (allocations, frees, segment events, OOMs)."""
    dropped: int = 0
    """Events past ``max_entries`` that were not kept (gpumem's history; PyTorch keeps the newest instead)."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailableError(f"PyTorch is not installed for {sys.executable} ({exc})") from None
    if not torch.cuda.is_available():
        raise BackendUnavailableError("PyTorch sees no CUDA device (torch.cuda.is_available() is False: no GPU, "
                                      "no driver, a CPU-only PyTorch or CUDA_VISIBLE_DEVICES hiding them)")
    return torch


def _allocator(value: "Allocator | str") -> Allocator:
    try:
        return Allocator(value)
    except ValueError:
        raise InvalidArgumentError(f"allocator must be one of {[a.value for a in Allocator]}, got {value!r}") from None


# -- gpumem's native history ------------------------------------------------------------------------------
class _HistoryEvent(ctypes.Structure):
    """Mirror of ``HistoryEvent`` in ``gpumem/_native/torch_api.cpp``."""

    _fields_ = [("addr", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("stream", ctypes.c_uint64),
                ("time_us", ctypes.c_double), ("device", ctypes.c_int32), ("action", ctypes.c_int32)]


_OOM_OBSERVER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)
_ALLOC, _FREE, _OOM = 0, 1, 2


@functools.cache
def _native() -> ctypes.CDLL:
    from .native import library_path

    lib = ctypes.CDLL(library_path())
    lib.gpumem_torch_record_history.restype = ctypes.c_int
    lib.gpumem_torch_record_history.argtypes = [ctypes.c_uint64]
    lib.gpumem_torch_history.restype = ctypes.c_int64
    lib.gpumem_torch_history.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64)]
    lib.gpumem_torch_set_oom_observer.restype = None
    lib.gpumem_torch_set_oom_observer.argtypes = [_OOM_OBSERVER]
    lib.gpumem_torch_history_event_size.restype = ctypes.c_int
    size = lib.gpumem_torch_history_event_size()
    if size != ctypes.sizeof(_HistoryEvent):
        raise GpumemError(f"gpumem's native history events are {size} bytes, its Python mirror "
                          f"{ctypes.sizeof(_HistoryEvent)}: rebuild the engine (python setup.py build_ext --inplace)")
    return lib


def _native_history_on(max_entries: int) -> None:
    lib = _native()
    if lib.gpumem_torch_record_history(max_entries) != 0:
        raise GpumemError("gpumem could not start its allocation history")


def _native_events() -> tuple[list[tuple[int, int, int, int, float, int]], int]:
    """The native history as ``(action, device, addr, nbytes, stream, time_us)`` tuples, and the dropped count."""
    lib = _native()
    dropped = ctypes.c_uint64(0)
    n = lib.gpumem_torch_history(None, 0, ctypes.byref(dropped))
    buf = (_HistoryEvent * max(n, 1))()
    n = min(n, lib.gpumem_torch_history(buf, n, ctypes.byref(dropped)))
    return [(e.action, e.device, e.addr, e.nbytes, e.stream, e.time_us) for e in buf[:n]], int(dropped.value)


def snapshot_from_events(events: list[tuple[int, int, int, int, int, float]], *, name: str = "gpumem.torch",
                         free_nbytes: "dict[int, int] | None" = None) -> dict[str, Any]:
    """The PyTorch snapshot dict of gpumem's native history (``(action, device, addr, nbytes, stream,
    time_us)``; action 0 alloc, 1 free, 2 out of memory): one device trace per device, each out-of-memory
    event an ``oom`` entry. A free of memory allocated before the history began is skipped."""
    from .managers.forensics import oom_entry
    from .trace.pytorch_export import to_pytorch_snapshot
    from .trace.recorder import TraceRecorder

    devices = sorted({e[1] for e in events}) or [0]
    snap: dict[str, Any] = {"segments": [], "device_traces": [[] for _ in range(max(devices) + 1)]}
    for dev in devices:
        rec = TraceRecorder()
        ooms = []
        for action, d, addr, nbytes, stream, t_us in events:
            if d != dev:
                continue
            if action == _ALLOC:
                rec.record_alloc(addr, nbytes, stream, t_us)
            elif action == _FREE:
                rec.record_free(addr, stream, t_us)
            elif action == _OOM:
                ooms.append(oom_entry(nbytes, (free_nbytes or {}).get(d, 0), stream=stream, time_us=t_us))
        one = to_pytorch_snapshot(rec.to_trace(f"{name} cuda:{dev}"), device=dev)
        entries = one["device_traces"][dev] + ooms
        entries.sort(key=lambda e: e["time_us"])  # stable: an OOM after the events of its moment
        snap["device_traces"][dev] = entries
        snap["segments"] += one["segments"]
        snap["allocator_settings"] = {**one["allocator_settings"], "trace_name": name,
                                      "generated_by": "gpumem.recording (gpumem.torch history)"}
    return snap


# -- snapshot on out of memory --------------------------------------------------------------------------------
def _buffers_of(snap: dict[str, Any], device: int) -> list[Any]:
    """The active blocks of a snapshot's segments on ``device`` as tracker entries (with their stacks), for
    :func:`~gpumem.managers.forensics.format_oom_report`."""
    from .managers.tracker import AllocationInfo, BufferId, Location, StackFrame

    out = []
    for seg in snap.get("segments", ()):
        if seg.get("device", device) != device:
            continue
        for blk in seg.get("blocks", ()):
            if blk.get("state") != "active_allocated":
                continue
            frames = blk.get("frames") or ()
            stack = tuple(StackFrame(str(f.get("filename", "?")), int(f.get("line", 0)), str(f.get("name", "?")))
                          for f in reversed(frames))  # PyTorch lists the innermost first; the tracker last
            out.append(AllocationInfo(BufferId(len(out)), int(blk.get("requested_size", blk["size"])), Location.GPU,
                                      0.0, 0.0, ptr=int(blk["address"]), device=f"cuda:{device}",
                                      stack=stack or None))
    return out


#: Out-of-memory snapshots written at most per process (Note [A bound on out-of-memory snapshots]).
MAX_OOM_SNAPSHOTS = 16

# Note [A bound on out-of-memory snapshots]: a program that catches torch.OutOfMemoryError and retries (halve
# the batch until it fits, skip the sample, a serving loop) meets the error hundreds of times, and each error
# wrote a full snapshot (with a million-event history, hundreds of MB): the disk filled with copies of one
# story. The first MAX_OOM_SNAPSHOTS errors are written (the first is the one that tells why); later ones are
# counted (``skipped``, in gpumem record's record.json) and logged once, and the snapshot is not even taken.


@dataclass
class _OomHook:
    """The process's out-of-memory hook (made once: PyTorch cannot detach an observer); ``directory`` None: off."""

    directory: "Path | None" = None
    records: list[OomSnapshot] = field(default_factory=list)
    skipped: int = 0
    """Out-of-memory errors past :data:`MAX_OOM_SNAPSHOTS`, not written."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    seq: Any = field(default_factory=itertools.count)
    native_callback: Any = None  # the ctypes callback gpumem's engine holds: kept alive here
    pytorch_attached: bool = False

    def write(self, device: int, requested: int, free: int, total: int, snap: dict[str, Any], extra: list[str],
              allocated: "int | None" = None, cached: "int | None" = None) -> None:
        """Write the snapshot and the report; never raises (Note [Forensics never hide the out-of-memory error])."""
        from .managers.forensics import format_oom_report, unique_stem
        from .trace.pytorch_export import save_pytorch_snapshot

        directory = self.directory
        if directory is None or self._full():
            return
        try:
            with self.lock:
                if self._full():
                    return
                directory.mkdir(parents=True, exist_ok=True)
                spec = f"cuda:{device}"
                stem = unique_stem(directory, spec, next(self.seq))
                error = OutOfMemoryError(requested, free, total, device=spec, allocated_nbytes=allocated,
                                         cached_nbytes=cached)
                snap.setdefault("allocator_settings", {})["oom_message"] = str(error)
                snapshot_path = save_pytorch_snapshot(snap, directory / f"{stem}.pickle")
                report_path = directory / f"{stem}.txt"
                report_path.write_text(format_oom_report(error, _buffers_of(snap, device), device=spec, extra=extra,
                                                         tracking=True), encoding="utf-8")
                self.records.append(OomSnapshot(Path(snapshot_path), report_path, device, requested))
            log.warning("out of memory on cuda:%d (%s requested): snapshot %s, report %s", device,
                        format_bytes(requested), snapshot_path, report_path)
        except Exception as exc:  # noqa: BLE001 - the program must learn of the OOM, not of a failed report
            log.error("could not write the out-of-memory snapshot to %s: %s: %s", directory, type(exc).__name__, exc)

    def _full(self) -> bool:
        """True (and the error counted, logged once) past :data:`MAX_OOM_SNAPSHOTS`."""
        if len(self.records) < MAX_OOM_SNAPSHOTS:
            return False
        self.skipped += 1
        if self.skipped == 1:
            log.warning("%d out-of-memory snapshots written; later out-of-memory errors are not written "
                        "(Note [A bound on out-of-memory snapshots])", MAX_OOM_SNAPSHOTS)
        return True

    def on_pytorch_oom(self, device: int, alloc: int, device_total: int, device_free: int) -> None:
        """PyTorch's OOM observer (``torch._C._cuda_attach_out_of_memory_observer``): PyTorch passes the device,
        the bytes requested, the device's total (or the cap of its memory fraction) and its free bytes."""
        if self.directory is None or len(self.records) >= MAX_OOM_SNAPSHOTS:
            self.write(int(device), int(alloc), 0, 0, {}, [])  # counts it
            return
        try:
            snap = _torch().cuda.memory._snapshot()
            segments = [seg for seg in snap.get("segments", ()) if seg.get("device", device) == device]
            reserved = sum(int(seg.get("total_size", 0)) for seg in segments)
            allocated = sum(int(b.get("size", 0)) for seg in segments for b in seg.get("blocks", ())
                            if b.get("state") == "active_allocated")
            extra = [f"PyTorch on cuda:{device}: {format_bytes(allocated)} allocated, {format_bytes(reserved)} "
                     f"reserved ({format_bytes(reserved - allocated)} reserved but unallocated)", ""]
        except Exception as exc:  # noqa: BLE001
            log.error("could not take PyTorch's snapshot at the out-of-memory error: %s", exc)
            return
        self.write(int(device), int(alloc), int(device_free), int(device_total), snap, extra, allocated,
                   max(0, reserved - allocated))

    def on_gpumem_oom(self, device: int, requested: int, free: int, total: int) -> None:
        """gpumem.torch's OOM observer (called by ``gpumem_torch_malloc`` before it throws)."""
        if self.directory is None or len(self.records) >= MAX_OOM_SNAPSHOTS:
            self.write(int(device), int(requested), 0, 0, {}, [])  # counts it
            return
        try:
            events, _ = _native_events()
            snap = snapshot_from_events(events, free_nbytes={device: free})
            extra = gtorch.memory_summary(device).splitlines() + [""]
        except Exception as exc:  # noqa: BLE001
            log.error("could not read gpumem's history at the out-of-memory error: %s", exc)
            return
        self.write(int(device), int(requested), int(free), int(total), snap, extra)


@functools.cache
def _oom_hook() -> _OomHook:
    return _OomHook()


def _attach(hook: _OomHook, allocator: Allocator, torch: Any) -> None:
    if allocator is Allocator.GPUMEM:
        if hook.native_callback is None:
            hook.native_callback = _OOM_OBSERVER(hook.on_gpumem_oom)
            _native().gpumem_torch_set_oom_observer(hook.native_callback)
    elif not hook.pytorch_attached:
        torch._C._cuda_attach_out_of_memory_observer(hook.on_pytorch_oom)
        hook.pytorch_attached = True


def _current_allocator() -> Allocator:
    return Allocator.GPUMEM if gtorch.installed() else Allocator.PYTORCH


def snapshot_on_oom(directory: "str | os.PathLike[str] | None", *, max_entries: int = DEFAULT_MAX_ENTRIES,
                    history: bool = True) -> None:
    """On every later out-of-memory error of PyTorch (on its allocator, or on gpumem.torch after
    :func:`gpumem.torch.install`), write a snapshot and a report of who holds what into ``directory``
    before the error reaches the program. ``None`` turns it off. At most :data:`MAX_OOM_SNAPSHOTS` errors
    per process are written (a program that retries after the error would fill the disk); later ones are
    counted and logged once.

    ``history``: also turn the allocation history on now (PyTorch's ``_record_memory_history``, or
    gpumem's), so that the snapshot holds the events that led to the error; otherwise it holds what the
    history recorded (nothing if it is off) and, on PyTorch's allocator, the segments at the error.

    ``directory`` is made absolute now (a later ``os.chdir`` does not move it) and created at the first error.

    Raises:
        BackendUnavailableError: no PyTorch or no CUDA device.
        InvalidArgumentError: ``max_entries`` is not an int from 1 to :data:`MAX_ENTRIES_LIMIT`.
    """
    hook = _oom_hook()
    if directory is None:
        hook.directory = None
        return
    check_max_entries(max_entries)
    folder = Path(directory).absolute()  # a later chdir of the program does not move it
    torch = _torch()
    allocator = _current_allocator()
    _attach(hook, allocator, torch)
    if history:
        _history_on(allocator, torch, max_entries, stacks=True)
    hook.directory = folder
    log.info("out-of-memory snapshots go to %s", hook.directory)


def _history_on(allocator: Allocator, torch: Any, max_entries: int, *, stacks: bool) -> None:
    if allocator is Allocator.GPUMEM:
        _native_history_on(max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled="all", context="all" if stacks else None,
                                                 stacks="python", max_entries=max_entries)


# -- recording --------------------------------------------------------------------------------------------
class Recording:
    """The context manager :func:`record` returns; ``result`` is set when the block has ended."""

    def __init__(self, out: "str | os.PathLike[str]", *, allocator: "Allocator | str" = Allocator.PYTORCH,
                 max_entries: int = DEFAULT_MAX_ENTRIES, stacks: bool = True,
                 oom_dir: "str | os.PathLike[str] | None" = None) -> None:
        check_max_entries(max_entries)
        if not str(out):
            raise InvalidArgumentError("out must name a folder")
        # absolute now: a program that changes its working folder still writes where it was asked to
        self.out = Path(out).absolute()
        self.allocator = _allocator(allocator)
        self.max_entries = max_entries
        self.stacks = bool(stacks)
        env_dir = os.environ.get(OOM_SNAPSHOT_ENV) or None
        oom = oom_dir if oom_dir is not None else env_dir
        self.oom_dir = Path(oom).absolute() if oom is not None else None
        self.result: RecordResult | None = None
        self._torch: Any = None
        self._previous_oom_dir: "Path | None" = None

    def start(self) -> "Recording":
        """Check PyTorch and CUDA, install gpumem.torch (``allocator="gpumem"``), turn the history on.

        Raises:
            BackendUnavailableError: no PyTorch, no CUDA device (or, for gpumem, no native engine).
            InvalidArgumentError: ``out`` is a file, cannot be created, or already holds a snapshot.
            gpumem.torch.TooLateError: ``allocator="gpumem"`` after PyTorch initialised CUDA.
        """
        if self._torch is not None:
            raise GpumemError("this recording has already started")
        torch = _torch()
        if self.out.exists() and not self.out.is_dir():
            raise InvalidArgumentError(f"out: {self.out} exists and is not a folder")
        snapshot = self.out / SNAPSHOT_NAME
        if snapshot.exists() or snapshot.is_symlink():
            raise InvalidArgumentError(f"out: {self.out} already holds a snapshot ({SNAPSHOT_NAME}); give a new "
                                       "folder or move it away")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgumentError(f"out: cannot create {self.out}: {exc.strerror or exc}") from None
        if self.allocator is Allocator.GPUMEM:
            gtorch.install()
        _history_on(self.allocator, torch, self.max_entries, stacks=self.stacks)
        if self.oom_dir is not None:
            hook = _oom_hook()
            _attach(hook, self.allocator, torch)
            self._previous_oom_dir = hook.directory  # given back at the end (a snapshot_on_oom of the program)
            hook.directory = self.oom_dir
        self._torch = torch
        log.info("recording %s's allocations (history of at most %d events) into %s", self.allocator.value,
                 self.max_entries, self.out)
        return self

    def stop(self) -> RecordResult:
        """Write the snapshot to ``out/snapshot.pickle``, turn the history off; returns :attr:`result`."""
        from .trace.pytorch_export import save_pytorch_snapshot

        torch = self._torch
        if torch is None:
            raise GpumemError("this recording has not started")
        if self.result is not None:
            return self.result
        dropped = 0
        if self.allocator is Allocator.GPUMEM:
            _native().gpumem_torch_record_history(0)
            events, dropped = _native_events()
            snap = snapshot_from_events(events, name=str(self.out.name or "recording"))
        else:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.oom_dir is not None:
            _oom_hook().directory = self._previous_oom_dir
        path = self.out / SNAPSHOT_NAME
        tmp = self.out / f".{SNAPSHOT_NAME}.tmp-{os.getpid()}"
        try:  # complete or not there: an interrupted write never leaves a truncated snapshot
            save_pytorch_snapshot(snap, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        n_events = sum(len(t) for t in snap.get("device_traces", ()))
        self.result = RecordResult(path, self.allocator, n_events, dropped)
        if dropped:
            log.warning("the history kept %d events and dropped %d past max_entries=%d", n_events, dropped,
                        self.max_entries)
        return self.result

    def __enter__(self) -> "Recording":
        return self.start()

    def __exit__(self, exc_type: "type[BaseException] | None", exc: "BaseException | None",
                 tb: "TracebackType | None") -> None:
        try:
            self.stop()
        except Exception as write_exc:  # noqa: BLE001
            if exc is None:
                raise
            # the block's own error is what the program must see; the failed snapshot is logged
            log.error("could not write the snapshot to %s: %s: %s", self.out, type(write_exc).__name__, write_exc)


def record(out: "str | os.PathLike[str]", *, allocator: "Allocator | str" = "pytorch",
           max_entries: int = DEFAULT_MAX_ENTRIES, stacks: bool = True,
           oom_dir: "str | os.PathLike[str] | None" = None) -> Recording:
    """Record the GPU memory of the ``with`` block into ``out/snapshot.pickle`` (a PyTorch snapshot that
    ``gpumem replay``, ``gpumem report`` and pytorch.org/memory_viz read)::

        with gpumem.record(out="run1") as rec:
            train()
        rec.result.snapshot_path

    Args:
        out: the folder (created; made absolute now); refused if it already holds a ``snapshot.pickle``.
        allocator: ``"pytorch"`` (PyTorch's caching allocator, with Python stacks) or ``"gpumem"``
            (installs :mod:`gpumem.torch` first: enter the block before PyTorch first uses the GPU).
        max_entries: allocation events kept at most.
        stacks: record Python stacks (PyTorch's allocator only).
        oom_dir: write :func:`snapshot_on_oom` files here while recording (default:
            ``$GPUMEM_OOM_SNAPSHOT_DIR`` if set, else none).

    The snapshot is written when the block ends, also by an exception (an error writing it is then logged,
    and the block's exception propagates).
    """
    return Recording(out, allocator=allocator, max_entries=max_entries, stacks=stacks, oom_dir=oom_dir)
