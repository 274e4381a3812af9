"""The Trace model, the address-to-id builder and the recorder."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.trace import OpKind, Trace, TraceOp, TraceRecorder, build_trace, replay_addresses
from gpumem.units import KiB, MiB

A, F = OpKind.ALLOC, OpKind.FREE


def small_trace() -> Trace:
    """alloc 0 (1 KiB), alloc 1 (1 MiB), free 0, alloc 2 (4 KiB, stream 7), free 2; id 1 stays live."""
    return Trace.from_ops("small", "gpumem", [
        (A, 0, KiB, 0, 10.0, 0x1000),
        (A, 1, MiB, 0, 11.0, 0x2000),
        (F, 0, KiB, 0, 12.0, 0x1000),
        (A, 2, 4 * KiB, 7, 13.5, 0x1000),
        (F, 2, 4 * KiB, 7, 14.0, 0x1000),
    ])


def test_sizes_and_counts() -> None:
    t = small_trace()
    assert (t.n_ops, len(t), t.n_allocs, t.n_frees, t.n_live_at_end) == (5, 5, 3, 2, 1)
    assert t.kinds.dtype == np.int8 and t.alloc_ids.dtype == np.int64 and t.times_us.dtype == np.float64


def test_peak_live_nbytes_is_max_of_running_sum() -> None:
    t = small_trace()
    assert t.live_nbytes().tolist() == [KiB, KiB + MiB, MiB, MiB + 4 * KiB, MiB]
    assert t.peak_live_nbytes == MiB + 4 * KiB
    assert Trace.empty().peak_live_nbytes == 0


def test_iteration_and_indexing_give_traceops() -> None:
    t = small_trace()
    ops = list(t)
    assert ops[3] == TraceOp(A, 2, 4 * KiB, 7, 13.5, 0x1000) == t[3]
    assert t[-1].kind is OpKind.FREE
    assert Trace.from_ops("small", "gpumem", ops) == t


def test_as_lists_are_plain_python_lists() -> None:
    kinds, ids, nbytes, streams = small_trace().as_lists()
    assert kinds == [0, 0, 1, 0, 1] and ids == [0, 1, 0, 2, 2] and streams == [0, 0, 0, 7, 7]
    assert all(type(x) is int for col in (kinds, ids, nbytes, streams) for x in col)


def test_equality_compares_everything() -> None:
    t = small_trace()
    assert t == small_trace()
    assert t != t.renamed("other")
    shifted = Trace(t.name, t.source, t.kinds, t.alloc_ids, t.nbytes, t.streams, t.times_us + 1, t.addrs)
    assert t != shifted and t.ops_equal(shifted, times=False)
    assert t != "not a trace"


@pytest.mark.parametrize(
    "ops, message",
    [
        ([(A, 1, 8, 0, 0.0, 0)], "expected 0"),
        ([(F, 0, 8, 0, 0.0, 0)], "never allocated"),
        ([(A, 0, 8, 0, 0.0, 0), (F, 0, 8, 0, 0.0, 0), (F, 0, 8, 0, 0.0, 0)], "second time"),
        ([(A, 0, 8, 0, 0.0, 0), (F, 0, 9, 0, 0.0, 0)], "says 9 bytes"),
        ([(A, 0, 8, 0, 0.0, 5), (F, 0, 8, 0, 0.0, 6)], "different addr"),
        ([(A, 0, -8, 0, 0.0, 0)], "negative size"),
        ([(2, 0, 8, 0, 0.0, 0)], "neither ALLOC"),
    ],
)
def test_invalid_ops_are_rejected(ops: list[tuple], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Trace.from_ops("bad", "gpumem", ops)


def test_free_before_alloc_is_rejected() -> None:
    t = small_trace()
    with pytest.raises(InvalidArgumentError, match="before its ALLOC"):
        Trace("x", "gpumem", t.kinds[[2, 0]], t.alloc_ids[[2, 0]], t.nbytes[[2, 0]], t.streams[[2, 0]],
              t.times_us[[2, 0]], t.addrs[[2, 0]])


def test_inconsistent_n_live_at_end_is_rejected() -> None:
    t = small_trace()
    with pytest.raises(InvalidArgumentError, match="n_live_at_end"):
        Trace("x", "gpumem", t.kinds, t.alloc_ids, t.nbytes, t.streams, t.times_us, t.addrs, n_live_at_end=3)


def test_head_keeps_a_prefix() -> None:
    t = small_trace()
    h = t.head(3)
    assert list(h) == list(t)[:3] and h.n_live_at_end == 1 and h.n_unmatched_frees == 0
    assert t.head(100) == t and t.head(0).n_ops == 0


def test_slice_renumbers_and_counts_orphan_frees() -> None:
    s = small_trace().slice(1)
    # ops 1..4: alloc 1 -> id 0; free of old id 0 dropped; alloc 2 -> id 1; free id 1
    assert [(op.kind, op.alloc_id, op.nbytes) for op in s] == [(A, 0, MiB), (A, 1, 4 * KiB), (F, 1, 4 * KiB)]
    assert s.n_unmatched_frees == 1 and s.n_live_at_end == 1


def test_summary() -> None:
    s = small_trace().summary()
    assert (s.n_ops, s.n_allocs, s.peak_live_nbytes, s.max_alloc_nbytes, s.n_streams) == (5, 3, MiB + 4 * KiB, MiB, 2)
    assert s.duration_s == pytest.approx(4e-6)
    assert "small" in str(s) and "MiB" in str(s)


# -- builder ------------------------------------------------------------------------


def test_builder_pairs_by_address_and_reuses_addresses() -> None:
    codes = [0, 0, 1, 0, 9, 1, 1]  # 9 is ignored (e.g. a segment event)
    addrs = [0x10, 0x20, 0x10, 0x10, 0x99, 0x10, 0x20]
    sizes = [100, 200, 0, 300, 5, 0, 0]
    t = build_trace("b", "recorded", codes, addrs, sizes, [0] * 7, list(range(7)))
    assert [(op.kind, op.alloc_id, op.nbytes, op.addr) for op in t] == [
        (A, 0, 100, 0x10), (A, 1, 200, 0x20), (F, 0, 100, 0x10), (A, 2, 300, 0x10), (F, 2, 300, 0x10),
        (F, 1, 200, 0x20),
    ]
    assert t.times_us.tolist() == [0, 1, 2, 3, 5, 6]


def test_builder_skips_unmatched_frees_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gpumem.trace.builder"):
        t = build_trace("b", "recorded", [1, 1, 0, 1], [0x1, 0x2, 0x3, 0x3], [0, 0, 8, 0], [0] * 4, [0.0] * 4)
    assert t.n_unmatched_frees == 2 and t.n_ops == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 free" in warnings[0].getMessage()


def test_replay_addresses_invents_distinct_ones_when_unknown() -> None:
    t = Trace.from_ops("z", "gpumem", [(A, 0, 10, 0, 0.0, 0), (A, 1, 600, 0, 0.0, 0), (F, 0, 10, 0, 0.0, 0)])
    addrs = replay_addresses(t)
    assert addrs[0] == addrs[2] != addrs[1] and addrs[0] % 512 == 0 and addrs[1] - addrs[0] >= 10


def test_replay_addresses_refuses_live_collisions() -> None:
    t = Trace.from_ops("z", "gpumem", [(A, 0, 10, 0, 0.0, 0x10), (A, 1, 10, 0, 0.0, 0x10)])
    with pytest.raises(InvalidArgumentError, match="while an allocation there is live"):
        replay_addresses(t)


# -- recorder -----------------------------------------------------------------------


def test_recorder_builds_the_trace() -> None:
    rec = TraceRecorder()
    rec.record_segment("segment_alloc", 0x1000, 2 * MiB, 0, time_us=1.0)
    rec.record_alloc(0x1000, 512, 0, time_us=2.0)
    rec.record_alloc(0x1200, 100, 3)
    rec.record_free(0x1000, 0, time_us=1e9)
    rec.record_free(0xDEAD, 0)  # never allocated: skipped
    t = rec.to_trace("run")
    assert (t.name, t.source, t.n_ops, t.n_unmatched_frees, t.n_live_at_end) == ("run", "recorded", 3, 1, 1)
    assert [(op.kind, op.alloc_id, op.nbytes, op.stream) for op in t] == [(A, 0, 512, 0), (A, 1, 100, 3),
                                                                           (F, 0, 512, 0)]
    assert t.times_us[0] == 2.0 and 0 <= t.times_us[1] < 1e9 and t.times_us[2] == 1e9
    assert rec.segment_events == [("segment_alloc", 0x1000, 2 * MiB, 0, 1.0)]
    assert len(rec) == 4


def test_recorder_default_times_increase() -> None:
    rec = TraceRecorder()
    for i in range(100):
        rec.record_alloc(0x1000 + i * 16, 16)
    times = rec.to_trace().times_us
    assert (np.diff(times) >= 0).all() and times[0] >= 0


def test_recorder_rejects_double_alloc_and_bad_segment_action() -> None:
    rec = TraceRecorder()
    rec.record_alloc(0x10, 8)
    rec.record_alloc(0x10, 8)
    with pytest.raises(TraceFormatError, match="entry 1"):
        rec.to_trace("dup")
    with pytest.raises(ValueError, match="unknown segment action"):
        rec.record_segment("segment_grow", 0, 0)
    rec.clear()
    assert len(rec) == 0 and rec.to_trace().n_ops == 0
