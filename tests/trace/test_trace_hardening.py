"""The adversarial review of the untrusted-trace hardening (issue 6 point 10): what was still open.

1. memo references in a snapshot's ``segments`` (never walked) cost 8 bytes each: a memory budget;
2. an RMM log of millions of events kept in Python lists: compact columns and a memory budget;
3. special files (directory, FIFO, device, symlink loop) must be refused, never hang;
4. a truncated pickle must say it is truncated;
5. NaN/inf times, Unicode digits and underscores, ``"version": true``, negative RMM streams;
6. a forced format that the content contradicts.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from gpumem.errors import TraceFormatError
from gpumem.trace import TraceLimits, load_trace
from gpumem.trace.limits import DEFAULT_LIMITS, ENTRY_NBYTES
from gpumem.trace.pytorch import snapshot_to_trace
from gpumem.trace.safe_pickle import MAX_FRAME_NBYTES

from hostile import load_in_child, rmm_event_bomb, segments_memo_bomb_pickle

RMM_HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"
GMT_HEADER = {"format": "gpumem-trace", "version": 1, "name": "t", "source": "gpumem", "n_ops": 2,
              "n_allocs": 1, "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us"}


def snapshot(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"segments": [], "device_traces": [entries]}


def pair(**alloc: Any) -> list[dict[str, Any]]:
    a = {"action": "alloc", "addr": 0x1000, "size": 64, "stream": 0, "time_us": 1}
    a.update(alloc)
    return [a, dict(a, action="free_requested", time_us=2)]


# 1. memo references ---------------------------------------------------------------------------------------


def test_memory_budget_default_is_documented() -> None:
    assert DEFAULT_LIMITS.max_memory_nbytes == 4 * 2**30
    assert "max_memory_nbytes" in (TraceLimits.__doc__ or "")
    with pytest.raises(Exception, match="max_memory_nbytes"):
        TraceLimits(max_memory_nbytes=0)


def test_segments_memo_references_bounded_in_a_capped_child(tmp_path: Path) -> None:
    # half the review's file: 50 million references, 0.4 GB of peak RSS before the fix. Under a 128 MiB
    # memory budget (and no ratio cap) the child refuses it near the budget. In a fresh child: the budget
    # counts resident memory growth, which memory freed earlier in the same process would hide
    path = segments_memo_bomb_pickle(tmp_path / "refs.snapshot.pickle.gz", n_batches=100_000)
    outcomes, peak = load_in_child([path], address_space_nbytes=3 << 30,
                                   limits={"max_compression_ratio": 1e9, "max_memory_nbytes": 128 << 20})
    assert outcomes[0][0] == "TraceFormatError"
    assert "more than 134,217,728 bytes of memory (TraceLimits.max_memory_nbytes" in outcomes[0][1]
    assert peak < 256 << 20, f"peak RSS {peak / 2**20:.0f} MiB"


def test_pickle_frames_are_capped(tmp_path: Path) -> None:
    n = MAX_FRAME_NBYTES + 1
    body = b"(" + b"N" * (n - 3) + b"l."  # a list of Nones, in one over-long frame
    path = tmp_path / "frame.pickle"
    path.write_bytes(b"\x80\x04\x95" + n.to_bytes(8, "little") + body[:n])
    with pytest.raises(TraceFormatError, match="pickle frame at byte 2 holds"):
        load_trace(path, format="pytorch-snapshot")


def test_snapshot_entries_count_against_what_unpickling_left() -> None:
    entries = pair() * 1  # 2 entries
    limits = TraceLimits(max_memory_nbytes=10 * ENTRY_NBYTES)
    assert snapshot_to_trace(snapshot(entries), limits=limits).n_ops == 2
    with pytest.raises(TraceFormatError, match="TraceLimits.max_memory_nbytes.*taken by unpickling"):
        snapshot_to_trace(snapshot(pair()), limits=limits, memory_nbytes=9 * ENTRY_NBYTES)


def test_real_snapshot_loads_within_a_tight_budget(data_dir: Path) -> None:
    trace = load_trace(data_dir / "resnet_head.snapshot.pickle.gz", limits=TraceLimits(max_memory_nbytes=128 << 20))
    assert trace.n_allocs > 0


# 2. RMM events --------------------------------------------------------------------------------------------


def test_rmm_events_hit_the_memory_budget_as_they_are_read(tmp_path: Path) -> None:
    path = rmm_event_bomb(tmp_path / "events.csv.gz", n_events=20_000)
    limits = TraceLimits(max_compression_ratio=1e9, max_memory_nbytes=5_000 * ENTRY_NBYTES)
    with pytest.raises(TraceFormatError, match=r"line 5002: more than 5,000 events \(TraceLimits.max_memory_nbytes"):
        load_trace(path, limits=limits)
    assert load_trace(path, limits=TraceLimits(max_compression_ratio=1e9)).n_ops == 20_000


def test_native_ops_hit_the_memory_budget(tmp_path: Path) -> None:
    lines = [json.dumps(dict(GMT_HEADER, n_ops=200, n_allocs=100))]
    for i in range(100):
        lines += [f"a {i} 8 0 {2 * i} {0x1000 * (i + 1):x}", f"f {i} 0 {2 * i + 1}"]
    path = tmp_path / "t.gmt"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=r"more than 50 ops \(TraceLimits.max_memory_nbytes"):
        load_trace(path, limits=TraceLimits(max_memory_nbytes=50 * ENTRY_NBYTES))


def test_rmm_peak_memory_per_event_is_within_entry_nbytes(tmp_path: Path) -> None:
    n = 300_000
    path = rmm_event_bomb(tmp_path / "events.csv.gz", n_events=n)
    small = rmm_event_bomb(tmp_path / "small.csv.gz", n_events=2)
    outcomes, peak = load_in_child([path], limits={"max_compression_ratio": 1e9})
    assert outcomes == [["trace", n]]
    _, base = load_in_child([small], limits={"max_compression_ratio": 1e9})
    assert peak - base < n * ENTRY_NBYTES, f"{(peak - base) / n:.0f} bytes per event"


# 3. special files -----------------------------------------------------------------------------------------


def load_with_deadline(path: Path, **kwargs: Any) -> BaseException | None:
    """Load in a thread; fail if it has not finished in 10 s (a FIFO open would block forever)."""
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            load_trace(path, **kwargs)
            result.append(None)
        except BaseException as e:  # noqa: BLE001
            result.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), f"loading {path} hangs"
    return result[0]


@pytest.mark.parametrize("fmt", [None, "rmm-log", "pytorch-snapshot", "gpumem"])
def test_special_files_are_refused(tmp_path: Path, fmt: str | None) -> None:
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.csv"
    loop.symlink_to(tmp_path / "loop.csv")
    cases = {tmp_path: "is a directory", fifo: r"is not a regular file \(a FIFO",
             loop: "symbolic link loop", Path("/dev/zero"): r"is not a regular file \(a character device"}
    for path, message in cases.items():
        err = load_with_deadline(path, format=fmt)
        assert isinstance(err, TraceFormatError), (path, err)
        assert str(path) in str(err)
        assert re.search(message, str(err)), str(err)
    dangling = tmp_path / "dangling.csv"
    dangling.symlink_to(tmp_path / "missing.csv")
    assert isinstance(load_with_deadline(dangling, format=fmt), FileNotFoundError)


# 4. truncated pickle --------------------------------------------------------------------------------------


def test_truncated_pickle_says_truncated(tmp_path: Path) -> None:
    data = pickle.dumps(snapshot(pair(frames=["x" * 100])), protocol=4)
    path = tmp_path / "cut.pickle"
    path.write_bytes(data[:110])
    with pytest.raises(TraceFormatError, match=r"truncated\): the opcode at byte \d+ declares [\d,]+ bytes, which "
                                               r"run past the end of the file \(110 bytes\)"):
        load_trace(path)


# 5. numbers -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [float("nan"), float("inf"), float("-inf")])
def test_snapshot_non_finite_time_is_refused(tmp_path: Path, t: float) -> None:
    path = tmp_path / "t.pickle"
    entries = pair() + pair(addr=0x2000, time_us=t)
    path.write_bytes(pickle.dumps(snapshot(entries), protocol=4))
    with pytest.raises(TraceFormatError, match=r"entry 2.*'time_us' is not finite|'time_us' is not finite.*entry 2"):
        load_trace(path)


@pytest.mark.parametrize("line, message", [
    ("0,21:50:47.674565,allocate,0x10,\u0661\u0662,0", "size '\u0661\u0662' is not an integer"),
    ("0,21:50:47.674565,allocate,0x10,1_0,0", "size '1_0' is not an integer"),
    ("0,21:50:47.674565,allocate,0x1_0,8,0", "pointer '0x1_0' is not a hexadecimal integer"),
    ("0,21:50:47.674565,allocate,0x10,8,\u0661", "stream '\u0661' is not an integer"),
    ("0,\u0662\u0661:50:47.674565,allocate,0x10,8,0", "is not HH:MM:SS"),
    ("0,21:50:47.6745_5,allocate,0x10,8,0", "is not HH:MM:SS"),
    ("0,21:50:47.674565,allocate,0x10,8,-1", "negative stream -1"),
])
def test_rmm_numbers(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(RMM_HEADER + line + "\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match="line 2: .*" + message.replace("(", r"\(")):
        load_trace(path)


@pytest.mark.parametrize("op, message", [
    ("a 0 \u0661\u0662 0 1 1000", "size '\u0661\u0662' is not an integer"),
    ("a 0 1_0 0 1 1000", "size '1_0' is not an integer"),
    ("a 0 8 0 1_0 1000", "time_us '1_0' is not a number"),
    ("a 0 8 0 \u0661 1000", "time_us '\u0661' is not a number"),
    ("a 0 8 0 1 10_00", "addr '10_00' is not a hexadecimal integer"),
    ("a 0 8 1_0 1 1000", "stream '1_0' is not an integer"),
])
def test_native_numbers(tmp_path: Path, op: str, message: str) -> None:
    path = tmp_path / "bad.gmt"
    path.write_text(json.dumps(GMT_HEADER) + "\n" + op + "\nf 0 0 2\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match="line 2: " + message):
        load_trace(path)


def test_native_version_true_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.gmt"
    path.write_text(json.dumps(dict(GMT_HEADER, version=True)) + "\na 0 8 0 1 1000\nf 0 0 2\n")
    with pytest.raises(TraceFormatError, match="line 1: unsupported gpumem-trace version True"):
        load_trace(path)
    path.write_text(json.dumps(GMT_HEADER) + "\na 0 8 0 1.5e3 1000\nf 0 0 inf\n")
    assert load_trace(path).n_ops == 2  # plain ASCII floats, inf included, still read


# 6. forced formats ----------------------------------------------------------------------------------------


def test_forced_snapshot_on_gzipped_csv(tmp_path: Path) -> None:
    path = tmp_path / "log.pickle.gz"
    path.write_bytes(gzip.compress((RMM_HEADER + "0,21:50:47.674565,allocate,0x10,8,0\n").encode()))
    with pytest.raises(TraceFormatError,
                       match=r"this file does not look like a PyTorch snapshot \(it starts like an RMM log\)"):
        load_trace(path, format="pytorch-snapshot")
