"""Step-plan events in a trace (:class:`gpumem.trace.PlanEvent`): gpumem.torch records where a program marked
its steps and where the memory-first warm-up began, and a replay under a policy gpumem.torch can run makes the
same calls (Note [Plan events in a replay] in gpumem/replay.py), so that the simulator predicts a run with
step plans (gpumem.torch's default) instead of an unplanned one."""

from __future__ import annotations

import dataclasses
import gzip

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem.errors import InvalidArgumentError, TraceFormatError
from gpumem.native import load_engine
from gpumem.replay import replay_trace
from gpumem.torch import trace_from_words
from gpumem.trace import OpKind, PlanEvent, PlanEventKind, Trace, load_trace, save_trace
from gpumem.trace.builder import PLAN_CODE, build_trace
from gpumem.units import MiB

MARK, START, STOP = PlanEventKind.MARK, PlanEventKind.WARMUP_START, PlanEventKind.WARMUP_STOP

# One training-like step: (size, life in ops); repeated, each step's blocks freed within it but the last
PATTERN = [96 * MiB, 3 * MiB + 5, 40 * MiB, 700, 17 * MiB, 64 * MiB, 2 * MiB]


def loop_trace(steps: int = 8, events: bool = True) -> Trace:
    """``steps`` repeats of PATTERN, every block freed at its step's end; with ``events``, the warm-up begun
    before the first op and a mark at the top of every step, as gpumem.torch would record them."""
    ops = []
    plans = []
    aid = 0
    for s in range(steps):
        if events:
            if s == 0:
                plans.append(PlanEvent(len(ops), START))
            plans.append(PlanEvent(len(ops), MARK))
        first = aid
        for size in PATTERN:
            ops.append((OpKind.ALLOC, aid, size))
            aid += 1
        for a in range(first, aid):
            ops.append((OpKind.FREE, a, PATTERN[a - first]))
    kinds = np.array([k for k, _, _ in ops], np.int8)
    ids = np.array([a for _, a, _ in ops], np.int64)
    sizes = np.array([n for _, _, n in ops], np.int64)
    z = np.zeros(len(ops), np.int64)
    return Trace("loop", "recorded", kinds, ids, sizes, z, z.astype(np.float64), (ids + 1) * 2**32,
                 plan_events=tuple(plans))


def test_a_gmt_file_keeps_plan_events_and_writes_version_4_only_when_it_has_some(tmp_path):
    t = loop_trace()
    path = save_trace(t, tmp_path / "loop.gmt")
    assert '"version": 4' in path.read_text().splitlines()[0]
    back = load_trace(path)
    assert back == t and back.plan_events == t.plan_events
    plain = save_trace(loop_trace(events=False), tmp_path / "plain.gmt")
    assert '"version": 1' in plain.read_text().splitlines()[0]


@pytest.mark.parametrize("edit, match", [
    (lambda text: text.replace('"version": 4', '"version": 3'), "expected"),           # a p line in version 3
    (lambda text: text.replace('"n_plan_events": 9', '"n_plan_events": 8'), "plan events"),
    (lambda text: text.replace("\np 0 0\n", "\np 7 0\n", 1), "plan event kind 7 out of range"),
    (lambda text: text.replace("\np 0 0\n", "\np x 0\n", 1), "plan event kind"),
])
def test_a_damaged_plan_event_line_is_a_format_error_naming_the_line(tmp_path, edit, match):
    path = save_trace(loop_trace(), tmp_path / "loop.gmt")
    bad = tmp_path / "bad.gmt"
    bad.write_text(edit(path.read_text()))
    with pytest.raises(TraceFormatError, match=match):
        load_trace(bad)


def test_the_trace_checks_its_plan_events():
    t = loop_trace(steps=2, events=False)
    with pytest.raises(InvalidArgumentError, match="plan events are sorted"):
        dataclasses.replace(t, plan_events=(PlanEvent(5, MARK), PlanEvent(2, MARK)))
    with pytest.raises(InvalidArgumentError, match="outside"):
        dataclasses.replace(t, plan_events=(PlanEvent(t.n_ops + 1, MARK),))
    with pytest.raises(InvalidArgumentError, match="kind must be a PlanEventKind"):
        dataclasses.replace(t, plan_events=(PlanEvent(0, 0),))
    with pytest.raises(InvalidArgumentError, match="must hold PlanEvent"):
        dataclasses.replace(t, plan_events=((0, MARK),))


def test_a_slice_keeps_the_events_of_its_window_at_their_new_places():
    t = loop_trace(steps=4)
    step_ops = 2 * len(PATTERN)
    s = t.slice(step_ops, 3 * step_ops)
    # a mark just before op start or stop is kept (as a stream wait is): here the tops of steps 1, 2 and 3
    assert s.plan_events == (PlanEvent(0, MARK), PlanEvent(step_ops, MARK), PlanEvent(2 * step_ops, MARK))
    assert t.renamed("x").plan_events == t.plan_events


def test_the_native_trace_words_give_plan_events_and_an_unknown_kind_is_a_format_error():
    words = [PLAN_CODE, 0, int(START), 0, 0,
             0, 0x1000, 512, 0, 10,
             PLAN_CODE, 0, int(MARK), 0, 20,
             1, 0x1000, 512, 0, 30]
    t = trace_from_words(words)
    assert t.plan_events == (PlanEvent(0, START, 0.0), PlanEvent(1, MARK, 0.02))
    words[2] = 9
    with pytest.raises(TraceFormatError, match="plan event kind 9"):
        trace_from_words(words)
    with pytest.raises(InvalidArgumentError, match="plan_code"):
        build_trace("x", "recorded", [0], [0], [1], [0], [0.0], use_code=2, wait_code=3, plan_code=3)


@pytest.mark.parametrize("engine", ["python"] + (["native"] if load_engine() is not None else []))
def test_a_replay_under_gpumem_makes_the_events_and_models_of_other_allocators_do_not(engine):
    planned = replay_trace(loop_trace(), "sim:h200-141gb", "gpumem", engine=engine, progress=False)
    unplanned = replay_trace(loop_trace(events=False), "sim:h200-141gb", "gpumem", engine=engine, progress=False)
    assert planned.extra["n_plan_events"] == 9 and unplanned.extra["n_plan_events"] == 0
    assert planned.peak_reserved_bytes != unplanned.peak_reserved_bytes or planned.stats != unplanned.stats
    for model in ("pytorch", "expandable", "bestfit"):
        a = replay_trace(loop_trace(), "sim:h200-141gb", model, progress=False)
        b = replay_trace(loop_trace(events=False), "sim:h200-141gb", model, progress=False)
        assert a.extra["n_plan_events"] == 0 and a.peak_reserved_bytes == b.peak_reserved_bytes


def test_a_replay_makes_the_same_calls_as_a_program_marking_by_hand():
    """The replay of a trace with events equals the allocator driven by hand with the same calls."""
    from gpumem import sim
    from gpumem.allocator import CachingAllocator

    t = loop_trace()
    alloc = CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), "gpumem")
    events = {e.at_op: e.kind for e in t.plan_events if e.kind is MARK}
    ptrs = {}
    alloc.start_plan_warmup()
    for i, op in enumerate(t):
        if i in events:
            alloc.mark_step()
        if op.kind is OpKind.ALLOC:
            ptrs[op.alloc_id] = alloc.allocate(op.nbytes, op.stream)
        else:
            alloc.free(ptrs.pop(op.alloc_id))
    by_hand = alloc.snapshot_stats()
    info = alloc.step_plan_info()
    alloc.close()
    replayed = replay_trace(t, "sim:h200-141gb", "gpumem", gpu_timing="idle", progress=False)
    assert info.plans_installed == 1
    assert replayed.peak_reserved_bytes == by_hand.peak_reserved_nbytes


@settings(max_examples=30, deadline=None)
@given(kinds=st.lists(st.sampled_from(list(PlanEventKind)), max_size=12), data=st.data())
def test_any_events_round_trip_through_a_gmt_file(tmp_path_factory, kinds, data):
    t = loop_trace(steps=2, events=False)
    places = sorted(data.draw(st.lists(st.integers(0, t.n_ops), min_size=len(kinds), max_size=len(kinds))))
    times = data.draw(st.lists(st.floats(0, 1e12, allow_nan=False), min_size=len(kinds), max_size=len(kinds)))
    t = dataclasses.replace(t, plan_events=tuple(PlanEvent(p, k, x) for p, k, x in zip(places, kinds, times)))
    path = tmp_path_factory.mktemp("gmt") / "t.gmt.gz"
    save_trace(t, path)
    with gzip.open(path, "rt") as f:
        assert sum(1 for line in f if line.startswith("p ")) == len(kinds)
    assert load_trace(path) == t


def test_a_device_without_virtual_memory_replays_the_ops_alone():
    """A plan's arena needs VMM: mark_step() raises there, so a replay on such a device must not make the
    events (gpumem.torch cannot run there either), rather than fail."""
    a = replay_trace(loop_trace(), "sim:jetson-nano-2gb", "gpumem", progress=False)
    b = replay_trace(loop_trace(events=False), "sim:jetson-nano-2gb", "gpumem", progress=False)
    assert a.extra["n_plan_events"] == 0 and a.peak_reserved_bytes == b.peak_reserved_bytes
