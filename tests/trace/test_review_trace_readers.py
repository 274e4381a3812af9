"""Review findings on the trace readers: the RMM log's repeated header column (5), a snapshot's second free and a
free of another size (6), and the .gmt reader held to its documentation (7)."""

from __future__ import annotations

import json
import logging
import pickle

import pytest

from gpumem.cli import EXIT_OK, EXIT_USAGE, main
from gpumem.errors import TraceFormatError
from gpumem.trace import load_trace, save_trace
from gpumem.trace.builder import SecondFreeError, build_trace
from gpumem.trace.gmt import read_gmt_trace
from gpumem.trace.pytorch import read_pytorch_snapshot
from gpumem.trace.rmm import read_rmm_log


# -- 5: RMM log header ---------------------------------------------------------------------------------------


def test_rmm_header_with_a_repeated_column_is_refused(tmp_path):
    p = tmp_path / "dup.csv"
    p.write_text("Thread,Time,Action,Pointer,Size,Stream,Size\n"
                 "1,00:00:00.000001,allocate,0x1000,4096,0,8\n"
                 "1,00:00:00.000002,free,0x1000,4096,0,8\n")
    with pytest.raises(TraceFormatError, match=r"line 1: header .* repeats column\(s\) 'Size'"):
        read_rmm_log(p)


@pytest.mark.parametrize("extra, cell", [
    (",,", ",,"),          # empty names (trailing commas) are no repeat (second attacker review: refused as '')
    (",Provider", ",x"),   # distinct extra columns
])
def test_rmm_header_with_empty_or_distinct_extra_columns_still_reads(tmp_path, extra, cell):
    p = tmp_path / "extra.csv"
    p.write_text(f"Thread,Time,Action,Pointer,Size,Stream{extra}\n"
                 f"1,00:00:00.000001,allocate,0x1000,4096,0{cell}\n"
                 f"1,00:00:00.000002,free,0x1000,4096,0{cell}\n")
    assert read_rmm_log(p).n_ops == 2


def test_rmm_second_free_is_refused_naming_both_lines(tmp_path):
    p = tmp_path / "twice.csv"
    p.write_text("Thread,Time,Action,Pointer,Size,Stream\n"
                 "1,00:00:00.000001,allocate,0x1000,4096,0\n"
                 "1,00:00:00.000002,free,0x1000,4096,0\n"
                 "1,00:00:00.000003,free,0x1000,4096,0\n")
    with pytest.raises(TraceFormatError, match=r"line 4: second free of 0x1000: .*already freed \(line 3\)"):
        read_rmm_log(p)


# -- 6: PyTorch snapshot: a second free, a free of another size ---------------------------------------------------


def _entry(action: str, addr: int, size: int, t: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}


def _snapshot(tmp_path, entries: list[dict]):
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries]}, protocol=4))
    return p


def test_snapshot_second_free_is_refused_not_called_unallocated(tmp_path, caplog):
    p = _snapshot(tmp_path, [_entry("alloc", 0x1000, 5000, 1), _entry("free_requested", 0x1000, 5000, 2),
                             _entry("free_requested", 0x1000, 5000, 3)])
    with caplog.at_level(logging.WARNING), pytest.raises(TraceFormatError) as info:
        read_pytorch_snapshot(p, step_marks=False)
    message = str(info.value)
    assert "entry 2" in message and "second free of 0x1000" in message and "already freed (entry 1)" in message
    assert "never allocated" not in caplog.text   # the old, false, warning


def test_replay_of_a_snapshot_with_a_second_free_is_a_usage_error(tmp_path, capsys):
    p = _snapshot(tmp_path, [_entry("alloc", 0x1000, 5000, 1), _entry("free_requested", 0x1000, 5000, 2),
                             _entry("free_requested", 0x1000, 5000, 3)])
    code = main(["replay", str(p), "--device", "sim:t4-16gb"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "second free of 0x1000" in err


def test_snapshot_free_before_the_window_is_still_an_unmatched_free(tmp_path, caplog):
    p = _snapshot(tmp_path, [_entry("free_requested", 0x2000, 64, 0), _entry("alloc", 0x1000, 5000, 1),
                             _entry("free_requested", 0x1000, 5000, 2)])
    with caplog.at_level(logging.WARNING):
        t = read_pytorch_snapshot(p, step_marks=False)
    assert t.n_unmatched_frees == 1 and t.n_ops == 2
    assert "skipped 1 free(s) of addresses never allocated in the trace window" in caplog.text


def test_snapshot_address_freed_allocated_again_and_freed_reads(tmp_path):
    p = _snapshot(tmp_path, [_entry("alloc", 0x1000, 10, 1), _entry("free_requested", 0x1000, 10, 2),
                             _entry("alloc", 0x1000, 20, 3), _entry("free_requested", 0x1000, 20, 4)])
    t = read_pytorch_snapshot(p, step_marks=False)
    assert t.n_ops == 4 and t.n_unmatched_frees == 0


def test_snapshot_free_of_another_size_warns(tmp_path, caplog):
    p = _snapshot(tmp_path, [_entry("alloc", 0x1000, 5000, 1), _entry("free_requested", 0x1000, 1000, 2)])
    with caplog.at_level(logging.WARNING, logger="gpumem.trace.builder"):
        t = read_pytorch_snapshot(p, step_marks=False)
    assert t.nbytes.tolist() == [5000, 5000]   # the allocation's size is kept
    assert ("1 free(s) carry a size other than their allocation's (the first, entry 1, frees 0x1000 with size "
            "1000, allocated with 5000)") in caplog.text


def test_snapshot_free_of_the_same_size_does_not_warn(tmp_path, caplog):
    p = _snapshot(tmp_path, [_entry("alloc", 0x1000, 5000, 1), _entry("free_requested", 0x1000, 5000, 2)])
    with caplog.at_level(logging.WARNING, logger="gpumem.trace.builder"):
        read_pytorch_snapshot(p, step_marks=False)
    assert "size other than" not in caplog.text


def test_build_trace_raises_double_free_error():
    with pytest.raises(SecondFreeError, match="second free of 0x10") as info:
        build_trace("b", "recorded", [0, 1, 1], [0x10, 0x10, 0x10], [8, 0, 0], [0] * 3, [0.0] * 3,
                    refuse_second_free=True)
    assert (info.value.index, info.value.first_free) == (2, 1)


def test_a_recorders_history_with_a_programs_double_free_still_builds(caplog):
    """gpumem.torch writes a free to its history before the engine judges it, so a program's double free (which
    the engine refused) is in the history: refusing it there lost the out-of-memory snapshot and the recording
    (second attacker review, 2026-12-05). The recorders skip it with a warning of its own."""
    from gpumem.recording import snapshot_from_events

    with caplog.at_level(logging.WARNING, logger="gpumem.trace.builder"):
        t = build_trace("b", "recorded", [0, 1, 1], [0x10, 0x10, 0x10], [8, 0, 0], [0] * 3, [0.0] * 3)
    assert t.n_ops == 2 and t.n_unmatched_frees == 1
    assert "skipped 1 second free(s) of addresses freed already" in caplog.text
    assert "never allocated" not in caplog.text
    snap = snapshot_from_events([(0, 0, 0x7F0000000000, 1024, 0, 1.0), (1, 0, 0x7F0000000000, 1024, 0, 2.0),
                                 (1, 0, 0x7F0000000000, 1024, 0, 3.0)])
    assert [e["action"] for e in snap["device_traces"][0]].count("alloc") == 1


# -- 7: the .gmt reader and its documentation -------------------------------------------------------------------

_V1 = {"format": "gpumem-trace", "version": 1, "name": "t", "source": "s", "n_ops": 2, "n_allocs": 1,
       "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us"}
_V6 = {**_V1, "version": 6, "n_stream_uses": 0, "n_stream_waits": 0, "n_plan_events": 0, "gpu_clock": False,
       "n_reserves": 1}


def _gmt(tmp_path, header: dict, body: str):
    p = tmp_path / "t.gmt"
    p.write_text(json.dumps(header) + "\n" + body)
    return p


def test_gmt_reserve_below_live_reads_with_a_warning(tmp_path, caplog):
    """Refused at first (attacker review); but a Trace may hold such a reserve and save_trace writes it, so the
    reader must read it back (second attacker review): read as written, with a warning naming the first."""
    p = _gmt(tmp_path, _V6, "a 0 1000000 0 0 1000\nr 5\nf 0 0 1\n")
    with caplog.at_level(logging.WARNING, logger="gpumem.trace.gmt"):
        t = read_gmt_trace(p)
    assert t.live_reserved_nbytes.tolist() == [5, -1]
    assert "1 reserve(s) below the bytes" in caplog.text and "line 3: 5 reserved, 1,000,000 live" in caplog.text


def test_gmt_a_trace_with_a_reserve_below_live_round_trips(tmp_path):
    import dataclasses

    import numpy as np

    from gpumem.trace import Trace, load_trace, save_trace

    t = Trace.from_ops("t", "gpumem", [(0, 0, 4096, 0, 1.0, 0x1000), (0, 1, 4096, 0, 2.0, 0x3000),
                                       (1, 0, 4096, 0, 3.0, 0x1000)])
    t = dataclasses.replace(t, live_reserved_nbytes=np.array([4096, 4096, -1], dtype=np.int64))
    save_trace(t, tmp_path / "r.gmt")
    assert load_trace(tmp_path / "r.gmt") == t


def test_gmt_reserve_at_or_above_live_reads(tmp_path):
    p = _gmt(tmp_path, _V6, "a 0 1000000 0 0 1000\nr 1000000\nf 0 0 1\n")
    assert read_gmt_trace(p).live_reserved_nbytes.tolist() == [1000000, -1]


@pytest.mark.parametrize("body, match", [
    ("a 0 +1000 0 0 1000\nf 0 0 1\n", r"line 2: size '\+1000' has a '\+' sign"),
    ("a 0 1000 +0 0 1000\nf 0 0 1\n", r"line 2: stream '\+0' has a '\+' sign"),
    ("a 0 1000 0 +5 1000\nf 0 0 1\n", r"line 2: time_us '\+5' has a '\+' sign"),
    ("a\t0 1000 0 0 1000\nf 0 0 1\n", r"line 2: a tab in .*single spaces"),
    ("a 0 1000 0 0 1000\nf 0\t0 1\n", r"line 3: a tab in .*single spaces"),
    ("a 0  1000 0 0 1000\nf 0 0 1\n", r"line 2: an empty field .*two spaces in a row"),
    ("a 0 1000 0 0 1000 \nf 0 0 1\n", r"line 2: an empty field .*end of the line"),
    (" a 0 1000 0 0 1000\nf 0 0 1\n", r"line 2: an empty field"),
])
def test_gmt_numbers_and_separators_as_documented(tmp_path, body, match):
    with pytest.raises(TraceFormatError, match=match):
        read_gmt_trace(_gmt(tmp_path, _V1, body))


def test_gmt_crlf_line_ends_still_read(tmp_path):
    p = tmp_path / "t.gmt"
    p.write_bytes((json.dumps(_V1) + "\r\na 0 1000 0 0 1000\r\nf 0 0 1\r\n").encode())
    assert read_gmt_trace(p).n_ops == 2


def test_gmt_self_wait_and_free_on_another_stream_are_kept_as_documented(tmp_path):
    """The doc is silent on both; decided (gmt.py docstring): a stream may wait for itself (the model keeps
    it, a program may make it), and a free's stream is the one it was made on (RMM's deallocate takes one):
    both read, and write back equal."""
    head = {**_V1, "version": 3, "n_stream_uses": 0, "n_stream_waits": 1}
    t = read_gmt_trace(_gmt(tmp_path, head, "a 0 1000 0 0 1000\nw 0 0 1\nf 0 7 2\n"))
    assert t.stream_waits[0].stream == t.stream_waits[0].waited == 0 and t.streams.tolist() == [0, 7]
    assert load_trace(save_trace(t, tmp_path / "back.gmt"), progress=False) == t


def test_gmt_writer_output_still_reads(tmp_path):
    from gpumem.trace import Trace

    t = Trace.from_ops("w", "gpumem", [(0, 0, 1000, 3, 0.5, 0x1000), (0, 1, 7, 3, -2.0, 0x2000),
                                        (1, 0, 1000, 3, float("nan"), 0x1000)])
    assert load_trace(save_trace(t, tmp_path / "w.gmt"), progress=False) == t


def test_gmt_replay_with_signed_size_is_a_usage_error(tmp_path, capsys):
    p = _gmt(tmp_path, _V1, "a 0 +1000 0 0 1000\nf 0 0 1\n")
    assert main(["replay", str(p), "--device", "sim:t4-16gb"]) == EXIT_USAGE
    assert "has a '+' sign" in capsys.readouterr().err
    q = _gmt(tmp_path, _V1, "a 0 1000 0 0 1000\nf 0 0 1\n")
    assert main(["replay", str(q), "--device", "sim:t4-16gb"]) == EXIT_OK
