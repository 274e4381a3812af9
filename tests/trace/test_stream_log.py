"""record_stream logged beside a PyTorch snapshot (gpumem.trace.stream_log): the logger (a stand-in torch,
no GPU), the log file, the merge into the snapshot's trace (placement, bad input) and what a replay makes of
it (a block used on a busy stream is held longer, under PyTorch's allocator model too)."""

from __future__ import annotations

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
from gpumem.trace.stream_log import (LoggedUse, LoggedWait, RecordStreamLog, RecordStreamLogger, load_trace_with_stream_uses,

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
    # counts from a history that began later than the log (base wrong): op 3 + 1 = 4 holds 3 allocations,
    # not 4, so the counts are not used
    merged, report = merge_stream_uses(_trace(), _log(USE_A, base=(-1, 0)))
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
    (LoggedUse(0, 0xDEAD000, SIDE, 115.0, 2, 0), "no allocation of two streams holds that address"),
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
    bad = write_record_stream_log(_log(LoggedUse(0, 0xDEAD000, SIDE, 5.0, 1, 0)), tmp_path / "bad.jsonl")
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
    assert code == 0 and "change nothing in this replay" in caplog.text and "1 stream use(s)" in caplog.text
