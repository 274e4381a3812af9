"""Write-then-read round trips through every format, as hypothesis properties.

Equality per format:

* native ``.gmt``: exact (``==``: ops, times, addresses, name, source, counters);
* PyTorch snapshot: the same ops, times and addresses (name and source are the reader's);
* RMM CSV: the same ops and addresses; times to the microsecond and relative to the
  first op, since RMM logs the time of day (rounded to microseconds).

A trace without allocations writes fine but ``load_trace`` refuses it ("no allocations").
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumem.errors import TraceFormatError
from gpumem.trace import (
    Trace,
    load_trace,
    read_pytorch_snapshot,
    save_pytorch_snapshot,
    save_trace,
    snapshot_to_trace,
    to_pytorch_snapshot,
    write_rmm_log,
)
from trace_strategies import PROPERTY, traces


@PROPERTY
@given(trace=traces(), gz=st.booleans())
def test_native_round_trip_is_exact(trace: Trace, gz: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ("x.gmt.gz" if gz else "x.gmt")
        save_trace(trace, path)
        if trace.n_allocs == 0:
            with pytest.raises(TraceFormatError, match="no allocations"):
                load_trace(path)
        else:
            assert load_trace(path) == trace


@PROPERTY
@given(trace=traces(), gz=st.booleans())
def test_rmm_round_trip_keeps_ops_and_relative_microseconds(trace: Trace, gz: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ("x.csv.gz" if gz else "x.csv")
        write_rmm_log(trace, path)
        if trace.n_allocs == 0:
            with pytest.raises(TraceFormatError, match="no allocations"):
                load_trace(path)
            return
        back = load_trace(path)
    assert back.source == "rmm-log" and back.name == "x"
    assert back.ops_equal(trace, times=False)
    if trace.n_ops:
        expected = np.round(trace.times_us) - np.round(trace.times_us[0])
        assert np.array_equal(back.times_us - back.times_us[0], expected)
        assert 0 <= back.times_us[0] < 86_400e6


@PROPERTY
@given(trace=traces(), gz=st.booleans())
def test_pytorch_snapshot_round_trip_keeps_ops_times_and_addresses(trace: Trace, gz: bool) -> None:
    snapshot = to_pytorch_snapshot(trace)
    assert snapshot_to_trace(snapshot).ops_equal(trace)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ("x.pickle.gz" if gz else "x.pickle")
        save_pytorch_snapshot(trace, path)
        back = read_pytorch_snapshot(path)
    assert back.ops_equal(trace) and back.source == "pytorch-snapshot" and back.n_live_at_end == trace.n_live_at_end


@PROPERTY
@given(trace=traces(), data=st.data())
def test_slices_are_valid_traces(trace: Trace, data: st.DataObject) -> None:
    start = data.draw(st.integers(0, trace.n_ops))
    stop = data.draw(st.integers(start, trace.n_ops))
    part = trace.slice(start, stop)  # the constructor validates every invariant
    assert part.n_ops + part.n_unmatched_frees == stop - start
    head = trace.head(stop)
    assert head.ops_equal(trace.slice(0, stop)) and head.peak_live_nbytes <= trace.peak_live_nbytes
