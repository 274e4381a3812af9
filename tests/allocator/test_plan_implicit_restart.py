"""An implicit step restart (Note [An implicit step restart] in gpumem/allocator/plan.py).

Properties: a planned step that has used its last slot and whose next allocation fits slot 0 starts a new
planned step there, as if marked (``implicit_steps``): a step without a mark (GradScaler skipping
``optimizer.step()`` under automatic marks) keeps peak reserved at the figure of the same loop with every
mark, and counts no miss; a program whose marks stop while its steps repeat keeps its plan; the overrun bound
(Note [When marks stop]) counts from the restart, so one doing something else still drops it; no restart after
a step that left the plan, over a live allocation in slot 0, or where ending the step would drop the plan; both
engines decide the same (also ``test_native_differential.py``).
"""

from __future__ import annotations

import pytest

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.allocator.plan import EARLY_LEAVE_STEPS, OVERRUN_FACTOR, MarkResult, StepState
from gpumem.native import load_engine
from gpumem.units import MiB

from test_plan_layer import LOOP, Loop

ENGINES = ["python"] + (["native"] if load_engine() is not None else [])

# LOOP begun at another allocation: its first (5 MiB) does not fit LOOP's slot 0 (3 MiB): no restart on it.
ROTATED = LOOP[2:] + LOOP[:2]


def make(engine: str) -> CachingAllocator:
    return CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), engine=engine)


class MarksAfter(Loop):
    """Steps of a pattern, each marked at its end as the optimizer hook marks (unless told not to); tracks
    the live pointers (``[ptr, size, free_at]``)."""

    def step(self, mark: bool = True, pattern=LOOP, change: dict | None = None, keep: int | None = None) -> MarkResult:
        """One step; ``change``: position -> size instead; ``keep``: that position is not freed (held on)."""
        self.allocations(pattern, change, keep)
        return self.alloc.mark_step() if mark else MarkResult.NOTHING


def skip_loop(engine: str, skipped: set[int], steps: int = 16) -> CachingAllocator:
    alloc = make(engine)
    loop = MarksAfter(alloc)
    for i in range(steps):
        loop.step(mark=i not in skipped)
    alloc.check_consistency()
    return alloc


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("skipped", [{8}, {5, 9, 13}, {6, 7}])
def test_a_step_without_a_mark_restarts_and_peak_reserved_stays_at_the_marked_figure(engine, skipped):
    marked = skip_loop(engine, set())
    alloc = skip_loop(engine, skipped)
    info, clean = alloc.step_plan_info(), marked.step_plan_info()
    assert info.state == StepState.PLANNED and info.plans_installed == 1 and info.plans_dropped == 0
    assert info.implicit_steps == len(skipped) and clean.implicit_steps == 0
    assert info.steps_missed == 0 and info.fallback == 0
    assert info.steps_hit == clean.steps_hit and info.served == clean.served
    assert alloc.stats.peak_reserved_nbytes == marked.stats.peak_reserved_nbytes


@pytest.mark.parametrize("engine", ENGINES)
def test_steps_that_repeat_after_marks_stop_keep_the_plan_and_one_doing_something_else_drops_it(engine):
    alloc = make(engine)
    loop = MarksAfter(alloc)
    for _ in range(6):
        loop.step()
    before = alloc.step_plan_info()
    for _ in range(5 * OVERRUN_FACTOR):   # far past the bound as counted from the last mark
        loop.step(mark=False)
    info = alloc.step_plan_info()
    assert info.state == StepState.PLANNED and info.plans_dropped == 0
    assert info.implicit_steps == 5 * OVERRUN_FACTOR - 1   # the first unmarked step continues the marked one's
    assert info.fallback == 0 and info.steps_missed == 0
    assert info.mapped_nbytes == before.mapped_nbytes
    # the bound counts from the last restart: the last LOOP step and three ROTATED ones are four templates
    for _ in range(OVERRUN_FACTOR - 1):
        loop.step(mark=False, pattern=ROTATED)
    assert alloc.step_plan_info().state == StepState.PLANNED
    loop.step(mark=False, pattern=ROTATED)   # its first allocation passes the bound
    info = alloc.step_plan_info()
    assert info.state == StepState.OFF and info.plans_dropped == 1 and info.implicit_steps == 5 * OVERRUN_FACTOR - 1
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_no_restart_after_a_step_that_left_the_plan(engine):
    alloc = make(engine)
    loop = MarksAfter(alloc)
    for _ in range(6 + EARLY_LEAVE_STEPS):   # past the early steps, where a leave drops (Note [A plan that leaves early])
        loop.step()
    loop.step(mark=False, change={2: 6 * MiB})   # leaves the plan at slot 2
    loop.step()   # its first allocation fits slot 0, but the step left: served by the engine, one miss
    info = alloc.step_plan_info()
    assert info.implicit_steps == 0 and info.steps_missed == 1 and info.fallback == 2 * len(LOOP) - 2
    assert info.state == StepState.PLANNED
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_no_restart_while_a_live_allocation_sits_over_slot_0(engine):
    alloc = make(engine)
    loop = MarksAfter(alloc)
    for _ in range(6 + EARLY_LEAVE_STEPS):   # past the early steps (Note [A plan that leaves early])
        loop.step()
    loop.step(mark=False, keep=0)   # slot 0's allocation is held on
    before = alloc.step_plan_info()
    loop.step()
    info = alloc.step_plan_info()
    assert info.implicit_steps == 0 and info.steps_missed == before.steps_missed + 1
    assert info.fallback == before.fallback + len(LOOP)
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("first_missed", [False, True])
def test_a_restart_that_would_drop_the_plan_is_not_made(engine, first_missed):
    """Two missed steps, then one missed without leaving the plan (slot 1 still taken by the step before's
    kept block) and not marked: ending it would be the third miss in a row, so no restart; the mark after the
    next step counts the long step missed and drops the plan. With the first step a hit, the restart is made."""
    alloc = make(engine)
    loop = MarksAfter(alloc)
    for _ in range(6 + EARLY_LEAVE_STEPS):   # past the early steps (Note [A plan that leaves early])
        loop.step()
    loop.step(change={3: 4000} if first_missed else None)   # a miss (left at slot 3) or a hit
    loop.step(keep=1, change={3: 4000})   # a miss; its slot 1 allocation stays live
    missed = alloc.step_plan_info().steps_missed
    assert missed == 1 + first_missed
    loop.step(mark=False)   # slot 1 taken by the step before's: missed, not left
    r = loop.step()
    info = alloc.step_plan_info()
    if first_missed:
        assert info.implicit_steps == 0 and r == MarkResult.DROPPED and info.plans_dropped == 1
    else:
        assert info.implicit_steps == 1 and r == MarkResult.NOTHING and info.plans_dropped == 0
        assert info.steps_missed == missed + 1   # the restarted one's predecessor; the restarted step hit
    alloc.check_consistency()


class ShortSteps(MarksAfter):
    """Steps that may stop after their first ``made`` allocations (GradScaler skipping the update: none of the
    optimizer's temporaries) while every block made is freed where a full step frees it: the clock ticks on."""

    def short_step(self, made: int) -> MarkResult:
        for j, (size, stream, life) in enumerate(LOOP):
            self.free_due()
            self.clock += 1
            if j < made:
                ptr = self.alloc.allocate(size, stream)
                self.live.append([ptr, size, self.clock + life])
        return self.alloc.mark_step()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_marked_step_that_ends_early_on_its_slots_is_a_hit_and_keeps_the_plan(engine):
    """Note [A step that ends early]: every other step stops after 3 of LOOP's 7 allocations, each on its slot.
    Counted missed (before), four of eight dropped the plan and its neighbours were served beside the arena."""
    alloc, full = make(engine), make(engine)
    loop, ref = ShortSteps(alloc), ShortSteps(full)
    for i in range(24):
        loop.short_step(3) if i >= 6 and i % 2 else loop.step()
        ref.step()
    info = alloc.step_plan_info()
    assert info.state == StepState.PLANNED and info.plans_installed == 1 and info.plans_dropped == 0
    assert info.steps_missed == 0 and info.fallback == 0 and info.implicit_steps == 0
    assert alloc.stats.peak_reserved_nbytes == full.stats.peak_reserved_nbytes
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_short_step_that_is_not_the_templates_prefix_still_leaves_the_plan(engine):
    """A step whose third allocation is not its slot's size leaves the plan (a miss) however short it is."""
    alloc = make(engine)
    loop = MarksAfter(alloc)
    for _ in range(4 + EARLY_LEAVE_STEPS):   # past the early steps (Note [A plan that leaves early])
        loop.step()
    before = alloc.step_plan_info()
    loop.step(pattern=LOOP[:2] + [(64 * MiB, 0, 1)])
    info = alloc.step_plan_info()
    assert info.steps_missed == before.steps_missed + 1 and info.steps_hit == before.steps_hit
