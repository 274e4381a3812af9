"""Writing a trace as a PyTorch memory snapshot, for PyTorch's memory viewer.

:func:`to_pytorch_snapshot` builds the dict that ``torch.cuda.memory._dump_snapshot``
would have written, so https://pytorch.org/memory_viz (or
``python -m torch.cuda._memory_viz trace_plot file.pickle -o file.html``) can draw
a gpumem trace, and :func:`gpumem.trace.read_pytorch_snapshot` reads the ops back::

    {"segments": [...],                 # allocator state at the end, see below
     "device_traces": [[entry, ...]],   # one device (device 0)
     "allocator_settings": {...}}       # a few descriptive keys

Entries carry ``action, addr, size, stream, time_us, frames`` (``[]``, or the stacks given as ``frames=``). An ALLOC op becomes
``alloc``; a FREE op becomes ``free_requested`` immediately followed by
``free_completed``. ``size`` is the requested size. ``time_us`` is written as an int
when it is integral (as PyTorch does), as a float otherwise, so it reads back
exactly. Addresses are ``Trace.addrs`` (or invented ones when all are 0, see
:func:`gpumem.trace.builder.replay_addresses`).

Segments. The viewer's *Allocator State History* replays the events backwards
from the final ``segments`` and needs every block to lie inside a segment at
every step. What is written:

* ``segments_events=None`` and a trace from :meth:`CachingAllocator.history()
  <gpumem.allocator.CachingAllocator.history>`: the allocator's own segment events, which
  the trace carries in ``trace.segment_events`` (as below), so the viewer shows the memory
  gpumem really reserved: ``segment_alloc``/``segment_free`` per ``malloc``'d segment,
  ``segment_map``/``segment_unmap`` per page of virtual memory.
* ``segments_events=None`` and any other trace: every allocation gets its own segment exactly its
  size: a ``segment_alloc`` right before its ``alloc`` and, if it is freed, a
  ``segment_free`` right after its ``free_completed`` (the picture a non-caching,
  cudaMalloc-per-tensor allocator would give).
* ``segments_events=[(action, addr, nbytes, stream, time_us), ...]`` (for instance
  :attr:`TraceRecorder.segment_events`): these events, sorted by time and merged
  with the ops by time (at equal times ``segment_alloc``/``segment_map`` go
  before the ops, ``segment_free``/``segment_unmap`` after); op order is kept.
  ``segment_map``/``segment_unmap`` describe expandable segments and merge with /
  split from adjacent mapped ranges, as PyTorch's viewer does.

The final ``segments`` list holds the segments live after the last event, each
with its ``blocks`` tiling it in address order: one ``active_allocated`` block
per allocation live at the end (size = requested size), ``inactive`` blocks for
the gaps. A live allocation outside every segment is given a segment of its own.
Zero-byte allocations have zero-byte blocks, which the State History view cannot
locate; the Active Memory Timeline is unaffected.
"""

from __future__ import annotations

import bisect
import heapq
import pickle
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..units import MiB
from ._fileio import PathLike, open_for_writing
from .builder import replay_addresses
from .model import OpKind, Trace
from .recorder import SEGMENT_ACTIONS

__all__ = ["to_pytorch_snapshot", "save_pytorch_snapshot", "snapshot_frames"]


def snapshot_frames(path: PathLike, n_allocs: int | None = None, device: int | None = None) -> list[Any] | None:
    """The stack (``frames``) of each ``alloc`` entry of the PyTorch snapshot ``path``, in order (allocation
    id order for a trace read from it), to hand to :func:`to_pytorch_snapshot`; None when the file has no
    single device trace, no stacks, or (given ``n_allocs``) another number of allocations."""
    from .pytorch import load_snapshot_dict

    data = load_snapshot_dict(path)
    traces = data.get("device_traces") or []
    if device is not None:
        entries = traces[device] if 0 <= device < len(traces) else None
    else:
        non_empty = [t for t in traces if t]
        entries = non_empty[0] if len(non_empty) == 1 else None
    if not entries:
        return None
    frames = [e.get("frames") for e in entries if isinstance(e, dict) and e.get("action") == "alloc"]
    if n_allocs is not None and len(frames) != n_allocs:
        return None
    if not any(isinstance(f, list) and f for f in frames):
        return None
    return [f if isinstance(f, list) else [] for f in frames]

_SEGMENT_RANK = {"segment_alloc": 0, "segment_map": 0, "segment_free": 2, "segment_unmap": 2}


def _time_value(t: float) -> int | float:
    return int(t) if t == t and abs(t) < 2**53 and t.is_integer() else t


def _entry(action: str, addr: int, size: int, stream: int, time_us: int | float) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time_us, "frames": []}


class _Segments:
    """The set of live segments, replayed from segment events (PyTorch viewer semantics)."""

    def __init__(self) -> None:
        self.starts: list[int] = []  # sorted
        self.info: dict[int, list[Any]] = {}  # start -> [size, stream, expandable]

    def _insert(self, addr: int, size: int, stream: int, expandable: bool) -> None:
        if addr in self.info:
            raise InvalidArgumentError(f"segment at {addr:#x} created twice")
        bisect.insort(self.starts, addr)
        self.info[addr] = [size, stream, expandable]

    def _remove(self, addr: int) -> None:
        self.starts.remove(addr)
        del self.info[addr]

    def _containing(self, addr: int, end: int) -> int | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0:
            start = self.starts[i]
            if end <= start + self.info[start][0]:
                return start
        return None

    def apply(self, action: str, addr: int, size: int, stream: int) -> None:
        if action == "segment_alloc":
            self._insert(addr, size, stream, False)
        elif action == "segment_free":
            if addr not in self.info:
                raise InvalidArgumentError(f"segment_free at {addr:#x}, where no segment starts")
            self._remove(addr)
        elif action == "segment_map":
            self._insert(addr, size, stream, True)
            nxt = addr + size
            if nxt in self.info and self.info[nxt][1] == stream and self.info[nxt][2]:
                self.info[addr][0] += self.info[nxt][0]
                self._remove(nxt)
            i = self.starts.index(addr)
            if i > 0:
                prev = self.starts[i - 1]
                p = self.info[prev]
                if prev + p[0] == addr and p[1] == stream and p[2]:
                    p[0] += self.info[addr][0]
                    self._remove(addr)
        elif action == "segment_unmap":
            start = self._containing(addr, addr + size)
            if start is None:
                raise InvalidArgumentError(f"segment_unmap of [{addr:#x}, +{size}) outside every mapped range")
            seg_size, seg_stream, _ = self.info[start]
            end = start + seg_size
            self._remove(start)
            if addr > start:
                self._insert(start, addr - start, seg_stream, True)
            if addr + size < end:
                self._insert(addr + size, end - addr - size, seg_stream, True)
        else:
            raise InvalidArgumentError(f"unknown segment action {action!r}; expected one of {SEGMENT_ACTIONS}")


def _final_segments(segs: _Segments, live: list[tuple[int, int, int]], device: int) -> list[dict[str, Any]]:
    """Segment dicts with blocks, for the live allocations ``(addr, nbytes, stream)``."""
    members: dict[int, list[tuple[int, int]]] = {start: [] for start in segs.starts}
    for addr, nbytes, stream in sorted(live):
        start = segs._containing(addr, addr + nbytes)
        if start is None:  # an allocation outside every segment: give it its own
            segs._insert(addr, nbytes, stream, False)
            members[addr] = []
            start = addr
        members[start].append((addr, nbytes))
    out = []
    for start in segs.starts:
        size, stream, expandable = segs.info[start]
        blocks: list[dict[str, Any]] = []
        cursor = start
        allocated = 0
        for addr, nbytes in members[start]:
            if addr < cursor:
                raise InvalidArgumentError(f"live allocations overlap at {addr:#x}")
            if addr > cursor:
                blocks.append(_block(cursor, addr - cursor, 0, "inactive"))
            blocks.append(_block(addr, nbytes, nbytes, "active_allocated"))
            allocated += nbytes
            cursor = addr + nbytes
        if cursor < start + size:
            blocks.append(_block(cursor, start + size - cursor, 0, "inactive"))
        out.append({
            "device": device,
            "address": start,
            "total_size": size,
            "allocated_size": allocated,
            "active_size": allocated,
            "requested_size": allocated,
            "stream": stream,
            "segment_type": "small" if size <= MiB else "large",
            "segment_pool_id": (0, 0),
            "is_expandable": expandable,
            "frames": [],
            "blocks": blocks,
        })
    return out


def _block(addr: int, size: int, requested: int, state: str) -> dict[str, Any]:
    return {"address": addr, "size": size, "requested_size": requested, "state": state, "frames": []}


def _op_entries(trace: Trace, addrs: np.ndarray, per_alloc_segments: bool,
                frames: Sequence[Any] | None = None) -> list[tuple[float, int, dict[str, Any]]]:
    """``(time_us, rank 1, entry)`` for each op entry, in op order."""
    out: list[tuple[float, int, dict[str, Any]]] = []
    push = out.append
    for kind, n, s, t, a, k in zip(trace.kinds.tolist(), trace.nbytes.tolist(), trace.streams.tolist(),
                                   trace.times_us.tolist(), addrs.tolist(), trace.alloc_ids.tolist()):
        tv = _time_value(t)
        if kind == OpKind.ALLOC:
            if per_alloc_segments:
                push((t, 1, _entry("segment_alloc", a, n, s, tv)))
            e = _entry("alloc", a, n, s, tv)
            if frames is not None and k < len(frames) and isinstance(frames[k], list):
                e["frames"] = frames[k]
            push((t, 1, e))
        else:
            push((t, 1, _entry("free_requested", a, n, s, tv)))
            push((t, 1, _entry("free_completed", a, n, s, tv)))
            if per_alloc_segments:
                push((t, 1, _entry("segment_free", a, n, s, tv)))
    return out


def to_pytorch_snapshot(
    trace: Trace,
    *,
    segments_events: Iterable[Sequence[Any]] | None = None,
    device: int = 0,
    frames: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """The PyTorch memory-snapshot dict of ``trace`` (see the module docstring for what it holds).

    ``segments_events`` is an iterable of ``(action, addr, nbytes, stream,
    time_us)`` with ``action`` in ``segment_alloc/segment_free/segment_map/segment_unmap``;
    by default the trace's own ``segment_events`` if it has them (an allocator's history).
    ``device`` is the index written into the segments; ``device_traces`` gets
    ``device + 1`` lists with the trace in the last. ``frames``: the stack of each allocation (a list of
    PyTorch frame dicts, indexed by allocation id; :func:`snapshot_frames` reads them from the snapshot the
    trace came from), written on its ``alloc`` entry so that the viewer and ``gpumem report`` can tell who
    allocated it (by default ``frames=[]``: gpumem's trace model keeps no stacks).
    """
    if frames is not None and not isinstance(frames, Sequence):
        raise InvalidArgumentError(f"frames must be a sequence (one stack per allocation), got {type(frames).__name__}")
    addrs = replay_addresses(trace)
    if segments_events is None:
        segments_events = getattr(trace, "segment_events", None)  # a trace from CachingAllocator.history()
    per_alloc = segments_events is None
    op_entries = _op_entries(trace, addrs, per_alloc, frames)
    seg_entries: list[tuple[float, int, dict[str, Any]]] = []
    if not per_alloc:
        for ev in segments_events or ():
            action, addr, nbytes, stream, time_us = ev
            if action not in _SEGMENT_RANK:
                raise InvalidArgumentError(f"unknown segment action {action!r}; expected one of {SEGMENT_ACTIONS}")
            seg_entries.append((float(time_us), _SEGMENT_RANK[action],
                                _entry(action, int(addr), int(nbytes), int(stream), _time_value(float(time_us)))))
        seg_entries.sort(key=lambda x: (x[0], x[1]))
    merged = heapq.merge(seg_entries, op_entries, key=lambda x: (x[0], x[1])) if seg_entries else op_entries
    entries = [e for _, _, e in merged]

    segs = _Segments()
    for e in entries:
        if e["action"].startswith("segment_"):
            segs.apply(e["action"], e["addr"], e["size"], e["stream"])
    is_alloc = trace.kinds == OpKind.ALLOC
    freed = np.zeros(trace.n_allocs, dtype=bool)
    freed[trace.alloc_ids[~is_alloc]] = True
    live_idx = np.flatnonzero(is_alloc)[~freed]
    live = list(zip(addrs[live_idx].tolist(), trace.nbytes[live_idx].tolist(), trace.streams[live_idx].tolist()))
    return {
        "segments": _final_segments(segs, live, device),
        "device_traces": [[] for _ in range(device)] + [entries],
        "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": "",
            "expandable_segments": any(e["action"] == "segment_map" for e in entries),
            "generated_by": "gpumem.trace",
            "trace_name": trace.name,
            "trace_source": trace.source,
        },
    }


def save_pytorch_snapshot(
    trace_or_snapshot: Trace | dict[str, Any],
    path: PathLike,
    *,
    segments_events: Iterable[Sequence[Any]] | None = None,
    frames: Sequence[Any] | None = None,
) -> Path:
    """Pickle a trace (converted by :func:`to_pytorch_snapshot`) or a ready snapshot dict to ``path``.

    Gzip-compressed when ``path`` ends in ``.gz``; PyTorch's web viewer wants the
    plain ``.pickle``. Returns the path written.
    """
    data = (
        to_pytorch_snapshot(trace_or_snapshot, segments_events=segments_events, frames=frames)
        if isinstance(trace_or_snapshot, Trace)
        else trace_or_snapshot
    )
    p = Path(path)
    with open_for_writing(p, text=False) as f:
        pickle.dump(data, f, protocol=4)
    return p
