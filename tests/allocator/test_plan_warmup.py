"""The memory-first warm-up before a step plan forms (Note [A memory-first warm-up] in gpumem/allocator/plan.py),
on both engines: what begins it, what ends it, and that while it is on the engine decides as the memory-first
policy does."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem import sim
from gpumem.allocator import CachingAllocator
from gpumem.allocator.plan import WARMUP_ALLOCS, WARMUP_MARKS, MarkResult, PlanInfo
from gpumem.allocator.policy import get_policy
from gpumem.errors import InvalidArgumentError, UnsupportedOperationError
from gpumem.native import load_engine
from gpumem.units import MiB

from test_plan_layer import LOOP, Loop

ENGINES = ["python"] + (["native"] if load_engine() is not None else [])
DEFAULT = get_policy("gpumem")
MEMORY_FIRST = dataclasses.replace(DEFAULT, name="memory-first", chunk_max_fraction=1 / 4096, page_slack=0.0,
                                   page_slack_min_nbytes=0, stream_ordered_steal=True, plan_warmup=False)
"""What the warm-up grows as: chunks of 1/4096 of what is held (one page under 8 GiB held), no page slack, the
stream-ordered steal."""


def make(engine: str, policy=DEFAULT, **kw) -> CachingAllocator:
    return CachingAllocator(sim.SimDevice(sim.get_profile("h200-141gb")), policy, engine=engine, **kw)


def warmup(alloc: CachingAllocator) -> bool:
    return bool(alloc.step_plan_info().warmup)


# A program: (size, stream) allocations, each freed some allocations later; enough growth to move chunks.
PROGRAMS = st.lists(st.tuples(st.sampled_from([512, 700, 1 * MiB + 5, 2 * MiB, 3 * MiB, 5 * MiB, 9 * MiB, 40 * MiB]),
                              st.sampled_from([0, 0, 0, 7]), st.integers(1, 12)), min_size=1, max_size=300)


def run_program(alloc: CachingAllocator, program) -> None:
    live: list[tuple[int, int]] = []   # (ptr, free at)
    for clock, (size, stream, life) in enumerate(program):
        for e in [e for e in live if e[1] <= clock]:
            alloc.free(e[0])
            live.remove(e)
        live.append((alloc.allocate(size, stream), clock + life))
    for ptr, _ in live:
        alloc.free(ptr)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=40, deadline=None)
@given(program=PROGRAMS)
def test_while_warm_the_engine_decides_as_the_memory_first_policy(engine, program):
    warm, first = make(engine), make(engine, MEMORY_FIRST)
    assert warm.start_plan_warmup() and warmup(warm)
    run_program(warm, program)
    run_program(first, program)
    a, b = warm.stats, first.stats
    assert (a.peak_reserved_nbytes, a.device_calls, a.event_calls, a.reserved_nbytes) == \
        (b.peak_reserved_nbytes, b.device_calls, b.event_calls, b.reserved_nbytes)
    assert warmup(warm)   # no mark, under WARMUP_ALLOCS allocations: still on
    warm.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_while_warm_with_gigabytes_held_chunks_grow_with_what_is_held(engine):
    """Past 8 GiB held a warm chunk holds 1/4096 of it: one-page chunks made every steal scan all of them, about
    166 ms of engine time an operation at 27 GB held (attacker 14, F1)."""
    program = [(s * 1024 * MiB + 700, st, life) for s, st, life in   # 20 GiB of weights, then the steps' churn
               [(20, 0, 100), (3, 0, 4), (2, 7, 2), (5, 0, 3), (1, 7, 1), (4, 0, 5), (2, 0, 2), (6, 7, 3), (3, 0, 2)]]
    one_page = dataclasses.replace(MEMORY_FIRST, chunk_max_fraction=0.0)
    warm, first, pages = make(engine), make(engine, MEMORY_FIRST), make(engine, one_page)
    warm.start_plan_warmup()
    for a in (warm, first, pages):
        run_program(a, program)
    a, b, c = warm.stats, first.stats, pages.stats
    assert (a.peak_reserved_nbytes, a.device_calls, a.event_calls) == (b.peak_reserved_nbytes, b.device_calls, b.event_calls)
    assert a.peak_reserved_nbytes > 20 * 1024 * MiB and a.device_calls < 0.75 * c.device_calls   # fewer, larger chunks
    warm.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_the_first_mark_begins_it_and_the_plan_ends_it(engine):
    alloc = make(engine)
    loop = Loop(alloc)
    loop.allocations()   # unmarked: the default policy's decisions
    assert not warmup(alloc)
    results = []
    for _ in range(5):
        results.append(loop.step())
        if alloc.step_plan_info().plans_installed == 0:
            assert warmup(alloc)
    assert MarkResult.READY in results and alloc.step_plan_info().plans_installed == 1
    assert not warmup(alloc)
    assert not alloc.start_plan_warmup()   # one warm-up per allocator: it ran
    alloc.check_consistency()


@pytest.mark.parametrize("give_back", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
def test_it_ends_at_the_eighth_mark_when_no_plan_forms(engine, give_back):
    """The 8th mark with no plan ends it; with ``warmup_give_back`` (the default) the idle cache goes back at once,
    its one-page chunks with it; without, what it grew stays and the mark makes no device call."""
    alloc = make(engine, dataclasses.replace(DEFAULT, warmup_give_back=give_back))
    loop = Loop(alloc)
    for i in range(WARMUP_MARKS + 2):
        if i + 1 == WARMUP_MARKS:
            loop.free_due()
            idle = alloc.reserved_nbytes - sum(n for _, n in alloc.live_blocks())
            assert idle > 0
            before, calls = alloc.reserved_nbytes, alloc.stats.device_calls
            alloc.mark_step()   # the 8th: over
            assert not warmup(alloc)
            if give_back:
                assert alloc.reserved_nbytes < before and alloc.stats.device_calls > calls
            else:
                assert (alloc.reserved_nbytes, alloc.stats.device_calls) == (before, calls)
            loop.allocations(change={0: (3 + i) * MiB})
            continue
        loop.step(change={0: (3 + i) * MiB})   # every step differs: never READY
        assert warmup(alloc) == (i + 1 < WARMUP_MARKS), i
    assert alloc.step_plan_info().plans_installed == 0
    assert not alloc.start_plan_warmup()
    alloc.check_consistency()


def _busy_steal_program(alloc: CachingAllocator, device: sim.SimDevice) -> int:
    """A kernel still reads block A on stream 0 when A is freed; a block of stream 0 then needs two pages more
    than are held idle: the reserved bytes after it (test_allocator_streams' steal scenario)."""
    a = alloc.allocate(2 * MiB)
    x = alloc.allocate(2 * MiB)   # stays live: A's free block is not the range's tail
    work = device.launch(0, 1.0, touches=[(a, 2 * MiB)])
    alloc.free(a)
    b = alloc.allocate(4 * MiB)
    assert not work.done
    reserved = alloc.reserved_nbytes
    alloc.free(b)
    alloc.free(x)
    return reserved


def _warm_then_busy(engine: str, policy, how: str) -> int:
    """An allocator whose warm-up ``how`` ("no plan": 8 marks of steps that differ; "plan": a repeating loop
    planned at its third mark; "stopped" by hand; "never" begun), then :func:`_busy_steal_program`'s reserved
    bytes; the sanitizer sees no hazard."""
    device = sim.SimDevice(sim.get_profile("h200-141gb"))
    alloc = CachingAllocator(device, policy, engine=engine)
    if how in ("no plan", "plan"):
        for i in range(WARMUP_MARKS if how == "no plan" else 3):
            alloc.mark_step()
            alloc.free(alloc.allocate(512 * (i + 1) if how == "no plan" else 512))   # steps that differ, or not
        assert alloc.step_plan_info().plans_installed == (how == "plan")
    elif how == "stopped":
        alloc.start_plan_warmup()
        assert alloc.stop_plan_warmup()
    assert not warmup(alloc)
    reserved = _busy_steal_program(alloc, device)   # after a plan: its 2 MiB misses the 512 B slot, the engine serves
    alloc.check_consistency()
    alloc.close()
    assert not device.hazards
    return reserved


@pytest.mark.parametrize("engine", ENGINES)
def test_a_warmup_that_ends_leaves_the_ordered_steal_on(engine):
    """Note [The ordered steal after a warm-up]: once the warm-up has ended, with a plan or none, memory freed on a
    stream whose work is still queued serves that stream's next block at once (``steal_after_warmup``, the
    default), where the policy's own knobs (here the ``busy_slack`` rule with no bound) create memory instead; a
    warm-up stopped by hand, or one that never ran, is ``steal_before_warmup``'s (here off: the policy's knobs)."""
    knobs = dict(page_slack=0.0, page_slack_min_nbytes=0, busy_slack=float("inf"), steal_before_warmup=False)
    on = dataclasses.replace(DEFAULT, steal_after_warmup=True, **knobs)
    off = dataclasses.replace(DEFAULT, steal_after_warmup=False, **knobs)
    for how in ("stopped", "never"):
        assert _warm_then_busy(engine, on, how) == _warm_then_busy(engine, off, how) == 8 * MiB   # grown past it
    assert _warm_then_busy(engine, on, "no plan") == 6 * MiB   # stolen in stream order, not grown
    assert _warm_then_busy(engine, off, "no plan") == 8 * MiB
    assert _warm_then_busy(engine, off, "plan") - _warm_then_busy(engine, on, "plan") == 2 * MiB


@pytest.mark.parametrize("engine", ENGINES)
def test_no_warmup_yet_or_one_stopped_has_the_ordered_steal_before(engine):
    """Note [The ordered steal before a warm-up]: a program that never began a warm-up, or stopped it by hand,
    steals in stream order where ``steal_before_warmup`` (on by default) says so, where the policy's own knobs
    create memory; once a warm-up has ended, only ``steal_after_warmup`` decides."""
    knobs = dict(page_slack=0.0, page_slack_min_nbytes=0, busy_slack=float("inf"))
    before = dataclasses.replace(DEFAULT, steal_before_warmup=True, steal_after_warmup=False, **knobs)
    neither = dataclasses.replace(DEFAULT, steal_before_warmup=False, steal_after_warmup=False, **knobs)
    for how in ("stopped", "never"):
        assert _warm_then_busy(engine, before, how) == 6 * MiB   # stolen in stream order, not grown
        assert _warm_then_busy(engine, neither, how) == 8 * MiB
    # a warm-up that ended: not "before" any more, with a plan or none
    assert _warm_then_busy(engine, before, "no plan") == _warm_then_busy(engine, neither, "no plan") == 8 * MiB
    assert _warm_then_busy(engine, before, "plan") == _warm_then_busy(engine, neither, "plan")


def _unmarked_busy_program(engine: str, policy, n: int = 3000):
    """``n`` allocations of seven sizes, whole pages, on stream 0, each touched by a kernel still queued when it is freed two
    allocations later, never a mark: memory past the held pages comes from busy chunks (a stream-ordered steal) or
    is grown. The allocator's stats, its backing's counters (and, on the Python engine, ``before_steals`` and
    ``before_ended``)."""
    device = sim.SimDevice(sim.get_profile("h200-141gb"))
    alloc = CachingAllocator(device, policy, engine=engine)
    live = []
    for i in range(n):
        nbytes = ((i * 5) % 7 + 1) * 2 * MiB   # whole pages: an ordered steal takes only those (Note [No other stream on a deferred chunk])
        ptr = alloc.allocate(nbytes, 0)
        device.launch(0, 0.01, touches=[(ptr, nbytes)])
        live.append(ptr)
        if len(live) > 2:
            alloc.free(live.pop(0))
    alloc.check_consistency()
    backing = alloc._engine.backing if engine == "python" else None   # noqa: SLF001
    before = (backing.before_steals, backing.before_ended) if backing is not None else None
    out = (alloc.snapshot_stats(), alloc._engine._ext.backing_stats() if engine == "native" else None, before)  # noqa: SLF001
    alloc.close()
    assert not device.hazards
    return out


def test_the_steal_before_a_warmup_ends_where_steals_outrun_its_budget():
    """Note [The ordered steal before a warm-up]: every steal made under ``steal_before_warmup`` alone counts against
    its budget, BEFORE_STEAL_BURST and one per BEFORE_STEAL_ALLOCS allocations, and the rule ends for the run where
    they pass it (live, training with its marks off stole ~45 times a step under it and paid a third of its step
    time); a program within it keeps the rule; the policy's own ``stream_ordered_steal`` has no budget; both engines
    alike."""
    from gpumem.allocator.backing import BEFORE_STEAL_ALLOCS, BEFORE_STEAL_BURST

    knobs = dict(page_slack=0.0, page_slack_min_nbytes=0, busy_slack=float("inf"))
    before = dataclasses.replace(DEFAULT, steal_before_warmup=True, **knobs)
    off = dataclasses.replace(DEFAULT, steal_before_warmup=False, **knobs)
    always = dataclasses.replace(DEFAULT, stream_ordered_steal=True, **knobs)
    stats, _, (spent, ended) = _unmarked_busy_program("python", before)
    # the storm passed the budget: the rule ended, at the steal that passed it, and no steal counted after
    assert ended and BEFORE_STEAL_BURST < spent <= BEFORE_STEAL_BURST + stats.num_allocs // BEFORE_STEAL_ALLOCS + 1
    unbudgeted, _, (spent_always, ended_always) = _unmarked_busy_program("python", always)
    assert (spent_always, ended_always) == (0, False)   # the policy's steal is not the before-rule's
    # without the budget the program steals more, holds less, and makes more driver calls
    assert unbudgeted.peak_reserved_nbytes < stats.peak_reserved_nbytes and unbudgeted.device_calls > stats.device_calls
    # a short program stays within the budget: the rule holds all along and saves memory against the knob off
    short, _, (spent_short, ended_short) = _unmarked_busy_program("python", before, n=200)
    assert not ended_short and 0 < spent_short <= BEFORE_STEAL_BURST
    assert short.peak_reserved_nbytes < _unmarked_busy_program("python", off, n=200)[0].peak_reserved_nbytes
    if "native" in ENGINES:
        for policy, n in ((before, 3000), (before, 200), (always, 3000)):
            assert _unmarked_busy_program("native", policy, n)[0] == _unmarked_busy_program("python", policy, n)[0]


@pytest.mark.parametrize(("knob", "default"), [("steal_after_warmup", True), ("steal_before_warmup", True)])
def test_the_steal_knobs_are_bools(knob, default):
    assert getattr(DEFAULT, knob) is default
    for bad in (1, "yes", None):
        with pytest.raises(InvalidArgumentError, match=f"{knob} must be a bool"):
            dataclasses.replace(DEFAULT, **{knob: bad})


@pytest.mark.parametrize("engine", ENGINES)
def test_it_ends_after_many_allocations_with_no_mark(engine):
    """A program that turned the warm-up on (automatic marks) but never marks goes back to its policy."""
    wide = dataclasses.replace(DEFAULT, chunk_max_fraction=1.0)   # a chunk may hold all that is held
    alloc, warm = make(engine, wide), make(engine, wide)
    assert alloc.start_plan_warmup() and warm.start_plan_warmup()
    loop = Loop(alloc)
    for _ in range(WARMUP_ALLOCS // len(LOOP) + 1):   # cache hits after the first steps
        loop.allocations()
    assert warmup(alloc) is False   # past WARMUP_ALLOCS with no mark: over (PlanInfo says so at once)
    assert not alloc.start_plan_warmup()
    assert warmup(warm)
    # from here on it grows by its policy's knobs: chunks of several pages, where the warm-up maps one a page
    calls = []
    for a in (alloc, warm):
        before = a.stats.device_calls
        a.free(a.allocate(900 * MiB))
        calls.append(a.stats.device_calls - before)
    assert calls[0] < 900 // 2 <= calls[1], calls
    for e in loop.live:
        alloc.free(e[0])
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", [dataclasses.replace(DEFAULT, plan_warmup=False), get_policy("pytorch"),
                                    get_policy("expandable"), dataclasses.replace(DEFAULT, growth="pages"),
                                    dataclasses.replace(DEFAULT, steal_empty_pages=False)],
                         ids=["off", "segments", "expandable", "pages", "no-steal"])
def test_policies_without_it_never_begin_it(engine, policy):
    alloc = make(engine, policy)
    assert not alloc.start_plan_warmup()
    loop = Loop(alloc)
    for _ in range(3):
        loop.step()
        assert not warmup(alloc)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("method", ["start_plan_warmup", "stop_plan_warmup"])
def test_a_closed_allocator_refuses_to_start_or_stop_it(engine, method):
    alloc = make(engine)
    alloc.close()
    with pytest.raises(InvalidArgumentError, match=f"{method}: the allocator is closed"):
        getattr(alloc, method)()


@pytest.mark.parametrize("engine", ENGINES)
def test_plan_info_names_it(engine):
    alloc = make(engine)
    info = alloc.step_plan_info()
    assert isinstance(info, PlanInfo) and info.as_dict()["warmup"] == 0
    alloc.start_plan_warmup()
    assert alloc.step_plan_info().as_dict()["warmup"] == 1
    assert "warmup=1" in repr(alloc.step_plan_info())


@pytest.mark.parametrize("engine", ENGINES)
def test_marks_on_a_device_without_virtual_memory_are_refused_and_change_nothing(engine):
    """A plan's arena is an address range of its own: on a device without VMM every third mark raised from deep
    inside the install (new user 11); now the first mark says so, and nothing is recorded."""
    dev = sim.SimDevice(sim.get_profile("jetson-nano-2gb"))
    assert not dev.vmm_supported
    alloc = CachingAllocator(dev, engine=engine)
    ptr = alloc.allocate(3 * MiB)
    before = alloc.step_plan_info()
    with pytest.raises(UnsupportedOperationError, match="virtual memory management"):
        alloc.mark_step()
    assert alloc.step_plan_info() == before and not alloc.start_plan_warmup()
    alloc.free(ptr)
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_stopping_it_gives_the_idle_cache_back_and_a_later_mark_begins_it_again(engine):
    """Automatic marks turned off (an attacker's finding: the warm-up went on for WARMUP_ALLOCS allocations):
    the warm-up stops as if it had not begun, its small chunks go back, and marks by hand may begin it again."""
    alloc = make(engine)
    assert not alloc.stop_plan_warmup()   # not on: nothing to stop
    assert alloc.start_plan_warmup()
    ptrs = [alloc.allocate(3 * MiB) for _ in range(8)]
    keep = ptrs.pop()
    for p in ptrs:
        alloc.free(p)
    held = alloc.memory_stats()["reserved_nbytes"]
    assert alloc.stop_plan_warmup() and not warmup(alloc)
    assert alloc.memory_stats()["reserved_nbytes"] < held   # the idle chunks went back
    assert not alloc.stop_plan_warmup()
    alloc.mark_step()
    assert warmup(alloc)   # not "one warm-up per allocator": this one never ended
    alloc.free(keep)
    alloc.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
def test_stopping_a_warm_up_that_ran_out_of_allocations_ends_it_and_none_begins_again(engine):
    """Past WARMUP_ALLOCS allocations with no mark the warm-up has ended (PlanInfo.warmup says 0), but only the
    slow path ended it: served from the cache, stop_plan_warmup() said it had stopped one under way and a later
    start_plan_warmup() (automatic marks turned off and on again) began a second warm-up."""
    alloc = make(engine)
    assert alloc.start_plan_warmup()
    for _ in range(WARMUP_ALLOCS + 5):
        alloc.free(alloc.allocate(4096))   # cache hits after the first: no slow path
    assert not warmup(alloc)
    assert alloc.stop_plan_warmup() is False
    assert alloc.start_plan_warmup() is False and not warmup(alloc)
    alloc.close()
