"""The PyTorch-snapshot export: what PyTorch's memory viewer needs, and reading it back.

:func:`check_viewer_consistency` re-implements, independently of the exporter, what
``torch/utils/viz/MemoryViz.js`` relies on: the segment and block fields it reads,
blocks tiling their segment (the viewer recomputes block addresses from the sizes),
and -- for the *Allocator State History* view, which replays events -- every
allocation lying inside a mapped segment when it happens, no segment released
while it holds a live block, and the final ``segments`` matching the replayed state.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given

from gpumem.errors import InvalidArgumentError
from gpumem.trace import (
    OpKind,
    Trace,
    TraceRecorder,
    load_trace,
    read_pytorch_snapshot,
    save_pytorch_snapshot,
    snapshot_to_trace,
    to_pytorch_snapshot,
)
from gpumem.units import KiB, MiB

from trace_strategies import PROPERTY, traces

SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_type", "is_expandable", "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
ENTRY_KEYS = {"action", "addr", "size", "stream", "time_us", "frames"}


def check_viewer_consistency(snapshot: dict[str, Any], device: int = 0) -> None:
    for seg in snapshot["segments"]:
        assert SEGMENT_KEYS <= seg.keys()
        addr = seg["address"]
        for b in seg["blocks"]:
            assert BLOCK_KEYS <= b.keys() and b["address"] == addr
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"], "blocks must tile their segment"
    segments: list[list[int]] = []  # [start, size, stream, expandable]
    live: dict[int, int] = {}

    def containing(a: int, end: int) -> list[int] | None:
        return next((s for s in segments if s[0] <= a and end <= s[0] + s[1]), None)

    for i, e in enumerate(snapshot["device_traces"][device]):
        assert ENTRY_KEYS <= e.keys(), e
        act, a, n = e["action"], e["addr"], e["size"]
        if act == "alloc":
            assert a not in live and containing(a, a + n) is not None, f"entry {i}: alloc outside segments"
            live[a] = n
        elif act == "free_requested":
            assert live.get(a) == n
        elif act == "free_completed":
            del live[a]
        elif act == "segment_alloc":
            segments.append([a, n, e["stream"], 0])
        elif act == "segment_map":
            segments.append([a, n, e["stream"], 1])
            segments.sort()
            merged: list[list[int]] = []
            for s in segments:
                if merged and merged[-1][3] and s[3] and merged[-1][0] + merged[-1][1] == s[0] \
                        and merged[-1][2] == s[2]:
                    merged[-1][1] += s[1]
                else:
                    merged.append(s)
            segments[:] = merged
        elif act in ("segment_free", "segment_unmap"):
            s = containing(a, a + n)
            assert s is not None and (act == "segment_unmap" or s[0] == a and s[1] == n)
            assert not any(a <= b < a + n for b in live), f"entry {i}: segment released under a live block"
            segments.remove(s)
            if s[0] < a:
                segments.append([s[0], a - s[0], s[2], s[3]])
            if a + n < s[0] + s[1]:
                segments.append([a + n, s[0] + s[1] - a - n, s[2], s[3]])
    final = sorted((s["address"], s["total_size"]) for s in snapshot["segments"])
    assert final == sorted((s[0], s[1]) for s in segments)
    blocks = {b["address"]: b["size"] for s in snapshot["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated"}
    assert blocks == live


@PROPERTY
@given(trace=traces())
def test_export_is_viewer_consistent(trace: Trace) -> None:
    snap = to_pytorch_snapshot(trace)
    check_viewer_consistency(snap)
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions.count("alloc") == trace.n_allocs and actions.count("free_requested") == trace.n_frees


def test_entries_mirror_the_ops() -> None:
    t = Trace.from_ops("t", "gpumem", [(OpKind.ALLOC, 0, 100, 3, 5.0, 0x1000),
                                       (OpKind.FREE, 0, 100, 3, 6.5, 0x1000)])
    entries = to_pytorch_snapshot(t, segments_events=[])["device_traces"][0]
    assert entries == [
        {"action": "alloc", "addr": 0x1000, "size": 100, "stream": 3, "time_us": 5, "frames": []},
        {"action": "free_requested", "addr": 0x1000, "size": 100, "stream": 3, "time_us": 6.5, "frames": []},
        {"action": "free_completed", "addr": 0x1000, "size": 100, "stream": 3, "time_us": 6.5, "frames": []},
    ]
    assert type(entries[0]["time_us"]) is int


def recorded_run() -> TraceRecorder:
    """A caching-allocator-like run: two 2 MiB segments, an expandable range mapped in two steps."""
    rec = TraceRecorder()
    base, base2, exp = 0x7F00_0000_0000, 0x7F00_1000_0000, 0x7F10_0000_0000
    rec.record_segment("segment_alloc", base, 2 * MiB, 0, time_us=0)
    rec.record_alloc(base, 512 * KiB, 0, time_us=1)
    rec.record_alloc(base + 512 * KiB, 100, 0, time_us=2)
    rec.record_segment("segment_alloc", base2, 2 * MiB, 0, time_us=3)
    rec.record_alloc(base2, 2 * MiB, 0, time_us=3)  # same time as its segment: the segment goes first
    rec.record_free(base2, 0, time_us=4)
    rec.record_segment("segment_free", base2, 2 * MiB, 0, time_us=4)  # same time as the free: goes after
    rec.record_segment("segment_map", exp, 2 * MiB, 0, time_us=5)
    rec.record_segment("segment_map", exp + 2 * MiB, 2 * MiB, 0, time_us=6)
    rec.record_alloc(exp + MiB, 2 * MiB, 0, time_us=7)  # spans both mapped steps
    rec.record_alloc(exp + 3 * MiB, 512 * KiB, 0, time_us=7.5)
    rec.record_free(exp + 3 * MiB, 0, time_us=8)
    rec.record_segment("segment_unmap", exp + 3 * MiB, MiB, 0, time_us=9)
    rec.record_free(base, 0, time_us=10)
    return rec


def test_export_with_recorded_segment_events() -> None:
    rec = recorded_run()
    trace = rec.to_trace("run")
    snap = to_pytorch_snapshot(trace, segments_events=rec.segment_events)
    check_viewer_consistency(snap)
    segs = {s["address"]: s for s in snap["segments"]}
    exp = 0x7F10_0000_0000
    assert sorted(segs) == [0x7F00_0000_0000, exp]
    assert segs[exp]["total_size"] == 3 * MiB and segs[exp]["is_expandable"]
    assert [(b["state"], b["size"]) for b in segs[exp]["blocks"]] == [("inactive", MiB),
                                                                      ("active_allocated", 2 * MiB)]
    assert [(b["state"], b["size"]) for b in segs[0x7F00_0000_0000]["blocks"]] == [
        ("inactive", 512 * KiB), ("active_allocated", 100), ("inactive", 2 * MiB - 512 * KiB - 100)]
    assert snap["allocator_settings"]["expandable_segments"] is True
    assert snapshot_to_trace(snap, name="run").ops_equal(trace)


def test_live_allocation_outside_segments_gets_its_own() -> None:
    t = Trace.from_ops("t", "gpumem", [(OpKind.ALLOC, 0, 100, 0, 0.0, 0x5000)])
    snap = to_pytorch_snapshot(t, segments_events=[])
    assert [(s["address"], s["total_size"]) for s in snap["segments"]] == [(0x5000, 100)]


@pytest.mark.parametrize("events, message", [
    ([("segment_grow", 0, 1, 0, 0.0)], "unknown segment action"),
    ([("segment_free", 0x10, 1, 0, 0.0)], "no segment starts"),
    ([("segment_unmap", 0x10, 1, 0, 0.0)], "outside every mapped range"),
])
def test_bad_segment_events_are_rejected(events: list[tuple[Any, ...]], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        to_pytorch_snapshot(Trace.empty(), segments_events=events)


def test_save_accepts_a_dict_and_gzip(tmp_path: Path) -> None:
    rec = recorded_run()
    snap = to_pytorch_snapshot(rec.to_trace(), segments_events=rec.segment_events)
    plain = save_pytorch_snapshot(snap, tmp_path / "run.pickle")
    packed = save_pytorch_snapshot(rec.to_trace(), tmp_path / "run.pickle.gz", segments_events=rec.segment_events)
    assert pickle.loads(plain.read_bytes()) == snap
    assert pickle.loads(gzip.decompress(packed.read_bytes())) == snap
    assert read_pytorch_snapshot(plain).ops_equal(rec.to_trace())


def test_fixture_export_matches_fixture_ops(data_dir: Path) -> None:
    exported = read_pytorch_snapshot(data_dir / "resnet_head.snapshot_export.pickle.gz")
    assert exported.ops_equal(load_trace(data_dir / "resnet_head.gmt.gz"))
    check_viewer_consistency(to_pytorch_snapshot(exported))


@pytest.mark.parametrize("policy", ["gpumem", "pytorch", "cupy"])
def test_allocator_history_export_shows_the_reserved_memory_at_every_step(policy: str) -> None:
    """Issue 6: --export-snapshot wrote one segment per allocation (17,126 segment_alloc events for
    the pytorch policy, which made 144 device calls) and nothing for virtual memory. The export of
    an allocator's history now carries its real segment (malloc) and map/unmap (virtual) events:
    the reserved bytes they imply equal the allocator's reserved_nbytes after every op."""
    from gpumem import sim
    from gpumem.allocator import CachingAllocator

    trace = _shipped_trace("resnet_train.snapshot.pickle.gz").head(4000)
    dev = sim.SimDevice(sim.get_profile("h200-141gb"))
    alloc = CachingAllocator(dev, policy, record_history=True)
    reserved_after: list[int] = []
    ptrs: dict[int, int] = {}
    for op in trace:
        if op.kind == OpKind.ALLOC:
            ptrs[op.alloc_id] = alloc.allocate(op.nbytes, op.stream)
        else:
            alloc.free(ptrs.pop(op.alloc_id))
        reserved_after.append(alloc.reserved_nbytes)
    history = alloc.history()
    snap = to_pytorch_snapshot(history)
    entries = snap["device_traces"][0]
    n_segment_events = sum(e["action"].startswith("segment_") for e in entries)
    assert n_segment_events == len(history.segment_events) <= alloc.snapshot_stats().device_calls
    implied = 0
    step = 0
    for e in entries:
        action = e["action"]
        if action in ("segment_alloc", "segment_map"):
            implied += e["size"]
        elif action in ("segment_free", "segment_unmap"):
            implied -= e["size"]
        elif action in ("alloc", "free_completed"):
            assert implied == reserved_after[step], f"op {step} ({action}): export {implied}, allocator " \
                                                    f"{reserved_after[step]}"
            step += 1
    assert step == trace.n_ops
    kinds = {e["action"] for e in entries if e["action"].startswith("segment_")}
    assert kinds <= ({"segment_map", "segment_unmap"} if alloc.uses_vmm else {"segment_alloc", "segment_free"})
    assert snap["allocator_settings"]["expandable_segments"] is alloc.uses_vmm
    check_viewer_consistency(snap)
    alloc.close()
    dev.close()


def _shipped_trace(name: str) -> Trace:
    from gpumem.trace import load_trace

    path = Path(__file__).resolve().parents[2] / "data" / "traces" / name
    if not path.exists():
        pytest.skip("data/traces is missing")
    return load_trace(path)


@pytest.mark.parametrize("policy", ["gpumem", "bestfit", "pytorch", "cupy"])
@pytest.mark.parametrize("seed", range(6))
def test_allocator_history_export_matches_reserved_under_faults(policy: str, seed: int) -> None:
    """Review finding F4: under injected faults (a failed mem_release in empty_cache...) chunks held
    but mapped nowhere vanished from the export, and close() recorded nothing. The reserved bytes
    the export implies equal the allocator's after every operation and after close, and the snapshot
    is viewer-consistent (Note [Exporting cached chunks] in gpumem.allocator.backing)."""
    import random

    from gpumem import sim
    from gpumem.allocator import CachingAllocator
    from gpumem.errors import CudaError, OutOfMemoryError, TransientDeviceError
    from gpumem.units import MiB

    sign = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    rng = random.Random(seed)
    rates = {c: 0.05 for c in sim.faults.CALL_NAMES if rng.random() < 0.5}
    base = "a100-80gb" if policy == "gpumem" else "jetson-nano-2gb"
    profile = sim.custom_profile(f"export-{policy}", 128 * MiB, base=base, context_nbytes=32 * MiB,
                                 host_reserved_nbytes=0) if policy != "gpumem" else \
        sim.custom_profile("export-vmm", 128 * MiB, context_nbytes=32 * MiB)
    dev = sim.SimDevice(profile, seed=seed, faults=sim.FaultPlan(call_failure_rates=rates))
    alloc = CachingAllocator(dev, policy, record_history=True, gc_threshold=rng.choice([None, 0.5]))

    def implied() -> int:
        return sum(sign[e[0]] * e[2] for e in alloc.history().segment_events)

    live: list[int] = []
    for step in range(200):
        k = rng.random()
        try:
            if k < 0.5 or not live:
                live.append(alloc.allocate(rng.randint(1, 12 * MiB), rng.choice([0, 1])))
            elif k < 0.9:
                alloc.free(live.pop(rng.randrange(len(live))))
            else:
                alloc.empty_cache()
        except (OutOfMemoryError, CudaError, TransientDeviceError):
            pass
        assert implied() == alloc.reserved_nbytes, f"step {step}"
    check_viewer_consistency(to_pytorch_snapshot(alloc.history()))
    alloc.close()
    assert implied() == alloc.reserved_nbytes


def test_export_carries_the_source_snapshots_frames(tmp_path: Path) -> None:
    # a snapshot with stacks, read, exported with its frames, read back: the report groups by the same sites
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "report"))
    from test_report import make_snapshot  # type: ignore[import-not-found]

    from gpumem.report.sites import frame_site, live_by_site, snapshot_sites
    from gpumem.trace import load_trace
    from gpumem.trace.pytorch_export import snapshot_frames

    src = make_snapshot(tmp_path / "src.pickle.gz")
    trace = load_trace(src)
    frames = snapshot_frames(src, trace.n_allocs)
    assert frames is not None and len(frames) == trace.n_allocs
    out = save_pytorch_snapshot(trace, tmp_path / "out.pickle", frames=frames)
    back = load_trace(out)
    assert back.n_allocs == trace.n_allocs
    assert snapshot_sites(out, back) == snapshot_sites(src, trace) and snapshot_sites(out, back) is not None
    op = len(trace.kinds) // 2
    assert live_by_site(back, op, snapshot_sites(out, back)) == live_by_site(trace, op, snapshot_sites(src, trace))
    assert live_by_site(back, op, snapshot_sites(out, back)).kind == "stack frame"
    # without frames, as before: empty stacks, and the report falls back to sizes
    plain = save_pytorch_snapshot(trace, tmp_path / "plain.pickle")
    assert snapshot_sites(plain, load_trace(plain)) is None
    assert frame_site(frames[0]) is not None
    with pytest.raises(InvalidArgumentError, match="frames"):
        to_pytorch_snapshot(trace, frames=42)  # type: ignore[arg-type]


def test_replay_export_snapshot_says_where_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from gpumem.cli import main
    from gpumem.trace import Trace, save_trace

    t = save_trace(Trace.from_ops("t", "test", [(0, 0, MiB, 0, 0.0, 0), (1, 0, MiB, 0, 1.0, 0)]), tmp_path / "t.gmt")
    snap = tmp_path / "snap.pickle"
    assert main(["replay", str(t), "--device", "sim:t4-16gb", "--export-snapshot", str(snap), "--json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)  # still one JSON document
    assert snap.is_file() and "wrote the PyTorch snapshot to" in err and "snap.pickle" in err
    assert main(["replay", str(t), "--device", "sim:t4-16gb", "--export-snapshot", str(tmp_path / "s2.pickle")]) == 0
    assert "wrote the PyTorch snapshot to" in capsys.readouterr().err
