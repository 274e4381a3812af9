"""The live engine's reserve in a trace (Trace.live_reserved_nbytes, .gmt version 6) and the replay's comparison
with it (gpumem.replay_compare, ``gpumem replay --compare-live``)."""

from __future__ import annotations

import dataclasses
import gzip
import json

import numpy as np
import pytest

from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.replay_compare import (ClockFloor, ReserveCapture, clock_floor, compare_live, compare_reserves,
                                   comparison_json)
from gpumem.trace import Trace, load_trace, save_trace
from gpumem.trace.builder import build_trace

MiB = 1 << 20


def _trace(reserves: list[int] | None = None, clock: bool = False) -> Trace:
    """Three allocations (3 MiB, 5 MiB, 1 MiB) and two frees."""
    codes = [0, 0, 1, 0, 1]
    addrs = [0x1000_0000, 0x2000_0000, 0x1000_0000, 0x3000_0000, 0x2000_0000]
    sizes = [3 * MiB, 5 * MiB, 0, MiB, 0]
    gpu = [float(10 * i + 5) for i in range(5)] if clock else None
    return build_trace("t", "recorded", codes, addrs, sizes, [0] * 5, [float(10 * i) for i in range(5)],
                       gpu_times_us=gpu, live_reserved_nbytes=reserves)


def _replayed_reserves(t: Trace) -> list[int]:
    """The reserve a replay of ``t`` holds after each op (-1 at frees), read the way compare_live reads it."""
    from gpumem.allocator import make_allocator
    from gpumem.replay import replay
    from gpumem.specs import open_device

    dev = open_device("sim:h200-141gb")
    a = make_allocator(dev, "gpumem")
    cap = ReserveCapture(t, a)
    replay(t, a, progress=False, gpu_timing="idle")
    cap.restore()
    a.close()
    dev.close()
    out = [-1] * t.n_ops
    for i, r in zip(cap.ops.tolist(), cap.reserves):
        out[i] = r
    return out


@pytest.mark.parametrize("clock", [False, True])
@pytest.mark.parametrize("suffix", [".gmt", ".gmt.gz"])
def test_gmt_v6_round_trip(tmp_path, clock, suffix):
    # a reserve is never below what is live (the reader refuses one that is): 4 MiB after the 3 MiB allocation
    t = _trace([4 * MiB, 8 * MiB, -1, 8 * MiB, -1], clock=clock)
    p = save_trace(t, tmp_path / f"t{suffix}")
    back = load_trace(p, progress=False)
    assert back == t and back.live_reserved_nbytes.tolist() == [4 * MiB, 8 * MiB, -1, 8 * MiB, -1]
    text = (gzip.open(p, "rt") if suffix.endswith(".gz") else open(p)).read().splitlines()
    header = json.loads(text[0])
    assert header["version"] == 6 and header["n_reserves"] == 3 and header["gpu_clock"] is clock
    assert text[2] == f"r {4 * MiB}"   # right after the op it belongs to


def test_writer_keeps_older_versions_without_reserves(tmp_path):
    for reserves in (None, [-1] * 5):   # none recorded: as a trace without them
        p = save_trace(_trace(reserves), tmp_path / "t.gmt")
        assert json.loads(open(p).readline())["version"] == 1
        assert load_trace(p, progress=False).live_reserved_nbytes is None


_HEAD = ('{"format": "gpumem-trace", "version": 6, "name": "t", "source": "s", "n_ops": 2, "n_allocs": 1, '
         '"n_unmatched_frees": 0, "n_failed_allocs": 0, "n_stream_uses": 0, "n_stream_waits": 0, '
         '"n_plan_events": 0, "gpu_clock": false, "n_reserves": 1}')


@pytest.mark.parametrize("body, match", [
    ("r 5\na 0 8 0 0 10\nf 0 0 1\n", "must follow the op line"),
    ("a 0 8 0 0 10\nr 8\nr 9\nf 0 0 1\n", "must follow the op line"),
    ("a 0 8 0 0 10\nr -5\nf 0 0 1\n", "reserved bytes"),
    ("a 0 8 0 0 10\nr 5 6\nf 0 0 1\n", "expected"),
    ("a 0 8 0 0 10\nf 0 0 1\n", "header says 1 reserves, the file has 0"),
    ("a 0 8 0 0 10 7\nr 5\nf 0 0 1\n", "expected"),   # a clock field the header does not announce
])
def test_gmt_v6_malformed(tmp_path, body, match):
    p = tmp_path / "bad.gmt"
    p.write_text(_HEAD + "\n" + body)
    with pytest.raises(TraceFormatError, match=match):
        load_trace(p, progress=False)


@pytest.mark.parametrize("header_change, match", [
    (('"gpu_clock": false', '"gpu_clock": 1'), "true or false"),
    (('"version": 6', '"version": 5'), "gpu_clock"),
    ((', "n_reserves": 1', ''), "n_reserves"),
])
def test_gmt_v6_bad_header(tmp_path, header_change, match):
    p = tmp_path / "bad.gmt"
    p.write_text(_HEAD.replace(*header_change) + "\na 0 8 0 0 10\nr 5\nf 0 0 1\n")
    with pytest.raises(TraceFormatError, match=match):
        load_trace(p, progress=False)


def test_r_line_refused_before_version_6(tmp_path):
    p = tmp_path / "old.gmt"
    head = json.loads(_HEAD)
    head["version"] = 4
    del head["gpu_clock"], head["n_reserves"]
    p.write_text(json.dumps(head) + "\na 0 8 0 0 10\nr 5\nf 0 0 1\n")
    with pytest.raises(TraceFormatError, match="expected"):
        load_trace(p, progress=False)


@pytest.mark.parametrize("bad, match", [
    (np.zeros(5, np.int32), "int64"),
    (np.zeros(4, np.int64), "one int64 per op"),
    (np.array([0, 0, -2, 0, 0], np.int64), "-2 bytes"),
    ("lots", "live_reserved_nbytes"),
])
def test_trace_refuses_bad_reserves(bad, match):
    t = _trace()
    with pytest.raises(InvalidArgumentError, match=match):
        dataclasses.replace(t, live_reserved_nbytes=bad)


def test_slice_and_rename_carry_reserves():
    t = _trace([2 * MiB, 8 * MiB, -1, 8 * MiB, -1])
    assert t.slice(1, 4).live_reserved_nbytes.tolist() == [8 * MiB, 8 * MiB]   # the free of op 0's block goes
    assert t.renamed("u").live_reserved_nbytes.tolist() == t.live_reserved_nbytes.tolist()
    assert t != _trace([2 * MiB, 8 * MiB, -1, 6 * MiB, -1])


def test_compare_live_agrees_with_itself():
    t = _trace()
    t = dataclasses.replace(t, live_reserved_nbytes=np.array(_replayed_reserves(t), np.int64))
    c = compare_live(t, gpu_timing="idle")
    assert c.agrees and c.allocations_compared == 3 and c.allocations_differing == 0
    assert c.live_peak_reserved_nbytes == c.replayed_peak_reserved_nbytes == c.result.peak_reserved_bytes
    assert "held what live held" in c.lines()[0]


def test_compare_live_finds_the_first_difference():
    t = _trace()
    r = _replayed_reserves(t)
    r[3] += 2 * MiB   # live held a page more after the third allocation
    t = dataclasses.replace(t, live_reserved_nbytes=np.array(r, np.int64), gpu_times_us=np.arange(5) * 10.0 + 7)
    c = compare_live(t, gpu_timing="idle")
    assert not c.agrees and c.allocations_differing == 1
    assert (c.first.op, c.first.nbytes, c.first.gap_nbytes) == (3, MiB, -2 * MiB)
    assert c.first.gpu_lag_us == pytest.approx(7.0) and c.largest == c.first
    assert "op 3 " in c.lines()[2]


def test_comparison_json_gives_times_to_the_nanosecond():
    """Times in ``--json`` are the clocks' nanoseconds, not a float's noise (179.3070000000298: new user 35)."""
    t = _trace()
    r = _replayed_reserves(t)
    r[3] += 2 * MiB
    lagged = t.times_us + 7.000000000029
    t = dataclasses.replace(t, live_reserved_nbytes=np.array(r, np.int64), gpu_times_us=lagged)
    first = comparison_json(compare_live(t, gpu_timing="idle"))["first"]
    assert first["gpu_lag_us"] == round(first["gpu_lag_us"], 3) == pytest.approx(7.0)
    assert first["time_us"] == round(first["time_us"], 3)


def test_comparison_gives_the_clock_floor_of_the_first_and_last_second():
    """An offset or drifting GPU clock parts a replay from live at an idle GPU: the comparison says how far behind the
    clock is at its least, in the trace's first and last second (new user 35: a trace does not say which clock
    recorded it)."""
    t = _trace()
    r = _replayed_reserves(t)
    times = np.array([0.0, 400_000.0, 900_000.0, 1_500_000.0, 2_200_000.0])   # seconds 0, 0, 0, 1, 2
    lag = np.array([5.0, 3.0, 9.0, 7.0, -2.0])
    t = dataclasses.replace(t, times_us=times, gpu_times_us=times + lag, live_reserved_nbytes=np.array(r, np.int64))
    c = compare_live(t, gpu_timing="idle")
    lo = float(np.percentile([5.0, 3.0, 9.0], 1))
    assert c.clock_floor == clock_floor(t) == ClockFloor(pytest.approx(lo), -2.0, 3)
    assert any(line.startswith(f"the trace's GPU clock at its least behind: {lo:.4g} µs in the first second, -2 µs")
               for line in c.lines())
    assert comparison_json(c)["gpu_clock_floor"] == {"first_second_us": round(lo, 3), "last_second_us": -2.0,
                                                      "seconds": 3}
    no_clock = dataclasses.replace(t, gpu_times_us=None)
    assert clock_floor(no_clock) is None
    assert comparison_json(compare_live(no_clock, gpu_timing="idle"))["gpu_clock_floor"] is None


def test_clock_floor_of_hostile_times():
    """Stamps or op times that are not finite are left out, none left is no clock; one second says so (re-check 36:
    a NaN op time crashed the comparison)."""
    t = _trace(clock=True)
    assert clock_floor(dataclasses.replace(t, gpu_times_us=np.full(5, np.nan))) is None
    nan_time = t.times_us.copy()
    nan_time[0] = np.nan
    f = clock_floor(dataclasses.replace(t, times_us=nan_time))
    assert f == ClockFloor(5.0, 5.0, 1) and "one second of stamps" in f.describe()
    all_nan = dataclasses.replace(t, times_us=np.full(5, np.nan))
    assert clock_floor(all_nan) is None
    assert "1e+300 µs" in ClockFloor(1e300, 1e300, 1).describe()


def test_compare_live_needs_reserves():
    with pytest.raises(InvalidArgumentError, match="no live reserves"):
        compare_live(_trace(), gpu_timing="idle")
    with pytest.raises(InvalidArgumentError, match="must be a Trace or a path"):
        compare_live(42)


def test_compare_live_takes_a_path_and_names_another_policy(tmp_path):
    t = _trace()
    t = dataclasses.replace(t, live_reserved_nbytes=np.array(_replayed_reserves(t), np.int64))
    p = save_trace(t, tmp_path / "t.gmt")
    assert compare_live(str(p), gpu_timing="idle").agrees
    other = compare_live(p, policy="pytorch", gpu_timing="idle")
    assert other.policy == "pytorch" and any("'pytorch' policy" in line for line in other.lines())


def test_capture_restores_the_allocator():
    from gpumem.allocator import make_allocator
    from gpumem.specs import open_device

    dev = open_device("sim:h200-141gb")
    a = make_allocator(dev, "gpumem")
    before = a.allocate
    cap = ReserveCapture(_trace(), a)
    assert a.allocate is not before
    cap.restore()
    assert a.allocate == before
    a.close()
    dev.close()
    with pytest.raises(InvalidArgumentError, match="no live reserves"):
        compare_reserves(_trace(), cap)


def test_cli_compare_live(tmp_path, capsys):
    from gpumem.cli import main

    t = _trace()
    t = dataclasses.replace(t, live_reserved_nbytes=np.array(_replayed_reserves(t), np.int64))
    p = save_trace(t, tmp_path / "t.gmt")
    assert main(["replay", str(p), "--compare-live", "--gpu-timing", "idle"]) == 0
    assert "held what live held after every one" in capsys.readouterr().out
    assert main(["replay", str(p), "--compare-live", "--gpu-timing", "idle", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["live_comparison"]["allocations_differing"] == 0 and data["live_comparison"]["first"] is None
    q = save_trace(_trace(), tmp_path / "plain.gmt")
    assert main(["replay", str(q), "--compare-live"]) == 2
    assert "no live reserves" in capsys.readouterr().err


def test_trace_from_words_reads_reserves():
    from gpumem.torch import trace_from_words

    words = [0, 0x1000, 4096, 0, 0, 1, 0x1000, 4096, 0, 10]
    t = trace_from_words(words, reserved=np.array([2 * MiB, -7], np.int64))
    assert t.live_reserved_nbytes.tolist() == [2 * MiB, -1]
    with pytest.raises(TraceFormatError, match="int64 reserves"):
        trace_from_words(words, reserved=np.array([1, 2, 3], np.int64))


def test_all_unrecorded_is_no_reserves(tmp_path):
    """A trace whose reserves are all -1 has none (attacker 33, F2): read(write(t)) == t holds."""
    t = _trace([-1] * 5)
    assert t.live_reserved_nbytes is None
    assert load_trace(save_trace(t, tmp_path / "t.gmt"), progress=False) == t
    v6 = _trace([2 * MiB, -1, -1, -1, -1])
    assert v6.slice(1, 5).live_reserved_nbytes is None   # a piece with no recorded allocation


def test_a_failed_allocation_keeps_the_pairing():
    """A replay that goes on past an out-of-memory error pairs each later reserve with its own op (attacker 33,
    F1), and the comparison says where the replay stopped when it stops."""
    from gpumem.allocator import make_allocator
    from gpumem.replay import replay
    from gpumem.specs import open_device

    t = build_trace("t", "recorded", [0] * 4, [0x1000, 0x2000, 0x3000, 0x4000],
                    [4 * MiB, 600 * MiB, 30 * MiB, 300 * MiB], [0] * 4, [1.0, 2.0, 3.0, 4.0],
                    live_reserved_nbytes=[4 * MiB, 602 * MiB, 34 * MiB, 334 * MiB])
    dev = open_device("sim:h200-141gb")
    a = make_allocator(dev, "gpumem", limit=512 * MiB)
    cap = ReserveCapture(t, a)
    r = replay(t, a, stop_on_oom=False, progress=False, gpu_timing="idle")
    cap.restore()
    a.close()
    dev.close()
    assert cap.reserves[1] == -1   # op 1 failed
    c = compare_reserves(t, cap, r)
    assert c.allocations_compared == 3 and (c.first is None or c.first.op != 1)
    assert c.stopped_at_op is None   # it went on to the end (re-check 34): nothing "not compared" after op 1
    stopped = compare_live(t, limit=512 * MiB, gpu_timing="idle")
    assert stopped.stopped_at_op == 1 and not stopped.agrees
    assert any("stopped by out of memory at op 2 (index 1 " in line for line in stopped.lines())
    none = compare_live(t, limit=1 * MiB, gpu_timing="idle")
    assert none.allocations_compared == 0 and not none.agrees
    assert none.lines()[0] == "no allocation compared with the live engine's reserve"


def test_build_trace_refuses_reserves_it_cannot_keep():
    for bad in ([1.5] * 5, [0] * 4):
        with pytest.raises(InvalidArgumentError, match="one int per event"):
            _trace(bad)


# -- placements (Note [Comparing placements]) ----------------------------------------------------------------------

def _replayed(t: Trace, policy: str = "gpumem", **options) -> ReserveCapture:
    from gpumem.allocator import make_allocator
    from gpumem.replay import replay
    from gpumem.specs import open_device

    dev = open_device("sim:h200-141gb")
    a = make_allocator(dev, policy, **options)
    cap = ReserveCapture(t, a)
    try:
        replay(t, a, stop_on_oom=False, progress=False, gpu_timing="idle")
    finally:
        cap.restore()
        a.close()
        dev.close()
    return cap


def _live_at(t: Trace, pointers: list[int], shift: int) -> Trace:
    """``t`` with each allocation at ``pointer + shift`` (its free at the same address) and the replay's reserves."""
    addrs = t.addrs.copy()
    alloc_ops = np.flatnonzero(t.kinds == 0)
    for op, p in zip(alloc_ops.tolist(), pointers):
        old = addrs[op]
        later = np.flatnonzero((t.kinds == 1) & (t.addrs == old))
        later = later[later > op]
        addrs[op] = p + shift
        if len(later):
            addrs[later[0]] = p + shift
    return build_trace("t", "recorded", t.kinds.tolist(), addrs.tolist(), t.nbytes.tolist(), t.streams.tolist(),
                       t.times_us.tolist(), live_reserved_nbytes=_replayed_reserves(t))


def test_placements_agree_where_the_replay_puts_each_block_where_live_did():
    t = _trace()
    live = _live_at(t, _replayed(t).pointers, shift=0x5000_0000_0000)   # live's range sits elsewhere
    c = compare_live(live, gpu_timing="idle")
    assert (c.placements_compared, c.placed_as_live, c.first_placed_otherwise_op) == (3, 3, None)
    assert any(line.startswith("placement: each of the 3 allocations compared sits where") for line in c.lines())
    data = comparison_json(c)
    assert (data["placements_compared"], data["placed_as_live"], data["first_placed_otherwise_op"]) == (3, 3, None)
    assert data["placements_agree"] is True and c.placements_agree is True
    assert not any("so the differences above" in line for line in c.lines())   # the reserves agree: none above


def test_a_block_placed_otherwise_is_named():
    t = _trace()
    pointers = _replayed(t).pointers
    pointers[1] += 2 * MiB   # the second allocation (op 1) sat 2 MiB further on live, in the first one's range
    c = compare_live(_live_at(t, pointers, shift=0x5000_0000_0000), gpu_timing="idle")
    assert (c.placements_compared, c.placed_as_live, c.first_placed_otherwise_op) == (3, 2, 1)
    assert any(line.startswith("placement: 2 of 3 allocations sit where the live engine put them (relative to the "
                               "first allocation in the same address range); the first elsewhere is op 1")
               for line in c.lines())
    pointers = _replayed(t).pointers
    pointers[2] += 2 * MiB   # the 1 MiB one is the first in its own range (the small blocks'): it fixes that shift
    assert compare_live(_live_at(t, pointers, shift=0x5000_0000_0000), gpu_timing="idle").first_placed_otherwise_op is None


def test_pointers_outside_any_reservation_are_not_compared():
    t = dataclasses.replace(_trace(), live_reserved_nbytes=np.array([2 * MiB, 8 * MiB, -1, 8 * MiB, -1], np.int64))
    c = compare_live(t, policy="pytorch", gpu_timing="idle")   # cudaMalloc'd segments: no reservation holds them
    assert (c.placements_compared, c.placed_as_live, c.first_placed_otherwise_op) == (0, 0, None)
    assert c.placements_agree is None
    assert any(line.startswith("placement: not compared") for line in c.lines())
    data = comparison_json(c)   # null, not "0 of 0" that a script would read as all placed as live
    assert (data["placed_as_live"], data["first_placed_otherwise_op"], data["placements_agree"]) == (None, None, None)


def test_a_failed_allocation_is_no_placement():
    t = build_trace("t", "recorded", [0] * 3, [0x1000, 0x2000, 0x3000], [4 * MiB, 600 * MiB, 30 * MiB], [0] * 3,
                    [1.0, 2.0, 3.0], live_reserved_nbytes=[4 * MiB, 604 * MiB, 34 * MiB])
    cap = _replayed(t, limit=512 * MiB)
    assert cap.pointers[1] == -1 and cap.reservations[1] == -1 and cap.reservations[0] >= 1
    c = compare_reserves(t, cap)
    # the two made share the large blocks' range; the first fixes its shift, the second's live address (0x3000) is
    # not the first's shift away from its pointer
    assert (c.placements_compared, c.placed_as_live, c.first_placed_otherwise_op) == (2, 1, 2)
    assert any("1 of 2 allocations sits where" in line for line in c.lines())


class _Device:
    """Says which reservation holds a pointer: one range at ``BASE``, its serial as set (attacker 37, F1)."""

    BASE = 0x7F00_0000_0000

    def __init__(self) -> None:
        self.serial = 1
        self.fails = False

    def reservation_at(self, ptr: int):
        if self.fails:
            raise InvalidArgumentError("cannot say")
        return (self.BASE, 1 << 30, self.serial)


class _Allocator:
    reserved_nbytes = 2 * MiB

    def __init__(self, pointers: list[int]) -> None:
        self.device = _Device()
        self._pointers = iter(pointers)

    def allocate(self, nbytes: int, stream: int = 0) -> int:
        return next(self._pointers)


def _four_allocations(live_addrs: list[int]) -> Trace:
    return build_trace("t", "recorded", [0] * 4, live_addrs, [MiB] * 4, [0] * 4, [1.0, 2.0, 3.0, 4.0],
                       live_reserved_nbytes=[2 * MiB] * 4)


def test_a_reservation_made_again_at_a_freed_ones_address_has_its_own_shift():
    """Live, two reservations at X and Y; the replay's second is made at its first's (freed) address, as a driver
    reuses a freed range: each block sits where live put it relative to its own reservation (attacker 37, F1)."""
    b = _Device.BASE
    x, y = 0x1_0000_0000, 0x9_0000_0000
    t = _four_allocations([x, x + MiB, y, y + MiB])
    a = _Allocator([b, b + MiB, b, b + MiB])
    cap = ReserveCapture(t, a)
    a.allocate(MiB)
    a.allocate(MiB)
    a.device.serial = 2   # given back and reserved again at the same base
    a.allocate(MiB)
    a.allocate(MiB)
    cap.restore()
    c = compare_reserves(t, cap)
    assert cap.reservations == [1, 1, 2, 2]
    assert (c.placements_compared, c.placed_as_live, c.first_placed_otherwise_op) == (4, 4, None)


def test_a_device_that_cannot_say_leaves_the_allocation_standing():
    b = _Device.BASE
    t = _four_allocations([0x1000, 0x2000, 0x3000, 0x4000])
    a = _Allocator([b, b + MiB, b + 2 * MiB, b + 3 * MiB])
    a.device.fails = True
    cap = ReserveCapture(t, a)
    assert [a.allocate(MiB) for _ in range(4)] == [b, b + MiB, b + 2 * MiB, b + 3 * MiB]
    cap.restore()
    assert cap.reservations == [-1] * 4 and cap.reserves == [2 * MiB] * 4
    assert compare_reserves(t, cap).placements_compared == 0


def test_a_device_whose_lookup_breaks_leaves_the_capture_in_step():
    """A duck-typed device answering a 2-tuple: the allocation stands and the three lists stay in step (re-check
    37)."""
    b = _Device.BASE
    t = _four_allocations([0x1000, 0x2000, 0x3000, 0x4000])
    a = _Allocator([b, b + MiB, b + 2 * MiB, b + 3 * MiB])
    a.device.reservation_at = lambda ptr: (ptr, MiB)
    cap = ReserveCapture(t, a)
    assert a.allocate(MiB) == b
    cap.restore()
    assert (cap.reserves, cap.pointers, cap.reservations) == ([2 * MiB], [-1], [-1])


def test_not_compared_names_no_single_cause():
    t = _four_allocations([0x1000, 0x2000, 0x3000, 0x4000])
    t = dataclasses.replace(t, addrs=np.zeros_like(t.addrs))   # the gpumem policy, no live addresses
    c = compare_live(t, gpu_timing="idle")
    assert c.placements_compared == 0
    assert any(line.startswith("placement: not compared (no allocation the replay made sat in an address reservation")
               for line in c.lines())


def test_unknown_live_addresses_and_wild_pointers_are_not_compared():
    b = _Device.BASE
    t = _four_allocations([0x1_0000_0000, 0, 0x1_0000_0000 + 2 * MiB, 0x1_0000_0000 + 3 * MiB])   # 0: unknown
    a = _Allocator([b, b + MiB, 1 << 63, b + 3 * MiB])   # a pointer past int64 from a duck-typed allocator
    cap = ReserveCapture(t, a)
    for _ in range(4):
        a.allocate(MiB)
    cap.restore()
    c = compare_reserves(t, cap)
    assert cap.pointers[2] == -1 and cap.reservations[2] == -1
    assert (c.placements_compared, c.placed_as_live, c.first_placed_otherwise_op) == (2, 2, None)


def test_device_reservation_at():
    from gpumem.specs import open_device

    dev = open_device("sim:h200-141gb")
    try:
        g = dev.granularity_nbytes
        va = dev.address_reserve(4 * g)
        wa = dev.address_reserve(2 * g)
        assert dev.reservation_at(va + g) == (va, 4 * g, 1) and dev.reservation_at(wa) == (wa, 2 * g, 2)
        dev.address_free(va, 4 * g)
        assert dev.reservation_at(va + g) is None
        again = dev.address_reserve(4 * g)
        assert dev.reservation_at(again)[2] == 3   # another reservation, wherever it lands
        for bad in ("0x1000", 0, -1, np.int64(-1), True, 1.5):   # as free() refuses them, whatever their type
            with pytest.raises(InvalidArgumentError):
                dev.reservation_at(bad)
        assert dev.reservation_at(np.int64(wa)) == (wa, 2 * g, 2) and dev.reservation_at(2**200) is None
        dev.address_free(again, 4 * g)
        dev.address_free(wa, 2 * g)
    finally:
        dev.close()
