"""Hostile and broken inputs: every one raises TraceFormatError naming the file (and entry or line).

Loading a pickle must never run code: the malicious pickles here would run
``touch <marker>`` under plain ``pickle.load``; the test checks the marker is
never created.
"""

from __future__ import annotations

import gzip
import os
import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest

from gpumem.errors import TraceFormatError
from gpumem.trace import load_trace, read_gmt_trace, read_pytorch_snapshot, read_rmm_log

GOOD_ENTRY = {"action": "alloc", "addr": 0x1000, "size": 64, "stream": 0, "time_us": 1, "frames": []}


def entries(n: int = 6) -> list[dict[str, Any]]:
    """``n`` well-formed entries: alternating alloc / free_requested at distinct addresses."""
    out = []
    for i in range(n // 2):
        out.append(dict(GOOD_ENTRY, addr=0x1000 * (i + 1), time_us=2 * i))
        out.append(dict(GOOD_ENTRY, action="free_requested", addr=0x1000 * (i + 1), time_us=2 * i + 1))
    return out


def write_pickle(path: Path, obj: Any = None, *, raw: bytes | None = None) -> Path:
    data = raw if raw is not None else pickle.dumps(obj, protocol=4)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def assert_names(err: pytest.ExceptionInfo[TraceFormatError], path: Path, entry: int | None = None) -> None:
    assert path.name in str(err.value)
    if entry is not None:
        assert err.value.entry == entry and f"entry {entry}" in str(err.value)


# -- code execution ---------------------------------------------------------------


class RunsShell:
    """Unpickling this with plain pickle would call os.system(command)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def globals_referenced(data: bytes) -> list[str]:
    """The ``module name`` pairs a pickle imports (read with pickletools, without executing anything)."""
    found, strings = [], []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.append(" ".join(strings[-2:]))
        elif op.name == "GLOBAL":
            found.append(arg)
    return found


@pytest.mark.parametrize("suffix", [".pickle", ".pickle.gz"])
@pytest.mark.parametrize("nested", [False, True])
def test_pickle_calling_os_system_is_refused_and_not_run(tmp_path: Path, suffix: str, nested: bool) -> None:
    marker = tmp_path / "pwned"
    evil = RunsShell(f"touch {marker}")
    payload = {"segments": [], "device_traces": [[dict(GOOD_ENTRY, addr=evil)]]} if nested else evil
    data = pickle.dumps(payload, protocol=4)
    assert any("system" in g for g in globals_referenced(data))  # it really is an os.system pickle
    path = write_pickle(tmp_path / f"evil{suffix}", raw=data)
    with pytest.raises(TraceFormatError, match="forbidden global") as err:
        load_trace(path)
    assert_names(err, path)
    assert "system" in str(err.value)
    assert not marker.exists()


def test_protocol_0_global_eval_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = f"cbuiltins\neval\n(V__import__('os').system('touch {marker}')\ntR.".encode()
    path = write_pickle(tmp_path / "evil.pkl", raw=data)
    with pytest.raises(TraceFormatError, match="builtins.eval") as err:
        load_trace(path)
    assert_names(err, path)
    assert not marker.exists()


def test_harmless_looking_globals_are_refused_too(tmp_path: Path) -> None:
    import collections

    path = write_pickle(tmp_path / "od.pickle", collections.OrderedDict(device_traces=[[]]))
    with pytest.raises(TraceFormatError, match="forbidden global collections.OrderedDict"):
        load_trace(path)


def test_persistent_ids_are_refused(tmp_path: Path) -> None:
    path = write_pickle(tmp_path / "pid.pickle", raw=b"Pabc\n.")  # PERSID opcode: asks persistent_load("abc")
    with pytest.raises(TraceFormatError, match="persistent ids") as err:
        read_pytorch_snapshot(path)
    assert_names(err, path)


# -- truncated and corrupt files ----------------------------------------------------


def test_truncated_gz_pickle(tmp_path: Path, data_dir: Path) -> None:
    whole = (data_dir / "resnet_head.snapshot.pickle.gz").read_bytes()
    path = tmp_path / "cut.snapshot.pickle.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceFormatError, match="truncated or corrupt|not a readable pickle") as err:
        load_trace(path)
    assert_names(err, path)


def test_truncated_plain_pickle(tmp_path: Path) -> None:
    data = pickle.dumps({"segments": [], "device_traces": [entries(40)]}, protocol=4)
    path = write_pickle(tmp_path / "cut.pickle", raw=data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match="not a readable pickle") as err:
        load_trace(path)
    assert_names(err, path)


def test_corrupt_gzip_stream(tmp_path: Path) -> None:
    good = gzip.compress(pickle.dumps({"device_traces": [entries(40)]}))
    path = tmp_path / "bad.pickle.gz"
    path.write_bytes(good[:20] + bytes(b ^ 0xFF for b in good[20:40]) + good[40:])
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    assert_names(err, path)


# -- wrong structure ----------------------------------------------------------------


@pytest.mark.parametrize("top, message", [
    ([1, 2, 3], "top level is a list"),
    ("snapshot", "top level is a str"),
    ({"segments": []}, "no 'device_traces'"),
    ({"device_traces": {"0": []}}, "must be a list"),
    ({"device_traces": [[], 5]}, "must be a list"),
    ({"device_traces": [[]], "segments": {}}, "'segments' must be a list"),
    ({"device_traces": [entries(), entries()]}, "pass device="),
])
def test_bad_top_level(tmp_path: Path, top: Any, message: str) -> None:
    path = write_pickle(tmp_path / "top.pickle.gz", top)
    with pytest.raises(TraceFormatError, match=message) as err:
        read_pytorch_snapshot(path)
    assert_names(err, path)


def test_device_argument(tmp_path: Path) -> None:
    path = write_pickle(tmp_path / "two.pickle", {"device_traces": [entries(2), entries(4)]})
    assert read_pytorch_snapshot(path, device=1).n_ops == 4
    assert load_trace(path, device=0).n_ops == 2
    with pytest.raises(TraceFormatError, match="no device 2"):
        read_pytorch_snapshot(path, device=2)


BAD_ENTRIES: list[tuple[Any, str]] = [
    ("not a dict", "not a dict"),
    ({k: v for k, v in GOOD_ENTRY.items() if k != "action"}, "'action' is missing"),
    (dict(GOOD_ENTRY, action=3), "'action' is missing or not a string"),
    (dict(GOOD_ENTRY, action="malloc"), "unknown action 'malloc'"),
    ({k: v for k, v in GOOD_ENTRY.items() if k != "addr"}, "'addr' is missing"),
    (dict(GOOD_ENTRY, addr="0x1000"), "'addr' is not an integer"),
    (dict(GOOD_ENTRY, addr=True), "'addr' is not an integer"),
    ({k: v for k, v in GOOD_ENTRY.items() if k != "size"}, "'size' is missing"),
    (dict(GOOD_ENTRY, size=-64), "negative 'size'"),
    (dict(GOOD_ENTRY, size=64.0), "'size' is not an integer"),
    (dict(GOOD_ENTRY, addr=2**64), "does not fit in 64 bits"),
    (dict(GOOD_ENTRY, stream="default"), "'stream' is not an integer"),
    (dict(GOOD_ENTRY, time_us="now"), "'time_us' is not a number"),
    (dict(GOOD_ENTRY, addr=0x1000), "already allocated"),  # alloc at a live address (entry 0's)
]


@pytest.mark.parametrize("bad, message", BAD_ENTRIES, ids=[m for _, m in BAD_ENTRIES])
def test_bad_entry_is_named(tmp_path: Path, bad: Any, message: str) -> None:
    trace_entries: list[Any] = entries()
    trace_entries[1] = dict(trace_entries[1], addr=0x9999)  # entry 0's allocation stays live
    trace_entries.insert(4, bad)
    path = write_pickle(tmp_path / "bad_entry.pickle.gz", {"segments": [], "device_traces": [trace_entries]})
    with pytest.raises(TraceFormatError, match=message) as err:
        load_trace(path)
    assert_names(err, path, entry=4)


def test_optional_fields_may_be_missing(tmp_path: Path) -> None:
    minimal = [{"action": "alloc", "addr": 16, "size": 8}, {"action": "free_requested", "addr": 16, "size": 8}]
    path = write_pickle(tmp_path / "min.pickle", {"device_traces": [minimal]})
    t = load_trace(path)
    assert t.n_ops == 2 and t.streams.tolist() == [0, 0] and t.times_us.tolist() == [0.0, 0.0]


def test_ignored_actions_and_oom_count(tmp_path: Path) -> None:
    extra = [dict(GOOD_ENTRY, action=a) for a in ("segment_alloc", "snapshot", "oom", "segment_map",
                                                 "segment_unmap", "segment_free", "free_completed")]
    path = write_pickle(tmp_path / "mixed.pickle", {"device_traces": [extra + entries(4)]})
    t = load_trace(path)
    assert t.n_ops == 4 and t.n_failed_allocs == 1 and t.n_unmatched_frees == 0


# -- native format --------------------------------------------------------------------

HEADER = ('{"format": "gpumem-trace", "version": 1, "name": "n", "source": "gpumem", "n_ops": 2, '
          '"n_allocs": 1, "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us"}')


HEADER2 = HEADER.replace('"version": 1', '"version": 2').replace("}", ', "n_stream_uses": 1}')
HEADER3 = HEADER.replace('"version": 1', '"version": 3').replace("}", ', "n_stream_uses": 0, "n_stream_waits": 1}')


@pytest.mark.parametrize("text, message", [
    (HEADER.replace('"version": 1', '"version": 7') + "\na 0 8 0 0 10\nf 0 0 1\n", "line 1: unsupported .* version 7"),
    # stream waits (version 3): only there, counted in the header, two streams in range
    (HEADER2 + "\na 0 8 0 0 10\nu 0 5 1\nw 5 0 1\nf 0 0 1\n", "line 4: expected .* \\(a version 2 file\\)"),
    (HEADER + "\na 0 8 0 0 10\nw 5 0 1\nf 0 0 1\n", "line 3: expected .* \\(a version 1 file\\)"),
    (HEADER.replace('"version": 1', '"version": 3').replace("}", ', "n_stream_uses": 0}') + "\na 0 8 0 0 10\nf 0 0 1\n",
     "line 1: header field 'n_stream_waits'"),
    (HEADER3 + "\na 0 8 0 0 10\nw 5 0 1\nw 0 5 1\nf 0 0 1\n", "header says 1 stream waits, the file has 2"),
    (HEADER3 + "\na 0 8 0 0 10\nf 0 0 1\n", "header says 1 stream waits, the file has 0"),
    (HEADER3 + "\na 0 8 0 0 10\nw 5 x 1\nf 0 0 1\n", "line 3: waited stream 'x' is not an integer"),
    (HEADER3 + "\na 0 8 0 0 10\nw -5 0 1\nf 0 0 1\n", "line 3: stream -5 out of range"),
    (HEADER3 + "\na 0 8 0 0 10\nw 5 0\nf 0 0 1\n", "line 3: expected"),
    (HEADER3 + "\na 0 8 0 0 10\nw 5 0 1 2\nf 0 0 1\n", "line 3: expected"),
    (HEADER3 + "\na 0 8 0 0 10\nw 5 0 soon\nf 0 0 1\n", "line 3: time_us 'soon' is not a number"),
    (HEADER3 + "\na 0 8 0 0 10\nw 5 99999999999999999999 1\nf 0 0 1\n", "line 3: waited stream"),
    # stream uses (version 2): only there, of a live allocation, counted in the header
    (HEADER + "\na 0 8 0 0 10\nu 0 5 1\nf 0 0 1\n", "line 3: expected .* \\(a version 1 file\\)"),
    (HEADER.replace('"version": 1', '"version": 2') + "\na 0 8 0 0 10\nf 0 0 1\n", "line 1: header field 'n_stream_uses'"),
    (HEADER2 + "\nu 0 5 1\na 0 8 0 0 10\nf 0 0 1\n", "line 2: stream use of id 0, which is not live"),
    (HEADER2 + "\na 0 8 0 0 10\nf 0 0 1\nu 0 5 1\n", "line 4: stream use of id 0, which is not live"),
    (HEADER2 + "\na 0 8 0 0 10\nu 0 five 1\nf 0 0 1\n", "line 3: stream 'five' is not an integer"),
    (HEADER2 + "\na 0 8 0 0 10\nu 0 5\nf 0 0 1\n", "line 3: expected"),
    (HEADER2 + "\na 0 8 0 0 10\nu 0 5 1\nu 0 6 1\nf 0 0 1\n", "header says 1 stream uses, the file has 2"),
    (HEADER.replace("gpumem-trace", "other") + "\n", "line 1: not a gpumem-trace header"),
    ("not json\n", "line 1"),
    (HEADER.replace('"n_ops": 2', '"n_ops": -2') + "\n", "line 1: header field 'n_ops'"),
    (HEADER + "\na 0 8 0 0 10\nx 0 0 1\n", "line 3: expected"),
    (HEADER + "\na 0 8 0 0\nf 0 0 1\n", "line 2: expected"),
    (HEADER + "\na 0 eight 0 0 10\nf 0 0 1\n", "line 2: size 'eight' is not an integer"),
    (HEADER + "\na 1 8 0 0 10\nf 1 0 1\n", "line 2: alloc id 1, expected 0"),
    (HEADER + "\na 0 -8 0 0 10\nf 0 0 1\n", "line 2: negative size"),
    (HEADER + "\na 0 8 0 0 zz\nf 0 0 1\n", "line 2: addr 'zz' is not a hexadecimal integer"),
    (HEADER + "\na 0 8 0 0 10\nf 1 0 1\n", "line 3: free of id 1, which is not live"),
    (HEADER + "\na 0 8 0 0 10\nf 0 0 1\nf 0 0 2\n", "line 4: free of id 0, which is not live"),
    (HEADER + "\na 0 8 0 0 10\n", "header says 2 ops, the file has 1"),
])
def test_bad_native_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.gmt"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=message) as err:
        read_gmt_trace(path)
    assert_names(err, path)


def test_truncated_native_gz(tmp_path: Path, data_dir: Path) -> None:
    whole = (data_dir / "resnet_head.gmt.gz").read_bytes()
    path = tmp_path / "cut.gmt.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceFormatError, match="truncated") as err:
        load_trace(path)
    assert_names(err, path)


# -- RMM log --------------------------------------------------------------------------

RMM_HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"


@pytest.mark.parametrize("text, message", [
    ("", "line 1: empty file"),
    ("Thread,Time,Pointer,Size\n", "line 1: header .* lacks column"),
    (RMM_HEADER + "1,21:50:47.674565,allocate,0x10,8,0\n1,21:50:47.674566,reallocate,0x10,8,0\n",
     "line 3: unknown action 'reallocate'"),
    (RMM_HEADER + "1,21:50:47.674565,allocate,0x10,8\n", "line 2: 5 fields"),
    (RMM_HEADER + "1,25:50:47.674565,allocate,0x10,8,0\n", "line 2: time of day out of range"),
    (RMM_HEADER + "1,yesterday,allocate,0x10,8,0\n", "line 2"),
    (RMM_HEADER + "1,21:50:47.674565,allocate,0xZZ,8,0\n", "line 2: pointer '0xZZ' is not a hexadecimal integer"),
    (RMM_HEADER + "1,21:50:47.674565,allocate,0x10,-8,0\n", "line 2: negative size -8"),
    (RMM_HEADER + "1,21:50:47.674565,allocate,0x10,8,0\n\n1,21:50:47.674566,allocate,0x10,8,0\n",
     "line 4: alloc at 0x10, which is already allocated"),
])
def test_bad_rmm_log(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=message) as err:
        read_rmm_log(path)
    assert_names(err, path)


def test_rmm_midnight_wrap_and_failures(tmp_path: Path) -> None:
    path = tmp_path / "wrap.csv"
    path.write_text(RMM_HEADER + "\n".join([
        "7,23:59:59.999990,allocate,0x10,8,0",
        "7,23:59:59.999985,allocate,0x20,8,0x0",  # 5 us backwards: out-of-order threads, not a new day
        "7,00:00:00.000010,free,0x10,8,0",  # the next day
        "7,00:00:00.5,allocate failure,(nil),1099511627776,0",
        "7,00:00:01,free,0x20,8,0",
    ]) + "\n")
    t = read_rmm_log(path)
    day = 86_400_000_000
    assert t.times_us.tolist() == [day - 10, day - 15, day + 10, day + 1_000_000]
    assert t.n_failed_allocs == 1 and t.n_ops == 4 and t.n_live_at_end == 0


# -- load_trace dispatch ------------------------------------------------------------


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    path = tmp_path / "nope.pickle.gz"
    with pytest.raises(FileNotFoundError, match="nope.pickle.gz"):
        load_trace(path)


def test_unknown_format(tmp_path: Path) -> None:
    path = tmp_path / "mystery.bin"
    path.write_bytes(b"\x00\x01 certainly not a trace")
    with pytest.raises(TraceFormatError, match="unrecognised trace format") as err:
        load_trace(path)
    assert_names(err, path)
    with pytest.raises(TraceFormatError, match="unknown format 'xml'"):
        load_trace(path, format="xml")


def test_empty_file_falls_back_to_the_suffix(tmp_path: Path) -> None:
    for name, message in [("e.pickle", "not a readable pickle"), ("e.csv", "empty file"),
                          ("e.gmt", "not a gpumem-trace header")]:
        path = tmp_path / name
        path.write_bytes(b"")
        with pytest.raises(TraceFormatError, match=message):
            load_trace(path)


def test_a_snapshot_with_stream_minus_one_is_refused_by_the_reader_naming_file_and_entry(tmp_path):
    """issue 20 item 12: stream -1 passed the reader and failed later in the replay without naming the
    file and the entry."""
    import pickle

    from gpumem.errors import TraceFormatError
    from gpumem.trace import load_trace
    entries = [{"action": "alloc", "addr": 4096, "size": 1024, "stream": 0, "time_us": 1, "frames": []},
               {"action": "alloc", "addr": 8192, "size": 1024, "stream": -1, "time_us": 2, "frames": []}]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries]}))
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert "s.pickle" in str(info.value) and "1" in str(info.value) and "stream" in str(info.value)
