"""record_stream logged beside a PyTorch snapshot (gpumem.trace.stream_log): the logger (a stand-in torch,
no GPU), the log file, the merge into the snapshot's trace (placement, bad input) and what a replay makes of
it (a block used on a busy stream is held longer, under PyTorch's allocator model too)."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.replay import replay_trace
from gpumem.trace import StreamUse, Trace, snapshot_to_trace
from gpumem.trace.pytorch_export import save_pytorch_snapshot
from gpumem.trace.stream_log import (TIME_TOLERANCE_US, LoggedUse, LoggedWait, RecordStreamLog, RecordStreamLogger, load_trace_with_stream_uses,

                                     merge_stream_uses, read_record_stream_log, unknown_stream_uses,
                                     write_record_stream_log)

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
MAIN, SIDE = 0, 0x5A5A00
A_ADDR, B_ADDR = 0x7F0000000000, 0x7F0010000000


# -- a stand-in torch --------------------------------------------------------------------------------------
class _TensorBase:
    """Plays torch._C.TensorBase: record_stream is defined here, not on the Tensor class."""

    def record_stream(self, stream: Any) -> None:
        if getattr(stream, "fail", False):
            raise RuntimeError("record_stream: not a CUDA stream")
        self.calls.append(stream)


class _Tensor(_TensorBase):
    def __init__(self, ptr: int, device: int = 0) -> None:
        self.ptr, self.device, self.calls = ptr, SimpleNamespace(index=device), []

    def untyped_storage(self) -> Any:
        return SimpleNamespace(data_ptr=lambda: self.ptr)


class _Cuda:
    def __init__(self) -> None:
        self.allocs, self.frees, self.initialised = 0, 0, True

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def memory_stats_as_nested_dict(self, device: int) -> dict:
        if not self.initialised:
            return {}   # torch.cuda before CUDA is initialised
        return {"allocation": {"all": {"allocated": self.allocs, "freed": self.frees, "current": 0, "peak": 0}}}


class _Stream:
    """Plays torch.cuda.Stream: wait_stream is a Python method of the class."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream, self.device, self.waited = handle, SimpleNamespace(index=0), []

    def wait_stream(self, other: Any) -> None:
        self.waited.append(other)


def _torch() -> Any:
    tensor = type("Tensor", (_TensorBase,), {})
    tensor.__init__ = _Tensor.__init__
    tensor.untyped_storage = _Tensor.untyped_storage
    cuda = _Cuda()
    cuda.Stream = type("Stream", (_Stream,), {})
    return SimpleNamespace(Tensor=tensor, cuda=cuda)


def test_the_logger_logs_each_call_after_passing_it_on_and_puts_the_method_back() -> None:
    torch = _torch()
    torch.cuda.allocs, torch.cuda.frees = 5, 2            # before the history began
    clock = iter([1_000_000_000, 1_000_500_000])
    with RecordStreamLogger(torch, clock_ns=lambda: next(clock)) as rs:
        x = torch.Tensor(A_ADDR)
        torch.cuda.allocs, torch.cuda.frees = 8, 3
        x.record_stream(SimpleNamespace(cuda_stream=SIDE))
        torch.cuda.allocs = 9
        torch.Tensor(B_ADDR, device=0).record_stream(SimpleNamespace(cuda_stream=MAIN))
        with pytest.raises(InvalidArgumentError, match="already logged"):
            RecordStreamLogger(torch).start()
    assert "record_stream" not in vars(torch.Tensor)       # the base class's method again
    assert len(x.calls) == 1                                # PyTorch got the call
    log = rs.log()
    assert log.base_counts == {0: (5, 2)} and log.n_unlogged == 0
    assert log.uses == (LoggedUse(0, A_ADDR, SIDE, 1_000_000.0, 8, 3), LoggedUse(0, B_ADDR, MAIN, 1_000_500.0, 9, 3))
    torch.Tensor(A_ADDR).record_stream(SimpleNamespace(cuda_stream=SIDE))   # after stop: not logged
    assert len(rs.log().uses) == 2


def test_the_logger_logs_wait_stream_too_and_puts_it_back() -> None:
    torch = _torch()
    main, copy = torch.cuda.Stream(MAIN), torch.cuda.Stream(SIDE)
    original = vars(_Stream)["wait_stream"]
    with RecordStreamLogger(torch, clock_ns=lambda: 7_000) as rs:
        torch.cuda.allocs = 4
        copy.wait_stream(main)
        assert copy.waited == [main]                        # the call went through
    assert "wait_stream" not in vars(torch.cuda.Stream) and torch.cuda.Stream.wait_stream is original
    assert rs.log().waits == (LoggedWait(0, SIDE, MAIN, 7.0, 4, 0),)
    with RecordStreamLogger(torch, waits=False) as rs:
        copy.wait_stream(main)
    assert rs.log().waits == ()


def test_a_failing_call_is_not_logged_and_an_unloggable_one_is_counted() -> None:
    torch = _torch()
    torch.cuda.initialised = False                         # the base counts are then 0
    with RecordStreamLogger(torch) as rs:
        with pytest.raises(RuntimeError, match="not a CUDA stream"):
            torch.Tensor(A_ADDR).record_stream(SimpleNamespace(cuda_stream=SIDE, fail=True))
        torch.Tensor(A_ADDR).record_stream(SimpleNamespace())   # no cuda_stream: went through, not logged
    log = rs.log()
    assert log.uses == () and log.n_unlogged == 1 and log.base_counts == {0: (0, 0)}
    with pytest.raises(TraceFormatError, match="1 record_stream call.* could not be logged"):
        merge_stream_uses(_trace(), log)


def test_a_tensor_class_with_its_own_method_gets_it_back() -> None:
    torch = _torch()
    own = lambda self, s: None   # noqa: E731
    torch.Tensor.record_stream = own
    RecordStreamLogger(torch).start().stop()
    assert vars(torch.Tensor)["record_stream"] is own


# -- the trace a snapshot gives ------------------------------------------------------------------------------
def _entries() -> list[dict]:
    """Block A (64 MiB, main) used on SIDE, freed; C at A's address (reused at once) used on SIDE too."""
    e = lambda action, addr, size, stream, t: dict(action=action, addr=addr, size=size, stream=stream, time_us=t)  # noqa: E731
    return [e("alloc", A_ADDR, 64 * MiB, MAIN, 100), e("alloc", B_ADDR, 4 * MiB, SIDE, 110),
            e("free_requested", A_ADDR, 64 * MiB, MAIN, 120), e("free_completed", A_ADDR, 64 * MiB, MAIN, 121),
            e("alloc", A_ADDR, 64 * MiB, MAIN, 130),
            e("free_requested", B_ADDR, 4 * MiB, SIDE, 140), e("free_requested", A_ADDR, 64 * MiB, MAIN, 150)]


def _trace() -> Trace:
    return snapshot_to_trace({"segments": [], "device_traces": [_entries()]}, name="two streams")


def _log(*uses: LoggedUse, base: tuple[int, int] = (0, 0)) -> RecordStreamLog:
    return RecordStreamLog(uses, {0: base})


USE_A = LoggedUse(0, A_ADDR, SIDE, 115.0, 2, 0)     # after ops 0, 1: A live
USE_C = LoggedUse(0, A_ADDR, SIDE, 135.0, 3, 1)     # the same address, the next allocation (C, id 2)


def test_the_merge_finds_the_allocation_live_at_the_call_by_the_allocators_counts() -> None:
    t = _trace()
    merged, report = merge_stream_uses(t, _log(USE_A, USE_C))
    assert merged.stream_uses == (StreamUse(2, 0, SIDE, 115.0), StreamUse(4, 2, SIDE, 135.0))
    assert (report.n_uses, report.n_by_count, report.n_by_time, report.n_own_stream) == (2, 2, 0, 0)
    assert merged.ops_equal(t) and t.stream_uses == ()     # the ops unchanged, the input untouched


def test_without_counts_or_with_counts_the_trace_contradicts_the_time_places_it() -> None:
    no_counts = [LoggedUse(0, u.ptr, u.stream, u.time_us) for u in (USE_A, USE_C)]
    merged, report = merge_stream_uses(_trace(), _log(*no_counts))
    assert [(u.at_op, u.alloc_id) for u in merged.stream_uses] == [(2, 0), (4, 2)] and report.n_by_time == 2
    # counts from a history that began later than the log (one allocation more than the trace's): the first
    # 3 + 0 ops hold 2 allocations, not 3, so the counts are not used
    merged, report = merge_stream_uses(_trace(), _log(LoggedUse(0, A_ADDR, SIDE, 115.0, 3, 0)))
    assert [(u.at_op, u.alloc_id) for u in merged.stream_uses] == [(2, 0)] and report.n_by_time == 1


def test_a_call_in_the_same_microsecond_as_its_blocks_free_goes_before_the_free() -> None:
    """Times tie at microseconds: a use logged at the free's time lands after it by time, and is moved
    back into the block's life (within TIME_TOLERANCE_US)."""
    merged, _ = merge_stream_uses(_trace(), _log(LoggedUse(0, A_ADDR, SIDE, 120.0)))
    assert [(u.at_op, u.alloc_id) for u in merged.stream_uses] == [(2, 0)]


def test_an_interior_pointer_and_a_use_on_the_own_stream() -> None:
    merged, report = merge_stream_uses(_trace(), _log(LoggedUse(0, A_ADDR + 4096, SIDE, 115.0, 2, 0),
                                                      LoggedUse(0, B_ADDR, SIDE, 115.0, 2, 0)))
    assert [(u.at_op, u.alloc_id, u.stream) for u in merged.stream_uses] == [(2, 0, SIDE), (2, 1, SIDE)]
    assert report.n_own_stream == 1 and report.streams == (SIDE,)


@pytest.mark.parametrize("use, message", [
    (LoggedUse(0, A_ADDR, SIDE, 125.0, 2, 1), "after op 2.* no allocation"),   # between A's free and C's alloc
    (LoggedUse(0, A_ADDR, 999, 115.0, 2, 0), "no operation of two streams runs on that stream"),
])
def test_bad_uses_are_refused_naming_the_entry(use: LoggedUse, message: str) -> None:
    t = _trace()
    with pytest.raises(TraceFormatError, match=f"run.jsonl, entry 1: .*{message}"):
        merge_stream_uses(t, _log(USE_A, use), where="run.jsonl")
    assert t.stream_uses == ()


def test_a_trace_with_uses_or_a_log_of_several_devices_is_refused() -> None:
    merged, _ = merge_stream_uses(_trace(), _log(USE_A))
    with pytest.raises(InvalidArgumentError, match="1 stream uses and 0 stream waits already"):
        merge_stream_uses(merged, _log(USE_C))
    two = RecordStreamLog((USE_A, LoggedUse(1, A_ADDR, SIDE, 115.0)), {0: (0, 0), 1: (0, 0)})
    with pytest.raises(InvalidArgumentError, match=r"devices \[0, 1\]: pass device="):
        merge_stream_uses(_trace(), two)
    assert len(merge_stream_uses(_trace(), two, device=0)[0].stream_uses) == 1


# -- the file ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["run.record_stream.jsonl", "run.record_stream.jsonl.gz"])
def test_the_log_file_round_trips(tmp_path: Path, name: str) -> None:
    log = RecordStreamLog((USE_A, LoggedUse(0, A_ADDR, SIDE, 135.5)), {0: (3, 1)}, 0,
                          waits=(LoggedWait(0, SIDE, MAIN, 114.0, 2, 0),))
    assert read_record_stream_log(write_record_stream_log(log, tmp_path / name)) == log


@pytest.mark.parametrize("lines, message", [
    (['{"format": "other"}'], "not a record_stream log"),
    (['{"format": "gpumem-record-stream-log", "version": 9, "clock": "unix_us"}'], "version 9"),
    (['{"format": "gpumem-record-stream-log", "version": 1, "clock": "unix_us", "n_uses": 2, "n_unlogged": 0}',
      '[0, 1, 2, 3.0, null, null]'], "header says 2 uses and 0 waits, the file has 1 and 0"),
    (['{"format": "gpumem-record-stream-log", "version": 1, "clock": "unix_us", "n_uses": 1, "n_unlogged": 0}',
      '[0, -1, 2, 3.0, null, null]'], "line 2: device, ptr, stream must be integers"),
    (['{"format": "gpumem-record-stream-log", "version": 1, "clock": "unix_us", "n_uses": 1, "n_unlogged": 0}',
      '[0, 1, 2, 3.0, 4, null]'], "line 2: n_allocs and n_frees"),
    (['{"format": "gpumem-record-stream-log", "version": 1, "clock": "unix_us", "n_uses": 1, "n_unlogged": 0}',
      '[0, 1, 2, NaN, null, null]'], "line 2: time_us must be a finite number"),
    (['{"format": "gpumem-record-stream-log", "version": 1, "clock": "unix_us", "n_uses": 0, "n_unlogged": 0}',
      '[[[[['], "line 2: not JSON"),
    ([], "empty"),
    (['{"format": "gpumem-record-stream-log", "version": 1, "clock": "unix_us", "n_uses": 0, "n_waits": 1, '
      '"n_unlogged": 0}', '{"w": [0, 1, 3.0, null, null]}'], "line 2: expected .device, stream, waited"),
])
def test_a_bad_log_file_is_refused_naming_the_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(TraceFormatError, match=message):
        read_record_stream_log(path)


# -- what a replay makes of it --------------------------------------------------------------------------------
def _busy_side_stream(tmp_path: Path) -> tuple[Path, Path]:
    """A 64 MiB block on MAIN used on SIDE, where 3 ms of work follows (1 ms gaps, under the 2 ms sync
    threshold); freed, then 64 MiB asked for again on MAIN while that work still runs: a snapshot and its
    log, as the workloads probe writes them."""
    ops = [(0, 0, 64 * MiB, MAIN, 0.0, A_ADDR), (0, 1, 4 * MiB, SIDE, 10.0, B_ADDR),
           (0, 2, 4 * MiB, SIDE, 1010.0, B_ADDR + 4 * MiB), (0, 3, 4 * MiB, SIDE, 2010.0, B_ADDR + 8 * MiB),
           (1, 0, 64 * MiB, MAIN, 2020.0, A_ADDR), (0, 4, 64 * MiB, MAIN, 2030.0, A_ADDR)]
    snap = save_pytorch_snapshot(Trace.from_ops("busy side", "pytorch-snapshot", ops), tmp_path / "busy.snapshot.pickle.gz")
    log = write_record_stream_log(_log(LoggedUse(0, A_ADDR, SIDE, 5.0, 1, 0)), tmp_path / "busy.record_stream.jsonl.gz")
    return Path(snap), log


@pytest.mark.parametrize("policy", ["pytorch", "expandable", "gpumem"])
def test_with_the_logged_use_the_block_is_held_while_the_other_stream_works(tmp_path: Path, policy: str) -> None:
    snap, log = _busy_side_stream(tmp_path)
    trace, report = load_trace_with_stream_uses(snap, log)
    assert report.n_by_count == 1 and trace.stream_uses == (StreamUse(1, 0, SIDE, 5.0),)
    plain = replay_trace(snap, "sim:h200-141gb", policy, gpu_timing="trace", progress=False)
    used = replay_trace(trace, "sim:h200-141gb", policy, gpu_timing="trace", progress=False)
    idle = replay_trace(trace, "sim:h200-141gb", policy, gpu_timing="idle", progress=False)
    # the first block still waits: most of a second 64 MiB (expandable segments map 2 MiB pages, some of
    # which the side stream's blocks leave free)
    assert used.peak_reserved_bytes >= plain.peak_reserved_bytes + 56 * MiB
    assert idle.peak_reserved_bytes == plain.peak_reserved_bytes              # an idle GPU: every event done


def test_several_streams_without_recorded_uses_cannot_be_scored() -> None:
    t = _trace()
    assert "2 streams" in unknown_stream_uses(t, uses_recorded=False)
    assert unknown_stream_uses(t, uses_recorded=True) is None                 # the program made none
    assert unknown_stream_uses(merge_stream_uses(t, _log(USE_A))[0], uses_recorded=False) is None
    one = Trace.from_ops("one", "gpumem", [(0, 0, 4096, 7, 0.0, A_ADDR)])
    assert unknown_stream_uses(one, uses_recorded=False) is None


def test_the_log_is_json_lines(tmp_path: Path) -> None:
    path = write_record_stream_log(_log(USE_A), tmp_path / "x.jsonl.gz")
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    assert json.loads(lines[0])["n_uses"] == 1 and json.loads(lines[1]) == [0, A_ADDR, SIDE, 115.0, 2, 0]


# -- gpumem replay --stream-uses ----------------------------------------------------------------------------
def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    from gpumem.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_gpumem_replay_makes_the_logged_uses(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    snap, log = _busy_side_stream(tmp_path)
    code, out, _ = _cli(capsys, "replay", str(snap), "--policy", "pytorch", "--gpu-timing", "trace", "--json")
    plain = json.loads(out)
    code2, out2, _ = _cli(capsys, "replay", str(snap), "--policy", "pytorch", "--gpu-timing", "trace", "--json",
                          "--stream-uses", str(log))
    used = json.loads(out2)
    assert (code, code2) == (0, 0) and (plain["n_stream_uses"], used["n_stream_uses"]) == (0, 1)
    assert used["peak_reserved_bytes"] >= plain["peak_reserved_bytes"] + 64 * MiB
    code, out, _ = _cli(capsys, "replay", str(snap), "--policy", "pytorch", "--stream-uses", str(log))
    assert code == 0 and "stream uses    1 record_stream calls made" in out


def test_gpumem_replay_refuses_a_bad_log_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from gpumem.cli import EXIT_USAGE

    snap, _ = _busy_side_stream(tmp_path)
    # A_ADDR between its free (op 4) and its next allocation (op 5): held at other times, not then
    bad = write_record_stream_log(_log(LoggedUse(0, A_ADDR, SIDE, 2025.0, 4, 1)), tmp_path / "bad.jsonl")
    code, _, err = _cli(capsys, "replay", str(snap), "--stream-uses", str(bad))
    assert code == EXIT_USAGE and "--stream-uses" in err and "no allocation of busy holds that address" in err
    code, _, err = _cli(capsys, "replay", str(snap), "--stream-uses", str(tmp_path / "missing.jsonl"))
    assert code == EXIT_USAGE and "no such file" in err


# -- property: a log of any program's calls merges back onto the allocations it named ------------------------
@st.composite
def _program(draw: Any) -> tuple[list[dict], list[LoggedUse], list[tuple[int, int]]]:
    """Random allocs and frees with addresses reused at once, and record_stream calls between them on a
    live allocation (at its start or inside it): the snapshot entries, the log (counts and times as the
    logger takes them), and for each call the true (position, allocation id)."""
    streams = [0, 7, 0x5A5A00]
    entries: list[dict] = []
    uses: list[LoggedUse] = []
    truth: list[tuple[int, int]] = []
    live: dict[int, tuple[int, int]] = {}   # addr -> (alloc id, size)
    free_addrs: list[int] = []
    n_allocs = n_frees = 0
    for _ in range(draw(st.integers(1, 40))):
        t = 10.0 * len(entries)
        if live and draw(st.booleans()):
            addr = draw(st.sampled_from(sorted(live)))
            aid, size = live.pop(addr)
            entries.append(dict(action="free_requested", addr=addr, size=size, stream=0, time_us=t))
            free_addrs.append(addr)
            n_frees += 1
        else:
            reuse = free_addrs and draw(st.booleans())
            addr = free_addrs.pop() if reuse else 0x7F0000000000 + 0x100000 * (n_allocs + 1)
            size = draw(st.sampled_from([512, 4096, 1 << 20]))
            entries.append(dict(action="alloc", addr=addr, size=size, stream=draw(st.sampled_from(streams)), time_us=t))
            live[addr] = (n_allocs, size)
            n_allocs += 1
        for _ in range(draw(st.integers(0, 2)) if live else 0):
            addr = draw(st.sampled_from(sorted(live)))
            aid, size = live[addr]
            inside = draw(st.integers(0, size - 1))
            uses.append(LoggedUse(0, addr + inside, draw(st.sampled_from(streams)), t + 5.0, n_allocs, n_frees))
            truth.append((len(entries), aid))
    # every stream runs an operation (the merge refuses a use on a stream that runs none)
    entries += [dict(action="alloc", addr=0x10 + 64 * i, size=8, stream=s, time_us=1e9) for i, s in enumerate(streams)]
    return entries, uses, truth


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_program(), st.booleans())
def test_merged_uses_land_on_the_allocations_the_program_named(program: Any, with_counts: bool) -> None:
    entries, uses, truth = program
    t = snapshot_to_trace({"segments": [], "device_traces": [entries]}, name="random")
    if not with_counts:
        uses = [LoggedUse(u.device, u.ptr, u.stream, u.time_us) for u in uses]
    merged, report = merge_stream_uses(t, _log(*uses))
    assert report.n_uses == len(uses) and report.n_by_count == (len(uses) if with_counts else 0)
    got = sorted((u.at_op, u.alloc_id) for u in merged.stream_uses)
    assert got == sorted(truth)
    merged.validate()


def test_gpumem_replay_refuses_a_log_for_a_trace_that_is_no_snapshot(capsys: pytest.CaptureFixture) -> None:
    """New-user finding: an RMM log with --stream-uses failed on an 'unknown stream'; it is refused by format."""
    from gpumem.cli import EXIT_USAGE

    code, _, err = _cli(capsys, "replay", str(ROOT / "data/traces/resnet_train.rmm_log.csv.gz"),
                        "--stream-uses", "whatever.jsonl")
    assert code == EXIT_USAGE and "--stream-uses" in err and "PyTorch snapshots only" in err and "rmm-log" in err


def test_gpumem_replay_says_idle_timing_ignores_the_uses(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    snap, log = _busy_side_stream(tmp_path)
    with caplog.at_level("WARNING", logger="gpumem"):
        code, _, _ = _cli(capsys, "replay", str(snap), "--policy", "pytorch", "--gpu-timing", "idle",
                          "--stream-uses", str(log))
    assert code == 0 and "change no decision of this replay" in caplog.text and "1 stream use(s)" in caplog.text


# -- review attacker 6 -----------------------------------------------------------------------------------------
def _reference_placement(trace: Trace, u: LoggedUse, p_count: int | None) -> tuple[int, int | None]:
    """The merge's placement as it was before the bisection (walk every allocation at the address, try each
    position of the time window): kept here to show the faster one answers the same."""
    import numpy as np

    is_alloc = trace.kinds == 0
    alloc_pos = np.flatnonzero(is_alloc)
    free_pos = np.full(len(alloc_pos), trace.n_ops, dtype=np.int64)
    free_pos[trace.alloc_ids[~is_alloc]] = np.flatnonzero(~is_alloc)
    addr, extent = trace.addrs[alloc_pos], np.maximum(trace.nbytes[alloc_pos], 1)

    if not ((addr <= u.ptr) & (u.ptr < addr + extent)).any():
        return -1, None   # never held: skipped as PyTorch skips it

    def live_at(p: int) -> int | None:
        for aid in np.flatnonzero(addr == u.ptr):
            if alloc_pos[aid] < p <= free_pos[aid]:
                return int(aid)
        hit = np.flatnonzero((alloc_pos < p) & (free_pos >= p) & (addr <= u.ptr) & (u.ptr < addr + extent))
        return int(hit[0]) if len(hit) else None

    if p_count is not None:
        return p_count, live_at(p_count)
    times = np.maximum.accumulate(np.where(np.isnan(trace.times_us), -np.inf, trace.times_us))
    p = int(np.searchsorted(times, u.time_us, side="right"))
    if live_at(p) is not None:
        return p, live_at(p)
    lo = int(np.searchsorted(times, u.time_us - TIME_TOLERANCE_US, side="left"))
    hi = int(np.searchsorted(times, u.time_us + TIME_TOLERANCE_US, side="right"))
    best: tuple[int, int] | None = None
    for q in range(lo, hi + 1):
        aid = live_at(q)
        if aid is not None and (best is None or abs(q - p) < abs(best[0] - p)):
            best = (q, aid)
    return best if best is not None else (p, None)


@st.composite
def _reused_addresses(draw: Any) -> tuple[Trace, list[LoggedUse]]:
    """A trace whose few addresses are reused, sometimes while still live (a .gmt may do that), with
    sizes that make some pointers interior, and uses anywhere (by counts or by time, near or far)."""
    pool = [0x1000, 0x1000 + 256, 0x4000]
    ops: list[tuple] = []
    live: list[tuple[int, int, int]] = []
    n = 0
    for k in range(draw(st.integers(1, 30))):
        t = draw(st.sampled_from([10.0 * k, 10.0 * k + 300.0, 5.0 * k]))
        if live and draw(st.booleans()):
            aid, size, a = live.pop(draw(st.integers(0, len(live) - 1)))
            ops.append((1, aid, size, 0, t, a))
        else:
            size, a = draw(st.sampled_from([0, 256, 1024])), draw(st.sampled_from(pool))
            ops.append((0, n, size, 0, t, a))
            live.append((n, size, a))
            n += 1
    ops.append((0, n, 8, 1, 1e6, 0x9000))
    trace = Trace.from_ops("reused", "gpumem", ops)
    uses = []
    for _ in range(draw(st.integers(1, 6))):
        ptr = draw(st.sampled_from(pool)) + draw(st.sampled_from([0, 100, 300]))
        at = draw(st.integers(0, len(ops)))
        counts = (int((trace.kinds[:at] == 0).sum()), int((trace.kinds[:at] == 1).sum()))
        uses.append(LoggedUse(0, ptr, 1, draw(st.floats(-50, 400)), *(counts if draw(st.booleans()) else (None, None))))
    return trace, uses


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_reused_addresses())
def test_the_bisecting_merge_places_each_use_where_walking_every_allocation_did(case: Any) -> None:
    trace, uses = case
    for u in uses:
        p_count = None if u.n_allocs is None else u.n_allocs + u.n_frees
        want = _reference_placement(trace, u, p_count)
        if want == (-1, None):
            merged, report = merge_stream_uses(trace, _log(u))
            assert merged.stream_uses == () and report.n_skipped == 1
        elif want[1] is None:
            with pytest.raises(TraceFormatError, match="no allocation of reused holds that address"):
                merge_stream_uses(trace, _log(u))
        else:
            got = merge_stream_uses(trace, _log(u))[0].stream_uses[0]
            assert (got.at_op, got.alloc_id) == want


@pytest.mark.parametrize("name, header, message", [
    ("superscript", {"base_counts": {"²": [0, 0]}}, "line 1: 'base_counts' must map device numbers"),
    ("long key", {"base_counts": {"9" * 5000: [0, 0]}}, "line 1: 'base_counts' must map device numbers"),
    ("arabic digit", {"base_counts": {"\u0663": [0, 0]}}, "line 1: 'base_counts' must map device numbers"),
])
def test_a_hostile_base_counts_key_is_refused_naming_line_1(tmp_path: Path, name: str, header: dict,
                                                            message: str) -> None:
    h = {"format": "gpumem-record-stream-log", "version": 1, "clock": "unix_us", "n_uses": 0, "n_unlogged": 0,
         **header}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(h) + "\n")
    with pytest.raises(TraceFormatError, match=message):
        read_record_stream_log(path)


def test_an_integer_time_too_large_for_a_float_is_refused_naming_line_2(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    from gpumem.cli import EXIT_USAGE

    path = tmp_path / "bigtime.jsonl"
    path.write_text('{"format": "gpumem-record-stream-log", "version": 1, "clock": "unix_us", "n_uses": 1, '
                    '"n_unlogged": 0}\n[0, 1, 2, %s, null, null]\n' % ("9" * 400))
    with pytest.raises(TraceFormatError, match="line 2: time_us must be a finite number"):
        read_record_stream_log(path)
    snap = save_pytorch_snapshot(_trace(), tmp_path / "t.snapshot.pickle")
    code, _, err = _cli(capsys, "replay", str(snap), "--stream-uses", str(path))
    assert code == EXIT_USAGE and "line 2: time_us" in err and "Traceback" not in err


def test_a_log_of_another_device_is_refused() -> None:
    on_1 = RecordStreamLog((LoggedUse(1, A_ADDR, SIDE, 115.0, 2, 0),), {1: (0, 0)})
    t = _trace()
    with pytest.raises(TraceFormatError, match=r"the log's calls are on device\(s\) \[1\], the trace is of device 0"):
        merge_stream_uses(t, on_1, device=0)
    assert t.stream_uses == ()


def test_a_log_far_from_the_snapshots_times_is_merged_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="gpumem"):
        merge_stream_uses(_trace(), _log(USE_A))
    assert "outside the snapshot's times" not in caplog.text
    with caplog.at_level("WARNING", logger="gpumem"):
        merged, _ = merge_stream_uses(_trace(), _log(LoggedUse(0, A_ADDR, SIDE, 1.7e15, 2, 0)))
    assert "1 of its 1 call(s) on this device lie more than 10 s outside the snapshot's times" in caplog.text
    assert len(merged.stream_uses) == 1


def test_a_nan_op_time_is_skipped_when_placing_by_time() -> None:
    """Review finding: np.maximum.accumulate carried one NaN to every later op, and a wait placed by time
    landed right after it. The NaN op takes the time before it."""
    ops = [(0, 0, 1 << 20, 0, 1000.0, 0x7F0000000000), (0, 1, 1 << 20, 5, float("nan"), 0x7F0000100000),
           (1, 0, 1 << 20, 0, 1020.0, 0x7F0000000000), (0, 2, 1 << 20, 0, 1030.0, 0x7F0000000000),
           (1, 1, 1 << 20, 5, 1040.0, 0x7F0000100000), (1, 2, 1 << 20, 0, 1050.0, 0x7F0000000000)]
    t = Trace.from_ops("nan", "gpumem", ops)
    rs = RecordStreamLog((LoggedUse(0, 0x7F0000100000, 0, 1035.0),), {0: (0, 0)},
                         waits=(LoggedWait(0, 5, 0, 1045.0),))
    merged, _ = merge_stream_uses(t, rs)
    assert [w.at_op for w in merged.stream_waits] == [5]
    assert [(u.at_op, u.alloc_id) for u in merged.stream_uses] == [(4, 1)]


def test_placed_by_time_between_two_lives_the_earlier_wins_a_tie() -> None:
    """No block holds the address at the first guess (after op 1, before op 2); the op before and the op
    after are equally near: the use goes into the earlier life (what trying each position in order did)."""
    ops = [(0, 0, 512, 0, 0.0, 0x1000), (1, 0, 512, 0, 10.0, 0x1000), (0, 1, 512, 0, 20.0, 0x1000),
           (1, 1, 512, 0, 30.0, 0x1000), (0, 2, 8, 1, 1e6, 0x9000)]
    merged, _ = merge_stream_uses(Trace.from_ops("tie", "gpumem", ops), _log(LoggedUse(0, 0x1000, 1, 15.0)))
    assert [(u.at_op, u.alloc_id) for u in merged.stream_uses] == [(1, 0)]


def test_gpumem_replay_refuses_a_log_of_another_device_in_one_line(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Review finding: a one-device snapshot took a log of device 1 (placed by time), and a two-device one
    with --device-index 1 dropped every call of a device-0 log without a word."""
    import pickle

    from gpumem.cli import EXIT_USAGE

    snap = save_pytorch_snapshot(_trace(), tmp_path / "t.snapshot.pickle")
    on_1 = write_record_stream_log(RecordStreamLog((LoggedUse(1, A_ADDR, SIDE, 115.0, 2, 0),), {1: (0, 0)}),
                                   tmp_path / "dev1.jsonl")
    code, _, err = _cli(capsys, "replay", str(snap), "--stream-uses", str(on_1))
    assert code == EXIT_USAGE and "device 1, the --stream-uses log's" in err and "no device 1" in err
    data = pickle.loads(Path(snap).read_bytes())
    data["device_traces"] = [data["device_traces"][0]] * 2
    two = tmp_path / "t2.snapshot.pickle"
    two.write_bytes(pickle.dumps(data))
    on_0 = write_record_stream_log(_log(USE_A), tmp_path / "dev0.jsonl")
    code, _, err = _cli(capsys, "replay", str(two), "--device-index", "1", "--stream-uses", str(on_0))
    assert code == EXIT_USAGE and "the log's calls are on device(s) [0], the trace is of device 1" in err
    assert len(err.strip().splitlines()) == 1
    code, _, _ = _cli(capsys, "replay", str(two), "--stream-uses", str(on_0))   # the log's device picks device 0
    assert code == 0
    trace, report = load_trace_with_stream_uses(two, on_0)
    assert report.n_uses == 1
    with pytest.raises(TraceFormatError, match="no device 1"):
        load_trace_with_stream_uses(snap, on_1)


# -- review attacker 8 -----------------------------------------------------------------------------------------
T0 = 1_795_000_000_000_000
X_ADDR, Y_ADDR = 0x7F0000000000, 0x7F0000100000


def _steps(source: str = "pytorch-snapshot") -> Trace:
    """Ops 1 s apart: a0@X (stream 0), a1@Y (stream 5), f0, a2@X (X reused: the next step's block), f1, f2."""
    ops = [(0, 0, MiB, 0, T0, X_ADDR), (0, 1, MiB, 5, T0 + 1e6, Y_ADDR), (1, 0, MiB, 0, T0 + 2e6, X_ADDR),
           (0, 2, MiB, 0, T0 + 3e6, X_ADDR), (1, 1, MiB, 5, T0 + 4e6, Y_ADDR), (1, 2, MiB, 0, T0 + 5e6, X_ADDR)]
    return Trace.from_ops("s", source, ops)


def test_counts_offset_by_a_whole_step_are_not_trusted_against_the_calls_time(
        caplog: pytest.LogCaptureFixture) -> None:
    """Finding 1: record_stream(a0) at T0 + 1.5 s logged counts (3, 1) over base (0, 0) (the logger began a
    step before the history): they pass the trace's own check and put the call after op 3, on allocation 2,
    made 1.5 s after the call. The times say otherwise: placed by time (allocation 0), with a warning."""
    use = LoggedUse(0, X_ADDR, 5, float(T0 + 1_500_000), 3, 1)
    wait = LoggedWait(0, 5, 0, float(T0 + 1_500_000), 3, 1)
    with caplog.at_level("WARNING", logger="gpumem"):
        merged, report = merge_stream_uses(_steps(), RecordStreamLog((use,), {0: (0, 0)}, waits=(wait,)))
    assert [(u.at_op, u.alloc_id) for u in merged.stream_uses] == [(2, 0)]
    assert [w.at_op for w in merged.stream_waits] == [2]
    assert (report.n_by_count, report.n_by_time, report.n_waits_by_count, report.n_count_disagreed) == (0, 1, 0, 2)
    assert "2 call(s) placed by time, not by their allocator counts" in caplog.text
    assert "first: entry 0 (record_stream of 0x7f0000000000 on stream 5)" in caplog.text
    assert "2 call(s) whose counts disagreed with their times placed by time" in str(report)
    # the right counts agree with the time: placed by them, no warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpumem"):
        merged, report = merge_stream_uses(_steps(), RecordStreamLog((dataclasses.replace(use, n_allocs=2, n_frees=0),),
                                                                     {0: (0, 0)}))
    assert [(u.at_op, u.alloc_id) for u in merged.stream_uses] == [(2, 0)] and report.n_by_count == 1
    assert report.n_count_disagreed == 0 and "allocator counts" not in caplog.text
    # a trace of another clock (not a PyTorch snapshot's): the counts are all there is
    merged, report = merge_stream_uses(_steps("gpumem"), RecordStreamLog((use,), {0: (0, 0)}))
    assert [(u.at_op, u.alloc_id) for u in merged.stream_uses] == [(4, 2)] and report.n_by_count == 1


def test_a_shifted_count_whose_time_finds_no_block_is_refused_naming_the_time() -> None:
    """Placed by time, a call no allocation holds within TIME_TOLERANCE_US is refused as any other."""
    use = LoggedUse(0, X_ADDR, 5, float(T0 + 2_500_000), 3, 1)   # X between f0 and a2 by time
    with pytest.raises(TraceFormatError, match=r"entry 0: record_stream of 0x7f0000000000 on stream 5 \(time "):
        merge_stream_uses(_steps(), RecordStreamLog((use,), {0: (0, 0)}), where="run.jsonl")


@pytest.mark.parametrize("ptr", [0, 0x500000000000, Y_ADDR + MiB])
def test_a_call_pytorch_ignores_is_skipped_counted_and_warned(ptr: int, caplog: pytest.LogCaptureFixture) -> None:
    """Finding 4: a null pointer, or an address no allocation ever holds (foreign memory, a block from
    before the history): skipped, the other uses merged."""
    ok = LoggedUse(0, Y_ADDR, 0, float(T0 + 1_500_000), 2, 0)
    ignored = LoggedUse(0, ptr, 5, float(T0 + 1_600_000), 2, 0)
    with caplog.at_level("WARNING", logger="gpumem"):
        merged, report = merge_stream_uses(_steps(), RecordStreamLog((ok, ignored, ignored), {0: (0, 0)}))
    assert [(u.at_op, u.alloc_id) for u in merged.stream_uses] == [(2, 1)]
    assert report.n_skipped == 2 and "2 record_stream call(s) skipped (a null or foreign pointer)" in str(report)
    assert caplog.text.count("record_stream call(s) skipped") == 1
    assert f"first: entry 1, pointer {ptr:#x}" in caplog.text


def test_the_logger_does_not_log_a_null_pointer() -> None:
    torch = _torch()
    with RecordStreamLogger(torch, clock_ns=lambda: 5_000) as rs:
        empty = torch.Tensor(0)
        empty.record_stream(SimpleNamespace(cuda_stream=SIDE))
        torch.Tensor(A_ADDR).record_stream(SimpleNamespace(cuda_stream=SIDE))
    assert len(empty.calls) == 1                            # PyTorch got the call (and ignores it)
    assert [u.ptr for u in rs.log().uses] == [A_ADDR] and rs.log().n_unlogged == 0


def test_gpumem_replay_merges_around_a_null_and_a_foreign_use(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    snap, _ = _busy_side_stream(tmp_path)
    good = LoggedUse(0, A_ADDR, SIDE, 5.0, 1, 0)
    for ptr in (0, 0x500000000000):
        log = write_record_stream_log(_log(good, LoggedUse(0, ptr, SIDE, 6.0, 1, 0)), tmp_path / "l.jsonl")
        code, out, err = _cli(capsys, "replay", str(snap), "--policy", "pytorch", "--stream-uses", str(log))
        assert code == 0 and "stream uses    1 record_stream calls made" in out, err


def test_the_log_reader_is_bounded_by_max_memory_nbytes(tmp_path: Path) -> None:
    """Finding 5: uses counted at LOG_ENTRY_NBYTES each against TraceLimits.max_memory_nbytes."""
    from gpumem.trace.limits import TraceLimits
    from gpumem.trace.stream_log import LOG_ENTRY_NBYTES

    n = 2000
    path = write_record_stream_log(RecordStreamLog(tuple(LoggedUse(0, 0x1000 + k, 5, 1.0 + k, k, k) for k in range(n)),
                                                   {0: (0, 0)}), tmp_path / "big.jsonl")
    limits = TraceLimits(max_memory_nbytes=(n - 1) * LOG_ENTRY_NBYTES)
    with pytest.raises(TraceFormatError, match=rf"line {n + 1}: more than {n - 1:,} entries \(TraceLimits.max_memory_nbytes"):
        read_record_stream_log(path, limits=limits)
    assert len(read_record_stream_log(path, limits=TraceLimits(max_memory_nbytes=n * LOG_ENTRY_NBYTES)).uses) == n


@pytest.mark.parametrize("kwargs, message", [
    ({"uses": (LoggedUse(0, Y_ADDR, 0, 1015.0, 2, None),)}, r"uses\[0\]: n_allocs and n_frees must both be"),
    ({"uses": (LoggedUse(0, -5, 0, 1015.0),)}, r"uses\[0\]: ptr must be an integer in \[0, 2\*\*63\)"),
    ({"uses": (LoggedUse(0, 5, 2**70, 1015.0),)}, r"uses\[0\]: stream must be"),
    ({"uses": (LoggedUse(0, 5, 0, float("nan")),)}, r"uses\[0\]: time_us must be a finite number"),
    ({"uses": (LoggedUse(True, 5, 0, 1.0),)}, r"uses\[0\]: device must be"),
    ({"uses": [LoggedUse(0, 5, 0, 1.0)]}, r"uses must be a tuple"),
    ({"uses": ((0, 5, 0, 1.0, None, None),)}, r"uses\[0\]: expected a LoggedUse, not a tuple"),
    ({"waits": (LoggedWait(0, 5, -1, 1.0),)}, r"waits\[0\]: waited must be"),
    ({"base_counts": {0: ("0", "0")}}, "base_counts must map devices"),
    ({"base_counts": {-1: (0, 0)}}, "base_counts must map devices"),
    ({"base_counts": {0: (0, 2**64)}}, "base_counts must map devices"),
    ({"clock": "tsc"}, "clock must be 'unix_us'"),
    ({"n_unlogged": -1}, "n_unlogged must be an integer"),
])
def test_a_log_built_through_the_api_is_checked_as_the_reader_checks(kwargs: dict, message: str) -> None:
    """Finding 10: a bad field is InvalidArgumentError at construction (was a bare TypeError in the merge,
    or a file the reader refuses)."""
    with pytest.raises(InvalidArgumentError, match=message):
        RecordStreamLog(**kwargs)
    assert RecordStreamLog(base_counts={0: [1, 2]}).base_counts == {0: (1, 2)}


def test_a_block_ending_past_2_63_holds_its_interior_pointers() -> None:
    """Finding 11: the block's end was computed in int64 and wrapped negative."""
    import numpy as np

    a = 2**63 - 4096
    t = Trace("o", "pytorch-snapshot", np.array([0, 0, 1, 1], np.int8), np.array([0, 1, 0, 1]),
              np.array([8192, 512, 8192, 512]), np.array([0, 5, 0, 5]), np.array([1., 2, 3, 4]),
              np.array([a, 0x1000, a, 0x1000]))
    merged, _ = merge_stream_uses(t, RecordStreamLog((LoggedUse(0, a + 100, 5, 2.5, 2, 0),), {0: (0, 0)}))
    assert [(u.at_op, u.alloc_id) for u in merged.stream_uses] == [(2, 0)]
    # a negative address (a hand-built trace) whose block ends below 0 holds no pointer
    n = Trace.from_ops("neg", "gpumem", [(0, 0, 16, 5, 1.0, -64), (0, 1, 512, 5, 2.0, 0x1000), (1, 0, 16, 5, 3.0, -64)])
    assert merge_stream_uses(n, RecordStreamLog((LoggedUse(0, 0x1000, 5, 2.5, 2, 0),), {0: (0, 0)}))[1].n_uses == 1


def test_a_trace_name_with_escape_sequences_is_escaped_in_merge_messages() -> None:
    """Finding 12: a name from a file reaches the terminal escaped."""
    t = Trace.from_ops("\x1b[2Jevil\nfake", "gpumem", [(0, 0, 512, 0, 1.0, 0x1000), (1, 0, 512, 0, 2.0, 0x1000)])
    with pytest.raises(TraceFormatError) as err:
        merge_stream_uses(t, _log(LoggedUse(0, 0x1000, 99, 1.5, 1, 0)))
    assert "\\x1b[2Jevil\\x0afake" in str(err.value) and "\x1b" not in str(err.value)


def test_n_stream_uses_counts_no_use_after_the_last_op() -> None:
    """Review attacker 8: uses at at_op == n_ops were counted as made; StreamUsePlan never makes them."""
    import dataclasses as dc

    t = dc.replace(Trace.from_ops("two", "gpumem", [(0, 0, 4096, 0, 1.0, 0x1000), (0, 1, 4096, 5, 2.0, 0x2000)]),
                   stream_uses=(StreamUse(1, 0, 5, 1.5), StreamUse(2, 0, 5, 3.0), StreamUse(2, 1, 0, 3.0)))
    result = replay_trace(t, "sim:h200-141gb", "pytorch", progress=False)
    assert result.extra["n_stream_uses"] == 1


def test_gpumem_replay_prints_a_trace_name_escaped(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Review attacker 8: a .gmt header's name reached the terminal with its escape sequences."""
    h = {"format": "gpumem-trace", "version": 1, "name": "\x1b]0;pwned\x07\x1b[2J\x1b[31mEVIL\x1b[0m\nfake line",
         "source": "gpumem", "n_ops": 2, "n_allocs": 1, "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us"}
    path = tmp_path / "esc.gmt"
    path.write_text(json.dumps(h) + "\na 0 512 0 1 10000\nf 0 0 2\n")
    code, out, _ = _cli(capsys, "replay", str(path))
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert out.splitlines()[0] == "trace          \\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mEVIL\\x1b[0m\\x0afake line (2 ops, 1 allocations)"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_program(), st.integers(1, 3))
def test_counts_shifted_by_whole_steps_never_move_a_use_off_its_allocation(program: Any, k: int) -> None:
    """Finding 1 as a property: ops 10 ms apart, each call 5 ms after the op before it, the counts offset by
    k allocations and k frees (a logger started k steps before the history): every use lands on the
    allocation the program named (the counts pass the trace's check or not; where they do, the time
    disagrees, and the call is placed by time)."""
    entries, uses, truth = program
    entries = [dict(e, time_us=e["time_us"] * 1000.0) for e in entries]
    t = snapshot_to_trace({"segments": [], "device_traces": [entries]}, name="random")
    shifted = [LoggedUse(u.device, u.ptr, u.stream, (u.time_us - 5.0) * 1000.0 + 5000.0, u.n_allocs + k,
                         u.n_frees + k) for u in uses]
    merged, report = merge_stream_uses(t, _log(*shifted))
    assert sorted((u.at_op, u.alloc_id) for u in merged.stream_uses) == sorted(truth)
    assert report.n_by_count == 0
