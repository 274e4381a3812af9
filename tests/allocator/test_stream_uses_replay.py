"""Stream uses (record_stream) recorded in traces and made by replays (issue 18, several streams).

A block freed after ``record_stream`` on another stream must not be handed out before the work queued on
that stream until the free has run (the engines' fences, Note [Streams] in gpumem.allocator.caching); a
replay makes the trace's uses where it has them (Note [Stream uses in a replay] in gpumem.replay).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumem.allocator import CachingAllocator
from gpumem.allocator.bucket import BucketAllocator
from gpumem.errors import InvalidArgumentError, InvalidPointerError, TraceFormatError
from gpumem.replay import replay, replay_trace, stream_use_plan
from gpumem.specs import open_device
from gpumem.trace import StreamUse, Trace, TraceRecorder, load_trace, read_gmt_trace, save_trace

ROOT = Path(__file__).resolve().parents[2]
OLD_GMT = ROOT / "reports" / "hil" / "live-h200-2026-11-25-run2" / "workloads" / "multistream_infer.gpumem.gmt.gz"
MiB = 1 << 20
ENGINES = ("python", "native")
S_ALLOC, S_USE = 11, 22


def _with_uses(t: Trace, uses: tuple[StreamUse, ...]) -> Trace:
    return Trace(t.name, t.source, t.kinds, t.alloc_ids, t.nbytes, t.streams, t.times_us, t.addrs,
                 n_unmatched_frees=t.n_unmatched_frees, n_failed_allocs=t.n_failed_allocs, stream_uses=uses)


# -- old traces -------------------------------------------------------------------------------------------
def test_an_old_trace_loads_unchanged_and_writes_back_byte_for_byte(tmp_path: Path) -> None:
    t = read_gmt_trace(OLD_GMT)
    assert t.stream_uses == () and t.n_ops == 648
    out = save_trace(t, tmp_path / "again.gmt.gz")
    assert gzip.decompress(out.read_bytes()) == gzip.decompress(OLD_GMT.read_bytes())   # still version 1


def test_idle_replays_an_old_trace_to_todays_figures() -> None:
    """The figures the replay gave before stream uses existed (issue 18 point 3: idle reproduces them)."""
    for engine in ENGINES:
        r = replay_trace(OLD_GMT, "sim:h200-141gb", "gpumem", gpu_timing="idle", progress=False, engine=engine)
        assert (r.peak_reserved_bytes, r.peak_live_bytes) == (1352663040, 1344602148), engine


@pytest.mark.parametrize("timing", ["idle", "trace"])
def test_uses_on_the_allocation_stream_change_nothing(timing: str) -> None:
    """Defined: record_stream on the block's own stream is kept in the trace and ignored by the engine."""
    t = load_trace(OLD_GMT)
    own = []
    for i, (kind, aid, stream) in enumerate(zip(t.kinds.tolist(), t.alloc_ids.tolist(), t.streams.tolist())):
        if kind == 0 and i + 1 < t.n_ops:
            own.append(StreamUse(i + 1, aid, stream, 0.0))
    for engine in ENGINES:
        a = replay_trace(t, "sim:h200-141gb", "gpumem", gpu_timing=timing, progress=False, engine=engine)
        b = replay_trace(_with_uses(t, tuple(own)), "sim:h200-141gb", "gpumem", gpu_timing=timing, progress=False,
                         engine=engine)
        assert (a.peak_reserved_bytes, a.stats.num_steals if hasattr(a.stats, "num_steals") else 0) == \
            (b.peak_reserved_bytes, b.stats.num_steals if hasattr(b.stats, "num_steals") else 0)


# -- the replay makes them ----------------------------------------------------------------------------------
def _two_stream_trace(with_use: bool) -> Trace:
    """A 64 MiB block on S_ALLOC used on S_USE, where 40 ms of work follows; freed, then the same size asked
    for again on S_ALLOC while that work still runs."""
    ops = [(0, 0, 64 * MiB, S_ALLOC, 0.0, 0x1000000),       # the block
           (0, 1, 4 * MiB, S_USE, 10.0, 0x9000000),         # the other stream's work: 40 ms after this op...
           (0, 2, 4 * MiB, S_USE, 1010.0, 0xA000000),       # ...queued as 1 ms gaps (under sync_gap_us)
           (0, 3, 4 * MiB, S_USE, 2010.0, 0xB000000),
           (1, 0, 64 * MiB, S_ALLOC, 2020.0, 0x1000000),    # the free of the block
           (0, 4, 64 * MiB, S_ALLOC, 2030.0, 0x1000000)]    # the same size again
    t = Trace.from_ops("two streams", "gpumem", ops)
    return _with_uses(t, (StreamUse(1, 0, S_USE, 5.0),) if with_use else ())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_block_used_on_a_busy_stream_is_not_reused_at_once(engine: str) -> None:
    plain = replay_trace(_two_stream_trace(False), "sim:h200-141gb", "gpumem", gpu_timing="trace", progress=False,
                         engine=engine)
    used = replay_trace(_two_stream_trace(True), "sim:h200-141gb", "gpumem", gpu_timing="trace", progress=False,
                        engine=engine)
    idle = replay_trace(_two_stream_trace(True), "sim:h200-141gb", "gpumem", gpu_timing="idle", progress=False,
                        engine=engine)
    assert used.peak_reserved_bytes >= plain.peak_reserved_bytes + 64 * MiB   # a second 64 MiB: the first waits
    assert idle.peak_reserved_bytes == plain.peak_reserved_bytes              # an idle GPU: every fence is done


def test_the_bucket_pool_refuses_a_trace_with_uses() -> None:
    dev = open_device("sim:h200-141gb")
    try:
        with pytest.raises(InvalidArgumentError, match="1 stream use .* BucketAllocator cannot take them: replay it under"):
            stream_use_plan(_two_stream_trace(True), BucketAllocator(dev))
        assert stream_use_plan(_two_stream_trace(False), BucketAllocator(dev)) is None
    finally:
        dev.close()


def test_recorded_uses_round_trip_and_replay_alike(tmp_path: Path) -> None:
    """The Python engine's recorder keeps record_stream; the .gmt file (version 2) keeps it too."""
    dev = open_device("sim:h200-141gb")
    try:
        alloc = CachingAllocator(dev, "gpumem", engine="python", record_history=True)
        p = alloc.allocate(8 * MiB, S_ALLOC)
        q = alloc.allocate(MiB, S_USE)
        alloc.record_stream(p, S_USE)
        alloc.record_stream(p, S_ALLOC)     # its own stream: kept, changes nothing
        alloc.free(p)
        alloc.free(q)
        t = alloc.history()
        alloc.close()
    finally:
        dev.close()
    assert [(u.at_op, u.alloc_id, u.stream) for u in t.stream_uses] == [(2, 0, S_USE), (2, 0, S_ALLOC)]
    path = save_trace(t, tmp_path / "rec.gmt")
    assert '"version": 2' in path.read_text().splitlines()[0]
    back = read_gmt_trace(path)
    assert back == t
    assert back.slice(1).stream_uses == ()              # the block's alloc is outside the window
    assert t.head(2).stream_uses == t.stream_uses       # a use before op 2 lies inside ops 0..1's window


def test_the_recorder_keeps_stream_waits() -> None:
    rec = TraceRecorder()
    rec.record_stream_wait(9, 1, 0.5)          # before any op
    rec.record_alloc(0x1000, 64, 1, 1.0)
    rec.record_stream_wait(1, 9, 2.0)
    rec.record_free(0x1000, 1, 3.0)
    t = rec.to_trace("waits")
    assert [(w.at_op, w.stream, w.waited, w.time_us) for w in t.stream_waits] == [(0, 9, 1, 0.5), (1, 1, 9, 2.0)]
    assert t.stream_uses == () and t.n_ops == 2


# -- bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_record_stream_of_an_unknown_or_freed_block_raises_and_changes_nothing(engine: str) -> None:
    dev = open_device("sim:h200-141gb")
    try:
        alloc = CachingAllocator(dev, "gpumem", engine=engine)
        p = alloc.allocate(MiB, S_ALLOC)
        q = alloc.allocate(MiB, S_ALLOC)
        alloc.free(q)
        before = (alloc.live_blocks(), alloc.reserved_nbytes)
        with pytest.raises(InvalidPointerError, match="record_stream: .* is not a live allocation"):
            alloc.record_stream(0xDEAD000, S_USE)
        with pytest.raises(InvalidPointerError, match="record_stream: .* is not a live allocation"):
            alloc.record_stream(q, S_USE)
        with pytest.raises(InvalidPointerError, match="inside the live block"):
            alloc.record_stream(p + 512, S_USE)
        assert (alloc.live_blocks(), alloc.reserved_nbytes) == before
        alloc.record_stream(p, S_ALLOC)     # its own stream: defined, nothing to wait for
        alloc.free(p)
        assert alloc.allocate(MiB, S_ALLOC) == p
        alloc.close()
    finally:
        dev.close()


@pytest.mark.parametrize("use, why", [
    (StreamUse(0, 0, 5), "not made before it"),
    (StreamUse(3, 0, 5), "freed \\(op 1\\) before it"),
    (StreamUse(2, 7, 5), "not made before it"),
    (StreamUse(9, 1, 5), "outside"),
    (StreamUse(1, 0, 2**63), r"stream must be in \[0, 2\*\*63\)"),
    (StreamUse(1, 0, -1), r"stream must be in \[0, 2\*\*63\)"),   # a .gmt file cannot hold it (review attacker 6)
    (StreamUse(1, 0, 1.5), "must be an int"),   # type: ignore[arg-type]
])
def test_a_trace_refuses_a_bad_stream_use(use: StreamUse, why: str) -> None:
    t = Trace.from_ops("t", "gpumem", [(0, 0, 8, 0, 0.0, 0), (1, 0, 8, 0, 1.0, 0), (0, 1, 8, 0, 2.0, 0)])
    with pytest.raises(InvalidArgumentError, match=why):
        _with_uses(t, (use,))
    with pytest.raises(InvalidArgumentError, match="out of order"):
        _with_uses(t, (StreamUse(3, 1, 5), StreamUse(1, 0, 5)))


def test_recorder_skips_a_use_of_an_unknown_address(caplog: pytest.LogCaptureFixture) -> None:
    rec = TraceRecorder()
    rec.record_alloc(0x1000, 8, 1, 1.0)
    rec.record_stream_use(0x5000, 2, 2.0)      # allocated before recording began
    rec.record_stream_use(0x1000, 2, 3.0)
    rec.record_free(0x1000, 1, 4.0)
    rec.record_stream_use(0x1000, 2, 5.0)      # freed: no allocation there any more
    t = rec.to_trace("r")
    assert t.stream_uses == (StreamUse(1, 0, 2, 3.0),) and t.n_unmatched_frees == 0
    assert "skipped 2 stream use(s)" in caplog.text


def test_a_use_line_in_a_version_1_file_is_refused(tmp_path: Path) -> None:
    text = gzip.decompress(OLD_GMT.read_bytes()).decode().splitlines()
    text.insert(2, "u 0 5 1")
    path = tmp_path / "v1.gmt"
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(TraceFormatError, match="line 3: expected .*a version 1 file"):
        read_gmt_trace(path)


# -- the invariant, both engines ----------------------------------------------------------------------------
_action = st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from([MiB, 8 * MiB, 24 * MiB]), st.integers(0, 2)),
    st.tuples(st.just("use"), st.integers(0, 3), st.integers(0, 2), st.floats(1e-4, 2e-2)),
    st.tuples(st.just("free"), st.integers(0, 3)),
    st.tuples(st.just("advance"), st.floats(0.0, 5e-3)),
)
#: Rounds of: allocate, use it on another stream, free it, allocate again (the case the invariant is about),
#: mixed with any other actions.
_round = st.tuples(st.sampled_from([MiB, 8 * MiB]), st.integers(0, 2), st.integers(0, 2), st.floats(1e-4, 2e-2),
                   st.lists(_action, max_size=4)).map(
    lambda r: [("alloc", r[0], r[1]), ("use", -1, r[2], r[3]), ("free", -1), *r[4], ("alloc", r[0], r[1])])


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(_round, min_size=1, max_size=8).map(lambda rounds: [a for r in rounds for a in r]))
def test_a_block_with_a_pending_use_waits_for_the_using_streams_fence(engine: str, actions: list) -> None:
    """A freed block used on other streams is never handed out (on any stream) before the work queued on
    those streams until its free has run; the work touches the block, so the simulator's sanitizer also
    catches an unmap under it."""
    streams = (0, S_ALLOC, S_USE)
    dev = open_device("sim:h200-141gb")
    try:
        alloc = CachingAllocator(dev, "gpumem", engine=engine)
        live: list[tuple[int, int, int, set[int]]] = []   # (ptr, nbytes, stream, streams it is used on)
        last_work: dict[int, object] = {}
        guarded: list[tuple[int, int, list]] = []        # (ptr, block size, the work it waits for)
        for act in actions:
            if act[0] == "alloc":
                _, nbytes, s = act
                p = alloc.allocate(nbytes, streams[s])
                for g_ptr, g_size, works in guarded:
                    if any(not w.done for w in works):
                        assert p + nbytes <= g_ptr or g_ptr + g_size <= p, (
                            f"{p:#x}+{nbytes} handed out over {g_ptr:#x}+{g_size}, whose fence is not done")
                live.append((p, nbytes, streams[s], set()))
            elif act[0] == "use" and live:
                _, k, s, duration_s = act
                p, nbytes, own, used = live[k % len(live)]
                alloc.record_stream(p, streams[s])
                used.add(streams[s])
                last_work[streams[s]] = dev.launch(streams[s], duration_s, ((p, nbytes),), name="use")
            elif act[0] == "free" and live:
                p, nbytes, own, used = live.pop(act[1] % len(live))
                works = [last_work[s] for s in used if s != own and s in last_work]
                guarded.append((p, alloc.block_size(p), works))
                alloc.free(p)
            elif act[0] == "advance":
                dev.advance(act[1])
        alloc.close()
    finally:
        dev.close()


# -- an out-of-memory error in an idle replay (the loop the uses split) ---------------------------------------
@pytest.mark.parametrize("with_use", [False, True])
def test_an_idle_replay_reports_the_operation_that_ran_out_of_memory(with_use: bool) -> None:
    """Before: UnboundLocalError (the plain loop did not say which operation failed), in replay() and in
    the report's runs alike."""
    from gpumem.report.runs import occupancy_at, run_policy

    ops = [(0, 0, 80 << 30, S_ALLOC, 0.0, 0), (0, 1, MiB, S_ALLOC, 1.0, 0), (0, 2, 80 << 30, S_ALLOC, 2.0, 0),
           (1, 1, MiB, S_ALLOC, 3.0, 0)]
    t = _with_uses(Trace.from_ops("too big", "gpumem", ops), (StreamUse(2, 1, S_USE),) if with_use else ())
    for stop in (True, False):
        r = replay_trace(t, "sim:h200-141gb", "gpumem", gpu_timing="idle", progress=False, stop_on_oom=stop)
        assert (r.oom_op, r.completed_ops, r.ooms) == ((2, 2, 1) if stop else (2, 4, 1))
    run = run_policy(t, "sim:h200-141gb", "gpumem", gpu_timing="idle")
    assert run.result is not None and run.result.oom_op == 2
    occ = occupancy_at(t, "sim:h200-141gb", "gpumem", 4, gpu_timing="idle")
    assert occ is not None and occ.stopped_by_oom and occ.op == 2
