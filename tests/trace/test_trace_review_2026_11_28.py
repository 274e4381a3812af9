"""What an attacker's review of 2026-11-28 found in the trace model and writers, each with its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.trace import StreamUse, Trace, load_trace, save_trace


def _trace() -> Trace:
    return Trace.from_ops("x", "gpumem", [(0, 0, 100, 0, 1.0, 0x1000), (1, 0, 100, 0, 2.0, 0x1000)])


def test_sizes_that_add_up_past_int64_are_refused():
    # live bytes, peaks and totals are int64: three allocations of 4e18 bytes wrapped to negative sums
    n = 4 * 10**18
    with pytest.raises(InvalidArgumentError, match=r"add up to more than 2\*\*63 - 1 bytes"):
        Trace.from_ops("ovf", "gpumem", [(0, i, n, 0, float(i), 0x1000 * (i + 1)) for i in range(3)])
    t = Trace.from_ops("ok", "gpumem", [(0, i, n, 0, float(i), 0x1000 * (i + 1)) for i in range(2)])
    assert t.peak_live_nbytes == 2 * n


@pytest.mark.parametrize("bad", [None, "abc", [1], True, float("nan"), float("inf")])
def test_a_stream_use_with_a_bad_time_is_refused(bad):
    t = _trace()
    with pytest.raises(InvalidArgumentError, match="time_us must be a finite number"):
        Trace(t.name, t.source, t.kinds, t.alloc_ids, t.nbytes, t.streams, t.times_us, t.addrs,
              stream_uses=(StreamUse(1, 0, 1, bad),))


@pytest.mark.parametrize("name", ["t.gmt", "t.gmt.gz"])
def test_a_writer_that_fails_leaves_the_file_that_was_there(tmp_path: Path, name, monkeypatch):
    path = tmp_path / name
    good = _trace()
    save_trace(good, path)
    before = path.read_bytes()
    import gpumem.trace.gmt as gmt

    def broken(_t: float) -> str:
        raise KeyboardInterrupt   # stands for Ctrl-C or a full disk half-way through
    monkeypatch.setattr(gmt, "_fmt_time", broken)
    with pytest.raises(KeyboardInterrupt):
        save_trace(good, path)
    assert path.read_bytes() == before
    assert load_trace(path) == good
    assert [p.name for p in tmp_path.iterdir()] == [name]   # no temporary file left behind


def test_a_writer_that_succeeds_replaces_the_file(tmp_path: Path):
    path = tmp_path / "t.gmt"
    path.write_text("old")
    save_trace(_trace(), path)
    assert load_trace(path) == _trace()
    assert [p.name for p in tmp_path.iterdir()] == ["t.gmt"]


@pytest.mark.parametrize("unit", ["ns", "s", 5, None])
def test_a_time_unit_other_than_us_is_refused(tmp_path: Path, unit):
    header = {"format": "gpumem-trace", "version": 1, "name": "x", "source": "gpumem", "n_ops": 2, "n_allocs": 1,
              "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": unit}
    path = tmp_path / "tu.gmt"
    path.write_text(json.dumps(header) + "\na 0 100 0 0 1000\nf 0 0 3\n")
    with pytest.raises(TraceFormatError, match="time_unit"):
        load_trace(path)
    del header["time_unit"]        # older files without the field are microseconds
    path.write_text(json.dumps(header) + "\na 0 100 0 0 1000\nf 0 0 3\n")
    assert load_trace(path).n_ops == 2


@pytest.mark.parametrize("lines", ["a 0 100 -5 0 1000\nf 0 -5 3\n", "a 0 100 0 0 1000\nf 0 -1 3\n"])
def test_a_negative_stream_in_a_gmt_file_is_refused_naming_the_line(tmp_path: Path, lines):
    # the replay stopped later with "stream must be an int in [0, 2**64)", naming neither file nor line
    header = {"format": "gpumem-trace", "version": 1, "name": "x", "source": "gpumem", "n_ops": 2, "n_allocs": 1,
              "n_unmatched_frees": 0, "n_failed_allocs": 0, "time_unit": "us"}
    path = tmp_path / "neg.gmt"
    path.write_text(json.dumps(header) + "\n" + lines)
    with pytest.raises(TraceFormatError, match=r"line \d+.*stream -\d+ out of range"):
        load_trace(path)
