"""Cross-stream waits (wait_stream) in traces and in a replay's simulated GPU (issue 18, several streams).

Work a program queues on a stream after ``wait_stream`` starts only once the awaited stream's work queued
before it has run; a replay queues a marker there that the stream's SimPy process waits on (Note
[Cross-stream waits] in gpumem.sim.gpu_work). A wait delays the work that follows it, so a block used
there is reusable later; a trace without waits replays exactly as before, and ``idle`` ignores them.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.replay import replay_trace
from gpumem.specs import open_device
from gpumem.trace import StreamUse, StreamWait, Trace, load_trace, read_gmt_trace, save_trace
from gpumem.trace.stream_log import LoggedUse, LoggedWait, RecordStreamLog, merge_stream_uses

ROOT = Path(__file__).resolve().parents[2]
OLD_GMT = ROOT / "reports" / "hil" / "live-h200-2026-11-25-run2" / "workloads" / "multistream_infer.gpumem.gmt.gz"
MiB = 1 << 20
A, B = 11, 22
SIM = "sim:h200-141gb"


def _with(t: Trace, uses: tuple[StreamUse, ...] = (), waits: tuple[StreamWait, ...] = ()) -> Trace:
    return Trace(t.name, t.source, t.kinds, t.alloc_ids, t.nbytes, t.streams, t.times_us, t.addrs,
                 n_unmatched_frees=t.n_unmatched_frees, n_failed_allocs=t.n_failed_allocs, stream_uses=uses,
                 stream_waits=waits)


def _chained(wait: bool) -> Trace:
    """A 64 MiB block X on stream A, then 40 ms of work on A (1 ms gaps, under sync_gap_us); X is used on
    stream B, whose own work is 1 us, and B waits for A (or not) there; X is freed and the same size asked
    for again on A a few microseconds later. Without the wait B's work is done by then and X is reused;
    with it B's work (and the event X's free records on B) waits for A's 40 ms: a second 64 MiB."""
    ops = [(0, 0, 64 * MiB, A, 0.0, 0x1000000)]
    t_us = 10.0
    for k in range(1, 41):
        ops.append((0, k, MiB, A, t_us, 0x2000000 + k * 0x200000))
        t_us += 1000.0
    at = len(ops)
    ops.append((0, 41, MiB, B, t_us, 0x9000000))
    t_us += 1.0
    for k in range(42, 52):
        ops.append((0, k, MiB, A, t_us, 0x2000000 + k * 0x200000))
        t_us += 1.0
    ops += [(1, 0, 64 * MiB, A, t_us, 0x1000000), (0, 52, 64 * MiB, A, t_us + 1.0, 0x1000000)]
    t = Trace.from_ops("chained streams", "gpumem", ops)
    return _with(t, (StreamUse(at, 0, B, 0.0),), (StreamWait(at, B, A, 0.0),) if wait else ())


# -- the replay honours them ---------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, engine", [("pytorch", "python"), ("gpumem", "python"), ("gpumem", "native"),
                                            ("expandable", "python")])
def test_a_wait_delays_the_reuse_of_a_block_used_after_it(policy: str, engine: str) -> None:
    free = replay_trace(_chained(False), SIM, policy, gpu_timing="trace", progress=False, engine=engine)
    waits = replay_trace(_chained(True), SIM, policy, gpu_timing="trace", progress=False, engine=engine)
    # X waits for A's 40 ms: a second X (most of one under expandable, which maps pages it lacks)
    assert waits.peak_reserved_bytes >= free.peak_reserved_bytes + (48 if policy == "expandable" else 64) * MiB
    assert waits.peak_live_bytes == free.peak_live_bytes
    assert (waits.extra["gpu_stream_waits"], waits.extra["gpu_stream_wait_markers"]) == (1, 1)
    assert "gpu_stream_waits" not in free.extra


@pytest.mark.parametrize("policy, engine", [("pytorch", "python"), ("gpumem", "native")])
def test_idle_ignores_waits_bit_for_bit(policy: str, engine: str) -> None:
    a = replay_trace(_chained(False), SIM, policy, gpu_timing="idle", progress=False, engine=engine)
    b = replay_trace(_chained(True), SIM, policy, gpu_timing="idle", progress=False, engine=engine)
    assert a.as_json() | {"wall_s": 0, "ns_per_op": 0} == b.as_json() | {"wall_s": 0, "ns_per_op": 0}


def test_waits_that_order_nothing_change_no_figure() -> None:
    """A wait of a stream on itself or on an idle stream queues no marker: a real trace's figures under
    the default timing are those without the waits, bit for bit (simulated time too)."""
    t = load_trace(OLD_GMT)
    streams = sorted(set(t.streams.tolist()))
    noop = tuple(w for i in range(1, t.n_ops, 7)
                 for w in (StreamWait(i, int(t.streams[i]), int(t.streams[i])), StreamWait(i, streams[0], 123456789)))
    for engine in ("python", "native"):
        a = replay_trace(t, SIM, "gpumem", progress=False, engine=engine)
        b = replay_trace(_with(t, waits=noop), SIM, "gpumem", progress=False, engine=engine)
        assert (a.peak_reserved_bytes, a.sim_time_s, a.stats.device_calls) == \
            (b.peak_reserved_bytes, b.sim_time_s, b.stats.device_calls)
        assert b.extra["gpu_stream_waits"] == len(noop) and b.extra["gpu_stream_wait_markers"] == 0


def test_a_replay_without_waits_reports_what_it_did() -> None:
    """The replay's extra keys of a trace without waits are those from before waits existed."""
    r = replay_trace(OLD_GMT, SIM, "gpumem", progress=False)
    assert set(r.extra) == {"engine", "n_stream_uses", "n_plan_events", "gpu_timing", "gpu_launches",
                            "gpu_queue_full_waits", "gpu_syncs", "gpu_pending_at_end_s", "gpu_sync_drain"}


# -- the simulated device ------------------------------------------------------------------------------------
def test_order_streams_chains_through_markers() -> None:
    dev = open_device(SIM)
    try:
        first = dev.launch(B, 0.010, name="B's 10 ms")
        assert dev.order_streams(A, A) is None                 # a stream on itself: nothing to order
        assert dev.order_streams(A, 999) is None               # an idle stream: nothing to wait for
        marker = dev.order_streams(A, B)                       # A waits for B's 10 ms
        assert marker is not None and marker.duration_s == 0.0 and marker.touches == ()
        assert dev.order_streams(33, A) is not None            # 33 waits for A's marker, so for B
        after = dev.launch(33, 0.001, name="after the chain")
        unordered = dev.launch(44, 0.001, name="unordered")
        dev.wait_work(after)
        assert after.start_s == first.end_s == first.start_s + 0.010
        assert unordered.end_s is not None and unordered.end_s < first.end_s
        assert dev.stats.calls.get("stream_wait_event", 0) == 0     # not a device call of the allocator's
    finally:
        dev.close()


def test_order_streams_refuses_bad_streams_and_a_closed_device() -> None:
    dev = open_device(SIM)
    try:
        dev.launch(B, 0.001)
        for bad in (-1, 2**64, 1.5, "1"):
            with pytest.raises(InvalidArgumentError):
                dev.order_streams(bad, B)   # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError):
                dev.order_streams(A, bad)   # type: ignore[arg-type]
        assert not dev.streams.known(A)
    finally:
        dev.close()
    with pytest.raises(Exception, match="closed"):
        dev.order_streams(A, B)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.tuples(st.just("launch"), st.integers(0, 2), st.integers(0, 5)),
                          st.tuples(st.just("wait"), st.integers(0, 2), st.integers(0, 2)),
                          st.tuples(st.just("advance"), st.integers(1, 5), st.just(0))), max_size=40))
def test_work_after_a_wait_never_starts_before_the_awaited_work_ends(actions: list) -> None:
    """Invariant: each work item queued on a stream after ``order_streams(stream, waited)`` starts no earlier
    than every item queued on ``waited`` before the wait ends, and each stream still runs in order."""
    dev = open_device(SIM)
    try:
        queued: dict[int, list] = {0: [], 1: [], 2: []}
        must_follow: dict[int, list] = {0: [], 1: [], 2: []}   # per stream: work it must start after
        checks = []
        for kind, x, y in actions:
            if kind == "launch":
                w = dev.launch(x, y * 1e-4)
                checks += [(w, before) for before in must_follow[x] + queued[x]]
                queued[x].append(w)
            elif kind == "wait":
                dev.order_streams(x, y)
                if x != y:
                    must_follow[x] = must_follow[x] + queued[y] + must_follow[y]
            else:
                dev.advance(x * 1e-4)
        for works in queued.values():
            for w in works:
                dev.wait_work(w)
        for w, before in checks:
            assert w.start_s >= before.end_s - 1e-12, (w, before)
    finally:
        dev.close()


# -- the trace: its files and bad input -------------------------------------------------------------------
def test_waits_round_trip_in_the_oldest_version_that_holds_them(tmp_path: Path) -> None:
    t = _chained(True)
    path = save_trace(t, tmp_path / "w.gmt")
    assert '"version": 3' in path.read_text().splitlines()[0] and "\nw 22 11 0\n" in path.read_text()
    assert read_gmt_trace(path) == t
    uses_only = save_trace(_with(t, t.stream_uses), tmp_path / "u.gmt.gz")
    assert '"version": 2' in gzip.decompress(uses_only.read_bytes()).decode().splitlines()[0]
    waits_only = _with(t, waits=(StreamWait(0, B, A, 1.5), StreamWait(t.n_ops, A, B)))   # before op 0, after the last
    assert read_gmt_trace(save_trace(waits_only, tmp_path / "w2.gmt")) == waits_only
    assert _chained(False) != t


def test_a_window_keeps_the_waits_inside_it() -> None:
    t = _chained(True)
    at = t.stream_waits[0].at_op
    assert t.slice(at - 2).stream_waits == (StreamWait(2, B, A, 0.0),)
    assert t.slice(at + 1).stream_waits == ()
    assert t.head(at - 1).stream_waits == ()
    assert t.renamed("x").stream_waits == t.stream_waits


@pytest.mark.parametrize("waits, why", [
    ((StreamWait(5, A, B), StreamWait(3, A, B)), "stream wait 1 .*out of order"),
    ((StreamWait(999, A, B),), "stream wait 0 .*outside"),
    ((StreamWait(-1, A, B),), "outside"),
    ((StreamWait(1, 1.5, B),), "stream must be an int"),          # type: ignore[arg-type]
    ((StreamWait(1, A, "22"),), "waited must be an int"),         # type: ignore[arg-type]
    ((StreamWait(1, A, 2**63),), r"stream must be in \[0, 2\*\*63\)"),
    ((StreamWait(1, -1, B),), r"stream must be in \[0, 2\*\*63\)"),   # review: written, then its reader refused it
    ((StreamWait(1, A, -5),), r"stream must be in \[0, 2\*\*63\)"),
    ((StreamWait(1, A, B, 10**400),), "time_us must be a finite number that a float holds, not an integer of"),
    ((StreamWait(1, 10**5000, B),), "stream an integer of 16,610 bits"),   # str() of it raised ValueError
    ((StreamWait(1, A, B, float("nan")),), "time_us must be a finite number"),
    ((StreamWait(1, A, B, True),), "time_us must be a finite number"),   # type: ignore[arg-type]
    (((1, A, B, 0.0),), "must hold StreamWait objects"),
])
def test_a_trace_refuses_a_bad_stream_wait(waits: tuple, why: str) -> None:
    t = _chained(False)
    with pytest.raises(InvalidArgumentError, match=why):
        _with(t, t.stream_uses, waits)
    assert t.stream_waits == ()


def test_a_trace_refuses_a_use_on_a_stream_a_gmt_file_cannot_hold() -> None:
    t = _chained(False)
    for stream in (-1, 2**63):
        with pytest.raises(InvalidArgumentError, match=r"stream use 0 .*stream must be in \[0, 2\*\*63\)"):
            _with(t, (StreamUse(3, 0, stream),))
    with pytest.raises(InvalidArgumentError, match="time_us must be a finite number that a float holds"):
        _with(t, (StreamUse(3, 0, B, 10**400),))


def test_an_int_time_is_kept_as_the_float_a_file_stores(tmp_path: Path) -> None:
    """Review finding: an int time_us of 10**30 came back from a write and a read as another number."""
    t = _chained(False)
    big = _with(t, (StreamUse(3, 0, B, 10**30),), (StreamWait(3, B, A, 10**30), StreamWait(4, B, A, 7)))
    assert [type(e.time_us) for e in big.stream_uses + big.stream_waits] == [float] * 3
    assert big.stream_waits[0].time_us == float(10**30)
    assert read_gmt_trace(save_trace(big, tmp_path / "big.gmt")) == big


# -- merged from a record_stream log ------------------------------------------------------------------------
def _snapshot_like() -> Trace:
    t = _chained(False)
    return _with(t)   # a PyTorch snapshot's trace has no uses


def test_the_log_s_waits_merge_by_counts_and_by_time() -> None:
    t = _snapshot_like()
    at = 41   # B's op
    by_count = LoggedWait(0, B, A, 0.0, 41, 0)           # after 41 allocations, no frees: before op 41
    by_time = LoggedWait(0, A, B, float(t.times_us[45]) + 0.25)   # no counts: after every op of time <= its own
    use = LoggedUse(0, 0x1000000, B, 0.0, 41, 0)
    merged, report = merge_stream_uses(t, RecordStreamLog((use,), {0: (0, 0)}, waits=(by_time, by_count)))
    assert merged.stream_waits == (StreamWait(at, B, A, 0.0), StreamWait(46, A, B, float(t.times_us[45]) + 0.25))
    assert (report.n_waits, report.n_waits_by_count) == (2, 1)
    assert "2 wait_stream call(s) merged (1 placed by the counts, 1 by time)" in str(report)
    assert t.stream_waits == ()
    again = replay_trace(merged, SIM, "pytorch", progress=False, engine="python")
    assert again.peak_reserved_bytes == replay_trace(_chained(True), SIM, "pytorch", progress=False,
                                                     engine="python").peak_reserved_bytes


def test_a_log_of_waits_only_merges_and_one_of_foreign_streams_is_refused() -> None:
    t = _snapshot_like()
    merged, report = merge_stream_uses(t, RecordStreamLog((), {0: (0, 0)}, waits=(LoggedWait(0, 777, A, 0.0, 3, 0),)))
    assert merged.stream_waits == (StreamWait(3, 777, A, 0.0),) and report.n_uses == 0   # 777 carries a chain
    with pytest.raises(TraceFormatError, match="run.jsonl, entry 1: wait_stream of stream 777 on stream 778: no "
                                               "operation of chained streams runs on either"):
        merge_stream_uses(t, RecordStreamLog((LoggedUse(0, 0x1000000, B, 0.0, 41, 0),), {0: (0, 0)},
                                             waits=(LoggedWait(0, 777, 778, 0.0, 3, 0),)), where="run.jsonl")
    with pytest.raises(InvalidArgumentError, match="0 stream uses and 1 stream waits already"):
        merge_stream_uses(merged, RecordStreamLog((), {0: (0, 0)}))


@st.composite
def _traces_with_waits(draw: st.DrawFn) -> Trace:
    n_allocs = draw(st.integers(0, 12))
    ops, live, size, stream, t_us = [], [], {}, {}, 0.0
    for aid in range(n_allocs):
        size[aid], stream[aid] = draw(st.integers(0, 4 * MiB)), draw(st.sampled_from([0, A, B]))
        ops.append((0, aid, size[aid], stream[aid], t_us, 0))
        live.append(aid)
        t_us += draw(st.floats(0, 5000, allow_nan=False))
        if draw(st.booleans()):
            gone = live.pop(draw(st.integers(0, len(live) - 1)))
            ops.append((1, gone, size[gone], stream[gone], t_us, 0))
    t = Trace.from_ops("random", "gpumem", ops)
    positions = sorted(draw(st.lists(st.integers(0, t.n_ops), max_size=8)))
    waits = tuple(StreamWait(p, draw(st.sampled_from([0, A, B, 2**40])), draw(st.sampled_from([0, A, B])),
                             draw(st.floats(-1e6, 1e18, allow_nan=False, allow_infinity=False))) for p in positions)
    return _with(t, waits=waits)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_traces_with_waits(), st.integers(0, 30), st.integers(0, 30))
def test_any_trace_s_waits_survive_its_file_and_windows(t: Trace, start: int, stop: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for name in ("t.gmt", "t.gmt.gz"):
            assert read_gmt_trace(save_trace(t, Path(folder) / name)) == t
    w = t.slice(start, stop)
    lo, hi, _ = slice(start, stop).indices(t.n_ops)
    hi = max(lo, hi)
    assert [(x.stream, x.waited, x.time_us) for x in w.stream_waits] == \
        [(x.stream, x.waited, x.time_us) for x in t.stream_waits if lo <= x.at_op <= hi]
    assert all(0 <= x.at_op <= w.n_ops for x in w.stream_waits)
