"""Untrusted trace files: the attacks measured in issue 6, each refused with a bounded cost.

Bombs run in a child process whose address space is capped (``RLIMIT_AS``), so a
regression fails with a ``MemoryError`` (or a crash) instead of taking the
machine's memory; the child reports its peak resident memory, which is checked
too. Everything else runs in process.
"""

from __future__ import annotations

import copyreg
import gzip
import json
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest

from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.trace import DEFAULT_LIMITS, TraceLimits, load_trace, read_gmt_trace, read_rmm_log, save_trace
from gpumem.trace._fileio import open_binary
from gpumem.trace.limits import shorten
from hostile import (
    load_in_child,
    memo_bomb_pickle,
    nested_tuple_key_pickle,
    rmm_blank_lines_bomb,
    rmm_long_line_bomb,
)

MiB = 2**20
GOOD = {"action": "alloc", "addr": 0x1000, "size": 64, "stream": 0, "time_us": 1}
RMM_HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"
GMT_HEADER = {"format": "gpumem-trace", "version": 1, "name": "n", "source": "gpumem", "n_ops": 2, "n_allocs": 1,
              "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us"}


def snapshot(entries: list[Any], **extra: Any) -> dict[str, Any]:
    return {"segments": [], "device_traces": [entries], **extra}


def pair(addr: int = 0x1000, **alloc: Any) -> list[dict[str, Any]]:
    return [dict(GOOD, addr=addr, **alloc), dict(GOOD, action="free_requested", addr=addr, time_us=2)]


def write_pickle(path: Path, obj: Any) -> Path:
    data = pickle.dumps(obj, protocol=4)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


# -- the measured bombs, in a memory-capped child --------------------------------------


def test_bombs_are_refused_in_bounded_memory(tmp_path: Path) -> None:
    memo = memo_bomb_pickle(tmp_path / "memo.snapshot.pickle.gz")  # ~330 KB -> 200 MB of pickle, 1e8 entries
    long_line = rmm_long_line_bomb(tmp_path / "long.rmm_log.csv.gz")  # 7.8 MB -> a 7.8 GiB line
    tuples = nested_tuple_key_pickle(tmp_path / "tuple.pickle.gz")  # a dict key nested 1e6 deep
    assert memo.stat().st_size < 400_000 and long_line.stat().st_size < 9_000_000
    outcomes, peak_rss = load_in_child([memo, long_line, tuples], address_space_nbytes=3 << 30)
    kinds = [o[0] for o in outcomes]
    assert kinds == ["TraceFormatError"] * 3, outcomes
    assert "max_compression_ratio" in outcomes[0][1]
    assert "line 2: longer than 1,048,576 bytes" in outcomes[1][1]
    assert "max_pickle_tuples" in outcomes[2][1]
    assert all(o[2] < 400 for o in outcomes)  # no message echoes the bomb
    assert peak_rss < 400 * MiB, f"peak RSS {peak_rss / MiB:.0f} MiB"


def test_uncompressed_memo_references_are_not_walked(tmp_path: Path) -> None:
    # 4 MB of BINGET opcodes: 2 million entries that are all the same dict
    path = memo_bomb_pickle(tmp_path / "memo.snapshot.pickle", n_batches=2000, gz=False)
    with pytest.raises(TraceFormatError, match="repeat the same objects"):
        load_trace(path)


def test_blank_line_bomb_hits_the_ratio_cap(tmp_path: Path) -> None:
    path = rmm_blank_lines_bomb(tmp_path / "blank.rmm_log.csv.gz", n_mib=8)
    with pytest.raises(TraceFormatError, match="max_compression_ratio"):
        load_trace(path, limits=TraceLimits(ratio_floor_nbytes=MiB))
    assert load_trace(path).n_ops == 1  # 8 MiB is under the default floor: a genuine (odd) file still reads


def test_decompressed_size_cap_applies_to_plain_files(tmp_path: Path) -> None:
    path = tmp_path / "big.rmm_log.csv"
    lines = [f"1,21:50:47.{i:06d},allocate,{0x1000 * (i + 1):#x},8,0\n" for i in range(20_000)]
    path.write_text(RMM_HEADER + "".join(lines))
    assert load_trace(path).n_ops == 20_000
    with pytest.raises(TraceFormatError, match="more than 65,536 bytes of content"):
        load_trace(path, limits=TraceLimits(max_decompressed_nbytes=65_536))


# -- numbers out of range ------------------------------------------------------------


@pytest.mark.parametrize("field, value, message", [
    ("time_us", 2**1024, "'time_us' \\(an integer of 1,025 bits\\) is out of range"),
    ("time_us", -(2**70), "'time_us' .* is out of range"),
    ("size", 2**100_000, "'size' \\(an integer of 100,001 bits\\) does not fit in 64 bits"),
    ("addr", -(2**100_000), "negative 'addr' \\(an integer of 100,001 bits\\)"),
    ("stream", 2**64, "'stream' .* does not fit in 64 bits"),
], ids=["time_2**1024", "time_-2**70", "size_2**100000", "addr_-2**100000", "stream_2**64"])
def test_snapshot_numbers_out_of_range_name_the_entry(tmp_path: Path, field: str, value: int, message: str) -> None:
    entries = pair(0x1000) + pair(0x2000)
    entries[2] = dict(entries[2], **{field: value})
    path = write_pickle(tmp_path / "big.snapshot.pickle", snapshot(entries))
    with pytest.raises(TraceFormatError, match=message) as err:
        load_trace(path)
    assert err.value.entry == 2 and len(str(err.value)) < 300


@pytest.mark.parametrize("line, message", [
    ("1,21:50:47.674565,allocate,0x10,99999999999999999999,0", "size 99999999999999999999 does not fit in 64 bits"),
    ("1,21:50:47.674565,allocate,0x10," + "9" * 5000 + ",0", "size '9999.*\\(5,000 chars\\) is not a 64-bit integer"),
    ("1,21:50:47.674565,allocate,0x1" + "0" * 17 + ",8,0", "pointer .* does not fit in 64 bits"),
    ("1,21:50:47.674565,allocate,0x10,8,-0x8000000000000000", "stream .* does not fit in 64 bits"),
    ("1,9" * 3000 + ":00:00,allocate,0x10,8,0", "line 2: 3005 fields"),
    ("1,99999999999:00:00.0,allocate,0x10,8,0", "not HH:MM:SS"),
])
def test_rmm_numbers_out_of_range(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "n.csv"
    path.write_text(RMM_HEADER + line + "\n")
    with pytest.raises(TraceFormatError, match=message) as err:
        read_rmm_log(path)
    assert len(str(err.value)) < 300


@pytest.mark.parametrize("ops, message", [
    ("a 0 9223372036854775808 0 0 10\nf 0 0 1", "line 2: size 9223372036854775808 out of range"),
    ("a 0 8 0 0 " + "f" * 17 + "\nf 0 0 1", "line 2: addr 295147905179352825855 out of range"),
    ("a 0 8 " + "7" * 30 + " 0 10\nf 0 0 1", "line 2: stream .* is not a 64-bit integer"),
    ("a 0 8 0 " + "1" * 400 + " 10\nf 0 0 1", None),  # a float time: huge but finite-or-inf, still a trace
    ("a " + "1" * 5000 + " 8 0 0 10\nf 0 0 1", "line 2: alloc id '1111.*\\(5,000 chars\\)"),
])
def test_native_numbers_out_of_range(tmp_path: Path, ops: str, message: str | None) -> None:
    path = tmp_path / "n.gmt"
    path.write_text(json.dumps(GMT_HEADER) + "\n" + ops + "\n")
    if message is None:
        assert read_gmt_trace(path).n_ops == 2
        return
    with pytest.raises(TraceFormatError, match=message) as err:
        read_gmt_trace(path)
    assert len(str(err.value)) < 300


def test_native_header_counts_must_fit_64_bits(tmp_path: Path) -> None:
    path = tmp_path / "h.gmt"
    path.write_text(json.dumps(dict(GMT_HEADER, n_ops=2**64)) + "\na 0 8 0 0 10\nf 0 0 1\n")
    with pytest.raises(TraceFormatError, match="'n_ops' must be a non-negative 64-bit integer"):
        read_gmt_trace(path)


# -- nesting -------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [65, 100_000])
def test_deeply_nested_native_header_is_refused(tmp_path: Path, depth: int) -> None:
    header = json.dumps(GMT_HEADER)[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
    path = tmp_path / "deep.gmt"
    path.write_text(header + "\na 0 8 0 0 10\nf 0 0 1\n")
    with pytest.raises(TraceFormatError, match=f"line 1: header nests {depth + 1} levels deep"):
        read_gmt_trace(path)


def test_brackets_inside_header_strings_do_not_count(tmp_path: Path) -> None:
    header = dict(GMT_HEADER, name="[" * 500 + '"{')
    path = tmp_path / "brackets.gmt"
    path.write_text(json.dumps(header) + "\na 0 8 0 0 10\nf 0 0 1\n")
    assert read_gmt_trace(path).name == header["name"]


def test_deep_lists_in_a_snapshot_are_harmless(tmp_path: Path) -> None:
    # lists cannot be hashed, so nesting them 100,000 deep costs only memory, which the other limits bound
    depth = 100_000
    traces = pickle.dumps([pair()], protocol=2)[2:-1]  # without PROTO and STOP
    data = (b"\x80\x02}(\x8c\x05extra" + b"]" * depth + b"a" * (depth - 1)
            + b"\x8c\x0ddevice_traces" + traces + b"u.")
    path = tmp_path / "deep.snapshot.pickle"
    path.write_bytes(data)
    assert load_trace(path).n_ops == 2


# -- what error messages quote --------------------------------------------------------


def test_messages_quote_a_short_prefix(tmp_path: Path) -> None:
    huge = "x" * 2_000_000
    cases = []
    p = write_pickle(tmp_path / "action.snapshot.pickle", snapshot([dict(GOOD, action=huge)]))
    cases.append(p)
    p = tmp_path / "action.csv"
    p.write_text(RMM_HEADER + "1,21:50:47.674565," + "y" * 500_000 + ",0x10,8,0\n")
    cases.append(p)
    p = tmp_path / "line.gmt"
    p.write_text(json.dumps(dict(GMT_HEADER, n_ops=1)) + "\n" + "z" * 500_000 + "\n")
    cases.append(p)
    p = tmp_path / "global.pickle"
    p.write_bytes(b"\x80\x04\x8c" + bytes([200]) + b"m" * 200 + b"X" + struct.pack("<I", 10**6) + b"n" * 10**6 + b"\x93.")
    cases.append(p)
    p = tmp_path / "format.gmt"
    p.write_text("{}")
    for path in cases:
        with pytest.raises(TraceFormatError) as err:
            load_trace(path)
        assert len(str(err.value)) < 400, str(err.value)[:500]
    with pytest.raises(TraceFormatError) as err:
        load_trace(p, format="q" * 10_000)
    assert len(str(err.value)) < 400


def test_shorten() -> None:
    assert shorten("abc") == "'abc'"
    assert shorten("a" * 100) == repr("a" * 80) + "... (100 chars)"
    assert shorten(b"\x00" * 81).endswith("... (81 bytes)")
    assert shorten(2**1024) == "an integer of 1,025 bits" and shorten(-5) == "-5"
    assert shorten([1, 2]) == "a list" and shorten(1.5) == "1.5"


# -- the restricted unpickler ----------------------------------------------------------


class _Marker:
    """A class copyreg can name by an extension code (a stand-in for os.system)."""

    def __init__(self, *args: Any) -> None:
        raise AssertionError("the loader called an object named by an extension code")


def test_extension_codes_are_refused_even_when_cached(tmp_path: Path) -> None:
    code = 0x7FFFFF00
    copyreg.add_extension(__name__, "_Marker", code)
    try:
        # a trusted unpickling elsewhere in the process resolves the code: copyreg caches _Marker
        assert pickle.loads(pickle.dumps(_Marker, protocol=2)) is _Marker
        assert copyreg._extension_cache.get(code) is _Marker  # type: ignore[attr-defined]
        evil = b"\x80\x02\x84" + struct.pack("<i", code) + b")R."  # EXT4 code, empty tuple, REDUCE: _Marker()
        for suffix in (".pickle", ".pickle.gz"):
            path = tmp_path / f"ext{suffix}"
            path.write_bytes(gzip.compress(evil) if suffix.endswith(".gz") else evil)
            with pytest.raises(TraceFormatError, match="extension code"):
                load_trace(path)
        for op in (b"\x82\x01", b"\x83\x01\x00", b"\x84\x01\x00\x00\x00"):
            path = tmp_path / "ext.pickle"
            path.write_bytes(b"\x80\x04" + op + b".")
            with pytest.raises(TraceFormatError, match="EXT opcode at byte 2"):
                load_trace(path)
    finally:
        copyreg.remove_extension(__name__, "_Marker", code)
        copyreg._extension_cache.pop(code, None)  # type: ignore[attr-defined]


def test_a_real_snapshot_has_few_tuples_and_the_tuple_cap_is_configurable(tmp_path: Path) -> None:
    entries = [dict(GOOD, frames=[("f.py", i)]) for i in range(1)] + pair(0x2000)
    entries[0]["addr"] = 0x3000
    path = write_pickle(tmp_path / "tuples.snapshot.pickle", snapshot(entries, extra=[(i,) for i in range(50)]))
    assert load_trace(path).n_allocs == 2
    with pytest.raises(TraceFormatError, match="more than 10 tuples"):
        load_trace(path, limits=TraceLimits(max_pickle_tuples=10))


def test_object_cap(tmp_path: Path) -> None:
    entries = [e for i in range(2000) for e in pair(0x1000 * (i + 1))]
    path = write_pickle(tmp_path / "many.snapshot.pickle", snapshot(entries))
    assert load_trace(path).n_ops == 4000
    with pytest.raises(TraceFormatError, match="more than 1,000 objects"):
        load_trace(path, limits=TraceLimits(max_objects=1000))


# -- configurable limits ----------------------------------------------------------------


def test_entry_caps_for_every_format(tmp_path: Path) -> None:
    from gpumem.trace import Trace

    trace = Trace.from_ops("t", "gpumem", [(0, i, 8, 0, float(i), 0x1000 * (i + 1)) for i in range(10)])
    gmt = save_trace(trace, tmp_path / "t.gmt")
    csv = tmp_path / "t.csv"
    csv.write_text(RMM_HEADER + "".join(f"1,21:50:47.{i:06d},allocate,{0x1000 * (i + 1):#x},8,0\n" for i in range(10)))
    snap = write_pickle(tmp_path / "t.snapshot.pickle.gz", snapshot([dict(GOOD, addr=0x1000 * (i + 1)) for i in range(10)]))
    small = TraceLimits(max_entries=9)
    for path in (gmt, csv, snap):
        assert load_trace(path).n_ops == 10
        with pytest.raises(TraceFormatError, match="more than 9 .*TraceLimits.max_entries"):
            load_trace(path, limits=small)
        assert load_trace(path, limits=TraceLimits(max_entries=10)).n_ops == 10


def test_line_cap_is_configurable(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(RMM_HEADER + "1,21:50:47.674565,allocate,0x10,8,0\n")
    assert load_trace(path).n_ops == 1
    with pytest.raises(TraceFormatError, match="line 1: longer than 20 bytes"):
        load_trace(path, limits=TraceLimits(max_line_nbytes=20))


def test_device_count_cap(tmp_path: Path) -> None:
    path = write_pickle(tmp_path / "devs.snapshot.pickle", {"device_traces": [[]] * 5000})
    with pytest.raises(TraceFormatError, match="5,000 devices"):
        load_trace(path)


@pytest.mark.parametrize("bad", [
    {"max_entries": 0}, {"max_entries": 1.5}, {"max_line_nbytes": -1}, {"max_compression_ratio": 0.5},
    {"max_compression_ratio": float("nan")}, {"max_objects": True},
])
def test_limits_are_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match="TraceLimits"):
        TraceLimits(**bad)


def test_default_limits_admit_the_shipped_traces(data_dir: Path) -> None:
    assert DEFAULT_LIMITS == TraceLimits()
    for path in sorted(data_dir.glob("*.gz")):
        assert load_trace(path, limits=DEFAULT_LIMITS).n_ops == 2000


# -- empty traces, format= and device= ----------------------------------------------------


@pytest.mark.parametrize("name, content", [
    ("frees_only.snapshot.pickle", None),
    ("header_only.csv", RMM_HEADER),
    ("failures_only.csv", RMM_HEADER + "1,21:50:47.674565,allocate failure,0x0,8,0\n"),
    ("zero.gmt", json.dumps(dict(GMT_HEADER, n_ops=0, n_allocs=0)) + "\n"),
])
def test_a_trace_without_allocations_is_an_error(tmp_path: Path, name: str, content: str | None) -> None:
    path = tmp_path / name
    if content is None:
        write_pickle(path, snapshot([dict(GOOD, action="free_requested")]))
    else:
        path.write_text(content)
    with pytest.raises(TraceFormatError, match="no allocations"):
        load_trace(path)


def test_format_forces_a_reader(tmp_path: Path) -> None:
    path = tmp_path / "trace.bin"
    path.write_text(RMM_HEADER + "1,21:50:47.674565,allocate,0x10,8,0\n")
    assert load_trace(path, format="rmm").source == "rmm-log"
    with pytest.raises(TraceFormatError, match=r"does not look like a gpumem \.gmt trace \(it starts like an RMM log\)"):
        load_trace(path, format="gpumem")
    with pytest.raises(TraceFormatError, match=r"does not look like a PyTorch snapshot \(it starts like an RMM log\)"):
        load_trace(path, format="pytorch-snapshot")
    other = tmp_path / "other.bin"
    other.write_text("hello,world\n")
    with pytest.raises(TraceFormatError, match=r"does not look like a PyTorch snapshot \(it does not start"):
        load_trace(other, format="pytorch-snapshot")
    with pytest.raises(TraceFormatError, match="not a gpumem-trace header"):  # unrecognised: the reader explains
        load_trace(other, format="gpumem")
    with pytest.raises(TraceFormatError, match="device=1 applies to PyTorch snapshots only"):
        load_trace(path, device=1)


def test_device_picks_one_gpu_of_several(tmp_path: Path) -> None:
    path = write_pickle(tmp_path / "two.snapshot.pickle", {"device_traces": [pair(0x10), pair(0x20) + pair(0x30)]})
    assert load_trace(path, device=1).n_ops == 4
    with pytest.raises(TraceFormatError, match=r"devices \[0, 1\] all have traces: pass device= \(the command line's "
                                               r"--device-index\)"):
        load_trace(path)
    with pytest.raises(TraceFormatError, match="device must be an int"):
        load_trace(path, device="1")  # type: ignore[arg-type]


# -- progress while loading -----------------------------------------------------------------


class RecordingBar:
    def __init__(self) -> None:
        self.steps: list[float] = []
        self.closed = False

    def update(self, n: float = 1) -> None:
        self.steps.append(n)

    def close(self) -> None:
        self.closed = True


def test_loading_reports_the_compressed_bytes_read(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    import gpumem.trace._fileio as fileio

    bars: list[tuple[Any, ...]] = []

    def fake_progress(total: int, desc: str, unit: str, *, enabled: bool | None = None) -> RecordingBar:
        bar = RecordingBar()
        bars.append((total, desc, unit, enabled, bar))
        return bar

    monkeypatch.setattr(fileio, "progress_bar", fake_progress)
    path = data_dir / "resnet_head.snapshot.pickle.gz"
    load_trace(path, progress=True)
    [(total, desc, unit, enabled, bar)] = [b for b in bars if b[3] is True]
    assert total == path.stat().st_size and unit == "B" and desc == f"load {path.name}"
    assert sum(bar.steps) == total and len(bar.steps) > 1 and bar.closed


def test_progress_bar_is_off_when_not_a_terminal(capsys: pytest.CaptureFixture[str], data_dir: Path) -> None:
    from gpumem.progress import NoProgress, progress

    assert isinstance(progress(10, "x"), NoProgress)  # stderr is captured: not a terminal
    load_trace(data_dir / "resnet_head.rmm_log.csv.gz")
    assert capsys.readouterr().err == ""


def test_open_binary_closes_the_file_on_error(tmp_path: Path) -> None:
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(b"a" * 100_000))
    with pytest.raises(TraceFormatError, match="more than 1,000 bytes"):
        with open_binary(path, limits=TraceLimits(max_decompressed_nbytes=1000)) as f:
            f.read()
    assert os.path.exists(path)


def test_progress_draws_with_tqdm_on_a_terminal() -> None:
    import io

    from gpumem.progress import NoProgress, ProgressBar, progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    bar = progress(4 * MiB, "load x", "B", stream=out, delay_s=0)
    assert not isinstance(bar, NoProgress) and type(bar).__module__.startswith("tqdm")
    bar.update(MiB)
    bar.close()
    assert "load x" in out.getvalue() and "4.00M" in out.getvalue()
    assert isinstance(progress(10, "x", stream=out, enabled=False), NoProgress)
    replay_bar = ProgressBar(100, "replay t", stream=out, delay_s=0)
    replay_bar.update(40)
    replay_bar.update(30)  # absolute counts never move the bar back
    assert replay_bar._bar.n == 40
    replay_bar.close(100)
    assert replay_bar._bar.n == 100


def test_a_reader_bug_still_surfaces_as_a_format_error(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    import gpumem.trace.io as trace_io

    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("x" * 10_000)

    monkeypatch.setattr(trace_io, "read_rmm_log", broken)
    with pytest.raises(TraceFormatError, match="unexpected reader failure \\(KeyError: ") as err:
        load_trace(data_dir / "resnet_head.rmm_log.csv.gz")
    assert len(str(err.value)) < 400 and isinstance(err.value.__cause__, KeyError)


def test_gmt_stream_uses_and_waits_are_budgeted_at_their_own_size(tmp_path: Path) -> None:
    """Review attacker 8: a ``w`` line with 63-bit stream ids takes about 209 bytes (resident), a ``u`` line
    about 161; they were counted at ENTRY_NBYTES (160), so a file of waits reached 1.3 times the cap."""
    import json

    from gpumem.trace.gmt import STREAM_ENTRY_NBYTES, read_gmt_trace
    from gpumem.trace.limits import ENTRY_NBYTES

    n = 50
    header = {"format": "gpumem-trace", "version": 3, "name": "w", "source": "gpumem", "n_ops": 1, "n_allocs": 1,
              "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us", "n_stream_uses": 0,
              "n_stream_waits": n}
    path = tmp_path / "w.gmt"
    path.write_text(json.dumps(header) + "\na 0 512 0 1 1000\n"
                    + "".join(f"w {2**62 + k} {2**62 + k + 1} 1000.5\n" for k in range(n)))
    fits = ENTRY_NBYTES + n * STREAM_ENTRY_NBYTES
    assert len(read_gmt_trace(path, limits=TraceLimits(max_memory_nbytes=fits)).stream_waits) == n
    with pytest.raises(TraceFormatError, match=rf"line {n + 2}: more entries than the limits admit "
                                               r"\(TraceLimits.max_memory_nbytes: .* 50 stream uses, waits and plan events"):
        read_gmt_trace(path, limits=TraceLimits(max_memory_nbytes=fits - 1))
    with pytest.raises(TraceFormatError, match=r"w.gmt: line 3: more entries than the limits admit "
                                               r"\(TraceLimits.max_entries\); raise"):
        read_gmt_trace(path, limits=TraceLimits(max_entries=1))
