"""Who holds the memory: live bytes at one operation, grouped by allocation site.

A PyTorch snapshot records a stack for every ``alloc`` entry. The *site* of an allocation is its innermost
frame outside PyTorch itself (``torch/`` files and frames without a file), written ``function
(file:line)``: the model code that asked for the tensor. Allocations are matched to snapshot entries by
order: allocation ``k`` of a :class:`~gpumem.trace.Trace` is the ``k``-th ``alloc`` entry of its device, as
the reader builds it. Traces without stacks (RMM logs, gpumem traces, snapshots recorded without frames)
are grouped by requested size instead, and say so (:attr:`SiteTable.kind`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import GpumemError
from ..trace import Trace
from ..trace.model import OpKind
from ..units import format_bytes

log = logging.getLogger(__name__)

_INTERNAL = ("torch/", "torch\\", "<")


@dataclass(frozen=True)
class Site:
    """Live bytes at one allocation site."""

    site: str
    live_nbytes: int
    n_live: int


@dataclass(frozen=True)
class SiteTable:
    """Live bytes by site at operation :attr:`op`, largest first."""

    op: int
    kind: str
    """``"stack frame"`` (from the snapshot's stacks) or ``"requested size"`` (no stacks in the trace)."""
    sites: list[Site]
    total_live_nbytes: int


def frame_site(frames: object) -> str | None:
    """The innermost frame outside PyTorch, as ``function (file:line)``; None when there is none."""
    if not isinstance(frames, list) or not frames:
        return None
    fallback = None
    for f in frames:
        if not isinstance(f, dict):
            continue
        filename = str(f.get("filename", ""))
        text = f"{f.get('name', '?')} ({'/'.join(filename.split('/')[-2:]) if filename else '?'}:{f.get('line', '?')})"
        if fallback is None:
            fallback = text
        if filename and not any(m in filename for m in _INTERNAL):
            return text
    return fallback


def snapshot_sites(path: str | Path, trace: Trace, device: int | None = None) -> list[str | None] | None:
    """The site of each allocation of ``trace`` (read from the PyTorch snapshot ``path``), or None when the
    file is not a snapshot, has no stacks, or its ``alloc`` entries do not match the trace's allocations."""
    from ..trace.pytorch import load_snapshot_dict

    try:
        data = load_snapshot_dict(path)
    except (GpumemError, OSError) as exc:
        log.debug("no stacks from %s: %s", path, exc)
        return None
    traces = data.get("device_traces") or []
    entries = None
    if device is not None and 0 <= device < len(traces):
        entries = traces[device]
    else:
        non_empty = [t for t in traces if t]
        entries = non_empty[0] if len(non_empty) == 1 else None
    if not entries:
        return None
    allocs = [e for e in entries if isinstance(e, dict) and e.get("action") == "alloc"]
    if len(allocs) != trace.n_allocs:
        log.info("%s: %d alloc entries for %d allocations: sites not used", path, len(allocs), trace.n_allocs)
        return None
    sites = [frame_site(e.get("frames")) for e in allocs]
    if all(s is None for s in sites):
        return None
    return sites


def _size_label(nbytes: int) -> str:
    return f"requests of {format_bytes(nbytes)}"


def live_by_site(trace: Trace, op: int, sites: list[str | None] | None, top: int = 15) -> SiteTable:
    """Live bytes after operations ``0 .. op - 1``, grouped by site (or by requested size without sites),
    the ``top`` largest first and the rest as one ``(other sites)`` row."""
    kinds = trace.kinds[:op]
    ids = trace.alloc_ids[:op]
    nbytes = trace.nbytes[:op]
    alive = np.zeros(trace.n_allocs, dtype=bool)
    alloc_mask = kinds == OpKind.ALLOC
    alive[ids[alloc_mask]] = True
    alive[ids[~alloc_mask]] = False
    live_ids = np.nonzero(alive)[0]
    size_of = np.zeros(trace.n_allocs, dtype=np.int64)
    size_of[trace.alloc_ids[trace.kinds == OpKind.ALLOC]] = trace.nbytes[trace.kinds == OpKind.ALLOC]
    del nbytes
    groups: dict[str, list[int]] = {}
    kind = "stack frame" if sites is not None else "requested size"
    for k in live_ids.tolist():
        n = int(size_of[k])
        if n == 0:
            continue
        label = (sites[k] or "(no Python frame: C++ or autograd)") if sites is not None else _size_label(n)
        g = groups.setdefault(label, [0, 0])
        g[0] += n
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0]))
    rows = [Site(label, b, c) for label, (b, c) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        what = "sites" if sites is not None else "sizes"
        rows.append(Site(f"(other {len(rest)} {what})", sum(v[0] for _, v in rest), sum(v[1] for _, v in rest)))
    total = int(sum(v[0] for v in groups.values()))
    return SiteTable(op, kind, rows, total)
