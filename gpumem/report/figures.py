"""The report's figures, drawn with matplotlib (Agg) into PNG files.

Every figure has axes labelled with units (GiB, seconds), a legend and a title naming the trace and the
device; colours are fixed per policy so that one policy looks the same in every figure.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import BackendUnavailableError
from ..units import GiB, MiB

if TYPE_CHECKING:  # pragma: no cover
    from .runs import FitCell, Occupancy, PolicyRun
    from .sites import SiteTable

DPI = 100
_POLICY_COLOURS = {
    "gpumem": "#1f77b4",
    "bestfit": "#7f7f7f",
    "pytorch": "#ff7f0e",
    "cupy": "#2ca02c",
    "expandable": "#9467bd",
}
_EXTRA_COLOURS = ("#8c564b", "#e377c2", "#bcbd22", "#17becf", "#d62728")
LIVE_COLOUR = "#1f4e9c"
FREE_COLOUR = "#f28e2b"
UNMAPPED_COLOUR = "#dcdcdc"


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BackendUnavailableError("gpumem report draws its figures with matplotlib, which is not installed: "
                                      "pip install 'gpumem[report]'") from exc
    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "figure.titlesize": 12,
                         "svg.hashsalt": "gpumem", "path.simplify": True})
    return plt


def check_matplotlib() -> None:
    """Raise :class:`~gpumem.errors.BackendUnavailableError` now if matplotlib is missing."""
    _plt()


def policy_colour(policy: str, order: Sequence[str]) -> str:
    """The colour of ``policy`` (fixed for the named policies)."""
    if policy in _POLICY_COLOURS:
        return _POLICY_COLOURS[policy]
    others = [p for p in order if p not in _POLICY_COLOURS]
    return _EXTRA_COLOURS[others.index(policy) % len(_EXTRA_COLOURS)] if policy in others else "#000000"


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)


def timeline_figure(path: Path, runs: list["PolicyRun"], xs: dict[str, np.ndarray], x_label: str,
                    title: str) -> np.ndarray:
    """(1) Live and reserved bytes over time per policy; out-of-memory errors and pressure marked. Returns the
    x values of the live line (those of the run that went furthest)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 5.2), layout="constrained")
    order = [r.policy for r in runs]
    any_tenant = any(any(r.timeline.tenant_nbytes) for r in runs if r.result is not None)
    oom_labelled = False
    live_x = np.zeros(0)
    src = furthest_run(runs)
    if src is not None:
        # live (and the tenants) from the run that went furthest: runs stopped by an out-of-memory error
        # end early, and the program's live bytes do not depend on the policy
        live_x = np.asarray(xs[src.policy])
        ax.plot(live_x, np.asarray(src.timeline.live_nbytes) / GiB, color="black", lw=1.2,
                label="live: the program's tensors (most in each interval)")
        if any_tenant:
            ax.plot(live_x, np.asarray(src.timeline.tenant_nbytes) / GiB, color="#555555", lw=0.9, ls=":",
                    label="other tenants (pressure scenario), sampled")
    for r in runs:
        if r.result is None:
            continue
        x = xs[r.policy]
        tl = r.timeline
        c = policy_colour(r.policy, order)
        ax.plot(x, np.asarray(tl.reserved_nbytes) / GiB, color=c, lw=1.4,
                label=f"reserved: {r.policy} (peak {r.result.peak_reserved_bytes / GiB:.2f} GiB)")
        if r.ooms:
            ox = [_x_at(x, tl.op, o.op) for o in r.ooms]
            oy = [o.reserved_nbytes / GiB for o in r.ooms]
            ax.scatter(ox, oy, marker="X", s=70, color="#d62728", edgecolor="black", zorder=5,
                       label=None if oom_labelled else "out of memory")
            oom_labelled = True
        if r.pressure:
            px = [_x_at(x, tl.op, e.op) for e in r.pressure if e.kind != "tenant_denied"]
            if px:
                ax.plot(px, [0] * len(px), "|", color=c, ms=10, alpha=0.6, transform=ax.get_xaxis_transform())
    if any(r.pressure for r in runs):
        ax.plot([], [], "|", color="#555555", ms=10, label="pressure event (a tenant took or gave memory)")
    ax.set_xlabel(x_label)
    ax.set_ylabel("memory (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    fig.legend(loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    _save(fig, path)
    return live_x


_LINE_STYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 1)))
_MARKERS = ("o", "s", "^", "D", "v", "x", "+")


def furthest_run(runs: list["PolicyRun"]) -> "PolicyRun | None":
    """The replayed run whose timeline reaches the furthest operation (the first of equals)."""
    done = [r for r in runs if r.result is not None and len(r.timeline.op)]
    return max(done, key=lambda r: r.timeline.op[-1]) if done else None


def _x_at(x: np.ndarray, ops: list[int], op: int) -> float:
    i = int(np.searchsorted(np.asarray(ops), op))
    return float(x[min(i, len(x) - 1)])


def occupancy_raster(occ: "Occupancy", cols: int = 400, max_rows: int = 60) -> tuple[np.ndarray, int, list[int]]:
    """An RGB image of the segments laid end to end, ``cols`` cells a row: each cell blends live, free (held)
    and unmapped colours by their share of its bytes. Returns the image, the bytes per cell and the cell
    where each segment starts."""
    total = sum(s.extent_nbytes for s in occ.segments)
    if total == 0:
        return np.ones((1, cols, 3)), 1, []
    cell = max(1, -(-total // (cols * max_rows)))
    # round the cell to a readable size: a power of two of KiB or more
    cell = 1 << max(10, math.ceil(math.log2(cell)))
    rows = max(1, -(-total // (cell * cols)))
    live_s, live_e, map_s, map_e, starts = [], [], [], [], []
    off = 0
    for s in occ.segments:
        starts.append(off // cell)
        for a, b in s.live:
            live_s.append(off + a)
            live_e.append(off + b)
        for a, b in s.mapped:
            map_s.append(off + a)
            map_e.append(off + b)
        off += s.extent_nbytes
    edges = np.arange(rows * cols + 1, dtype=np.float64) * cell
    live = np.diff(_cumulative(np.array(live_s, float), np.array(live_e, float), edges))
    mapped = np.diff(_cumulative(np.array(map_s, float), np.array(map_e, float), edges))
    inside = np.diff(np.minimum(edges, total))
    free = np.clip(mapped - live, 0, None)
    unmapped = np.clip(inside - mapped, 0, None)
    outside = cell - inside
    rgb = np.zeros((rows * cols, 3))
    for share, colour in ((live, LIVE_COLOUR), (free, FREE_COLOUR), (unmapped, UNMAPPED_COLOUR),
                          (outside, "#ffffff")):
        rgb += (share / cell)[:, None] * np.array(_rgb(colour))[None, :]
    return np.clip(rgb.reshape(rows, cols, 3), 0, 1), cell, starts


def _rgb(colour: str) -> tuple[float, float, float]:
    c = colour.lstrip("#")
    return tuple(int(c[i:i + 2], 16) / 255 for i in (0, 2, 4))  # type: ignore[return-value]


def _cumulative(starts: np.ndarray, ends: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Bytes of the sorted, disjoint intervals ``[starts, ends)`` below each ``x``."""
    if len(starts) == 0:
        return np.zeros_like(x)
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    lengths = ends - starts
    before = np.concatenate(([0.0], np.cumsum(lengths)))
    idx = np.searchsorted(starts, x, side="right") - 1
    safe = np.clip(idx, 0, len(starts) - 1)
    within = np.clip(x - starts[safe], 0, lengths[safe])
    return np.where(idx >= 0, before[safe] + within, 0.0)


def occupancy_figure(path: Path, occupancies: list[tuple[str, "Occupancy"]], title: str) -> None:
    """(2) The occupancy map at the peak: one panel per policy, segments laid end to end, row by row."""
    plt = _plt()
    from matplotlib.patches import Patch

    from matplotlib.lines import Line2D

    panels = [(p, o) for p, o in occupancies if o is not None]
    boundaries = False
    n = max(1, len(panels))
    fig, axes = plt.subplots(n, 1, figsize=(10, 1.0 + 1.9 * n), layout="constrained", squeeze=False)
    for ax, (policy, occ) in zip(axes[:, 0], panels):
        img, cell, starts = occupancy_raster(occ)
        rows, cols = img.shape[:2]
        ax.imshow(img, aspect="auto", interpolation="nearest", extent=(0, cols * cell / MiB, rows, 0))
        if len(starts) <= 80:
            boundaries = boundaries or len(starts) > 1
            for s in starts[1:]:
                r, c = divmod(s, cols)
                ax.plot([c * cell / MiB] * 2, [r, r + 1], color="black", lw=0.8)
        seg_kind = "virtual ranges" if occ.segments and occ.segments[0].virtual else "segments"
        live = sum(s.live_nbytes for s in occ.segments)
        held = sum(s.mapped_nbytes for s in occ.segments)
        ax.set_title(f"{policy}: {len(occ.segments)} {seg_kind}, {live / GiB:.2f} GiB live in "
                     f"{held / GiB:.2f} GiB held; each row {_size(cell * cols)}, each cell {_size(cell)}",
                     fontsize=9, loc="left")
        ax.set_ylabel("row")
        ax.set_xlabel("offset within the row (MiB)")
        ax.yaxis.get_major_locator().set_params(integer=True)
    if not panels:
        axes[0, 0].text(0.5, 0.5, "no policy ran on this device", ha="center", va="center")
        axes[0, 0].set_axis_off()
    handles = [Patch(color=LIVE_COLOUR, label="live blocks"), Patch(color=FREE_COLOUR, label="free holes (held)"),
               Patch(color=UNMAPPED_COLOUR, label="unmapped address space")]
    if boundaries:
        handles.append(Line2D([], [], color="black", lw=0.8, label="segment boundary"))
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle(title)
    _save(fig, path)


def _size(nbytes: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (1024, "KiB")):
        if nbytes >= unit:
            v = nbytes / unit
            return f"{v:.0f} {name}" if v == int(v) else f"{v:.1f} {name}"
    return f"{nbytes} B"


def fragmentation_figure(path: Path, runs: list["PolicyRun"], holes: dict[str, list[int]],
                         xs: dict[str, np.ndarray], x_label: str, title: str) -> None:
    """(3) Free-hole sizes at the peak (bytes in holes of each size) and external fragmentation over time."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    order = [r.policy for r in runs]
    all_holes = [h for hs in holes.values() for h in hs]
    if all_holes:
        lo = max(512, min(all_holes))
        hi = max(all_holes) * 1.01
        bins = np.logspace(math.log10(lo) - 0.01, math.log10(max(hi, lo * 2)), 30)
    else:
        bins = np.logspace(3, 10, 30)
    for policy, hs in holes.items():
        if not hs:
            continue
        c = policy_colour(policy, order)
        left.hist(np.asarray(hs, float), bins=bins, weights=np.asarray(hs, float) / GiB, histtype="step", lw=1.6,
                  color=c, label=f"{policy}: {len(hs)} holes, {sum(hs) / GiB:.2f} GiB")
    left.set_xscale("log")
    left.set_xlabel("free hole size (bytes, log scale)")
    left.set_ylabel("memory in holes of that size (GiB)")
    left.set_title("free holes at the peak of live data", fontsize=10)
    left.grid(alpha=0.3)
    if any(holes.values()):
        left.legend(fontsize=8)
    else:
        left.text(0.5, 0.5, "no free holes", transform=left.transAxes, ha="center")
    for k, r in enumerate(runs):
        if r.result is None:
            continue
        x = np.asarray(xs[r.policy])
        step = max(1, len(x) // 8)  # markers staggered between policies, so that none hides another's
        # distinct styles and sparse markers: policies often sit on the same line (e.g. all near 97 %)
        right.plot(x, np.asarray(r.timeline.external_fragmentation) * 100, lw=1.3,
                   ls=_LINE_STYLES[k % len(_LINE_STYLES)], marker=_MARKERS[k % len(_MARKERS)],
                   markevery=(k * step // max(1, len(runs)), step), ms=5, mfc="none",
                   color=policy_colour(r.policy, order), label=r.policy)
    right.set_xlabel(x_label)
    right.set_ylabel("external fragmentation (%)")
    right.set_ylim(-2, 102)
    right.set_title("1 - largest free block / all free bytes", fontsize=10)
    right.grid(alpha=0.3)
    # outside the panel, so it hides no data
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(title)
    _save(fig, path)


def sites_figure(path: Path, table: "SiteTable", title: str) -> None:
    """(4) Who holds the memory at the peak: live bytes by allocation site, largest first."""
    plt = _plt()
    rows = table.sites[::-1]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.32 * max(1, len(rows))), layout="constrained")
    labels = [_shorten(s.site, 70) for s in rows]
    values = [s.live_nbytes / GiB for s in rows]
    bars = ax.barh(range(len(rows)), values, color=LIVE_COLOUR, label=f"live bytes by {table.kind}")
    for bar, s in zip(bars, rows):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {s.live_nbytes / table.total_live_nbytes:.1%} ({s.n_live:,} tensor{'' if s.n_live == 1 else 's'})" if table.total_live_nbytes
                else "", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_xlabel("live memory at the peak (GiB)")
    ax.set_xlim(0, max(values + [1e-3]) * 1.25)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title)
    _save(fig, path)


def _shorten(text: str, n: int) -> str:
    return text if len(text) <= n else "..." + text[-(n - 3):]


def fit_figure(path: Path, cells: list["FitCell"], devices: list[str], policies: list[str], title: str) -> None:
    """(5) The fit matrix: per device and policy, whether the trace runs and the smallest limit it runs under."""
    plt = _plt()
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(1.8 + 1.9 * len(policies), 1.3 + 0.55 * len(devices)), layout="constrained")
    colours = {"runs": "#b7e1a1", "out of memory": "#f4a6a6", "unsupported": "#e0e0e0"}
    by = {(c.device, c.policy): c for c in cells}
    for i, d in enumerate(devices):
        for j, p in enumerate(policies):
            c = by.get((d, p))
            if c is None:
                continue
            ax.add_patch(plt.Rectangle((j, i), 1, 1, facecolor=colours[c.status], edgecolor="white", lw=2))
            text = c.status if c.status != "runs" else "runs"
            if c.smallest_limit_nbytes is not None:
                text += f"\nneeds {c.smallest_limit_nbytes / GiB:.2f} GiB"
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(policies))
    ax.set_ylim(len(devices), 0)
    ax.set_xticks([j + 0.5 for j in range(len(policies))], policies)
    by_limit = {c.device for c in cells if getattr(c, "decided_by", "replay") == "limit"}
    ax.set_yticks([i + 0.5 for i in range(len(devices))], [d + (" *" if d in by_limit else "") for d in devices],
                  fontsize=8)
    if by_limit:
        ax.set_ylabel("device (* no replay of its own: \"needs\"\ncompared with its free memory)", fontsize=8)
    else:
        ax.set_ylabel("device", fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlabel("allocator policy (\"needs\": the smallest memory limit it runs under, in GiB)")
    fig.legend(handles=[Patch(color=v, label=k) for k, v in colours.items()], loc="outside lower center", ncol=3,
               fontsize=8)
    ax.set_title(title)
    _save(fig, path)
