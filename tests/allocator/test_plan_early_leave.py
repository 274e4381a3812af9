"""A plan that leaves early (Note [A plan that leaves early] in gpumem/allocator/plan.py).

Properties: a planned step that first leaves its plan (a slot's size differs) within the plan's first
EARLY_LEAVE_STEPS planned steps drops it at that allocation, the layer recording again and the dropped arena's
idle runs given back; at most EARLY_DROPS such drops in a row, after which the miss rules alone decide, until a
plan lives EARLY_LEAVE_STEPS planned steps; a leave later than that, or a miss (not a leave), drops nothing at
once; a plan installed mid-step (allocations between the mark and the install) is not dropped by the partial
step it begins in, nor by a request that can never fit; the bound is a setting of each engine
(``set_early_leave_steps``, 0: never), bad values refused; both engines decide the same (also
``test_native_differential.py``).
"""

from __future__ import annotations

import pytest

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.allocator.plan import EARLY_DROPS, EARLY_LEAVE_STEPS, StepState
from gpumem.errors import InternalError, InvalidArgumentError, OutOfMemoryError
from gpumem.native import load_engine
from gpumem.units import MiB

from test_plan_layer import LOOP, Loop

ENGINES = ["python"] + (["native"] if load_engine() is not None else [])
LEAVE = {2: 6 * MiB}   # LOOP's third allocation made larger than its slot (5 MiB): the step leaves the plan


def make(engine: str) -> CachingAllocator:
    return CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), engine=engine)


def until_planned(loop: Loop, most: int = 12) -> int:
    """LOOP steps until a plan is installed; the steps it took."""
    for i in range(most):
        loop.step()
        if loop.alloc.step_plan_info().state is StepState.PLANNED:
            return i + 1
    raise AssertionError("no plan formed")


def leave(loop: Loop) -> None:
    """Mark, then LOOP's first allocations up to the one that leaves the plan (the rest of the step follows)."""
    loop.alloc.mark_step()
    loop.allocations(LOOP[:3], LEAVE)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_step_that_leaves_a_new_plan_drops_it_at_once_and_gives_its_idle_pages_back(engine):
    alloc = make(engine)
    loop = Loop(alloc)
    until_planned(loop)
    loop.step()   # one planned step, a hit: the arena's pages are mapped
    before = alloc.step_plan_info()
    assert before.mapped_nbytes > 0 and before.plans_dropped == 0
    leave(loop)
    info = alloc.step_plan_info()
    assert info.state is StepState.RECORDING and info.plans_dropped == 1
    assert info.mapped_nbytes < before.mapped_nbytes   # the runs no live allocation touches went back
    loop.allocations(LOOP[3:])
    until_planned(loop)   # the layer records again and a new plan forms
    for _ in range(3):
        loop.step()
    info = alloc.step_plan_info()
    assert info.state is StepState.PLANNED and info.plans_installed == 2 and info.steps_missed == 0
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_early_drops_stop_after_a_bound_until_a_plan_lives(engine):
    alloc = make(engine)
    loop = Loop(alloc)
    for k in range(EARLY_DROPS):
        until_planned(loop)
        leave(loop)
        loop.allocations(LOOP[3:])
        assert alloc.step_plan_info().plans_dropped == k + 1
    until_planned(loop)
    leave(loop)   # the bound is met: this plan stays, the step counted a miss at its end
    loop.allocations(LOOP[3:])
    info = alloc.step_plan_info()
    assert info.state is StepState.PLANNED and info.plans_dropped == EARLY_DROPS
    for _ in range(EARLY_LEAVE_STEPS + 2):   # the plan lives EARLY_LEAVE_STEPS planned steps: the count resets
        loop.step()
    for _ in range(3):   # three misses in a row drop it at the mark after them (Note [Step plans])
        loop.step(change=LEAVE)
    loop.step()
    assert alloc.step_plan_info().plans_dropped == EARLY_DROPS + 1
    until_planned(loop)
    leave(loop)
    info = alloc.step_plan_info()
    assert info.state is StepState.RECORDING and info.plans_dropped == EARLY_DROPS + 2
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_leave_after_the_early_steps_or_a_miss_drops_nothing_at_once(engine):
    alloc = make(engine)
    loop = Loop(alloc)
    until_planned(loop)
    for _ in range(EARLY_LEAVE_STEPS):
        loop.step()
    leave(loop)
    info = alloc.step_plan_info()
    assert info.state is StepState.PLANNED and info.plans_dropped == 0
    loop.allocations(LOOP[3:])
    alloc.check_consistency()
    alloc2 = make(engine)   # a miss (a kept block over a slot) is no leave
    loop2 = Loop(alloc2)
    until_planned(loop2)
    loop2.step(keep=0)
    loop2.step()
    assert alloc2.step_plan_info().plans_dropped == 0
    alloc2.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_give_back_that_fails_in_an_early_drop_serves_the_request_and_the_next_mark_retries(engine):
    """Attacker 44: a failed mem_unmap during the early drop's give-back failed the program's allocation, which
    before the rule was served by the engine with no device call. Now the request is served, the runs stay held,
    and the next mark gives them back; a lost device still raises."""
    from gpumem.errors import CudaError, DeviceLostError

    for error, raises in ((CudaError("mem_unmap", "CUDA_ERROR_UNKNOWN", "injected"), False),
                          (DeviceLostError("injected: the device fell off the bus"), True)):
        dev = sim.SimDevice(sim.get_profile("h200-141gb"))
        alloc = CachingAllocator(dev, engine=engine)
        loop = Loop(alloc)
        until_planned(loop)
        loop.step()
        alloc.mark_step()
        loop.allocations(LOOP[:2])
        real = dev.mem_unmap

        def failing(*args, error=error):
            raise error

        dev.mem_unmap = failing
        try:
            if raises:
                with pytest.raises(DeviceLostError):
                    alloc.allocate(6 * MiB, 0)
                continue
            ptr = alloc.allocate(6 * MiB, 0)   # leaves the plan: the early drop's give-back fails
        finally:
            dev.mem_unmap = real
        held = alloc.step_plan_info()
        assert ptr and held.state is StepState.RECORDING and held.plans_dropped == 1 and held.mapped_nbytes > 0
        alloc.free(ptr)
        loop.allocations(LOOP[3:])
        alloc.check_consistency()
        alloc.mark_step()   # the retry: what nothing touches goes back
        assert alloc.step_plan_info().mapped_nbytes < held.mapped_nbytes
        alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("steps", "drops"), [(4, True), (3, False), (0, False)])
def test_the_early_leave_bound_is_a_setting_and_zero_turns_the_drop_off(engine, steps, drops):
    """``set_early_leave_steps``: a leave while fewer than ``steps`` planned steps have ended drops the plan; 0,
    never (the miss rules alone). The leave here comes after three planned steps (the partial step the plan was
    installed in and two more): a bound of 4 drops it, 3 does not."""
    alloc = make(engine)
    alloc._engine.set_early_leave_steps(steps)   # noqa: SLF001
    loop = Loop(alloc)
    until_planned(loop)
    loop.step()
    loop.step()   # two planned steps, hits
    leave(loop)
    info = alloc.step_plan_info()
    assert info.plans_dropped == (1 if drops else 0)
    assert info.state is (StepState.RECORDING if drops else StepState.PLANNED)
    loop.allocations(LOOP[3:])
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("bad", [-1, 1 << 41, True, 2.0, "16", None])
def test_a_bad_early_leave_bound_is_refused_and_the_bound_kept(engine, bad):
    """A bound that is not an int in [0, 2**40] raises InvalidArgumentError naming it; the default bound stays
    (a leave at the first planned step still drops the plan)."""
    alloc = make(engine)
    with pytest.raises(InvalidArgumentError, match="early_leave_steps"):
        alloc._engine.set_early_leave_steps(bad)   # noqa: SLF001
    loop = Loop(alloc)
    until_planned(loop)
    leave(loop)
    assert alloc.step_plan_info().plans_dropped == 1


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("over", ["limit", "device"])
def test_a_request_that_can_never_fit_is_refused_and_the_plan_kept(engine, over):
    """A request larger than the limit or the device is refused at once (out of memory) and is no leave: the plan a
    planned step early in its life holds stays installed (attacker 45, F2: it was dropped, and the limit's error no
    longer named the plan's arena)."""
    alloc = CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), engine=engine, limit=400 * MiB)
    loop = Loop(alloc)
    until_planned(loop)
    loop.step()
    alloc.mark_step()
    loop.allocations(LOOP[:2])
    before = alloc.step_plan_info()
    nbytes = 401 * MiB if over == "limit" else alloc.device.properties().total_nbytes + 1
    with pytest.raises(OutOfMemoryError) as err:
        alloc.allocate(nbytes)
    info = alloc.step_plan_info()
    assert info.state is StepState.PLANNED and info.plans_dropped == 0 == before.plans_dropped
    assert info.mapped_nbytes == before.mapped_nbytes
    if over == "limit":   # the limit's message says what the plans hold
        assert "step plan" in str(err.value)
    loop.allocations(LOOP[2:])
    alloc.mark_step()
    assert alloc.step_plan_info().state is StepState.PLANNED
    alloc.check_consistency()


@pytest.mark.skipif("native" not in ENGINES, reason="the native engine is not built")
@pytest.mark.parametrize("setter", ["set_early_leave_steps", "set_step_record_limit"])
def test_a_setting_changed_from_inside_a_device_call_raises_and_is_kept(setter):
    """A setter re-entered from a device call inside an allocation (a finalizer, a Python device) raises
    InternalError in the native engine, the setting unchanged (attacker 45, F1: a C++ exception unwound through
    Python and crashed the interpreter)."""
    dev = sim.SimDevice(sim.get_profile("h200-141gb"))
    alloc = CachingAllocator(dev, engine="native")
    real, seen = dev.mem_create, []

    def mem_create(*args):
        if not seen:
            try:
                getattr(alloc._engine, setter)(1)   # noqa: SLF001
            except BaseException as exc:   # noqa: BLE001 - what the call raised is the test's subject
                seen.append(exc)
        return real(*args)

    dev.mem_create = mem_create
    alloc.free(alloc.allocate(64 * MiB))
    assert len(seen) == 1 and isinstance(seen[0], InternalError) and "re-enter" in str(seen[0])
    alloc.check_consistency()
    # the early-leave bound kept its default: a leave at the first planned step still drops the plan
    loop = Loop(alloc)
    until_planned(loop)
    leave(loop)
    assert alloc.step_plan_info().plans_dropped == 1


class _FakeInt:
    """An object that says its class is ``int`` (attacker 45, F4: the Python engine stored it as it was, the native
    one raised TypeError)."""

    __class__ = int   # type: ignore[assignment]

    def __ge__(self, other: object) -> bool:
        return True

    def __le__(self, other: object) -> bool:
        return True


@pytest.mark.parametrize("engine", ENGINES)
def test_a_fake_int_bound_is_refused_by_both_engines_and_the_bound_kept(engine):
    alloc = make(engine)
    with pytest.raises(InvalidArgumentError, match="early_leave_steps"):
        alloc._engine.set_early_leave_steps(_FakeInt())   # noqa: SLF001
    loop = Loop(alloc)
    until_planned(loop)
    leave(loop)
    assert alloc.step_plan_info().plans_dropped == 1
