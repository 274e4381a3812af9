"""Step plans when marks stop (Note [When marks stop] in gpumem/allocator/plan.py; review attacker 11, F1 and F2).

Properties: a recording holds at most its limit of records however many allocations come without a mark
(counted, not timed); a planned step that runs past four templates drops the plan and its arena goes back,
so the memory held returns to what the same program holds unmarked; ``empty_cache`` gives back the arena's
runs that nothing live touches and the plan goes on serving; marks that resume plan again; bad limits raise
and change nothing; both engines decide the same.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.allocator.plan import OVERRUN_FACTOR, RECORD_LIMIT, MarkResult, StepState
from gpumem.errors import InvalidArgumentError
from gpumem.native import load_engine
from gpumem.units import MiB
from test_native_differential import Pair

from test_plan_layer import LOOP, Loop, check_no_overlap

ENGINES = ["python"] + (["native"] if load_engine() is not None else [])


def make(engine: str, record_limit: int | None = None, early_leave_steps: int | None = None,
         **kw) -> CachingAllocator:
    """As ``test_plan_layer.make``: ``early_leave_steps`` 0 for the tests whose plans a leaving step must not drop
    at once (these are of the overrun and record bounds, Note [When marks stop]), None for the default."""
    alloc = CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), engine=engine, **kw)
    if early_leave_steps is not None:
        alloc._engine.set_early_leave_steps(early_leave_steps)   # noqa: SLF001
    if record_limit is not None:
        alloc._engine.set_step_record_limit(record_limit)   # noqa: SLF001
    return alloc


class UnmarkedLoop(Loop):
    """:class:`Loop` whose steps may skip their mark (the program stopped marking)."""

    def steps(self, n: int, mark: bool = False, pattern=LOOP) -> None:
        for _ in range(n):
            if mark:
                self.step(pattern)
                continue
            for size, stream, life in pattern:
                self.free_due()
                self.clock += 1
                ptr = self.alloc.allocate(size, stream)
                check_no_overlap(self.live, ptr, size)
                self.live.append([ptr, size, self.clock + life])

    def drain(self) -> None:
        """Free everything still live."""
        self.clock += 1 << 40
        self.free_due()


def churn(alloc: CachingAllocator, n: int) -> None:
    """``n`` allocate/free pairs of small sizes (the review's loop)."""
    for i in range(n):
        alloc.free(alloc.allocate(512 + (i % 7) * 512))


# -- F1: the recording ------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("marks", [1, 2])   # stopped in RECORDING, in RECORDING_NEXT
def test_a_recording_with_no_mark_holds_at_most_its_limit_of_records(engine, marks):
    alloc = make(engine, record_limit=100)
    for i in range(marks):
        alloc.mark_step()
        alloc.free(alloc.allocate((i + 1) * MiB))   # steps that differ: nothing planned
    assert alloc.step_plan_info().state == (StepState.RECORDING if marks == 1 else StepState.RECORDING_NEXT)
    seen = []
    for _ in range(20):
        churn(alloc, 50)
        seen.append(alloc.step_plan_info().records)
    info = alloc.step_plan_info()
    assert max(seen) <= 2 * 100
    assert info.records == 0 and info.state == StepState.OFF and info.recordings_abandoned == 1
    alloc.check_consistency()
    # marks that come back start over and plan
    loop = Loop(alloc)
    for _ in range(5):
        loop.step()
    info = alloc.step_plan_info()
    assert info.state == StepState.PLANNED and info.plans_installed == 1 and info.steps_hit >= 1
    assert info.recordings_abandoned == 1


@pytest.mark.skipif("native" not in ENGINES, reason="the native engine is not built")
def test_the_default_limit_stops_the_recording_at_two_to_the_eighteen_records():
    alloc = make("native")
    alloc.mark_step()
    churn(alloc, RECORD_LIMIT)
    assert alloc.step_plan_info().records == RECORD_LIMIT
    churn(alloc, 1)
    info = alloc.step_plan_info()
    assert info.records == 0 and info.recordings_abandoned == 1 and info.state == StepState.OFF


@pytest.mark.parametrize("engine", ENGINES)
def test_steps_longer_than_the_limit_are_recorded_never_and_run_as_unmarked(engine):
    """A program whose every step passes the limit: each mark starts over, each step abandons; the layer
    never plans and never holds more than the limit."""
    alloc = make(engine, record_limit=5)
    loop = Loop(alloc)
    for i in range(6):
        assert loop.step() == MarkResult.NOTHING   # 7 allocations a step
        assert alloc.step_plan_info().records <= 2 * 5
    info = alloc.step_plan_info()
    assert info.plans_installed == 0 and info.recordings_abandoned == 6
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_lowering_the_limit_mid_step_abandons_at_the_next_allocation(engine):
    alloc = make(engine)
    alloc.mark_step()
    churn(alloc, 30)
    assert alloc.step_plan_info().records == 30
    alloc._engine.set_step_record_limit(10)   # noqa: SLF001
    assert alloc.step_plan_info().records == 30   # nothing changes until an allocation
    churn(alloc, 1)
    assert alloc.step_plan_info().records == 0 and alloc.step_plan_info().recordings_abandoned == 1


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("bad", [0, -1, 1 << 41, 2.5, "8", None])
def test_a_bad_record_limit_raises_and_changes_nothing(engine, bad):
    alloc = make(engine, record_limit=3)
    alloc.mark_step()
    churn(alloc, 3)
    with pytest.raises(InvalidArgumentError, match="records"):
        alloc._engine.set_step_record_limit(bad)   # noqa: SLF001
    assert alloc.step_plan_info().records == 3
    churn(alloc, 1)   # the limit of 3 still holds
    assert alloc.step_plan_info().recordings_abandoned == 1


# -- F2: the plan -----------------------------------------------------------------------------------------

# LOOP begun at another allocation: its first one (5 MiB) does not fit LOOP's slot 0 (3 MiB), so a plan of LOOP
# never restarts on it (Note [An implicit step restart]): a program that does something else once marks stop.
ROTATED = LOOP[2:] + LOOP[:2]


def unmarked_figures(engine: str, loop_steps: int, rotated_steps: int) -> tuple[int, int]:
    """(reserved, reserved after empty_cache) of :data:`LOOP` run ``loop_steps`` times, then :data:`ROTATED`
    ``rotated_steps`` times, with no mark at all."""
    alloc = make(engine)
    loop = UnmarkedLoop(alloc)
    loop.steps(loop_steps)
    loop.steps(rotated_steps, pattern=ROTATED)
    loop.drain()
    reserved = alloc.snapshot_stats().reserved_nbytes
    alloc.empty_cache()
    return reserved, alloc.snapshot_stats().reserved_nbytes


@pytest.mark.parametrize("engine", ENGINES)
def test_a_plan_whose_marks_stop_is_dropped_and_memory_returns_to_the_unmarked_figure(engine):
    alloc = make(engine, early_leave_steps=0)
    loop = UnmarkedLoop(alloc)
    loop.steps(6, mark=True)
    info = alloc.step_plan_info()
    assert info.state == StepState.PLANNED and info.mapped_nbytes > 0
    loop.steps(OVERRUN_FACTOR - 1, pattern=ROTATED)   # with the last marked step, four templates' worth: not past
    assert alloc.step_plan_info().state == StepState.PLANNED
    loop.steps(1, pattern=ROTATED)   # its first allocation passes it
    info = alloc.step_plan_info()
    assert info.state == StepState.OFF and info.plans_dropped == 1 and info.records == 0
    loop.steps(20, pattern=ROTATED)
    loop.drain()
    info = alloc.step_plan_info()
    assert info.mapped_nbytes == 0 and info.live_nbytes == 0 and info.implicit_steps == 0
    reserved = alloc.snapshot_stats().reserved_nbytes
    alloc.empty_cache()
    assert (reserved, alloc.snapshot_stats().reserved_nbytes) == unmarked_figures(engine, 6, OVERRUN_FACTOR + 20)
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_long_pass_between_two_marks_drops_the_plan_and_training_is_planned_again(engine):
    """An evaluation pass (other sizes, many of them) between two marks: nothing breaks, no two live
    allocations overlap, and three marks after training resumes the plan serves again."""
    alloc = make(engine, early_leave_steps=0)
    loop = UnmarkedLoop(alloc)
    loop.steps(5, mark=True)
    assert alloc.step_plan_info().steps_hit >= 1
    evaluation = [(6 * MiB, 0, 1), (2 * MiB, 0, 2), (300, 0, 1)]
    loop.steps(40, pattern=evaluation)
    info = alloc.step_plan_info()
    assert info.state == StepState.OFF and info.plans_dropped == 1
    loop.steps(6, mark=True)
    info = alloc.step_plan_info()
    assert info.state == StepState.PLANNED and info.plans_installed == 2 and info.steps_hit >= 2
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_dropped_arena_keeps_a_block_live_past_the_drop_until_its_free(engine):
    alloc = make(engine, early_leave_steps=0)
    loop = UnmarkedLoop(alloc)
    loop.steps(5, mark=True)
    kept = loop.live[-1]   # an arena allocation that lives into the next step
    loop.live.remove(kept)
    loop.steps(OVERRUN_FACTOR + 1, pattern=ROTATED)
    info = alloc.step_plan_info()
    assert info.state == StepState.OFF and 0 < info.mapped_nbytes and info.live_nbytes > 0
    alloc.free(kept[0])
    assert alloc.step_plan_info().mapped_nbytes == 0
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_empty_cache_gives_back_the_arena_runs_nothing_live_touches_and_the_plan_serves_on(engine):
    alloc = make(engine)
    loop = UnmarkedLoop(alloc)
    loop.steps(6, mark=True)
    before = alloc.step_plan_info()
    loop.drain()   # nothing live in the arena: every run is idle
    released = alloc.empty_cache()
    info = alloc.step_plan_info()
    assert info.state == StepState.PLANNED and info.mapped_nbytes == 0
    assert released >= before.mapped_nbytes
    loop.steps(3, mark=True)   # the slots map their pages again and serve
    after = alloc.step_plan_info()
    assert after.state == StepState.PLANNED and after.plans_dropped == 0
    assert after.steps_hit - before.steps_hit == 3 and after.mapped_nbytes == before.mapped_nbytes
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_empty_cache_keeps_the_runs_of_live_arena_allocations(engine):
    alloc = make(engine)
    loop = UnmarkedLoop(alloc)
    loop.steps(6, mark=True)
    live = alloc.step_plan_info().live_nbytes
    assert live > 0
    alloc.empty_cache()
    info = alloc.step_plan_info()
    assert info.live_nbytes == live and 0 < info.mapped_nbytes
    loop.steps(3, mark=True)
    assert alloc.step_plan_info().plans_dropped == 0
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_plan_whose_marks_stop_with_no_allocation_goes_back_at_empty_cache(engine):
    """CUDA-graph replay after the warm-up marked: no mark, no allocation; empty_cache gives the arena's
    pages back (what is left of F2: Note [When marks stop])."""
    alloc = make(engine)
    loop = UnmarkedLoop(alloc)
    loop.steps(6, mark=True)
    loop.drain()
    assert alloc.step_plan_info().mapped_nbytes > 0
    alloc.empty_cache()
    assert alloc.step_plan_info().mapped_nbytes == 0 and alloc.snapshot_stats().reserved_nbytes == 0


# -- both engines decide the same -------------------------------------------------------------------------

@pytest.mark.skipif(len(ENGINES) < 2, reason="the native engine is not built")
@given(phases=st.lists(st.tuples(st.sampled_from(["marked", "unmarked", "churn", "empty_cache"]), st.integers(1, 8)),
                       min_size=2, max_size=10))
@settings(max_examples=40, deadline=None)
def test_native_and_python_decide_the_same_when_marks_stop(phases):
    pair = Pair(lambda: sim.SimDevice(sim.get_profile("h200-141gb")))
    for alloc in pair.allocs:
        alloc._engine.set_step_record_limit(20)   # noqa: SLF001
    clock, live = 0, []

    def step(mark: bool) -> None:
        nonlocal clock
        if mark:
            pair.both("mark_step")
        for size, stream, life in LOOP:
            for e in [e for e in live if e[1] <= clock]:
                pair.both("free", e[0])
                live.remove(e)
            clock += 1
            r = pair.both("allocate", size, stream)
            live.append([r[1], clock + life])

    for what, n in [("marked", 4)] + phases:
        if what == "empty_cache":
            pair.both("empty_cache")
        elif what == "churn":
            for i in range(n * 5):
                r = pair.both("allocate", 512 + (i % 7) * 512)
                pair.both("free", r[1])
        else:
            for _ in range(n):
                step(what == "marked")
        pair.both("step_plan_info")
        pair.both("check_consistency")
    pair.both("close")
