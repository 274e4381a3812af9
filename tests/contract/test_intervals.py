"""The interval map behind every address book (gpumem.intervals), against a naive model.

Not a device contract, but device-independent: it lives with the contract suite because every
device's bookkeeping rests on it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem import InternalError
from gpumem.intervals import IntervalMap

SPAN = 200

OPS = st.lists(st.tuples(st.sampled_from(["add", "remove"]), st.integers(0, SPAN), st.integers(1, 40)),
               max_size=60)


def _model_overlaps(model: dict[int, int], start: int, end: int) -> list[int]:
    return sorted(s for s, e in model.items() if s < end and start < e)


@settings(max_examples=150)
@given(ops=OPS, probes=st.lists(st.tuples(st.integers(0, SPAN + 50), st.integers(1, 60)), max_size=15))
def test_interval_map_matches_a_naive_model(ops, probes):
    m: IntervalMap[str] = IntervalMap()
    model: dict[int, int] = {}
    for op, start, n in ops:
        end = start + n
        if op == "add":
            if _model_overlaps(model, start, end):
                with pytest.raises(InternalError):
                    m.add(start, end, "x")
            else:
                m.add(start, end, f"v{start}")
                model[start] = end
        elif model:
            victim = sorted(model)[start % len(model)]
            assert m.remove(victim) == f"v{victim}"
            del model[victim]
        m.check()
    assert [(s, e) for s, e, _ in m.items()] == sorted(model.items())
    assert len(m) == len(model)
    for point, n in probes:
        end = point + n
        hit = m.find(point)
        holders = [s for s, e in model.items() if s <= point < e]
        assert (hit[0] if hit else None) == (holders[0] if holders else None)
        assert [s for s, _, _ in m.overlapping(point, end)] == _model_overlaps(model, point, end)
        first = m.first_overlap(point, end)
        expected = _model_overlaps(model, point, end)
        assert (first[0] if first else None) == (expected[0] if expected else None)
        tiles, hole = m.tiling(point, end)
        cursor, want = point, []
        while cursor < end:
            h = [s for s, e in model.items() if s <= cursor < e]
            if not h:
                break
            want.append(h[0])
            cursor = model[h[0]]
        assert [s for s, _, _ in tiles] == want
        assert hole == (cursor if cursor < end else None)
        for align in (1, 8):
            gap = m.find_gap(0, SPAN + 50, n, align)
            candidates = [a for a in range(0, SPAN + 50 - n + 1, align)
                          if not _model_overlaps(model, a, a + n)]
            assert gap == (candidates[0] if candidates else None)
        # the longest free run within [point, end): the largest n such that some [a, a + n) there is free
        free = [not _model_overlaps(model, a, a + 1) for a in range(point, end)]
        run = best = 0
        for f in free:
            run = run + 1 if f else 0
            best = max(best, run)
        assert m.largest_gap(point, end) == best
        # the free run that holds a free address, within [point, end)
        if not _model_overlaps(model, point, point + 1):
            lo = point
            while lo > 0 and not _model_overlaps(model, lo - 1, lo):
                lo -= 1
            hi = point + 1
            while hi < end and not _model_overlaps(model, hi, hi + 1):
                hi += 1
            assert m.free_run(0, end, point) == (lo, hi)
        else:
            with pytest.raises(InternalError):
                m.free_run(0, end, point)


def test_interval_map_refuses_bad_intervals():
    m: IntervalMap[int] = IntervalMap()
    m.add(10, 20, 1)
    for start, end in [(5, 5), (30, 25), (15, 16), (5, 11), (19, 30)]:
        with pytest.raises(InternalError):
            m.add(start, end, 2)
    with pytest.raises(InternalError):
        m.remove(11)
    m.add(20, 30, 3)  # touching is not overlapping
    assert m.find(20)[2] == 3 and m.get(10) == 1 and m.end_of(20) == 30 and 20 in m and 21 not in m
